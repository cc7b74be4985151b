// CudaLlamaModel: start-up (sizing and carving the one device allocation, uploading weights as
// fp16, fused [wq; wk; wv] and [w_gate; w_up]) and the step: host plan into pinned memory
// (cuda_step_plan.h), one copy to the device, then per layer RMSNorm → QKV GEMM → RoPE/split →
// KV append → attention (decode and prefill kernels) → output GEMM → residual → RMSNorm →
// gate/up GEMM → SwiGLU → down GEMM → residual; final norm of the logit rows, vocabulary GEMM,
// one copy back.
#include "kernels/cuda_model.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/ggml_types.h"
#include "kernels/append_kv.h"
#include "kernels/cuda_kv_store.h"
#include "kernels/cuda_status.h"
#include "kernels/cuda_step_plan.h"
#include "kernels/decode_attention.h"
#include "kernels/decode_plan_builder.h"
#include "kernels/device_compressed_kv_cache.h"
#include "kernels/device_info.h"
#include "kernels/device_memory.h"
#include "kernels/embedding.h"
#include "kernels/expand_blocks.h"
#include "kernels/gemm.h"
#include "kernels/outlier_tokens.h"
#include "kernels/prefill_attention.h"
#include "kernels/residual.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/sampling.h"
#include "kernels/step_graphs.h"
#include "kernels/swiglu.h"

namespace subspace::kernels {
namespace {

constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;
constexpr float kFp16Max = 65504.0f;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct DeviceLayer {
  float* attn_norm = nullptr;     // [dim]
  uint16_t* wqkv = nullptr;       // [(n_heads + 2 n_kv) * hd, dim]
  uint16_t* wo = nullptr;         // [dim, n_heads * hd]
  float* ffn_norm = nullptr;      // [dim]
  uint16_t* w_gate_up = nullptr;  // [2 * ffn, dim]
  uint16_t* w_down = nullptr;     // [dim, ffn]
};

}  // namespace

struct CudaLlamaModel::Impl {
  ModelConfig config;
  CudaModelOptions options;
  std::string device_name;
  int target_ctas = 0;  // decode split-K: 2 CTAs per multiprocessor
  int64_t max_blocks_per_seq = 0;
  std::unique_ptr<DeviceAllocation> memory;
  cudaStream_t stream = nullptr;
  std::unique_ptr<Gemm> gemm;
  MemoryUse use;

  // Weights.
  uint16_t* embd = nullptr;  // [vocab, dim]
  float* output_norm = nullptr;
  uint16_t* output = nullptr;  // [vocab, dim]; == embd when tied
  std::vector<DeviceLayer> layers;
  float* rope_table = nullptr;  // [context, rope_dim / 2, 2]
  // Activations for max_batch_tokens rows.
  float *x = nullptr, *qkv = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *attn = nullptr,
        *proj = nullptr, *gate_up = nullptr, *logits = nullptr;
  uint16_t *xn = nullptr, *attn16 = nullptr, *hidden = nullptr;
  float* decode_workspace = nullptr;
  void* cublas_workspace = nullptr;
  uint8_t* meta_device = nullptr;
  uint8_t* kv_pool = nullptr;  // full-rank cache: [n_layers, num_blocks, page_bytes]
  int64_t kv_pool_bytes = 0;
  // Compressed cache: its layers' geometry, its device buffers and the prefill scratch pages
  // ([scratch_pages, page_bytes], one sequence's context, reused by every layer and group).
  std::vector<KvPoolLayout> layouts;
  CudaKvStore::Device store_device;
  std::shared_ptr<CudaKvStore> store;
  int64_t num_pages = 0;
  uint8_t* scratch = nullptr;
  int64_t scratch_pages = 0;
  StepMetaLayout meta;
  std::unique_ptr<PinnedHostBuffer> meta_host;
  std::unique_ptr<PinnedHostBuffer> logits_host;  // [T, vocab] fp32
  const KvCacheBase* cache = nullptr;  // the one created with this model: one of
  DevicePagedKvCache* paged = nullptr;
  DeviceCompressedKvCache* compressed = nullptr;

  // Per-step host scratch (reused; grows only to the largest step).
  std::vector<SeqId> seq_scratch;
  StepPlanner planner;
  StepPlan plan;
  StepGraphs graphs;  // decode steps' executable graphs, by batch size

  ~Impl() {
    gemm.reset();
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  int64_t QkvWidth() const {
    return static_cast<int64_t>(config.n_heads + 2 * config.n_kv_heads) * config.head_dim;
  }
  int64_t QWidth() const { return static_cast<int64_t>(config.n_heads) * config.head_dim; }
  int64_t KvWidth() const { return static_cast<int64_t>(config.n_kv_heads) * config.head_dim; }

  // Every buffer but the KV pool, in a fixed order: run once counting (null base), once for real.
  void CarveBuffers(Carver& c) {
    const ModelConfig& m = config;
    const int64_t t = options.max_batch_tokens, dim = m.dim, ffn = m.ffn_dim;
    const int64_t weights_start = c.used();
    embd = c.TakeArray<uint16_t>(static_cast<int64_t>(m.n_vocab) * dim);
    output_norm = c.TakeArray<float>(dim);
    layers.assign(static_cast<size_t>(m.n_layers), DeviceLayer{});
    for (DeviceLayer& l : layers) {
      l.attn_norm = c.TakeArray<float>(dim);
      l.wqkv = c.TakeArray<uint16_t>(QkvWidth() * dim);
      l.wo = c.TakeArray<uint16_t>(dim * QWidth());
      l.ffn_norm = c.TakeArray<float>(dim);
      l.w_gate_up = c.TakeArray<uint16_t>(2 * ffn * dim);
      l.w_down = c.TakeArray<uint16_t>(dim * ffn);
    }
    output = m.tied_output ? embd : c.TakeArray<uint16_t>(static_cast<int64_t>(m.n_vocab) * dim);
    use.weights = c.used() - weights_start;

    const int64_t act_start = c.used();
    rope_table = c.TakeArray<float>(static_cast<int64_t>(m.context_length) * (m.rope_dim / 2) * 2);
    x = c.TakeArray<float>(t * dim);
    xn = c.TakeArray<uint16_t>(t * dim);
    qkv = c.TakeArray<float>(t * QkvWidth());
    q = c.TakeArray<float>(t * QWidth());
    k = c.TakeArray<float>(t * KvWidth());
    v = c.TakeArray<float>(t * KvWidth());
    attn = c.TakeArray<float>(t * QWidth());
    attn16 = c.TakeArray<uint16_t>(t * QWidth());
    proj = c.TakeArray<float>(t * dim);
    gate_up = c.TakeArray<float>(t * 2 * ffn);
    hidden = c.TakeArray<uint16_t>(t * ffn);
    logits = c.TakeArray<float>(t * m.n_vocab);
    // Split-K partials: [work, n_heads, 4 + head_dim + epochs * r_v] (DecodePartialStride); a
    // sequence of the compressed cache has one epoch (static bases), the full cache none.
    const int64_t max_work = MaxDecodeWork(options.max_sequences, {.target_ctas = target_ctas});
    int64_t max_rank_v = 0;
    for (const KvPoolLayout& l : layouts) max_rank_v = std::max<int64_t>(max_rank_v, l.rank_v);
    decode_workspace = c.TakeArray<float>(max_work * m.n_heads * (4 + m.head_dim + max_rank_v));
    if (options.compressed) {
      scratch_pages = max_blocks_per_seq;
      scratch = c.Take(scratch_pages * layouts[0].page_bytes);
    }
    cublas_workspace = c.Take(kCublasWorkspaceBytes);
    meta_device = c.Take(meta.total);
    use.activations = c.used() - act_start;
  }

  // The compressed cache's per-layer geometry: ranks from the basis when one is given, else the
  // options (head_dim / 4 when empty). INVALID_ARGUMENT for what the kernels cannot address.
  absl::Status LayoutCompressedLayers() {
    const CudaCompressedCacheOptions& co = *options.compressed;
    const int n_layers = config.n_layers;
    if (co.basis_capacity < 1) {
      return absl::InvalidArgumentError("CUDA backend: basis_capacity must be >= 1");
    }
    if (co.readback_pages < 0) {
      return absl::InvalidArgumentError("CUDA backend: readback_pages must be >= 0");
    }
    layouts.clear();
    for (int l = 0; l < n_layers; ++l) {
      const auto rank = [&](const std::vector<int>& given, bool key) {
        if (co.basis != nullptr && co.basis->layers.size() == static_cast<size_t>(n_layers)) {
          const LayerBasis& lb = co.basis->layers[static_cast<size_t>(l)];
          return key ? lb.rank_k : lb.rank_v;
        }
        if (given.size() == static_cast<size_t>(n_layers)) return given[static_cast<size_t>(l)];
        return std::max(1, config.head_dim / 4);
      };
      layouts.push_back(MakeKvPoolLayout(config.n_kv_heads, config.head_dim, options.block_size,
                                         rank(co.r_k, true), rank(co.r_v, false),
                                         co.coeff_dtype));
      if (const char* error = KvPoolLayoutError(layouts.back()); error != nullptr) {
        return absl::InvalidArgumentError(
            absl::StrFormat("CUDA backend, compressed KV cache, layer %d: %s", l, error));
      }
    }
    return absl::OkStatus();
  }

  // The KV pool of `kv_bytes` (whole page ids) and, for the compressed cache, its basis tables
  // and staging area.
  void CarvePool(Carver& c, int64_t kv_bytes) {
    const int64_t block_bytes = DevicePagedKvCache::BlockBytes(config.cache_geometry(),
                                                               options.block_size);
    if (!options.compressed) {
      kv_pool = c.Take(kv_bytes);
      kv_pool_bytes = kv_bytes;
      return;
    }
    num_pages = kv_bytes / block_bytes;
    CudaKvStore::CarveDevice(c, layouts, num_pages, options.compressed->basis_capacity,
                             &store_device);
  }

  void LayoutMeta(int64_t pool_blocks) {
    meta = LayoutStepMeta({.max_tokens = options.max_batch_tokens,
                           .max_sequences = options.max_sequences,
                           .max_blocks_per_seq = max_blocks_per_seq,
                           .pool_blocks = pool_blocks,
                           .n_kv_heads = config.n_kv_heads,
                           .target_ctas = target_ctas,
                           .compressed = options.compressed.has_value(),
                           .outliers = options.compressed.has_value() &&
                                       options.compressed->outlier_threshold < 1.0f});
  }

  template <typename T>
  T* MetaDevice(int64_t offset) {
    return reinterpret_cast<T*>(meta_device + offset);
  }

  absl::Status Upload(void* dst, const void* src, int64_t bytes, std::string_view what) {
    return CudaStatus(cudaMemcpy(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice),
                      what);
  }

  // Rows of `w` as fp16 appended to `out`; INVALID_ARGUMENT naming `name` for a value fp16 cannot
  // hold (bf16 and fp32 weights have more range).
  static absl::Status AppendFp16Rows(const WeightMatrix& w, std::string_view name,
                                     std::vector<uint16_t>* out) {
    std::vector<float> row(static_cast<size_t>(w.cols));
    out->reserve(out->size() + static_cast<size_t>(w.rows * w.cols));
    for (int64_t r = 0; r < w.rows; ++r) {
      if (w.type == GgmlType::kF16) {
        const auto* src = reinterpret_cast<const uint16_t*>(w.row(r));
        out->insert(out->end(), src, src + w.cols);
        continue;
      }
      DequantizeRow(w.type, w.row(r), row.data(), w.cols);
      for (int64_t c = 0; c < w.cols; ++c) {
        const float value = row[static_cast<size_t>(c)];
        if (!(std::fabs(value) <= kFp16Max)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "weight %s[%d, %d] = %g does not fit fp16, the CUDA backend's weight type",
              std::string(name), r, c, value));
        }
        out->push_back(Fp32ToFp16(value));
      }
    }
    return absl::OkStatus();
  }

  absl::Status UploadMatrices(std::initializer_list<std::pair<const WeightMatrix*, const char*>> ws,
                              uint16_t* dst, std::string_view what) {
    std::vector<uint16_t> host;
    for (const auto& [w, name] : ws) {
      if (absl::Status st = AppendFp16Rows(*w, name, &host); !st.ok()) return st;
    }
    return Upload(dst, host.data(), static_cast<int64_t>(host.size() * 2), what);
  }

  absl::Status UploadWeights(const LlamaModel& model) {
    const int64_t dim = config.dim;
    if (absl::Status st = UploadMatrices({{&model.token_embd(), "token_embd"}}, embd, "token_embd");
        !st.ok()) {
      return st;
    }
    if (!config.tied_output) {
      if (absl::Status st = UploadMatrices({{&model.output(), "output"}}, output, "output");
          !st.ok()) {
        return st;
      }
    }
    if (absl::Status st = Upload(output_norm, model.output_norm(), dim * 4, "output_norm");
        !st.ok()) {
      return st;
    }
    for (size_t i = 0; i < layers.size(); ++i) {
      const LlamaModel::Layer& src = model.layers()[i];
      const DeviceLayer& dst = layers[i];
      const std::string at = absl::StrCat("layer ", i);
      absl::Status st = Upload(dst.attn_norm, src.attn_norm, dim * 4, at);
      if (st.ok()) st = Upload(dst.ffn_norm, src.ffn_norm, dim * 4, at);
      if (st.ok()) {
        st = UploadMatrices({{&src.wq, "attn_q"}, {&src.wk, "attn_k"}, {&src.wv, "attn_v"}},
                            dst.wqkv, at);
      }
      if (st.ok()) st = UploadMatrices({{&src.wo, "attn_output"}}, dst.wo, at);
      if (st.ok()) {
        st = UploadMatrices({{&src.w_gate, "ffn_gate"}, {&src.w_up, "ffn_up"}}, dst.w_gate_up, at);
      }
      if (st.ok()) st = UploadMatrices({{&src.w_down, "ffn_down"}}, dst.w_down, at);
      if (!st.ok()) return st;
    }
    const std::vector<float> table =
        RopeCosSinTable(config.context_length, config.rope_dim, config.rope_theta);
    return Upload(rope_table, table.data(), static_cast<int64_t>(table.size() * 4), "rope table");
  }

  absl::Status Launch(cudaError_t err, std::string_view what) { return CudaStatus(err, what); }

  const KvPoolLayout& LayerLayout(int layer) const {
    return paged != nullptr ? paged->layout() : layouts[static_cast<size_t>(layer)];
  }
  uint8_t* LayerPool(int layer) const {
    return paged != nullptr ? paged->LayerPool(layer) : store->LayerPool(layer);
  }
  // Forward and ForwardAndSample after their checks: one of out_logits and (rows, sampled).
  absl::Status Run(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                   std::vector<float>* out_logits, std::span<const RowSampling> rows,
                   std::vector<TokenLogprob>* sampled);
  absl::Status Step(std::span<const SequenceChunk> batch, int64_t t_rows, int64_t logit_rows,
                    std::vector<float>* out_logits, std::span<const RowSampling> rows,
                    std::vector<TokenLogprob>* sampled);
  // The logits rows sampled with `rows`, their tokens and log-probabilities copied back (waited
  // for by the step's synchronisation).
  absl::Status EnqueueSampling(std::span<const RowSampling> rows);
  // Everything a planned step runs on the stream, from the plan copy to the logits: what a
  // decode step's graph captures.
  absl::Status EnqueueForward(int64_t t_rows, int64_t n_logit_rows);
};

namespace {

absl::Status CheckOptions(const ModelConfig& m, const CudaModelOptions& o) {
  if (o.max_batch_tokens < 1 || o.max_sequences < 1 || o.max_sequences > 65535) {
    return absl::InvalidArgumentError(
        "CUDA backend: max_batch_tokens must be >= 1 and max_sequences in [1, 65535]");
  }
  if (o.block_size < 1 || o.block_size > kMaxBlockSize) {
    return absl::InvalidArgumentError(absl::StrFormat("CUDA backend: block size %d outside [1, %d]",
                                                      o.block_size, kMaxBlockSize));
  }
  if (o.kv_cache_bytes < 0 || !(o.gpu_memory_fraction >= 0.0 && o.gpu_memory_fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        "CUDA backend: kv_cache_bytes must be >= 0 and gpu_memory_fraction in [0, 1]");
  }
  if (o.kv_cache_bytes == 0 && o.gpu_memory_fraction == 0.0) {
    return absl::InvalidArgumentError(
        "CUDA backend: set the KV pool by kv_cache_bytes or gpu_memory_fraction");
  }
  if (m.head_dim != 64 && m.head_dim != 128) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CUDA backend: head_dim %d; the attention kernels support 64 and 128", m.head_dim));
  }
  if (m.rope_dim % 2 != 0 || m.rope_dim > m.head_dim) {
    return absl::InvalidArgumentError("CUDA backend: rope_dim must be even and <= head_dim");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CudaBackend> CreateCudaBackend(const LlamaModel& model,
                                              const CudaModelOptions& options) {
  const ModelConfig& m = model.config();
  if (absl::Status st = CheckOptions(m, options); !st.ok()) return st;
  std::string why;
  const std::vector<CudaDeviceInfo> devices = ListCudaDevices(&why);
  if (options.device < 0 || options.device >= static_cast<int>(devices.size())) {
    return absl::UnavailableError(absl::StrFormat("CUDA device %d not available (%d found)%s",
                                                  options.device, devices.size(),
                                                  why.empty() ? "" : absl::StrCat(": ", why)));
  }
  const CudaDeviceInfo& dev = devices[static_cast<size_t>(options.device)];
  if (absl::Status st = CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"); !st.ok()) {
    return st;
  }

  auto impl = std::make_unique<CudaLlamaModel::Impl>();
  CudaLlamaModel::Impl& s = *impl;
  s.config = m;
  s.options = options;
  s.device_name = absl::StrFormat("cuda:%d (%s)", dev.index, dev.name);
  s.target_ctas = 2 * dev.multiprocessors;
  s.max_blocks_per_seq = CeilDiv(m.context_length, options.block_size);
  if (options.compressed) {
    if (absl::Status st = s.LayoutCompressedLayers(); !st.ok()) return st;
  }

  // Size everything but the pool, then the pool from what is left. One page id costs a page in
  // every layer, compressed cache or not.
  const int64_t block_bytes =
      DevicePagedKvCache::BlockBytes(m.cache_geometry(), options.block_size);
  int64_t kv_bytes = options.kv_cache_bytes;
  {
    // The plan bound depends on the pool's block count; size it for the pool first guessed.
    const int64_t guess = kv_bytes > 0
                              ? kv_bytes
                              : static_cast<int64_t>(options.gpu_memory_fraction *
                                                     static_cast<double>(dev.total_memory_bytes));
    s.LayoutMeta(guess / block_bytes);
    Carver count(nullptr, 0);
    s.CarveBuffers(count);
    s.CarvePool(count, 0);
    if (kv_bytes == 0) {
      kv_bytes = guess - count.used();
      if (kv_bytes < block_bytes) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "CUDA backend: gpu_memory_fraction %g of %d MiB leaves no KV pool after %d MiB of "
            "weights and buffers",
            options.gpu_memory_fraction, dev.total_memory_bytes >> 20, count.used() >> 20));
      }
    }
  }
  kv_bytes = kv_bytes / block_bytes * block_bytes;
  Carver count(nullptr, 0);
  s.CarveBuffers(count);
  s.CarvePool(count, kv_bytes);
  const int64_t total = count.used();
  absl::StatusOr<std::unique_ptr<DeviceAllocation>> memory =
      DeviceAllocation::Create(total, "CUDA backend (weights, activations, KV pool)");
  if (!memory.ok()) return memory.status();
  s.memory = *std::move(memory);
  Carver carve(s.memory->data(), s.memory->bytes());
  s.CarveBuffers(carve);
  s.CarvePool(carve, kv_bytes);
  s.use.kv_pool = kv_bytes;
  if (!carve.ok()) return absl::InternalError("CUDA backend: carving overran its allocation");

  if (absl::Status st = CudaStatus(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking),
                                   "cudaStreamCreate");
      !st.ok()) {
    return st;
  }
  absl::StatusOr<std::unique_ptr<Gemm>> gemm =
      Gemm::Create(s.stream, s.cublas_workspace, kCublasWorkspaceBytes);
  if (!gemm.ok()) return gemm.status();
  s.gemm = *std::move(gemm);
  absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> meta_host =
      PinnedHostBuffer::Create(s.meta.total, "step plan");
  if (!meta_host.ok()) return meta_host.status();
  s.meta_host = *std::move(meta_host);
  absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> logits_host = PinnedHostBuffer::Create(
      static_cast<int64_t>(options.max_batch_tokens) * m.n_vocab * 4, "logits");
  if (!logits_host.ok()) return logits_host.status();
  s.logits_host = *std::move(logits_host);
  if (absl::Status st = s.UploadWeights(model); !st.ok()) return st;

  if (options.compressed) {
    absl::StatusOr<std::unique_ptr<CudaKvStore>> store =
        CudaKvStore::Create(s.layouts, s.num_pages, options.compressed->basis_capacity,
                            options.compressed->readback_pages, s.store_device, s.stream);
    if (!store.ok()) return store.status();
    s.store = *std::move(store);
  }

  std::shared_ptr<CudaLlamaModel> runner(new CudaLlamaModel(std::move(impl)));
  CudaLlamaModel::Impl& r = *runner->impl_;
  if (!options.compressed) {
    absl::StatusOr<std::unique_ptr<DevicePagedKvCache>> cache = DevicePagedKvCache::Create(
        {.geometry = m.cache_geometry(), .block_size = options.block_size}, r.kv_pool,
        r.kv_pool_bytes, runner);
    if (!cache.ok()) return cache.status();
    r.cache = r.paged = cache->get();
    return CudaBackend{std::move(runner), *std::move(cache)};
  }
  const CudaCompressedCacheOptions& co = *options.compressed;
  DeviceCompressedKvCacheConfig cc;
  cc.geometry = m.cache_geometry();
  cc.block_size = options.block_size;
  cc.sink_tokens = co.sink_tokens;
  cc.window_tokens = co.window_tokens;
  for (const KvPoolLayout& l : r.layouts) {
    cc.r_k.push_back(l.rank_k);
    cc.r_v.push_back(l.rank_v);
  }
  cc.coeff_dtype = co.coeff_dtype;
  cc.num_pages = r.num_pages;
  cc.refresh = co.refresh;
  cc.refresh_inline = co.refresh_inline;
  cc.outlier_threshold = co.outlier_threshold;
  // The store's buffers are the runner's: the cache keeps the runner alive through it.
  absl::StatusOr<std::unique_ptr<DeviceCompressedKvCache>> cache = DeviceCompressedKvCache::Create(
      cc, std::shared_ptr<CompressedKvStore>(runner, r.store.get()));
  if (!cache.ok()) return cache.status();
  if (co.basis != nullptr) {
    absl::StatusOr<EpochId> epoch = (*cache)->InstallBasis(co.basis);
    if (!epoch.ok()) return epoch.status();
    if (absl::Status st = (*cache)->SetDefaultEpoch(*epoch); !st.ok()) return st;
    if (absl::Status st = (*cache)->ReleaseEpoch(*epoch); !st.ok()) return st;
  }
  r.cache = r.compressed = cache->get();
  return CudaBackend{std::move(runner), *std::move(cache)};
}

CudaLlamaModel::CudaLlamaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaLlamaModel::~CudaLlamaModel() = default;
const ModelConfig& CudaLlamaModel::config() const { return impl_->config; }
std::string CudaLlamaModel::device_name() const { return impl_->device_name; }
CudaLlamaModel::MemoryUse CudaLlamaModel::memory_use() const { return impl_->use; }
StepGraphStats CudaLlamaModel::graph_stats() const { return impl_->graphs.stats(); }

absl::Status CudaLlamaModel::Forward(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                                     std::vector<float>* logits) {
  return impl_->Run(batch, cache, logits, {}, nullptr);
}

absl::Status CudaLlamaModel::ForwardAndSample(std::span<const SequenceChunk> batch,
                                              KvCacheBase& cache, std::span<const RowSampling> rows,
                                              std::vector<TokenLogprob>* sampled) {
  if (rows.size() != batch.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d sampling rows for %d chunks: one per chunk", rows.size(), batch.size()));
  }
  for (const SequenceChunk& ch : batch) {
    if (ch.all_logits) return absl::InvalidArgumentError("device sampling takes one row per chunk");
  }
  if (sampled == nullptr) return absl::InvalidArgumentError("null sampled");
  return impl_->Run(batch, cache, nullptr, rows, sampled);
}

absl::Status CudaLlamaModel::Impl::Run(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                                       std::vector<float>* logits,
                                       std::span<const RowSampling> rows,
                                       std::vector<TokenLogprob>* sampled) {
  Impl& s = *this;
  int64_t t_rows = 0, logit_rows = 0;
  // ValidateStep wants the logits vector only to tell "none" from "some": the sampled path has
  // its own output.
  std::vector<float> unused;
  if (absl::Status st = ValidateStep(s.config, batch, cache, logits != nullptr ? logits : &unused,
                                     &s.seq_scratch, &t_rows, &logit_rows);
      !st.ok()) {
    return st;
  }
  if (&cache != s.cache) {
    return absl::InvalidArgumentError(
        "the CUDA backend runs only on the device KV cache created with it");
  }
  if (t_rows > s.options.max_batch_tokens ||
      static_cast<int64_t>(batch.size()) > s.options.max_sequences) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "step of %d tokens in %d chunks exceeds the CUDA backend's %d tokens / %d sequences",
        t_rows, batch.size(), s.options.max_batch_tokens, s.options.max_sequences));
  }
  if (absl::Status st = CudaStatus(cudaSetDevice(s.options.device), "cudaSetDevice"); !st.ok()) {
    return st;
  }
  return s.Step(batch, t_rows, logit_rows, logits, rows, sampled);
}

absl::Status CudaLlamaModel::Impl::Step(std::span<const SequenceChunk> batch, int64_t t_rows,
                                        int64_t n_logit_rows, std::vector<float>* out_logits,
                                        std::span<const RowSampling> rows,
                                        std::vector<TokenLogprob>* sampled) {
  const ModelConfig& m = config;
  KvCacheBase& cache = paged != nullptr ? static_cast<KvCacheBase&>(*paged) : *compressed;
  // Compressions queued outside a step (a Commit by the engine) run before this step's writes.
  if (compressed != nullptr) {
    if (absl::Status st = compressed->Flush(); !st.ok()) return st;
  }

  // ---- Plan on the host: decodes first, then prefill chunks (cuda_step_plan.h). ------------
  const StepPlanInputs inputs = {
      .meta = &meta,
      .meta_host = meta_host->data(),
      .block_size = options.block_size,
      .n_kv_heads = m.n_kv_heads,
      .target_ctas = target_ctas,
      .paged = paged,
      .compressed = compressed,
      .num_pages = num_pages,
      .basis_capacity = compressed != nullptr ? store->basis_capacity() : 0,
      .scratch_pages = scratch_pages};
  if (absl::Status st = planner.Plan(inputs, batch, &plan); !st.ok()) return st;

  // ---- The forward pass: replayed as a graph for decode-only steps (step_graphs.h). --------
  absl::Status st =
      options.cuda_graphs && plan.n_prefill == 0
          ? graphs.Run(stream, plan.n_decode, [&] { return EnqueueForward(t_rows, n_logit_rows); })
          : EnqueueForward(t_rows, n_logit_rows);

  // ---- Logits of the rows asked for back to the host, or the tokens sampled from them. -------
  const size_t logit_bytes = static_cast<size_t>(n_logit_rows) * m.n_vocab * sizeof(float);
  if (st.ok()) {
    st = !rows.empty() ? EnqueueSampling(rows)
                       : CudaStatus(cudaMemcpyAsync(logits_host->data(), logits, logit_bytes,
                                                    cudaMemcpyDeviceToHost, stream),
                                    "logits copy");
  }
  // Wait even after a failed launch: the host buffers must not be reused while work is queued.
  const absl::Status sync = CudaStatus(cudaStreamSynchronize(stream), "step");
  if (!st.ok()) return st;
  if (!sync.ok()) return sync;
  if (!rows.empty()) {
    const int64_t s_cap = options.max_sequences;
    const auto* token = reinterpret_cast<const int32_t*>(meta_host->data() + meta.sample_out);
    const auto* logprob = reinterpret_cast<const float*>(token + s_cap);
    sampled->resize(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) (*sampled)[i] = {token[i], logprob[i]};
  } else {
    out_logits->resize(static_cast<size_t>(n_logit_rows) * m.n_vocab);
    std::memcpy(out_logits->data(), logits_host->data(), logit_bytes);
  }

  for (const SequenceChunk& ch : batch) {
    if (absl::Status c = cache.Commit(ch.seq, ch.pos + static_cast<int64_t>(ch.tokens.size()));
        !c.ok()) {
      return c;
    }
  }
  // The blocks that left the window, coded in one batch on the stream (ahead of the next step).
  return compressed != nullptr ? compressed->Flush() : absl::OkStatus();
}

absl::Status CudaLlamaModel::Impl::EnqueueSampling(std::span<const RowSampling> rows) {
  // [5, S] parameters in the pinned metadata, copied whole (S is small), then the kernel over
  // the logits rows (one per chunk) and [2, S] results back into the pinned metadata.
  const int64_t s_cap = options.max_sequences;
  uint8_t* params = meta_host->data() + meta.sample_params;
  auto* temperature = reinterpret_cast<float*>(params);
  auto* top_k = reinterpret_cast<int32_t*>(temperature + s_cap);
  auto* top_p = reinterpret_cast<float*>(top_k + s_cap);
  auto* min_p = top_p + s_cap;
  auto* uniform = min_p + s_cap;
  for (size_t i = 0; i < rows.size(); ++i) {
    temperature[i] = rows[i].temperature;
    top_k[i] = rows[i].top_k;
    top_p[i] = rows[i].top_p;
    min_p[i] = rows[i].min_p;
    uniform[i] = rows[i].uniform;
  }
  if (absl::Status st = CudaStatus(
          cudaMemcpyAsync(meta_device + meta.sample_params, params,
                          static_cast<size_t>(5 * s_cap * 4), cudaMemcpyHostToDevice, stream),
          "sampling parameters copy");
      !st.ok()) {
    return st;
  }
  const auto* d_params = reinterpret_cast<const float*>(meta_device + meta.sample_params);
  auto* d_token = reinterpret_cast<int32_t*>(meta_device + meta.sample_out);
  if (absl::Status st =
          Launch(LaunchSampleTokens({.logits = logits,
                                     .temperature = d_params,
                                     .top_k = reinterpret_cast<const int32_t*>(d_params + s_cap),
                                     .top_p = d_params + 2 * s_cap,
                                     .min_p = d_params + 3 * s_cap,
                                     .uniform = d_params + 4 * s_cap,
                                     .token = d_token,
                                     .logprob = reinterpret_cast<float*>(d_token + s_cap),
                                     .n_rows = static_cast<int32_t>(rows.size()),
                                     .vocab = config.n_vocab},
                                    stream),
                 "sampling");
      !st.ok()) {
    return st;
  }
  return CudaStatus(
      cudaMemcpyAsync(meta_host->data() + meta.sample_out, d_token,
                      static_cast<size_t>(2 * s_cap * 4), cudaMemcpyDeviceToHost, stream),
      "sampled tokens copy");
}

absl::Status CudaLlamaModel::Impl::EnqueueForward(int64_t t_rows, int64_t n_logit_rows) {
  const ModelConfig& m = config;
  const int64_t n_decode = plan.n_decode, n_prefill = plan.n_prefill;

  // ---- One copy of the plan to the device. -------------------------------------------------
  if (absl::Status st = CudaStatus(
          cudaMemcpyAsync(meta_device, meta_host->data(), static_cast<size_t>(plan.meta_bytes),
                          cudaMemcpyHostToDevice, stream),
          "plan copy");
      !st.ok()) {
    return st;
  }
  // The expansion lists (after the plan's capacity): the used prefix of each.
  const int64_t n_exp = plan.n_exp;
  // With outliers to put back, their lists too (ints of 4 bytes; the mask is two).
  const int64_t n_exp_outliers = plan.exp_outliers ? n_exp : 0;
  for (const auto& [offset, ints] :
       {std::pair{meta.exp_src_page, n_exp}, std::pair{meta.exp_src_slot, n_exp},
        std::pair{meta.exp_dst, n_exp}, std::pair{meta.exp_epoch, n_exp * m.n_kv_heads},
        std::pair{meta.exp_outlier_mask, 2 * n_exp_outliers},
        std::pair{meta.exp_outlier_first, n_exp_outliers},
        std::pair{meta.exp_outlier_pages, 2 * n_exp_outliers}}) {
    if (ints == 0) continue;
    if (absl::Status st = CudaStatus(
            cudaMemcpyAsync(meta_device + offset, meta_host->data() + offset,
                            static_cast<size_t>(ints) * 4, cudaMemcpyHostToDevice, stream),
            "expansion list copy");
        !st.ok()) {
      return st;
    }
  }

  // ---- The layers. --------------------------------------------------------------------------
  const int32_t t = static_cast<int32_t>(t_rows);
  const int64_t dim = m.dim;
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(m.head_dim));
  absl::Status st = Launch(LaunchEmbedding({.table = embd,
                                            .tokens = MetaDevice<int32_t>(meta.tokens),
                                            .out = x,
                                            .n = t,
                                            .dim = m.dim,
                                            .n_vocab = m.n_vocab},
                                           stream),
                           "embedding");
  for (int l = 0; l < m.n_layers && st.ok(); ++l) {
    const DeviceLayer& w = layers[static_cast<size_t>(l)];
    uint8_t* pool = LayerPool(l);
    const KvPoolLayout& layout = LayerLayout(l);
    st = Launch(
        LaunchRmsNorm(
            {.x = x, .weight = w.attn_norm, .out = xn, .n = t, .dim = m.dim, .eps = m.rms_eps},
            stream),
        "attention norm");
    if (st.ok()) st = gemm->Linear(w.wqkv, QkvWidth(), dim, xn, t, qkv);
    if (st.ok()) {
      st = Launch(LaunchRopeSplitQkv({.qkv = qkv,
                                      .positions = MetaDevice<int32_t>(meta.positions),
                                      .cos_sin = rope_table,
                                      .q = q,
                                      .k = k,
                                      .v = v,
                                      .n = t,
                                      .n_heads = m.n_heads,
                                      .n_kv_heads = m.n_kv_heads,
                                      .head_dim = m.head_dim,
                                      .rope_dim = m.rope_dim,
                                      .max_position = m.context_length},
                                     stream),
                  "rope");
    }
    if (st.ok()) {
      st = Launch(LaunchAppendKv({.layout = layout,
                                  .pool = pool,
                                  .k = k,
                                  .v = v,
                                  .slot_mapping = MetaDevice<int64_t>(meta.slot_mapping),
                                  .n = t},
                                 stream),
                  "kv append");
    }
    if (st.ok() && n_decode > 0) {
      DecodeAttentionParams p;
      p.layout = layout;
      p.plan = plan.decode.DeviceView(meta_device + meta.plan);
      p.pool = pool;
      if (compressed != nullptr) {
        p.basis_pq = store->basis_pq(l);
        p.basis_rv = store->basis_rv(l);
      }
      p.q = q;
      p.out = attn;
      p.workspace = decode_workspace;
      p.n_heads = m.n_heads;
      p.sm_scale = sm_scale;
      st = Launch(LaunchDecodeAttention(p, stream), "decode attention");
    }
    // Prefill chunks, group by group: the group's compressed history expanded into the scratch
    // pages (this layer's bases), then attention over pool and scratch pages.
    for (size_t g = 0; st.ok() && n_prefill > 0 && g < plan.group_end.size(); ++g) {
      const int first = g == 0 ? 0 : plan.group_end[g - 1];
      const int64_t e0 = plan.group_exp[g], n_expand = plan.group_exp[g + 1] - e0;
      if (n_expand > 0) {
        ExpandBlocksParams ep;
        ep.layout = layout;
        ep.src_pool = pool;
        ep.dst_pool = scratch;
        ep.basis_pq = store->basis_pq(l);
        ep.basis_rv = store->basis_rv(l);
        ep.src_page = MetaDevice<int32_t>(meta.exp_src_page) + e0;
        ep.src_slot = MetaDevice<int32_t>(meta.exp_src_slot) + e0;
        ep.dst_page = MetaDevice<int32_t>(meta.exp_dst) + e0;
        ep.epoch = MetaDevice<int32_t>(meta.exp_epoch) + e0 * m.n_kv_heads;
        ep.n_blocks = static_cast<int32_t>(n_expand);
        st = Launch(LaunchExpandBlocks(ep, stream), "history expansion");
        if (st.ok() && plan.exp_outliers) {
          // The expanded blocks' outliers, exact, from the pool's outlier pages.
          OutlierTokensParams op;
          op.layout = layout;
          op.block_pool = scratch;
          op.outlier_pool = pool;
          op.block_page = MetaDevice<int32_t>(meta.exp_dst) + e0;
          op.mask = MetaDevice<uint64_t>(meta.exp_outlier_mask) + e0;
          op.first_slot = MetaDevice<int32_t>(meta.exp_outlier_first) + e0;
          op.outlier_page = MetaDevice<int32_t>(meta.exp_outlier_pages) + 2 * e0;
          op.n_blocks = static_cast<int32_t>(n_expand);
          op.direction = OutlierMove::kToBlockPages;
          st = Launch(LaunchOutlierTokens(op, stream), "history outliers");
        }
        if (!st.ok()) break;
      }
      // q_indptr holds rows from the first prefill row, so a group only moves the pointers.
      const int64_t off = n_decode * QWidth();
      PrefillAttentionParams pp;
      pp.layout = layout;
      pp.pool = pool;
      pp.scratch = scratch;
      pp.block_table = MetaDevice<int32_t>(meta.block_table) + int64_t{first} * plan.table_stride;
      pp.seq_q_indptr = MetaDevice<int32_t>(meta.q_indptr) + first;
      pp.seq_q_start = MetaDevice<int32_t>(meta.q_start) + first;
      pp.q = q + off;
      pp.out = attn + off;
      pp.num_seqs = plan.group_end[g] - first;
      pp.max_blocks = plan.table_stride;
      pp.max_q_per_seq = plan.max_q;
      pp.n_heads = m.n_heads;
      pp.sm_scale = sm_scale;
      st = Launch(LaunchPrefillAttention(pp, stream), "prefill attention");
    }
    if (st.ok()) {
      st = Launch(LaunchCastToHalf({.in = attn, .out = attn16, .n = t_rows * QWidth()}, stream),
                  "attention cast");
    }
    if (st.ok()) st = gemm->Linear(w.wo, dim, QWidth(), attn16, t, proj);
    if (st.ok()) {
      st = Launch(LaunchResidualAdd({.x = x, .y = proj, .n = t_rows * dim}, stream), "residual");
    }
    if (st.ok()) {
      st = Launch(
          LaunchRmsNorm(
              {.x = x, .weight = w.ffn_norm, .out = xn, .n = t, .dim = m.dim, .eps = m.rms_eps},
              stream),
          "ffn norm");
    }
    if (st.ok()) st = gemm->Linear(w.w_gate_up, 2 * int64_t{m.ffn_dim}, dim, xn, t, gate_up);
    if (st.ok()) {
      st = Launch(
          LaunchSwiGlu({.gate_up = gate_up, .out = hidden, .n = t, .ffn = m.ffn_dim}, stream),
          "swiglu");
    }
    if (st.ok()) st = gemm->Linear(w.w_down, dim, m.ffn_dim, hidden, t, proj);
    if (st.ok()) {
      st = Launch(LaunchResidualAdd({.x = x, .y = proj, .n = t_rows * dim}, stream), "residual");
    }
  }

  // ---- Logits of the rows asked for. -----------------------------------------------------------
  const int32_t rows = static_cast<int32_t>(n_logit_rows);
  if (st.ok()) {
    st = Launch(LaunchRmsNorm({.x = x,
                               .weight = output_norm,
                               .rows = MetaDevice<int32_t>(meta.logit_rows),
                               .out = xn,
                               .n = rows,
                               .dim = m.dim,
                               .eps = m.rms_eps},
                              stream),
                "output norm");
  }
  if (st.ok()) st = gemm->Linear(output, m.n_vocab, dim, xn, rows, logits);
  return st;
}

}  // namespace subspace::kernels
