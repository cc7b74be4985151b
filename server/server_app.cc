// Start-up and shutdown order of the server; see server_app.h.
#include "server/server_app.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/compress/basis.h"
#include "core/compress/basis_file.h"
#include "core/compress/codec_file.h"
#include "core/gguf/gguf.h"
#include "core/model/model.h"
#include "core/model/model_file.h"
#include "core/tokenizer/tokenizer.h"
#include "runtime/codec_calibration.h"
#include "server/auth.h"
#include "server/net_util.h"
#include "server/session_persistence.h"
#include "spdlog/spdlog.h"

namespace subspace::server {
namespace {

constexpr char kServiceName[] = "subspace.v1.Subspace";

// Both are process-wide switches read when a server is built, and neither is thread-safe.
void EnableServerPlugins() {
  static absl::once_flag once;
  absl::call_once(once, [] {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  });
}

const char* TransportName(const TlsConfig& tls) {
  if (!TlsEnabled(tls)) return "plaintext";
  return tls.client_ca_path.empty() ? "TLS" : "mutual TLS";
}

absl::Status ValidateConfig(const ServerAppConfig& c) {
  if (c.model_path.empty()) return absl::InvalidArgumentError("--model must be set");
  if (c.port < 0 || c.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--port must be in [0, 65535], got ", c.port));
  }
  if (c.http_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-port must be at most 65535, got ", c.http_port));
  }
  if (c.http_port >= 0 && c.http_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-threads must be >= 1, got ", c.http_threads));
  }
  if (c.metrics_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-port must be at most 65535, got ", c.metrics_port));
  }
  if (c.kv_cache_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-bytes must be > 0, got ", c.kv_cache_bytes));
  }
  if (c.block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--block-size must be > 0, got ", c.block_size));
  }
  if (c.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-message-bytes must be > 0, got ", c.max_message_bytes));
  }
  if (c.drain_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--drain-seconds must be >= 0");
  }
  const EngineConfig& e = c.engine;
  if (e.max_running <= 0 || e.max_batch_tokens <= 0 || e.max_queue < 0 || e.max_sessions < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-running and --max-batch-tokens must be > 0, --max-queue and --max-sessions >= 0; "
        "got ",
        e.max_running, ", ", e.max_batch_tokens, ", ", e.max_queue, ", ", e.max_sessions));
  }
  if (e.prompt_cache_entries < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prompt-cache-entries must be >= 0, got ", e.prompt_cache_entries));
  }
  if (e.default_session_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--session-ttl-seconds must be > 0");
  }
  return runtime::ValidateKvCacheOptions(c.kv_cache, c.block_size);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerApp>> ServerApp::Start(ServerAppConfig config) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  std::unique_ptr<ServerApp> app(new ServerApp(std::move(config)));
  if (absl::Status s = app->Init(); !s.ok()) return s;  // ~ServerApp stops what started
  return app;
}

ServerApp::ServerApp(ServerAppConfig config) : config_(std::move(config)) {}

ServerApp::~ServerApp() { Shutdown(); }

absl::Status ServerApp::Init() {
  // Credentials first: a bad certificate or tokens file stops the server before it listens.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      BuildServerCredentials(config_.tls);
  if (!credentials.ok()) return credentials.status();
  Authenticator auth;
  if (!config_.operator_tokens_path.empty() && config_.auth_tokens_path.empty()) {
    return absl::InvalidArgumentError(
        "--operator-tokens needs --auth-tokens: without authentication every call is the same "
        "anonymous principal, which already sees every session");
  }
  if (!config_.auth_tokens_path.empty()) {
    absl::StatusOr<Authenticator> loaded =
        Authenticator::FromFiles(config_.auth_tokens_path, config_.operator_tokens_path);
    if (!loaded.ok()) return loaded.status();
    auth = *std::move(loaded);
  }
  const bool authenticates = auth.enabled();
  if (authenticates && !TlsEnabled(config_.tls)) {
    spdlog::warn("--auth-tokens without --tls-cert: bearer tokens cross the network in clear text");
  }
  metrics_registry_ = std::make_unique<Metrics>();
  service_ = std::make_unique<SubspaceService>(metrics_registry_.get(), config_.limits, auth);

  // Listen before loading, so orchestrators see a live process that is NOT_SERVING yet.
  EnableServerPlugins();
  const std::string address = JoinHostPort(config_.host, config_.port);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, *credentials, &port_);
  builder.RegisterService(service_.get());
  builder.SetMaxReceiveMessageSize(config_.max_message_bytes);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  SetServing(false);
  spdlog::info("listening on {} (port {}), {}{}", address, port_, TransportName(config_.tls),
               authenticates ? ", bearer tokens required" : "");

  if (config_.http_port >= 0) {
    absl::StatusOr<std::unique_ptr<HttpServer>> http =
        HttpServer::Start({.host = config_.host,
                           .port = config_.http_port,
                           .tls = config_.tls,
                           .max_body_bytes = config_.max_message_bytes,
                           .threads = config_.http_threads},
                          metrics_registry_.get(), config_.limits, std::move(auth));
    if (!http.ok()) return http.status();
    http_ = *std::move(http);
    spdlog::info("OpenAI-compatible HTTP API on {}://{}/v1",
                 TlsEnabled(config_.tls) ? "https" : "http",
                 JoinHostPort(config_.host, http_->port()));
  }

  if (config_.metrics_port >= 0) {
    absl::StatusOr<std::unique_ptr<MetricsExporter>> exporter =
        MetricsExporter::Start(config_.host, config_.metrics_port, *metrics_registry_);
    if (!exporter.ok()) return exporter.status();
    metrics_ = *std::move(exporter);
    spdlog::info("metrics on http://{}/metrics", JoinHostPort(config_.host, metrics_->port()));
  }

  const absl::Time load_start = absl::Now();
  absl::StatusOr<ModelFile> files = OpenModelFile(config_.model_path);
  if (!files.ok()) return files.status();
  const std::shared_ptr<const GgufFile> gguf = files->gguf;
  const ModelConfig model_config = files->model->config();
  absl::StatusOr<ChatSetup> chat = LoadChatSetup(config_.chat_template_path, *gguf);
  if (!chat.ok()) return chat.status();
  if (chat->chat_template == nullptr) {
    spdlog::warn("Chat is unavailable: {}", std::string(chat->unavailable.message()));
  } else {
    spdlog::info("chat template from {}",
                 chat->source == "file" ? config_.chat_template_path : "the model's GGUF");
  }

  std::shared_ptr<const Basis> bases;
  if (!config_.kv_cache.bases_path.empty()) {
    absl::StatusOr<std::shared_ptr<const Basis>> loaded =
        runtime::LoadBases(config_.kv_cache.bases_path, *gguf, model_config.cache_geometry());
    if (!loaded.ok()) return loaded.status();
    bases = *std::move(loaded);
    spdlog::info("basis file {} loaded; it becomes the compressed cache's default epoch",
                 config_.kv_cache.bases_path);
  }
  // Refused now rather than after the codec is fitted.
  if (absl::Status s = runtime::CheckCacheRunsOn(config_.device, config_.kv_cache); !s.ok()) {
    return s;
  }
  std::shared_ptr<const CodecFile> codec;
  if (!config_.kv_cache.codec_path.empty()) {
    absl::StatusOr<std::shared_ptr<const CodecFile>> loaded =
        runtime::LoadCodec(config_.kv_cache.codec_path, *gguf, model_config.cache_geometry());
    if (!loaded.ok()) return loaded.status();
    codec = *std::move(loaded);
    spdlog::info("codec file {} loaded: {} / {} bits per key / value element{}",
                 config_.kv_cache.codec_path, codec->info.key_bits, codec->info.value_bits,
                 codec->info.pre_rope_keys ? " (pre-RoPE keys)" : "");
  } else if (config_.kv_cache.kv_budget > 0.0) {
    const runtime::KvCacheOptions& o = config_.kv_cache;
    const absl::Time fit_start = absl::Now();
    // Without text, the model writes its own (scored as held-out text on the long-context
    // suite: docs/transform_codec.md).
    absl::StatusOr<std::vector<int32_t>> tokens = runtime::CalibrationTokens(
        o.calib_text_path, *files->model, *files->tokenizer, o.calib_tokens, /*window=*/512);
    if (!tokens.ok()) {
      return absl::Status(
          tokens.status().code(),
          absl::StrCat(o.calib_text_path.empty() ? "sampling calibration text: " : "--calib-text: ",
                       tokens.status().message()));
    }
    const TransformFitOptions fit{.key_bits = o.kv_budget,
                                  .value_bits = o.kv_budget_v > 0.0 ? o.kv_budget_v : o.kv_budget,
                                  .pre_rope_keys = !o.codec_post_rope,
                                  .attention_weighted = o.codec_weighted};
    absl::StatusOr<CodecFile> fitted = runtime::FitCodecFile(
        *files->model, *gguf, *tokens, fit,
        {.window = 512, .max_tokens = 0, .bos = files->tokenizer->bos_id(), .progress = {}});
    if (!fitted.ok()) return fitted.status();
    codec = std::make_shared<const CodecFile>(*std::move(fitted));
    spdlog::info(
        "codec fitted on {} tokens of {} in {:.1f} s: {} / {} bits per key / value "
        "element ({} keys{})",
        tokens->size(), o.calib_text_path.empty() ? "the model's own text" : o.calib_text_path,
        absl::ToDoubleSeconds(absl::Now() - fit_start), fit.key_bits, fit.value_bits,
        fit.pre_rope_keys ? "pre-RoPE" : "post-RoPE",
        fit.attention_weighted ? ", attention-weighted" : "");
  }
  const runtime::KvCacheOptions cache_options =
      runtime::ResolveKvCacheOptions(config_.kv_cache, model_config.cache_geometry(), bases.get());
  absl::StatusOr<runtime::Backend> backend =
      runtime::CreateBackend({.device = config_.device,
                              .block_size = config_.block_size,
                              .kv_cache_bytes = config_.kv_cache_bytes,
                              .gpu_memory_fraction = config_.gpu_memory_fraction,
                              .max_batch_tokens = config_.engine.max_batch_tokens,
                              .max_running = config_.engine.max_running,
                              .cuda_graphs = config_.cuda_graphs},
                             std::move(files->model), cache_options,
                             {.bases = std::move(bases), .codec = std::move(codec)});
  if (!backend.ok()) return backend.status();
  const std::string device_name = backend->model->device_name();

  // Snapshots (--session-dir, ExportSession, the disk tier) name the model file by its
  // checksum: one pass over the mapped file (~0.5 s per GB).
  snapshot_identity_ = {.model_checksum = ModelChecksum(*gguf), .model_name = model_config.name};
  EngineConfig engine_config = config_.engine;
  engine_config.session_tiers.host_bytes = config_.session_host_bytes;
  engine_config.session_tiers.identity = snapshot_identity_;
  if (!config_.session_dir.empty()) {
    // Before the engine's tiers empty its tier/ folder: a killed process's files are recovered.
    absl::StatusOr<std::unique_ptr<SessionPersistence>> persistence =
        SessionPersistence::Open(config_.session_dir, snapshot_identity_,
                                 config_.session_checkpoint_interval, metrics_registry_.get());
    if (!persistence.ok()) return persistence.status();
    persistence_ = *std::move(persistence);
    if (config_.session_disk_bytes > 0) {
      engine_config.session_tiers.disk_dir = persistence_->TierDir();
      engine_config.session_tiers.disk_bytes = config_.session_disk_bytes;
    }
    engine_config.on_session_removed =
        [removed = persistence_->RemovalHook(),
         next = std::move(engine_config.on_session_removed)](const std::string& id) {
          removed(id);
          if (next) next(id);
        };
  }
  Metrics* metrics = metrics_registry_.get();
  engine_config.on_step = [metrics,
                           next = std::move(engine_config.on_step)](const StepStats& step) {
    metrics->RecordStep(step);
    if (next) next(step);
  };
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(std::move(engine_config), std::move(backend->model),
                     std::move(files->tokenizer), std::move(backend->cache));
  if (!engine.ok()) return engine.status();
  engine_ = *std::move(engine);

  if (persistence_ != nullptr) persistence_->Restore(*engine_);  // before any RPC can reach it
  const KvCacheStats cache_stats = engine_->Stats().cache;
  if (http_ != nullptr) {
    // The file's name by default: what the operator chose and can see (general.name is often
    // the base model's, shared by every quantization and fine-tune of it).
    std::string model_id = config_.model_id;
    if (model_id.empty()) model_id = std::filesystem::path(config_.model_path).stem().string();
    http_->AttachEngine(engine_.get(), *chat, model_id, snapshot_identity_);
    spdlog::info("HTTP API model id '{}'", model_id);
  }
  service_->AttachEngine(engine_.get(),
                         CacheDescription{.options = cache_options,
                                          .pool_bytes = cache_stats.bytes_total,
                                          .block_size = config_.block_size},
                         *std::move(chat), snapshot_identity_);
  metrics_registry_->AttachEngine(engine_.get());
  SetServing(true);
  if (persistence_ != nullptr) persistence_->StartCheckpoints(engine_.get());
  spdlog::info(
      "serving model '{}' from {} on {}: {} layers, dim {}, {} heads ({} kv), vocab {}, "
      "context {}; {} KV cache, pool {} MiB in {} blocks of {} tokens; loaded in {:.2f} s",
      model_config.name, config_.model_path, device_name, model_config.n_layers, model_config.dim,
      model_config.n_heads, model_config.n_kv_heads, model_config.n_vocab,
      engine_->model_config().context_length,  // the backend's runner's
      runtime::KvCacheKindName(cache_options.kind), cache_stats.bytes_total >> 20,
      cache_stats.blocks_total, config_.block_size,
      absl::ToDoubleSeconds(absl::Now() - load_start));
  if (cache_options.kind == runtime::KvCacheKind::kTransform) {
    spdlog::info(
        "transform-coded KV cache: {} sink and {} window tokens at fp16, older blocks as "
        "the codec's codes",
        cache_options.sink_tokens, cache_options.window_tokens);
  }
  if (cache_options.kind == runtime::KvCacheKind::kQuantized) {
    spdlog::info("quantized KV cache: K and V rows in {}", KvDtypeName(cache_options.kv_dtype));
  }
  if (cache_options.kind == runtime::KvCacheKind::kCompressed) {
    spdlog::info(
        "compressed KV cache: {} sink and {} window tokens full-rank, ranks k {} v {} of {}, "
        "{} coefficients, outlier threshold {}",
        cache_options.sink_tokens, cache_options.window_tokens, cache_options.rank_k,
        cache_options.rank_v, model_config.head_dim, CoeffDtypeName(cache_options.coeff_dtype),
        cache_options.outlier_threshold);
    const RefreshConfig& r = cache_options.refresh;
    spdlog::info(
        "online basis refresh by default: {} (every {} tokens, residual threshold {}, half-life "
        "{} tokens, Oja rate {}, at most {} epochs per session)",
        RefreshMethodName(r.method), r.every_tokens, r.residual_threshold, r.half_life_tokens,
        r.oja_learning_rate, r.max_epochs);
  }
  return absl::OkStatus();
}

void ServerApp::SetServing(bool serving) {
  if (server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", serving);
  health->SetServingStatus(kServiceName, serving);
}

int ServerApp::http_port() const { return http_ != nullptr ? http_->port() : -1; }

void ServerApp::BeginDrain() {
  if (service_ != nullptr) service_->BeginDrain();
  if (http_ != nullptr) http_->BeginDrain();
  SetServing(false);
}

bool ServerApp::Shutdown() {
  std::lock_guard<std::mutex> lock(shutdown_mu_);
  if (shut_down_) return drained_;
  shut_down_ = true;
  BeginDrain();
  // No checkpoint may overwrite what the drain writes.
  if (persistence_ != nullptr) persistence_->StopCheckpoints();
  if (engine_ != nullptr) {
    spdlog::info("draining: waiting up to {:.0f} s for running requests",
                 absl::ToDoubleSeconds(config_.drain_timeout));
    drained_ = engine_->Drain(config_.drain_timeout);
    if (!drained_) spdlog::warn("drain timed out; cancelling the requests left");
  }
  // The HTTP API's streams have written their last events once the engine drained; whatever is
  // left after a timed-out drain is cancelled.
  if (http_ != nullptr) http_->Stop(drained_ ? absl::Seconds(5) : absl::ZeroDuration());
  if (server_ != nullptr) {
    // Drained calls only have their last messages to flush; after a timed-out drain the rest is
    // cancelled at once (their reactors finish on OnCancel without waiting for the engine).
    const auto grace = drained_ ? std::chrono::seconds(5) : std::chrono::seconds(0);
    server_->Shutdown(std::chrono::system_clock::now() + grace);
    server_->Wait();
  }
  if (persistence_ != nullptr && engine_ != nullptr) {
    // Requests the timed-out drain left were cancelled with their calls; their sessions keep
    // what they produced once the engine has finished them.
    if (!drained_ && !engine_->Drain(absl::Seconds(5))) {
      spdlog::error("sessions not saved: requests still run after their calls were cancelled");
    } else {
      persistence_->Save(*engine_);
    }
  }
  metrics_.reset();
  if (metrics_registry_ != nullptr) metrics_registry_->AttachEngine(nullptr);
  spdlog::info("server stopped");
  return drained_;
}

}  // namespace subspace::server
