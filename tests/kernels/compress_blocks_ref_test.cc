// The CPU twin of compress_blocks.cu: its encoding bit-for-bit against core's EncodeCoeffs, its
// slots against the bytes CompressedKvCache itself writes into its pool, its outlier masks
// against the cache's outlier positions, the layout's sizes against core's, and the batch checks
// that guard the kernel's no-aliasing precondition.
#include "tests/kernels/compress_blocks_ref.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/compress/compressed_kv_cache.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

TEST(CompressBlocksRefTest, EncodingIsBitIdenticalToEncodeCoeffs) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> rank(1, 128);
  std::uniform_real_distribution<float> log_scale(-30.0f, 20.0f);
  for (CoeffDtype dt : {CoeffDtype::kFp16, CoeffDtype::kInt8}) {
    for (int trial = 0; trial < 4000; ++trial) {
      const int r = rank(rng);
      std::vector<float> x(static_cast<size_t>(r));
      const float scale = std::exp2(log_scale(rng));  // subnormal halves to fp16 overflow
      for (float& v : x) v = normal(rng) * scale;
      switch (trial % 5) {
        case 0:  // ties: integers and half-integers of one step
          for (size_t j = 0; j < x.size(); ++j)
            x[j] = 0.5f * static_cast<float>(static_cast<int>(j) - r / 2);
          break;
        case 1:
          std::fill(x.begin(), x.end(), 0.0f);
          break;
        default:
          break;
      }
      std::vector<uint8_t> want(static_cast<size_t>(r) * 2, 0xab), got(want.size(), 0xab);
      uint16_t want_scale = 0x1234, got_scale = 0x1234;
      EncodeCoeffs(dt, x.data(), r, want.data(), &want_scale);
      EncodeCoeffsRef(dt, x.data(), r, got.data(), &got_scale);
      ASSERT_EQ(want, got) << CoeffDtypeName(dt) << " r=" << r << " trial " << trial;
      ASSERT_EQ(want_scale, got_scale) << CoeffDtypeName(dt) << " r=" << r << " trial " << trial;
    }
  }
}

TEST(CompressBlocksRefTest, LayoutSizesMatchTheCpuCache) {
  for (int hd : {64, 128}) {
    for (int bs : {8, 16, 32, 64}) {
      for (int r : {8, 16, 32}) {
        for (CoeffDtype dt : {CoeffDtype::kFp16, CoeffDtype::kInt8}) {
          const KvCacheGeometry g{1, 4, hd};
          const KvPoolLayout l = MakeKvPoolLayout(4, hd, bs, r, r / 2, dt);
          EXPECT_EQ(l.page_bytes, CompressedKvCache::PageBytes(g, bs, CoeffDtype::kFp16));
          EXPECT_EQ(l.CompressedBytes(),
                    CompressedKvCache::CompressedBlockBytes(g, bs, r, r / 2, dt));
          EXPECT_EQ(l.slot_bytes % 16, 0);
          EXPECT_EQ(KvPoolLayoutError(l), nullptr);
        }
      }
    }
  }
  EXPECT_NE(KvPoolLayoutError(MakeKvPoolLayout(2, 64, 16, 8, 8, CoeffDtype::kFp32)), nullptr);
  EXPECT_NE(KvPoolLayoutError(MakeKvPoolLayout(2, 64, 65, 8, 8, CoeffDtype::kFp16)), nullptr);
  EXPECT_NE(KvPoolLayoutError(MakeKvPoolLayout(2, 64, 16, 65, 8, CoeffDtype::kFp16)), nullptr);
  EXPECT_NE(KvPoolLayoutError(MakeKvPoolLayout(1, 64, 1, 4, 3, CoeffDtype::kInt8)), nullptr);
}

// The CPU cache and the twin on the same tokens: one sequence of whole blocks, no sinks, no
// window, one epoch, so every block of every layer compresses, in order, as soon as it is
// complete (slot b = block b: the slab allocator takes the lowest free slot).
struct SameTokens {
  KvPoolLayout layout;
  KvCacheGeometry geometry;
  int nb = 0;                    // blocks per layer
  std::shared_ptr<Basis> basis;  // drawn by the test
  cache_test::Data data;         // [n_layers][T, n_kv, d]
  std::unique_ptr<CompressedKvCache> cache;
  SeqId seq = 0;

  int64_t tokens() const { return static_cast<int64_t>(nb) * layout.block_size; }
};

// Layout, block count and random tokens of a two-head cache; no basis, no cache yet.
SameTokens DrawTokens(int n_layers, int hd, int bs, int rk, int rv, CoeffDtype dt,
                      std::mt19937_64& rng) {
  SameTokens s;
  const int n_kv = 2;
  s.layout = MakeKvPoolLayout(n_kv, hd, bs, rk, rv, dt);
  s.geometry = KvCacheGeometry{n_layers, n_kv, hd};
  s.nb = std::min(s.layout.SlotsPerPage(), 6);
  s.data = cache_test::RandomKv(s.geometry, s.tokens(), static_cast<uint32_t>(rng()));
  return s;
}

// Creates s.cache over s.basis (outlier_threshold >= 1: no outliers) and appends every token
// in one step; every block ends up compressed and no outlier is dropped for want of a page.
void FillCache(SameTokens& s, float outlier_threshold) {
  const int n_layers = s.geometry.n_layers;
  CompressedKvCacheConfig cfg;
  cfg.geometry = s.geometry;
  cfg.block_size = s.layout.block_size;
  cfg.policy.sink_tokens = 0;
  cfg.policy.window_tokens = 0;
  cfg.policy.outlier_threshold = outlier_threshold;
  cfg.policy.r_k.assign(static_cast<size_t>(n_layers), s.layout.rank_k);
  cfg.policy.r_v.assign(static_cast<size_t>(n_layers), s.layout.rank_v);
  cfg.policy.coeff_dtype = s.layout.coeff_dtype;
  cfg.full_dtype = CoeffDtype::kFp16;
  cfg.capacity_bytes = s.layout.page_bytes * 4 * s.nb * n_layers;
  auto cache = CompressedKvCache::Create(cfg);
  ASSERT_TRUE(cache.ok()) << cache.status();
  s.cache = *std::move(cache);
  CompressedKvCache& kv = *s.cache;
  absl::StatusOr<EpochId> id = kv.InstallBasis(s.basis);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(kv.SetDefaultEpoch(*id).ok());
  absl::StatusOr<SeqId> seq = kv.CreateSequence();
  ASSERT_TRUE(seq.ok());
  s.seq = *seq;
  cache_test::Append(kv, s.seq, s.data, 0, s.tokens());
  for (int l = 0; l < n_layers; ++l) {
    for (int b = 0; b < s.nb; ++b)
      ASSERT_TRUE(kv.IsCompressed(s.seq, l, b)) << "layer " << l << " block " << b;
  }
  ASSERT_EQ(kv.Detail().outliers_dropped, 0);
}

// The twin's pool and tables for one layer: block b's fp16 rows on page b, its slot b on
// page nb (poisoned before the twin writes it).
struct TwinBatch {
  int64_t num_pages = 0;
  std::vector<uint8_t> pool;
  std::vector<int32_t> src, dst_page, dst_slot, epoch;
  CompressBlocksParams params;  // no outlier detection; pointers into this batch
};

TwinBatch MakeTwinBatch(const SameTokens& s, int layer) {
  const KvPoolLayout& l = s.layout;
  const int hd = l.head_dim, bs = l.block_size, n_kv = l.n_kv_heads, nb = s.nb;
  TwinBatch t;
  t.num_pages = nb + 1;
  t.pool.assign(static_cast<size_t>(t.num_pages * l.page_bytes), testing::kPoison);
  const std::vector<float>& k_in = s.data.k[static_cast<size_t>(layer)];
  const std::vector<float>& v_in = s.data.v[static_cast<size_t>(layer)];
  for (int b = 0; b < nb; ++b) {
    for (int tok = 0; tok < bs; ++tok) {
      for (int h = 0; h < n_kv; ++h) {
        auto* k = reinterpret_cast<uint16_t*>(t.pool.data() + l.FullK(b, h)) + tok * hd;
        auto* v = reinterpret_cast<uint16_t*>(t.pool.data() + l.FullV(b, h)) + tok * hd;
        const int64_t row = ((static_cast<int64_t>(b) * bs + tok) * n_kv + h) * hd;
        for (int i = 0; i < hd; ++i) {
          k[i] = Fp32ToFp16(k_in[row + i]);
          v[i] = Fp32ToFp16(v_in[row + i]);
        }
      }
    }
    t.src.push_back(b);
    t.dst_page.push_back(nb);
    t.dst_slot.push_back(b);
    t.epoch.insert(t.epoch.end(), n_kv, 0);
  }
  const LayerBasis& lb = s.basis->layers[static_cast<size_t>(layer)];
  t.params.layout = l;
  t.params.pool = t.pool.data();
  t.params.basis_pk = lb.p_k.data();
  t.params.basis_pv = lb.p_v.data();
  t.params.src_page = t.src.data();
  t.params.dst_page = t.dst_page.data();
  t.params.dst_slot = t.dst_slot.data();
  t.params.epoch = t.epoch.data();
  t.params.n_blocks = nb;
  return t;  // moved: the vectors keep their buffers, so the pointers stay valid
}

using CacheShape = std::tuple<int, int, CoeffDtype>;  // head_dim, block size, coefficients

std::string CacheShapeName(const ::testing::TestParamInfo<CacheShape>& info) {
  return "d" + std::to_string(std::get<0>(info.param)) + "_b" +
         std::to_string(std::get<1>(info.param)) + "_" + CoeffDtypeName(std::get<2>(info.param));
}

class CompressBlocksRefVsCacheTest : public ::testing::TestWithParam<CacheShape> {};

// The twin's slots against CompressedKvCache::CompressBlock's: one layer, one slab page.
TEST_P(CompressBlocksRefVsCacheTest, SlotsMatchTheCpuCache) {
  const auto [hd, bs, dt] = GetParam();
  const int rk = 16, rv = 8;
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  SameTokens s = DrawTokens(/*n_layers=*/1, hd, bs, rk, rv, dt, rng);
  s.basis = cache_test::ObliqueBasis(s.geometry, rk, rv, static_cast<uint32_t>(rng()));
  ASSERT_NO_FATAL_FAILURE(FillCache(s, /*outlier_threshold=*/1.0f));
  const CompressedKvCache& kv = *s.cache;
  int32_t core_page = -1;
  for (int32_t p = 0; p < kv.pool().num_blocks(); ++p) {
    if (kv.pool().in_use(p) && kv.pool().kind(p) == BlockKind::kCompressed) {
      ASSERT_EQ(core_page, -1) << "one slab page expected";
      core_page = p;
    }
  }
  ASSERT_GE(core_page, 0);

  const KvPoolLayout& layout = s.layout;
  TwinBatch t = MakeTwinBatch(s, 0);
  ASSERT_TRUE(CheckCompressBatch(t.params, t.num_pages, 1).ok());
  CompressBlocksRef(t.params);

  // Core projects in float, the twin in double: codes may round apart (SlotMismatch).
  const auto* core = reinterpret_cast<const uint8_t*>(kv.pool().data(core_page));
  int64_t codes = 0, differ = 0;
  for (int b = 0; b < s.nb; ++b) {
    const uint8_t* got = t.pool.data() + layout.Slot(s.nb, b);
    const std::string mismatch = testing::SlotMismatch(
        layout, core + static_cast<int64_t>(b) * layout.slot_bytes, got, &codes, &differ);
    ASSERT_EQ(mismatch, "") << "block " << b;
    // Nothing past the payload: the slot's padding keeps its poison.
    for (int64_t i = layout.CompressedBytes(); i < layout.slot_bytes; ++i) {
      ASSERT_EQ(got[i], testing::kPoison) << "byte " << i << " of slot " << b;
    }
  }
  EXPECT_LE(differ, codes / 100) << differ << " of " << codes << " codes differ";
}

// Block size 1 is left out: too few codes for the 1% bound on codes that round apart.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CompressBlocksRefVsCacheTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(8, 16, 32, 64),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8)),
    CacheShapeName);

// An orthogonal basis whose P_q is P_k plus noise N(0, 0.04 / r_k): a key's residual ratio is
// about 1 - r_k / d + 0.04 (below 1, where the cache detects outliers) with a spread a
// threshold can split, and a twin reading P_k where P_q belongs would flag other tokens.
std::shared_ptr<Basis> NoisyQueryBasis(const KvCacheGeometry& g, int rk, int rv,
                                       std::mt19937_64& rng) {
  std::shared_ptr<Basis> b = cache_test::OrthoBasis(g, rk, rv, static_cast<uint32_t>(rng()));
  std::normal_distribution<float> noise(0.0f, 0.2f / std::sqrt(static_cast<float>(rk)));
  for (LayerBasis& lb : b->layers) {
    for (float& x : lb.p_q) x += noise(rng);
  }
  return b;
}

// Per token of `layer`, its largest residual ratio |k - P_q P_k^T k|^2 / |k|^2 over the heads,
// in double from the fp16 keys both caches store: an outlier when it exceeds thr^2.
std::vector<double> TokenResidualRatios(const SameTokens& s, int layer) {
  const int hd = s.layout.head_dim, n_kv = s.layout.n_kv_heads, rk = s.layout.rank_k;
  const LayerBasis& lb = s.basis->layers[static_cast<size_t>(layer)];
  std::vector<double> ratios, k(static_cast<size_t>(hd)), c(static_cast<size_t>(rk));
  for (int64_t t = 0; t < s.tokens(); ++t) {
    double worst = 0.0;
    for (int h = 0; h < n_kv; ++h) {
      const float* row = s.data.k[static_cast<size_t>(layer)].data() + (t * n_kv + h) * hd;
      const float* pk = lb.p_k.data() + static_cast<int64_t>(h) * hd * rk;
      const float* pq = lb.p_q.data() + static_cast<int64_t>(h) * hd * rk;
      for (int i = 0; i < hd; ++i) k[i] = HalfToFloat(Fp32ToFp16(row[i]));
      for (int j = 0; j < rk; ++j) {
        c[j] = 0.0;
        for (int i = 0; i < hd; ++i) c[j] += pk[i * rk + j] * k[i];
      }
      double err = 0.0, norm = 0.0;
      for (int i = 0; i < hd; ++i) {
        double kr = 0.0;
        for (int j = 0; j < rk; ++j) kr += pq[i * rk + j] * c[j];
        err += (k[i] - kr) * (k[i] - kr);
        norm += k[i] * k[i];
      }
      worst = std::max(worst, err / norm);
    }
    ratios.push_back(worst);
  }
  return ratios;
}

// The cache's outlier positions of `layer` as one mask per block.
std::vector<uint64_t> CacheMasks(const SameTokens& s, int layer) {
  std::vector<uint64_t> masks(static_cast<size_t>(s.nb), 0);
  const int bs = s.layout.block_size;
  for (int64_t p : s.cache->OutlierPositions(s.seq, layer)) {
    masks[static_cast<size_t>(p / bs)] |= uint64_t{1} << (p % bs);
  }
  return masks;
}

// The twin's masks against CompressedKvCache::CompressBlock's outliers, two layers: each
// layer's launch alone, then both launches OR-ing into one mask array (as the device cache
// launches once per layer). Detection must not change a slot byte.
class CompressBlocksRefOutliersTest : public ::testing::TestWithParam<CacheShape> {};

TEST_P(CompressBlocksRefOutliersTest, OutliersMatchTheCpuCache) {
  const auto [hd, bs, dt] = GetParam();
  const int rk = hd / 4, rv = 8;
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  SameTokens s = DrawTokens(/*n_layers=*/2, hd, bs, rk, rv, dt, rng);
  s.basis = NoisyQueryBasis(s.geometry, rk, rv, rng);
  std::vector<double> ratios = TokenResidualRatios(s, 0);
  const std::vector<double> ratios1 = TokenResidualRatios(s, 1);
  ratios.insert(ratios.end(), ratios1.begin(), ratios1.end());
  const float thr = testing::ThresholdInAGap(ratios);
  ASSERT_LT(thr, 1.0f) << "the CPU cache detects outliers below 1 only";
  const double thr2 = static_cast<double>(thr) * thr;
  for (double r : ratios) ASSERT_GT(std::fabs(r - thr2), 1e-4 * thr2) << "ratio " << r;
  ASSERT_NO_FATAL_FAILURE(FillCache(s, thr));
  const std::vector<uint64_t> want[2] = {CacheMasks(s, 0), CacheMasks(s, 1)};
  int64_t outliers = 0;
  for (const std::vector<uint64_t>& w : want) {
    for (uint64_t m : w) outliers += std::popcount(m);
  }
  EXPECT_GT(outliers, 0);
  EXPECT_LT(outliers, 2 * s.tokens());

  TwinBatch plain = MakeTwinBatch(s, 0);
  CompressBlocksRef(plain.params);
  std::vector<uint64_t> shared(static_cast<size_t>(s.nb), 0);
  for (int layer = 0; layer < 2; ++layer) {
    const LayerBasis& lb = s.basis->layers[static_cast<size_t>(layer)];
    std::vector<uint64_t> masks(static_cast<size_t>(s.nb), 0);
    for (uint64_t* into : {masks.data(), shared.data()}) {
      TwinBatch t = MakeTwinBatch(s, layer);
      t.params.basis_pq = lb.p_q.data();
      t.params.outlier_masks = into;
      t.params.outlier_threshold = thr;
      ASSERT_TRUE(CheckCompressBatch(t.params, t.num_pages, 1).ok());
      CompressBlocksRef(t.params);
      if (layer == 0) {
        ASSERT_EQ(t.pool, plain.pool) << "outlier detection changed the pool";
      }
    }
    EXPECT_EQ(masks, want[layer]) << "layer " << layer;
  }
  std::vector<uint64_t> both(static_cast<size_t>(s.nb));
  for (int b = 0; b < s.nb; ++b) both[b] = want[0][b] | want[1][b];
  EXPECT_EQ(shared, both) << "two layers into one mask array";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CompressBlocksRefOutliersTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(1, 8, 16, 32, 64),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8)),
    CacheShapeName);

TEST(CompressBlocksRefTest, CheckCompressBatchRejectsUnsafeBatches) {
  const KvPoolLayout l = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp16);
  std::vector<int32_t> src = {0, 1}, dst_page = {2, 2}, dst_slot = {0, 1}, epoch = {0, 0, 0, 1};
  CompressBlocksParams p;
  p.layout = l;
  p.src_page = src.data();
  p.dst_page = dst_page.data();
  p.dst_slot = dst_slot.data();
  p.epoch = epoch.data();
  p.n_blocks = 2;
  EXPECT_TRUE(CheckCompressBatch(p, 3, 2).ok());
  EXPECT_FALSE(CheckCompressBatch(p, 2, 2).ok());  // page 2 out of range
  EXPECT_FALSE(CheckCompressBatch(p, 3, 1).ok());  // epoch 1 out of range
  dst_slot[1] = 0;
  EXPECT_FALSE(CheckCompressBatch(p, 3, 2).ok());  // one slot twice
  dst_slot[1] = l.SlotsPerPage();
  EXPECT_FALSE(CheckCompressBatch(p, 3, 2).ok());  // past the page
  dst_slot[1] = 1;
  dst_page[1] = 0;
  EXPECT_FALSE(CheckCompressBatch(p, 3, 2).ok());  // writes into a page it reads
  dst_page[1] = 2;
  uint64_t masks[2] = {0, 0};
  const float pq = 0.0f;
  p.outlier_masks = masks;
  EXPECT_EQ(CheckCompressBatch(p, 3, 2).code(), absl::StatusCode::kInvalidArgument)
      << "outlier masks without basis_pq";
  p.basis_pq = &pq;  // never read: only the pointers are checked
  EXPECT_TRUE(CheckCompressBatch(p, 3, 2).ok());
}

}  // namespace
}  // namespace subspace::kernels
