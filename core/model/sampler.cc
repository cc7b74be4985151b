// Token sampling (penalty, temperature, top-k, min-p, top-p, seeded draw) and stop-sequence
// matching on streamed text. The draw uses raw mt19937_64 bits so a seed reproduces the same
// tokens on every standard library.
#include "core/model/sampler.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace subspace {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kMaxFinite = std::numeric_limits<float>::max();

absl::Status FieldError(std::string_view field, std::string_view range, double got) {
  return absl::InvalidArgumentError(
      absl::StrFormat("SamplingParams.%s must be in %s, got %g", field, range, got));
}

// Uniform in [0, 1) from the top 53 bits. std::uniform_real_distribution would do, but its
// algorithm is implementation-defined and a seeded request must replay identically everywhere.
double UniformFromBits(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

// Index of the largest value, ties → lowest index; 0 when all are -inf.
int32_t Argmax(std::span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& params) {
  // Each range test is written so that NaN fails it.
  if (!(params.temperature >= 0.0f && params.temperature <= kMaxTemperature)) {
    return FieldError("temperature", absl::StrFormat("[0, %g]", kMaxTemperature),
                      params.temperature);
  }
  if (params.top_k < 0) return FieldError("top_k", "[0, inf)", params.top_k);
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
    return FieldError("top_p", "(0, 1]", params.top_p);
  }
  if (!(params.min_p >= 0.0f && params.min_p < 1.0f)) {
    return FieldError("min_p", "[0, 1)", params.min_p);
  }
  if (!(params.repetition_penalty > 0.0f && std::isfinite(params.repetition_penalty))) {
    return FieldError("repetition_penalty", "(0, inf)", params.repetition_penalty);
  }
  if (params.repetition_window < 0) {
    return FieldError("repetition_window", "[0, inf)", params.repetition_window);
  }
  if (params.logprobs < 0 || params.logprobs > kMaxLogprobs) {
    return FieldError("logprobs", absl::StrFormat("[0, %d]", kMaxLogprobs), params.logprobs);
  }
  return absl::OkStatus();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  assert(ValidateSamplingParams(params).ok());
  top_heap_.reserve(kMaxLogprobs);
}

SampledToken Sampler::Sample(std::span<float> logits, std::span<const int32_t> history) {
  SampledToken out;
  assert(!logits.empty());
  if (logits.empty()) return out;

  // One pass makes the logits safe for every later comparison and exp().
  float max_logit = kNegInf;
  for (float& x : logits) {
    if (std::isnan(x)) {
      x = kNegInf;
    } else if (x > kMaxFinite) {
      x = kMaxFinite;
    }
    max_logit = std::max(max_logit, x);
  }
  // log of the softmax normaliser of the raw logits; float terms, double sum.
  double log_z = kNegInf;
  if (max_logit > kNegInf) {
    double sum = 0.0;
    for (float x : logits) sum += std::exp(x - max_logit);
    log_z = static_cast<double>(max_logit) + std::log(sum);
  }
  if (params_.logprobs > 0) FillTopLogprobs(logits, max_logit, log_z, out);

  ApplyRepetitionPenalty(logits, history);
  out.token = params_.temperature > 0.0f ? SampleStochastic(logits) : Argmax(logits);

  const float raw = RawLogit(logits, out.token);
  out.logprob = max_logit > kNegInf ? static_cast<float>(raw - log_z) : kNegInf;
  return out;
}

bool Sampler::RowSamplingApplies() const {
  return params_.repetition_penalty == 1.0f && params_.logprobs == 0;
}

RowSampling Sampler::NextRow() {
  RowSampling row{.temperature = params_.temperature,
                  .top_k = params_.top_k,
                  .top_p = params_.top_p,
                  .min_p = params_.min_p};
  if (params_.temperature > 0.0f) {
    // Below 1 after the narrowing too: the kernel's draw is u * total with u in [0, 1).
    row.uniform = std::min(static_cast<float>(UniformFromBits(rng_)), 0x1.fffffep-1f);
  }
  return row;
}

void Sampler::FillTopLogprobs(std::span<const float> logits, float max_logit, double log_z,
                              SampledToken& out) {
  const size_t n =
      std::min(static_cast<size_t>(std::min(params_.logprobs, kMaxLogprobs)), logits.size());
  // Strict total order, so the list is the same whatever the heap implementation does.
  auto better = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  // A heap of the n best seen so far with the worst of them on top: O(V log n).
  top_heap_.clear();
  for (size_t i = 0; i < logits.size(); ++i) {
    const int32_t token = static_cast<int32_t>(i);
    if (top_heap_.size() < n) {
      top_heap_.push_back(token);
      std::push_heap(top_heap_.begin(), top_heap_.end(), better);
    } else if (better(token, top_heap_.front())) {
      std::pop_heap(top_heap_.begin(), top_heap_.end(), better);
      top_heap_.back() = token;
      std::push_heap(top_heap_.begin(), top_heap_.end(), better);
    }
  }
  std::sort_heap(top_heap_.begin(), top_heap_.end(), better);
  out.top.reserve(n);
  for (int32_t token : top_heap_) {
    const float logprob = max_logit > kNegInf ? static_cast<float>(logits[token] - log_z) : kNegInf;
    out.top.push_back({token, logprob});
  }
}

void Sampler::ApplyRepetitionPenalty(std::span<float> logits, std::span<const int32_t> history) {
  penalised_.clear();
  penalised_raw_.clear();
  const float penalty = params_.repetition_penalty;
  if (penalty == 1.0f || !(penalty > 0.0f) || !std::isfinite(penalty)) return;

  const size_t window =
      params_.repetition_window > 0
          ? std::min(static_cast<size_t>(params_.repetition_window), history.size())
          : history.size();
  const int64_t vocab = static_cast<int64_t>(logits.size());
  for (int32_t token : history.last(window)) {
    if (token >= 0 && token < vocab) penalised_.push_back(token);
  }
  // Penalise each distinct token once, as llama.cpp does: a token repeated ten times in the
  // window is not pushed ten times further down.
  std::sort(penalised_.begin(), penalised_.end());
  penalised_.erase(std::unique(penalised_.begin(), penalised_.end()), penalised_.end());
  for (int32_t token : penalised_) {
    const float raw = logits[token];
    penalised_raw_.push_back(raw);
    // CTRL-style: dividing a positive logit and multiplying a negative one both lower it
    // when penalty > 1. A penalty < 1 may overflow a positive logit, hence the clamp.
    logits[token] = raw > 0.0f ? std::min(raw / penalty, kMaxFinite) : raw * penalty;
  }
}

float Sampler::RawLogit(std::span<const float> logits, int32_t token) const {
  const auto it = std::lower_bound(penalised_.begin(), penalised_.end(), token);
  if (it != penalised_.end() && *it == token) return penalised_raw_[it - penalised_.begin()];
  return logits[token];
}

int32_t Sampler::SampleStochastic(std::span<float> logits) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  // Strict total order (logit descending, then id), so truncation and the order the draw walks
  // are fully determined and a seed replays exactly.
  auto better = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };

  bool sorted = false;
  candidates_.clear();
  if (params_.top_k > 0 && params_.top_k < vocab) {
    candidates_.resize(vocab);
    std::iota(candidates_.begin(), candidates_.end(), 0);
    std::partial_sort(candidates_.begin(), candidates_.begin() + params_.top_k, candidates_.end(),
                      better);
    candidates_.resize(params_.top_k);
    while (!candidates_.empty() && logits[candidates_.back()] == kNegInf) candidates_.pop_back();
    sorted = true;
  } else {
    for (int32_t i = 0; i < vocab; ++i) {
      if (logits[i] > kNegInf) candidates_.push_back(i);
    }
  }
  if (candidates_.empty()) {
    // Only reachable when the penalty pushed every finite logit to -inf; the caller still gets
    // the model's own favourite.
    for (size_t i = 0; i < penalised_.size(); ++i) logits[penalised_[i]] = penalised_raw_[i];
    return Argmax(logits);
  }

  float max_logit = logits[candidates_.front()];
  if (!sorted) {
    for (int32_t token : candidates_) max_logit = std::max(max_logit, logits[token]);
  }
  // Weights relative to the most likely token, which therefore has weight exactly 1: min-p
  // needs no normalisation, and (x - max) / T cannot overflow however small T is.
  const float temperature = params_.temperature;
  auto fill_weights = [&] {
    probs_.resize(candidates_.size());
    for (size_t j = 0; j < candidates_.size(); ++j) {
      probs_[j] = std::exp((logits[candidates_[j]] - max_logit) / temperature);
    }
  };
  fill_weights();

  if (params_.min_p > 0.0f) {
    size_t kept = 0;
    for (size_t j = 0; j < candidates_.size(); ++j) {
      if (probs_[j] >= params_.min_p) {
        candidates_[kept] = candidates_[j];
        probs_[kept] = probs_[j];
        ++kept;
      }
    }
    candidates_.resize(kept);
    probs_.resize(kept);
  }

  if (params_.top_p < 1.0f) {
    if (!sorted) {
      // Sorting after min-p keeps the O(n log n) step to the survivors.
      std::sort(candidates_.begin(), candidates_.end(), better);
      fill_weights();
    }
    double total = 0.0;
    for (float w : probs_) total += w;
    const double target = static_cast<double>(params_.top_p) * total;
    double cumulative = 0.0;
    for (size_t j = 0; j < probs_.size(); ++j) {
      cumulative += probs_[j];
      if (cumulative >= target) {
        candidates_.resize(j + 1);
        probs_.resize(j + 1);
        break;
      }
    }
  }

  double total = 0.0;
  for (float w : probs_) total += w;
  const double r = UniformFromBits(rng_) * total;
  double cumulative = 0.0;
  for (size_t j = 0; j < probs_.size(); ++j) {
    cumulative += probs_[j];
    // Strict, so a zero-weight token is never chosen.
    if (r < cumulative) return candidates_[j];
  }
  // u * total rounded up to total: take the last token that has any weight.
  for (size_t j = probs_.size(); j-- > 0;) {
    if (probs_[j] > 0.0f) return candidates_[j];
  }
  return candidates_.front();
}

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (std::string& stop : stops) {
    if (stop.empty()) continue;
    max_len_ = std::max(max_len_, stop.size());
    stops_.push_back(std::move(stop));
  }
}

StopMatcher::Result StopMatcher::Push(std::string_view piece) {
  Result result;
  if (stopped_) {
    result.stopped = true;
    return result;
  }
  if (stops_.empty()) {
    result.text = piece;
    return result;
  }
  pending_.append(piece);

  // pending_ held no complete stop before this piece, so any match here ends inside it. The
  // first occurrence of a stop is also the one that ends first.
  const std::string_view text = pending_;
  size_t best_start = std::string_view::npos;
  size_t best_end = std::string_view::npos;
  for (const std::string& stop : stops_) {
    const size_t start = text.find(stop);
    if (start == std::string_view::npos) continue;
    const size_t end = start + stop.size();
    if (end < best_end || (end == best_end && start < best_start)) {
      best_start = start;
      best_end = end;
    }
  }
  if (best_start != std::string_view::npos) {
    result.text = pending_.substr(0, best_start);
    result.stopped = true;
    pending_.clear();
    stopped_ = true;
    return result;
  }

  const size_t emit = pending_.size() - HeldBackLength();
  result.text = pending_.substr(0, emit);
  pending_.erase(0, emit);
  return result;
}

std::string StopMatcher::Flush() {
  if (stopped_) return {};
  return std::exchange(pending_, {});
}

size_t StopMatcher::HeldBackLength() const {
  const std::string_view text = pending_;
  // A suffix as long as a whole stop would have been a match, so max_len_ - 1 bounds the search.
  for (size_t len = std::min(text.size(), max_len_ - 1); len > 0; --len) {
    const std::string_view suffix = text.substr(text.size() - len);
    for (const std::string& stop : stops_) {
      if (stop.size() > len && std::string_view(stop).starts_with(suffix)) return len;
    }
  }
  return 0;
}

}  // namespace subspace
