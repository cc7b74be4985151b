// recode_blocks.cu against its CPU twin (RecodeBlocksRef, itself checked against the compactor's
// r x r maps in recode_blocks_ref_test.cc) across head_dim x block size x batch x rank x
// coefficient dtype, fresh random slots, bases and epochs per case. The kernel re-codes in place:
// every byte outside the re-coded payloads must come back untouched. Tolerance as
// compress_blocks_test.cc's (testing::SlotMismatch, and at most 1% of the codes differ at all):
// the kernel sums in float, the twin in double.
#include "kernels/recode_blocks.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/kv_test_data.h"
#include "tests/kernels/recode_blocks_ref.h"

namespace subspace::kernels {
namespace {

using testing::DeviceBuffer;
using testing::ToDevice;

void ExpectKernelMatchesTwin(const KvPoolLayout& l, int n_blocks, int n_epochs,
                             std::mt19937_64& rng) {
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  const testing::RecodeCase rc = testing::RandomRecodeCase(l, n_blocks, n_epochs, rng);
  const testing::ExpandCase& c = rc.coded;
  const std::vector<int32_t>& to = rc.to;
  std::vector<uint8_t> want = c.src_pool;
  RecodeBlocksParams p = rc.HostParams(want);
  ASSERT_TRUE(CheckRecodeBatch(p, c.num_src_pages, c.bases.n_epochs).ok());
  RecodeBlocksRef(p);

  DeviceBuffer<uint8_t> pool = ToDevice(c.src_pool);
  DeviceBuffer<float> pq = ToDevice(c.bases.p_q), rv = ToDevice(c.bases.r_v),
                      pk = ToDevice(c.bases.p_k), pv = ToDevice(c.bases.p_v);
  DeviceBuffer<int32_t> page = ToDevice(c.src_page), slot = ToDevice(c.src_slot),
                        from = ToDevice(c.epoch), to_d = ToDevice(to);
  ASSERT_TRUE(pool.ok() && pq.ok() && rv.ok() && pk.ok() && pv.ok() && page.ok() && slot.ok() &&
              from.ok() && to_d.ok());
  p.pool = pool.get();
  p.basis_pq = pq.get();
  p.basis_rv = rv.get();
  p.basis_pk = pk.get();
  p.basis_pv = pv.get();
  p.page = page.get();
  p.slot = slot.get();
  p.from_epoch = from.get();
  p.to_epoch = to_d.get();
  SUBSPACE_ASSERT_CUDA(LaunchRecodeBlocks(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got;
  SUBSPACE_ASSERT_CUDA(pool.Download(&got));

  std::vector<bool> payload(got.size(), false);
  int64_t codes = 0, differ = 0;
  for (int i = 0; i < n_blocks; ++i) {
    const int64_t at = l.Slot(c.src_page[i], c.src_slot[i]);
    std::fill(payload.begin() + at, payload.begin() + at + l.CompressedBytes(), true);
    const std::string mismatch =
        testing::SlotMismatch(l, want.data() + at, got.data() + at, &codes, &differ);
    ASSERT_EQ(mismatch, "") << "block " << i;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (!payload[i]) {
      ASSERT_EQ(got[i], c.src_pool[i]) << "byte " << i << " written outside a slot";
    }
  }
  EXPECT_LE(differ, codes / 100) << differ << " of " << codes << " codes differ from the twin";
}

// head_dim, block size, batch (blocks), rank, coefficient dtype.
using Shape = std::tuple<int, int, int, int, CoeffDtype>;

std::string ShapeName(const Shape& s) {
  return "d" + std::to_string(std::get<0>(s)) + "_b" + std::to_string(std::get<1>(s)) + "_n" +
         std::to_string(std::get<2>(s)) + "_r" + std::to_string(std::get<3>(s)) + "_" +
         CoeffDtypeName(std::get<4>(s));
}

class RecodeBlocksGpuTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(RecodeBlocksGpuTest, MatchesCpuTwin) {
  const auto [hd, bs, batch, rank, dt] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  ExpectKernelMatchesTwin(MakeKvPoolLayout(3, hd, bs, rank, rank * 3 / 4, dt), batch, 3, rng);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RecodeBlocksGpuTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(8, 16, 32),
                       ::testing::Values(1, 7, 32), ::testing::Values(8, 16, 32),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8)),
    [](const ::testing::TestParamInfo<Shape>& info) { return ShapeName(info.param); });

// Skewed ranks, and block size 64 at head_dim 128 and full rank: the kernel's largest
// shared-memory footprint (64 KiB, past the default 48 KiB: the opt-in path).
TEST(RecodeBlocksGpuLimitsTest, SkewedAndLargestShapes) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  for (const CoeffDtype dt : {CoeffDtype::kFp16, CoeffDtype::kInt8}) {
    for (const int hd : {64, 128}) {
      ExpectKernelMatchesTwin(MakeKvPoolLayout(2, hd, 16, 1, hd, dt), 5, 2, rng);
      ExpectKernelMatchesTwin(MakeKvPoolLayout(2, hd, 16, hd, 1, dt), 5, 2, rng);
      ExpectKernelMatchesTwin(MakeKvPoolLayout(1, hd, 64, hd, hd, dt), 3, 2, rng);
    }
  }
}

TEST(RecodeBlocksGpuLimitsTest, RejectsUnsupportedShapes) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  RecodeBlocksParams p;
  p.layout = MakeKvPoolLayout(2, 96, 16, 8, 8, CoeffDtype::kFp16);  // head_dim 96
  p.n_blocks = 1;
  EXPECT_EQ(LaunchRecodeBlocks(p, nullptr), cudaErrorInvalidValue);
  p.layout = MakeKvPoolLayout(2, 64, 16, 8, 8, CoeffDtype::kFp32);
  EXPECT_EQ(LaunchRecodeBlocks(p, nullptr), cudaErrorInvalidValue);
  p.layout = MakeKvPoolLayout(2, 64, 16, 8, 8, CoeffDtype::kFp16);
  p.n_blocks = -1;
  EXPECT_EQ(LaunchRecodeBlocks(p, nullptr), cudaErrorInvalidValue);
  p.n_blocks = 0;  // nothing to launch
  EXPECT_EQ(LaunchRecodeBlocks(p, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace subspace::kernels
