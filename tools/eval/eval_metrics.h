// Quality metrics of a basis epoch (tools/eval_main.cc, docs/quality.md): perplexity with the
// prefill fed in small chunks so the compressed cache really attends over compressed blocks,
// a KvCache decorator that captures one sequence's post-RoPE Q, K, V per layer, and the
// per-head error metrics of a basis on captured tensors (key reconstruction, logits, attention
// output, residual energy). Errors are returned as sums so heads and layers can be pooled:
// relative error = sqrt(err2 / ref2), residual-energy ratio = err2 / ref2.
#ifndef SUBSPACE_TOOLS_EVAL_EVAL_METRICS_H_
#define SUBSPACE_TOOLS_EVAL_EVAL_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/kvcache/forwarding_kv_cache.h"
#include "core/kvcache/kv_cache.h"
#include "core/model/model.h"
#include "tools/eval/perplexity.h"

namespace subspace::eval {

// Squared-error and reference sums of one metric, additive over heads, layers and tokens.
struct ErrorSums {
  double err2 = 0.0;
  double ref2 = 0.0;
  ErrorSums& operator+=(const ErrorSums& o) {
    err2 += o.err2;
    ref2 += o.ref2;
    return *this;
  }
  // sqrt(err2 / ref2); 0 when ref2 is 0.
  double Relative() const;
  // err2 / ref2 (an energy ratio); 0 when ref2 is 0.
  double EnergyRatio() const;
};

// All matrices row-major float. Per head: p_q, p_k [d, r]; p_v [d, r_v]; r_v [r_v, d];
// x, q, k, v [n, d] with row stride `stride` (>= d; lets callers pass one head of a
// [n, n_heads, d] tensor: pointer to the head's first row, stride n_heads * d).

// Key as the query sees it: err2 = sum ||k - P_q P_k^T k||^2, ref2 = sum ||k||^2.
ErrorSums KeyReconstructionError(int d, int r, const float* p_q, const float* p_k, const float* k,
                                 int64_t n, int64_t stride);
// Residual energy outside span(p) (orthogonal projector onto the column space of p, which
// need not be orthonormal): err2 = sum ||x - Pi x||^2, ref2 = sum ||x||^2.
ErrorSums ResidualEnergy(int d, int r, const float* p, const float* x, int64_t n, int64_t stride);
// Causal logits of one query head: pairs (i, j) with j <= i, exact q_i . k_j vs
// (P_q^T q_i) . (P_k^T k_j) (the 1/sqrt(d) scale cancels in the ratio).
// q, k: [n, d] (positions 0..n-1 of one sequence).
ErrorSums LogitError(int d, int r, const float* p_q, const float* p_k, const float* q,
                     int64_t q_stride, const float* k, int64_t k_stride, int64_t n);
// Causal attention output of one query head (scale 1/sqrt(d)), exact vs every key and value
// replaced by its low-rank form (logit (P_q^T q) . (P_k^T k), value R_v^T P_v^T v), no sinks or
// window kept full-rank: err2 = sum_i ||o_i - o^_i||^2, ref2 = sum_i ||o_i||^2.
ErrorSums AttentionOutputError(int d, int r_k, int r_v, const float* p_q, const float* p_k,
                               const float* p_v, const float* r_v_mat, const float* q,
                               int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                               int64_t v_stride, int64_t n);

// Forwards everything to `inner` and records, for sequences written from position 0, the
// post-RoPE keys/values (Write) and queries (Attend) of every layer, by position. Meant for one
// sequence at a time (capture, then read, then FreeSequence).
class CapturingKvCache final : public ForwardingKvCache {
 public:
  CapturingKvCache(std::unique_ptr<KvCache> inner, int n_heads);

  void Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k, const float* v) override;
  void Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) override;

  // Per layer: k, v [tokens, n_kv, d]; q [tokens, n_heads, d]. Tokens = the longest written.
  struct Layer {
    std::vector<float> k, v, q;
  };
  const std::vector<Layer>& layers() const { return layers_; }
  int64_t tokens() const;
  int n_heads() const { return n_heads_; }

 private:
  int n_heads_;
  absl::Mutex mu_;
  std::vector<Layer> layers_;
};

// Perplexity with ComputePerplexity's windowing ([BOS] + window - 1 tokens, each window a fresh
// sequence), but each window is fed in steps of `chunk` tokens (all logits), so the cache
// commits, and a compressed cache compresses, between steps: later queries attend over
// compressed blocks, as in decoding. Also samples the cache footprint at the end of each
// window, before the sequence is freed.
struct ChunkedPerplexityOptions {
  int window = 512;
  int chunk = 16;
  int32_t bos = -1;
  std::function<void(int64_t done, int64_t total)> progress;  // per window; may be empty
};
struct ChunkedPerplexityResult {
  PerplexityResult ppl;
  // Summed over windows at their end: bytes used (full + compressed + outlier) and the fp16
  // full-rank equivalent of the same tokens, and the compressed part alone.
  int64_t bytes_used = 0;
  int64_t bytes_compressed = 0;
  int64_t bytes_fp16_equivalent = 0;
  double Ratio() const {  // bytes used / full fp16
    return bytes_fp16_equivalent > 0
               ? static_cast<double>(bytes_used) / static_cast<double>(bytes_fp16_equivalent)
               : 0.0;
  }
};
absl::StatusOr<ChunkedPerplexityResult> ComputeChunkedPerplexity(
    LlamaModel& model, KvCache& cache, std::span<const int32_t> tokens,
    const ChunkedPerplexityOptions& options);

}  // namespace subspace::eval

#endif  // SUBSPACE_TOOLS_EVAL_EVAL_METRICS_H_
