// The CPU twin of compress_blocks.cu: its encoding bit-for-bit against core's EncodeCoeffs, its
// slots against the bytes CompressedKvCache itself writes into its pool, the layout's sizes
// against core's, and the batch checks that guard the kernel's no-aliasing precondition.
#include "tests/kernels/compress_blocks_ref.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "core/compressed_kv_cache.h"
#include "core/ggml_types.h"
#include "tests/core/compressed_kv_cache_test_util.h"
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

// The twin's slots against CompressedKvCache::CompressBlock's: a sequence of whole blocks,
// no sinks, no window, one epoch, so every block compresses, in order, into one slab page
// (slot b = block b: the slab allocator takes the lowest free slot).
class CompressBlocksRefVsCacheTest
    : public ::testing::TestWithParam<std::tuple<int, int, CoeffDtype>> {};

TEST_P(CompressBlocksRefVsCacheTest, SlotsMatchTheCpuCache) {
  const auto [hd, bs, dt] = GetParam();
  const int n_kv = 2, rk = 16, rv = 8;
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const KvCacheGeometry g{1, n_kv, hd};
  const KvPoolLayout layout = MakeKvPoolLayout(n_kv, hd, bs, rk, rv, dt);
  const int nb = std::min(layout.SlotsPerPage(), 6);
  CompressedKvCacheConfig cfg;
  cfg.geometry = g;
  cfg.block_size = bs;
  cfg.sink_tokens = 0;
  cfg.window_tokens = 0;
  cfg.r_k = {rk};
  cfg.r_v = {rv};
  cfg.coeff_dtype = dt;
  cfg.full_dtype = CoeffDtype::kFp16;
  cfg.capacity_bytes = layout.page_bytes * 4 * nb;
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
  const cache_test::Data d = cache_test::RandomKv(g, T, static_cast<uint32_t>(rng()));
  cache_test::Append(kv, *seq, d, 0, T);
  int32_t core_page = -1;
  for (int32_t p = 0; p < kv.pool().num_blocks(); ++p) {
    if (kv.pool().in_use(p) && kv.pool().kind(p) == BlockKind::kCompressed) {
      ASSERT_EQ(core_page, -1) << "one slab page expected";
      core_page = p;
    }
  }
  ASSERT_GE(core_page, 0);
  for (int b = 0; b < nb; ++b) ASSERT_TRUE(kv.IsCompressed(*seq, 0, b));

  // Twin pool: block b on page b, slots on page nb.
  const int64_t num_pages = nb + 1;
  std::vector<uint8_t> pool(static_cast<size_t>(num_pages * layout.page_bytes), testing::kPoison);
  std::vector<int32_t> src, dst_page, dst_slot, epoch;
  for (int b = 0; b < nb; ++b) {
    for (int t = 0; t < bs; ++t) {
      for (int h = 0; h < n_kv; ++h) {
        auto* k = reinterpret_cast<uint16_t*>(pool.data() + layout.FullK(b, h)) + t * hd;
        auto* v = reinterpret_cast<uint16_t*>(pool.data() + layout.FullV(b, h)) + t * hd;
        const int64_t row = ((static_cast<int64_t>(b) * bs + t) * n_kv + h) * hd;
        for (int i = 0; i < hd; ++i) {
          k[i] = Fp32ToFp16(d.k[0][row + i]);
          v[i] = Fp32ToFp16(d.v[0][row + i]);
        }
      }
    }
    src.push_back(b);
    dst_page.push_back(nb);
    dst_slot.push_back(b);
    epoch.insert(epoch.end(), n_kv, 0);
  }
  const LayerBasis& lb = basis->layers[0];
  CompressBlocksParams p;
  p.layout = layout;
  p.pool = pool.data();
  p.basis_pk = lb.p_k.data();
  p.basis_pv = lb.p_v.data();
  p.src_page = src.data();
  p.dst_page = dst_page.data();
  p.dst_slot = dst_slot.data();
  p.epoch = epoch.data();
  p.n_blocks = nb;
  ASSERT_TRUE(CheckCompressBatch(p, num_pages, 1).ok());
  CompressBlocksRef(p);

  // Core projects in float, the twin in double: codes may round apart (SlotMismatch).
  const auto* core = reinterpret_cast<const uint8_t*>(kv.pool().data(core_page));
  int64_t codes = 0, differ = 0;
  for (int b = 0; b < nb; ++b) {
    const uint8_t* got = pool.data() + layout.Slot(nb, b);
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

INSTANTIATE_TEST_SUITE_P(
    Shapes, CompressBlocksRefVsCacheTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(8, 16, 32),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8)),
    [](const ::testing::TestParamInfo<std::tuple<int, int, CoeffDtype>>& info) {
      return "d" + std::to_string(std::get<0>(info.param)) + "_b" +
             std::to_string(std::get<1>(info.param)) + "_" +
             CoeffDtypeName(std::get<2>(info.param));
    });

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
}

}  // namespace
}  // namespace subspace::kernels
