// The CUDA backend's state (CudaLlamaModel::Impl), shared by its two halves: cuda_model.cc
// (start-up: sizing and carving the one device allocation, uploading the weights) and
// cuda_model_step.cc (the step). Internal to the backend: nothing else includes it.
#ifndef SUBSPACE_CUDA_CUDA_MODEL_IMPL_H_
#define SUBSPACE_CUDA_CUDA_MODEL_IMPL_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/base/tensor_types.h"
#include "core/model/decoder_ops.h"
#include "cuda/cuda_kv_store.h"
#include "cuda/cuda_model.h"
#include "cuda/cuda_status.h"
#include "cuda/cuda_step_plan.h"
#include "cuda/cuda_transform_store.h"
#include "cuda/decode_plan_builder.h"
#include "cuda/device_compressed_kv_cache.h"
#include "cuda/device_memory.h"
#include "cuda/device_paged_kv_cache.h"
#include "cuda/device_transform_kv_cache.h"
#include "cuda/gemm.h"
#include "cuda/rope_table.h"
#include "cuda/step_graphs.h"
#include "kernels/append_kv.h"
#include "kernels/decode_attention.h"
#include "kernels/device_info.h"
#include "kernels/embedding.h"
#include "kernels/expand_blocks.h"
#include "kernels/outlier_tokens.h"
#include "kernels/prefill_attention.h"
#include "kernels/residual.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/sampling.h"
#include "kernels/swiglu.h"

namespace subspace::cuda {

struct CudaLlamaModel::Impl {
  static constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;
  static constexpr float kFp16Max = 65504.0f;

  struct DeviceLayer {
    float* attn_norm = nullptr;     // [dim]
    uint16_t* wqkv = nullptr;       // [(n_heads + 2 n_kv) * hd, dim]
    float* qkv_bias = nullptr;      // [(n_heads + 2 n_kv) * hd] (Qwen2), or null
    float* q_norm = nullptr;        // [hd] (Qwen3), or null
    float* k_norm = nullptr;        // [hd] (Qwen3), or null
    uint16_t* wo = nullptr;         // [dim, n_heads * hd]
    float* ffn_norm = nullptr;      // [dim]
    uint16_t* w_gate_up = nullptr;  // [2 * ffn, dim]
    uint16_t* w_down = nullptr;     // [dim, ffn]
  };

  ModelConfig config;
  DecoderProgram program;  // the ops a step runs, as on the CPU
  int sliding_window = 0;  // every attention op's window: a step is planned once for all layers
  CudaModelOptions options;
  std::string device_name;
  int target_ctas = 0;  // decode split-K: 8 CTAs per multiprocessor
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
  std::vector<kernels::KvPoolLayout> layouts;
  CudaKvStore::Device store_device;
  std::shared_ptr<CudaKvStore> store;
  // Transform-coded cache: its device buffers and store (the layouts above are its layers').
  CudaTransformStore::Device transform_device;
  std::shared_ptr<CudaTransformStore> transform_store;
  // How the step decodes a group's coded history into the scratch pages: the cache kind's
  // kernels (ExpandLowRank, ExpandTransform), chosen once at start-up; null without codes.
  absl::Status (Impl::*expand_history)(int layer, int64_t first, int64_t n) = nullptr;
  int64_t num_pages = 0;
  uint8_t* scratch = nullptr;
  int64_t scratch_pages = 0;
  // kqsvd refresh: query rows a step reads back, [n_layers, rows, n_heads * head_dim] fp16 on the
  // device and in pinned memory (0 rows: none).
  int64_t query_readback_rows = 0;
  uint16_t* query_readback = nullptr;
  std::unique_ptr<PinnedHostBuffer> query_readback_host;
  StepMetaLayout meta;
  std::unique_ptr<PinnedHostBuffer> meta_host;
  std::unique_ptr<PinnedHostBuffer> logits_host;  // [T, vocab] fp32
  // The cache created with this model (whatever its kind: the step sees only DeviceKvCache),
  // and each layer's bytes as the attention kernels read them.
  struct KvLayer {
    kernels::KvPoolLayout layout;
    uint8_t* pool = nullptr;
    const float* basis_pq = nullptr;  // basis tables of coded blocks (null: none)
    const float* basis_rv = nullptr;
    kernels::TransformTables transform;  // transform-coded blocks' tables (null: none)
    kernels::TransformKeyRope key_rope;
  };
  DeviceKvCache* cache = nullptr;
  std::vector<KvLayer> kv_layers;  // [n_layers]

  // Per-step host scratch (reused; grows only to the largest step).
  std::vector<SeqId> seq_scratch;
  StepPlanner planner;
  StepPlan plan;
  StepGraphs graphs;         // decode steps' executable graphs, by batch size
  OpTrace* trace = nullptr;  // set for one ForwardTraced step

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
      if (m.qkv_bias) l.qkv_bias = c.TakeArray<float>(QkvWidth());
      if (m.qk_norm) {
        l.q_norm = c.TakeArray<float>(m.head_dim);
        l.k_norm = c.TakeArray<float>(m.head_dim);
      }
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
    // Split-K partials: [work, n_heads, 4 + head_dim + u] (DecodePartialStride); a sequence of
    // the compressed cache has one epoch (static bases, u = r_v), the transform cache's u is
    // head_dim (its value components), the full cache's none.
    const int64_t max_work = MaxDecodeWork(options.max_sequences, {.target_ctas = target_ctas});
    int64_t max_u = options.transform ? m.head_dim : 0;
    for (const kernels::KvPoolLayout& l : layouts) max_u = std::max<int64_t>(max_u, l.rank_v);
    decode_workspace = c.TakeArray<float>(max_work * m.n_heads * (4 + m.head_dim + max_u));
    if (options.compressed || options.transform) {
      scratch_pages = max_blocks_per_seq;
      scratch = c.Take(scratch_pages * layouts[0].page_bytes);
    }
    query_readback = c.TakeArray<uint16_t>(QueryReadbackValues());
    cublas_workspace = c.Take(kCublasWorkspaceBytes);
    meta_device = c.Take(meta.total);
    use.activations = c.used() - act_start;
  }

  // Rows of the kqsvd query readback: as many as query_readback_bytes hold, clamped to
  // [min(max_sequences, max_batch_tokens), max_batch_tokens]; 0 when disabled or full-rank.
  int64_t QueryReadbackRows() const {
    if (!options.compressed || options.compressed->query_readback_bytes <= 0) return 0;
    const int64_t row_bytes = config.n_layers * QWidth() * 2;
    const int64_t most = options.max_batch_tokens;
    const int64_t least = std::min<int64_t>(options.max_sequences, most);
    return std::clamp(options.compressed->query_readback_bytes / row_bytes, least, most);
  }
  int64_t QueryReadbackValues() const { return query_readback_rows * config.n_layers * QWidth(); }

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
        return CompressionPolicy::DefaultRank(config.head_dim);
      };
      layouts.push_back(kernels::MakeKvPoolLayout(
          config.n_kv_heads, config.head_dim, options.block_size, rank(co.policy.r_k, true),
          rank(co.policy.r_v, false), co.policy.coeff_dtype));
      if (const char* error = kernels::KvPoolLayoutError(layouts.back()); error != nullptr) {
        return absl::InvalidArgumentError(
            absl::StrFormat("CUDA backend, compressed KV cache, layer %d: %s", l, error));
      }
    }
    return absl::OkStatus();
  }

  // The KV pool of `kv_bytes` (whole page ids) and, for the compressed cache, its basis tables
  // and staging area.
  void CarvePool(Carver& c, int64_t kv_bytes) {
    const int64_t block_bytes =
        DevicePagedKvCache::BlockBytes(config.cache_geometry(), options.block_size);
    if (!options.compressed && !options.transform) {
      kv_pool = c.Take(kv_bytes);
      kv_pool_bytes = kv_bytes;
      return;
    }
    num_pages = kv_bytes / block_bytes;
    if (options.transform) {
      CudaTransformStore::CarveDevice(c, layouts, num_pages, &transform_device);
      return;
    }
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
                           .compressed = options.compressed || options.transform,
                           .outliers = options.compressed.has_value() &&
                                       options.compressed->policy.outliers_enabled(),
                           .query_rows = query_readback_rows});
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
      if (w.type == TensorType::kF16) {
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
      if (st.ok() && dst.qkv_bias != nullptr) {
        // [bq | bk | bv], the columns of the fused projection.
        std::vector<float> bias(static_cast<size_t>(QkvWidth()));
        std::copy_n(src.bq, QWidth(), bias.begin());
        std::copy_n(src.bk, KvWidth(), bias.begin() + QWidth());
        std::copy_n(src.bv, KvWidth(), bias.begin() + QWidth() + KvWidth());
        st = Upload(dst.qkv_bias, bias.data(), QkvWidth() * 4, at);
      }
      if (st.ok() && dst.q_norm != nullptr) {
        st = Upload(dst.q_norm, src.q_norm, int64_t{config.head_dim} * 4, at);
        if (st.ok()) st = Upload(dst.k_norm, src.k_norm, int64_t{config.head_dim} * 4, at);
      }
      if (st.ok()) st = UploadMatrices({{&src.wo, "attn_output"}}, dst.wo, at);
      if (st.ok()) {
        st = UploadMatrices({{&src.w_gate, "ffn_gate"}, {&src.w_up, "ffn_up"}}, dst.w_gate_up, at);
      }
      if (st.ok()) st = UploadMatrices({{&src.w_down, "ffn_down"}}, dst.w_down, at);
      if (!st.ok()) return st;
    }
    const std::vector<float> table = RopeCosSinTable(config.context_length, program.rope);
    return Upload(rope_table, table.data(), static_cast<int64_t>(table.size() * 4), "rope table");
  }

  absl::Status Launch(cudaError_t err, std::string_view what) { return CudaStatus(err, what); }

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
  // The attention op: the step's K/V appended to layer op.layer's pages, then the decode and
  // prefill attention kernels.
  absl::Status EnqueueAttention(const DecoderOp& op, int32_t t);
  // ForwardTraced: op `index`'s outputs copied back (after a synchronisation) into `trace`; with
  // trace->inputs, its inputs loaded from there first.
  absl::Status TraceOutputs(int index, int64_t t_rows, int64_t n_logit_rows);
  absl::Status LoadInputs(int index, int64_t t_rows, int64_t n_logit_rows);
  void* ActivationBuffer(std::string_view name, bool* half);
  // The expansions [first, first + n) of the plan into the scratch pages, for layer `layer`.
  absl::Status ExpandLowRank(int layer, int64_t first, int64_t n);
  absl::Status ExpandTransform(int layer, int64_t first, int64_t n);
  // The transform cache's configuration (before its pool is sized: num_pages 0).
  DeviceTransformKvCacheConfig TransformCacheConfig() const {
    const CudaTransformCacheOptions& o = *options.transform;
    return {.geometry = config.cache_geometry(),
            .block_size = options.block_size,
            .sink_tokens = o.sink_tokens,
            .window_tokens = o.window_tokens,
            .key_codes = o.key_codes,
            .value_codes = o.value_codes,
            .num_pages = num_pages,
            .pre_rope_keys = o.pre_rope_keys};
  }
  // kqsvd refresh: layer `layer`'s planned query rows into the readback buffer (after RoPE).
  absl::Status EnqueueQueryGather(int layer);
  // After the step's synchronisation: each planned sequence's rows to its refresher.
  absl::Status DeliverQueries();
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_CUDA_MODEL_IMPL_H_
