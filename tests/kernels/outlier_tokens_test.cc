// outlier_tokens.cu against its CPU twin (OutlierTokensRef, itself checked against offsets
// spelled out in outlier_tokens_ref_test.cc) across head_dim x block size x batch x one or two
// pools, both directions. A copy has no rounding: the whole pools must match byte for byte,
// destinations arriving poisoned, so a missed row, a row written twice or a byte written
// outside the rows shows up.
#include "kernels/outlier_tokens.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/kv_test_data.h"
#include "tests/kernels/outlier_tokens_ref.h"

namespace subspace::kernels {
namespace {

using testing::DeviceBuffer;
using testing::OutlierCase;
using testing::ToDevice;

// Runs `p` (host pointers into c's pools and tables) on the device from the pools' current
// bytes and downloads the results into *block_bytes and *outlier_bytes (equal with one pool).
void RunOnDevice(OutlierCase& c, OutlierTokensParams p, std::vector<uint8_t>* block_bytes,
                 std::vector<uint8_t>* outlier_bytes) {
  DeviceBuffer<uint8_t> outlier_pool = ToDevice(c.outlier_pool);
  DeviceBuffer<uint8_t> block_pool = c.same_pool ? DeviceBuffer<uint8_t>() : ToDevice(c.block_pool);
  std::vector<int32_t> pages(p.block_page, p.block_page + c.n_blocks());
  DeviceBuffer<int32_t> block_page = ToDevice(pages), first = ToDevice(c.first_slot),
                        outlier_page = ToDevice(c.outlier_page);
  DeviceBuffer<uint64_t> mask = ToDevice(c.mask);
  ASSERT_TRUE(outlier_pool.ok() && block_pool.ok() && block_page.ok() && first.ok() &&
              outlier_page.ok() && mask.ok());
  p.outlier_pool = outlier_pool.get();
  p.block_pool = c.same_pool ? outlier_pool.get() : block_pool.get();
  p.block_page = block_page.get();
  p.mask = mask.get();
  p.first_slot = first.get();
  p.outlier_page = outlier_page.get();
  SUBSPACE_ASSERT_CUDA(LaunchOutlierTokens(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  SUBSPACE_ASSERT_CUDA(outlier_pool.Download(outlier_bytes));
  if (c.same_pool) {
    *block_bytes = *outlier_bytes;
  } else {
    SUBSPACE_ASSERT_CUDA(block_pool.Download(block_bytes));
  }
}

// "" or the first byte where the pools differ.
std::string FirstDifference(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got) {
  if (want.size() != got.size()) return "sizes differ";
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] != got[i]) {
      return "byte " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs the twin's " +
             std::to_string(want[i]);
    }
  }
  return "";
}

// head_dim, block size, blocks, one pool.
using Shape = std::tuple<int, int, int, bool>;

std::string ShapeName(const Shape& s) {
  return "d" + std::to_string(std::get<0>(s)) + "_b" + std::to_string(std::get<1>(s)) + "_n" +
         std::to_string(std::get<2>(s)) + (std::get<3>(s) ? "_onepool" : "_twopools");
}

class OutlierTokensGpuTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(OutlierTokensGpuTest, MatchesCpuTwinBothWays) {
  const auto [hd, bs, n_blocks, same_pool] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const KvPoolLayout l = MakeKvPoolLayout(3, hd, bs, 8, 8, CoeffDtype::kFp16);
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  OutlierCase c = testing::RandomOutlierCase(l, n_blocks, same_pool, /*p_outlier=*/0.3, rng);

  // Into the (poisoned) outlier pages, from the case's bytes.
  std::vector<uint8_t> got_blocks, got_outliers;
  ASSERT_NO_FATAL_FAILURE(RunOnDevice(c, c.HostParams(OutlierMove::kToOutlierPages, c.block_page),
                                      &got_blocks, &got_outliers));
  const OutlierTokensParams to = c.HostParams(OutlierMove::kToOutlierPages, c.block_page);
  ASSERT_TRUE(CheckOutlierBatch(to, c.num_block_pages, c.num_outlier_pages, same_pool).ok());
  OutlierTokensRef(to);
  ASSERT_EQ(FirstDifference(c.outlier_pool, got_outliers), "") << "to the outlier pages";
  ASSERT_EQ(FirstDifference(c.block_bytes(), got_blocks), "") << "to the outlier pages";

  // Back into the (poisoned) spare pages, from the twin's outlier pages.
  ASSERT_NO_FATAL_FAILURE(RunOnDevice(c, c.HostParams(OutlierMove::kToBlockPages, c.spare_page),
                                      &got_blocks, &got_outliers));
  const OutlierTokensParams back = c.HostParams(OutlierMove::kToBlockPages, c.spare_page);
  ASSERT_TRUE(CheckOutlierBatch(back, c.num_block_pages, c.num_outlier_pages, same_pool).ok());
  OutlierTokensRef(back);
  ASSERT_EQ(FirstDifference(c.block_bytes(), got_blocks), "") << "back to the block pages";
  ASSERT_EQ(FirstDifference(c.outlier_pool, got_outliers), "") << "back to the block pages";
}

INSTANTIATE_TEST_SUITE_P(Shapes, OutlierTokensGpuTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(1, 16, 64),
                                            ::testing::Values(1, 9, 48), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return ShapeName(info.param);
                         });

TEST(OutlierTokensGpuLimitsTest, RejectsUnsupportedShapes) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  OutlierTokensParams p;
  p.n_blocks = 1;
  p.layout = MakeKvPoolLayout(2, 96, 16, 16, 16, CoeffDtype::kFp16);
  EXPECT_EQ(LaunchOutlierTokens(p, nullptr), cudaErrorInvalidValue) << "head_dim 96";
  p.layout = MakeKvPoolLayout(2, 64, 65, 16, 16, CoeffDtype::kFp16);
  EXPECT_EQ(LaunchOutlierTokens(p, nullptr), cudaErrorInvalidValue) << "block size 65";
  p.layout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp16);
  p.n_blocks = -1;
  EXPECT_EQ(LaunchOutlierTokens(p, nullptr), cudaErrorInvalidValue) << "negative n_blocks";
  p.n_blocks = 1;
  p.direction = static_cast<OutlierMove>(2);
  EXPECT_EQ(LaunchOutlierTokens(p, nullptr), cudaErrorInvalidValue) << "no such direction";
  p.direction = OutlierMove::kToOutlierPages;
  // Rejected before anything is dereferenced: the pointer is never read.
  p.block_pool = reinterpret_cast<uint8_t*>(uintptr_t{4096 + 8});
  EXPECT_EQ(LaunchOutlierTokens(p, nullptr), cudaErrorInvalidValue) << "pool not 16-byte aligned";
  p.block_pool = nullptr;
  p.n_blocks = 0;
  EXPECT_EQ(LaunchOutlierTokens(p, nullptr), cudaSuccess) << "an empty batch";
}

}  // namespace
}  // namespace subspace::kernels
