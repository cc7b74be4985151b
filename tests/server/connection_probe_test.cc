// connection_probe.h on real loopback connections: the socket found by its addresses is the
// server's end of that connection, and a peer's hang-up (FIN or RST) is seen at once while
// unread pipelined bytes are not taken for one.
#include "server/connection_probe.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"

namespace subspace::server {
namespace {

struct Loopback {
  int listener = -1, client = -1, server = -1;
  int port = 0, client_port = 0;
  ~Loopback() {
    for (int fd : {listener, client, server}) {
      if (fd >= 0) close(fd);
    }
  }
};

int PortOf(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return ntohs(addr.sin_port);
}

void Connect(Loopback* l) {
  l->listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(l->listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(l->listener, 4), 0);
  l->port = PortOf(l->listener);
  addr.sin_port = htons(static_cast<uint16_t>(l->port));
  l->client = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(connect(l->client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  l->server = accept(l->listener, nullptr, nullptr);
  ASSERT_GE(l->server, 0);
  l->client_port = PortOf(l->client);
}

TEST(ConnectionProbeTest, FindsTheServersEndOfAConnection) {
  Loopback a, b;
  Connect(&a);
  Connect(&b);
  EXPECT_EQ(FindConnectionSocket(a.port, "127.0.0.1", a.client_port), a.server);
  EXPECT_EQ(FindConnectionSocket(b.port, "127.0.0.1", b.client_port), b.server);
  // Another client's port, another host, another local port: none.
  EXPECT_EQ(FindConnectionSocket(a.port, "127.0.0.1", b.client_port), -1);
  EXPECT_EQ(FindConnectionSocket(a.port, "127.0.0.2", a.client_port), -1);
  EXPECT_EQ(FindConnectionSocket(b.port, "127.0.0.1", a.client_port), -1);
  // Asked again (the thread's last answer is tried first): still each its own.
  EXPECT_EQ(FindConnectionSocket(a.port, "127.0.0.1", a.client_port), a.server);
  EXPECT_EQ(FindConnectionSocket(a.port, "127.0.0.1", a.client_port), a.server);
  EXPECT_EQ(FindConnectionSocket(b.port, "127.0.0.1", b.client_port), b.server);
}

TEST(ConnectionProbeTest, AClosedConnectionIsNotFoundAgain) {
  int server_fd = -1, client_port = 0, port = 0;
  {
    Loopback l;
    Connect(&l);
    ASSERT_EQ(FindConnectionSocket(l.port, "127.0.0.1", l.client_port), l.server);
    server_fd = l.server;
    client_port = l.client_port;
    port = l.port;
  }  // every socket of it closed
  Loopback other;
  Connect(&other);  // may reuse the closed descriptors' numbers
  EXPECT_EQ(FindConnectionSocket(port, "127.0.0.1", client_port), -1) << "was fd " << server_fd;
  EXPECT_EQ(FindConnectionSocket(other.port, "127.0.0.1", other.client_port), other.server);
}

TEST(ConnectionProbeTest, SeesAHangUpButNotPendingBytes) {
  Loopback l;
  Connect(&l);
  EXPECT_FALSE(PeerHungUp(l.server));
  const std::string next = "GET /health HTTP/1.1\r\n\r\n";  // a pipelined request, unread
  ASSERT_EQ(send(l.client, next.data(), next.size(), 0), static_cast<ssize_t>(next.size()));
  EXPECT_FALSE(PeerHungUp(l.server));
  close(l.client);
  l.client = -1;
  EXPECT_TRUE(PeerHungUp(l.server));
  // Nothing was read: the bytes are still there for the server.
  char buf[64];
  EXPECT_EQ(recv(l.server, buf, sizeof(buf), 0), static_cast<ssize_t>(next.size()));
}

TEST(ConnectionProbeTest, SeesAHalfClose) {
  Loopback l;
  Connect(&l);
  ASSERT_EQ(shutdown(l.client, SHUT_WR), 0);
  EXPECT_TRUE(PeerHungUp(l.server));
}

}  // namespace
}  // namespace subspace::server
