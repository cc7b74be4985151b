// The rotated-quantization baselines' pieces: the Hadamard rotation is orthonormal and undone
// exactly, the Gaussian Lloyd-Max codebooks are the published ones, and TurboQuant's round trip
// keeps a row's norm and direction to its codebook's error.
#include "tools/eval/rotated_quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace subspace::eval {
namespace {

TEST(RotatedQuantTest, HadamardIsOrthonormalAndItsOwnInverse) {
  for (int n : {1, 2, 8, 64, 128}) {
    // Column j of H / sqrt(n) is the transform of e_j: they must be orthonormal.
    std::vector<std::vector<float>> cols;
    for (int j = 0; j < n; ++j) {
      std::vector<float> e(static_cast<size_t>(n), 0.0f);
      e[static_cast<size_t>(j)] = 1.0f;
      NormalizedHadamard(e.data(), n);
      cols.push_back(e);
    }
    for (int a = 0; a < n; a += std::max(1, n / 8)) {
      for (int b = 0; b < n; ++b) {
        double dot = 0;
        for (int i = 0; i < n; ++i) dot += cols[a][i] * cols[b][i];
        EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5) << n;
      }
    }
    std::mt19937 rng(n);
    std::normal_distribution<float> nd;
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = nd(rng);
    const RandomizedHadamard r(n, 9);
    std::vector<float> y = x;
    r.Rotate(y.data());
    r.Unrotate(y.data());
    for (int i = 0; i < n; ++i) EXPECT_NEAR(y[i], x[i], 1e-5);
  }
}

TEST(RotatedQuantTest, LloydMaxCodebooksAreMaxs) {
  // Max (1960), Table I: the optimal quantizers of the unit normal.
  const std::vector<float> one = GaussianLloydMax(1);
  ASSERT_EQ(one.size(), 2u);
  EXPECT_NEAR(one[1], 0.7979, 1e-3);
  EXPECT_NEAR(one[0], -0.7979, 1e-3);
  const std::vector<float> two = GaussianLloydMax(2);
  ASSERT_EQ(two.size(), 4u);
  EXPECT_NEAR(two[2], 0.4528, 1e-3);
  EXPECT_NEAR(two[3], 1.510, 1e-3);
  const std::vector<float> three = GaussianLloydMax(3);
  const float want3[] = {0.2451f, 0.7560f, 1.344f, 2.152f};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(three[static_cast<size_t>(4 + i)], want3[i], 2e-3) << i;
    EXPECT_NEAR(three[static_cast<size_t>(3 - i)], -want3[i], 2e-3) << i;
  }
  const std::vector<float> four = GaussianLloydMax(4);
  EXPECT_NEAR(four[15], 2.733, 3e-3);
  EXPECT_NEAR(four[8], 0.1284, 1e-3);
}

TEST(RotatedQuantTest, NearestLevel) {
  const std::vector<float> l = {-1.0f, 0.0f, 2.0f};
  EXPECT_EQ(NearestLevel(l, -5.0f), 0u);
  EXPECT_EQ(NearestLevel(l, -0.6f), 0u);
  EXPECT_EQ(NearestLevel(l, -0.4f), 1u);
  EXPECT_EQ(NearestLevel(l, 1.1f), 2u);
  EXPECT_EQ(NearestLevel(l, 0.9f), 1u);
  EXPECT_EQ(NearestLevel(l, 9.0f), 2u);
}

TEST(RotatedQuantTest, TurboRoundTripErrorFollowsItsBits) {
  const int n = 64;
  const RandomizedHadamard r(n, 3);
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  double err[3] = {0, 0, 0}, energy = 0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> x(n);
    for (float& v : x) v = nd(rng) * (1.0f + 0.1f * static_cast<float>(trial % 7));
    x[5] += 6.0f;  // an outlier channel, which the rotation spreads
    for (float v : x) energy += v * v;
    int i = 0;
    for (int bits : {2, 3, 4}) {
      std::vector<float> y = x;
      RoundTripTurbo(r, bits, 0, y.data());
      for (int k = 0; k < n; ++k) err[i] += (y[k] - x[k]) * (y[k] - x[k]);
      ++i;
    }
  }
  // Lloyd-Max MSE per coordinate of the unit normal: 0.1175 (2 bits), 0.03454, 0.009497.
  EXPECT_NEAR(err[0] / energy, 0.1175, 0.015);
  EXPECT_NEAR(err[1] / energy, 0.03454, 0.006);
  EXPECT_NEAR(err[2] / energy, 0.009497, 0.002);
  std::vector<float> zero(n, 0.0f);
  RoundTripTurbo(r, 2, 32, zero.data());
  for (float v : zero) EXPECT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace subspace::eval
