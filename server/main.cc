// subspace-server: loads a GGUF model and serves subspace.v1.Subspace, grpc.health.v1.Health and
// server reflection over gRPC, the OpenAI-compatible HTTP API on the same engine, and Prometheus
// metrics on a separate HTTP port. SIGTERM or SIGINT
// drains (health NOT_SERVING, new requests UNAVAILABLE, running ones finish) and exits 0.
#include <pthread.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cli/flags.h"
#include "core/kvcache/refresh_config.h"
#include "server/server_app.h"
#include "spdlog/async.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, model, "models/subspace-tiny.gguf", "path of the GGUF model");
ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on (gRPC, HTTP API and metrics)");
ABSL_FLAG(int32_t, port, 50051, "gRPC port; 0 picks a free one and prints it");
ABSL_FLAG(int32_t, metrics_port, 9090,
          "Prometheus /metrics HTTP port; 0 picks a free one, -1 turns metrics off");
ABSL_FLAG(int32_t, http_port, 8080,
          "OpenAI-compatible HTTP API port (/v1/chat/completions, /v1/completions, /v1/models; "
          "docs/http_api.md); 0 picks a free one, -1 turns it off");
ABSL_FLAG(int32_t, http_threads, 64,
          "HTTP API: connections served at once (a request holds one while it runs)");
ABSL_FLAG(std::string, model_id, "",
          "HTTP API: the model id /v1/models lists and requests name; empty: the model "
          "file's name without .gguf (models/subspace-long.gguf: subspace-long)");
ABSL_FLAG(std::string, device, "cpu",
          "backend: cpu, cuda (a GPU: both cache kinds; the compressed one with static, "
          "self-calibrated or refreshed bases and outliers) or auto (cuda when "
          "a GPU is present and the cache configuration runs there, else cpu)");
ABSL_FLAG(int64_t, kv_cache_bytes, int64_t{256} << 20, "KV cache pool size in bytes");
ABSL_FLAG(double, gpu_memory_fraction, 0.0,
          "cuda: size the KV pool as this fraction of the GPU's memory minus weights and "
          "buffers (overrides --kv-cache-bytes); 0 = use --kv-cache-bytes");
ABSL_FLAG(bool, cuda_graphs, false,
          "cuda: run decode steps as CUDA graphs (one submission per step; measured slower than "
          "eager launches on an H200, bench/RESULTS.md); false launches each kernel on its own");
ABSL_FLAG(int32_t, block_size, 16, "KV cache block size in tokens (at most 64 when compressed)");
ABSL_FLAG(std::string, kv_cache, "auto",
          "KV cache: 'transform' (blocks outside the sinks and the window in the transform "
          "codec's codes: --codec, --kv-budget or the model's own <model>.codec), 'compressed' "
          "(low-rank blocks outside the sinks and the window), 'full' (full-rank fp32 paged), "
          "'quantized' (full-rank paged, rows in --kv-dtype), or 'auto': transform when a codec "
          "is given, or on --device cpu when the model has its own and no --bases, --kv-rank-* "
          "or low-rank-only --refresh-method is given; compressed otherwise");
ABSL_FLAG(std::string, codec, "",
          "transform cache: codec file from subspace-calibrate --kv-budget; empty: the model's "
          "own <model>.codec beside the .gguf when there is one; none: never that one (refused "
          "by the other kinds)");
ABSL_FLAG(double, kv_budget, 0.0,
          "transform cache without --codec: fit the codec at start-up for this many bits per "
          "key element (values: --kv-budget-v), on --calib-text, or without it on text the model "
          "samples itself");
ABSL_FLAG(double, kv_budget_v, 0.0, "--kv-budget: bits per value element; 0 = --kv-budget");
ABSL_FLAG(std::string, calib_text, "",
          "--kv-budget: a text file, or a directory of them, to fit the codec on; empty: "
          "--calib-tokens the model writes itself (temperature 1, from BOS)");
ABSL_FLAG(int64_t, calib_tokens, 20000, "--kv-budget: fit on at most this many tokens of it");
ABSL_FLAG(bool, codec_post_rope, false,
          "--kv-budget: code keys after RoPE (scored on their codes: decode as fast as the full "
          "cache, but more bits for the same quality) instead of before it");
ABSL_FLAG(bool, codec_weighted, true,
          "--kv-budget: weigh the codec's errors by attention (queries on keys, W_O on values)");
ABSL_FLAG(std::string, kv_dtype, "",
          "quantized cache: K/V row format, q8_0 (when empty) or q4_0 (llama.cpp's cache types); "
          "an error with any other --kv-cache");
ABSL_FLAG(int32_t, kv_sink_tokens, 4,
          "compressed and transform caches: first tokens kept full-rank (sinks)");
ABSL_FLAG(int32_t, kv_window_tokens, 64,
          "compressed and transform caches: last tokens kept full-rank");
ABSL_FLAG(int32_t, kv_rank_k, 0, "compressed cache: key rank per KV head; 0 = head_dim / 4");
ABSL_FLAG(int32_t, kv_rank_v, 0, "compressed cache: value rank per KV head; 0 = head_dim / 4");
ABSL_FLAG(std::string, kv_coeff_dtype, "int8",
          "compressed cache: coefficient storage, int8 (per-token scale; as good as fp16 on the "
          "long-context suite at 24-40 % fewer bytes), int4 (per-token scale, even ranks, CPU "
          "only) or fp16 (fp32 for exactness checks)");
ABSL_FLAG(std::string, kv_full_dtype, "fp16",
          "compressed cache: storage of the full-rank blocks (sinks, window, outliers), fp16 "
          "(fp32 for exactness checks)");
ABSL_FLAG(float, kv_outlier_threshold, 1.0f,
          "compressed cache: relative key residual above which a token stays full-rank; "
          ">= 1 turns outliers off");
ABSL_FLAG(std::string, bases, "",
          "compressed cache: basis file from subspace-calibrate, installed as the default epoch "
          "(its per-layer ranks replace --kv-rank-k/--kv-rank-v); empty: the model's own "
          "<model>.bases beside the .gguf when there is one; none: self-calibrate");
ABSL_FLAG(std::string, refresh_method, "none",
          "online refresh per session: none (static bases or codes); the compressed cache: pca, "
          "kqsvd, oja or fd; the transform cache: pca; a session may ask for another "
          "(CreateSessionRequest.refresh)");
ABSL_FLAG(int64_t, refresh_every_tokens, 256,
          "online refresh: new basis epoch every this many compressed tokens (0 = never by count)");
ABSL_FLAG(double, refresh_residual_threshold, 0.0,
          "online refresh: also refresh when the mean key residual-energy ratio of new blocks "
          "passes this (0 = off)");
ABSL_FLAG(double, refresh_half_life_tokens, 1024,
          "online refresh (pca, kqsvd, fd): statistics lose half their weight over this many "
          "tokens (0 = no decay)");
ABSL_FLAG(double, refresh_oja_learning_rate, 1.0, "online refresh (oja): step size");
ABSL_FLAG(int32_t, refresh_max_epochs, 2,
          "online refresh: basis epochs live per session; older blocks are re-projected");
ABSL_FLAG(int32_t, max_running, 16, "sequences admitted to the batch at once");
ABSL_FLAG(int32_t, max_batch_tokens, 512, "tokens per engine step (decodes + prefill chunks)");
ABSL_FLAG(int32_t, max_queue, 256, "waiting requests; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, max_sessions, 1024, "live sessions; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, prompt_cache_entries, 8,
          "caches of finished requests without a session kept for a later one that starts with "
          "the same tokens (a client resending its conversation, a shared system prompt), which "
          "then prefills only the rest; 0 frees them at once. The pool reclaims them first");
ABSL_FLAG(int32_t, session_ttl_seconds, 600, "idle time after which a session is dropped");
ABSL_FLAG(int32_t, drain_seconds, 30, "on SIGTERM, how long running requests may take to finish");
ABSL_FLAG(std::string, session_dir, "",
          "directory that keeps sessions across restarts: SIGTERM writes every live session "
          "there after draining, start-up restores them (docs/sessions.md); empty: sessions end "
          "with the process");
ABSL_FLAG(int64_t, session_host_mb, 512,
          "host-memory tier for idle sessions' KV caches the pool needs, in MiB (0: off): their "
          "next call restores the cache instead of prefilling the conversation again");
ABSL_FLAG(int64_t, session_disk_mb, 4096,
          "disk tier under the host tier, in MiB, in <session-dir>/tier (needs --session-dir; "
          "0: off)");
ABSL_FLAG(double, session_checkpoint_seconds, 30,
          "with --session-dir: write the sessions used since the last checkpoint this often while "
          "serving, so that a killed process loses at most this much (0: at drain only)");
ABSL_FLAG(int32_t, max_message_bytes, 4 << 20, "largest gRPC request accepted, in bytes");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain for gRPC over TLS (with --tls-key); empty = plaintext");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; set = mutual TLS: clients must present a certificate it signed");
ABSL_FLAG(std::string, chat_template, "",
          "Jinja chat template for the Chat RPCs, overriding the model's tokenizer.chat_template");
ABSL_FLAG(std::string, auth_tokens, "",
          "file of bearer tokens, one per line ('#' comments); set = every Subspace RPC needs "
          "'authorization: Bearer <token>' (health does not)");
ABSL_FLAG(std::string, operator_tokens, "",
          "file of bearer tokens (as --auth-tokens, which it needs) that may also list, export, "
          "import and delete every principal's sessions: to move sessions off a replica before "
          "draining it (docs/sessions.md)");
ABSL_FLAG(std::string, log_level, "info",
          "trace, debug, info, warn, error, critical or off (request lines are info)");

namespace {

// Log lines from the engine thread must not wait on stderr: an async logger that drops the
// oldest line rather than block when its queue is full.
bool SetUpLogging(const std::string& level_name) {
  const spdlog::level::level_enum level = spdlog::level::from_str(level_name);
  if (level == spdlog::level::off && level_name != "off") {
    std::fprintf(stderr, "subspace-server: unknown --log-level '%s'\n", level_name.c_str());
    return false;
  }
  spdlog::init_thread_pool(8192, 1);
  auto logger = spdlog::create_async_nb<spdlog::sinks::stderr_color_sink_mt>("subspace");
  logger->set_level(level);
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
  spdlog::flush_every(std::chrono::seconds(1));
  return true;
}

// Only the names are parsed here; ServerApp::Start checks the values.
absl::StatusOr<subspace::server::ServerAppConfig> ConfigFromFlags() {
  subspace::server::ServerAppConfig c;
  c.model_path = absl::GetFlag(FLAGS_model);
  c.host = absl::GetFlag(FLAGS_host);
  c.port = absl::GetFlag(FLAGS_port);
  c.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  c.http_port = absl::GetFlag(FLAGS_http_port);
  c.http_threads = absl::GetFlag(FLAGS_http_threads);
  c.model_id = absl::GetFlag(FLAGS_model_id);
  c.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  absl::StatusOr<subspace::runtime::Device> device =
      subspace::runtime::ParseDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) return device.status();
  c.device = *device;
  c.gpu_memory_fraction = absl::GetFlag(FLAGS_gpu_memory_fraction);
  c.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  c.block_size = absl::GetFlag(FLAGS_block_size);
  absl::StatusOr<subspace::RefreshMethod> refresh =
      subspace::ParseRefreshMethod(absl::GetFlag(FLAGS_refresh_method));
  if (!refresh.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--refresh-method: ", refresh.status().message()));
  }
  const std::string kv_cache_flag = absl::GetFlag(FLAGS_kv_cache),
                    codec_flag = absl::GetFlag(FLAGS_codec),
                    bases_flag = absl::GetFlag(FLAGS_bases);
  absl::StatusOr<subspace::runtime::KvCacheChoice> choice = subspace::runtime::ResolveKvCacheChoice(
      {.kind = kv_cache_flag,
       .codec = codec_flag,
       .kv_budget = absl::GetFlag(FLAGS_kv_budget),
       .bases = bases_flag,
       .rank_k = absl::GetFlag(FLAGS_kv_rank_k),
       .rank_v = absl::GetFlag(FLAGS_kv_rank_v),
       .refresh = *refresh},
      c.model_path, c.device == subspace::runtime::Device::kCpu);
  if (!choice.ok()) return choice.status();
  absl::StatusOr<subspace::CoeffDtype> dtype =
      subspace::runtime::ParseCoeffDtype(absl::GetFlag(FLAGS_kv_coeff_dtype));
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<subspace::CoeffDtype> full_dtype =
      subspace::runtime::ParseFullDtype(absl::GetFlag(FLAGS_kv_full_dtype));
  if (!full_dtype.ok()) return full_dtype.status();
  // Given with another cache kind it would be ignored: a user who asked for q4_0 rows and got
  // fp32 ones would read the wrong footprint off every metric.
  const std::string kv_dtype_flag = absl::GetFlag(FLAGS_kv_dtype);
  if (!kv_dtype_flag.empty() && choice->kind != subspace::runtime::KvCacheKind::kQuantized) {
    return absl::InvalidArgumentError("--kv-dtype applies to --kv-cache=quantized only");
  }
  absl::StatusOr<subspace::KvDtype> kv_dtype =
      subspace::runtime::ParseQuantizedKvDtype(kv_dtype_flag.empty() ? "q8_0" : kv_dtype_flag);
  if (!kv_dtype.ok()) return kv_dtype.status();
  c.kv_cache.kind = choice->kind;
  c.kv_cache.kv_dtype = *kv_dtype;
  c.kv_cache.codec_path = choice->codec_path;
  c.kv_cache.kv_budget = absl::GetFlag(FLAGS_kv_budget);
  c.kv_cache.kv_budget_v = absl::GetFlag(FLAGS_kv_budget_v);
  c.kv_cache.calib_text_path = absl::GetFlag(FLAGS_calib_text);
  c.kv_cache.calib_tokens = absl::GetFlag(FLAGS_calib_tokens);
  c.kv_cache.codec_post_rope = absl::GetFlag(FLAGS_codec_post_rope);
  c.kv_cache.codec_weighted = absl::GetFlag(FLAGS_codec_weighted);
  c.kv_cache.sink_tokens = absl::GetFlag(FLAGS_kv_sink_tokens);
  c.kv_cache.window_tokens = absl::GetFlag(FLAGS_kv_window_tokens);
  c.kv_cache.rank_k = absl::GetFlag(FLAGS_kv_rank_k);
  c.kv_cache.rank_v = absl::GetFlag(FLAGS_kv_rank_v);
  c.kv_cache.coeff_dtype = *dtype;
  c.kv_cache.full_dtype = *full_dtype;
  c.kv_cache.outlier_threshold = absl::GetFlag(FLAGS_kv_outlier_threshold);
  c.kv_cache.bases_path =
      subspace::runtime::ResolveBasesPath(absl::GetFlag(FLAGS_bases), c.model_path, c.kv_cache.kind,
                                          c.kv_cache.rank_k, c.kv_cache.rank_v);
  c.kv_cache.refresh.method = *refresh;
  c.kv_cache.refresh.every_tokens = absl::GetFlag(FLAGS_refresh_every_tokens);
  c.kv_cache.refresh.residual_threshold = absl::GetFlag(FLAGS_refresh_residual_threshold);
  c.kv_cache.refresh.half_life_tokens = absl::GetFlag(FLAGS_refresh_half_life_tokens);
  c.kv_cache.refresh.oja_learning_rate = absl::GetFlag(FLAGS_refresh_oja_learning_rate);
  c.kv_cache.refresh.max_epochs = absl::GetFlag(FLAGS_refresh_max_epochs);
  c.engine.max_running = absl::GetFlag(FLAGS_max_running);
  c.engine.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  c.engine.max_queue = absl::GetFlag(FLAGS_max_queue);
  c.engine.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  c.engine.prompt_cache_entries = absl::GetFlag(FLAGS_prompt_cache_entries);
  c.engine.default_session_ttl = absl::Seconds(absl::GetFlag(FLAGS_session_ttl_seconds));
  c.drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_seconds));
  c.session_dir = absl::GetFlag(FLAGS_session_dir);
  for (const auto& [name, mb] :
       {std::pair{"--session-host-mb", absl::GetFlag(FLAGS_session_host_mb)},
        std::pair{"--session-disk-mb", absl::GetFlag(FLAGS_session_disk_mb)}}) {
    if (mb < 0 || mb > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be between 0 and 2^30 MiB, got ", mb));
    }
  }
  const double checkpoint = absl::GetFlag(FLAGS_session_checkpoint_seconds);
  if (!(checkpoint >= 0.0 && checkpoint <= 86400.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--session-checkpoint-seconds must be between 0 and 86400, got ", checkpoint));
  }
  c.session_checkpoint_interval = absl::Seconds(checkpoint);
  c.session_host_bytes = absl::GetFlag(FLAGS_session_host_mb) << 20;
  c.session_disk_bytes = absl::GetFlag(FLAGS_session_disk_mb) << 20;
  c.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  c.tls.cert_path = absl::GetFlag(FLAGS_tls_cert);
  c.tls.key_path = absl::GetFlag(FLAGS_tls_key);
  c.tls.client_ca_path = absl::GetFlag(FLAGS_tls_client_ca);
  c.auth_tokens_path = absl::GetFlag(FLAGS_auth_tokens);
  c.operator_tokens_path = absl::GetFlag(FLAGS_operator_tokens);
  c.chat_template_path = absl::GetFlag(FLAGS_chat_template);
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  subspace::cli::ParseFlags(argc, argv,
                            "subspace-server --model M.gguf [--port 50051] [--http-port 8080] "
                            "[--metrics-port 9090] "
                            "[--kv-cache compressed|full] ...");

  // Block the shutdown signals before any thread starts, so every thread inherits the mask and
  // only the sigwait below sees them: no work in a signal handler.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  if (!SetUpLogging(absl::GetFlag(FLAGS_log_level))) return 2;

  absl::StatusOr<subspace::server::ServerAppConfig> config = ConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "subspace-server: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<subspace::server::ServerApp>> app =
      subspace::server::ServerApp::Start(*std::move(config));
  if (!app.ok()) {
    spdlog::critical("cannot start: {}", app.status().ToString());
    spdlog::shutdown();
    return 1;
  }
  std::printf("subspace-server listening on port %d, metrics port %d, http port %d\n",
              (*app)->port(), (*app)->metrics_port(), (*app)->http_port());
  std::fflush(stdout);

  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("received {}; draining (a second signal exits at once)", strsignal(sig));
  std::thread([signals] {
    int again = 0;
    sigwait(&signals, &again);
    std::fprintf(stderr, "subspace-server: second %s, exiting without draining\n",
                 strsignal(again));
    std::_Exit(1);
  }).detach();

  (*app)->Shutdown();
  app->reset();
  spdlog::shutdown();
  return 0;
}
