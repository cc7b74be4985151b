// Helpers for the server integration tests: a real ServerApp on a tiny random model listening
// on port 0, a stub for it, and raw clients for what has no generated stub here -- the health
// and reflection services (over gRPC's generic stub, hand-encoded protobuf) and /metrics (HTTP).
#ifndef SUBSPACE_TESTS_SERVER_SERVER_TEST_UTIL_H_
#define SUBSPACE_TESTS_SERVER_SERVER_TEST_UTIL_H_

#include <arpa/inet.h>
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "server/server_app.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace::testing {

inline constexpr absl::Duration kTestWait = absl::Seconds(60);

// Writes the tiny model (context 256) once per process and returns its path; the file is
// removed when the process exits.
inline const std::string& TinyModelPath() {
  struct TempFile {
    TempFile() : path(absl::StrCat(::testing::TempDir(), "/subspace_tiny_", getpid(), ".gguf")) {
      TinyModelOptions options;
      options.context = 256;
      std::ofstream out(path, std::ios::binary);
      out << BuildTinyLlamaGguf(options);
    }
    ~TempFile() { std::remove(path.c_str()); }
    std::string path;
  };
  static const TempFile file;
  return file.path;
}

inline server::ServerAppConfig TestServerConfig() {
  server::ServerAppConfig c;
  c.model_path = TinyModelPath();
  c.host = "127.0.0.1";
  c.port = 0;
  c.metrics_port = -1;  // stopping civetweb takes ~2 s; tests that scrape turn it on
  c.kv_cache_bytes = 4 << 20;
  c.block_size = 8;
  c.engine.max_running = 16;
  c.engine.max_batch_tokens = 256;
  c.drain_timeout = absl::Seconds(30);
  return c;
}

inline std::shared_ptr<grpc::Channel> ChannelTo(int port) {
  return grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
}

// CreateSession asking for online refresh `method` every `every_tokens` (0: the server's T).
inline grpc::Status CreateRefreshingSession(v1::Subspace::Stub& stub, const std::string& method,
                                            uint32_t every_tokens, v1::Session* out) {
  grpc::ClientContext context;
  v1::CreateSessionRequest request;
  request.mutable_refresh()->set_method(method);
  request.mutable_refresh()->set_every_tokens(every_tokens);
  return stub.CreateSession(&context, request, out);
}

inline std::string ByteBufferToString(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

inline grpc::ByteBuffer StringToByteBuffer(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

// Protobuf length-delimited field `number` holding `payload`, for fields numbered below 16.
inline std::string LengthDelimitedField(int number, const std::string& payload) {
  std::string out(1, static_cast<char>((number << 3) | 2));
  size_t n = payload.size();
  do {
    unsigned char byte = n & 0x7F;
    n >>= 7;
    if (n != 0) byte |= 0x80;
    out.push_back(static_cast<char>(byte));
  } while (n != 0);
  return out + payload;
}

// grpc.health.v1.Health/Check for `service` ("" is the whole server): the ServingStatus number
// (1 SERVING, 2 NOT_SERVING) or the call's error.
inline absl::StatusOr<int> HealthCheck(const std::shared_ptr<grpc::Channel>& channel,
                                       const std::string& service = "") {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const grpc::ByteBuffer request =
      StringToByteBuffer(service.empty() ? "" : LengthDelimitedField(1, service));
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  const grpc::Status status = done.get_future().get();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  google::protobuf::UnknownFieldSet fields;
  if (!fields.ParseFromString(ByteBufferToString(response))) {
    return absl::InternalError("unparsable HealthCheckResponse");
  }
  for (int i = 0; i < fields.field_count(); ++i) {
    if (fields.field(i).number() == 1) return static_cast<int>(fields.field(i).varint());
  }
  return 0;  // UNKNOWN, the proto3 default, is not on the wire
}

// Service names listed by grpc.reflection.v1alpha.ServerReflection (list_services = "*").
inline absl::StatusOr<std::vector<std::string>> ReflectionListServices(
    const std::shared_ptr<grpc::Channel>& channel) {
  class Reactor : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit Reactor(const std::shared_ptr<grpc::Channel>& channel) : stub_(channel) {
      context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      request_ = StringToByteBuffer(LengthDelimitedField(7, "*"));  // list_services
      stub_.PrepareBidiStreamingCall(
          &context_, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
          grpc::StubOptions(), this);
      StartWrite(&request_);
      StartRead(&response_);
      StartCall();
    }
    void OnWriteDone(bool ok) override {
      if (ok) StartWritesDone();
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;
      responses_.push_back(ByteBufferToString(response_));
      StartRead(&response_);
    }
    void OnDone(const grpc::Status& s) override { done_.set_value(s); }

    grpc::Status Wait() { return done_.get_future().get(); }
    const std::vector<std::string>& responses() const { return responses_; }

   private:
    grpc::GenericStub stub_;
    grpc::ClientContext context_;
    grpc::ByteBuffer request_;
    grpc::ByteBuffer response_;
    std::vector<std::string> responses_;
    std::promise<grpc::Status> done_;
  };
  Reactor reactor(channel);
  const grpc::Status status = reactor.Wait();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  std::vector<std::string> names;
  // ServerReflectionResponse.list_services_response (6) -> ListServiceResponse.service (1)
  // -> ServiceResponse.name (1).
  const auto length_delimited = [](const std::string& bytes, int number) {
    std::vector<std::string> out;
    google::protobuf::UnknownFieldSet fields;
    if (!fields.ParseFromString(bytes)) return out;
    for (int i = 0; i < fields.field_count(); ++i) {
      const google::protobuf::UnknownField& f = fields.field(i);
      if (f.number() == number &&
          f.type() == google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) {
        out.push_back(f.length_delimited());
      }
    }
    return out;
  };
  for (const std::string& response : reactor.responses()) {
    for (const std::string& list : length_delimited(response, 6)) {
      for (const std::string& service : length_delimited(list, 1)) {
        for (const std::string& name : length_delimited(service, 1)) names.push_back(name);
      }
    }
  }
  return names;
}

// A TCP connection to 127.0.0.1:port, or -1.
inline int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// GET http://127.0.0.1:port/path with HTTP/1.0: {status line, body}.
inline absl::StatusOr<std::pair<std::string, std::string>> HttpGet(int port,
                                                                   const std::string& path) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot connect to port ", port));
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::InternalError("send failed");
  }
  std::string response;
  char buf[65536];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) response.append(buf, n);
  close(fd);
  const size_t header_end = response.find("\r\n\r\n");
  if (header_end == std::string::npos) return absl::InternalError("no HTTP header end");
  return std::make_pair(response.substr(0, response.find("\r\n")), response.substr(header_end + 4));
}

// The effective compression ratio GetCacheStats should report, from the stats themselves:
// full-rank fp16 bytes of the cached tokens over the pool bytes in use (0 when empty).
inline double ExpectedCompressionRatio(const v1::CacheStats& stats, const v1::ModelInfo& model) {
  const double used = static_cast<double>(stats.bytes_used_full() + stats.bytes_used_compressed() +
                                          stats.bytes_used_outlier());
  if (stats.tokens_cached() == 0 || used == 0) return 0.0;
  const double fp16_bytes = static_cast<double>(stats.tokens_cached()) * model.layers() * 2 *
                            model.kv_heads() * model.head_dim() * 2;
  return fp16_bytes / used;
}

// The value of the sample `series` (name and labels exactly as exposed) in a Prometheus text
// body, or NOT_FOUND.
inline absl::StatusOr<double> MetricValue(const std::string& body, const std::string& series) {
  const std::string prefix = series + " ";
  for (size_t at = 0; at < body.size();) {
    const size_t end = std::min(body.find('\n', at), body.size());
    if (body.compare(at, prefix.size(), prefix) == 0) {
      double value = 0;
      if (absl::SimpleAtod(body.substr(at + prefix.size(), end - at - prefix.size()), &value)) {
        return value;
      }
    }
    at = end + 1;
  }
  return absl::NotFoundError(absl::StrCat("no sample ", series));
}

// Polls `condition` until it holds or kTestWait passes.
inline bool WaitFor(const std::function<bool()>& condition) {
  const absl::Time deadline = absl::Now() + kTestWait;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return condition();
}

}  // namespace subspace::testing

#endif  // SUBSPACE_TESTS_SERVER_SERVER_TEST_UTIL_H_
