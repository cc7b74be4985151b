// expand_blocks.cu against its CPU twin (ExpandBlocksRef, itself checked against core's
// DecodeCoeffs, CompressedKvCache's Decompress and a compression round trip in
// expand_blocks_ref_test.cc) across head_dim x block size x rank x coefficient dtype, with
// destinations in the source pool (Truncate) and in a scratch pool (prefill), several epochs per
// batch. Fresh random inputs per case; destination pools poisoned before the launch, and every
// byte outside the destination pages must come back untouched.
//
// Tolerance: the kernel sums in float (fma, in the twin's order), the twin in double; both
// round once to fp16. Where the two sums straddle a rounding boundary they land one fp16 unit
// apart (<= 2^-10 relative), so |gpu - twin| <= 2e-3 * |twin| allows two units. Near zero,
// cancellation makes the float sum's error relative to the row, not the element: ~sqrt(r) 2^-24
// of the terms, ~1e-6 of the row's largest output; the floor 2e-3 * 1e-2 * max|row| = 2e-5 of
// it leaves an order of magnitude. Indexing, epoch or scale errors are O(1); NaN never passes.
#include "kernels/expand_blocks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/expand_blocks_ref.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

using testing::DeviceBuffer;
using testing::ExpandCase;
using testing::ToDevice;

constexpr double kRelTolerance = 2e-3;
constexpr double kRowFloor = 1e-2;

// "" or the first violation: outside the destination pages `got` equals `before` byte for
// byte; inside, every fp16 element is finite and within tolerance of the twin's (`want`).
std::string ExpansionMismatch(const KvPoolLayout& l, const std::vector<int32_t>& dst_page,
                              const std::vector<uint8_t>& before, const std::vector<uint8_t>& want,
                              const std::vector<uint8_t>& got) {
  const std::set<int32_t> named(dst_page.begin(), dst_page.end());
  for (size_t i = 0; i < got.size(); ++i) {
    const auto page = static_cast<int32_t>(static_cast<int64_t>(i) / l.page_bytes);
    if (named.count(page) == 0 && got[i] != before[i]) {
      return "byte " + std::to_string(i) + " of page " + std::to_string(page) + " was written";
    }
  }
  const int hd = l.head_dim;
  for (int32_t page : dst_page) {
    for (int64_t row = 0; row < 2 * l.Rows(); ++row) {  // [2][n_kv][B] rows of head_dim
      const int64_t at = l.Page(page) + 2 * row * hd;
      double amax = 0.0;
      for (int i = 0; i < hd; ++i)
        amax = std::max(amax, std::fabs(testing::PoolHalf(want, at + 2 * i)));
      for (int i = 0; i < hd; ++i) {
        const double w = testing::PoolHalf(want, at + 2 * i);
        const double g = testing::PoolHalf(got, at + 2 * i);
        if (!std::isfinite(g) ||
            std::fabs(g - w) > kRelTolerance * (std::fabs(w) + kRowFloor * amax)) {
          return "page " + std::to_string(page) + " row " + std::to_string(row) +
                 " (K then V, head-major) element " + std::to_string(i) + ": " + std::to_string(g) +
                 " vs " + std::to_string(w);
        }
      }
    }
  }
  return "";
}

// Draws a case, runs the twin and the kernel on it, compares.
void ExpectKernelMatchesTwin(const KvPoolLayout& l, int n_blocks, int n_epochs, bool one_pool,
                             std::mt19937_64& rng) {
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  const ExpandCase c = testing::RandomExpandCase(l, n_blocks, n_epochs, one_pool, rng);
  ExpandCase want = c;
  ExpandBlocksParams p = want.HostParams();
  ASSERT_TRUE(CheckExpandBatch(p, c.num_src_pages, c.num_dst_pages, n_epochs).ok());
  ExpandBlocksRef(p);

  DeviceBuffer<uint8_t> src = ToDevice(c.src_pool);
  DeviceBuffer<uint8_t> scratch = ToDevice(c.dst_pool);  // poisoned; empty with one_pool
  DeviceBuffer<float> pq = ToDevice(c.bases.p_q), rv = ToDevice(c.bases.r_v);
  DeviceBuffer<int32_t> src_page = ToDevice(c.src_page), src_slot = ToDevice(c.src_slot),
                        dst_page = ToDevice(c.dst_page), epoch = ToDevice(c.epoch);
  ASSERT_TRUE(src.ok() && scratch.ok() && pq.ok() && rv.ok() && src_page.ok() && src_slot.ok() &&
              dst_page.ok() && epoch.ok());
  p.src_pool = src.get();
  p.dst_pool = one_pool ? src.get() : scratch.get();
  p.basis_pq = pq.get();
  p.basis_rv = rv.get();
  p.src_page = src_page.get();
  p.src_slot = src_slot.get();
  p.dst_page = dst_page.get();
  p.epoch = epoch.get();
  SUBSPACE_ASSERT_CUDA(LaunchExpandBlocks(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got_src, got_dst;
  SUBSPACE_ASSERT_CUDA(src.Download(&got_src));
  if (one_pool) {
    ASSERT_EQ(ExpansionMismatch(l, c.dst_page, c.src_pool, want.src_pool, got_src), "");
  } else {
    SUBSPACE_ASSERT_CUDA(scratch.Download(&got_dst));
    ASSERT_EQ(ExpansionMismatch(l, c.dst_page, c.dst_pool, want.dst_pool, got_dst), "");
    ASSERT_EQ(got_src, c.src_pool) << "a scratch batch wrote the source pool";
  }
}

// head_dim, block size, rank (0: head_dim), coefficient dtype, destinations in the source pool.
using Shape = std::tuple<int, int, int, CoeffDtype, bool>;

// Not a lambda in the macro: a structured binding's commas would split the macro's arguments.
std::string ShapeName(const Shape& s) {
  const int rank = std::get<2>(s);
  return "d" + std::to_string(std::get<0>(s)) + "_b" + std::to_string(std::get<1>(s)) + "_r" +
         (rank == 0 ? std::string("full") : std::to_string(rank)) + "_" +
         CoeffDtypeName(std::get<3>(s)) + (std::get<4>(s) ? "_onepool" : "_scratch");
}

class ExpandBlocksGpuTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(ExpandBlocksGpuTest, MatchesCpuTwin) {
  const auto [hd, bs, rank_param, dt, one_pool] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const int rank = rank_param == 0 ? hd : rank_param;
  // r_v differs from r_k where int8 alignment allows (3 heads, odd B: r_k + r_v even).
  const int rank_v = rank == 16 ? 8 : rank;
  const KvPoolLayout l = MakeKvPoolLayout(3, hd, bs, rank, rank_v, dt);
  ExpectKernelMatchesTwin(l, /*n_blocks=*/7, /*n_epochs=*/3, one_pool, rng);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ExpandBlocksGpuTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(1, 16, 64),
                       ::testing::Values(1, 16, 0),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8), ::testing::Bool()),
    [](const ::testing::TestParamInfo<Shape>& info) { return ShapeName(info.param); });

// One rank at 1 and the other at head_dim, both ways: the key and value sides must each take
// their own rank, codes and scales. Block size 64 at full rank: the largest shared-memory
// footprint (32 KiB).
TEST(ExpandBlocksGpuLimitsTest, SkewedAndLargestRanks) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int hd : {64, 128}) {
    for (CoeffDtype dt : {CoeffDtype::kFp16, CoeffDtype::kInt8}) {
      SCOPED_TRACE(::testing::Message() << "d" << hd << " " << CoeffDtypeName(dt));
      ExpectKernelMatchesTwin(MakeKvPoolLayout(2, hd, 16, 1, hd, dt), 5, 2, false, rng);
      ExpectKernelMatchesTwin(MakeKvPoolLayout(2, hd, 16, hd, 1, dt), 5, 2, true, rng);
      ExpectKernelMatchesTwin(MakeKvPoolLayout(1, hd, 64, hd, hd, dt), 3, 2, false, rng);
    }
  }
}

TEST(ExpandBlocksGpuLimitsTest, RejectsUnsupportedShapes) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  ExpandBlocksParams p;
  p.n_blocks = 1;
  p.layout = MakeKvPoolLayout(2, 96, 16, 16, 16, CoeffDtype::kFp16);
  EXPECT_EQ(LaunchExpandBlocks(p, nullptr), cudaErrorInvalidValue);
  p.layout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp32);
  EXPECT_EQ(LaunchExpandBlocks(p, nullptr), cudaErrorInvalidValue);
  p.layout = MakeKvPoolLayout(2, 64, 65, 16, 16, CoeffDtype::kFp16);
  EXPECT_EQ(LaunchExpandBlocks(p, nullptr), cudaErrorInvalidValue);
  p.layout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp16);
  p.n_blocks = -1;
  EXPECT_EQ(LaunchExpandBlocks(p, nullptr), cudaErrorInvalidValue);
  p.n_blocks = 0;  // nothing to launch: null pointers are never read
  EXPECT_EQ(LaunchExpandBlocks(p, nullptr), cudaSuccess);
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace subspace::kernels
