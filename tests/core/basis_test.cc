// Jacobi eigendecomposition, PCA epoch construction and the epoch registry's refcounts.
#include "core/basis.h"

#include <cmath>
#include <random>
#include <vector>

#include "core/pca.h"
#include "gtest/gtest.h"

namespace subspace {
namespace {

TEST(PcaTest, JacobiReconstructsAndSorts) {
  const int n = 24;
  std::mt19937 rng(3);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> x(static_cast<size_t>(n) * 50), a(static_cast<size_t>(n) * n, 0.0);
  for (double& v : x) v = nd(rng);
  for (int t = 0; t < 50; ++t) {
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) a[i * n + j] += x[t * n + i] * x[t * n + j];
    }
  }
  std::vector<double> copy = a, values, vecs;
  SymmetricEigen(n, copy, &values, &vecs);
  for (int j = 1; j < n; ++j) EXPECT_GE(values[j - 1], values[j]);
  double err = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      double r = 0;
      for (int k = 0; k < n; ++k) r += vecs[i * n + k] * values[k] * vecs[j * n + k];
      err = std::max(err, std::fabs(r - a[i * n + j]));
    }
  }
  EXPECT_LE(err, 1e-9);
}

TEST(BasisTest, PcaBasisIsOrthonormalAndFindsTheSubspace) {
  const KvCacheGeometry g{1, 1, 8};
  // Data in span(e0, e1) only: the top-2 eigenvectors must span it.
  std::vector<std::vector<double>> gk(1, std::vector<double>(64, 0.0)), gv = gk;
  gk[0][0] = 5;
  gk[0][9] = 2;
  gk[0][1] = gk[0][8] = 1;
  for (int i = 0; i < 8; ++i) gv[0][i * 9] = 8 - i;
  Basis b = PcaBasis(g, {2}, {3}, gk, gv);
  const LayerBasis& lb = b.layers[0];
  for (int i = 2; i < 8; ++i) {
    EXPECT_NEAR(lb.p_k[i * 2], 0.0, 1e-9);
    EXPECT_NEAR(lb.p_k[i * 2 + 1], 0.0, 1e-9);
  }
  for (int a = 0; a < 3; ++a) {
    for (int c = 0; c < 3; ++c) {
      double dot = 0;
      for (int i = 0; i < 8; ++i) dot += lb.p_v[i * 3 + a] * lb.p_v[i * 3 + c];
      EXPECT_NEAR(dot, a == c ? 1.0 : 0.0, 1e-6);
      EXPECT_FLOAT_EQ(lb.r_v[a * 8 + c], lb.p_v[c * 3 + a]);  // R_v = P_v^T
    }
  }
  EXPECT_EQ(lb.p_q, lb.p_k);
  EXPECT_TRUE(ValidateBasis(b, g, {2}, {3}).ok());
  EXPECT_FALSE(ValidateBasis(b, g, {3}, {3}).ok());
}

TEST(BasisTest, RegistryRefcounts) {
  BasisRegistry r;
  auto basis = std::make_shared<Basis>(Basis::Zeros({1, 1, 4}, {1}, {1}));
  const EpochId a = r.Register(basis);
  const EpochId b = r.Register(basis);
  EXPECT_NE(a, b);
  EXPECT_EQ(r.live(), 2);
  ASSERT_TRUE(r.Acquire(a).ok());
  EXPECT_EQ(r.RefCount(a), 2);
  r.Release(a);
  EXPECT_NE(r.Get(a), nullptr);
  r.Release(a);
  EXPECT_EQ(r.Get(a), nullptr);
  EXPECT_EQ(r.Acquire(a).code(), absl::StatusCode::kNotFound);
  r.Release(b);
  EXPECT_EQ(r.live(), 0);
}

}  // namespace
}  // namespace subspace
