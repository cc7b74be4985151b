// Windowed perplexity: each window is a fresh sequence in the cache, scored with all logits.
#include "tools/eval/perplexity.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace subspace::eval {

double NegLogLikelihood(const float* row, int n_vocab, int32_t target) {
  float max_logit = row[0];
  for (int i = 1; i < n_vocab; ++i) max_logit = std::max(max_logit, row[i]);
  double sum = 0.0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(row[i] - max_logit));
  return std::log(sum) - static_cast<double>(row[target] - max_logit);
}

absl::StatusOr<PerplexityResult> ComputePerplexity(
    LlamaModel& model, KvCache& cache, std::span<const int32_t> tokens, int32_t bos_id, int window,
    const std::function<void(int64_t, int64_t)>& progress) {
  const ModelConfig& config = model.config();
  if (window < 2 || window > config.context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("perplexity window ", window, " must be in [2, ", config.context_length, "]"));
  }
  if (tokens.empty()) return absl::InvalidArgumentError("perplexity needs at least one token");
  if (bos_id < 0 || bos_id >= config.n_vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("perplexity needs a BOS token, got id ", bos_id));
  }
  const int64_t total = static_cast<int64_t>(tokens.size());
  const int64_t chunk = window - 1;
  const int64_t n_windows = (total + chunk - 1) / chunk;
  PerplexityResult result;
  double nll_sum = 0.0;
  std::vector<float> logits;
  std::vector<int32_t> window_tokens;
  window_tokens.reserve(window);
  for (int64_t w = 0; w < n_windows; ++w) {
    const int64_t begin = w * chunk;
    const int64_t n_chunk = std::min<int64_t>(chunk, total - begin);
    window_tokens.assign(1, bos_id);
    window_tokens.insert(window_tokens.end(), tokens.begin() + begin,
                         tokens.begin() + begin + n_chunk);
    const int64_t len = n_chunk + 1;
    absl::StatusOr<SeqId> seq = cache.CreateSequence();
    if (!seq.ok()) return seq.status();
    absl::Status status = cache.Reserve(*seq, len);
    if (status.ok()) {
      SequenceChunk step{*seq, 0, window_tokens, /*all_logits=*/true};
      status = model.Forward({&step, 1}, cache, &logits);
    }
    cache.FreeSequence(*seq).IgnoreError();  // the id came from CreateSequence above
    if (!status.ok()) return status;
    for (int64_t i = 0; i + 1 < len; ++i) {
      nll_sum +=
          NegLogLikelihood(&logits[i * config.n_vocab], config.n_vocab, window_tokens[i + 1]);
    }
    result.tokens_scored += len - 1;
    ++result.windows;
    if (progress) progress(w + 1, n_windows);
  }
  result.mean_nll = nll_sum / static_cast<double>(result.tokens_scored);
  result.perplexity = std::exp(result.mean_nll);
  return result;
}

}  // namespace subspace::eval
