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
#include "tests/kernels/transform_blocks_ref.h"

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
    const int64_t ws_floats = DecodeWorkspaceFloats(plan->HostView(), l, c.n_heads, false);
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

// Sliding windows (decode_plan_builder.h): rows before each sequence's window start masked in
// full, compressed and outlier pages, whole blocks before it skipped by the kernel.
TEST_P(DecodeAttentionGpuTest, SlidingWindowMatchesCpuTwin) {
  const auto [hd, bs, batch, rank, dt] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const KvPoolLayout l = MakeKvPoolLayout(2, hd, bs, rank, rank * 3 / 4, dt);
  testing::DecodeCaseOptions options;
  options.p_outlier = 0.2;
  testing::DecodeCase c = testing::RandomDecodeCase(l, batch, options, rng);
  for (cuda::DecodeSeqDesc& d : c.seqs) {
    d.window_start = std::uniform_int_distribution<int64_t>(0, d.length - 1)(rng);
  }
  c.seqs[0].window_start = c.seqs[0].length - 1;
  CheckAgainstTwin(c);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeAttentionGpuTest,
    ::testing::Combine(::testing::Values(64, 128), ::testing::Values(8, 16, 32),
                       ::testing::Values(1, 7, 32), ::testing::Values(8, 16, 32),
                       ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8)),
    [](const ::testing::TestParamInfo<Shape>& info) { return ShapeName(info.param); });

// Eight live epochs, a group of 8 query heads and rank 64: more than 48 KiB of shared memory a
// CTA, the opt-in path of the launcher. MQA (one KV head) on the side.
// Transform-coded blocks (transform_blocks.h) mixed with full ones in two sequences, keys coded
// before RoPE or as written, under the three partitions. The kernel reads coded rows in code
// space in float and the twin decodes them in double: the same sums in another order, so rows
// agree to float rounding (1e-4). Keys coded before RoPE are decoded by both, each rounding them
// once to fp16: an element may land one fp16 unit apart (2^-11 relative), which the softmax
// averages out to well under 2e-3 of a row. Indexing, position or table errors are O(1).
// head_dim, block size, keys before RoPE, a sliding window (masking a whole coded block of one
// sequence and part of one of the other's)
using TransformShape = std::tuple<int, int, bool, bool>;

class DecodeAttentionTransformGpuTest : public ::testing::TestWithParam<TransformShape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(DecodeAttentionTransformGpuTest, MatchesCpuTwin) {
  const auto [hd, bs, pre_rope, windowed] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  testing::TransformCase c = testing::RandomTransformCase({.n_kv = 2,
                                                           .head_dim = hd,
                                                           .block_size = bs,
                                                           .n_blocks = 6,
                                                           .bits = 2.5,
                                                           .pre_rope = pre_rope,
                                                           .halves = hd == 128},
                                                          rng);
  const KvPoolLayout& l = c.layout;
  // Sequence 0: full page 0, coded blocks 1 and 2, full page 3 (5 tokens); sequence 1: coded
  // blocks 4 and 5, then full page 0 again (3 tokens). Each coded at its place in its sequence.
  c.first_pos = {0, bs, 2 * bs, 3 * bs, 0, bs};
  testing::TransformCase coded = c;
  TransformCodeRef(coded.CodeParams());
  const auto desc = [&](std::vector<int> blocks, std::vector<bool> is_coded, int64_t length) {
    cuda::DecodeSeqDesc d;
    d.length = length;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const auto b = static_cast<size_t>(blocks[i]);
      d.pages.push_back(is_coded[i] ? c.slab_page[b] : c.full_page[b]);
      d.slots.push_back(is_coded[i] ? c.slot[b] : kFullBlock);
      d.epochs.insert(d.epochs.end(), 2, is_coded[i] ? 0 : -1);
    }
    return d;
  };
  std::vector<cuda::DecodeSeqDesc> seqs = {
      desc({0, 1, 2, 3}, {false, true, true, false}, 3 * bs + std::min(bs, 5)),
      desc({4, 5, 0}, {true, true, false}, 2 * bs + std::min(bs, 3))};
  if (windowed) {
    seqs[0].window_start = 2 * bs - 1;  // blocks 0 and most of coded block 1 masked
    seqs[1].window_start = bs / 2;      // half of coded block 4
  }
  constexpr int kHeads = 4;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q_host(static_cast<size_t>(2 * kHeads * hd));
  for (float& x : q_host) x = normal(rng);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(hd));

  std::vector<float> want(q_host.size(), std::nanf(""));
  {
    absl::StatusOr<cuda::DecodePlan> plan = cuda::BuildDecodePlan(l, c.num_pages, 1, seqs);
    ASSERT_TRUE(plan.ok()) << plan.status();
    DecodeAttentionParams p;
    p.layout = l;
    p.plan = plan->HostView();
    p.pool = coded.pool.data();
    p.q = q_host.data();
    p.out = want.data();
    p.n_heads = kHeads;
    p.sm_scale = sm_scale;
    p.transform = coded.HostTables();
    p.key_rope = coded.HostRope();
    DecodeAttentionRef(p);
  }
  DeviceBuffer<uint8_t> pool = ToDevice(coded.pool);
  DeviceBuffer<float> floats = ToDevice(c.tables.floats), cos_sin = ToDevice(c.cos_sin),
                      q = ToDevice(q_host);
  DeviceBuffer<int32_t> ints = ToDevice(c.tables.ints);
  DeviceBuffer<float> out(q_host.size());
  ASSERT_TRUE(pool.ok() && floats.ok() && cos_sin.ok() && q.ok() && ints.ok() && out.ok());
  const cuda::DecodePlanOptions partitions[] = {
      {}, {.blocks_per_split = 1}, {.target_ctas = 8 * MultiProcessors()}};
  for (const cuda::DecodePlanOptions& o : partitions) {
    SCOPED_TRACE(::testing::Message() << "blocks_per_split " << o.blocks_per_split);
    absl::StatusOr<cuda::DecodePlan> plan = cuda::BuildDecodePlan(l, c.num_pages, 1, seqs, o);
    ASSERT_TRUE(plan.ok()) << plan.status();
    DeviceBuffer<uint64_t> plan_d = ToDevice(plan->buffer);
    DeviceBuffer<float> workspace(
        static_cast<size_t>(DecodeWorkspaceFloats(plan->HostView(), l, kHeads, true)));
    ASSERT_TRUE(plan_d.ok() && workspace.ok());
    SUBSPACE_ASSERT_CUDA(workspace.Poison());
    SUBSPACE_ASSERT_CUDA(out.Poison());
    DecodeAttentionParams p;
    p.layout = l;
    p.plan = plan->DeviceView(plan_d.get());
    p.pool = pool.get();
    p.q = q.get();
    p.out = out.get();
    p.workspace = workspace.get();
    p.n_heads = kHeads;
    p.sm_scale = sm_scale;
    p.transform = {floats.get(), ints.get()};
    p.key_rope = coded.HostRope();
    if (pre_rope) p.key_rope.cos_sin = cos_sin.get();
    SUBSPACE_ASSERT_CUDA(LaunchDecodeAttention(p, nullptr));
    SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<float> got;
    SUBSPACE_ASSERT_CUDA(out.Download(&got));
    for (size_t row = 0; row < got.size() / hd; ++row) {
      EXPECT_LT(testing::RelError(got.data() + row * hd, want.data() + row * hd, hd),
                pre_rope ? 2e-3 : 1e-4)
          << "sequence " << row / kHeads << " head " << row % kHeads;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeAttentionTransformGpuTest,
    ::testing::Values(TransformShape{64, 16, false, false}, TransformShape{64, 16, true, false},
                      TransformShape{128, 64, true, false}, TransformShape{128, 7, false, false},
                      TransformShape{64, 16, true, true}, TransformShape{128, 7, false, true}));

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
