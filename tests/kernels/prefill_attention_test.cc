// prefill_attention.cu against its CPU twin (PrefillAttentionRef, itself checked against dense
// causal attention and the decode twin in prefill_attention_ref_test.cc) across head_dim x
// block size x batch x query rows per sequence x GQA group. Fresh random inputs per case
// (chunks after cached tokens, sequences with no rows, pages shuffled, unused pool bytes
// poisoned), output poisoned with NaN before every launch.
//
// Tolerance: max |kernel - twin| <= 2e-5 * max |v| over the case. The kernel reads the same
// fp16 rows the twin reads and differs by fp32 vs double arithmetic alone: q pre-scaled by
// sm_scale * log2 e, fp32 dot products over head_dim, exp2f, fp32 sums over up to a few hundred
// keys. A host emulation of the kernel's own source (one std::thread per CUDA thread; not in
// the tree, no GPU was available) and of its float operation order gave at most 1e-6 * max|v|
// for queries N(0, 2^2) (logits ~N(0, 4)), growing with the logits' spread (2e-6 at N(0, 4^2)).
// 2e-5 leaves room for the device's exp2f (2 ulp) and fma contraction while an fp16 rounding
// of q or of the weights (~5e-4 relative) or any indexing or masking error (O(1)) fails.
#include "kernels/prefill_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/kv_test_data.h"
#include "tests/kernels/prefill_attention_ref.h"

namespace subspace::kernels {
namespace {

using testing::DeviceBuffer;
using testing::PrefillCase;
using testing::PrefillSeqShape;
using testing::ToDevice;

constexpr double kTolerance = 2e-5;  // times max |v|
constexpr float kQSigma = 2.0f;

KvPoolLayout Layout(int n_kv, int hd, int bs) {
  return MakeKvPoolLayout(n_kv, hd, bs, 16, 16, CoeffDtype::kFp16);
}

PrefillAttentionParams Params(const PrefillCase& c) {
  PrefillAttentionParams p;
  p.layout = c.layout;
  p.num_seqs = c.num_seqs();
  p.max_blocks = c.max_blocks;
  p.max_q_per_seq = c.max_q_per_seq;
  p.n_heads = c.n_heads;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(c.layout.head_dim));
  return p;
}

// Runs the kernel on `c` with the grid sized for `max_q_per_seq` (the case's own when 0) and
// compares every output element with the twin; `scratch` (when not empty) holds the pages that
// c's negative table entries name.
void CheckAgainstTwin(const PrefillCase& c, int32_t max_q_per_seq = 0,
                      const std::vector<uint8_t>& scratch = {}, int32_t window = 0) {
  const int hd = c.layout.head_dim;
  std::vector<float> want(c.q.size(), std::nanf(""));
  PrefillAttentionParams host = Params(c);
  host.window = window;
  host.pool = c.pool.data();
  host.scratch = scratch.empty() ? nullptr : scratch.data();
  host.block_table = c.block_table.data();
  host.seq_q_indptr = c.q_indptr.data();
  host.seq_q_start = c.q_start.data();
  host.q = c.q.data();
  host.out = want.data();
  PrefillAttentionRef(host);

  DeviceBuffer<uint8_t> pool = ToDevice(c.pool);
  DeviceBuffer<uint8_t> scratch_d = scratch.empty() ? DeviceBuffer<uint8_t>() : ToDevice(scratch);
  DeviceBuffer<int32_t> table = ToDevice(c.block_table), indptr = ToDevice(c.q_indptr),
                        start = ToDevice(c.q_start);
  DeviceBuffer<float> q = ToDevice(c.q);
  DeviceBuffer<float> out(std::max<size_t>(c.q.size(), 1));
  ASSERT_TRUE(pool.ok() && scratch_d.ok() && table.ok() && indptr.ok() && start.ok() && q.ok() &&
              out.ok());
  SUBSPACE_ASSERT_CUDA(out.Poison());
  PrefillAttentionParams p = Params(c);
  p.window = window;
  p.pool = pool.get();
  p.scratch = scratch_d.get();  // null when empty
  p.block_table = table.get();
  p.seq_q_indptr = indptr.get();
  p.seq_q_start = start.get();
  p.q = q.get();
  p.out = out.get();
  if (max_q_per_seq > 0) p.max_q_per_seq = max_q_per_seq;
  SUBSPACE_ASSERT_CUDA(LaunchPrefillAttention(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> got;
  SUBSPACE_ASSERT_CUDA(out.Download(&got));
  got.resize(c.q.size());

  double v_max = 0.0;
  for (const auto& v : c.v) {
    for (uint16_t x : v) v_max = std::max(v_max, std::fabs(static_cast<double>(HalfToFloat(x))));
  }
  double worst = 0.0;
  size_t worst_at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i]))
        << "query row " << i / hd / c.n_heads << " head " << i / hd % c.n_heads << " element "
        << i % hd << " (never written, or read poison)";
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (err > worst) {
      worst = err;
      worst_at = i;
    }
  }
  EXPECT_LE(worst, kTolerance * v_max)
      << "max |v| " << v_max << "; worst at query row " << worst_at / hd / c.n_heads << " head "
      << worst_at / hd % c.n_heads << " element " << worst_at % hd << ": " << got[worst_at]
      << " vs " << want[worst_at];
}

// head_dim, block size, batch, query rows, group.
using Shape = std::tuple<int, int, int, int, int>;

// Appends rather than "d" + std::to_string(...): GCC 12 warns (-Wrestrict) on the latter.
std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  const auto& [hd, bs, batch, rows, group] = info.param;
  std::string name = "d";
  name += std::to_string(hd);
  name += "_b";
  name += std::to_string(bs);
  name += "_n";
  name += std::to_string(batch);
  name += "_q";
  name += std::to_string(rows);
  name += "_g";
  name += std::to_string(group);
  return name;
}

class PrefillAttentionGpuTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

// The first sequence is a whole prompt of `rows` rows (start 0); the others are chunks of up
// to `rows` rows (some none) after up to 150 cached tokens.
TEST_P(PrefillAttentionGpuTest, MatchesCpuTwin) {
  const auto [hd, bs, batch, rows, group] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  std::vector<PrefillSeqShape> shapes = {{0, rows}};
  for (int i = 1; i < batch; ++i) {
    shapes.push_back({std::uniform_int_distribution<int32_t>(0, 150)(rng),
                      std::uniform_int_distribution<int32_t>(0, rows)(rng)});
  }
  CheckAgainstTwin(testing::RandomPrefillCase(Layout(2, hd, bs), 2 * group, shapes, kQSigma, rng));
}

INSTANTIATE_TEST_SUITE_P(Shapes, PrefillAttentionGpuTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(1, 16, 64),
                                            ::testing::Values(1, 3, 8),
                                            ::testing::Values(1, 5, 64, 200),
                                            ::testing::Values(1, 2, 4)),
                         ShapeName);

// Off the sweep's grid: odd block sizes, MQA, a group that does not divide a 64-row tile, one
// larger than a tile, a long cached prefix, and grids sized too small (the kernel loops over
// row tiles) or too large (CTAs past a sequence's rows exit).
TEST(PrefillAttentionGpuShapesTest, OddGroupsBlockSizesAndGrids) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  struct Case {
    int n_kv, hd, bs, group;
    std::vector<PrefillSeqShape> shapes;
    int32_t max_q_per_seq;  // 0: the case's own
  };
  const Case cases[] = {
      {2, 64, 7, 3, {{10, 50}, {0, 22}, {0, 0}, {200, 9}}, 0},
      {1, 128, 33, 8, {{0, 130}, {64, 30}}, 0},
      {1, 64, 16, 80, {{0, 3}, {5, 2}}, 0},
      {2, 128, 64, 2, {{2000, 64}, {1999, 1}}, 0},
      {2, 128, 16, 2, {{129, 200}, {0, 1}}, 1},
      {1, 64, 1, 4, {{3, 40}, {0, 17}}, 120},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(::testing::Message() << "n_kv " << k.n_kv << " d " << k.hd << " B " << k.bs
                                      << " group " << k.group << " grid for " << k.max_q_per_seq);
    CheckAgainstTwin(testing::RandomPrefillCase(Layout(k.n_kv, k.hd, k.bs), k.n_kv * k.group,
                                                k.shapes, kQSigma, rng),
                     k.max_q_per_seq);
  }
}

// Some of each sequence's blocks read from scratch pages (negative table entries), the pool
// copies poisoned: the kernel must pick the buffer per block as the twin does.
TEST(PrefillAttentionGpuShapesTest, ScratchPages) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  struct Case {
    int n_kv, hd, bs, group;
    std::vector<PrefillSeqShape> shapes;
  };
  const Case cases[] = {
      {2, 64, 16, 2, {{0, 64}, {130, 70}, {64, 0}, {17, 5}}},
      {2, 128, 1, 4, {{0, 40}, {90, 3}}},
      {1, 128, 64, 8, {{0, 200}, {300, 64}, {5, 1}}},
      {2, 64, 7, 3, {{10, 50}, {0, 22}, {200, 9}}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "n_kv " << k.n_kv << " d " << k.hd << " B " << k.bs << " group " << k.group);
    PrefillCase c = testing::RandomPrefillCase(Layout(k.n_kv, k.hd, k.bs), k.n_kv * k.group,
                                               k.shapes, kQSigma, rng);
    const std::vector<uint8_t> scratch = testing::MovePagesToScratch(&c, rng);
    CheckAgainstTwin(c, /*max_q_per_seq=*/0, scratch);
  }
}

// Sliding windows: of one token, inside a block, across a 64-key tile and longer than every
// sequence; row tiles whose later rows' windows start past the first KV tile the CTA reads (a
// row with no key yet must not poison its sums), GQA groups that spread one position over
// several rows, and scratch pages.
TEST(PrefillAttentionGpuShapesTest, SlidingWindows) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  struct Case {
    int n_kv, hd, bs, group;
    std::vector<PrefillSeqShape> shapes;
  };
  const Case cases[] = {
      {2, 64, 16, 1, {{0, 200}, {130, 70}, {5, 1}}},
      {1, 128, 7, 4, {{0, 90}, {300, 64}}},
      {2, 64, 64, 2, {{0, 64}, {200, 150}, {63, 2}}},
  };
  for (const Case& k : cases) {
    for (int32_t window : {1, 5, 40, 64, 65, 130, 10000}) {
      SCOPED_TRACE(::testing::Message() << "n_kv " << k.n_kv << " d " << k.hd << " B " << k.bs
                                        << " group " << k.group << " window " << window);
      PrefillCase c = testing::RandomPrefillCase(Layout(k.n_kv, k.hd, k.bs), k.n_kv * k.group,
                                                 k.shapes, kQSigma, rng);
      std::vector<uint8_t> scratch;
      if (window == 40) scratch = testing::MovePagesToScratch(&c, rng);
      CheckAgainstTwin(c, /*max_q_per_seq=*/0, scratch, window);
    }
  }
}

// Validation happens before any CUDA call, so this runs without a device too.
TEST(PrefillAttentionGpuLimitsTest, RejectsUnsupportedParams) {
  alignas(16) static uint8_t pool[64];
  alignas(16) static float q[8], out[8];
  static const int32_t table[1] = {0}, indptr[2] = {0, 1}, start[1] = {0};
  const auto valid = [&] {
    PrefillAttentionParams p;
    p.layout = Layout(2, 64, 16);
    p.pool = pool;
    p.block_table = table;
    p.seq_q_indptr = indptr;
    p.seq_q_start = start;
    p.q = q;
    p.out = out;
    p.num_seqs = 1;
    p.max_blocks = 1;
    p.max_q_per_seq = 1;
    p.n_heads = 4;
    p.sm_scale = 0.125f;
    return p;
  };
  std::vector<std::pair<const char*, PrefillAttentionParams>> bad;
  const auto add = [&](const char* why, auto&& edit) {
    PrefillAttentionParams p = valid();
    edit(p);
    bad.emplace_back(why, p);
  };
  add("head_dim 96", [](auto& p) { p.layout = Layout(2, 96, 16); });
  add("head_dim 256", [](auto& p) { p.layout = Layout(2, 256, 16); });
  add("block size 0", [](auto& p) { p.layout.block_size = 0; });
  add("block size 65", [](auto& p) { p.layout = Layout(2, 64, 65); });
  add("n_kv 0", [](auto& p) { p.layout.n_kv_heads = 0; });
  add("pages too small", [](auto& p) { p.layout.page_bytes -= 16; });
  add("n_heads 3 over n_kv 2", [](auto& p) { p.n_heads = 3; });
  add("n_heads 0", [](auto& p) { p.n_heads = 0; });
  add("window -1", [](auto& p) { p.window = -1; });
  add("num_seqs 0", [](auto& p) { p.num_seqs = 0; });
  add("num_seqs 65536", [](auto& p) { p.num_seqs = 65536; });
  add("max_q_per_seq 0", [](auto& p) { p.max_q_per_seq = 0; });
  add("max_blocks 0", [](auto& p) { p.max_blocks = 0; });
  add("no pool", [](auto& p) { p.pool = nullptr; });
  add("no block table", [](auto& p) { p.block_table = nullptr; });
  add("no indptr", [](auto& p) { p.seq_q_indptr = nullptr; });
  add("no starts", [](auto& p) { p.seq_q_start = nullptr; });
  add("no q", [](auto& p) { p.q = nullptr; });
  add("no out", [](auto& p) { p.out = nullptr; });
  add("pool misaligned", [](auto& p) { p.pool += 8; });
  add("scratch misaligned", [](auto& p) { p.scratch = pool + 8; });
  add("q misaligned", [](auto& p) { p.q += 1; });
  add("out misaligned", [](auto& p) { p.out += 2; });
  for (const auto& [why, p] : bad) {
    EXPECT_EQ(LaunchPrefillAttention(p, nullptr), cudaErrorInvalidValue) << why;
  }
}

}  // namespace
}  // namespace subspace::kernels
