// subspace-bench-cpu: end-to-end prefill and decode throughput of a backend's forward pass on one
// GGUF model (--device cpu or cuda) for each KV cache kind in --kv-cache, built as the server
// builds it with its defaults (runtime/: full: paged full-rank; quantized: q8_0 rows;
// compressed: sinks 4, window 64, rank head_dim / 4, int8 codes, a basis self-calibrated from the
// first prompt) at several batch sizes, with the cache bytes in use at the end of decode. Kinds
// run one after another, each on its own runner and cache (one pool allocated at a time), so the
// compressed/full ratios come from one run. Token ids are synthetic (fixed pseudo-random ids),
// which does not change the arithmetic of a dense forward pass.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/flags.h"
#include "core/gguf/gguf.h"
#include "core/model/model.h"
#include "runtime/backend.h"

ABSL_FLAG(std::string, model, "models/subspace-tiny.gguf", "path of the GGUF model");
ABSL_FLAG(int32_t, prompt_tokens, 256, "tokens per prefill");
ABSL_FLAG(int32_t, decode_tokens, 64, "decode steps per measurement");
ABSL_FLAG(std::vector<std::string>, batch, std::vector<std::string>({"1", "8"}),
          "comma-separated batch sizes");
ABSL_FLAG(int32_t, prefill_batch, 0,
          "sequences per prefill step (0: the whole batch in one step); bounds the activations "
          "of long prompts at large batch");
ABSL_FLAG(int32_t, repeats, 3,
          "measurements per cell; the median is reported, with the decode spread "
          "(max - min) / median");
ABSL_FLAG(int64_t, kv_cache_bytes, 1ll << 30, "KV cache pool size in bytes (per kind)");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda (the CUDA backend)");
ABSL_FLAG(bool, cuda_graphs, false, "cuda: decode steps as CUDA graphs (false: eager launches)");
ABSL_FLAG(std::vector<std::string>, kv_cache, std::vector<std::string>({"full", "compressed"}),
          "comma-separated KV cache kinds, each measured in turn: full (paged full-rank), "
          "quantized (paged q8_0 rows, CPU only), compressed (low-rank), transform (the codec "
          "of --codec)");
ABSL_FLAG(std::string, codec, "",
          "transform: codec file from subspace-calibrate --kv-budget, as the server's --codec");

namespace subspace {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchConfig {
  std::string device;                      // cpu or cuda
  std::string codec_path;                  // --codec (transform)
  std::shared_ptr<const CodecFile> codec;  // loaded, checked against the model
  bool cuda_graphs = false;
  std::vector<int> batches;
  int prompt_len = 0;
  int decode_len = 0;
  int prefill_batch = 0;  // 0: all
  int repeats = 1;
  int64_t kv_cache_bytes = 0;
};

struct Cell {
  double prefill_tps = 0;    // median over the repeats
  double decode_tps = 0;     // median over the repeats
  double decode_spread = 0;  // (max - min) / median of decode tokens/s over the repeats
  KvCacheStats stats;        // at the end of decode, before the sequences are freed
};

// One kind's results, one cell per batch size.
struct KindResult {
  std::string kind;
  std::string device_name;
  std::vector<Cell> cells;
};

int64_t BytesUsed(const KvCacheStats& s) {
  return s.bytes_used_full + s.bytes_used_compressed + s.bytes_used_outlier;
}

double Ratio(double num, double den) { return den > 0 ? num / den : 0.0; }

absl::StatusOr<Cell> Measure(ModelRunner& model, KvCacheBase& cache, int batch, int prompt_len,
                             int decode_len, int prefill_batch, uint64_t seed) {
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
  // Prefill: the prompts in steps of prefill_batch sequences (all in one step by default), as
  // the scheduler batches them.
  std::vector<SequenceChunk> chunks;
  const int per_step = prefill_batch > 0 ? std::min(prefill_batch, batch) : batch;
  auto start = Clock::now();
  for (int b0 = 0; b0 < batch; b0 += per_step) {
    chunks.clear();
    for (int b = b0; b < std::min(batch, b0 + per_step); ++b) {
      chunks.push_back({seqs[b], 0, prompts[b], false});
    }
    if (absl::Status s = model.Forward(chunks, cache, &logits); !s.ok()) return s;
  }
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
  cell.stats = cache.Stats();
  for (SeqId s : seqs) cache.FreeSequence(s).IgnoreError();
  return cell;
}

// The server's backend for the kind, with the server's defaults (runtime/backend.h). cpu: a cache
// over the shared CPU model; cuda: a whole backend (weights, activations and pool in one device
// allocation) per kind, from the CUDA plugin.
absl::StatusOr<runtime::Backend> CreateBackend(const std::shared_ptr<LlamaModel>& cpu_model,
                                               const BenchConfig& config, const std::string& kind) {
  absl::StatusOr<runtime::Device> device = runtime::ParseDevice(config.device);
  if (!device.ok()) return device.status();
  absl::StatusOr<runtime::KvCacheKind> cache_kind = runtime::ParseKvCacheKind(kind);
  if (!cache_kind.ok()) return cache_kind.status();
  runtime::KvCacheOptions options;
  options.kind = *cache_kind;
  if (options.kind == runtime::KvCacheKind::kTransform) options.codec_path = config.codec_path;
  constexpr int kBlockSize = 16;
  if (absl::Status st = runtime::ValidateKvCacheOptions(options, kBlockSize); !st.ok()) return st;
  const int max_batch = *std::max_element(config.batches.begin(), config.batches.end());
  const int prefill_seqs =
      config.prefill_batch > 0 ? std::min(config.prefill_batch, max_batch) : max_batch;
  return runtime::CreateBackend(
      {.device = *device,
       .block_size = kBlockSize,
       .kv_cache_bytes = config.kv_cache_bytes,
       .max_batch_tokens = std::max(prefill_seqs * config.prompt_len, max_batch),
       .max_running = max_batch,
       .cuda_graphs = config.cuda_graphs},
      cpu_model, runtime::ResolveKvCacheOptions(options, cpu_model->config().cache_geometry()),
      {.codec = config.codec});
}

// Builds the kind's backend, measures every batch size (median of config.repeats) and drops the
// backend again before the next kind takes its memory.
absl::StatusOr<KindResult> MeasureKind(const std::shared_ptr<LlamaModel>& cpu_model,
                                       const BenchConfig& config, const std::string& kind) {
  absl::StatusOr<runtime::Backend> backend = CreateBackend(cpu_model, config, kind);
  if (!backend.ok()) return backend.status();
  KindResult result{.kind = kind, .device_name = backend->model->device_name()};
  for (const int batch : config.batches) {
    Cell median;
    std::vector<double> prefill, decode;
    for (int r = 0; r < config.repeats; ++r) {
      absl::StatusOr<Cell> cell =
          Measure(*backend->model, *backend->cache, batch, config.prompt_len, config.decode_len,
                  config.prefill_batch, r);
      if (!cell.ok()) {
        return absl::Status(cell.status().code(), absl::StrCat(kind, " cache, batch ", batch, ": ",
                                                               cell.status().message()));
      }
      prefill.push_back(cell->prefill_tps);
      decode.push_back(cell->decode_tps);
      median.stats = cell->stats;  // the same every repeat: same lengths, same block rounding
    }
    std::sort(prefill.begin(), prefill.end());
    std::sort(decode.begin(), decode.end());
    median.prefill_tps = prefill[prefill.size() / 2];
    median.decode_tps = decode[decode.size() / 2];
    median.decode_spread = Ratio(decode.back() - decode.front(), median.decode_tps);
    result.cells.push_back(median);
  }
  return result;
}

// Weight bytes one decode step streams: every layer matrix and the output head (the token
// embedding only gives one row a token, unless it is the output head too).
uint64_t DecodeWeightBytes(const LlamaModel& model) {
  const auto bytes = [](const WeightMatrix& w) {
    return static_cast<uint64_t>(w.rows) * w.row_bytes();
  };
  uint64_t total = bytes(model.output());
  for (const LlamaModel::Layer& l : model.layers()) {
    for (const WeightMatrix* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) {
      total += bytes(*w);
    }
  }
  return total;
}

void PrintTables(const BenchConfig& config, const std::vector<KindResult>& results) {
  std::printf(
      "| batch | KV cache   | prefill tokens/s | decode tokens/s | decode spread "
      "| decode ms/step | KV MiB used | fp16-equivalent / used |\n");
  std::printf(
      "|------:|:-----------|-----------------:|----------------:|--------------:"
      "|---------------:|------------:|-----------------------:|\n");
  for (size_t i = 0; i < config.batches.size(); ++i) {
    for (const KindResult& r : results) {
      const Cell& c = r.cells[i];
      const int64_t used = BytesUsed(c.stats);
      std::printf("| %5d | %-10s | %16.1f | %15.1f | %12.0f%% | %14.2f | %11.2f | %22.2f |\n",
                  config.batches[i], r.kind.c_str(), c.prefill_tps, c.decode_tps,
                  100.0 * c.decode_spread, Ratio(1000.0 * config.batches[i], c.decode_tps),
                  used / 1048576.0, Ratio(c.stats.bytes_full_fp16_equivalent, used));
    }
  }
  const KindResult* full = nullptr;
  const KindResult* compressed = nullptr;
  for (const KindResult& r : results) {
    if (r.kind == "full") full = &r;
    if (r.kind == "compressed") compressed = &r;
  }
  if (full == nullptr || compressed == nullptr) return;
  std::printf("\nCompressed against full: decode tokens/s ratio next to the KV bytes ratio.\n\n");
  std::printf("| batch | decode speedup compressed/full | KV bytes full/compressed |\n");
  std::printf("|------:|-------------------------------:|-------------------------:|\n");
  for (size_t i = 0; i < config.batches.size(); ++i) {
    const Cell& f = full->cells[i];
    const Cell& c = compressed->cells[i];
    std::printf("| %5d | %30.2f | %24.2f |\n", config.batches[i], Ratio(c.decode_tps, f.decode_tps),
                Ratio(BytesUsed(f.stats), BytesUsed(c.stats)));
  }
}

absl::Status Run() {
  BenchConfig config;
  config.device = absl::GetFlag(FLAGS_device);
  config.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  if (config.device != "cpu" && config.device != "cuda") {
    return absl::InvalidArgumentError("--device must be cpu or cuda");
  }
  const std::vector<std::string> kinds = absl::GetFlag(FLAGS_kv_cache);
  if (kinds.empty()) return absl::InvalidArgumentError("--kv-cache names no kind");
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (absl::Status st = runtime::ParseKvCacheKind(kinds[i]).status(); !st.ok()) return st;
    if (std::find(kinds.begin(), kinds.begin() + i, kinds[i]) != kinds.begin() + i) {
      return absl::InvalidArgumentError(absl::StrCat("--kv-cache names ", kinds[i], " twice"));
    }
  }
  for (const std::string& b : absl::GetFlag(FLAGS_batch)) config.batches.push_back(std::stoi(b));
  if (config.batches.empty() ||
      *std::min_element(config.batches.begin(), config.batches.end()) < 1) {
    return absl::InvalidArgumentError("--batch sizes must be at least 1");
  }
  config.repeats = absl::GetFlag(FLAGS_repeats);
  config.prefill_batch = absl::GetFlag(FLAGS_prefill_batch);
  if (config.prefill_batch < 0) return absl::InvalidArgumentError("--prefill-batch must be >= 0");
  if (config.repeats < 1) return absl::InvalidArgumentError("--repeats must be at least 1");
  config.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);

  absl::StatusOr<std::unique_ptr<LlamaModel>> opened = LlamaModel::Open(absl::GetFlag(FLAGS_model));
  if (!opened.ok()) return opened.status();
  const std::shared_ptr<LlamaModel> cpu_model = *std::move(opened);
  const ModelConfig cfg = cpu_model->config();
  config.codec_path = absl::GetFlag(FLAGS_codec);
  if (!config.codec_path.empty()) {
    absl::StatusOr<std::unique_ptr<GgufFile>> gguf = GgufFile::Open(absl::GetFlag(FLAGS_model));
    if (!gguf.ok()) return gguf.status();
    absl::StatusOr<std::shared_ptr<const CodecFile>> codec =
        runtime::LoadCodec(config.codec_path, **gguf, cfg.cache_geometry());
    if (!codec.ok()) return codec.status();
    config.codec = *std::move(codec);
  }
  config.prompt_len = absl::GetFlag(FLAGS_prompt_tokens);
  config.decode_len = absl::GetFlag(FLAGS_decode_tokens);
  if (config.prompt_len + config.decode_len > cfg.context_length) {
    config.prompt_len = cfg.context_length - config.decode_len;
  }
  if (config.prompt_len < 1 || config.decode_len < 1) {
    return absl::InvalidArgumentError("prompt and decode lengths must fit the context");
  }

  std::vector<KindResult> results;
  for (const std::string& kind : kinds) {
    absl::StatusOr<KindResult> r = MeasureKind(cpu_model, config, kind);
    if (!r.ok()) return r.status();
    results.push_back(*std::move(r));
  }

  std::printf("device %s, KV caches %s\n", results.front().device_name.c_str(),
              absl::StrJoin(kinds, ", ").c_str());
  std::printf("model %s: dim %d, layers %d, heads %d/%d, vocab %d, context %d\n",
              absl::GetFlag(FLAGS_model).c_str(), cfg.dim, cfg.n_layers, cfg.n_heads,
              cfg.n_kv_heads, cfg.n_vocab, cfg.context_length);
  std::printf("prompt %d tokens, decode %d tokens, median of %d; KV bytes at the end of decode\n\n",
              config.prompt_len, config.decode_len, config.repeats);
  PrintTables(config, results);
  // Decode on the CPU is a stream of the weights: their read rate at batch 1, for a
  // comparison with the machine's read bandwidth (subspace-bench-matmul prints it).
  const uint64_t weight_bytes = DecodeWeightBytes(*cpu_model);
  for (const KindResult& r : results) {
    for (size_t i = 0; i < config.batches.size(); ++i) {
      if (config.batches[i] != 1 || r.cells[i].decode_tps <= 0) continue;
      std::printf("\ndecode weight reads (%s, batch 1): %.1f MB a step, %.1f GB/s\n",
                  r.kind.c_str(), weight_bytes / 1e6, weight_bytes * r.cells[i].decode_tps / 1e9);
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace subspace

int main(int argc, char** argv) {
  subspace::cli::ParseFlags(argc, argv, "subspace-bench-cpu [flags]");
  if (absl::Status s = subspace::Run(); !s.ok()) {
    std::fprintf(stderr, "subspace-bench-cpu: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
