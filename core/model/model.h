// Llama-family decoder forward pass on the CPU backend (the ModelRunner of --device cpu):
// RMSNorm, RoPE, GQA attention through a KvCache, SwiGLU, tied or separate output; with
// Qwen2's Q/K/V biases, Qwen3's per-head Q/K norms and Phi-3's fused QKV and gate-up tensors
// (read as row slices of the fused matrix, no copy). One Forward
// call is one engine step: any mix of prefill chunks and single-token decodes of many
// sequences, batched through every matmul.
#ifndef SUBSPACE_CORE_MODEL_MODEL_H_
#define SUBSPACE_CORE_MODEL_MODEL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/base/rope.h"
#include "core/base/weight.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/kv_cache.h"
#include "core/model/decoder_ops.h"
#include "core/model/model_runner.h"

namespace subspace {

class LlamaModel final : public ModelRunner {
 public:
  // Keeps `file` alive: weights are read in place from its mapping.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(std::shared_ptr<const GgufFile> file);
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Open(const std::string& path);

  const ModelConfig& config() const override { return config_; }
  std::string device_name() const override { return "cpu"; }
  const GgufFile& file() const { return *file_; }

  // The weights as mapped from the file (checked shapes and types): other backends upload them.
  struct Layer {
    const float* attn_norm = nullptr;   // [dim]
    WeightMatrix wq, wk, wv, wo;        // [n_heads*hd, dim], [n_kv*hd, dim] x2, [dim, n_heads*hd]
    const float* bq = nullptr;          // [n_heads*hd] (Qwen2), or null
    const float* bk = nullptr;          // [n_kv*hd], or null
    const float* bv = nullptr;          // [n_kv*hd], or null
    const float* q_norm = nullptr;      // [hd] (Qwen3), or null
    const float* k_norm = nullptr;      // [hd], or null
    const float* ffn_norm = nullptr;    // [dim]
    WeightMatrix w_gate, w_up, w_down;  // [ffn, dim] x2, [dim, ffn]
  };
  const WeightMatrix& token_embd() const { return token_embd_; }
  const float* output_norm() const { return output_norm_; }  // [dim]
  const WeightMatrix& output() const { return output_; }     // token_embd when tied
  const std::vector<Layer>& layers() const { return layers_; }

  // ModelRunner::Forward on the CPU. INVALID_ARGUMENT for a cache that is not a host KvCache.
  absl::Status Forward(std::span<const SequenceChunk> batch, KvCacheBase& cache_base,
                       std::vector<float>* logits) override;
  absl::Status ForwardTraced(std::span<const SequenceChunk> batch, KvCacheBase& cache_base,
                             std::vector<float>* logits, OpTrace* trace) override;
  // The ops Forward runs (the CUDA backend runs the same list).
  const DecoderProgram& program() const { return program_; }

  ~LlamaModel() override;

 private:
  struct Workspace;

  LlamaModel() = default;
  absl::Status Run(std::span<const SequenceChunk> batch, KvCacheBase& cache_base,
                   std::vector<float>* logits, OpTrace* trace);

  std::shared_ptr<const GgufFile> file_;
  ModelConfig config_;
  WeightMatrix token_embd_;
  const float* output_norm_ = nullptr;
  WeightMatrix output_;
  std::vector<Layer> layers_;
  DecoderProgram program_;
  std::vector<std::vector<float>> f32_copies_;  // norm weights stored as F16/BF16 in the file
  std::unique_ptr<Workspace> ws_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_MODEL_MODEL_H_
