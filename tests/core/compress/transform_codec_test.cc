// The transform codec: every code value of every width through the quantizer, packed rows
// against a float64 reference, the quantizer fit, the width allocation against brute force,
// the PCA analysis and the shared (joint) budget.
#include "core/compress/transform_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace subspace {
namespace {

TEST(ComponentQuantizerTest, EveryCodeOfEveryWidthDecodesAndEncodesBack) {
  for (int bits = 1; bits <= ComponentQuantizer::kMaxBits; ++bits) {
    const ComponentQuantizer q{.bits = bits, .offset = -1.25f, .step = 0.0625f};
    const uint32_t top = (1u << bits) - 1;
    for (uint32_t c = 0; c <= top; ++c) {
      const double want = -1.25 + 0.0625 * c;  // float64 reference
      EXPECT_NEAR(q.Decode(c), want, 1e-6) << bits << " " << c;
      EXPECT_EQ(q.Encode(q.Decode(c)), c) << bits;
      EXPECT_EQ(q.Encode(q.Decode(c) + 0.03f), c) << "rounds to the nearest";
    }
    EXPECT_EQ(q.Encode(-100.0f), 0u);
    EXPECT_EQ(q.Encode(100.0f), top) << "clamped";
    EXPECT_EQ(q.Encode(std::numeric_limits<float>::quiet_NaN()), 0u);
  }
  const ComponentQuantizer zero{.bits = 0, .offset = 0.5f, .step = 0.0f};
  EXPECT_EQ(zero.Encode(7.0f), 0u);
  EXPECT_EQ(zero.Decode(0), 0.5f);
}

// A code with a random orthonormal basis (Gram-Schmidt of a random matrix) and the given widths.
TransformCode RandomCode(int d, const std::vector<int>& widths, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd;
  std::vector<double> b(static_cast<size_t>(d) * d);
  for (double& x : b) x = nd(rng);
  for (int j = 0; j < d; ++j) {
    double* r = b.data() + static_cast<size_t>(j) * d;
    for (int k = 0; k < j; ++k) {
      const double* p = b.data() + static_cast<size_t>(k) * d;
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += r[i] * p[i];
      for (int i = 0; i < d; ++i) r[i] -= dot * p[i];
    }
    double n = 0;
    for (int i = 0; i < d; ++i) n += r[i] * r[i];
    for (int i = 0; i < d; ++i) r[i] /= std::sqrt(n);
  }
  TransformCode c;
  c.dim = d;
  c.basis.assign(b.begin(), b.end());
  c.mean.resize(static_cast<size_t>(d));
  for (float& m : c.mean) m = static_cast<float>(0.3 * nd(rng));
  for (int j = 0; j < d; ++j) {
    const int bits = widths[static_cast<size_t>(j) % widths.size()];
    const float range = 3.0f;
    c.components.push_back(
        {.bits = bits,
         .offset = bits == 0 ? 0.1f : -range,
         .step = bits == 0 ? 0.0f : 2 * range / static_cast<float>((1 << bits) - 1)});
  }
  return c;
}

TEST(TransformCodeTest, PackedRowsMatchAFloat64Reference) {
  const int d = 16;
  for (const std::vector<int>& widths : {std::vector<int>{0},
                                         {1},
                                         {2},
                                         {3},
                                         {4},
                                         {5},
                                         {6},
                                         {7},
                                         {8},
                                         {0, 2, 3, 4, 8},
                                         {8, 1, 0, 5}}) {
    const TransformCode c = RandomCode(d, widths, 7);
    int bits = 0;
    for (int j = 0; j < d; ++j) bits += widths[static_cast<size_t>(j) % widths.size()];
    EXPECT_EQ(c.BitsPerRow(), bits);
    EXPECT_EQ(c.BytesPerRow(), (bits + 7) / 8);
    std::mt19937 rng(11);
    std::normal_distribution<float> nd;
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> x(static_cast<size_t>(d));
      for (float& v : x) v = 1.5f * nd(rng);
      // Reference: project in double, quantize each coefficient, reconstruct.
      std::vector<double> want(c.mean.begin(), c.mean.end());
      for (int j = 0; j < d; ++j) {
        const ComponentQuantizer& q = c.components[static_cast<size_t>(j)];
        double coef = 0;
        for (int i = 0; i < d; ++i)
          coef += c.basis[static_cast<size_t>(j * d + i)] * (x[i] - c.mean[i]);
        double v = q.offset;
        if (q.bits > 0) {
          const double top = (1 << q.bits) - 1;
          v = q.offset + q.step * std::clamp(std::round((coef - q.offset) / q.step), 0.0, top);
        }
        for (int i = 0; i < d; ++i)
          want[static_cast<size_t>(i)] += v * c.basis[static_cast<size_t>(j * d + i)];
      }
      std::vector<uint8_t> codes(static_cast<size_t>(c.BytesPerRow()) + 4, 0xAB);
      c.Encode(x.data(), codes.data());
      for (size_t i = static_cast<size_t>(c.BytesPerRow()); i < codes.size(); ++i) {
        EXPECT_EQ(codes[i], 0xAB) << "wrote past the row";
      }
      std::vector<float> got(static_cast<size_t>(d));
      c.Decode(codes.data(), got.data());
      std::vector<float> rt = x;
      c.RoundTrip(rt.data());
      for (int i = 0; i < d; ++i) {
        EXPECT_NEAR(got[i], want[static_cast<size_t>(i)], 1e-4) << i;
        EXPECT_EQ(rt[i], got[i]);
        EXPECT_FALSE(std::isnan(got[i]));
      }
    }
  }
}

TEST(TransformCodeTest, IdentityBasisAndEqualWidthsIsScalarQuantization) {
  const int d = 8;
  TransformCode c;
  c.dim = d;
  c.mean.assign(d, 0.0f);
  c.basis.assign(d * d, 0.0f);
  for (int i = 0; i < d; ++i) c.basis[static_cast<size_t>(i * d + i)] = 1.0f;
  c.components.assign(d, {.bits = 4, .offset = -2.0f, .step = 0.25f});
  std::vector<float> x = {-3.0f, -1.9f, -0.13f, 0.0f, 0.12f, 0.9f, 1.6f, 5.0f};
  std::vector<float> rt = x;
  c.RoundTrip(rt.data());
  for (int i = 0; i < d; ++i) {
    const float want = -2.0f + 0.25f * std::clamp(std::round((x[i] + 2.0f) / 0.25f), 0.0f, 15.0f);
    EXPECT_FLOAT_EQ(rt[i], want) << i;
  }
}

TEST(FitComponentQuantizerTest, ZeroBitsIsTheMeanAndMoreBitsLessError) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.5f, 2.0f);
  std::vector<float> x(5000);
  for (float& v : x) v = nd(rng);
  const FittedQuantizer f0 = FitComponentQuantizer(x, 0);
  double mean = 0, var = 0;
  for (float v : x) mean += v;
  mean /= x.size();
  for (float v : x) var += (v - mean) * (v - mean);
  var /= x.size();
  EXPECT_NEAR(f0.quantizer.offset, mean, 1e-4);
  EXPECT_NEAR(f0.mse, var, 1e-3 * var);
  double prev = f0.mse;
  for (int bits = 1; bits <= 8; ++bits) {
    const FittedQuantizer f = FitComponentQuantizer(x, bits);
    EXPECT_EQ(f.quantizer.bits, bits);
    EXPECT_LT(f.mse, prev) << bits;
    prev = f.mse;
  }
  // A Gaussian at 2 bits: the optimal uniform quantizer's error is 0.1188 sigma^2 (Max, 1960).
  EXPECT_NEAR(FitComponentQuantizer(x, 2).mse / var, 0.1188, 0.01);
  EXPECT_LT(prev / var, 1e-4);
}

TEST(FitComponentQuantizerTest, SamplesOnTheGridAreExact) {
  std::vector<float> x;
  for (int i = 0; i < 200; ++i) x.push_back(1.0f + 0.5f * static_cast<float>(i % 8));
  const FittedQuantizer f = FitComponentQuantizer(x, 3);
  EXPECT_LT(f.mse, 1e-10);
  for (float v : x) EXPECT_NEAR(f.quantizer.Decode(f.quantizer.Encode(v)), v, 1e-5);
  const FittedQuantizer c = FitComponentQuantizer(std::vector<float>(10, 2.0f), 4);
  EXPECT_EQ(c.mse, 0.0);
  EXPECT_EQ(c.quantizer.Decode(c.quantizer.Encode(2.0f)), 2.0f);
}

TEST(AllocateWidthsTest, MatchesBruteForceOnSmallCases) {
  const std::vector<int> widths = {0, 2, 3, 4, 8};
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int trial = 0; trial < 30; ++trial) {
    const int n = 1 + trial % 4;
    std::vector<std::vector<double>> dist(static_cast<size_t>(n));
    for (auto& row : dist) {  // decreasing in width, like a real distortion, but not convex
      double v = 1.0 + 10 * u(rng);
      for (size_t o = 0; o < widths.size(); ++o) {
        row.push_back(v);
        v *= u(rng);
      }
    }
    for (int budget = 0; budget <= 8 * n; budget += 1 + trial % 3) {
      absl::StatusOr<std::vector<int>> got = AllocateWidths(dist, widths, budget);
      ASSERT_TRUE(got.ok()) << got.status();
      double got_d = 0;
      int got_bits = 0;
      for (int i = 0; i < n; ++i) {
        got_d += dist[static_cast<size_t>(i)][static_cast<size_t>((*got)[static_cast<size_t>(i)])];
        got_bits += widths[static_cast<size_t>((*got)[static_cast<size_t>(i)])];
      }
      EXPECT_LE(got_bits, budget);
      double best = std::numeric_limits<double>::infinity();
      int combos = 1;
      for (int i = 0; i < n; ++i) combos *= static_cast<int>(widths.size());
      for (int m = 0; m < combos; ++m) {
        double d = 0;
        int bits = 0;
        for (int i = 0, r = m; i < n; ++i, r /= static_cast<int>(widths.size())) {
          const int o = r % static_cast<int>(widths.size());
          d += dist[static_cast<size_t>(i)][static_cast<size_t>(o)];
          bits += widths[static_cast<size_t>(o)];
        }
        if (bits <= budget) best = std::min(best, d);
      }
      EXPECT_NEAR(got_d, best, 1e-12 * best) << "n " << n << " budget " << budget;
    }
  }
}

TEST(AllocateWidthsTest, RefusesWhatCannotBeAllocated) {
  const std::vector<std::vector<double>> dist = {{1.0, 0.5}, {1.0, 0.5}};
  EXPECT_FALSE(AllocateWidths(dist, std::vector<int>{0, 9}, 8).ok());
  EXPECT_FALSE(AllocateWidths(dist, std::vector<int>{0, -1}, 8).ok());
  EXPECT_FALSE(AllocateWidths(dist, std::vector<int>{0, 2, 4}, 8).ok()) << "rows of 2, widths 3";
  EXPECT_FALSE(AllocateWidths(dist, std::vector<int>{2, 4}, 3).ok()) << "2 x 2 bits > 3";
  EXPECT_FALSE(AllocateWidths(dist, std::vector<int>{}, 3).ok());
  absl::StatusOr<std::vector<int>> ok = AllocateWidths(dist, std::vector<int>{2, 4}, 4);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, (std::vector<int>{0, 0}));
}

// Rows with variance 16, 4, 1, 0.25 along a rotated basis, plus a mean.
std::vector<float> AnisotropicRows(int64_t n, int d, uint32_t seed, std::vector<float>* axis0) {
  const TransformCode rot = RandomCode(d, {0}, seed);
  std::mt19937 rng(seed + 1);
  std::normal_distribution<float> nd;
  std::vector<float> rows(static_cast<size_t>(n) * d);
  for (int64_t r = 0; r < n; ++r) {
    for (int j = 0; j < d; ++j) {
      const float c = nd(rng) * std::pow(2.0f, 2.0f - static_cast<float>(j));
      for (int i = 0; i < d; ++i)
        rows[static_cast<size_t>(r * d + i)] += c * rot.basis[static_cast<size_t>(j * d + i)];
    }
    for (int i = 0; i < d; ++i) rows[static_cast<size_t>(r * d + i)] += 1.0f + i;
  }
  axis0->assign(rot.basis.begin(), rot.basis.begin() + d);
  return rows;
}

TEST(AnalyzeStreamTest, PcaFindsTheAxesAndAllocationFollowsVariance) {
  const int d = 4;
  std::vector<float> axis0;
  const std::vector<float> rows = AnisotropicRows(20000, d, 21, &axis0);
  const TransformCodeOptions o;
  absl::StatusOr<TransformStream> s = AnalyzeStream(rows.data(), 20000, d, o);
  ASSERT_TRUE(s.ok()) << s.status();
  for (int i = 0; i < d; ++i) EXPECT_NEAR(s->mean[static_cast<size_t>(i)], 1.0 + i, 0.1);
  double dot = 0;
  for (int i = 0; i < d; ++i)
    dot += s->basis[static_cast<size_t>(i)] * axis0[static_cast<size_t>(i)];
  EXPECT_GT(std::fabs(dot), 0.999) << "the first component is the widest axis";
  for (int j = 0; j < d; ++j) {
    for (int k = 0; k < d; ++k) {
      double g = 0;
      for (int i = 0; i < d; ++i)
        g += s->basis[static_cast<size_t>(j * d + i)] * s->basis[static_cast<size_t>(k * d + i)];
      EXPECT_NEAR(g, j == k ? 1.0 : 0.0, 1e-5);
    }
  }
  EXPECT_NEAR(s->variance, 16 + 4 + 1 + 0.25, 0.5);
  // 9 bits over 4 components: the widest first.
  absl::StatusOr<std::vector<TransformCode>> codes =
      AllocateTransformCodes(std::span<const TransformStream>(&*s, 1), o.widths, 9.0 / d, false);
  ASSERT_TRUE(codes.ok()) << codes.status();
  const TransformCode& c = (*codes)[0];
  EXPECT_LE(c.BitsPerRow(), 9);
  for (int j = 1; j < d; ++j)
    EXPECT_GE(c.components[0].bits, c.components[static_cast<size_t>(j)].bits);
  EXPECT_GT(c.components[0].bits, 0);

  TransformCodeOptions id = o;
  id.pca = false;
  absl::StatusOr<TransformStream> si = AnalyzeStream(rows.data(), 20000, d, id);
  ASSERT_TRUE(si.ok());
  for (int j = 0; j < d; ++j) {
    for (int i = 0; i < d; ++i)
      EXPECT_EQ(si->basis[static_cast<size_t>(j * d + i)], i == j ? 1.0f : 0.0f);
  }
  EXPECT_FALSE(AnalyzeStream(rows.data(), 1, d, o).ok());
  TransformCodeOptions bad = o;
  bad.widths = {0, 12};
  EXPECT_FALSE(AnalyzeStream(rows.data(), 100, d, bad).ok());
}

TEST(AnalyzeStreamTest, AMetricBuysPrecisionWhereItWeighs) {
  // Isotropic rows: without a metric every dim is alike; weighting dim 0 by 100 makes its
  // error smaller at the same budget, and the scale round-trips through the packed code.
  const int d = 8;
  std::mt19937 rng(41);
  std::normal_distribution<float> nd;
  std::vector<float> rows(static_cast<size_t>(6000) * d);
  for (float& v : rows) v = nd(rng);
  std::vector<float> metric(d, 1.0f);
  metric[0] = 100.0f;
  const std::vector<int> widths = TransformCodeOptions{}.widths;
  double err[2] = {0, 0};
  for (int weighted = 0; weighted < 2; ++weighted) {
    absl::StatusOr<TransformStream> s =
        AnalyzeStream(rows.data(), 6000, d, {},
                      weighted ? std::span<const float>(metric) : std::span<const float>());
    ASSERT_TRUE(s.ok()) << s.status();
    absl::StatusOr<std::vector<TransformCode>> c =
        AllocateTransformCodes(std::span<const TransformStream>(&*s, 1), widths, 2.0, false);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ((*c)[0].scale.size(), weighted ? static_cast<size_t>(d) : 0u);
    for (int r = 0; r < 500; ++r) {
      std::vector<float> x(rows.begin() + r * d, rows.begin() + (r + 1) * d);
      std::vector<uint8_t> codes(static_cast<size_t>((*c)[0].BytesPerRow()));
      (*c)[0].Encode(x.data(), codes.data());
      std::vector<float> y(d);
      (*c)[0].Decode(codes.data(), y.data());
      err[weighted] += (y[0] - x[0]) * (y[0] - x[0]);
    }
  }
  EXPECT_LT(err[1], 0.25 * err[0]);
  EXPECT_FALSE(AnalyzeStream(rows.data(), 100, d, {}, std::vector<float>(3, 1.0f)).ok());
  std::vector<float> bad(d, 1.0f);
  bad[2] = 0.0f;
  EXPECT_FALSE(AnalyzeStream(rows.data(), 100, d, {}, bad).ok());
}

TEST(AllocateTransformCodesTest, AJointBudgetGoesWhereItReducesRelativeErrorMost) {
  const int d = 8;
  std::vector<float> axis0;
  // Stream 0: nearly rank one (one wide axis, the rest 256x narrower in variance).
  // Stream 1: isotropic -- every component needs bits.
  std::vector<float> a = AnisotropicRows(8000, d, 31, &axis0);
  std::mt19937 rng(32);
  std::normal_distribution<float> nd;
  std::vector<float> b(static_cast<size_t>(8000) * d);
  for (float& v : b) v = nd(rng);
  std::vector<TransformStream> streams;
  for (const std::vector<float>* x : {&a, &b}) {
    absl::StatusOr<TransformStream> s = AnalyzeStream(x->data(), 8000, d, {});
    ASSERT_TRUE(s.ok());
    streams.push_back(*std::move(s));
  }
  const std::vector<int> widths = TransformCodeOptions{}.widths;
  absl::StatusOr<std::vector<TransformCode>> own =
      AllocateTransformCodes(streams, widths, 3.0, false);
  absl::StatusOr<std::vector<TransformCode>> joint =
      AllocateTransformCodes(streams, widths, 3.0, true);
  ASSERT_TRUE(own.ok() && joint.ok());
  EXPECT_LE((*own)[0].BitsPerRow(), 24);
  EXPECT_LE((*own)[1].BitsPerRow(), 24);
  EXPECT_LE((*joint)[0].BitsPerRow() + (*joint)[1].BitsPerRow(), 48);
  EXPECT_GT((*joint)[1].BitsPerRow(), (*joint)[0].BitsPerRow());
}

}  // namespace
}  // namespace subspace
