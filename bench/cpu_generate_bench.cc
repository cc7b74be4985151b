// subspace-bench-cpu: prefill and decode throughput of the CPU engine on one GGUF model, at
// batch 1 and batch 8, printed as a table. Token ids are synthetic (fixed pseudo-random ids),
// which does not change the arithmetic of a dense forward pass.
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/model.h"
#include "core/paged_kv_cache.h"
#include "tools/cli/dash_flags.h"

ABSL_FLAG(std::string, model, "models/subspace-tiny.gguf", "path of the GGUF model");
ABSL_FLAG(int32_t, prompt_tokens, 256, "tokens per prefill");
ABSL_FLAG(int32_t, decode_tokens, 64, "decode steps per measurement");
ABSL_FLAG(std::vector<std::string>, batch, std::vector<std::string>({"1", "8"}),
          "comma-separated batch sizes");
ABSL_FLAG(int32_t, repeats, 3, "measurements per cell; the best is reported");
ABSL_FLAG(int64_t, kv_cache_bytes, 1ll << 30, "KV cache pool size in bytes");

namespace subspace {
namespace {

using Clock = std::chrono::steady_clock;

struct Cell {
  double prefill_tps = 0;
  double decode_tps = 0;
};

absl::StatusOr<Cell> Measure(LlamaModel& model, KvCache& cache, int batch, int prompt_len,
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
  absl::StatusOr<std::unique_ptr<LlamaModel>> model =
      LlamaModel::Open(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return model.status();
  const ModelConfig& cfg = (*model)->config();
  PagedKvCache::Config cache_config;
  cache_config.geometry = cfg.cache_geometry();
  cache_config.capacity_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  absl::StatusOr<std::unique_ptr<PagedKvCache>> cache = PagedKvCache::Create(cache_config);
  if (!cache.ok()) return cache.status();

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
  for (const std::string& b : absl::GetFlag(FLAGS_batch)) {
    const int batch = std::stoi(b);
    Cell best;
    for (int r = 0; r < absl::GetFlag(FLAGS_repeats); ++r) {
      absl::StatusOr<Cell> cell = Measure(**model, **cache, batch, prompt_len, decode_len, r);
      if (!cell.ok()) return cell.status();
      best.prefill_tps = std::max(best.prefill_tps, cell->prefill_tps);
      best.decode_tps = std::max(best.decode_tps, cell->decode_tps);
    }
    std::printf("| %5d | %16.1f | %15.1f | %14.2f |\n", batch, best.prefill_tps,
                best.decode_tps, 1000.0 * batch / best.decode_tps);
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
