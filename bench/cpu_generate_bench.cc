// subspace-bench-cpu: prefill and decode throughput of a backend's forward pass on one GGUF
// model (--device cpu or cuda; --kv-cache full or compressed: sinks 4, window 64, rank
// head_dim / 4, fp16 codes, a basis self-calibrated from the first prompt), at several batch sizes,
// printed as a table. Token ids are synthetic (fixed pseudo-random ids), which does not change
// the arithmetic of a dense forward pass.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/compressed_kv_cache.h"
#include "core/model.h"
#include "core/paged_kv_cache.h"
#include "tools/cli/dash_flags.h"

#if defined(SUBSPACE_WITH_CUDA)
#include "kernels/cuda_model.h"
#endif

ABSL_FLAG(std::string, model, "models/subspace-tiny.gguf", "path of the GGUF model");
ABSL_FLAG(int32_t, prompt_tokens, 256, "tokens per prefill");
ABSL_FLAG(int32_t, decode_tokens, 64, "decode steps per measurement");
ABSL_FLAG(std::vector<std::string>, batch, std::vector<std::string>({"1", "8"}),
          "comma-separated batch sizes");
ABSL_FLAG(int32_t, repeats, 3, "measurements per cell; the best is reported");
ABSL_FLAG(int64_t, kv_cache_bytes, 1ll << 30, "KV cache pool size in bytes");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda (the CUDA backend)");
ABSL_FLAG(std::string, kv_cache, "full", "full (paged full-rank) or compressed (low-rank)");

namespace subspace {
namespace {

using Clock = std::chrono::steady_clock;

struct Cell {
  double prefill_tps = 0;
  double decode_tps = 0;
};

absl::StatusOr<Cell> Measure(ModelRunner& model, KvCacheBase& cache, int batch, int prompt_len,
                             int decode_len, uint64_t seed) {
  const ModelConfig& cfg = model.config();
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> prompts(batch, std::vector<int32_t>(prompt_len));
  for (auto& p : prompts) {
    for (auto& t : p) t = static_cast<int32_t>(rng() % cfg.n_vocab);
  }
  std::vector<SeqId> seqs;
  for (int b = 0; b < batch; ++b) {
    absl::StatusOr<SeqId> s = cache.CreateSequence();
    if (!s.ok()) return s.status();
    if (absl::Status st = cache.Reserve(*s, prompt_len + decode_len); !st.ok()) return st;
    seqs.push_back(*s);
  }
  std::vector<float> logits;
  Cell cell;
  // Prefill: all prompts in one step, as the scheduler batches them.
  std::vector<SequenceChunk> chunks;
  for (int b = 0; b < batch; ++b) chunks.push_back({seqs[b], 0, prompts[b], false});
  auto start = Clock::now();
  if (absl::Status s = model.Forward(chunks, cache, &logits); !s.ok()) return s;
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  cell.prefill_tps = batch * prompt_len / seconds;
  // Decode: one token per sequence per step.
  std::vector<int32_t> next(batch);
  start = Clock::now();
  for (int step = 0; step < decode_len; ++step) {
    chunks.clear();
    for (int b = 0; b < batch; ++b) {
      next[b] = static_cast<int32_t>(rng() % cfg.n_vocab);
      chunks.push_back({seqs[b], prompt_len + step, {&next[b], 1}, false});
    }
    if (absl::Status s = model.Forward(chunks, cache, &logits); !s.ok()) return s;
  }
  seconds = std::chrono::duration<double>(Clock::now() - start).count();
  cell.decode_tps = batch * decode_len / seconds;
  for (SeqId s : seqs) cache.FreeSequence(s).IgnoreError();
  return cell;
}

absl::Status Run() {
  absl::StatusOr<std::unique_ptr<LlamaModel>> cpu_model =
      LlamaModel::Open(absl::GetFlag(FLAGS_model));
  if (!cpu_model.ok()) return cpu_model.status();
  const ModelConfig cfg = (*cpu_model)->config();
  std::vector<int> batches;
  for (const std::string& b : absl::GetFlag(FLAGS_batch)) batches.push_back(std::stoi(b));
  const int max_batch = *std::max_element(batches.begin(), batches.end());

  std::shared_ptr<ModelRunner> model;
  std::unique_ptr<KvCacheBase> cache;
  const std::string device = absl::GetFlag(FLAGS_device);
  const std::string kind = absl::GetFlag(FLAGS_kv_cache);
  if (kind != "full" && kind != "compressed") {
    return absl::InvalidArgumentError("--kv-cache must be full or compressed");
  }
  if (device == "cpu" && kind == "compressed") {
    CompressedKvCacheConfig c;
    c.geometry = cfg.cache_geometry();
    c.capacity_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
    absl::StatusOr<std::unique_ptr<CompressedKvCache>> compressed = CompressedKvCache::Create(c);
    if (!compressed.ok()) return compressed.status();
    model = std::shared_ptr<LlamaModel>(*std::move(cpu_model));
    cache = *std::move(compressed);
  } else if (device == "cpu") {
    PagedKvCache::Config cache_config;
    cache_config.geometry = cfg.cache_geometry();
    cache_config.capacity_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
    absl::StatusOr<std::unique_ptr<PagedKvCache>> paged = PagedKvCache::Create(cache_config);
    if (!paged.ok()) return paged.status();
    model = std::shared_ptr<LlamaModel>(*std::move(cpu_model));
    cache = *std::move(paged);
  } else if (device == "cuda") {
#if defined(SUBSPACE_WITH_CUDA)
    absl::StatusOr<kernels::CudaBackend> cuda = kernels::CreateCudaBackend(
        **cpu_model, {.max_batch_tokens = max_batch * absl::GetFlag(FLAGS_prompt_tokens),
                      .max_sequences = max_batch,
                      .kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes),
                      .compressed = kind == "compressed"
                                        ? std::optional<kernels::CudaCompressedCacheOptions>(
                                              kernels::CudaCompressedCacheOptions{})
                                        : std::nullopt});
    if (!cuda.ok()) return cuda.status();
    model = std::move(cuda->model);
    cache = std::move(cuda->cache);
#else
    return absl::UnavailableError("built without CUDA");
#endif
  } else {
    return absl::InvalidArgumentError("--device must be cpu or cuda");
  }
  std::printf("device %s, KV cache %s\n", model->device_name().c_str(), kind.c_str());

  int prompt_len = absl::GetFlag(FLAGS_prompt_tokens);
  int decode_len = absl::GetFlag(FLAGS_decode_tokens);
  if (prompt_len + decode_len > cfg.context_length) {
    prompt_len = cfg.context_length - decode_len;
  }
  if (prompt_len < 1 || decode_len < 1) {
    return absl::InvalidArgumentError("prompt and decode lengths must fit the context");
  }
  std::printf("model %s: dim %d, layers %d, heads %d/%d, vocab %d, context %d\n",
              absl::GetFlag(FLAGS_model).c_str(), cfg.dim, cfg.n_layers, cfg.n_heads,
              cfg.n_kv_heads, cfg.n_vocab, cfg.context_length);
  std::printf("prompt %d tokens, decode %d tokens, best of %d\n\n", prompt_len, decode_len,
              absl::GetFlag(FLAGS_repeats));
  std::printf("| batch | prefill tokens/s | decode tokens/s | decode ms/step |\n");
  std::printf("|------:|-----------------:|----------------:|---------------:|\n");
  for (const int batch : batches) {
    Cell best;
    for (int r = 0; r < absl::GetFlag(FLAGS_repeats); ++r) {
      absl::StatusOr<Cell> cell = Measure(*model, *cache, batch, prompt_len, decode_len, r);
      if (!cell.ok()) return cell.status();
      best.prefill_tps = std::max(best.prefill_tps, cell->prefill_tps);
      best.decode_tps = std::max(best.decode_tps, cell->decode_tps);
    }
    std::printf("| %5d | %16.1f | %15.1f | %14.2f |\n", batch, best.prefill_tps, best.decode_tps,
                1000.0 * batch / best.decode_tps);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace subspace

int main(int argc, char** argv) {
  std::vector<std::string> args = subspace::cli::NormalizeDashFlags(argc, argv);
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = subspace::Run(); !s.ok()) {
    std::fprintf(stderr, "subspace-bench-cpu: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
