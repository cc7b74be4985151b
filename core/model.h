// Llama-family decoder forward pass on the CPU backend: RMSNorm, RoPE, GQA attention through
// a KvCache, SwiGLU, tied or separate output. One Forward call is one engine step: any mix of
// prefill chunks and single-token decodes of many sequences, batched through every matmul.
#ifndef SUBSPACE_CORE_MODEL_H_
#define SUBSPACE_CORE_MODEL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/gguf.h"
#include "core/kv_cache.h"
#include "core/weight.h"

namespace subspace {

struct ModelConfig {
  std::string architecture;  // "llama"
  std::string name;
  int n_vocab = 0;
  int dim = 0;          // embedding width
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;     // dim / n_heads
  int ffn_dim = 0;
  int context_length = 0;
  int rope_dim = 0;     // dims rotated per head (rope.dimension_count, default head_dim)
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  bool tied_output = false;  // output.weight absent: reuse token_embd

  // Reads llama.* metadata; INVALID_ARGUMENT naming the key when missing or inconsistent.
  static absl::StatusOr<ModelConfig> FromGguf(const GgufFile& file);
  KvCacheGeometry cache_geometry() const { return {n_layers, n_kv_heads, head_dim}; }
};

// One sequence's part of a step: tokens at positions [pos, pos + tokens.size()).
struct SequenceChunk {
  SeqId seq = -1;
  int64_t pos = 0;
  std::span<const int32_t> tokens;
  bool all_logits = false;  // logits for every token (perplexity) instead of the last only
};

class LlamaModel {
 public:
  // Keeps `file` alive: weights are read in place from its mapping.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(std::shared_ptr<const GgufFile> file);
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Open(const std::string& path);

  const ModelConfig& config() const { return config_; }
  const GgufFile& file() const { return *file_; }

  // Runs one step. Each chunk's range must already be reserved in `cache`; on success the
  // cache holds the chunk's K/V and Length(seq) = pos + size. `logits` gets, per chunk in
  // order, one row of n_vocab floats (last token), or one per token when all_logits.
  // INVALID_ARGUMENT for token ids out of range, empty chunks, positions past the context
  // or not equal to the cache length.
  absl::Status Forward(std::span<const SequenceChunk> batch, KvCache& cache,
                       std::vector<float>* logits);

  ~LlamaModel();

 private:
  struct Layer {
    const float* attn_norm = nullptr;  // [dim]
    WeightMatrix wq, wk, wv, wo;       // [n_heads*hd, dim], [n_kv*hd, dim] x2, [dim, n_heads*hd]
    const float* ffn_norm = nullptr;   // [dim]
    WeightMatrix w_gate, w_up, w_down; // [ffn, dim] x2, [dim, ffn]
  };
  struct Workspace;

  LlamaModel() = default;

  std::shared_ptr<const GgufFile> file_;
  ModelConfig config_;
  WeightMatrix token_embd_;
  const float* output_norm_ = nullptr;
  WeightMatrix output_;
  std::vector<Layer> layers_;
  std::vector<std::vector<float>> f32_copies_;  // norm weights stored as F16/BF16 in the file
  std::unique_ptr<Workspace> ws_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_MODEL_H_
