// The CUDA backend's forward pass (--device cuda): the Llama decoder of core/model/model.h on a
// GPU. Weights live on the device as fp16 (GEMMs through cuBLAS with fp32 accumulation); the
// residual stream is fp32; keys/values go to a DevicePagedKvCache, a DeviceCompressedKvCache or a
// DeviceTransformKvCache (whose coded history a chunk attends through its kind's expansion
// kernel into scratch pages). Each
// step's metadata (tokens, positions, slot mapping, block tables, the decode plan) is built on the
// host into a pinned buffer and copied to the device once; decodes run the split-K decode attention
// kernel and prefill chunks the tiled prefill kernel. Everything is carved from one device
// allocation at start-up: nothing is allocated per request.
#ifndef SUBSPACE_CUDA_CUDA_MODEL_H_
#define SUBSPACE_CUDA_CUDA_MODEL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/base/coeff_codec.h"
#include "core/compress/basis.h"
#include "core/compress/compression_policy.h"
#include "core/compress/transform_codec.h"
#include "core/kvcache/refresh_config.h"
#include "core/model/model.h"
#include "core/model/model_runner.h"
#include "cuda/device_paged_kv_cache.h"

namespace subspace::cuda {

// --kv-cache=compressed on the GPU (DeviceCompressedKvCache): its policy, as the CPU cache's.
struct CudaCompressedCacheOptions {
  // Sinks, window, ranks, coefficient dtype (fp16 or int8), outliers (the device cache decides
  // them once for every layer), self-calibration.
  CompressionPolicy policy;
  // Installed as the default epoch (--bases); null: the first sequence to compress builds one.
  std::shared_ptr<const Basis> basis;
  int basis_capacity = 8;  // epochs the device basis tables hold
  // Online refresh every new sequence starts with (pca, oja or fd; sessions may ask for their
  // own). The refresher reads back at most readback_pages blocks per step (pinned host memory:
  // readback_pages x n_layers pages).
  RefreshConfig refresh;
  bool refresh_inline = false;  // refresh on the engine thread: deterministic (tests)
  int64_t readback_pages = 16;
  // kqsvd refresh reads back the query rows of its sequences, every layer's, as fp16: a device
  // buffer and a pinned one of up to this many bytes each (n_layers x n_heads x head_dim x 2
  // bytes a row; at least max_sequences rows, so every decode's query fits, at most
  // max_batch_tokens). A long prefill chunk past it is read back as an even, weighted subset.
  // 0: no readback, kqsvd refused.
  int64_t query_readback_bytes = int64_t{16} << 20;
};

// --kv-cache=transform on the GPU (DeviceTransformKvCache): the CPU cache's sinks and window
// and the codec's codes (a codec file or a start-up fit).
struct CudaTransformCacheOptions {
  int sink_tokens = CompressionPolicy::kDefaultSinkTokens;
  int window_tokens = CompressionPolicy::kDefaultWindowTokens;
  // Layer l, KV head h at [l * n_kv_heads + h], each of dimension head_dim.
  std::shared_ptr<const std::vector<TransformCode>> key_codes, value_codes;
  // Keys coded before RoPE with the model's own schedule (CodecFileInfo::pre_rope_keys).
  bool pre_rope_keys = false;
};

struct CudaModelOptions {
  int device = 0;              // CUDA device index
  int max_batch_tokens = 512;  // tokens per step the activations are sized for
  int max_sequences = 64;      // chunks per step (block tables, decode plan)
  int block_size = 16;         // KV block size, 1..64
  // The KV pool: kv_cache_bytes when > 0, else gpu_memory_fraction of the device's total memory
  // minus everything else the backend takes (weights, activations, plan, workspaces).
  int64_t kv_cache_bytes = 0;
  double gpu_memory_fraction = 0.0;
  // Set: the compressed cache (DeviceCompressedKvCache), or the transform-coded one
  // (DeviceTransformKvCache); neither: full-rank pages. At most one.
  std::optional<CudaCompressedCacheOptions> compressed;
  std::optional<CudaTransformCacheOptions> transform;
  // Decode-only steps run as CUDA graphs (cuda/step_graphs.h); false: launched one by one. Off
  // by default: each step is captured and the graph updated, which cost more host time on an
  // H200 than the launch gaps it saves (0.64-0.86x eager, bench/RESULTS.md, 2026-11-26).
  bool cuda_graphs = false;
};

class CudaLlamaModel;
// cuda/step_graphs.h, which needs the CUDA headers this one keeps out of the server.
struct StepGraphStats;

// The backend's two halves: Forward accepts only the cache created with it (a
// DevicePagedKvCache, a DeviceCompressedKvCache with options.compressed, a
// DeviceTransformKvCache with options.transform).
struct CudaBackend {
  std::shared_ptr<CudaLlamaModel> model;
  std::unique_ptr<KvCacheBase> cache;
};

// Uploads `model`'s weights (any stored type, converted to fp16; INVALID_ARGUMENT for a weight
// outside fp16's range or a head_dim other than 64 or 128) and carves the one device allocation.
// RESOURCE_EXHAUSTED when the device cannot hold it; INVALID_ARGUMENT for bad options;
// UNAVAILABLE when there is no such CUDA device. `model` may be dropped afterwards.
absl::StatusOr<CudaBackend> CreateCudaBackend(const LlamaModel& model,
                                              const CudaModelOptions& options);

class CudaLlamaModel final : public ModelRunner {
 public:
  ~CudaLlamaModel() override;

  const ModelConfig& config() const override;
  std::string device_name() const override;
  // ModelRunner::Forward. Also INVALID_ARGUMENT for any cache but the one created with it, and
  // for a step over max_batch_tokens or max_sequences; INTERNAL for a CUDA failure. Synchronous:
  // returns when the logits are on the host.
  absl::Status Forward(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                       std::vector<float>* logits) override;
  // Forward, eagerly, each op's outputs copied back into `trace`.
  absl::Status ForwardTraced(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                             std::vector<float>* logits, OpTrace* trace) override;
  // The logits rows sampled on the device (kernels/sampling.h): only tokens and log-probabilities
  // come back to the host.
  bool samples_rows() const override { return true; }
  absl::Status ForwardAndSample(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                                std::span<const RowSampling> rows,
                                std::vector<TokenLogprob>* sampled) override;

  // Bytes of the one device allocation, and how they split (start-up log, README).
  struct MemoryUse {
    int64_t weights = 0;
    int64_t activations = 0;  // activations, plan mirror, decode and cuBLAS workspaces
    int64_t kv_pool = 0;
  };
  MemoryUse memory_use() const;
  // Decode steps replayed as graphs so far (tests, benchmarks).
  StepGraphStats graph_stats() const;

 private:
  struct Impl;
  explicit CudaLlamaModel(std::unique_ptr<Impl> impl);
  friend absl::StatusOr<CudaBackend> CreateCudaBackend(const LlamaModel&, const CudaModelOptions&);
  std::unique_ptr<Impl> impl_;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_CUDA_MODEL_H_
