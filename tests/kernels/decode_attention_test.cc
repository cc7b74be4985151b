// decode_attention.cu against its CPU twin (DecodeAttentionRef, itself checked against dense
// attention and the CPU cache in decode_attention_ref_test.cc) across head_dim x block size x
// batch x rank x coefficient dtype, each case under three split-K partitions. Fresh random
// inputs per case, output and workspace poisoned with NaN before every launch.
//
// Tolerance: the kernel reads the same fp16 rows and codes the twin reads and differs only by
// float vs double arithmetic (expf, summation order): ~6e-7 relative per (sequence, head) row
// when this code ran on the host under a throwaway thread-per-CUDA-thread emulation (not in
// the tree; no GPU was available). 1e-4 leaves two orders of
// magnitude for the GPU's expf and fma while still catching a stray fp16 rounding (~5e-4);
// indexing or masking errors are O(1).
#include "kernels/decode_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/decode_plan_builder.h"
#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/decode_attention_ref.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

using testing::DeviceBuffer;
using testing::ToDevice;

constexpr double kTolerance = 1e-4;

int MultiProcessors() {
  const std::vector<CudaDeviceInfo> devices = ListCudaDevices();
  return devices.empty() ? 1 : devices.front().multiprocessors;
}

// Runs the kernels on `c` under each partition and compares with the twin.
void CheckAgainstTwin(const testing::DecodeCase& c) {
  const KvPoolLayout& l = c.layout;
  const int hd = l.head_dim;
  std::vector<float> want(c.q.size(), std::nanf(""));
  {
    absl::StatusOr<cuda::DecodePlan> plan =
        cuda::BuildDecodePlan(l, c.num_pages, c.bases.n_epochs, c.seqs);
    ASSERT_TRUE(plan.ok()) << plan.status();
    DecodeAttentionParams p;
    p.layout = l;
    p.plan = plan->HostView();
    p.pool = c.pool.data();
    p.basis_pq = c.bases.p_q.data();
    p.basis_rv = c.bases.r_v.data();
    p.q = c.q.data();
    p.out = want.data();
    p.n_heads = c.n_heads;
    p.sm_scale = 1.0f / std::sqrt(static_cast<float>(hd));
    DecodeAttentionRef(p);
  }
  DeviceBuffer<uint8_t> pool = ToDevice(c.pool);
  DeviceBuffer<float> pq = ToDevice(c.bases.p_q), rv = ToDevice(c.bases.r_v), q = ToDevice(c.q);
  DeviceBuffer<float> out(c.q.size());
  ASSERT_TRUE(pool.ok() && pq.ok() && rv.ok() && q.ok() && out.ok());

  const cuda::DecodePlanOptions partitions[] = {
      {},                                       // one work item per sequence
      {.blocks_per_split = 3},                  // many, with uneven tails
      {.target_ctas = 8 * MultiProcessors()}};  // what a server would ask for
  for (const cuda::DecodePlanOptions& o : partitions) {
    SCOPED_TRACE(::testing::Message()
                 << "blocks_per_split " << o.blocks_per_split << " target_ctas " << o.target_ctas);
    absl::StatusOr<cuda::DecodePlan> plan =
        cuda::BuildDecodePlan(l, c.num_pages, c.bases.n_epochs, c.seqs, o);
    ASSERT_TRUE(plan.ok()) << plan.status();
    DeviceBuffer<uint64_t> plan_d = ToDevice(plan->buffer);
    const int64_t ws_floats = DecodeWorkspaceFloats(plan->HostView(), l, c.n_heads);
    DeviceBuffer<float> workspace(static_cast<size_t>(ws_floats));
    ASSERT_TRUE(plan_d.ok() && workspace.ok());
    SUBSPACE_ASSERT_CUDA(workspace.Poison());
    SUBSPACE_ASSERT_CUDA(out.Poison());

    DecodeAttentionParams p;
    p.layout = l;
    p.plan = plan->DeviceView(plan_d.get());
    p.pool = pool.get();
    p.basis_pq = pq.get();
    p.basis_rv = rv.get();
    p.q = q.get();
    p.out = out.get();
    p.workspace = workspace.get();
    p.n_heads = c.n_heads;
    p.sm_scale = 1.0f / std::sqrt(static_cast<float>(hd));
    SUBSPACE_ASSERT_CUDA(LaunchDecodeAttention(p, nullptr));
    SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<float> got;
    SUBSPACE_ASSERT_CUDA(out.Download(&got));
    for (size_t row = 0; row < got.size() / hd; ++row) {
      for (int i = 0; i < hd; ++i) {
        ASSERT_TRUE(std::isfinite(got[row * hd + i])) << "row " << row << " element " << i;
      }
      EXPECT_LT(testing::RelError(got.data() + row * hd, want.data() + row * hd, hd), kTolerance)
          << "sequence " << row / c.n_heads << " head " << row % c.n_heads;
    }
  }
}

// head_dim, block size, batch, rank, coefficient dtype.
using Shape = std::tuple<int, int, int, int, CoeffDtype>;

// Not a lambda in the macro: a structured binding's commas would split the macro's arguments.
std::string ShapeName(const Shape& s) {
  return "d" + std::to_string(std::get<0>(s)) + "_b" + std::to_string(std::get<1>(s)) + "_n" +
         std::to_string(std::get<2>(s)) + "_r" + std::to_string(std::get<3>(s)) + "_" +
         CoeffDtypeName(std::get<4>(s));
}

class DecodeAttentionGpuTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(DecodeAttentionGpuTest, MatchesCpuTwin) {
  const auto [hd, bs, batch, rank, dt] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  // r_v != r_k so that a rank mix-up cannot pass.
  const KvPoolLayout l = MakeKvPoolLayout(2, hd, bs, rank, rank * 3 / 4, dt);
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  CheckAgainstTwin(testing::RandomDecodeCase(l, batch, {}, rng));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeAttentionGpuTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(8, 16, 32),
                       ::testing::Values(1, 7, 32), ::testing::Values(8, 16, 32),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8)),
    [](const ::testing::TestParamInfo<Shape>& info) { return ShapeName(info.param); });

// Eight live epochs, a group of 8 query heads and rank 64: more than 48 KiB of shared memory a
// CTA, the opt-in path of the launcher. MQA (one KV head) on the side.
TEST(DecodeAttentionGpuLimitsTest, ManyEpochsAndLargeGroups) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (CoeffDtype dt : {CoeffDtype::kFp16, CoeffDtype::kInt8}) {
    const KvPoolLayout l = MakeKvPoolLayout(1, 128, 16, 64, 64, dt);
    testing::DecodeCaseOptions o;
    o.n_kv_heads = 1;
    o.group = 8;
    o.n_epochs = kMaxSeqEpochs;
    o.min_seq_epochs = kMaxSeqEpochs;
    o.max_seq_epochs = kMaxSeqEpochs;
    o.max_blocks = 40;
    CheckAgainstTwin(testing::RandomDecodeCase(l, 5, o, rng));
  }
}

TEST(DecodeAttentionGpuLimitsTest, RejectsUnsupportedShapes) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  DecodeAttentionParams p;
  p.layout = MakeKvPoolLayout(2, 96, 16, 16, 16, CoeffDtype::kFp16);  // head_dim 96
  p.plan.num_seqs = 1;
  p.plan.num_work = 1;
  p.plan.n_kv_heads = 2;
  p.n_heads = 4;
  EXPECT_EQ(LaunchDecodeAttention(p, nullptr), cudaErrorInvalidValue);
  p.layout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp32);  // fp32 codes
  EXPECT_EQ(LaunchDecodeAttention(p, nullptr), cudaErrorInvalidValue);
  p.layout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp16);
  p.n_heads = 3;  // not a multiple of n_kv
  EXPECT_EQ(LaunchDecodeAttention(p, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace subspace::kernels
