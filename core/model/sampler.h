// Token sampling: greedy, temperature, top-k, top-p, min-p and repetition penalty, with a
// seeded RNG so a request with a seed is reproducible; plus stop-sequence matching on text.
#ifndef SUBSPACE_CORE_MODEL_SAMPLER_H_
#define SUBSPACE_CORE_MODEL_SAMPLER_H_

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace subspace {

inline constexpr float kMaxTemperature = 100.0f;
inline constexpr int32_t kMaxLogprobs = 20;

struct SamplingParams {
  float temperature = 0.0f;         // 0 = greedy (argmax)
  int32_t top_k = 0;                // 0 = off
  float top_p = 1.0f;               // (0, 1]; 1 = off
  float min_p = 0.0f;               // [0, 1); 0 = off
  float repetition_penalty = 1.0f;  // > 0; 1 = off (CTRL-style: divide positive logits)
  int32_t repetition_window = 64;   // last N tokens of the history penalised; 0 = all
  uint64_t seed = 0;
  int32_t logprobs = 0;  // how many top alternatives to report, 0..20
};

// INVALID_ARGUMENT naming the offending field (NaN, out of range). Ranges: temperature
// [0, kMaxTemperature], top_k >= 0, top_p (0, 1], min_p [0, 1), repetition_penalty finite and
// > 0, repetition_window >= 0, logprobs [0, kMaxLogprobs].
absl::Status ValidateSamplingParams(const SamplingParams& params);

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

// One logits row's sampling as a device kernel runs it (kernels/sampling.h, the policy of
// Sampler::Sample without repetition penalty or top logprobs): the request's parameters and the
// uniform its Sampler drew for the row.
struct RowSampling {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float uniform = 0.0f;  // [0, 1); unused when temperature is 0
};

struct SampledToken {
  int32_t token = 0;
  float logprob = 0.0f;  // of the chosen token under the unmodified distribution (log-softmax)
  std::vector<TokenLogprob> top;  // params.logprobs most likely, descending
};

// One per request: holds the request's RNG stream and reusable scratch, so it is not
// thread-safe and Sample() allocates nothing after the first call (except `top`).
class Sampler {
 public:
  // `params` must have passed ValidateSamplingParams; out-of-range values are not checked again
  // here beyond what keeps Sample() memory-safe.
  explicit Sampler(const SamplingParams& params);

  // `logits`: [vocab], used as scratch. `history`: prompt + generated tokens so far.
  //
  // Order: repetition penalty, then temperature 0 → argmax (ties → lowest id, no RNG drawn);
  // otherwise top-k, softmax at the temperature, min-p (relative to the most likely token),
  // top-p over what min-p left, and one draw from the renormalised rest.
  //
  // `logprob` and `top` describe the model's own distribution: the log-softmax of the raw
  // logits, before penalty, temperature or truncation. The shaped distribution is a decoding
  // policy, not a property of the text, and under truncation it assigns -inf to most tokens;
  // reporting the raw one (vLLM's default too) keeps the numbers comparable across requests
  // with different sampling settings.
  //
  // NaN logits count as -inf and +inf as the largest finite float. If every logit is -inf there
  // is no distribution: the result is token 0 with logprob -inf.
  //
  // The uniform draw is built from raw mt19937_64 bits rather than a <random> distribution,
  // whose algorithms the standard leaves unspecified, so a seed gives the same tokens with
  // every standard library.
  SampledToken Sample(std::span<float> logits, std::span<const int32_t> history);

  // Whether a device may sample for this request (no repetition penalty, which needs the
  // history, and no top logprobs, which need the whole row).
  bool RowSamplingApplies() const;
  // The next row as RowSampling: draws the request's next uniform when it samples
  // stochastically, as Sample would, so a seeded request picks the same tokens either way
  // (up to float rounding of the draw).
  RowSampling NextRow();

 private:
  void ApplyRepetitionPenalty(std::span<float> logits, std::span<const int32_t> history);
  // The logit `token` had before ApplyRepetitionPenalty touched it.
  float RawLogit(std::span<const float> logits, int32_t token) const;
  int32_t SampleStochastic(std::span<float> logits);
  void FillTopLogprobs(std::span<const float> logits, float max_logit, double log_z,
                       SampledToken& out);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> candidates_;   // scratch, kept to avoid a per-token allocation
  std::vector<float> probs_;          // [candidates_.size()] unnormalised weights
  std::vector<int32_t> penalised_;    // sorted distinct tokens penalised in this call
  std::vector<float> penalised_raw_;  // [penalised_.size()] their logits before the penalty
  std::vector<int32_t> top_heap_;     // scratch for the `logprobs` most likely tokens
};

// Finds stop sequences in streamed text. Text that might be the start of a stop sequence is
// held back until it is decided, so a client never sees part of a stop sequence.
//
// The stop that completes first wins, as if the text arrived one byte at a time (among stops
// completing at the same byte, the one starting earliest), so the output does not depend on how
// the tokenizer happened to split the text into pieces. Matching is on bytes.
class StopMatcher {
 public:
  // Empty strings are ignored (they would match before any text).
  explicit StopMatcher(std::vector<std::string> stops);

  struct Result {
    std::string text;      // safe to emit now
    bool stopped = false;  // a stop sequence matched; `text` ends just before it
  };
  // After a stop has matched, further pieces are dropped: {"", true}.
  Result Push(std::string_view piece);
  // Releases held-back text at the end of generation ("" after a stop matched).
  std::string Flush();

 private:
  // Length of the longest suffix of pending_ that is a proper prefix of some stop.
  size_t HeldBackLength() const;

  std::vector<std::string> stops_;
  size_t max_len_ = 0;
  std::string pending_;
  bool stopped_ = false;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_MODEL_SAMPLER_H_
