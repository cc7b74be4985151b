// compress_blocks.cu against its CPU twin (CompressBlocksRef, itself checked against core's
// EncodeCoeffs and CompressedKvCache in compress_blocks_ref_test.cc) across head_dim x block
// size x batch (blocks) x rank x coefficient dtype. Fresh random inputs per case; destination
// pages poisoned before the launch, and every byte outside the written payloads must come back
// untouched.
//
// Tolerance: the kernel projects in float, the twin in double, then both encode identically;
// a code may round the other way. Per token row (testing::SlotMismatch): decoded coefficients
// within one fp16 unit of the row's largest (2e-3) or 1.5 int8 steps, int8 scales within one
// fp16 unit; and at most 1% of the codes differ at all. Outlier masks
// (CompressBlocksOutlierGpuTest) match the twin's exactly but for tokens within 1e-4 of the
// threshold.
#include "kernels/compress_blocks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/kernels/compress_blocks_ref.h"
#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

using testing::DeviceBuffer;
using testing::ToDevice;

// head_dim, block size, batch (blocks), rank, coefficient dtype.
using Shape = std::tuple<int, int, int, int, CoeffDtype>;

// Not a lambda in the macro: a structured binding's commas would split the macro's arguments.
std::string ShapeName(const Shape& s) {
  return "d" + std::to_string(std::get<0>(s)) + "_b" + std::to_string(std::get<1>(s)) + "_n" +
         std::to_string(std::get<2>(s)) + "_r" + std::to_string(std::get<3>(s)) + "_" +
         CoeffDtypeName(std::get<4>(s));
}

class CompressBlocksGpuTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(CompressBlocksGpuTest, MatchesCpuTwin) {
  const auto [hd, bs, batch, rank, dt] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const KvPoolLayout l = MakeKvPoolLayout(3, hd, bs, rank, rank * 3 / 4, dt);
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  const testing::CompressCase c = testing::RandomCompressCase(l, batch, /*n_epochs=*/3, rng);

  std::vector<uint8_t> want = c.pool;
  CompressBlocksParams p;
  p.layout = l;
  p.pool = want.data();
  p.basis_pk = c.bases.p_k.data();
  p.basis_pv = c.bases.p_v.data();
  p.src_page = c.src_page.data();
  p.dst_page = c.dst_page.data();
  p.dst_slot = c.dst_slot.data();
  p.epoch = c.epoch.data();
  p.n_blocks = batch;
  ASSERT_TRUE(CheckCompressBatch(p, c.num_pages, c.bases.n_epochs).ok());
  CompressBlocksRef(p);

  DeviceBuffer<uint8_t> pool = ToDevice(c.pool);  // destinations arrive poisoned
  DeviceBuffer<float> pk = ToDevice(c.bases.p_k), pv = ToDevice(c.bases.p_v);
  DeviceBuffer<int32_t> src = ToDevice(c.src_page), dst = ToDevice(c.dst_page),
                        slot = ToDevice(c.dst_slot), epoch = ToDevice(c.epoch);
  ASSERT_TRUE(pool.ok() && pk.ok() && pv.ok() && src.ok() && dst.ok() && slot.ok() && epoch.ok());
  p.pool = pool.get();
  p.basis_pk = pk.get();
  p.basis_pv = pv.get();
  p.src_page = src.get();
  p.dst_page = dst.get();
  p.dst_slot = slot.get();
  p.epoch = epoch.get();
  SUBSPACE_ASSERT_CUDA(LaunchCompressBlocks(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got;
  SUBSPACE_ASSERT_CUDA(pool.Download(&got));

  // Outside the payloads, every byte is what it was before the launch.
  std::vector<bool> payload(got.size(), false);
  for (int i = 0; i < batch; ++i) {
    const int64_t at = l.Slot(c.dst_page[i], c.dst_slot[i]);
    std::fill(payload.begin() + at, payload.begin() + at + l.CompressedBytes(), true);
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (!payload[i]) {
      ASSERT_EQ(got[i], c.pool[i]) << "byte " << i << " written outside a slot";
    }
  }

  int64_t codes = 0, differ = 0;
  for (int i = 0; i < batch; ++i) {
    const int64_t at = l.Slot(c.dst_page[i], c.dst_slot[i]);
    const std::string mismatch =
        testing::SlotMismatch(l, want.data() + at, got.data() + at, &codes, &differ);
    ASSERT_EQ(mismatch, "") << "block " << i;
  }
  EXPECT_LE(differ, codes / 100) << differ << " of " << codes << " codes differ from the twin";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CompressBlocksGpuTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(8, 16, 32),
                       ::testing::Values(1, 7, 32), ::testing::Values(8, 16, 32),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8)),
    [](const ::testing::TestParamInfo<Shape>& info) { return ShapeName(info.param); });

// Block size 64 at head_dim 128 and full rank: the kernel's largest shared-memory footprint
// (exactly 48 KiB).
TEST(CompressBlocksGpuLimitsTest, LargestBlockAndRank) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const KvPoolLayout l = MakeKvPoolLayout(1, 128, 64, 128, 64, CoeffDtype::kInt8);
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  testing::CompressCase c = testing::RandomCompressCase(l, 3, 2, rng);
  std::vector<uint8_t> want = c.pool;
  CompressBlocksParams p;
  p.layout = l;
  p.pool = want.data();
  p.basis_pk = c.bases.p_k.data();
  p.basis_pv = c.bases.p_v.data();
  p.src_page = c.src_page.data();
  p.dst_page = c.dst_page.data();
  p.dst_slot = c.dst_slot.data();
  p.epoch = c.epoch.data();
  p.n_blocks = 3;
  CompressBlocksRef(p);
  DeviceBuffer<uint8_t> pool = ToDevice(c.pool);
  DeviceBuffer<float> pk = ToDevice(c.bases.p_k), pv = ToDevice(c.bases.p_v);
  DeviceBuffer<int32_t> src = ToDevice(c.src_page), dst = ToDevice(c.dst_page),
                        slot = ToDevice(c.dst_slot), epoch = ToDevice(c.epoch);
  p.pool = pool.get();
  p.basis_pk = pk.get();
  p.basis_pv = pv.get();
  p.src_page = src.get();
  p.dst_page = dst.get();
  p.dst_slot = slot.get();
  p.epoch = epoch.get();
  SUBSPACE_ASSERT_CUDA(LaunchCompressBlocks(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got;
  SUBSPACE_ASSERT_CUDA(pool.Download(&got));
  int64_t codes = 0, differ = 0;
  for (int i = 0; i < 3; ++i) {
    const int64_t at = l.Slot(c.dst_page[i], c.dst_slot[i]);
    const std::string mismatch =
        testing::SlotMismatch(l, want.data() + at, got.data() + at, &codes, &differ);
    ASSERT_EQ(mismatch, "") << "block " << i;
  }
  EXPECT_LE(differ, codes / 100) << differ << " of " << codes << " codes differ from the twin";
}

// ---- Outlier detection ----------------------------------------------------------------------

// Per (block, head, token) of the case, the key's residual ratio |k - P_q P_k^T k|^2 / |k|^2
// in double from its fp16 row and its epoch's bases: [n_blocks, n_kv, B].
std::vector<double> ResidualRatios(const testing::CompressCase& c) {
  const KvPoolLayout& l = c.layout;
  const int hd = l.head_dim, r = l.rank_k, bs = l.block_size, n_kv = l.n_kv_heads;
  std::vector<double> ratios, k(static_cast<size_t>(hd)), coef(static_cast<size_t>(r));
  for (size_t i = 0; i < c.src_page.size(); ++i) {
    for (int h = 0; h < n_kv; ++h) {
      const int64_t e = c.epoch[i * n_kv + h];
      const float* pk = c.bases.p_k.data() + (e * n_kv + h) * hd * r;  // [d, r]
      const float* pq = c.bases.p_q.data() + (e * n_kv + h) * hd * r;  // [d, r]
      for (int t = 0; t < bs; ++t) {
        for (int x = 0; x < hd; ++x)
          k[x] = testing::PoolHalf(c.pool, l.FullK(c.src_page[i], h) + 2 * (t * hd + x));
        for (int j = 0; j < r; ++j) {
          coef[j] = 0.0;
          for (int x = 0; x < hd; ++x) coef[j] += pk[x * r + j] * k[x];
        }
        double err = 0.0, norm = 0.0;
        for (int x = 0; x < hd; ++x) {
          double kr = 0.0;
          for (int j = 0; j < r; ++j) kr += pq[x * r + j] * coef[j];
          err += (k[x] - kr) * (k[x] - kr);
          norm += k[x] * k[x];
        }
        ratios.push_back(err / norm);
      }
    }
  }
  return ratios;
}

// head_dim, block size, rank (0: head_dim), coefficient dtype.
using OutlierShape = std::tuple<int, int, int, CoeffDtype>;

std::string OutlierShapeName(const ::testing::TestParamInfo<OutlierShape>& info) {
  const int rank = std::get<2>(info.param);
  return "d" + std::to_string(std::get<0>(info.param)) + "_b" +
         std::to_string(std::get<1>(info.param)) + "_r" +
         (rank == 0 ? std::string("full") : std::to_string(rank)) + "_" +
         CoeffDtypeName(std::get<3>(info.param));
}

class CompressBlocksOutlierGpuTest : public ::testing::TestWithParam<OutlierShape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

// The kernel's outlier masks against the twin's, OR-ed into bits an earlier layer already set.
// Random bases make P_q unrelated to P_k (ratios around 1 + r / d); the threshold splits the
// tokens' largest ratios in a wide gap near their median (ThresholdInAGap). The kernel sums in
// float, the twin in double: a token whose largest ratio lies within 1e-4 (relative) of thr^2
// may fall either way and is not compared (the gap makes that rare). Detection only reads:
// the slots must be byte for byte those of a launch without masks.
TEST_P(CompressBlocksOutlierGpuTest, MasksMatchCpuTwin) {
  const auto [hd, bs, rank_param, dt] = GetParam();
  const int rank = rank_param == 0 ? hd : rank_param;
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const int n_kv = 3, batch = 9;
  const KvPoolLayout l = MakeKvPoolLayout(n_kv, hd, bs, rank, rank * 3 / 4, dt);
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  const testing::CompressCase c = testing::RandomCompressCase(l, batch, /*n_epochs=*/3, rng);
  const std::vector<double> ratios = ResidualRatios(c);
  std::vector<double> token_ratio;  // per (block, token): the largest over the heads
  for (int i = 0; i < batch; ++i) {
    for (int t = 0; t < bs; ++t) {
      double worst = 0.0;
      for (int h = 0; h < n_kv; ++h) worst = std::max(worst, ratios[(i * n_kv + h) * bs + t]);
      token_ratio.push_back(worst);
    }
  }
  const float thr = testing::ThresholdInAGap(token_ratio);
  const double thr2 = static_cast<double>(thr) * thr;
  const uint64_t valid = bs == 64 ? ~uint64_t{0} : (uint64_t{1} << bs) - 1;
  std::vector<uint64_t> prior(static_cast<size_t>(batch));
  for (uint64_t& m : prior) m = rng() & rng() & valid;  // about a quarter of the tokens

  std::vector<uint8_t> want = c.pool;
  std::vector<uint64_t> want_masks = prior;
  CompressBlocksParams p;
  p.layout = l;
  p.pool = want.data();
  p.basis_pk = c.bases.p_k.data();
  p.basis_pv = c.bases.p_v.data();
  p.basis_pq = c.bases.p_q.data();
  p.src_page = c.src_page.data();
  p.dst_page = c.dst_page.data();
  p.dst_slot = c.dst_slot.data();
  p.epoch = c.epoch.data();
  p.n_blocks = batch;
  p.outlier_masks = want_masks.data();
  p.outlier_threshold = thr;
  ASSERT_TRUE(CheckCompressBatch(p, c.num_pages, c.bases.n_epochs).ok());
  CompressBlocksRef(p);

  DeviceBuffer<uint8_t> pool = ToDevice(c.pool);
  DeviceBuffer<float> pk = ToDevice(c.bases.p_k), pv = ToDevice(c.bases.p_v),
                      pq = ToDevice(c.bases.p_q);
  DeviceBuffer<int32_t> src = ToDevice(c.src_page), dst = ToDevice(c.dst_page),
                        slot = ToDevice(c.dst_slot), epoch = ToDevice(c.epoch);
  DeviceBuffer<uint64_t> masks = ToDevice(prior);
  ASSERT_TRUE(pool.ok() && pk.ok() && pv.ok() && pq.ok() && src.ok() && dst.ok() && slot.ok() &&
              epoch.ok() && masks.ok());
  p.pool = pool.get();
  p.basis_pk = pk.get();
  p.basis_pv = pv.get();
  p.basis_pq = pq.get();
  p.src_page = src.get();
  p.dst_page = dst.get();
  p.dst_slot = slot.get();
  p.epoch = epoch.get();
  p.outlier_masks = masks.get();
  SUBSPACE_ASSERT_CUDA(LaunchCompressBlocks(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got;
  std::vector<uint64_t> got_masks;
  SUBSPACE_ASSERT_CUDA(pool.Download(&got));
  SUBSPACE_ASSERT_CUDA(masks.Download(&got_masks));

  int64_t compared = 0, outliers = 0;
  for (int i = 0; i < batch; ++i) {
    ASSERT_EQ(got_masks[i] & ~valid, 0u) << "block " << i << ": bits past B";
    ASSERT_EQ(got_masks[i] & prior[i], prior[i]) << "block " << i << ": earlier bits lost";
    for (int t = 0; t < bs; ++t) {
      // Only the largest head decides: the others are below thr^2 whenever it is.
      if (std::fabs(token_ratio[i * bs + t] - thr2) <= 1e-4 * thr2) continue;
      ++compared;
      const bool want_bit = (want_masks[i] >> t) & 1u, got_bit = (got_masks[i] >> t) & 1u;
      outliers += got_bit;
      ASSERT_EQ(got_bit, want_bit) << "block " << i << " token " << t << ": largest ratio "
                                   << token_ratio[i * bs + t] << ", thr^2 " << thr2;
    }
  }
  EXPECT_GE(compared, batch * bs - 1) << "tokens at the threshold";
  EXPECT_GT(outliers, 0);

  DeviceBuffer<uint8_t> plain_pool = ToDevice(c.pool);
  ASSERT_TRUE(plain_pool.ok());
  p.pool = plain_pool.get();
  p.outlier_masks = nullptr;
  SUBSPACE_ASSERT_CUDA(LaunchCompressBlocks(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> plain;
  SUBSPACE_ASSERT_CUDA(plain_pool.Download(&plain));
  ASSERT_TRUE(plain == got) << "outlier detection changed the pool";
}

// Rank 7: the scalar path for P_q rows (float4 loads need r % 4 == 0); full rank at block 64
// and head_dim 128: the largest shared-memory footprint.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CompressBlocksOutlierGpuTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(1, 8, 33, 64),
                       ::testing::Values(7, 16, 0),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8)),
    OutlierShapeName);

TEST(CompressBlocksGpuLimitsTest, RejectsUnsupportedShapes) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  CompressBlocksParams p;
  p.n_blocks = 1;
  p.layout = MakeKvPoolLayout(2, 96, 16, 16, 16, CoeffDtype::kFp16);
  EXPECT_EQ(LaunchCompressBlocks(p, nullptr), cudaErrorInvalidValue);
  p.layout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp32);
  EXPECT_EQ(LaunchCompressBlocks(p, nullptr), cudaErrorInvalidValue);
  p.layout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp16);
  uint64_t* masks = reinterpret_cast<uint64_t*>(uintptr_t{4096});  // never dereferenced
  p.outlier_masks = masks;
  EXPECT_EQ(LaunchCompressBlocks(p, nullptr), cudaErrorInvalidValue)
      << "outlier masks without basis_pq";
  p.outlier_masks = nullptr;
  p.n_blocks = 0;
  EXPECT_EQ(LaunchCompressBlocks(p, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace subspace::kernels
