// sampling.cu against its CPU twin (sampling_ref.h, itself held to core::Sampler token for
// token in sampling_ref_test.cc). The policies of the sweep (temperature 0/0.2/1/5 x top_k
// 0/1/5/vocab x top_p 0.1/0.9/1 x min_p 0/0.05; all of them for plain logits, a rotating share
// for the others: PolicySweep) are rows of one launch, per vocabulary size (1, 7, 1000, 32000)
// and kind of logits (plain, tied, -inf/NaN/+inf, all equal, signed zeros, nothing finite); then
// batches of rows with random per-row policies at LLM vocabulary sizes up to 256000. Fresh random
// logits and uniforms per case (seed printed; SUBSPACE_TEST_SEED pins it), uniforms 0 and the float
// below 1 among them; outputs poisoned (0xff: token -1, logprob NaN) before each launch.
//
// Tolerances:
//  - Token: identical to the twin's, unless the twin's margin (its closest call: a min-p
//    weight against min_p, the top-p running sum against its target, the draw against the
//    running sums around it, all relative) is below 1e-6. The kernel's weights are float
//    exp((logit - max) / T) like the twin's, from double exp() rounded to float where the twin
//    has glibc's expf (<= 0.502 ulp): they differ by at most one float ulp (1.2e-7), and the
//    double sums only in order (~1e-16), so a different pick needs a margin far below 1e-6.
//    (1e-5 would excuse too much: a draw over n candidates lands within m of a boundary with
//    probability ~2 m n, most rows at 32000 without top-k.) Such rows still need a token the
//    policy allows (finite logit, within top-k) and are counted: at most half of the rows.
//  - Logprob: within 1e-4 (absolute) of the twin's log-softmax of the kernel's token; both are
//    float(logit - log_z) with log_z from the same float terms, summed in another order.
#include "kernels/sampling.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/kv_test_data.h"
#include "tests/kernels/sampling_ref.h"

namespace subspace::kernels {
namespace {

using testing::DeviceBuffer;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kMarginTolerance = 1e-6;
constexpr double kLogprobTolerance = 1e-4;

#define SUBSPACE_TRACE_SEED(seed) \
  SCOPED_TRACE(::testing::Message() << "seed " << (seed) << " (SUBSPACE_TEST_SEED pins it)")

enum class Logits { kNormal, kTied, kSpecial, kAllEqual, kSignedZeros, kNothingFinite };

std::string KindName(Logits kind) {
  switch (kind) {
    case Logits::kNormal:
      return "normal";
    case Logits::kTied:
      return "tied";
    case Logits::kSpecial:
      return "special";
    case Logits::kAllEqual:
      return "all_equal";
    case Logits::kSignedZeros:
      return "signed_zeros";
    case Logits::kNothingFinite:
      return "nothing_finite";
  }
  return "?";
}

void PrintTo(Logits kind, std::ostream* os) { *os << KindName(kind); }

// kNormal: N(0, sigma^2), sigma 1 to 4. kTied: multiples of 0.5, signed zeros among them.
// kSpecial: kNormal with ~10% -inf, ~5% NaN and, in a quarter of the rows, +inf twice and the
// largest float once (a three-way tie). kAllEqual: one value. kSignedZeros: +0 and -0 at
// random (equal: only ids order them) and one -1. kNothingFinite: -inf and NaN.
std::vector<float> RandomLogits(int vocab, Logits kind, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f + 3.0f * uni(rng));
  std::uniform_int_distribution<int> pick(0, vocab - 1);
  std::vector<float> x(static_cast<size_t>(vocab));
  for (float& v : x) v = normal(rng);
  switch (kind) {
    case Logits::kNormal:
      break;
    case Logits::kTied:
      for (float& v : x) {
        v = std::round(v * 2.0f) / 2.0f;
        if (v == 0.0f && uni(rng) < 0.5f) v = -0.0f;
      }
      break;
    case Logits::kSpecial:
      for (float& v : x) {
        const float t = uni(rng);
        if (t < 0.10f)
          v = -kInf;
        else if (t < 0.15f)
          v = std::numeric_limits<float>::quiet_NaN();
      }
      if (uni(rng) < 0.25f) {
        x[pick(rng)] = kInf;
        x[pick(rng)] = std::numeric_limits<float>::max();
        x[pick(rng)] = kInf;
      }
      break;
    case Logits::kAllEqual:
      std::fill(x.begin(), x.end(), normal(rng));
      break;
    case Logits::kSignedZeros:
      for (float& v : x) v = uni(rng) < 0.5f ? -0.0f : 0.0f;
      x[pick(rng)] = -1.0f;
      break;
    case Logits::kNothingFinite:
      for (float& v : x) v = uni(rng) < 0.5f ? -kInf : std::numeric_limits<float>::quiet_NaN();
      break;
  }
  return x;
}

// Host copies of a launch's inputs.
struct Batch {
  int32_t vocab = 0;
  std::vector<float> logits;  // [rows, vocab]
  std::vector<float> temperature, top_p, min_p, uniform;
  std::vector<int32_t> top_k;

  int32_t rows() const { return static_cast<int32_t>(temperature.size()); }
  void Add(const std::vector<float>& x, float t, int32_t k, float p, float m, float u) {
    logits.insert(logits.end(), x.begin(), x.end());
    temperature.push_back(t);
    top_k.push_back(k);
    top_p.push_back(p);
    min_p.push_back(m);
    uniform.push_back(u);
  }
};

// Mostly uniform in [0, 1); now and then exactly 0 or the float just below 1.
float RandomUniform(std::mt19937_64& rng) {
  const float u = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
  const uint64_t edge = rng() % 16;
  return edge == 0 ? 0.0f : edge == 1 ? std::nextafter(1.0f, 0.0f) : u;
}

// The sweep: policies as rows, fresh logits each. Plain logits get every policy. The other kinds
// get every (temperature, top_k) pair with a share of the (top_p, min_p) pairs, rotated by a
// random offset so that every policy meets every kind over runs: half of them for tied and
// special logits, one in six where ties or non-finite values make all policies alike (all
// equal, signed zeros, nothing finite). Their rows cost the emulated kernel the most (a CTA
// walks each tie), ~150 of the sweep's 250 CPU seconds when every kind took every policy.
Batch PolicySweep(int vocab, Logits kind, std::mt19937_64& rng) {
  Batch b;
  b.vocab = vocab;
  const int stride = kind == Logits::kNormal                             ? 1
                     : kind == Logits::kTied || kind == Logits::kSpecial ? 2
                                                                         : 6;
  const int offset = static_cast<int>(rng() % 6);
  int pair = 0;
  for (float t : {0.0f, 0.2f, 1.0f, 5.0f}) {
    for (int32_t k : {0, 1, 5, vocab}) {
      int tail = 0;
      for (float p : {0.1f, 0.9f, 1.0f}) {
        for (float m : {0.0f, 0.05f}) {
          if ((tail++ + pair + offset) % stride == 0) {
            b.Add(RandomLogits(vocab, kind, rng), t, k, p, m, RandomUniform(rng));
          }
        }
      }
      ++pair;
    }
  }
  return b;
}

// Rank of `token` in the host's strict order (logit descending, then id; NaN as -inf).
int64_t Rank(std::span<const float> x, int32_t token) {
  const auto clean = [](float v) { return std::isnan(v) ? -kInf : v; };
  const float t = clean(x[token]);
  int64_t rank = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float v = clean(x[i]);
    rank += v > t || (v == t && static_cast<int32_t>(i) < token);
  }
  return rank;
}

// Launches the kernel on `b` and holds every row to the twin.
void CheckAgainstTwin(const Batch& b) {
  const int32_t rows = b.rows(), vocab = b.vocab;
  std::vector<int32_t> want_token(static_cast<size_t>(rows));
  std::vector<float> want_logprob(static_cast<size_t>(rows));
  std::vector<double> margin(static_cast<size_t>(rows));
  SampleTokensParams host{
      b.logits.data(),  b.temperature.data(), b.top_k.data(),      b.top_p.data(), b.min_p.data(),
      b.uniform.data(), want_token.data(),    want_logprob.data(), rows,           vocab};
  SampleTokensRef(host, margin.data());

  DeviceBuffer<float> d_logits = testing::ToDevice(b.logits);
  DeviceBuffer<float> d_t = testing::ToDevice(b.temperature), d_p = testing::ToDevice(b.top_p),
                      d_m = testing::ToDevice(b.min_p), d_u = testing::ToDevice(b.uniform);
  DeviceBuffer<int32_t> d_k = testing::ToDevice(b.top_k);
  DeviceBuffer<int32_t> d_token(static_cast<size_t>(rows));
  DeviceBuffer<float> d_logprob(static_cast<size_t>(rows));
  ASSERT_TRUE(d_logits.ok() && d_t.ok() && d_p.ok() && d_m.ok() && d_u.ok() && d_k.ok() &&
              d_token.ok() && d_logprob.ok());
  SUBSPACE_ASSERT_CUDA(d_token.Poison());
  SUBSPACE_ASSERT_CUDA(d_logprob.Poison());
  const SampleTokensParams p{d_logits.get(), d_t.get(),     d_k.get(),       d_p.get(), d_m.get(),
                             d_u.get(),      d_token.get(), d_logprob.get(), rows,      vocab};
  SUBSPACE_ASSERT_CUDA(LaunchSampleTokens(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<int32_t> got_token;
  std::vector<float> got_logprob;
  SUBSPACE_ASSERT_CUDA(d_token.Download(&got_token));
  SUBSPACE_ASSERT_CUDA(d_logprob.Download(&got_logprob));

  int flagged = 0;
  for (int32_t r = 0; r < rows; ++r) {
    const std::span<const float> x(b.logits.data() + static_cast<size_t>(r) * vocab,
                                   static_cast<size_t>(vocab));
    SCOPED_TRACE(::testing::Message()
                 << "row " << r << ": temperature " << b.temperature[r] << " top_k " << b.top_k[r]
                 << " top_p " << b.top_p[r] << " min_p " << b.min_p[r] << " uniform "
                 << b.uniform[r] << " twin margin " << margin[r]);
    const int32_t token = got_token[r];
    ASSERT_GE(token, 0);
    ASSERT_LT(token, vocab);
    const bool close_call = margin[r] < kMarginTolerance;
    flagged += close_call;
    if (!close_call) {
      ASSERT_EQ(token, want_token[r]);
    } else if (token != want_token[r]) {
      // A close call may go the other way, but only to a token the policy allows.
      const float v = std::isnan(x[token]) ? -kInf : x[token];
      EXPECT_GT(v, -kInf) << "token " << token;
      if (b.top_k[r] > 0) {
        EXPECT_LT(Rank(x, token), b.top_k[r]) << "token " << token;
      }
    }
    // The twin's log-softmax of the kernel's token.
    float want = want_logprob[r];
    if (token != want_token[r]) {
      const SampleRowResult row =
          SampleRowRef(x, b.temperature[r], b.top_k[r], b.top_p[r], b.min_p[r], b.uniform[r]);
      const float raw =
          std::isnan(x[token]) ? -kInf : std::min(x[token], std::numeric_limits<float>::max());
      want =
          std::isinf(row.log_z) ? -kInf : static_cast<float>(static_cast<double>(raw) - row.log_z);
    }
    ASSERT_FALSE(std::isnan(got_logprob[r])) << "logprob not written";
    if (std::isinf(want) || std::isinf(got_logprob[r])) {
      ASSERT_EQ(got_logprob[r], want);
    } else {
      ASSERT_NEAR(got_logprob[r], want, kLogprobTolerance);
    }
  }
  EXPECT_LE(flagged, rows / 2 + 2) << "too many rows within float rounding of a boundary";
}

class SamplingGpuTest : public ::testing::TestWithParam<std::tuple<int, Logits>> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(SamplingGpuTest, EveryPolicyMatchesTheTwin) {
  const auto [vocab, kind] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  CheckAgainstTwin(PolicySweep(vocab, kind, rng));
}

std::string SweepName(const ::testing::TestParamInfo<std::tuple<int, Logits>>& info) {
  std::string name = "v";
  name += std::to_string(std::get<0>(info.param));
  name += "_";
  name += KindName(std::get<1>(info.param));
  return name;
}

INSTANTIATE_TEST_SUITE_P(Shapes, SamplingGpuTest,
                         ::testing::Combine(::testing::Values(1, 7, 1000, 32000),
                                            ::testing::Values(Logits::kNormal, Logits::kTied,
                                                              Logits::kSpecial, Logits::kAllEqual,
                                                              Logits::kSignedZeros,
                                                              Logits::kNothingFinite)),
                         SweepName);

class SamplingGpuBatchTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

// 48 rows, each with its own kind of logits and policy (top_k and top_p drawn wider than the
// sweep's), in one launch.
TEST_P(SamplingGpuBatchTest, MixedRowsMatchTheTwin) {
  const int vocab = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  Batch b;
  b.vocab = vocab;
  for (int r = 0; r < 48; ++r) {
    const auto kind = static_cast<Logits>(rng() % 6 == 0 ? rng() % 6 : 0);
    const float temps[] = {0.0f, 0.05f, 0.7f, 1.0f, 1.5f, 100.0f};
    const int32_t ks[] = {0, 1, 2, 40, 1000, vocab - 1, vocab, vocab + 5};
    const float ps[] = {1.0f, 1.0f, 0.95f, 0.5f, 0.01f, uni(rng)};
    const float ms[] = {0.0f, 0.0f, 0.1f, 0.9f * uni(rng)};
    b.Add(RandomLogits(vocab, kind, rng), temps[rng() % 6], std::max(0, ks[rng() % 8]),
          std::max(ps[rng() % 6], 1e-3f), ms[rng() % 4], RandomUniform(rng));
  }
  CheckAgainstTwin(b);
}

INSTANTIATE_TEST_SUITE_P(Vocab, SamplingGpuBatchTest,
                         ::testing::Values(1000, 32000, 128256, 256000));

// No device needed: the launcher checks before it touches CUDA.
TEST(SamplingGpuLimitsTest, RejectsBadParams) {
  float f = 0.0f;
  int32_t i = 0;
  const SampleTokensParams good{&f, &f, &i, &f, &f, &f, &i, &f, 1, 1};
  auto with = [&](auto change) {
    SampleTokensParams p = good;
    change(p);
    return LaunchSampleTokens(p, nullptr);
  };
  EXPECT_EQ(with([](SampleTokensParams& p) { p.n_rows = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.n_rows = -3; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.vocab = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.vocab = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.vocab = std::numeric_limits<int32_t>::max(); }),
            cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.logits = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.temperature = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.top_k = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.top_p = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.min_p = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.uniform = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.token = nullptr; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](SampleTokensParams& p) { p.logprob = nullptr; }), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace subspace::kernels
