// Everything a running server is made of, built in order: the gRPC server (Subspace, health,
// reflection) listening first with health NOT_SERVING, the metrics exporter, then the model,
// tokenizer, KV cache and engine; health turns SERVING once the engine is attached. main() and
// the integration tests both start servers through this class.
#ifndef SUBSPACE_SERVER_SERVER_APP_H_
#define SUBSPACE_SERVER_SERVER_APP_H_

#include <grpcpp/server.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/engine/session_snapshot.h"
#include "runtime/backend.h"
#include "runtime/kv_cache_options.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/request_validation.h"
#include "server/service.h"
#include "server/session_persistence.h"
#include "server/tls.h"

namespace subspace::server {

struct ServerAppConfig {
  std::string model_path;
  std::string host = "0.0.0.0";
  int port = 50051;         // 0: pick a free port (see ServerApp::port)
  int metrics_port = 9090;  // 0: pick a free port; negative: no metrics endpoint
  // The OpenAI-compatible HTTP API (server/http_server.h): 0 picks a free port, negative turns it
  // off (main's --http-port defaults to 8080). Host, TLS files and tokens are gRPC's.
  int http_port = -1;
  int http_threads = 64;  // HTTP connections served at once
  std::string model_id;   // the id the HTTP API lists and requests name; empty: the model
                          // file's name without .gguf
  int64_t kv_cache_bytes = int64_t{256} << 20;
  int block_size = 16;
  runtime::Device device =
      runtime::Device::kCpu;         // --device: cpu, cuda or auto (runtime/backend.h)
  double gpu_memory_fraction = 0.0;  // CUDA: > 0 sizes the KV pool from device memory
  bool cuda_graphs = false;          // CUDA: decode steps replayed as graphs
  runtime::KvCacheOptions kv_cache;  // full or compressed, and the compressed cache's policy
  EngineConfig engine;               // on_step, if set, runs after the metrics hook (engine thread)
  absl::Duration drain_timeout = absl::Seconds(30);
  int max_message_bytes = 4 << 20;  // largest request accepted
  RequestLimits limits;
  TlsConfig tls;                     // plaintext unless a certificate is set
  std::string auth_tokens_path;      // bearer tokens, one per line (server/auth.h); empty: no auth
  std::string operator_tokens_path;  // operator tokens (auth.h); needs auth_tokens_path
  std::string chat_template_path;    // --chat-template: overrides the GGUF's chat template
  // --session-dir: Shutdown writes every live session there and Start restores (and removes)
  // the snapshots it finds (docs/sessions.md); empty: sessions end with the process.
  std::string session_dir;
  // Session tiers (docs/sessions.md, "Tiers"): idle sessions' caches the pool needs go to host
  // memory, then (with a session_dir) to disk in session_dir/tier; 0 turns a tier off.
  int64_t session_host_bytes = int64_t{512} << 20;
  int64_t session_disk_bytes = int64_t{4} << 30;
  // With a session_dir: how often the sessions used since the last checkpoint are written while
  // serving, so that a killed process loses at most that much (zero: at drain only).
  absl::Duration session_checkpoint_interval = absl::Seconds(30);
};

class ServerApp {
 public:
  // Returns once the model is loaded and the server answers (health SERVING). Errors: whatever
  // loading the model gives, INVALID_ARGUMENT for a bad config (a cache rank above the model's
  // head_dim included, and TLS files or a tokens file that cannot be used), UNAVAILABLE when a
  // port cannot be bound.
  static absl::StatusOr<std::unique_ptr<ServerApp>> Start(ServerAppConfig config);
  ~ServerApp();  // Shutdown()

  int port() const { return port_; }
  // The bound metrics port, or -1 when metrics are off.
  int metrics_port() const { return metrics_ ? metrics_->port() : -1; }
  // The bound HTTP API port, or -1 when it is off.
  int http_port() const;
  Engine& engine() { return *engine_; }

  // Health NOT_SERVING and new Generate calls UNAVAILABLE; in-flight requests continue.
  void BeginDrain();
  // BeginDrain, then waits up to the drain timeout for in-flight and queued requests, then
  // stops the gRPC server (cancelling what is left) and the metrics endpoint, then writes every
  // session to the session directory when there is one. Idempotent.
  // True when every request finished within the drain timeout.
  bool Shutdown();

 private:
  explicit ServerApp(ServerAppConfig config);
  absl::Status Init();
  void SetServing(bool serving);

  ServerAppConfig config_;
  int port_ = 0;
  // Destruction runs bottom-up: the exporter and gRPC server stop before the engine goes.
  std::unique_ptr<Metrics> metrics_registry_;
  std::unique_ptr<Engine> engine_;
  // --session-dir (its checkpoint thread stops before the engine goes).
  std::unique_ptr<SessionPersistence> persistence_;
  std::unique_ptr<SubspaceService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HttpServer> http_;
  std::unique_ptr<MetricsExporter> metrics_;
  SnapshotIdentity snapshot_identity_;

  // std::mutex rather than absl::Mutex: ThreadSanitizer sees through it (scripts/sanitize.sh).
  std::mutex shutdown_mu_;
  bool shut_down_ = false;  // guarded by shutdown_mu_
  bool drained_ = true;     // guarded by shutdown_mu_
};

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_SERVER_APP_H_
