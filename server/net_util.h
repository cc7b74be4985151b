// Address formatting shared by the gRPC listener and the metrics endpoint.
#ifndef SUBSPACE_SERVER_NET_UTIL_H_
#define SUBSPACE_SERVER_NET_UTIL_H_

#include <string>

#include "absl/strings/str_cat.h"

namespace subspace::server {

// "host:port", with brackets around an IPv6 host ("[::]:50051").
inline std::string JoinHostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_NET_UTIL_H_
