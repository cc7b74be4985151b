// What the engine needs from a model, whichever backend runs it: the hyper-parameters and one
// batched forward step over a KvCache. LlamaModel (core/model/model.h) runs it on the CPU; the CUDA
// backend (cuda/cuda_model.h) on a GPU. The engine, scheduler and sessions see only this.
#ifndef SUBSPACE_CORE_MODEL_MODEL_RUNNER_H_
#define SUBSPACE_CORE_MODEL_MODEL_RUNNER_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/base/rope.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/kv_cache.h"
#include "core/model/sampler.h"

namespace subspace {

struct OpTrace;  // core/model/decoder_ops.h

struct ModelConfig {
  // general.architecture: "llama" (also Mistral, Llama 3), "qwen2", "qwen3" or "phi3".
  std::string architecture;
  std::string name;
  int n_vocab = 0;
  int dim = 0;  // embedding width
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;  // attention.key_length; dim / n_heads when absent (Qwen3 differs)
  int ffn_dim = 0;
  int context_length = 0;
  int sliding_window = 0;  // attention.sliding_window (every layer), 0 for none
  int rope_dim = 0;        // dims rotated per head (rope.dimension_count, default head_dim)
  float rope_theta = 10000.0f;
  RopeLayout rope_layout = RopeLayout::kAdjacentPairs;  // kHalves for qwen2, qwen3, phi3
  float rope_freq_scale = 1.0f;                         // 1 / rope.scaling.factor (linear)
  std::vector<float> rope_freq_factors;                 // rope_freqs.weight (Llama 3.x), or none
  bool rope_yarn = false;                               // rope.scaling.type = yarn
  int rope_yarn_original_context = 0;                   // rope.scaling.original_context_length
  float rope_attn_factor = 1.0f;                        // rope.scaling.attn_factor
  float rms_eps = 1e-5f;
  bool tied_output = false;  // output.weight absent: reuse token_embd
  bool qkv_bias = false;     // attn_{q,k,v}.bias (Qwen2)
  bool qk_norm = false;      // attn_{q,k}_norm.weight: RMSNorm per head before RoPE (Qwen3)

  // Reads <arch>.* metadata; INVALID_ARGUMENT naming the key when missing or inconsistent,
  // UNIMPLEMENTED for what the forward pass does not do (another architecture, YaRN).
  static absl::StatusOr<ModelConfig> FromGguf(const GgufFile& file);
  KvCacheGeometry cache_geometry() const { return {n_layers, n_kv_heads, head_dim}; }
  int q_width() const { return n_heads * head_dim; }
  int kv_width() const { return n_kv_heads * head_dim; }
  // The RoPE schedule both backends rotate by (FromGguf has checked it can be made).
  absl::StatusOr<RopeSchedule> rope() const;
};

// One sequence's part of a step: tokens at positions [pos, pos + tokens.size()).
struct SequenceChunk {
  SeqId seq = -1;
  int64_t pos = 0;
  std::span<const int32_t> tokens;
  bool all_logits = false;  // logits for every token (perplexity) instead of the last only
};

// Runs one step. Each chunk's range must already be reserved in `cache`; on success the cache
// holds the chunk's K/V and Length(seq) = pos + size. `logits` gets, per chunk in order, one row
// of n_vocab floats (last token), or one per token when all_logits. INVALID_ARGUMENT for token
// ids out of range, empty chunks, positions past the context or not equal to the cache length,
// or a cache the backend cannot run on.
class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  virtual const ModelConfig& config() const = 0;
  // "cpu", or "cuda:0 (NVIDIA H100 80GB HBM3)": for logs and the server's startup line.
  virtual std::string device_name() const = 0;
  virtual absl::Status Forward(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                               std::vector<float>* logits) = 0;
  // Forward, recording every op's outputs (core/model/decoder_ops.h) into `trace`: for tests
  // that compare backends op by op; slow (each output copied out, a device's graphs not used).
  // UNIMPLEMENTED where the backend cannot.
  virtual absl::Status ForwardTraced(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                                     std::vector<float>* logits, OpTrace* trace);

  // Runners that sample on their own device (the CUDA backend) instead of returning logits:
  // Forward, then chunk i's logits row sampled with rows[i]; only the chosen tokens and their
  // log-probabilities come back (`sampled`: one per chunk). INVALID_ARGUMENT for all_logits
  // chunks or a rows count other than the chunks'; UNIMPLEMENTED where samples_rows() is false.
  virtual bool samples_rows() const { return false; }
  virtual absl::Status ForwardAndSample(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                                        std::span<const RowSampling> rows,
                                        std::vector<TokenLogprob>* sampled);
};

// The checks every Forward makes before writing anything (the errors documented above, plus
// FAILED_PRECONDITION for an unreserved range and INVALID_ARGUMENT for a cache whose geometry is
// not the model's or a sequence in two chunks). On success `total_tokens` gets the step's tokens
// and `total_logit_rows` the logit rows it returns. `seq_scratch` is reusable scratch.
absl::Status ValidateStep(const ModelConfig& config, std::span<const SequenceChunk> batch,
                          const KvCacheBase& cache, const std::vector<float>* logits,
                          std::vector<SeqId>* seq_scratch, int64_t* total_tokens,
                          int64_t* total_logit_rows);

}  // namespace subspace

#endif  // SUBSPACE_CORE_MODEL_MODEL_RUNNER_H_
