// A small synchronous C++ client for the subspace.v1.Subspace gRPC service and the standard
// grpc.health.v1 check: one method per RPC, absl::Status errors carrying the gRPC code, per-call
// deadlines, the `x-session-id` request header that session-affine proxies route on, TLS (and
// mutual TLS) and a bearer token. Thread-safe: one client may serve many threads.
#ifndef SUBSPACE_CLIENT_SUBSPACE_CLIENT_H_
#define SUBSPACE_CLIENT_SUBSPACE_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"
#include "proto/subspace.grpc.pb.h"

namespace subspace::client {

namespace v1 = ::subspace::v1;
namespace health_v1 = ::grpc::health::v1;
using ServingStatus = health_v1::HealthCheckResponse::ServingStatus;

// The metadata key carrying the session id of a call, so proxies can route without parsing the
// body. Set on every call that names a session.
inline constexpr char kSessionIdHeader[] = "x-session-id";

// TLS settings of the channel, as PEM text (LoadClientTls reads them from files).
struct ClientTls {
  std::string root_certs;   // CAs that may sign the server's certificate; empty: gRPC's defaults
  std::string cert_chain;   // for mutual TLS: the client's certificate chain, with private_key
  std::string private_key;  // for mutual TLS
};

struct ClientOptions {
  std::string server = "localhost:50051";  // host:port, or any gRPC target URI
  // Deadline of each call, from its start; InfiniteDuration() for none.
  absl::Duration timeout = absl::InfiniteDuration();
  // Queue calls while the channel connects instead of failing fast with UNAVAILABLE (useful
  // right after starting a server); the deadline still applies.
  bool wait_for_ready = false;
  // Unset: a plaintext channel.
  std::optional<ClientTls> tls;
  // Sent on every call as `authorization: Bearer <token>` when not empty.
  std::string auth_token;
};

// Reads the PEM files of a TLS channel: `ca_path` (empty: gRPC's default roots) and, for mutual
// TLS, `cert_path` with `key_path` (both or neither). INVALID_ARGUMENT naming the flag
// (--tls-ca, --tls-cert, --tls-key) for a file that cannot be read or a lone cert or key.
absl::StatusOr<ClientTls> LoadClientTls(const std::string& ca_path, const std::string& cert_path,
                                        const std::string& key_path);

// The channel credentials `options` ask for: TLS when options.tls is set, else insecure.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const ClientOptions& options);

// What a finished stream returned besides its chunks.
struct StreamResult {
  std::string request_id;
  v1::StreamFinal final;
};

// Called for each chunk message (`message.chunk()` is set) as it arrives; return false to
// cancel the stream (Stream() then returns CANCELLED). Runs on the calling thread.
using ChunkCallback = std::function<bool(const v1::GenerateStreamResponse& message)>;

// A fresh session id: 128 bits from the OS CSPRNG (getrandom) as 32 lowercase hex digits, the
// same form as the ids the server makes.
absl::StatusOr<std::string> NewSessionId();

// Converts a gRPC status to the absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

class SubspaceClient {
 public:
  // Opens a channel to options.server, TLS when options.tls is set (connection happens lazily,
  // on the first call).
  explicit SubspaceClient(const ClientOptions& options);
  // Uses an existing channel, e.g. an in-process one in tests.
  SubspaceClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options);

  SubspaceClient(const SubspaceClient&) = delete;
  SubspaceClient& operator=(const SubspaceClient&) = delete;

  absl::StatusOr<v1::GenerateResponse> Generate(const v1::GenerateRequest& request);
  // Streams a generation: `on_chunk` sees each chunk in order, and the final message is
  // returned. A stream that ends without its final message is a DATA_LOSS error.
  absl::StatusOr<StreamResult> Stream(const v1::GenerateRequest& request,
                                      const ChunkCallback& on_chunk);
  // The same for a conversation rendered with the model's chat template.
  absl::StatusOr<v1::GenerateResponse> Chat(const v1::ChatRequest& request);
  absl::StatusOr<StreamResult> ChatStream(const v1::ChatRequest& request,
                                          const ChunkCallback& on_chunk);

  // idle_ttl_seconds = 0 takes the server's default. The session's id is made here
  // (NewSessionId()) unless `session_id` is given, and is sent both in the request and as the
  // `x-session-id` header, so a session-affine proxy sends the create and every later call of
  // the session to the same replica. A given id must follow the server's rule (32 to 64
  // characters from [A-Za-z0-9_-]) and should hold at least 128 random bits: it is the
  // capability to use the session. ALREADY_EXISTS when a live session has it. `refresh`: the
  // session's online basis refresh (unset: the server's --refresh-* flags).
  absl::StatusOr<v1::Session> CreateSession(
      uint32_t idle_ttl_seconds = 0, const std::string& session_id = "",
      const std::optional<v1::BasisRefresh>& refresh = std::nullopt);
  absl::StatusOr<v1::Session> GetSession(const std::string& session_id);
  absl::StatusOr<std::vector<v1::Session>> ListSessions();
  absl::Status DeleteSession(const std::string& session_id);
  // A session's snapshot (docs/sessions.md), and a session made from one. To move a session:
  // export it from its replica, import it (with its id, for the affinity header) where its
  // calls will go, then delete it at the source.
  absl::StatusOr<std::string> ExportSession(const std::string& session_id);
  absl::StatusOr<v1::Session> ImportSession(const std::string& session_id,
                                            const std::string& snapshot);

  absl::StatusOr<v1::ModelInfo> GetModelInfo();
  absl::StatusOr<v1::CacheStats> GetCacheStats();

  // grpc.health.v1.Health/Check of `service` ("" is the whole server). A service the server
  // does not know (Check answers NOT_FOUND) is returned as SERVICE_UNKNOWN, so every answer is
  // a status; not reaching the server stays an error (UNAVAILABLE, DEADLINE_EXCEEDED).
  absl::StatusOr<ServingStatus> Health(const std::string& service = "");

  const ClientOptions& options() const { return options_; }

 private:
  // Applies the deadline, wait-for-ready, the bearer token and (when non-empty) the session
  // header.
  void Prepare(grpc::ClientContext& context, const std::string& session_id) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Subspace::Stub> stub_;
  std::unique_ptr<health_v1::Health::Stub> health_stub_;
};

}  // namespace subspace::client

#endif  // SUBSPACE_CLIENT_SUBSPACE_CLIENT_H_
