// Tests for core/sampler: parameter validation, the sampling pipeline checked against plain
// double-precision references written here, and stop-sequence matching on streamed text.
#include "core/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace subspace {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Helpers and references. Randomness in the tests comes from raw mt19937_64 bits (whose output
// the standard fixes), so every input below is the same on every platform.

std::vector<float> RandomLogits(int vocab, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::vector<float> logits(vocab);
  for (float& x : logits) {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    x = static_cast<float>((2.0 * u - 1.0) * scale);
  }
  return logits;
}

std::vector<double> SoftmaxRef(const std::vector<float>& logits, double temperature) {
  const double max = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    p[i] = std::exp((logits[i] - max) / temperature);
    sum += p[i];
  }
  for (double& x : p) x /= sum;
  return p;
}

std::vector<double> LogSoftmaxRef(const std::vector<float>& logits) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float x : logits) sum += std::exp(x - max);
  std::vector<double> out(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - max - std::log(sum);
  return out;
}

// The distribution the sampler should draw from, written the obvious way: full sort, truncate
// step by step, in double. `well_separated` is false when some token sits within 1e-4 of a
// min-p or top-p threshold, where float rounding in the sampler could legitimately decide the
// other way; tests assert it so their inputs stay meaningful.
struct Allowed {
  std::map<int32_t, double> probs;  // token → renormalised probability
  bool well_separated = true;
};

Allowed AllowedRef(const std::vector<float>& logits, const SamplingParams& params) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < order.size()) {
    order.resize(params.top_k);
  }
  Allowed out;
  std::vector<double> p;
  for (int32_t t : order)
    p.push_back(std::exp((logits[t] - logits[order[0]]) / params.temperature));
  if (params.min_p > 0) {
    std::vector<int32_t> kept_order;
    std::vector<double> kept_p;
    for (size_t j = 0; j < order.size(); ++j) {
      if (std::abs(p[j] - params.min_p) < 1e-4) out.well_separated = false;
      if (p[j] >= params.min_p * p[0]) {
        kept_order.push_back(order[j]);
        kept_p.push_back(p[j]);
      }
    }
    order = kept_order;
    p = kept_p;
  }
  double sum = std::accumulate(p.begin(), p.end(), 0.0);
  for (double& x : p) x /= sum;
  if (params.top_p < 1) {
    double cumulative = 0.0;
    size_t n = 0;
    while (n < p.size() && cumulative < params.top_p) {
      cumulative += p[n++];
      if (std::abs(cumulative - params.top_p) < 1e-4) out.well_separated = false;
    }
    order.resize(n);
    p.resize(n);
    sum = std::accumulate(p.begin(), p.end(), 0.0);
    for (double& x : p) x /= sum;
  }
  for (size_t j = 0; j < order.size(); ++j) out.probs[order[j]] = p[j];
  return out;
}

SamplingParams Stochastic(float temperature, uint64_t seed = 1234) {
  SamplingParams params;
  params.temperature = temperature;
  params.seed = seed;
  params.repetition_penalty = 1.0f;
  return params;
}

// Sample() uses the logits as scratch, so each draw gets a fresh copy.
SampledToken Draw(Sampler& sampler, const std::vector<float>& logits,
                  const std::vector<int32_t>& history = {}) {
  std::vector<float> scratch = logits;
  return sampler.Sample(scratch, history);
}

std::vector<int> Counts(const SamplingParams& params, const std::vector<float>& logits, int draws) {
  Sampler sampler(params);
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < draws; ++i) ++counts[Draw(sampler, logits).token];
  return counts;
}

// Pearson chi-square of `counts` against `expected` probabilities. Tokens with an expected count
// below 5 are pooled into one bin so the statistic's chi-square approximation holds.
std::pair<double, int> ChiSquare(const std::vector<int>& counts,
                                 const std::vector<double>& expected, int draws) {
  double stat = 0.0;
  int bins = 0;
  double pooled_expected = 0.0;
  double pooled_observed = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = expected[i] * draws;
    if (e < 5.0) {
      pooled_expected += e;
      pooled_observed += counts[i];
      continue;
    }
    stat += (counts[i] - e) * (counts[i] - e) / e;
    ++bins;
  }
  if (pooled_expected >= 5.0) {
    stat +=
        (pooled_observed - pooled_expected) * (pooled_observed - pooled_expected) / pooled_expected;
    ++bins;
  }
  return {stat, bins - 1};
}

// Tolerance: the upper 1e-9 tail of chi-square with `dof` degrees of freedom (Wilson–Hilferty,
// z = 6.0). A correct sampler would exceed it for fewer than one seed in 10^9; with the fixed
// seeds used here the outcome is deterministic anyway, so the test cannot flake.
double ChiSquareLimit(int dof) {
  const double k = dof;
  const double t = 1.0 - 2.0 / (9.0 * k) + 6.0 * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

void ExpectMatchesDistribution(const SamplingParams& params, const std::vector<float>& logits,
                               const std::vector<double>& expected, int draws) {
  const std::vector<int> counts = Counts(params, logits, draws);
  const auto [stat, dof] = ChiSquare(counts, expected, draws);
  ASSERT_GT(dof, 0);
  EXPECT_LT(stat, ChiSquareLimit(dof)) << "dof " << dof << " temperature " << params.temperature;
}

// ---------------------------------------------------------------------------------------------
// Validation.

TEST(ValidateSamplingParamsTest, DefaultsAndBoundaryValuesAreValid) {
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}).ok());
  SamplingParams edge;
  edge.temperature = kMaxTemperature;
  edge.top_k = 1;
  edge.top_p = 1.0f;
  edge.min_p = 0.0f;
  edge.repetition_penalty = 0.5f;
  edge.repetition_window = 0;
  edge.logprobs = kMaxLogprobs;
  EXPECT_TRUE(ValidateSamplingParams(edge).ok());
  edge.top_p = 1e-6f;
  edge.min_p = 0.999f;
  EXPECT_TRUE(ValidateSamplingParams(edge).ok());
}

TEST(ValidateSamplingParamsTest, EachBadValueNamesItsField) {
  struct Case {
    std::string field;
    std::function<void(SamplingParams&)> set;
  };
  const std::vector<Case> cases = {
      {"temperature", [](SamplingParams& p) { p.temperature = kNaN; }},
      {"temperature", [](SamplingParams& p) { p.temperature = kInf; }},
      {"temperature", [](SamplingParams& p) { p.temperature = -0.5f; }},
      {"temperature", [](SamplingParams& p) { p.temperature = kMaxTemperature * 1.01f; }},
      {"top_k", [](SamplingParams& p) { p.top_k = -1; }},
      {"top_p", [](SamplingParams& p) { p.top_p = kNaN; }},
      {"top_p", [](SamplingParams& p) { p.top_p = 0.0f; }},
      {"top_p", [](SamplingParams& p) { p.top_p = -0.1f; }},
      {"top_p", [](SamplingParams& p) { p.top_p = 1.0001f; }},
      {"min_p", [](SamplingParams& p) { p.min_p = kNaN; }},
      {"min_p", [](SamplingParams& p) { p.min_p = -0.01f; }},
      {"min_p", [](SamplingParams& p) { p.min_p = 1.0f; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = kNaN; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = 0.0f; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = -1.0f; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = kInf; }},
      {"repetition_window", [](SamplingParams& p) { p.repetition_window = -1; }},
      {"logprobs", [](SamplingParams& p) { p.logprobs = -1; }},
      {"logprobs", [](SamplingParams& p) { p.logprobs = kMaxLogprobs + 1; }},
  };
  for (const Case& c : cases) {
    SamplingParams params;
    c.set(params);
    const absl::Status status = ValidateSamplingParams(params);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(status.message().find(c.field), std::string::npos)
        << "message \"" << status.message() << "\" does not name " << c.field;
  }
}

// ---------------------------------------------------------------------------------------------
// Greedy.

TEST(SamplerTest, GreedyIsArgmaxWithTiesToLowestId) {
  Sampler sampler(SamplingParams{});
  EXPECT_EQ(Draw(sampler, {1.0f, 3.0f, 3.0f, 2.0f}).token, 1);
  EXPECT_EQ(Draw(sampler, {5.0f, 5.0f}).token, 0);
  EXPECT_EQ(Draw(sampler, {-3.0f, -1.0f, -2.0f}).token, 1);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    const std::vector<float> logits = RandomLogits(1000, seed, 10.0f);
    const int32_t expected =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ(Draw(sampler, logits).token, expected);
  }
}

TEST(SamplerTest, TopKOneEqualsGreedy) {
  Sampler greedy(SamplingParams{});
  SamplingParams params = Stochastic(1.5f);
  params.top_k = 1;
  Sampler top1(params);
  for (uint64_t seed = 0; seed < 200; ++seed) {
    std::vector<float> logits = RandomLogits(64, seed, 4.0f);
    // Rounding to half-units makes ties at the maximum common, which must go to the lowest id.
    for (float& x : logits) x = std::round(x * 2.0f) / 2.0f;
    EXPECT_EQ(Draw(top1, logits).token, Draw(greedy, logits).token) << "seed " << seed;
  }
}

TEST(SamplerTest, TinyTemperatureIsGreedyWithoutOverflow) {
  const std::vector<float> logits = RandomLogits(100, 7, 5.0f);
  const int32_t expected =
      static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  Sampler sampler(Stochastic(1e-30f));
  for (int i = 0; i < 100; ++i) EXPECT_EQ(Draw(sampler, logits).token, expected);
}

// ---------------------------------------------------------------------------------------------
// Seeds and distributions.

TEST(SamplerTest, SameSeedSameSequenceDifferentSeedDifferent) {
  const std::vector<float> logits = RandomLogits(50, 3, 2.0f);
  auto sequence = [&](uint64_t seed) {
    SamplingParams params = Stochastic(1.0f, seed);
    params.top_p = 0.95f;
    Sampler sampler(params);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 1000; ++i) tokens.push_back(Draw(sampler, logits).token);
    return tokens;
  };
  EXPECT_EQ(sequence(42), sequence(42));
  EXPECT_NE(sequence(42), sequence(43));
}

// Pins the seed → tokens mapping. mt19937_64 is fully specified by the standard and the draw
// does not go through <random> distributions, so this holds on every platform; if a change to
// the pipeline breaks it, seeded requests stop replaying across versions: say so in the change.
// The expected tokens were also derived by a separate Python model of mt19937_64 (checked
// against the standard's 10000th-output value) and the documented draw rule.
TEST(SamplerTest, SeededDrawsAreStableAcrossBuilds) {
  const std::vector<float> logits = {0.5f, 1.5f, -1.0f, 2.0f, 0.0f, 1.0f};
  Sampler sampler(Stochastic(1.0f, 2024));
  std::vector<int32_t> tokens;
  for (int i = 0; i < 12; ++i) tokens.push_back(Draw(sampler, logits).token);
  EXPECT_EQ(tokens, (std::vector<int32_t>{3, 4, 1, 1, 0, 1, 5, 3, 1, 3, 3, 3}));
}

TEST(SamplerTest, TemperatureOneMatchesSoftmax) {
  const std::vector<float> logits = RandomLogits(16, 11, 2.0f);
  ExpectMatchesDistribution(Stochastic(1.0f), logits, SoftmaxRef(logits, 1.0), 20000);
}

TEST(SamplerTest, TemperatureScalesTheDistribution) {
  const std::vector<float> logits = RandomLogits(16, 12, 2.0f);
  const int32_t top =
      static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  double previous_share = 1.0;
  for (float temperature : {0.5f, 1.0f, 2.0f, 4.0f}) {
    SCOPED_TRACE(temperature);
    ExpectMatchesDistribution(Stochastic(temperature), logits, SoftmaxRef(logits, temperature),
                              20000);
    // Hotter must flatten: the favourite's share falls as temperature rises.
    const double share = Counts(Stochastic(temperature), logits, 20000)[top] / 20000.0;
    EXPECT_LT(share, previous_share);
    previous_share = share;
  }
}

// ---------------------------------------------------------------------------------------------
// Truncation: never outside the reference's allowed set, every allowed token that is not rare
// shows up, and the frequencies match the renormalised reference.

TEST(SamplerTest, TruncationRestrictsSupportExactly) {
  const std::vector<float> logits = RandomLogits(200, 21, 3.0f);
  struct Case {
    const char* name;
    int32_t top_k;
    float top_p;
    float min_p;
    float temperature;
  };
  const std::vector<Case> cases = {
      {"top_k=5", 5, 1.0f, 0.0f, 1.0f},
      {"top_k=40 T=2", 40, 1.0f, 0.0f, 2.0f},
      {"top_p=0.5", 0, 0.5f, 0.0f, 1.0f},
      {"top_p=0.9 T=0.7", 0, 0.9f, 0.0f, 0.7f},
      {"min_p=0.1", 0, 1.0f, 0.1f, 1.0f},
      {"min_p=0.25 T=1.5", 0, 1.0f, 0.25f, 1.5f},
      {"top_k=30 min_p=0.05 top_p=0.8", 30, 0.8f, 0.05f, 1.0f},
      {"min_p=0.02 top_p=0.7 T=1.3", 0, 0.7f, 0.02f, 1.3f},
  };
  constexpr int kDraws = 20000;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    SamplingParams params = Stochastic(c.temperature, 99);
    params.top_k = c.top_k;
    params.top_p = c.top_p;
    params.min_p = c.min_p;
    const Allowed allowed = AllowedRef(logits, params);
    ASSERT_TRUE(allowed.well_separated) << "pick inputs away from the thresholds";
    ASSERT_GT(allowed.probs.size(), 1u);
    ASSERT_LT(allowed.probs.size(), logits.size());

    const std::vector<int> counts = Counts(params, logits, kDraws);
    std::vector<double> expected(logits.size(), 0.0);
    for (size_t t = 0; t < logits.size(); ++t) {
      const auto it = allowed.probs.find(static_cast<int32_t>(t));
      if (it == allowed.probs.end()) {
        EXPECT_EQ(counts[t], 0) << "token " << t << " is outside the allowed set";
      } else {
        expected[t] = it->second;
        // P(never drawn) <= (1 - 0.002)^20000 < 1e-17.
        if (it->second >= 0.002) {
          EXPECT_GT(counts[t], 0) << "allowed token " << t;
        }
      }
    }
    const auto [stat, dof] = ChiSquare(counts, expected, kDraws);
    EXPECT_LT(stat, ChiSquareLimit(dof)) << "dof " << dof;
  }
}

TEST(SamplerTest, TopPAlwaysKeepsAtLeastTheFavourite) {
  const std::vector<float> logits = {0.0f, 3.0f, 1.0f, 2.9f};
  SamplingParams params = Stochastic(1.0f);
  params.top_p = 1e-6f;
  Sampler sampler(params);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(Draw(sampler, logits).token, 1);
}

// ---------------------------------------------------------------------------------------------
// Repetition penalty. Greedy picks between a penalised token and a fixed rival; the crossover
// penalty pins the arithmetic (a wrong operation would not cross, or cross elsewhere).

int32_t GreedyWithPenalty(const std::vector<float>& logits, const std::vector<int32_t>& history,
                          float penalty, int32_t window = 64) {
  SamplingParams params;
  params.repetition_penalty = penalty;
  params.repetition_window = window;
  Sampler sampler(params);
  return Draw(sampler, logits, history).token;
}

TEST(RepetitionPenaltyTest, DividesPositiveLogits) {
  // 4 / p crosses the rival's 2.5 at p = 1.6.
  EXPECT_EQ(GreedyWithPenalty({4.0f, 2.5f}, {0}, 1.5f), 0);
  EXPECT_EQ(GreedyWithPenalty({4.0f, 2.5f}, {0}, 1.7f), 1);
  EXPECT_EQ(GreedyWithPenalty({4.0f, 2.5f}, {0}, 1.0f), 0);
}

TEST(RepetitionPenaltyTest, MultipliesNegativeLogits) {
  // -1 * p crosses the rival's -1.5 at p = 1.5; dividing would never cross.
  EXPECT_EQ(GreedyWithPenalty({-1.0f, -1.5f}, {0}, 1.4f), 0);
  EXPECT_EQ(GreedyWithPenalty({-1.0f, -1.5f}, {0}, 1.6f), 1);
  // Zero counts as non-positive: 0 * p stays 0, so the rival at -0.1 never wins.
  EXPECT_EQ(GreedyWithPenalty({0.0f, -0.1f}, {0}, 10.0f), 0);
}

TEST(RepetitionPenaltyTest, PenalisesEachDistinctTokenOnce) {
  // Once: 4 / 1.5 = 2.67 > 2.5. Three times would give 1.19.
  EXPECT_EQ(GreedyWithPenalty({4.0f, 2.5f}, {0, 0, 0}, 1.5f), 0);
}

TEST(RepetitionPenaltyTest, OnlyTheWindowCounts) {
  const std::vector<float> logits = {4.0f, 2.5f, 0.0f};
  const std::vector<int32_t> history = {0, 2, 2};
  EXPECT_EQ(GreedyWithPenalty(logits, history, 2.0f, /*window=*/2), 0);
  EXPECT_EQ(GreedyWithPenalty(logits, history, 2.0f, /*window=*/3), 1);
  EXPECT_EQ(GreedyWithPenalty(logits, history, 2.0f, /*window=*/100), 1);
  EXPECT_EQ(GreedyWithPenalty(logits, history, 2.0f, /*window=*/0), 1);  // 0 = all
}

TEST(RepetitionPenaltyTest, PenaltyBelowOneRewardsAndIgnoresBadIds) {
  EXPECT_EQ(GreedyWithPenalty({2.0f, 2.5f}, {0}, 0.5f), 0);  // 2 / 0.5 = 4
  EXPECT_EQ(GreedyWithPenalty({2.0f, 2.5f}, {-1, 7, 1000000}, 2.0f), 1);
}

// ---------------------------------------------------------------------------------------------
// Log-probabilities: always of the raw distribution.

TEST(SamplerTest, LogprobsAreRawLogSoftmaxSortedDescending) {
  const std::vector<float> logits = RandomLogits(1000, 31, 8.0f);
  const std::vector<double> ref = LogSoftmaxRef(logits);
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ref[a] > ref[b]; });

  SamplingParams params = Stochastic(0.7f);
  params.top_k = 10;
  params.repetition_penalty = 1.3f;
  params.logprobs = kMaxLogprobs;
  Sampler sampler(params);
  // Penalising the favourites must not change the reported numbers.
  const std::vector<int32_t> history(order.begin(), order.begin() + 5);
  for (int i = 0; i < 50; ++i) {
    const SampledToken out = Draw(sampler, logits, history);
    EXPECT_NEAR(out.logprob, ref[out.token], 1e-5);
    ASSERT_EQ(out.top.size(), static_cast<size_t>(kMaxLogprobs));
    for (size_t j = 0; j < out.top.size(); ++j) {
      EXPECT_EQ(out.top[j].token, order[j]);
      EXPECT_NEAR(out.top[j].logprob, ref[order[j]], 1e-5);
      if (j > 0) {
        EXPECT_GE(out.top[j - 1].logprob, out.top[j].logprob);
      }
    }
  }
}

TEST(SamplerTest, GreedyLogprobIgnoresPenalty) {
  const std::vector<float> logits = {3.0f, 1.0f, 0.5f};
  SamplingParams params;
  params.repetition_penalty = 1.1f;
  params.logprobs = 2;
  Sampler sampler(params);
  const SampledToken out = Draw(sampler, logits, {0});
  ASSERT_EQ(out.token, 0);
  EXPECT_NEAR(out.logprob, LogSoftmaxRef(logits)[0], 1e-5);
  ASSERT_EQ(out.top.size(), 2u);
  EXPECT_EQ(out.top[0].token, 0);
  EXPECT_EQ(out.top[1].token, 1);
}

TEST(SamplerTest, LogprobsCountIsClampedToVocabAndTiesGoToLowestId) {
  SamplingParams params;
  params.logprobs = 5;
  Sampler sampler(params);
  const SampledToken out = Draw(sampler, {1.0f, 2.0f, 1.0f});
  ASSERT_EQ(out.top.size(), 3u);
  EXPECT_EQ(out.top[0].token, 1);
  EXPECT_EQ(out.top[1].token, 0);
  EXPECT_EQ(out.top[2].token, 2);

  Sampler none(SamplingParams{});
  EXPECT_TRUE(Draw(none, {1.0f, 2.0f}).top.empty());
}

// ---------------------------------------------------------------------------------------------
// Non-finite logits.

TEST(SamplerTest, NaNLogitsAreNeverChosen) {
  std::vector<float> logits = RandomLogits(100, 41, 2.0f);
  for (size_t i = 0; i < logits.size(); i += 2) logits[i] = kNaN;
  logits[0] = kNaN;
  for (float temperature : {0.0f, 1.0f, 5.0f}) {
    SamplingParams params = Stochastic(temperature);
    params.logprobs = kMaxLogprobs;
    Sampler sampler(params);
    for (int i = 0; i < 500; ++i) {
      const SampledToken out = Draw(sampler, logits);
      EXPECT_EQ(out.token % 2, 1) << "NaN token " << out.token << " chosen";
      EXPECT_TRUE(std::isfinite(out.logprob));
      for (const TokenLogprob& t : out.top) EXPECT_EQ(t.token % 2, 1);
    }
  }
}

TEST(SamplerTest, AllNaNOrMinusInfFallsBackToTokenZero) {
  for (float bad : {kNaN, -kInf}) {
    for (float temperature : {0.0f, 1.0f}) {
      SamplingParams params = Stochastic(temperature);
      params.top_k = 3;
      params.logprobs = 2;
      Sampler sampler(params);
      const SampledToken out = Draw(sampler, std::vector<float>(10, bad));
      EXPECT_EQ(out.token, 0);
      EXPECT_EQ(out.logprob, -kInf);
      ASSERT_EQ(out.top.size(), 2u);
      EXPECT_EQ(out.top[0].logprob, -kInf);
    }
  }
}

TEST(SamplerTest, PlusInfLogitBehavesAsCertain) {
  SamplingParams params = Stochastic(1.0f);
  params.logprobs = 1;
  Sampler sampler(params);
  for (int i = 0; i < 100; ++i) {
    const SampledToken out = Draw(sampler, {0.0f, kInf, 1.0f});
    EXPECT_EQ(out.token, 1);
    EXPECT_EQ(out.logprob, 0.0f);
  }
}

TEST(SamplerTest, MinusInfLogitsAreExcludedFromSampling) {
  std::vector<float> logits(64, -kInf);
  logits[10] = 0.0f;
  logits[20] = 0.0f;
  for (int32_t top_k : {0, 5}) {
    SamplingParams params = Stochastic(1.0f);
    params.top_k = top_k;
    Sampler sampler(params);
    for (int i = 0; i < 200; ++i) {
      const int32_t token = Draw(sampler, logits).token;
      EXPECT_TRUE(token == 10 || token == 20) << token;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// StopMatcher.

// Pushes `pieces` and returns everything emitted (Push texts, then Flush unless stopped).
std::pair<std::string, bool> Stream(StopMatcher& matcher, const std::vector<std::string>& pieces) {
  std::string emitted;
  for (const std::string& piece : pieces) {
    StopMatcher::Result r = matcher.Push(piece);
    emitted += r.text;
    if (r.stopped) return {emitted, true};
  }
  emitted += matcher.Flush();
  return {emitted, false};
}

TEST(StopMatcherTest, NoStopsPassesThrough) {
  StopMatcher matcher({});
  EXPECT_EQ(matcher.Push("hello").text, "hello");
  EXPECT_EQ(matcher.Push(" world").text, " world");
  EXPECT_EQ(matcher.Flush(), "");
}

TEST(StopMatcherTest, EmptyStopStringsAreIgnored) {
  StopMatcher matcher({"", "x"});
  const StopMatcher::Result r = matcher.Push("abc");
  EXPECT_EQ(r.text, "abc");
  EXPECT_FALSE(r.stopped);
}

TEST(StopMatcherTest, StopWithinOnePiece) {
  StopMatcher matcher({"END"});
  const StopMatcher::Result r = matcher.Push("helloENDworld");
  EXPECT_EQ(r.text, "hello");
  EXPECT_TRUE(r.stopped);
  // Nothing after the stop comes out, ever.
  EXPECT_EQ(matcher.Push("more").text, "");
  EXPECT_TRUE(matcher.Push("more").stopped);
  EXPECT_EQ(matcher.Flush(), "");
}

TEST(StopMatcherTest, StopSpanningManyPieces) {
  StopMatcher matcher({"</s>"});
  StopMatcher::Result r = matcher.Push("abc<");
  EXPECT_EQ(r.text, "abc");
  r = matcher.Push("/");
  EXPECT_EQ(r.text, "");
  r = matcher.Push("s");
  EXPECT_EQ(r.text, "");
  EXPECT_FALSE(r.stopped);
  r = matcher.Push(">tail");
  EXPECT_EQ(r.text, "");
  EXPECT_TRUE(r.stopped);
}

TEST(StopMatcherTest, PartialPrefixThenMismatchReleasesText) {
  StopMatcher matcher({"</s>"});
  EXPECT_EQ(matcher.Push("ab<").text, "ab");
  const StopMatcher::Result r = matcher.Push("/x");
  EXPECT_EQ(r.text, "</x");
  EXPECT_FALSE(r.stopped);
}

TEST(StopMatcherTest, HeldTextCanStartAnotherCandidate) {
  // "aa" is held; "aab" then matches starting inside the held text, not at its start.
  StopMatcher matcher({"aab"});
  EXPECT_EQ(matcher.Push("aa").text, "");
  const StopMatcher::Result r = matcher.Push("aab");
  EXPECT_EQ(r.text, "aa");
  EXPECT_TRUE(r.stopped);
}

TEST(StopMatcherTest, OverlappingCandidatesFirstToCompleteWins) {
  StopMatcher matcher({"abcd", "bce"});
  EXPECT_EQ(matcher.Push("xabc").text, "x");
  const StopMatcher::Result r = matcher.Push("e");
  EXPECT_EQ(r.text, "a");
  EXPECT_TRUE(r.stopped);

  // "bc" inside "abcd" completes first, also when both arrive in one piece.
  StopMatcher nested({"abcd", "bc"});
  EXPECT_EQ(nested.Push("abcd").text, "a");
}

TEST(StopMatcherTest, TwoStopsEarliestWins) {
  StopMatcher matcher({"World", "lo"});
  const StopMatcher::Result r = matcher.Push("Hello World");
  EXPECT_EQ(r.text, "Hel");
  EXPECT_TRUE(r.stopped);

  // Completing at the same byte: the longer one starts earlier and wins.
  StopMatcher same_end({"c", "abc"});
  EXPECT_EQ(same_end.Push("xxabcyy").text, "xx");
}

TEST(StopMatcherTest, FlushReleasesHeldText) {
  StopMatcher matcher({"<|end|>"});
  EXPECT_EQ(matcher.Push("foo<|en").text, "foo");
  EXPECT_EQ(matcher.Flush(), "<|en");
  EXPECT_EQ(matcher.Flush(), "");
}

TEST(StopMatcherTest, MultiByteStop) {
  StopMatcher matcher({"\xE2\x80\x94stop"});  // em dash + "stop"
  EXPECT_EQ(matcher.Push("caf\xC3\xA9 \xE2\x80").text, "caf\xC3\xA9 ");
  const StopMatcher::Result r = matcher.Push("\x94stop!");
  EXPECT_EQ(r.text, "");
  EXPECT_TRUE(r.stopped);
}

// Reference: feed one byte at a time and stop at the first byte where some stop has completed;
// cut at the earliest start among the stops ending there.
std::pair<std::string, bool> StopRef(const std::string& text,
                                     const std::vector<std::string>& stops) {
  for (size_t end = 1; end <= text.size(); ++end) {
    size_t cut = std::string::npos;
    for (const std::string& stop : stops) {
      if (!stop.empty() && stop.size() <= end &&
          text.compare(end - stop.size(), stop.size(), stop) == 0) {
        cut = std::min(cut, end - stop.size());
      }
    }
    if (cut != std::string::npos) return {text.substr(0, cut), true};
  }
  return {text, false};
}

TEST(StopMatcherTest, OutputDoesNotDependOnHowTextIsSplit) {
  // "ca" nested in "abcab" exercises first-to-complete against earliest-start.
  const std::vector<std::string> stops = {"aba", "bab", "abb", "ca", "abcab", ""};
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text;
    const size_t len = 1 + rng() % 12;
    for (size_t i = 0; i < len; ++i) text += "abc"[rng() % 3];
    std::vector<std::string> pieces;
    for (size_t pos = 0; pos < text.size();) {
      const size_t n = std::min<size_t>(1 + rng() % 4, text.size() - pos);
      pieces.push_back(text.substr(pos, n));
      pos += n;
    }
    StopMatcher matcher(stops);
    EXPECT_EQ(Stream(matcher, pieces), StopRef(text, stops)) << "text " << text;
  }
}

}  // namespace
}  // namespace subspace
