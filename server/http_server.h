// The OpenAI-compatible HTTP/1.1 API beside gRPC, in the same process and on the same engine
// (shared admission, queue and sessions): GET /v1/models, POST /v1/completions and
// /v1/chat/completions (streamed as server-sent events when asked), the session extension
// (POST /v1/sessions, GET and DELETE /v1/sessions/{id}), GET /health and GET /metrics. Bodies are
// parsed and written by openai_api.h; requests take the gRPC API's path from the wire message on
// (prepare_request.h), so both APIs validate, render chat and report errors alike. The same
// bearer tokens and TLS files as gRPC. docs/http_api.md is the user's page.
//
// HTTP is cpp-httplib's (Debian's libcpp-httplib-dev): a thread per connection from a fixed pool,
// which suits a server whose requests wait on one engine thread anyway.
#ifndef SUBSPACE_SERVER_HTTP_SERVER_H_
#define SUBSPACE_SERVER_HTTP_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/engine/session_snapshot.h"
#include "server/auth.h"
#include "server/chat_request.h"
#include "server/metrics.h"
#include "server/request_validation.h"
#include "server/tls.h"

namespace subspace::server {

struct HttpServerConfig {
  std::string host = "0.0.0.0";
  int port = 8080;  // 0: pick a free port (HttpServer::port)
  TlsConfig tls;    // HTTPS when a certificate is set; a client CA asks for client certificates
  int64_t max_body_bytes = 4 << 20;  // larger bodies get 413
  int threads = 64;                  // connections served at once; more wait for a free thread
  // A client that stalls sending its request, or stops reading the answer, for this long is
  // disconnected; a stream's engine request is cancelled with it.
  absl::Duration io_timeout = absl::Seconds(30);
  absl::Duration keep_alive = absl::Seconds(5);  // an idle keep-alive connection is closed
};

class HttpServer {
 public:
  // Listening when this returns; every API call is 503 until AttachEngine. UNAVAILABLE when the
  // address cannot be bound, INVALID_ARGUMENT for TLS files the library refuses. `metrics` must
  // outlive the server.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerConfig config,
                                                           Metrics* metrics, RequestLimits limits,
                                                           Authenticator auth);
  ~HttpServer();  // Stop()

  int port() const;
  // Starts serving with `engine`, which must outlive Stop(). `model_id` is the id the API lists
  // and requests must name; `snapshot` the model identity session snapshots carry. Call once.
  void AttachEngine(Engine* engine, ChatSetup chat, std::string model_id,
                    SnapshotIdentity snapshot);
  // New generation and session requests get 503; running ones continue; /health says draining.
  void BeginDrain();
  // BeginDrain; waits up to `grace` for running requests to be answered, cancels the rest,
  // closes every connection and joins the server's threads. Idempotent.
  void Stop(absl::Duration grace = absl::ZeroDuration());

  class Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_HTTP_SERVER_H_
