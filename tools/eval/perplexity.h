// Perplexity of a token stream under the model, in windows of at most the context length.
// The windowing rule is shared with tools/train/eval_lib.py so both report the same number:
// the text's tokens (no BOS) are cut into consecutive chunks of `window - 1`; each window is
// [BOS] + chunk, scored from scratch, so every token is predicted exactly once (the first of a
// chunk from BOS alone).
#ifndef SUBSPACE_TOOLS_EVAL_PERPLEXITY_H_
#define SUBSPACE_TOOLS_EVAL_PERPLEXITY_H_

#include <cstdint>
#include <functional>
#include <span>

#include "absl/status/statusor.h"
#include "core/kvcache/kv_cache.h"
#include "core/model/model.h"

namespace subspace::eval {

struct PerplexityResult {
  double perplexity = 0.0;
  double mean_nll = 0.0;      // nats per predicted token
  int64_t tokens_scored = 0;  // predicted tokens
  int64_t windows = 0;
};

// -log softmax(row)[target], in double for a stable sum over many tokens.  row: [n_vocab]
double NegLogLikelihood(const float* row, int n_vocab, int32_t target);

// `tokens`: the text's tokens without BOS. `window` in [2, context].
// `progress(done, total)` is called after each window when given.
absl::StatusOr<PerplexityResult> ComputePerplexity(
    LlamaModel& model, KvCache& cache, std::span<const int32_t> tokens, int32_t bos_id, int window,
    const std::function<void(int64_t, int64_t)>& progress = nullptr);

}  // namespace subspace::eval

#endif  // SUBSPACE_TOOLS_EVAL_PERPLEXITY_H_
