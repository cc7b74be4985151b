// CompressedKvCache: exactness of coefficient-space attention against plain references
// (full rank = paged cache; rank r = dense attention over the explicitly reconstructed keys
// k^ = P_q c and values v^ = R_v^T u, in double), several live epochs, outliers, int8,
// accounting, truncation, memory ratios, and the tiny model end to end (Forward and Engine).
// Exactness against PagedKvCache pins full_dtype fp32; fp16 full blocks are checked against a
// reference built from fp16-rounded K/V, and against fp32 full blocks.
#include "core/compress/compressed_kv_cache.h"

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <utility>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/cpu/matmul_internal.h"
#include "core/engine/engine.h"
#include "core/kvcache/paged_kv_cache.h"
#include "gtest/gtest.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace {
namespace {

using namespace cache_test;  // NOLINT(build/namespaces): the helpers of this test family

TEST(CompressedKvCacheTest, RejectsBadConfig) {
  CompressedKvCacheConfig c = SmallConfig({2, 2, 16}, 4, CoeffDtype::kFp16);
  c.block_size = 65;
  EXPECT_EQ(CompressedKvCache::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = SmallConfig({2, 2, 16}, 17, CoeffDtype::kFp16);
  EXPECT_EQ(CompressedKvCache::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = SmallConfig({2, 2, 16}, 4, CoeffDtype::kFp16);
  c.capacity_bytes = CompressedKvCache::PageBytes(c.geometry, 4, c.full_dtype);
  EXPECT_EQ(CompressedKvCache::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = SmallConfig({2, 2, 16}, 4, CoeffDtype::kFp16);
  c.full_dtype = CoeffDtype::kInt8;
  EXPECT_EQ(CompressedKvCache::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  // fp32 coefficients at full rank are twice an fp16 full block: no slot fits a page.
  c = SmallConfig({2, 2, 16}, 16, CoeffDtype::kFp32);
  EXPECT_EQ(CompressedKvCache::Create(c).status().code(), absl::StatusCode::kInvalidArgument);
  c = SmallConfig({2, 2, 16}, 16, CoeffDtype::kFp32, CoeffDtype::kFp32);
  EXPECT_TRUE(CompressedKvCache::Create(c).ok());
  // int4: two codes a byte, so odd ranks are refused naming the layer, and the fp16 scales
  // after the codes must start on a 2-byte boundary.
  c = SmallConfig({2, 2, 16}, 5, CoeffDtype::kInt4);
  absl::Status odd = CompressedKvCache::Create(c).status();
  EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(odd.message().find("int4 coefficients need even ranks; layer 0 has r_k 5"),
            std::string::npos)
      << odd;
  c = SmallConfig({2, 1, 16}, 2, CoeffDtype::kInt4);
  c.policy.r_v = {4, 4};  // one row of 2 + 4 codes: 3 bytes
  c.block_size = 1;
  EXPECT_NE(CompressedKvCache::Create(c).status().message().find("divisible by 4"),
            std::string::npos);
  c.block_size = 2;
  EXPECT_TRUE(CompressedKvCache::Create(c).ok());
  c = SmallConfig({2, 2, 16}, 4, CoeffDtype::kFp16);
  auto cache = Make(c);
  EXPECT_FALSE(cache->InstallBasis(OrthoBasis(c.geometry, 5, 4, 1)).ok());  // wrong rank
}

// Full rank, fp32 coefficients, an orthonormal basis (installed, or the sequence's own PCA):
// equals the full-rank paged cache, decode and a prefill chunk, every layer.
TEST(CompressedKvCacheTest, FullRankEqualsPagedCache) {
  const KvCacheGeometry g{2, 2, 16};
  const int n_heads = 4;
  for (bool pca : {false, true}) {
    CompressedKvCacheConfig c = SmallConfig(g, 16, CoeffDtype::kFp32, CoeffDtype::kFp32);
    auto cache = Make(c);
    PagedKvCache::Config pc{g, 4, 256 * PagedKvCache::BlockBytes(g, 4)};
    auto paged = *PagedKvCache::Create(pc);
    SeqId s = *cache->CreateSequence();
    SeqId ps = *paged->CreateSequence();
    if (!pca) {
      EpochId e = *cache->InstallBasis(OrthoBasis(g, 16, 16, 7));
      ASSERT_TRUE(cache->SetSequenceEpoch(s, e).ok());
      ASSERT_TRUE(cache->ReleaseEpoch(e).ok());
    }
    const int64_t T = 45;
    Data d = RandomKv(g, T + 8, 3);
    int64_t pos = 0;
    for (int64_t step : {13, 7, 1, 1, 9, 14}) {
      Append(*cache, s, d, pos, pos + step);
      Append(*paged, ps, d, pos, pos + step);
      pos += step;
    }
    ASSERT_EQ(pos, T);
    EXPECT_TRUE(cache->IsCompressed(s, 0, 1));
    EXPECT_FALSE(cache->IsCompressed(s, 0, 0));  // sinks
    // Decode step and a prefill chunk of 8 after it.
    Append(*cache, s, d, T, T + 8);
    Append(*paged, ps, d, T, T + 8);
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<float> q = RandomQ(8, n_heads, 16, 11 + l);
      const double err = RelErr(RunAttend(*cache, l, s, T, 8, q, n_heads),
                                RunAttend(*paged, l, ps, T, 8, q, n_heads));
      EXPECT_LE(err, 1e-5) << "pca=" << pca << " layer " << l;
      std::printf("full rank (%s basis) layer %d: rel err vs paged %.3g\n", pca ? "PCA" : "random",
                  l, err);
    }
  }
}

// Without an installed basis, the first sequence to compress builds epoch 0 by PCA and it
// becomes the default: sequences created before and after it reuse it, no second PCA. An
// explicitly set default then takes over for new sequences.
TEST(CompressedKvCacheTest, SelfCalibratedEpochIsSharedAndYieldsToAnExplicitOne) {
  const KvCacheGeometry g{2, 2, 16};
  auto cache = Make(SmallConfig(g, 4, CoeffDtype::kFp16));
  Data d = RandomKv(g, 64, 9);
  SeqId a = *cache->CreateSequence(), early = *cache->CreateSequence();
  EXPECT_EQ(cache->default_epoch(), kNoEpoch);
  Append(*cache, a, d, 0, 45);
  ASSERT_TRUE(cache->IsCompressed(a, 0, 1));
  const EpochId e0 = cache->SequenceEpoch(a);
  EXPECT_NE(e0, kNoEpoch);
  EXPECT_EQ(cache->default_epoch(), e0);
  EXPECT_TRUE(cache->Detail().default_self_calibrated);
  SeqId late = *cache->CreateSequence();
  EXPECT_EQ(cache->SequenceEpoch(late), e0);
  Append(*cache, early, d, 0, 45);
  Append(*cache, late, d, 0, 45);
  EXPECT_EQ(cache->BlockEpoch(early, 1, 2, 1), e0);
  EXPECT_EQ(cache->BlockEpoch(late, 0, 1, 0), e0);
  EXPECT_EQ(cache->Detail().pca_epochs_built, 1);

  EpochId installed = *cache->InstallBasis(OrthoBasis(g, 4, 4, 3));
  ASSERT_TRUE(cache->SetDefaultEpoch(installed).ok());
  ASSERT_TRUE(cache->ReleaseEpoch(installed).ok());
  EXPECT_FALSE(cache->Detail().default_self_calibrated);
  SeqId next = *cache->CreateSequence();
  Append(*cache, next, d, 0, 45);
  EXPECT_EQ(cache->BlockEpoch(next, 0, 1, 0), installed);
  EXPECT_EQ(cache->BlockEpoch(a, 0, 1, 0), e0);  // old blocks keep theirs
  EXPECT_EQ(cache->Detail().pca_epochs_built, 1);
  // e0 lives while blocks use it, then goes; the installed default stays.
  for (SeqId s : {a, early, late, next}) ASSERT_TRUE(cache->FreeSequence(s).ok());
  EXPECT_EQ(cache->registry().Get(e0), nullptr);
  EXPECT_EQ(cache->Detail().epochs_live, 1);
}

TEST(CompressedKvCacheTest, PerSequencePcaOption) {
  const KvCacheGeometry g{2, 2, 16};
  CompressedKvCacheConfig c = SmallConfig(g, 4, CoeffDtype::kFp16);
  c.policy.per_sequence_pca = true;
  auto cache = Make(c);
  Data d = RandomKv(g, 64, 9), d2 = RandomKv(g, 64, 10);
  SeqId a = *cache->CreateSequence(), b = *cache->CreateSequence();
  Append(*cache, a, d, 0, 45);
  Append(*cache, b, d2, 0, 45);
  EXPECT_NE(cache->SequenceEpoch(a), cache->SequenceEpoch(b));
  EXPECT_EQ(cache->default_epoch(), kNoEpoch);
  EXPECT_EQ(cache->Detail().pca_epochs_built, 2);
}

class LowRankTest : public ::testing::TestWithParam<CoeffDtype> {};

// Rank r < d with an oblique (KQ-SVD-shaped) basis: equals dense attention over the
// reconstructed keys/values; then a second epoch joins the same sequence. The reference is
// built from K/V rounded as the full blocks store them (compression reads those blocks).
void CheckLowRankAcrossEpochs(CoeffDtype dt, CoeffDtype full, const char* isa) {
  const KvCacheGeometry g{2, 2, 16};
  const int n_heads = 6;                          // GQA group of 3
  const int r = dt == CoeffDtype::kInt4 ? 6 : 5;  // int4 rows hold an even number of codes
  auto cache = Make(SmallConfig(g, r, dt, full));
  SeqId s = *cache->CreateSequence();
  EpochId a = *cache->InstallBasis(ObliqueBasis(g, r, r, 21));
  EpochId b = *cache->InstallBasis(OrthoBasis(g, r, r, 22));
  ASSERT_TRUE(cache->SetSequenceEpoch(s, a).ok());
  const int64_t T = 60;
  Data d = RandomKv(g, T + 1, 5);
  Append(*cache, s, d, 0, 30);
  ASSERT_TRUE(cache->SetSequenceEpoch(s, b).ok());
  Append(*cache, s, d, 30, 45);
  for (int64_t p = 45; p < T; ++p) Append(*cache, s, d, p, p + 1);
  EXPECT_EQ(cache->BlockEpoch(s, 0, 1, 0), a);
  EXPECT_EQ(cache->BlockEpoch(s, 1, 4, 1), a);
  EXPECT_EQ(cache->BlockEpoch(s, 0, 6, 0), b);
  EXPECT_EQ(cache->BlockEpoch(s, 0, 10, 1), b);
  EXPECT_FALSE(cache->IsCompressed(s, 0, 13));  // window: [52, 60)
  Data eff = EffectiveKv(*cache, s, RoundTo(d, full), T + 1, dt);
  Append(*cache, s, d, T, T + 1);
  for (int l = 0; l < g.n_layers; ++l) {
    std::vector<float> q = RandomQ(1, n_heads, 16, 31 + l);
    const double err =
        RelErr(RunAttend(*cache, l, s, T, 1, q, n_heads), DenseAttend(g, eff, l, T, 1, q, n_heads));
    EXPECT_LE(err, 1e-5) << CoeffDtypeName(dt) << " full " << CoeffDtypeName(full) << " layer "
                         << l;
    std::printf(
        "rank %d/16 %s, %s full blocks, 2 epochs, layer %d (%s kernels): rel err vs "
        "reconstruction %.3g\n",
        r, CoeffDtypeName(dt), CoeffDtypeName(full), l, isa, err);
  }
  // Refcounts: epochs die with their last block, sequence and installer reference.
  ASSERT_TRUE(cache->ReleaseEpoch(a).ok());
  ASSERT_TRUE(cache->ReleaseEpoch(b).ok());
  EXPECT_EQ(cache->Detail().epochs_live, 2);
  ASSERT_TRUE(cache->FreeSequence(s).ok());
  EXPECT_EQ(cache->Detail().epochs_live, 0);
  EXPECT_EQ(cache->Stats().blocks_free, cache->Stats().blocks_total);
}

// With the AVX2 attention kernels and with their scalar twins (the fallback), fp32 and fp16
// full blocks.
TEST_P(LowRankTest, MatchesReconstructionReferenceAcrossEpochs) {
  using cpu::internal::Isa;
  std::vector<Isa> isas = {Isa::kScalar};
  if (cpu::internal::DetectedIsa() >= Isa::kAvx2) isas.push_back(Isa::kAvx2);
  for (Isa isa : isas) {
    cpu::internal::ScopedMaxIsa cap(isa);
    for (CoeffDtype full : {CoeffDtype::kFp32, CoeffDtype::kFp16}) {
      CheckLowRankAcrossEpochs(GetParam(), full, isa == Isa::kScalar ? "scalar" : "avx2");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LowRankTest,
                         ::testing::Values(CoeffDtype::kFp32, CoeffDtype::kFp16, CoeffDtype::kInt8,
                                           CoeffDtype::kInt4),
                         [](const auto& info) { return std::string(CoeffDtypeName(info.param)); });

// fp16, int8 and int4 against fp32 coefficients (same basis): the quantisation error alone.
TEST(CompressedKvCacheTest, QuantizedCloseToFp32Coefficients) {
  const KvCacheGeometry g{1, 2, 32};
  const int n_heads = 4;
  std::vector<float> q = RandomQ(1, n_heads, 32, 9);
  Data d = RandomKv(g, 101, 8);
  std::vector<float> ref;
  for (CoeffDtype dt :
       {CoeffDtype::kFp32, CoeffDtype::kFp16, CoeffDtype::kInt8, CoeffDtype::kInt4}) {
    auto cache = Make(SmallConfig(g, 8, dt));
    SeqId s = *cache->CreateSequence();
    EpochId e = *cache->InstallBasis(OrthoBasis(g, 8, 8, 4));
    ASSERT_TRUE(cache->SetSequenceEpoch(s, e).ok());
    Append(*cache, s, d, 0, 101);
    std::vector<float> out = RunAttend(*cache, 0, s, 100, 1, q, n_heads);
    if (dt == CoeffDtype::kFp32) {
      ref = out;
      continue;
    }
    const double err = RelErr(out, ref);
    std::printf("%s vs fp32 coefficients: rel err %.3g\n", CoeffDtypeName(dt), err);
    EXPECT_LE(err, dt == CoeffDtype::kFp16 ? 2e-3 : dt == CoeffDtype::kInt8 ? 2e-2 : 8e-2);
  }
}

// Tokens the rank-2 basis represents badly stay full-rank and are attended exactly.
TEST(CompressedKvCacheTest, OutliersKeptExactly) {
  const KvCacheGeometry g{1, 2, 16};
  CompressedKvCacheConfig c = SmallConfig(g, 4, CoeffDtype::kFp16);
  c.policy.outlier_threshold = 0.85f;
  auto cache = Make(c);
  SeqId s = *cache->CreateSequence();
  EpochId e = *cache->InstallBasis(OrthoBasis(g, 4, 4, 2));
  ASSERT_TRUE(cache->SetSequenceEpoch(s, e).ok());
  Data d = RandomKv(g, 81, 6);
  Append(*cache, s, d, 0, 80);
  const int64_t n_out = static_cast<int64_t>(cache->OutlierPositions(s, 0).size());
  EXPECT_GT(n_out, 0);
  EXPECT_LT(n_out, 60);
  EXPECT_GT(cache->Stats().bytes_used_outlier, 0);
  std::printf("outliers: %ld of %d compressed tokens\n", static_cast<long>(n_out), 80 - 4 - 8);
  const Data stored = RoundTo(d, c.full_dtype);  // outliers keep the fp16 full-block bits
  Data eff = EffectiveKv(*cache, s, stored, 81, CoeffDtype::kFp16);
  for (int64_t p : cache->OutlierPositions(s, 0)) {
    EXPECT_EQ(eff.k[0][p * 32], stored.k[0][p * 32]);  // reference uses the stored key
  }
  Append(*cache, s, d, 80, 81);
  std::vector<float> q = RandomQ(1, 2, 16, 3);
  EXPECT_LE(RelErr(RunAttend(*cache, 0, s, 80, 1, q, 2), DenseAttend(g, eff, 0, 80, 1, q, 2)),
            1e-5);
}

TEST(CompressedKvCacheTest, ReserveTruncateAccounting) {
  const KvCacheGeometry g{2, 1, 8};
  // fp32 full blocks: the expansion at Truncate is then exact, and 8 slots fill a page.
  CompressedKvCacheConfig c = SmallConfig(g, 2, CoeffDtype::kFp16, CoeffDtype::kFp32);
  c.capacity_bytes = 12 * CompressedKvCache::PageBytes(g, 4, CoeffDtype::kFp32);
  auto cache = Make(c);
  SeqId s = *cache->CreateSequence();
  EpochId e = *cache->InstallBasis(OrthoBasis(g, 2, 2, 1));
  ASSERT_TRUE(cache->SetDefaultEpoch(e).ok());
  EXPECT_EQ(cache->BlocksNeeded(s, 24), 12);
  EXPECT_EQ(cache->Reserve(s, 25).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache->Stats().blocks_free, 12);  // all or nothing
  Data d = RandomKv(g, 64, 1);
  Append(*cache, s, d, 0, 24);  // pool full before Commit; compression gives pages back
  KvCacheStats st = cache->Stats();
  // Blocks 1..3 ([4, 16)) left the window [16, 24): 3 per layer compressed into one slab page
  // per layer class (shared across layers of equal ranks).
  EXPECT_TRUE(cache->IsCompressed(s, 1, 3));
  EXPECT_FALSE(cache->IsCompressed(s, 1, 4));
  EXPECT_EQ(st.bytes_used_full, 6 * cache->pool().block_bytes());
  EXPECT_EQ(st.bytes_used_compressed, cache->pool().block_bytes());
  EXPECT_EQ(st.tokens_cached, 24);
  EXPECT_EQ(st.bytes_full_fp16_equivalent, 24 * 2 * 2 * 1 * 8 * 2);
  EXPECT_EQ(cache->Detail().blocks_compressed, 6);
  // Attention before and after cutting into a compressed block agrees on the kept prefix.
  std::vector<float> q = RandomQ(1, 2, 8, 5);
  std::vector<float> before = RunAttend(*cache, 1, s, 9, 1, q, 2);
  ASSERT_TRUE(cache->Truncate(s, 10).ok());
  EXPECT_EQ(cache->Length(s), 10);
  EXPECT_FALSE(cache->IsCompressed(s, 1, 2));  // expanded for rewriting
  EXPECT_TRUE(cache->IsCompressed(s, 1, 1));
  EXPECT_LE(RelErr(RunAttend(*cache, 1, s, 9, 1, q, 2), before), 1e-6);
  // Grows again through the policy, a few tokens per step as the small pool allows.
  for (int64_t p = 10; p < 40; p += 2) Append(*cache, s, d, p, p + 2);
  EXPECT_TRUE(cache->IsCompressed(s, 0, 7));
  ASSERT_TRUE(cache->FreeSequence(s).ok());
  EXPECT_EQ(cache->Stats().blocks_free, 12);
  EXPECT_EQ(cache->Stats().bytes_used_compressed, 0);
  ASSERT_TRUE(cache->SetDefaultEpoch(kNoEpoch).ok());
  ASSERT_TRUE(cache->ReleaseEpoch(e).ok());
  EXPECT_EQ(cache->Detail().epochs_live, 0);
}

// fp16 full blocks against fp32 ones (same data, basis, coefficients dtype, outliers on):
// only the rounding of the full-rank K/V (and of the keys compression reads) differs.
TEST(CompressedKvCacheTest, Fp16FullBlocksCloseToFp32) {
  const KvCacheGeometry g{2, 2, 32};
  const int n_heads = 4;
  Data d = RandomKv(g, 101, 12);
  std::vector<float> ref[2];
  for (CoeffDtype full : {CoeffDtype::kFp32, CoeffDtype::kFp16}) {
    CompressedKvCacheConfig c = SmallConfig(g, 8, CoeffDtype::kFp16, full);
    c.policy.outlier_threshold = 0.9f;
    auto cache = Make(c);
    SeqId s = *cache->CreateSequence();
    EpochId e = *cache->InstallBasis(OrthoBasis(g, 8, 8, 4));
    ASSERT_TRUE(cache->SetSequenceEpoch(s, e).ok());
    Append(*cache, s, d, 0, 93);
    Append(*cache, s, d, 93, 101);  // a prefill chunk
    EXPECT_GT(cache->OutlierPositions(s, 1).size(), 0u);
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<float> q = RandomQ(8, n_heads, 32, 40 + l);
      std::vector<float> out = RunAttend(*cache, l, s, 93, 8, q, n_heads);
      if (full == CoeffDtype::kFp32) {
        ref[l] = out;
        continue;
      }
      const double err = RelErr(out, ref[l]);
      std::printf("fp16 vs fp32 full blocks, layer %d: rel err %.3g\n", l, err);
      EXPECT_LE(err, 1e-3);  // fp16 keeps 11 significant bits: ~5e-4 per element at worst
    }
  }
}

// Truncating into a compressed block with fp16 full blocks: the expanded block holds k^, v^
// rounded to fp16, so attention over the kept prefix moves by that rounding only.
TEST(CompressedKvCacheTest, TruncateWithFp16FullBlocks) {
  const KvCacheGeometry g{2, 1, 8};
  CompressedKvCacheConfig c = SmallConfig(g, 2, CoeffDtype::kFp16);
  auto cache = Make(c);
  SeqId s = *cache->CreateSequence();
  EpochId e = *cache->InstallBasis(OrthoBasis(g, 2, 2, 1));
  ASSERT_TRUE(cache->SetSequenceEpoch(s, e).ok());
  Data d = RandomKv(g, 64, 1);
  Append(*cache, s, d, 0, 24);
  ASSERT_TRUE(cache->IsCompressed(s, 1, 2));
  const KvCacheStats st = cache->Stats();
  // 6 compressed blocks of 32 bytes, 4 to a 128-byte fp16 page.
  EXPECT_EQ(cache->pool().block_bytes(), 128);
  EXPECT_EQ(st.bytes_used_compressed, 2 * cache->pool().block_bytes());
  EXPECT_EQ(st.bytes_used_full, 6 * cache->pool().block_bytes());
  std::vector<float> q = RandomQ(1, 2, 8, 5);
  std::vector<float> before = RunAttend(*cache, 1, s, 9, 1, q, 2);
  ASSERT_TRUE(cache->Truncate(s, 10).ok());
  EXPECT_FALSE(cache->IsCompressed(s, 1, 2));
  const double err = RelErr(RunAttend(*cache, 1, s, 9, 1, q, 2), before);
  std::printf("fp16 full blocks: attention after truncation, rel err %.3g\n", err);
  EXPECT_LE(err, 1e-3);
  for (int64_t p = 10; p < 40; p += 2) Append(*cache, s, d, p, p + 2);
  EXPECT_TRUE(cache->IsCompressed(s, 0, 7));
  ASSERT_TRUE(cache->FreeSequence(s).ok());
  EXPECT_EQ(cache->Stats().blocks_free, cache->Stats().blocks_total);
}

// Sliding-window attention over every kind of token the cache holds: sinks, coded blocks of two
// epochs, outliers and the full-rank window, with window lengths that start mid-block, on a
// block boundary, inside the coded blocks or only in the recent window, for decode and a
// prefill chunk. Equals dense attention over the same effective keys and values restricted to
// each query's window.
TEST(CompressedKvCacheTest, SlidingWindowMatchesTheReferenceOverEveryTokenKind) {
  const KvCacheGeometry g{1, 2, 16};
  const int n_heads = 4;
  CompressedKvCacheConfig c = SmallConfig(g, 4, CoeffDtype::kFp16);
  c.policy.outlier_threshold = 0.85f;  // some tokens the rank-4 basis misses stay full-rank
  auto cache = Make(c);
  SeqId s = *cache->CreateSequence();
  EpochId a = *cache->InstallBasis(ObliqueBasis(g, 4, 4, 5));
  EpochId b = *cache->InstallBasis(OrthoBasis(g, 4, 4, 6));
  ASSERT_TRUE(cache->SetSequenceEpoch(s, a).ok());
  const int64_t T = 70;
  Data d = RandomKv(g, T + 4, 12);
  Append(*cache, s, d, 0, 30);
  ASSERT_TRUE(cache->SetSequenceEpoch(s, b).ok());
  Append(*cache, s, d, 30, T);
  ASSERT_GT(cache->OutlierPositions(s, 0).size(), 0u);
  ASSERT_TRUE(cache->IsCompressed(s, 0, 3));
  Append(*cache, s, d, T, T + 4);  // the 4 queries' own keys
  const Data eff = EffectiveKv(*cache, s, RoundTo(d, c.full_dtype), T + 4, CoeffDtype::kFp16);
  for (int64_t window : {1, 3, 8, 13, 40, 64, 200}) {
    for (int64_t n : {1, 4}) {  // decode at T + 3, or a chunk T .. T + 3
      const int64_t pos = n == 1 ? T + 3 : T;
      std::vector<float> q = RandomQ(n, n_heads, 16, 40 + static_cast<int>(window));
      const double err = RelErr(RunAttend(*cache, 0, s, pos, n, q, n_heads, window),
                                DenseAttend(g, eff, 0, pos, n, q, n_heads, window));
      EXPECT_LE(err, 1e-5) << "window " << window << " n " << n;
    }
  }
}

// Memory at r = d/4, S = 4, W = 64, B = 16 for a 4k-token sequence.
TEST(CompressedKvCacheTest, MemoryPerTokenAt4k) {
  for (KvCacheGeometry g : {KvCacheGeometry{1, 2, 64}, KvCacheGeometry{1, 8, 128}}) {
    for (const auto& [full, dt] : {std::pair{CoeffDtype::kFp16, CoeffDtype::kFp16},
                                   std::pair{CoeffDtype::kFp16, CoeffDtype::kInt8},
                                   std::pair{CoeffDtype::kFp16, CoeffDtype::kInt4},
                                   std::pair{CoeffDtype::kFp32, CoeffDtype::kFp16},
                                   std::pair{CoeffDtype::kFp32, CoeffDtype::kInt8}}) {
      CompressedKvCacheConfig c;
      c.geometry = g;
      c.block_size = 16;
      c.policy.sink_tokens = 4;
      c.policy.window_tokens = 64;
      c.policy.coeff_dtype = dt;
      c.full_dtype = full;
      c.capacity_bytes = 300 * CompressedKvCache::PageBytes(g, 16, full);
      auto cache = Make(c);
      SeqId s = *cache->CreateSequence();
      EpochId e = *cache->InstallBasis(OrthoBasis(g, g.head_dim / 4, g.head_dim / 4, 1));
      ASSERT_TRUE(cache->SetSequenceEpoch(s, e).ok());
      Data d = RandomKv(g, 4096, 2);
      for (int64_t p = 0; p < 4096; p += 512) Append(*cache, s, d, p, p + 512);
      const KvCacheStats st = cache->Stats();
      const CompressedKvCacheDetail det = cache->Detail();
      const double used = static_cast<double>(st.bytes_used_full + st.bytes_used_compressed +
                                              st.bytes_used_outlier);
      const double ratio = used / static_cast<double>(st.bytes_full_fp16_equivalent);
      // Accounting: every page in use is counted once, at the page size of full_dtype.
      const int64_t page = CompressedKvCache::PageBytes(g, 16, full);
      EXPECT_EQ(cache->pool().block_bytes(), page);
      EXPECT_EQ(st.bytes_used_full, det.pages_full * page);
      EXPECT_EQ(st.bytes_used_compressed, det.pages_compressed * page);
      EXPECT_EQ(st.blocks_total - st.blocks_free,
                det.pages_full + det.pages_compressed + det.pages_outlier);
      std::printf(
          "n_kv %d hd %d %s coefficients, %s full blocks: %.1f B/token/layer vs %lld fp16 "
          "full-rank = %.1f%% (x%.2f); payload %.1f%% of slab pages\n",
          g.n_kv_heads, g.head_dim, CoeffDtypeName(dt), CoeffDtypeName(full), used / 4096.0,
          static_cast<long long>(2 * g.n_kv_heads * g.head_dim * 2), 100 * ratio, 1 / ratio,
          100.0 * det.compressed_slot_bytes / std::max<int64_t>(st.bytes_used_compressed, 1));
      if (full == CoeffDtype::kFp16) {  // the target
        EXPECT_LE(ratio, dt == CoeffDtype::kFp16 ? 0.30 : dt == CoeffDtype::kInt8 ? 0.17 : 0.11);
      } else {
        EXPECT_LE(ratio, dt == CoeffDtype::kFp16 ? 0.30 : 0.19);
      }
    }
  }
}

// The tiny model end to end: Forward over the compressed cache at full rank (PCA epoch of the
// sequence's own keys, fp32 coefficients) matches the paged cache's logits.
TEST(CompressedKvCacheTest, TinyModelForwardMatchesPaged) {
  auto tm = testing::LoadTinyModel();
  ASSERT_TRUE(tm.ok()) << tm.status();
  const ModelConfig& mc = tm->model->config();
  const KvCacheGeometry g = mc.cache_geometry();
  CompressedKvCacheConfig c;
  c.geometry = g;
  c.block_size = 4;
  c.policy.sink_tokens = 1;
  c.policy.window_tokens = 6;
  c.policy.r_k = c.policy.r_v = std::vector<int>(g.n_layers, g.head_dim);
  c.policy.coeff_dtype = CoeffDtype::kFp32;
  c.full_dtype = CoeffDtype::kFp32;  // exactness against the paged cache
  c.capacity_bytes = 256 * CompressedKvCache::PageBytes(g, 4, c.full_dtype);
  auto cache = Make(c);
  auto paged = *testing::MakeTinyCache(mc, 4, 256);
  std::mt19937 rng(5);
  std::vector<int32_t> tokens(60);
  for (int32_t& t : tokens) t = testing::kTinyFirstByte + static_cast<int32_t>(rng() % 200);
  SeqId s = *cache->CreateSequence(), ps = *paged->CreateSequence();
  int64_t pos = 0;
  double worst = 0;
  for (int64_t n : {20, 1, 1, 15, 1, 1, 1, 20}) {
    ASSERT_TRUE(cache->Reserve(s, n).ok());
    ASSERT_TRUE(paged->Reserve(ps, n).ok());
    std::span<const int32_t> chunk(tokens.data() + pos, static_cast<size_t>(n));
    std::vector<float> a, b;
    SequenceChunk ca{s, pos, chunk, true}, cb{ps, pos, chunk, true};
    ASSERT_TRUE(tm->model->Forward(std::span<const SequenceChunk>(&ca, 1), *cache, &a).ok());
    ASSERT_TRUE(tm->model->Forward(std::span<const SequenceChunk>(&cb, 1), *paged, &b).ok());
    worst = std::max(worst, RelErr(a, b));
    pos += n;
  }
  EXPECT_GT(cache->Detail().blocks_compressed, 0);
  EXPECT_LE(worst, 1e-5);
  std::printf("tiny model full-rank logits: worst rel err vs paged %.3g\n", worst);
}

class Collect : public GenerateObserver {
 public:
  void OnTokens(std::span<const GeneratedTokenEvent> events) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const GeneratedTokenEvent& e : events) tokens_.push_back(e.token);
  }
  void OnFinish(const GenerateResult&) override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }
  std::vector<int32_t> Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(30), [this] { return done_; });
    return tokens_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::vector<int32_t> tokens_;
};

std::vector<int32_t> Gen(Engine& engine, std::vector<int32_t> prompt, int n, std::string session) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = n;
  r.ignore_eos = true;
  r.session_id = std::move(session);
  auto obs = std::make_shared<Collect>();
  EXPECT_TRUE(engine.Submit(std::move(r), obs).ok());
  return obs->Wait();
}

// A session continued over several calls equals one call, with the engine on the compressed
// cache (full rank, so chunking cannot change what attention sees).
TEST(CompressedKvCacheTest, EngineSessionContinuationIsExact) {
  auto tm = testing::LoadTinyModel();
  ASSERT_TRUE(tm.ok());
  const KvCacheGeometry g = tm->model->config().cache_geometry();
  CompressedKvCacheConfig c;
  c.geometry = g;
  c.block_size = 4;
  c.policy.sink_tokens = 1;
  c.policy.window_tokens = 4;
  c.policy.r_k = c.policy.r_v = std::vector<int>(g.n_layers, g.head_dim);
  c.policy.coeff_dtype = CoeffDtype::kFp32;
  c.full_dtype = CoeffDtype::kFp32;  // exactness against the paged cache
  c.capacity_bytes = 256 * CompressedKvCache::PageBytes(g, 4, c.full_dtype);
  auto engine = *Engine::Create({}, tm->model, tm->tokenizer, Make(c));
  auto session = engine->CreateSession();
  ASSERT_TRUE(session.ok());
  std::vector<int32_t> a = tm->tokenizer->Encode("hello world and the");
  std::vector<int32_t> b = tm->tokenizer->Encode("of the world", {.add_bos = false});
  std::vector<int32_t> first = Gen(*engine, a, 12, session->id);
  std::vector<int32_t> second = Gen(*engine, b, 10, session->id);
  std::vector<int32_t> all = a;
  all.insert(all.end(), first.begin(), first.end());
  all.insert(all.end(), b.begin(), b.end());
  std::vector<int32_t> one_shot = Gen(*engine, all, 10, "");
  ASSERT_EQ(second.size(), 10u);
  EXPECT_EQ(second, one_shot);
  const KvCacheStats st = engine->Stats().cache;
  EXPECT_GT(st.bytes_used_compressed, 0);
}

}  // namespace
}  // namespace subspace
