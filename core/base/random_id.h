// 128-bit random identifiers from the kernel's CSPRNG, as 32 lowercase hex characters: session
// ids made by the server, and by clients that choose their session's id (and so its routing
// key) before creating it. Header-only so the client library can use it without linking core.
#ifndef SUBSPACE_CORE_BASE_RANDOM_ID_H_
#define SUBSPACE_CORE_BASE_RANDOM_ID_H_

#include <sys/random.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace subspace {

inline absl::StatusOr<std::string> NewRandomHexId() {
  uint8_t bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom failed (errno ", errno, ")"));
    }
    got += static_cast<size_t>(n);
  }
  constexpr char kHex[] = "0123456789abcdef";
  std::string id;
  id.reserve(2 * sizeof(bytes));
  for (uint8_t b : bytes) {
    id += kHex[b >> 4];
    id += kHex[b & 0xF];
  }
  return id;
}

}  // namespace subspace

#endif  // SUBSPACE_CORE_BASE_RANDOM_ID_H_
