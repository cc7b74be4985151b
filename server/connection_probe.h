// Whether an HTTP client is still there while its request is being served. cpp-httplib 0.11.4
// (Debian 12's) gives a handler no handle on its connection, and newer versions'
// Request::is_connection_closed does what PeerHungUp does here; so the handler finds its
// connection's socket by address (FindConnectionSocket) and asks the kernel about it.
#ifndef SUBSPACE_SERVER_CONNECTION_PROBE_H_
#define SUBSPACE_SERVER_CONNECTION_PROBE_H_

#include <string_view>

namespace subspace::server {

// The file descriptor of this process's connected TCP socket whose local port is `local_port`
// and whose peer is remote_addr:remote_port (numeric, as cpp-httplib's Request::remote_addr
// writes it), or -1 when there is none. A connection is one socket while it is open, so the
// answer is exact for as long as the caller's request holds the connection. It costs a pass
// over /proc/self/fd, once per connection: the thread's last answer is checked first (two
// syscalls), which a keep-alive connection's next request on the same thread finds again.
int FindConnectionSocket(int local_port, std::string_view remote_addr, int remote_port);

// True once the peer of connected socket `fd` has closed its side (FIN: a client that hung up
// or half-closed, which cpp-httplib treats alike) or the connection broke (RST, error). Never
// blocks and reads nothing, so pipelined bytes of a next request stay where they are.
bool PeerHungUp(int fd);

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_CONNECTION_PROBE_H_
