// The sampling kernel's CPU twin (sampling_ref.h) against the host sampler it stands in for
// (core/model/sampler.h, no repetition penalty), so a kernel that matches the twin matches the
// host. core::Sampler draws its uniform from raw mt19937_64 bits (UniformFromBits: the top 53 bits
// times 2^-53); the test rebuilds that draw from the seed and hands it to the twin, so the two
// must pick the same token for every seed, not merely from the same distribution, and report
// bit-identical log-probabilities (both compute float(logit - log_z) with the same float terms
// summed in double in the same order). Fresh random logits per case (seed printed;
// SUBSPACE_TEST_SEED pins it): plain, heavily tied, and with -inf, NaN, +inf and signed zeros.
#include "tests/kernels/sampling_ref.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "core/model/sampler.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// core/model/sampler.cc's first draw for `seed` (UniformFromBits on a fresh engine).
double HostUniform(uint64_t seed) {
  std::mt19937_64 rng(seed);
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

enum class Logits { kNormal, kTied, kSpecial };

// kNormal: N(0, sigma^2), sigma 1 to 4. kTied: multiples of 0.5 (most tokens share a value
// with others; signed zeros among them). kSpecial: kNormal with ~10% -inf, ~5% NaN and, in a
// quarter of the rows, one +inf.
std::vector<float> RandomLogits(int vocab, Logits kind, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f + 3.0f * uni(rng));
  std::vector<float> x(static_cast<size_t>(vocab));
  for (float& v : x) v = normal(rng);
  if (kind == Logits::kTied) {
    for (float& v : x) {
      v = std::round(v * 2.0f) / 2.0f;
      if (v == 0.0f && uni(rng) < 0.5f) v = -0.0f;
    }
  } else if (kind == Logits::kSpecial) {
    for (float& v : x) {
      const float t = uni(rng);
      if (t < 0.10f)
        v = -kInf;
      else if (t < 0.15f)
        v = std::numeric_limits<float>::quiet_NaN();
    }
    if (uni(rng) < 0.25f) x[std::uniform_int_distribution<size_t>(0, x.size() - 1)(rng)] = kInf;
  }
  return x;
}

struct Policy {
  float temperature;
  int32_t top_k;
  float top_p;
  float min_p;
};

std::string Describe(const Policy& p) {
  return "temperature " + std::to_string(p.temperature) + " top_k " + std::to_string(p.top_k) +
         " top_p " + std::to_string(p.top_p) + " min_p " + std::to_string(p.min_p);
}

// Every combination the kernel tests sweep too; top_k = vocab is "all" through the other branch
// of the host's code than top_k = 0.
std::vector<Policy> Policies(int vocab) {
  std::vector<Policy> out;
  for (float t : {0.0f, 0.2f, 1.0f, 5.0f}) {
    for (int32_t k : {0, 1, 5, vocab}) {
      for (float p : {0.1f, 0.9f, 1.0f}) {
        for (float m : {0.0f, 0.05f}) out.push_back({t, k, p, m});
      }
    }
  }
  return out;
}

SampledToken HostSample(std::vector<float> logits, const Policy& p, uint64_t seed) {
  SamplingParams sp;
  sp.temperature = p.temperature;
  sp.top_k = p.top_k;
  sp.top_p = p.top_p;
  sp.min_p = p.min_p;
  sp.seed = seed;
  EXPECT_TRUE(ValidateSamplingParams(sp).ok());
  Sampler sampler(sp);
  return sampler.Sample(logits, {});
}

bool SameFloat(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// vocab, kind of logits.
using Shape = std::tuple<int, Logits>;

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  const auto& [vocab, kind] = info.param;
  std::string name = "v";
  name += std::to_string(vocab);
  name += kind == Logits::kNormal ? "_normal" : kind == Logits::kTied ? "_tied" : "_special";
  return name;
}

class SamplingRefTest : public ::testing::TestWithParam<Shape> {};

TEST_P(SamplingRefTest, PicksTheHostSamplersTokenForEverySeed) {
  const auto [vocab, kind] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  // Fewer draws where a row is expensive to sort; still ~300 rows of 32000.
  const int draws = vocab >= 32000 ? 3 : vocab >= 1000 ? 20 : 40;
  int64_t rows = 0, stochastic = 0;
  for (const Policy& policy : Policies(vocab)) {
    SCOPED_TRACE(Describe(policy));
    for (int d = 0; d < draws; ++d) {
      const std::vector<float> logits = RandomLogits(vocab, kind, rng);
      const uint64_t draw_seed = rng();
      const SampledToken want = HostSample(logits, policy, draw_seed);
      const SampleRowResult got = SampleRowRef(logits, policy.temperature, policy.top_k,
                                               policy.top_p, policy.min_p, HostUniform(draw_seed));
      ASSERT_EQ(got.token, want.token) << "draw " << d << " (seed " << draw_seed << ")";
      ASSERT_TRUE(SameFloat(got.logprob, want.logprob))
          << "draw " << d << ": " << got.logprob << " vs " << want.logprob;
      ++rows;
      stochastic += policy.temperature > 0.0f;
    }
  }
  EXPECT_GT(stochastic, 0);
  RecordProperty("rows", static_cast<int>(rows));
}

// The margin means what it says: moving the uniform by less than margin * (the kept total) —
// half the margin, in uniform units — never changes the token.
TEST_P(SamplingRefTest, TokenHoldsWithinTheReportedMargin) {
  const auto [vocab, kind] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  const int draws = vocab >= 32000 ? 2 : 10;
  for (const Policy& policy : Policies(vocab)) {
    if (policy.temperature == 0.0f) continue;
    SCOPED_TRACE(Describe(policy));
    for (int d = 0; d < draws; ++d) {
      const std::vector<float> logits = RandomLogits(vocab, kind, rng);
      const double u = uni(rng);
      const SampleRowResult r =
          SampleRowRef(logits, policy.temperature, policy.top_k, policy.top_p, policy.min_p, u);
      if (!(r.margin > 0.0) || std::isinf(r.margin)) continue;
      for (double nudged : {u - 0.49 * r.margin, u + 0.49 * r.margin}) {
        if (nudged < 0.0 || nudged >= 1.0) continue;
        const SampleRowResult n = SampleRowRef(logits, policy.temperature, policy.top_k,
                                               policy.top_p, policy.min_p, nudged);
        ASSERT_EQ(n.token, r.token) << "u " << u << " -> " << nudged << ", margin " << r.margin;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SamplingRefTest,
                         ::testing::Combine(::testing::Values(1, 7, 1000, 32000),
                                            ::testing::Values(Logits::kNormal, Logits::kTied,
                                                              Logits::kSpecial)),
                         ShapeName);

// Rows with nothing to sample: token 0 and logprob -inf, like the host, whatever the policy.
TEST(SamplingRefEdgeTest, AllMinusInfOrNaNGivesTokenZero) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const std::vector<float>& logits :
       {std::vector<float>{-kInf, -kInf, -kInf}, std::vector<float>{nan, nan},
        std::vector<float>{nan, -kInf, nan, -kInf}}) {
    for (const Policy& p : Policies(static_cast<int>(logits.size()))) {
      const SampleRowResult r = SampleRowRef(logits, p.temperature, p.top_k, p.top_p, p.min_p, 0.5);
      EXPECT_EQ(r.token, 0) << Describe(p);
      EXPECT_EQ(r.logprob, -kInf) << Describe(p);
      const SampledToken h = HostSample(logits, p, 7);
      EXPECT_EQ(h.token, 0);
      EXPECT_EQ(h.logprob, -kInf);
    }
  }
}

// +inf is the largest finite float: two of them tie (lowest id wins under greedy, both are
// drawn under sampling) and everything else has weight 0.
TEST(SamplingRefEdgeTest, PlusInfTiesWithTheLargestFloat) {
  const std::vector<float> logits = {1.0f, kInf, 3.0f, std::numeric_limits<float>::max(), kInf};
  EXPECT_EQ(SampleRowRef(logits, 0.0f, 0, 1.0f, 0.0f, 0.5).token, 1);
  // Id order: 1, 3, 4 share the weight.
  EXPECT_EQ(SampleRowRef(logits, 1.0f, 0, 1.0f, 0.0f, 0.1).token, 1);
  EXPECT_EQ(SampleRowRef(logits, 1.0f, 0, 1.0f, 0.0f, 0.5).token, 3);
  EXPECT_EQ(SampleRowRef(logits, 1.0f, 0, 1.0f, 0.0f, 0.9).token, 4);
  EXPECT_EQ(SampleRowRef(logits, 1.0f, 2, 1.0f, 0.0f, 0.9).token, 3);
  for (uint64_t seed = 0; seed < 50; ++seed) {
    const SampledToken h = HostSample(logits, {1.0f, 0, 1.0f, 0.0f}, seed);
    const SampleRowResult r = SampleRowRef(logits, 1.0f, 0, 1.0f, 0.0f, HostUniform(seed));
    EXPECT_EQ(r.token, h.token);
    EXPECT_TRUE(SameFloat(r.logprob, h.logprob));
  }
}

// The walk order the host uses: by id without top-k and top-p, sorted otherwise. Weights 0.5
// (id 0) and 1 (id 1), total 1.5. u = 0.4 (r = 0.6): id 1 either way. u = 0.3 (r = 0.45):
// by id the first running sum, 0.5, already exceeds r: id 0; sorted, id 1 comes first.
TEST(SamplingRefEdgeTest, WalksByIdOnlyWithoutTopKAndTopP) {
  const std::vector<float> logits = {std::log(0.5f), 0.0f};
  EXPECT_EQ(SampleRowRef(logits, 1.0f, 0, 1.0f, 0.0f, 0.4).token, 1);
  EXPECT_EQ(SampleRowRef(logits, 1.0f, 0, 1.0f, 0.0f, 0.3).token, 0);
  EXPECT_EQ(SampleRowRef(logits, 1.0f, 2, 1.0f, 0.0f, 0.3).token, 0);  // top_k = vocab: all
  EXPECT_EQ(SampleRowRef(logits, 1.0f, 0, 0.999f, 0.0f, 0.3).token, 1);
  EXPECT_EQ(SampleRowRef(logits, 1.0f, 1, 1.0f, 0.0f, 0.3).token, 1);
}

}  // namespace
}  // namespace subspace::kernels
