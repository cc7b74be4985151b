// Token sampling: greedy, temperature, top-k, top-p, min-p and repetition penalty, with a
// seeded RNG so a request with a seed is reproducible; plus stop-sequence matching on text.
#ifndef SUBSPACE_CORE_SAMPLER_H_
#define SUBSPACE_CORE_SAMPLER_H_

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace subspace {

struct SamplingParams {
  float temperature = 0.0f;         // 0 = greedy (argmax)
  int32_t top_k = 0;                // 0 = off
  float top_p = 1.0f;               // (0, 1]; 1 = off
  float min_p = 0.0f;               // [0, 1); 0 = off
  float repetition_penalty = 1.0f;  // > 0; 1 = off (CTRL-style: divide positive logits)
  int32_t repetition_window = 64;   // last N tokens of the history penalised; 0 = all
  uint64_t seed = 0;
  int32_t logprobs = 0;             // how many top alternatives to report, 0..20
};

// INVALID_ARGUMENT naming the offending field (NaN, out of range).
absl::Status ValidateSamplingParams(const SamplingParams& params);

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

struct SampledToken {
  int32_t token = 0;
  float logprob = 0.0f;  // of the chosen token under the unmodified distribution (log-softmax)
  std::vector<TokenLogprob> top;  // params.logprobs most likely, descending
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  // `logits`: [vocab], used as scratch. `history`: prompt + generated tokens so far.
  SampledToken Sample(std::span<float> logits, std::span<const int32_t> history);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> candidates_;  // scratch, kept to avoid a per-token allocation
  std::vector<float> probs_;
};

// Finds stop sequences in streamed text. Text that might be the start of a stop sequence is
// held back until it is decided, so a client never sees part of a stop sequence.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  struct Result {
    std::string text;      // safe to emit now
    bool stopped = false;  // a stop sequence matched; `text` ends just before it
  };
  Result Push(std::string_view piece);
  // Releases held-back text at the end of generation.
  std::string Flush();

 private:
  std::vector<std::string> stops_;
  size_t max_len_ = 0;
  std::string pending_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_SAMPLER_H_
