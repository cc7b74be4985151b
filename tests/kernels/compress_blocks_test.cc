// compress_blocks.cu against its CPU twin (CompressBlocksRef, itself checked against core's
// EncodeCoeffs and CompressedKvCache in compress_blocks_ref_test.cc) across head_dim x block
// size x batch (blocks) x rank x coefficient dtype. Fresh random inputs per case; destination
// pages poisoned before the launch, and every byte outside the written payloads must come back
// untouched.
//
// Tolerance: the kernel projects in float, the twin in double, then both encode identically;
// a code may round the other way. Per token row (testing::SlotMismatch): decoded coefficients
// within one fp16 unit of the row's largest (2e-3) or 1.5 int8 steps, int8 scales within one
// fp16 unit; and at most 1% of the codes differ at all.
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

TEST(CompressBlocksGpuLimitsTest, RejectsUnsupportedShapes) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  CompressBlocksParams p;
  p.n_blocks = 1;
  p.layout = MakeKvPoolLayout(2, 96, 16, 16, 16, CoeffDtype::kFp16);
  EXPECT_EQ(LaunchCompressBlocks(p, nullptr), cudaErrorInvalidValue);
  p.layout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp32);
  EXPECT_EQ(LaunchCompressBlocks(p, nullptr), cudaErrorInvalidValue);
  p.n_blocks = 0;
  p.layout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp16);
  EXPECT_EQ(LaunchCompressBlocks(p, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace subspace::kernels
