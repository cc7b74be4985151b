// Fault injection for the hardening tests: a gate that holds the engine between steps (so a
// test acts while a request is certainly running), a TCP proxy that resets a client's connection
// the way a crash or a network drop does, and calls that send hand-encoded request bytes.
#ifndef SUBSPACE_TESTS_SERVER_FAULT_INJECTION_H_
#define SUBSPACE_TESTS_SERVER_FAULT_INJECTION_H_

#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace subspace::testing {

// Holds the engine thread between steps: on_step runs on it after each step's tokens have been
// handed to the observers, so while the gate is closed a request that has sent its first chunk
// is certainly still running. No sleeps decide what a test sees. Install with
// `config.engine.on_step = [&gate](const StepStats&) { gate.OnStep(); }`.
class EngineGate {
 public:
  void Close() {
    absl::MutexLock lock(&mu_);
    open_ = false;
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }
  void SetStepDelay(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    delay_ = d;
  }
  // Engine thread. Bounded, so a failed test cannot wedge the engine past its end.
  void OnStep() {
    absl::Duration delay;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&open_), kTestWait);
      delay = delay_;
    }
    absl::SleepFor(delay);
  }

 private:
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
  absl::Duration delay_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
};

// A TCP forwarder between a client channel and the server, so a test can cut the client's
// connection the way a crashed client or a dropped network does (TCP reset), which
// ClientContext::TryCancel cannot: the server learns of it only from the transport.
class TcpProxy {
 public:
  explicit TcpProxy(int target_port) : target_port_(target_port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = Loopback(0);
    socklen_t len = sizeof(addr);
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        listen(listen_fd_, 8) != 0 ||
        getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      ADD_FAILURE() << "proxy cannot listen";
      return;
    }
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Run(); });
  }
  ~TcpProxy() { Kill(); }

  int port() const { return port_; }

  // Resets every forwarded connection (SO_LINGER 0: RST, not FIN) and stops listening.
  void Kill() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  static sockaddr_in Loopback(int port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return addr;
  }

  static void Reset(int fd) {
    linger l{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
    close(fd);
  }

  void Run() {
    std::vector<std::pair<int, int>> links;  // {client side, server side}
    while (!stop_) {
      std::vector<pollfd> fds = {{listen_fd_, POLLIN, 0}};
      for (const auto& [a, b] : links) {
        fds.push_back({a, POLLIN, 0});
        fds.push_back({b, POLLIN, 0});
      }
      if (poll(fds.data(), fds.size(), 10) <= 0) continue;
      const size_t polled = links.size();  // fds covers these; a link accepted now waits a turn
      if (fds[0].revents & POLLIN) {
        const int client = accept(listen_fd_, nullptr, nullptr);
        const int upstream = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in addr = Loopback(target_port_);
        if (client >= 0 &&
            connect(upstream, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
          links.emplace_back(client, upstream);
        } else {
          if (client >= 0) close(client);
          close(upstream);
        }
      }
      std::vector<std::pair<int, int>> alive;
      for (size_t i = 0; i < links.size(); ++i) {
        if (i >= polled) {
          alive.push_back(links[i]);
          continue;
        }
        bool open = true;
        for (int side = 0; side < 2 && open; ++side) {
          const pollfd& p = fds[1 + 2 * i + side];
          if (!(p.revents & (POLLIN | POLLHUP | POLLERR))) continue;
          const int from = side == 0 ? links[i].first : links[i].second;
          const int to = side == 0 ? links[i].second : links[i].first;
          char buf[65536];
          const ssize_t n = read(from, buf, sizeof(buf));
          for (ssize_t done = 0; n > 0 && done < n;) {
            const ssize_t w = write(to, buf + done, n - done);
            if (w <= 0) break;
            done += w;
          }
          if (n <= 0) open = false;
        }
        if (open) {
          alive.push_back(links[i]);
        } else {
          close(links[i].first);
          close(links[i].second);
        }
      }
      links = std::move(alive);
    }
    for (const auto& [a, b] : links) {
      Reset(a);
      Reset(b);
    }
    close(listen_fd_);
  }

  const int target_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A unary call of `method` whose request is `bytes` as given, so a test can send what no typed
// stub would encode.
inline grpc::Status RawUnary(const std::shared_ptr<grpc::Channel>& channel,
                             const std::string& method, const std::string& bytes) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kTestWait));
  const grpc::ByteBuffer request = StringToByteBuffer(bytes);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  return done.get_future().get();
}

// A server-streaming call with a hand-made request (on the wire it is a bidi call that writes
// one message): the status and how many messages came back.
inline grpc::Status RawStream(const std::shared_ptr<grpc::Channel>& channel,
                              const std::string& method, const std::string& bytes, int* messages) {
  class Reactor : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    Reactor(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
            const std::string& bytes)
        : stub_(channel), request_(StringToByteBuffer(bytes)) {
      context_.set_deadline(absl::ToChronoTime(absl::Now() + kTestWait));
      stub_.PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
      StartWriteLast(&request_, grpc::WriteOptions());
      StartRead(&response_);
      StartCall();
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;
      ++messages_;
      StartRead(&response_);
    }
    void OnDone(const grpc::Status& s) override { done_.set_value(s); }
    grpc::Status Wait() { return done_.get_future().get(); }
    int messages() const { return messages_; }

   private:
    grpc::GenericStub stub_;
    grpc::ClientContext context_;
    grpc::ByteBuffer request_;
    grpc::ByteBuffer response_;
    int messages_ = 0;
    std::promise<grpc::Status> done_;
  };
  Reactor reactor(channel, method, bytes);
  const grpc::Status status = reactor.Wait();
  *messages = reactor.messages();
  return status;
}

}  // namespace subspace::testing

#endif  // SUBSPACE_TESTS_SERVER_FAULT_INJECTION_H_
