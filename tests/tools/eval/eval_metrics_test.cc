// Basis error metrics on small known matrices: key reconstruction, residual energy (oblique
// bases included), causal logit error, attention-output error, and the capturing cache.
#include "tools/eval/eval_metrics.h"

#include <cmath>
#include <vector>

#include "core/kvcache/paged_kv_cache.h"
#include "gtest/gtest.h"

namespace subspace::eval {
namespace {

// d = 3, r = 1, basis e0 (orthogonal: P_q = P_k).
TEST(EvalMetricsTest, KeyErrorAndResidualEnergyOfAxisBasis) {
  const std::vector<float> p = {1, 0, 0};  // [3, 1]
  const std::vector<float> k = {3, 4, 0,   // residual (0,4,0): 16 of 25
                                1, 0, 0};  // exact
  const ErrorSums e = KeyReconstructionError(3, 1, p.data(), p.data(), k.data(), 2, 3);
  EXPECT_DOUBLE_EQ(e.err2, 16.0);
  EXPECT_DOUBLE_EQ(e.ref2, 26.0);
  EXPECT_NEAR(e.Relative(), std::sqrt(16.0 / 26.0), 1e-12);
  const ErrorSums rer = ResidualEnergy(3, 1, p.data(), k.data(), 2, 3);
  EXPECT_NEAR(rer.EnergyRatio(), 16.0 / 26.0, 1e-12);
}

TEST(EvalMetricsTest, FullRankBasisIsExact) {
  const std::vector<float> id = {1, 0, 0, 1};  // [2, 2]
  const std::vector<float> k = {1, 2, -3, 0.5f, 2, 2};
  EXPECT_NEAR(KeyReconstructionError(2, 2, id.data(), id.data(), k.data(), 3, 2).err2, 0.0, 1e-12);
  EXPECT_NEAR(ResidualEnergy(2, 2, id.data(), k.data(), 3, 2).err2, 0.0, 1e-12);
  EXPECT_NEAR(LogitError(2, 2, id.data(), id.data(), k.data(), 2, k.data(), 2, 3).err2, 0.0, 1e-12);
  EXPECT_NEAR(AttentionOutputError(2, 2, 2, id.data(), id.data(), id.data(), id.data(), k.data(), 2,
                                   k.data(), 2, k.data(), 2, 3)
                  .err2,
              0.0, 1e-12);
}

// Residual energy uses the orthogonal projector onto span(P): a scaled, non-orthonormal column
// spans the same line, and with an oblique pair (P_q != P_k) the key error differs from RER.
TEST(EvalMetricsTest, ResidualEnergyOfNonOrthonormalColumns) {
  const std::vector<float> p = {2, 0, 0, 2, 0, 0};  // [3, 2]: span(e0, e1) scaled by 2
  const std::vector<float> x = {1, 1, 1};
  EXPECT_NEAR(ResidualEnergy(3, 2, p.data(), x.data(), 1, 3).EnergyRatio(), 1.0 / 3.0, 1e-12);
  // Dependent columns count once: span(e0) only.
  const std::vector<float> dup = {1, 1, 0, 0, 0, 0};
  EXPECT_NEAR(ResidualEnergy(3, 2, dup.data(), x.data(), 1, 3).EnergyRatio(), 2.0 / 3.0, 1e-12);
  // Oblique: P_k = e0 / 2, P_q = 2 e0 reconstructs k's e0 component exactly.
  const std::vector<float> pk = {0.5f, 0, 0}, pq = {2, 0, 0};
  const ErrorSums e = KeyReconstructionError(3, 1, pq.data(), pk.data(), x.data(), 1, 3);
  EXPECT_NEAR(e.err2, 2.0, 1e-12);
  EXPECT_NEAR(e.ref2, 3.0, 1e-12);
}

// Logits with a stride: query head = second of two heads in a [n, 2, d] tensor.
TEST(EvalMetricsTest, CausalLogitErrorByHand) {
  const int d = 2;
  const std::vector<float> p = {1, 0};  // [2, 1]: keep coordinate 0
  // q rows (head 1 of 2): (1, 1), (2, -1); head 0 is garbage that must be ignored.
  const std::vector<float> q = {9, 9, 1, 1, 9, 9, 2, -1};
  const std::vector<float> k = {1, 2, 3, 1};  // k0 = (1, 2), k1 = (3, 1)
  // Causal pairs: (0,0): exact 1+2=3, approx 1 -> err 4; (1,0): exact 2-2=0, approx 2 -> err 4;
  // (1,1): exact 6-1=5, approx 6 -> err 1. ref = 9 + 0 + 25.
  const ErrorSums e = LogitError(d, 1, p.data(), p.data(), q.data() + 2, 4, k.data(), 2, 2);
  EXPECT_NEAR(e.err2, 9.0, 1e-12);
  EXPECT_NEAR(e.ref2, 34.0, 1e-12);
}

// Attention output: one token attends to itself only, so o = v and o^ = R_v^T P_v^T v
// whatever the logits; with two tokens and equal logits the output is the mean.
TEST(EvalMetricsTest, AttentionOutputErrorByHand) {
  const int d = 2;
  const std::vector<float> pk = {1, 0}, pv = {0, 1}, rv = {0, 1};  // values keep coordinate 1
  const std::vector<float> q = {0, 0, 0, 0};  // zero queries: uniform attention
  const std::vector<float> k = {1, 5, -2, 3};
  const std::vector<float> v = {4, 2, 2, 6};
  // Token 0: o = (4, 2), o^ = (0, 2) -> err 16, ref 20.
  // Token 1: o = mean = (3, 4), o^ = (0, 4) -> err 9, ref 25.
  const ErrorSums e = AttentionOutputError(d, 1, 1, pk.data(), pk.data(), pv.data(), rv.data(),
                                           q.data(), 2, k.data(), 2, v.data(), 2, 2);
  EXPECT_NEAR(e.err2, 25.0, 1e-9);
  EXPECT_NEAR(e.ref2, 45.0, 1e-9);
  EXPECT_NEAR(e.Relative(), std::sqrt(25.0 / 45.0), 1e-9);
}

TEST(EvalMetricsTest, ErrorSumsPoolAndHandleZero) {
  ErrorSums a{1.0, 4.0};
  a += ErrorSums{3.0, 12.0};
  EXPECT_DOUBLE_EQ(a.Relative(), 0.5);
  EXPECT_DOUBLE_EQ(a.EnergyRatio(), 0.25);
  EXPECT_EQ(ErrorSums{}.Relative(), 0.0);
}

TEST(EvalMetricsTest, CapturingCacheRecordsByPosition) {
  const KvCacheGeometry g{1, 1, 2};
  auto inner = PagedKvCache::Create(
      {.geometry = g, .block_size = 4, .capacity_bytes = PagedKvCache::BlockBytes(g, 4) * 4});
  ASSERT_TRUE(inner.ok());
  CapturingKvCache cap(*std::move(inner), /*n_heads=*/1);
  auto seq = cap.CreateSequence();
  ASSERT_TRUE(seq.ok());
  ASSERT_TRUE(cap.Reserve(*seq, 3).ok());
  const std::vector<float> k = {1, 2, 3, 4, 5, 6}, v = {7, 8, 9, 10, 11, 12};
  cap.Write(0, *seq, 0, 2, k.data(), v.data());
  cap.Write(0, *seq, 2, 1, k.data() + 4, v.data() + 4);
  std::vector<float> out(6);
  AttentionRequest req{*seq, 0, 3, k.data(), out.data()};
  cap.Attend(0, {&req, 1}, 1);
  EXPECT_EQ(cap.tokens(), 3);
  EXPECT_EQ(cap.layers()[0].k, k);
  EXPECT_EQ(cap.layers()[0].v, v);
  EXPECT_EQ(cap.layers()[0].q, k);
  EXPECT_FLOAT_EQ(out[0], 7.0f);  // first token attends to itself only
}

}  // namespace
}  // namespace subspace::eval
