#include "server/connection_probe.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdlib>
#include <string>

namespace subspace::server {
namespace {

// The port and numeric host of a socket address; false for anything but IPv4/IPv6.
bool HostPort(const sockaddr_storage& addr, socklen_t len, std::string* host, int* port) {
  if (addr.ss_family == AF_INET) {
    *port = ntohs(reinterpret_cast<const sockaddr_in&>(addr).sin_port);
  } else if (addr.ss_family == AF_INET6) {
    *port = ntohs(reinterpret_cast<const sockaddr_in6&>(addr).sin6_port);
  } else {
    return false;
  }
  if (host == nullptr) return true;
  char buf[NI_MAXHOST];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, buf, sizeof(buf), nullptr, 0,
                  NI_NUMERICHOST) != 0) {
    return false;
  }
  *host = buf;
  return true;
}

// Whether `fd` is a socket bound to local_port whose peer is remote_addr:remote_port.
bool IsConnection(int fd, int local_port, std::string_view remote_addr, int remote_port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  int port = -1;
  // Not a socket, or not bound to the HTTP port (getsockname fails on other files).
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      !HostPort(addr, len, nullptr, &port) || port != local_port) {
    return false;
  }
  len = sizeof(addr);
  std::string host;
  // The listening socket has no peer; another client's connection has another.
  return getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 &&
         HostPort(addr, len, &host, &port) && port == remote_port && host == remote_addr;
}

}  // namespace

int FindConnectionSocket(int local_port, std::string_view remote_addr, int remote_port) {
  // A keep-alive connection brings its next requests to the same thread (cpp-httplib serves a
  // connection on one thread until it closes): the last answer, checked again, is the first try.
  thread_local int last = -1;
  if (last >= 0 && IsConnection(last, local_port, remote_addr, remote_port)) return last;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    if (IsConnection(static_cast<int>(fd), local_port, remote_addr, remote_port)) {
      found = static_cast<int>(fd);
      break;
    }
  }
  closedir(dir);
  last = found;
  return found;
}

bool PeerHungUp(int fd) {
  pollfd p{.fd = fd, .events = POLLRDHUP, .revents = 0};
  if (poll(&p, 1, 0) < 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace subspace::server
