// Eigensolvers (LAPACK dsyevd against the Jacobi reference), PCA epoch construction and the
// epoch registry's refcounts.
#include "core/compress/basis.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/base/pca.h"
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

// A Gram matrix of `samples` Gaussian rows with per-coordinate scales decaying like
// activations (a few strong directions), rotated by a random orthogonal-ish mix. [n, n]
std::vector<double> RandomGram(int n, int samples, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> mix(static_cast<size_t>(n) * n);
  for (double& v : mix) v = nd(rng);
  std::vector<double> x(static_cast<size_t>(samples) * n, 0.0), z(static_cast<size_t>(n));
  for (int t = 0; t < samples; ++t) {
    for (int i = 0; i < n; ++i) z[i] = nd(rng) * std::exp(-0.1 * i);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) x[static_cast<size_t>(t) * n + i] += mix[i * n + j] * z[j];
    }
  }
  std::vector<double> gram(static_cast<size_t>(n) * n);
  GramOfRows(x.data(), samples, n, gram.data());
  return gram;
}

// dsyevd's top-r eigenpairs equal Jacobi's (eigenvectors after the shared sign rule, within
// the perturbation bound eps * lambda_max / gap: the tail of a decaying spectrum has close
// eigenvalues), and GramOfRows equals the plain sum of outer products.
TEST(PcaTest, LapackMatchesJacobi) {
  double worst_val = 0, worst_vec = 0, worst_orth = 0;
  for (int n : {8, 24, 64, 128}) {
    const std::vector<double> gram = RandomGram(n, 3 * n, static_cast<uint32_t>(n));
    std::vector<double> all(n), all_vecs(static_cast<size_t>(n) * n);
    TopEigenpairs(n, gram.data(), n, EigenSolver::kJacobi, all.data(), all_vecs.data());
    for (int r : {1, 4, n / 4, n}) {
      std::vector<double> va(r), vb(r), ea(static_cast<size_t>(n) * r), eb(ea.size());
      TopEigenpairs(n, gram.data(), r, EigenSolver::kLapack, va.data(), ea.data());
      TopEigenpairs(n, gram.data(), r, EigenSolver::kJacobi, vb.data(), eb.data());
      for (int j = 0; j < r; ++j) {
        if (j > 0) {
          EXPECT_GE(va[j - 1], va[j]);
        }
        worst_val = std::max(worst_val, std::fabs(va[j] - vb[j]) / std::fabs(vb[0]));
        const double gap = std::min(j > 0 ? all[j - 1] - all[j] : all[0],
                                    j + 1 < n ? all[j] - all[j + 1] : all[0]);
        for (int i = 0; i < n; ++i) {  // error in units of 1e-12 * lambda_max / gap
          worst_vec = std::max(worst_vec,
                               std::fabs(ea[i * r + j] - eb[i * r + j]) * gap / (1e-12 * all[0]));
        }
        for (int c = 0; c <= j; ++c) {
          double dot = 0;
          for (int i = 0; i < n; ++i) dot += ea[i * r + j] * ea[i * r + c];
          worst_orth = std::max(worst_orth, std::fabs(dot - (c == j ? 1.0 : 0.0)));
        }
      }
    }
  }
  std::printf(
      "dsyevd vs Jacobi: eigenvalues %.3g (rel. to largest), eigenvectors %.3g x "
      "1e-12 lambda_max / gap, orthonormality %.3g\n",
      worst_val, worst_vec, worst_orth);
  EXPECT_LE(worst_val, 1e-12);
  EXPECT_LE(worst_vec, 1.0);
  EXPECT_LE(worst_orth, 1e-12);

  const int n = 5, rows = 7;
  std::vector<double> x(rows * n), gram(n * n, -1.0);
  std::mt19937 rng(1);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (double& v : x) v = nd(rng);
  GramOfRows(x.data(), rows, n, gram.data());
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      double ref = 0;
      for (int t = 0; t < rows; ++t) ref += x[t * n + i] * x[t * n + j];
      EXPECT_NEAR(gram[i * n + j], ref, 1e-12);
    }
  }
}

TEST(BasisTest, PcaBasisSolversAgree) {
  const KvCacheGeometry g{2, 2, 32};
  std::vector<std::vector<double>> gk(2), gv(2);
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      const auto a = RandomGram(32, 100, 10 + l * 2 + h), b = RandomGram(32, 100, 20 + l * 2 + h);
      gk[l].insert(gk[l].end(), a.begin(), a.end());
      gv[l].insert(gv[l].end(), b.begin(), b.end());
    }
  }
  const Basis a = PcaBasis(g, {8, 4}, {8, 6}, gk, gv, EigenSolver::kLapack);
  const Basis b = PcaBasis(g, {8, 4}, {8, 6}, gk, gv, EigenSolver::kJacobi);
  for (int l = 0; l < 2; ++l) {
    for (auto m : {&LayerBasis::p_q, &LayerBasis::p_k, &LayerBasis::p_v, &LayerBasis::r_v}) {
      const std::vector<float>& x = a.layers[l].*m;
      const std::vector<float>& y = b.layers[l].*m;
      ASSERT_EQ(x.size(), y.size());
      for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], y[i], 1e-6) << "layer " << l;
    }
  }
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
