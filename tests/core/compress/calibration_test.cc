// Calibration: the KQ-SVD closed form reaches the Eckart-Young optimum of K Q^T from Gram
// matrices alone and beats K-SVD and Eigen; energy-based ranks; the calibrating cache sums a
// GQA group's queries and forwards attention unchanged; a tiny model calibrates end to end.
#include "core/compress/calibration.h"

#include <cblas.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/base/pca.h"
#include "core/kvcache/paged_kv_cache.h"
#include "gtest/gtest.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace {
namespace {

// A [rows, d] float matrix with a decaying spectrum: Gaussian rows scaled per column by
// decay^j, then rotated by a random orthogonal matrix so no basis is axis-aligned.
std::vector<float> DecayingMatrix(int rows, int d, double decay, std::mt19937& rng) {
  std::normal_distribution<double> normal;
  std::vector<double> g(static_cast<size_t>(d) * d);
  for (double& x : g) x = normal(rng);
  std::vector<double> sym(g.size());
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) sym[i * d + j] = g[i * d + j] + g[j * d + i];
  std::vector<double> values, rot;
  SymmetricEigen(d, sym, &values, &rot);  // eigenvectors of a random symmetric matrix
  std::vector<float> x(static_cast<size_t>(rows) * d);
  std::vector<double> row(static_cast<size_t>(d));
  for (int t = 0; t < rows; ++t) {
    for (int j = 0; j < d; ++j) row[j] = normal(rng) * std::pow(decay, j);
    for (int i = 0; i < d; ++i) {
      double s = 0.0;
      for (int j = 0; j < d; ++j) s += rot[i * d + j] * row[j];
      x[static_cast<size_t>(t) * d + i] = static_cast<float>(s);
    }
  }
  return x;
}

std::vector<double> ToDouble(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// ||K Q^T - K P_k P_q^T Q^T||_F in double, P_k = left[:, :r], P_q = right[:, :r].
double LogitError(const std::vector<double>& k, int n, const std::vector<double>& q, int m, int d,
                  const HeadFactors& f, int r) {
  std::vector<double> pk(static_cast<size_t>(d) * r), pq(static_cast<size_t>(d) * r);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < r; ++j) {
      pk[i * r + j] = f.left[i * d + j];
      pq[i * r + j] = f.right[i * d + j];
    }
  }
  std::vector<double> proj(static_cast<size_t>(d) * d);  // P_k P_q^T
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, d, d, r, 1.0, pk.data(), r, pq.data(), r,
              0.0, proj.data(), d);
  for (int i = 0; i < d; ++i) proj[i * d + i] -= 1.0;  // P_k P_q^T - I
  std::vector<double> kp(static_cast<size_t>(n) * d), e(static_cast<size_t>(n) * m);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, d, 1.0, k.data(), d, proj.data(), d,
              0.0, kp.data(), d);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, d, 1.0, kp.data(), d, q.data(), d, 0.0,
              e.data(), m);
  double s = 0.0;
  for (double x : e) s += x * x;
  return std::sqrt(s);
}

TEST(CalibrationTest, KqsvdReachesEckartYoungAndBeatsKsvdAndEigen) {
  constexpr int n = 300, m = 200, d = 16;
  std::mt19937 rng(7);
  const std::vector<float> kf = DecayingMatrix(n, d, 0.8, rng);
  const std::vector<float> qf = DecayingMatrix(m, d, 0.85, rng);
  const std::vector<double> k = ToDouble(kf), q = ToDouble(qf);
  std::vector<double> gk(d * d, 0.0), gq(d * d, 0.0);
  AccumulateHeadGrams(kf.data(), n, 1, d, 1, gk.data());
  AccumulateHeadGrams(qf.data(), m, 1, d, 1, gq.data());

  // Eckart-Young reference straight from X = K Q^T: the eigenvalues of X^T X [m, m].
  std::vector<double> x(static_cast<size_t>(n) * m), xtx(static_cast<size_t>(m) * m);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, d, 1.0, k.data(), d, q.data(), d, 0.0,
              x.data(), m);
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, m, n, 1.0, x.data(), m, x.data(), m, 0.0,
              xtx.data(), m);
  std::vector<double> sv2(static_cast<size_t>(m)), vecs(static_cast<size_t>(m) * m);
  TopEigenpairs(m, xtx.data(), m, EigenSolver::kLapack, sv2.data(), vecs.data());

  const HeadFactors kq = FactorHead(d, gk.data(), gq.data(), true, 0.0, 1e-7);
  const HeadFactors ks = FactorHead(d, gk.data(), gq.data(), false, 0.0, 1e-7);
  const HeadFactors eig = FactorHead(d, gk.data(), gq.data(), false, 1.0, 1e-7);
  for (int r : {1, 2, 4, 8, 12}) {
    double tail = 0.0;
    for (int i = r; i < d; ++i) tail += std::max(sv2[i], 0.0);
    const double optimum = std::sqrt(tail);
    const double e_kq = LogitError(k, n, q, m, d, kq, r);
    EXPECT_NEAR(e_kq, optimum, 1e-8 * optimum) << "rank " << r;
    // The KQ-SVD spectrum is K Q^T's squared singular values.
    EXPECT_NEAR(kq.spectrum[r - 1], sv2[r - 1], 1e-9 * sv2[0]) << "rank " << r;
    EXPECT_LE(e_kq, LogitError(k, n, q, m, d, ks, r) * (1 + 1e-12)) << "rank " << r;
    EXPECT_LE(e_kq, LogitError(k, n, q, m, d, eig, r) * (1 + 1e-12)) << "rank " << r;
  }
  // Full rank is exact.
  EXPECT_LT(LogitError(k, n, q, m, d, kq, d), 1e-9 * std::sqrt(sv2[0]));
}

TEST(CalibrationTest, RankForEnergy) {
  const std::vector<double> s = {4, 3, 2, 1};
  EXPECT_EQ(RankForEnergy(s, 0.1), 1);
  EXPECT_EQ(RankForEnergy(s, 0.4), 1);
  EXPECT_EQ(RankForEnergy(s, 0.7), 2);
  EXPECT_EQ(RankForEnergy(s, 0.71), 3);
  EXPECT_EQ(RankForEnergy(s, 1.0), 4);
  EXPECT_EQ(RankForEnergy(std::vector<double>{0, 0}, 0.9), 1);
}

// Diagonal Gram matrices with known spectra: the layer's rank is the max over its heads.
TEST(CalibrationTest, EnergyRankIsMaxOverHeadsOfALayer) {
  const KvCacheGeometry g{2, 2, 4};
  CalibrationStats stats = CalibrationStats::Zeros(g, 4);
  const double spectra[2][2][4] = {{{10, 0.5, 0.3, 0.2}, {4, 3, 2, 1}},
                                   {{1, 1, 1, 1}, {8, 1, 0.5, 0.5}}};
  for (int l = 0; l < 2; ++l) {
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 4; ++i) {
        const size_t at = static_cast<size_t>(h) * 16 + i * 4 + i;
        stats.g_k[l][at] = spectra[l][h][i];
        stats.g_v[l][at] = spectra[l][1 - h][i];
        stats.g_q[l][at] = 1.0;
        stats.g_o[l][at] = 1.0;
      }
    }
  }
  BasisMethodOptions o;
  o.method_k = KeyBasisMethod::kKsvd;
  o.method_v = ValueBasisMethod::kKsvd;
  o.energy = 0.9;
  absl::StatusOr<CalibratedBasis> b = ComputeCalibratedBasis(stats, o);
  ASSERT_TRUE(b.ok()) << b.status();
  // Layer 0: head 0 needs 2 (10.5/11), head 1 needs 3 (9/10). Layer 1: 4 and 2 -> 4.
  EXPECT_EQ(b->basis.layers[0].rank_k, 3);
  EXPECT_EQ(b->basis.layers[0].rank_v, 3);
  EXPECT_EQ(b->basis.layers[1].rank_k, 4);
  EXPECT_NEAR(b->energy_k[0], (10.8 / 11 + 0.9) / 2, 1e-12);
  EXPECT_NEAR(b->energy_k[1], 1.0, 1e-12);
  // Orthogonal methods: P_q = P_k, R_v = P_v^T.
  const LayerBasis& lb = b->basis.layers[0];
  EXPECT_EQ(lb.p_q, lb.p_k);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < lb.rank_v; ++j)
        EXPECT_EQ(lb.r_v[(h * lb.rank_v + j) * 4 + i], lb.p_v[(h * 4 + i) * lb.rank_v + j]);

  o.energy = 0.0;
  EXPECT_EQ(ComputeCalibratedBasis(stats, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.rank = 5;
  EXPECT_EQ(ComputeCalibratedBasis(stats, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.rank = 2;
  o.method_k = KeyBasisMethod::kKqsvd;
  o.method_v = ValueBasisMethod::kKqsvd;
  b = ComputeCalibratedBasis(stats, o);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->basis.layers[1].rank_k, 2);
  EXPECT_TRUE(ValidateBasis(b->basis, g, {2, 2}, {2, 2}).ok());
}

TEST(CalibrationTest, CalibratingCacheSumsGqaGroupAndForwardsAttention) {
  const KvCacheGeometry g{1, 2, 8};
  constexpr int n_heads = 4, n = 5, d = 8;
  PagedKvCache::Config pc;
  pc.geometry = g;
  pc.block_size = 4;
  pc.capacity_bytes = 4 * PagedKvCache::BlockBytes(g, pc.block_size);
  auto inner = PagedKvCache::Create(pc);
  auto plain = PagedKvCache::Create(pc);
  ASSERT_TRUE(inner.ok() && plain.ok());
  CalibrationStats stats = CalibrationStats::Zeros(g, n_heads);
  CalibratingKvCache cache(*std::move(inner), &stats);

  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> k(n * 2 * d), v(n * 2 * d), q(n * n_heads * d);
  for (auto* x : {&k, &v, &q})
    for (float& e : *x) e = normal(rng);
  std::vector<float> out(q.size()), out_plain(q.size());
  for (KvCache* c : {static_cast<KvCache*>(&cache), static_cast<KvCache*>(plain->get())}) {
    absl::StatusOr<SeqId> seq = c->CreateSequence();
    ASSERT_TRUE(seq.ok());
    ASSERT_TRUE(c->Reserve(*seq, n).ok());
    c->Write(0, *seq, 0, n, k.data(), v.data());
    const AttentionRequest req{.seq = *seq,
                               .pos = 0,
                               .n = n,
                               .q = q.data(),
                               .out = c == &cache ? out.data() : out_plain.data()};
    c->Attend(0, std::span<const AttentionRequest>(&req, 1), n_heads);
    ASSERT_TRUE(c->Commit(*seq, n).ok());
  }
  EXPECT_EQ(out, out_plain);
  EXPECT_EQ(stats.key_tokens, n);
  EXPECT_EQ(stats.query_tokens, n);
  for (int kv = 0; kv < 2; ++kv) {
    for (int i = 0; i < d; ++i) {
      for (int j = i; j < d; ++j) {
        double want_q = 0.0, want_k = 0.0;
        for (int t = 0; t < n; ++t) {
          for (int h = kv * 2; h < kv * 2 + 2; ++h) {  // query heads 2kv, 2kv+1
            want_q += double{q[(t * n_heads + h) * d + i]} * q[(t * n_heads + h) * d + j];
          }
          want_k += double{k[(t * 2 + kv) * d + i]} * k[(t * 2 + kv) * d + j];
        }
        EXPECT_NEAR(stats.g_q[0][kv * d * d + i * d + j], want_q, 1e-9);
        EXPECT_NEAR(stats.g_k[0][kv * d * d + i * d + j], want_k, 1e-9);
      }
    }
  }
}

TEST(CalibrationTest, TinyModelCalibratesEndToEnd) {
  absl::StatusOr<testing::TinyModel> tiny = testing::LoadTinyModel();
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  const std::vector<int32_t> tokens =
      tiny->tokenizer->Encode("hello world and the world is hello to the world of it", {false});
  CalibrationRunOptions ro;
  ro.window = 8;
  ro.bos = tiny->tokenizer->bos_id();
  int64_t last_done = 0;
  ro.progress = [&](int64_t done, int64_t total) {
    EXPECT_GT(done, last_done);
    EXPECT_EQ(total, static_cast<int64_t>(tokens.size()));
    last_done = done;
  };
  absl::StatusOr<CalibrationStats> stats = CollectCalibrationStats(*tiny->model, tokens, ro);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(last_done, static_cast<int64_t>(tokens.size()));
  const int64_t windows = (static_cast<int64_t>(tokens.size()) + 7) / 8;
  EXPECT_EQ(stats->key_tokens, static_cast<int64_t>(tokens.size()) + windows);
  EXPECT_EQ(stats->query_tokens, stats->key_tokens);
  EXPECT_GT(stats->g_o[1][0], 0.0);  // W_O slices are non-zero
  BasisMethodOptions o;
  o.energy = 0.9;
  absl::StatusOr<CalibratedBasis> b = ComputeCalibratedBasis(*stats, o);
  ASSERT_TRUE(b.ok()) << b.status();
  for (size_t l = 0; l < b->basis.layers.size(); ++l) {
    EXPECT_GE(b->energy_k[l], 0.9 - 1e-9);
    EXPECT_GE(b->energy_v[l], 0.9 - 1e-9);
    for (float x : b->basis.layers[l].p_k) ASSERT_TRUE(std::isfinite(x));
    for (float x : b->basis.layers[l].r_v) ASSERT_TRUE(std::isfinite(x));
  }
}

}  // namespace
}  // namespace subspace
