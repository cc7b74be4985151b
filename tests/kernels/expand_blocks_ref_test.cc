// The CPU twin of expand_blocks.cu: its pages bit-for-bit against an independent expansion
// through core's DecodeCoeffs at the CPU cache's offsets, against CompressedKvCache's own
// Decompress (Truncate into a compressed block), a round trip through CompressBlocksRef, the
// batch checks that guard the kernel's no-aliasing precondition, and that it writes nothing
// outside its destination pages.
#include "tests/kernels/expand_blocks_ref.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/compress/compressed_kv_cache.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/kernels/compress_blocks_ref.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

using testing::ExpandCase;
using testing::RandomExpandCase;

// "" when every byte of `after` outside the destination pages of `c` equals `before`'s, else
// the first one that does not. Covers the source slabs too when the pools are one.
std::string WrittenOutsideDestinations(const ExpandCase& c, const std::vector<uint8_t>& before,
                                       const std::vector<uint8_t>& after) {
  const std::set<int32_t> named(c.dst_page.begin(), c.dst_page.end());
  for (size_t i = 0; i < after.size(); ++i) {
    const auto page = static_cast<int32_t>(static_cast<int64_t>(i) / c.layout.page_bytes);
    if (named.count(page) == 0 && after[i] != before[i]) {
      return "byte " + std::to_string(i) + " of page " + std::to_string(page) + " was written";
    }
  }
  return "";
}

// head_dim, block size, rank (0: head_dim), coefficient dtype, destinations in the source pool.
using Shape = std::tuple<int, int, int, CoeffDtype, bool>;

std::string ShapeName(const Shape& s) {
  const int rank = std::get<2>(s);
  return "d" + std::to_string(std::get<0>(s)) + "_b" + std::to_string(std::get<1>(s)) + "_r" +
         (rank == 0 ? std::string("full") : std::to_string(rank)) + "_" +
         CoeffDtypeName(std::get<3>(s)) + (std::get<4>(s) ? "_onepool" : "_scratch");
}

// r_v from the rank parameter: a different value where int8 alignment allows (n_kv = 3 and
// odd B need r_k + r_v even), so a swapped rank shows up.
int ValueRank(int rank) { return rank == 16 ? 8 : rank; }

class ExpandBlocksRefTest : public ::testing::TestWithParam<Shape> {};

// Independent of the twin's loops: codes found at the offsets CompressedKvCache::Decompress
// computes, decoded by core's DecodeCoeffs, outputs at [2][n_kv][B][d] offsets spelled out.
// Same double sums in the same order, one rounding to float and one to fp16: bit-identical.
TEST_P(ExpandBlocksRefTest, MatchesDecodeCoeffsAndExplicitLoops) {
  const auto [hd, bs, rank_param, dt, one_pool] = GetParam();
  const int rank = rank_param == 0 ? hd : rank_param;
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const int n_kv = 3, rk = rank, rv = ValueRank(rank);
  const KvPoolLayout l = MakeKvPoolLayout(n_kv, hd, bs, rk, rv, dt);
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  ExpandCase c = RandomExpandCase(l, /*n_blocks=*/5, /*n_epochs=*/3, one_pool, rng);
  const std::vector<uint8_t> before = c.dst_bytes();
  const std::vector<uint8_t> src = c.src_pool;  // the codes as drawn, even when overwritten
  ExpandBlocksParams p = c.HostParams();
  ASSERT_TRUE(CheckExpandBatch(p, c.num_src_pages, c.num_dst_pages, c.bases.n_epochs).ok());
  ExpandBlocksRef(p);
  const std::vector<uint8_t>& got = c.dst_bytes();
  ASSERT_EQ(WrittenOutsideDestinations(c, before, got), "");

  const int64_t cb = CodeBytes(dt, 1), rows = static_cast<int64_t>(n_kv) * bs;
  std::vector<float> k_coef(static_cast<size_t>(rk)), v_coef(static_cast<size_t>(rv));
  for (int b = 0; b < c.n_blocks(); ++b) {
    const uint8_t* base = src.data() + c.src_page[b] * l.page_bytes + c.src_slot[b] * l.slot_bytes;
    const uint8_t* k_codes = base;
    const uint8_t* v_codes = k_codes + rows * rk * cb;
    std::vector<uint16_t> scales(static_cast<size_t>(2 * rows));  // k then v, int8 only
    if (dt == CoeffDtype::kInt8) std::memcpy(scales.data(), v_codes + rows * rv * cb, 4 * rows);
    for (int h = 0; h < n_kv; ++h) {
      const int64_t e = c.epoch[b * n_kv + h];
      const float* pq = c.bases.p_q.data() + (e * n_kv + h) * hd * rk;   // [d, r_k]
      const float* rvm = c.bases.r_v.data() + (e * n_kv + h) * rv * hd;  // [r_v, d]
      for (int t = 0; t < bs; ++t) {
        const int64_t row = static_cast<int64_t>(h) * bs + t;
        DecodeCoeffs(dt, k_codes + row * rk * cb, scales.data() + row, rk, k_coef.data());
        DecodeCoeffs(dt, v_codes + row * rv * cb, scales.data() + rows + row, rv, v_coef.data());
        for (int i = 0; i < hd; ++i) {
          double k = 0.0, v = 0.0;
          for (int j = 0; j < rk; ++j) k += static_cast<double>(pq[i * rk + j]) * k_coef[j];
          for (int j = 0; j < rv; ++j) v += static_cast<double>(rvm[j * hd + i]) * v_coef[j];
          const int64_t k_at = c.dst_page[b] * l.page_bytes + 2 * ((row * hd) + i);
          const int64_t v_at = k_at + 2 * rows * hd;
          uint16_t k16, v16;
          std::memcpy(&k16, got.data() + k_at, 2);
          std::memcpy(&v16, got.data() + v_at, 2);
          ASSERT_EQ(k16, Fp32ToFp16(static_cast<float>(k)))
              << "block " << b << " head " << h << " token " << t << " key " << i;
          ASSERT_EQ(v16, Fp32ToFp16(static_cast<float>(v)))
              << "block " << b << " head " << h << " token " << t << " value " << i;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ExpandBlocksRefTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(1, 16, 64),
                       ::testing::Values(1, 16, 0),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8), ::testing::Bool()),
    [](const ::testing::TestParamInfo<Shape>& info) { return ShapeName(info.param); });

// Compress then expand with an orthonormal basis at full rank (P_q = P_k, R_v = P_v^T) and fp16
// codes gives back the keys and values up to two fp16 roundings: of the coefficients
// (||P dc|| = ||dc|| <= 2^-11 ||c|| = 2^-11 ||k||) and of the output (<= 2^-11 ||k^||). So per
// row ||k^ - k|| <= 2^-10 ||k||, plus 1% and 1e-5 ||k|| for float bases that are orthonormal
// only to ~1e-7.
class ExpandBlocksRoundTripTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ExpandBlocksRoundTripTest, ReproducesCompressedBlocks) {
  const auto [hd, bs] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const int n_kv = 2, n_blocks = 3, n_epochs = 2;
  const KvPoolLayout l = MakeKvPoolLayout(n_kv, hd, bs, hd, hd, CoeffDtype::kFp16);
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  testing::CompressCase c = testing::RandomCompressCase(l, n_blocks, n_epochs, rng);
  std::mt19937 basis_rng(static_cast<uint32_t>(rng()));
  const int64_t per_head = static_cast<int64_t>(hd) * hd;
  for (int64_t eh = 0; eh < static_cast<int64_t>(n_epochs) * n_kv; ++eh) {
    const std::vector<float> uk = cache_test::RandomOrthonormal(hd, hd, basis_rng);
    const std::vector<float> uv = cache_test::RandomOrthonormal(hd, hd, basis_rng);
    for (int i = 0; i < hd; ++i) {
      for (int j = 0; j < hd; ++j) {
        c.bases.p_k[eh * per_head + i * hd + j] = uk[i * hd + j];
        c.bases.p_q[eh * per_head + i * hd + j] = uk[i * hd + j];
        c.bases.p_v[eh * per_head + i * hd + j] = uv[i * hd + j];
        c.bases.r_v[eh * per_head + j * hd + i] = uv[i * hd + j];  // R_v = P_v^T
      }
    }
  }
  CompressBlocksParams cp;
  cp.layout = l;
  cp.pool = c.pool.data();
  cp.basis_pk = c.bases.p_k.data();
  cp.basis_pv = c.bases.p_v.data();
  cp.src_page = c.src_page.data();
  cp.dst_page = c.dst_page.data();
  cp.dst_slot = c.dst_slot.data();
  cp.epoch = c.epoch.data();
  cp.n_blocks = n_blocks;
  ASSERT_TRUE(CheckCompressBatch(cp, c.num_pages, n_epochs).ok());
  CompressBlocksRef(cp);

  std::vector<uint8_t> scratch(static_cast<size_t>(n_blocks * l.page_bytes), testing::kPoison);
  std::vector<int32_t> dst_page = {0, 1, 2};
  ExpandBlocksParams p;
  p.layout = l;
  p.src_pool = c.pool.data();
  p.dst_pool = scratch.data();
  p.basis_pq = c.bases.p_q.data();
  p.basis_rv = c.bases.r_v.data();
  p.src_page = c.dst_page.data();
  p.src_slot = c.dst_slot.data();
  p.dst_page = dst_page.data();
  p.epoch = c.epoch.data();
  p.n_blocks = n_blocks;
  ASSERT_TRUE(CheckExpandBatch(p, c.num_pages, n_blocks, n_epochs).ok());
  ExpandBlocksRef(p);

  for (int b = 0; b < n_blocks; ++b) {
    for (int h = 0; h < n_kv; ++h) {
      for (int side = 0; side < 2; ++side) {
        const int64_t want_at = side == 0 ? l.FullK(c.src_page[b], h) : l.FullV(c.src_page[b], h);
        const int64_t got_at = side == 0 ? l.FullK(b, h) : l.FullV(b, h);
        for (int t = 0; t < bs; ++t) {
          double err = 0.0, norm = 0.0;
          for (int i = 0; i < hd; ++i) {
            const double want = testing::PoolHalf(c.pool, want_at + 2 * (t * hd + i));
            const double got = testing::PoolHalf(scratch, got_at + 2 * (t * hd + i));
            ASSERT_TRUE(std::isfinite(got)) << "block " << b << " head " << h << " token " << t;
            err += (got - want) * (got - want);
            norm += want * want;
          }
          EXPECT_LE(std::sqrt(err), (std::exp2(-10.0) * 1.01 + 1e-5) * std::sqrt(norm) + 1e-6)
              << "block " << b << " head " << h << (side == 0 ? " key" : " value") << " token "
              << t;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ExpandBlocksRoundTripTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(1, 16, 64)),
                         [](const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
                           return "d" + std::to_string(std::get<0>(info.param)) + "_b" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The twin against what the CPU cache itself rebuilds: Truncate into a compressed block
// expands it in place (CompressedKvCache::Decompress; no outliers here). The cache sums in
// float in its own order, the twin in double: an element may round one fp16 unit apart.
class ExpandBlocksRefVsCacheTest
    : public ::testing::TestWithParam<std::tuple<int, int, CoeffDtype>> {};

TEST_P(ExpandBlocksRefVsCacheTest, MatchesTruncateDecompress) {
  const auto [hd, bs, dt] = GetParam();
  const int n_kv = 2, rk = 16, rv = 8;
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const KvCacheGeometry g{1, n_kv, hd};
  const KvPoolLayout l = MakeKvPoolLayout(n_kv, hd, bs, rk, rv, dt);
  const int nb = std::min(l.SlotsPerPage(), 4);
  CompressedKvCacheConfig cfg;
  cfg.geometry = g;
  cfg.block_size = bs;
  cfg.policy.sink_tokens = 0;
  cfg.policy.window_tokens = 0;
  cfg.policy.r_k = {rk};
  cfg.policy.r_v = {rv};
  cfg.policy.coeff_dtype = dt;
  cfg.full_dtype = CoeffDtype::kFp16;
  cfg.capacity_bytes = l.page_bytes * 4 * nb;
  auto cache = CompressedKvCache::Create(cfg);
  ASSERT_TRUE(cache.ok()) << cache.status();
  CompressedKvCache& kv = **cache;
  std::shared_ptr<Basis> basis = cache_test::ObliqueBasis(g, rk, rv, static_cast<uint32_t>(rng()));
  absl::StatusOr<EpochId> id = kv.InstallBasis(basis);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(kv.SetDefaultEpoch(*id).ok());
  absl::StatusOr<SeqId> seq = kv.CreateSequence();
  ASSERT_TRUE(seq.ok());
  const int64_t T = static_cast<int64_t>(nb) * bs;
  cache_test::Append(kv, *seq, cache_test::RandomKv(g, T, static_cast<uint32_t>(rng())), 0, T);
  const auto find_page = [&](BlockKind kind) {
    int32_t found = -1;
    for (int32_t p = 0; p < kv.pool().num_blocks(); ++p) {
      if (!kv.pool().in_use(p) || kv.pool().kind(p) != kind) continue;
      if (found >= 0) return int32_t{-2};  // more than one
      found = p;
    }
    return found;
  };
  const int32_t slab = find_page(BlockKind::kCompressed);
  ASSERT_GE(slab, 0) << "one slab page expected";
  ASSERT_EQ(find_page(BlockKind::kFull), -1);
  for (int b = 0; b < nb; ++b) ASSERT_TRUE(kv.IsCompressed(*seq, 0, b));
  // The slab as it was (slot b = block b: the slab allocator takes the lowest free slot).
  const auto* slab_bytes = reinterpret_cast<const uint8_t*>(kv.pool().data(slab));
  std::vector<uint8_t> src(slab_bytes, slab_bytes + l.page_bytes);

  ASSERT_TRUE(kv.Truncate(*seq, T - bs / 2).ok());  // into the last block: it expands
  const int32_t full = find_page(BlockKind::kFull);
  ASSERT_GE(full, 0) << "one full page expected";
  const auto* core = reinterpret_cast<const uint8_t*>(kv.pool().data(full));

  std::vector<uint8_t> dst(static_cast<size_t>(l.page_bytes), testing::kPoison);
  const std::vector<int32_t> src_page = {0}, src_slot = {nb - 1}, dst_page = {0};
  const std::vector<int32_t> epoch(static_cast<size_t>(n_kv), 0);
  const LayerBasis& lb = basis->layers[0];
  ExpandBlocksParams p;
  p.layout = l;
  p.src_pool = src.data();
  p.dst_pool = dst.data();
  p.basis_pq = lb.p_q.data();
  p.basis_rv = lb.r_v.data();
  p.src_page = src_page.data();
  p.src_slot = src_slot.data();
  p.dst_page = dst_page.data();
  p.epoch = epoch.data();
  p.n_blocks = 1;
  ASSERT_TRUE(CheckExpandBatch(p, 1, 1, 1).ok());
  ExpandBlocksRef(p);

  // Same bound as the GPU test's (expand_blocks_test.cc): two fp16 units, relative.
  int64_t differ = 0;
  for (int64_t row = 0; row < 2 * l.Rows(); ++row) {
    double amax = 0.0;
    for (int i = 0; i < hd; ++i)
      amax = std::max(amax, std::fabs(testing::PoolHalf(dst, 2 * (row * hd + i))));
    for (int i = 0; i < hd; ++i) {
      const int64_t at = 2 * (row * hd + i);
      const double want = testing::PoolHalf(dst, at);
      uint16_t c16;
      std::memcpy(&c16, core + at, 2);
      ASSERT_LE(std::fabs(HalfToFloat(c16) - want), 2e-3 * (std::fabs(want) + 1e-2 * amax))
          << "row " << row << " (K then V, head-major) element " << i;
      differ += std::memcmp(core + at, dst.data() + at, 2) != 0;
    }
  }
  EXPECT_LE(differ, 2 * l.Rows() * hd / 100) << differ << " elements round apart";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ExpandBlocksRefVsCacheTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(8, 16),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8)),
    [](const ::testing::TestParamInfo<std::tuple<int, int, CoeffDtype>>& info) {
      return "d" + std::to_string(std::get<0>(info.param)) + "_b" +
             std::to_string(std::get<1>(info.param)) + "_" +
             CoeffDtypeName(std::get<2>(info.param));
    });

TEST(ExpandBlocksRefTest, CheckExpandBatchRejectsUnsafeBatches) {
  const KvPoolLayout l = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp16);
  std::vector<int32_t> src_page = {0, 1}, src_slot = {0, 1}, dst_page = {2, 3};
  std::vector<int32_t> epoch = {0, 0, 0, 1};
  uint8_t src_pool = 0, scratch = 0;  // only their addresses are compared
  ExpandBlocksParams p;
  p.layout = l;
  p.src_pool = &src_pool;
  p.dst_pool = &scratch;
  p.src_page = src_page.data();
  p.src_slot = src_slot.data();
  p.dst_page = dst_page.data();
  p.epoch = epoch.data();
  p.n_blocks = 2;
  EXPECT_TRUE(CheckExpandBatch(p, 2, 4, 2).ok());
  EXPECT_FALSE(CheckExpandBatch(p, 1, 4, 2).ok());  // source page 1 out of range
  EXPECT_FALSE(CheckExpandBatch(p, 2, 3, 2).ok());  // destination page 3 out of range
  EXPECT_FALSE(CheckExpandBatch(p, 2, 4, 1).ok());  // epoch 1 out of range
  epoch[3] = -1;
  EXPECT_FALSE(CheckExpandBatch(p, 2, 4, 2).ok());
  epoch[3] = 1;
  src_slot[1] = l.SlotsPerPage();
  EXPECT_FALSE(CheckExpandBatch(p, 2, 4, 2).ok());  // past the page
  src_slot[1] = -1;
  EXPECT_FALSE(CheckExpandBatch(p, 2, 4, 2).ok());
  src_slot[1] = 1;
  dst_page[1] = 2;
  EXPECT_FALSE(CheckExpandBatch(p, 2, 4, 2).ok());  // one destination page twice
  dst_page[1] = 3;

  // A destination page with a source page's index: fine in a scratch pool, not in one pool.
  dst_page[0] = 1;
  EXPECT_TRUE(CheckExpandBatch(p, 4, 4, 2).ok());
  p.dst_pool = &src_pool;
  EXPECT_FALSE(CheckExpandBatch(p, 4, 4, 2).ok());
  dst_page[0] = 2;
  EXPECT_TRUE(CheckExpandBatch(p, 4, 4, 2).ok());

  p.n_blocks = -1;
  EXPECT_FALSE(CheckExpandBatch(p, 4, 4, 2).ok());
  p.n_blocks = 2;
  p.layout = MakeKvPoolLayout(2, 64, 65, 16, 16, CoeffDtype::kFp16);
  EXPECT_FALSE(CheckExpandBatch(p, 4, 4, 2).ok());  // block size past 64
  p.layout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp32);
  EXPECT_FALSE(CheckExpandBatch(p, 4, 4, 2).ok());  // fp32 codes: the CPU cache only
}

// Pages of the destination pool no block names keep their poison, byte for byte, and with one
// pool the source slabs are untouched too.
TEST(ExpandBlocksRefTest, LeavesPagesOutsideTheBatchUntouched) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (bool one_pool : {false, true}) {
    const KvPoolLayout l = MakeKvPoolLayout(2, 64, 8, 16, 8, CoeffDtype::kInt8);
    ExpandCase c = RandomExpandCase(l, /*n_blocks=*/6, /*n_epochs=*/2, one_pool, rng);
    const std::vector<uint8_t> src_before = c.src_pool, dst_before = c.dst_bytes();
    ExpandBlocksParams p = c.HostParams();
    ASSERT_TRUE(CheckExpandBatch(p, c.num_src_pages, c.num_dst_pages, 2).ok());
    ExpandBlocksRef(p);
    const std::set<int32_t> named(c.dst_page.begin(), c.dst_page.end());
    int unnamed = 0;
    for (int32_t page = 0; page < c.num_dst_pages; ++page) {
      const uint8_t* bytes = c.dst_bytes().data() + l.Page(page);
      const uint8_t* was = dst_before.data() + l.Page(page);
      if (named.count(page) != 0) {
        EXPECT_NE(std::memcmp(bytes, was, static_cast<size_t>(l.page_bytes)), 0) << page;
        continue;
      }
      ++unnamed;
      for (int64_t i = 0; i < l.page_bytes; ++i) {
        ASSERT_EQ(bytes[i], was[i])
            << "byte " << i << " of page " << page << " one_pool " << one_pool;
      }
    }
    EXPECT_GE(unnamed, 2);
    if (!one_pool) {
      EXPECT_EQ(c.src_pool, src_before);  // a scratch batch never writes the source pool
    }
  }
}

}  // namespace
}  // namespace subspace::kernels
