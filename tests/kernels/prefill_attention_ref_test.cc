// The CPU twin of prefill_attention.cu, checked so that the reference the GPU kernel is held to
// is itself verified on any machine: against dense double-precision causal attention over the
// keys and values as drawn (the twin finds them through the block table and the pool pages;
// the dense reference never looks at the pool), and against the decode twin for single-query
// sequences (a prefill row at position p is a decode step over p + 1 tokens).
#include "tests/kernels/prefill_attention_ref.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/decode_plan_builder.h"
#include "tests/kernels/decode_attention_ref.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

using testing::PrefillCase;
using testing::PrefillSeqShape;
using testing::RelError;

PrefillAttentionParams HostParams(const PrefillCase& c, float* out) {
  PrefillAttentionParams p;
  p.layout = c.layout;
  p.pool = c.pool.data();
  p.block_table = c.block_table.data();
  p.seq_q_indptr = c.q_indptr.data();
  p.seq_q_start = c.q_start.data();
  p.q = c.q.data();
  p.out = out;
  p.num_seqs = c.num_seqs();
  p.max_blocks = c.max_blocks;
  p.max_q_per_seq = c.max_q_per_seq;
  p.n_heads = c.n_heads;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(c.layout.head_dim));
  return p;
}

// Full pages only; ranks are irrelevant to prefill but make the layout a valid one.
KvPoolLayout Layout(int n_kv, int hd, int bs) {
  return MakeKvPoolLayout(n_kv, hd, bs, 16, 16, CoeffDtype::kFp16);
}

// head_dim, block size, group (query heads per KV head).
using Shape = std::tuple<int, int, int>;

// Appends rather than "d" + std::to_string(...): GCC 12 warns (-Wrestrict) on the latter.
std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  std::string name = "d";
  name += std::to_string(std::get<0>(info.param));
  name += "_b";
  name += std::to_string(std::get<1>(info.param));
  name += "_g";
  name += std::to_string(std::get<2>(info.param));
  return name;
}

class PrefillAttentionRefTest : public ::testing::TestWithParam<Shape> {};

TEST_P(PrefillAttentionRefTest, MatchesDenseCausalAttention) {
  const auto [hd, bs, group] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const KvPoolLayout l = Layout(2, hd, bs);
  // Whole prompts (start 0), chunks after cached tokens at and off block boundaries, a single
  // decode-like row, a sequence with no query rows this step, and a random one.
  std::vector<PrefillSeqShape> shapes = {{0, 37}, {5, 1},           {130, 70},
                                         {64, 0}, {bs, 2 * bs + 3}, {0, 1}};
  shapes.push_back({std::uniform_int_distribution<int32_t>(0, 150)(rng),
                    std::uniform_int_distribution<int32_t>(1, 80)(rng)});
  const PrefillCase c = testing::RandomPrefillCase(l, 2 * group, shapes, /*q_sigma=*/2.0f, rng);

  std::vector<float> out(c.q.size(), std::nanf(""));
  const PrefillAttentionParams p = HostParams(c, out.data());
  PrefillAttentionRef(p);
  const std::vector<double> dense = testing::DensePrefillAttention(c, p.sm_scale);
  // Both in double over the same fp16 values; the twin rounds its output to float once.
  for (size_t row = 0; row < out.size() / hd; ++row) {
    EXPECT_LT(RelError(out.data() + row * hd, dense.data() + row * hd, hd), 1e-6)
        << "query row " << row / c.n_heads << " head " << row % c.n_heads;
  }
}

// With a sliding window each row attends (p - window, p] only: windows of one token, shorter
// than a block, across blocks, and longer than any sequence (no masking at all).
TEST_P(PrefillAttentionRefTest, SlidingWindowMatchesDenseWindowedAttention) {
  const auto [hd, bs, group] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const std::vector<PrefillSeqShape> shapes = {{0, 37}, {5, 1}, {130, 70}, {bs, 2 * bs + 3}};
  const PrefillCase c =
      testing::RandomPrefillCase(Layout(2, hd, bs), 2 * group, shapes, /*q_sigma=*/2.0f, rng);
  for (int window : {1, 13, 64, 1000}) {
    SCOPED_TRACE(::testing::Message() << "window " << window);
    std::vector<float> out(c.q.size(), std::nanf(""));
    PrefillAttentionParams p = HostParams(c, out.data());
    p.window = window;
    PrefillAttentionRef(p);
    const std::vector<double> dense = testing::DensePrefillAttention(c, p.sm_scale, window);
    for (size_t row = 0; row < out.size() / hd; ++row) {
      ASSERT_LT(RelError(out.data() + row * hd, dense.data() + row * hd, hd), 1e-6)
          << "query row " << row / c.n_heads << " head " << row % c.n_heads;
    }
  }
}

// Blocks read from scratch pages (negative table entries) give the same bits as the same
// blocks in the pool: the pool copies are poisoned, so reading the pool for them gives NaN.
TEST_P(PrefillAttentionRefTest, ScratchPagesMatchPoolPages) {
  const auto [hd, bs, group] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  std::vector<PrefillSeqShape> shapes = {{0, 37}, {130, 70}, {bs, 2 * bs + 3}, {64, 0}};
  shapes.push_back({std::uniform_int_distribution<int32_t>(0, 150)(rng),
                    std::uniform_int_distribution<int32_t>(1, 80)(rng)});
  PrefillCase c = testing::RandomPrefillCase(Layout(2, hd, bs), 2 * group, shapes,
                                             /*q_sigma=*/2.0f, rng);
  std::vector<float> want(c.q.size(), std::nanf(""));
  PrefillAttentionRef(HostParams(c, want.data()));

  const std::vector<uint8_t> scratch = testing::MovePagesToScratch(&c, rng);
  std::vector<float> got(c.q.size(), std::nanf(""));
  PrefillAttentionParams p = HostParams(c, got.data());
  p.scratch = scratch.data();
  PrefillAttentionRef(p);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << "element " << i << " read a poisoned page";
    uint32_t got_bits, want_bits;
    std::memcpy(&got_bits, &got[i], sizeof(got_bits));
    std::memcpy(&want_bits, &want[i], sizeof(want_bits));
    ASSERT_EQ(got_bits, want_bits) << "query row " << i / hd / c.n_heads << " head "
                                   << i / hd % c.n_heads << " element " << i % hd;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PrefillAttentionRefTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(1, 16, 64),
                                            ::testing::Values(1, 2, 4)),
                         ShapeName);

void CheckSingleRowsAgainstDecodeTwin(const Shape& shape, int window);

// A sequence whose only query row sits at position p (start p, one row) is a decode step over
// p + 1 full blocks' tokens: the decode twin on the same pages must agree, also with a sliding
// window (the prefill twin masks per row, the decode plan masks the rows before window_start).
TEST_P(PrefillAttentionRefTest, SingleRowsMatchDecodeTwin) {
  for (int window : {0, 1, 7, 40}) {
    SCOPED_TRACE(::testing::Message() << "window " << window);
    CheckSingleRowsAgainstDecodeTwin(GetParam(), window);
  }
}

void CheckSingleRowsAgainstDecodeTwin(const Shape& shape, int window) {
  const auto [hd, bs, group] = shape;
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const KvPoolLayout l = Layout(2, hd, bs);
  std::vector<PrefillSeqShape> shapes = {{0, 1}, {bs - 1, 1}, {bs, 1}, {3 * bs + 1, 1}};
  for (int i = 0; i < 3; ++i) {
    shapes.push_back({std::uniform_int_distribution<int32_t>(0, 200)(rng), 1});
  }
  const PrefillCase c = testing::RandomPrefillCase(l, 2 * group, shapes, /*q_sigma=*/2.0f, rng);
  std::vector<float> out(c.q.size(), std::nanf(""));
  PrefillAttentionParams p = HostParams(c, out.data());
  p.window = window;
  PrefillAttentionRef(p);

  // The decode plan masks the rows before the window (decode_plan_builder.h).
  std::vector<cuda::DecodeSeqDesc> seqs;
  for (int32_t s = 0; s < c.num_seqs(); ++s) {
    cuda::DecodeSeqDesc d;
    d.length = c.q_start[s] + 1;
    d.window_start = window > 0 ? std::max<int64_t>(0, d.length - window) : 0;
    const int64_t nb = (d.length + bs - 1) / bs;
    d.pages.assign(c.block_table.begin() + static_cast<int64_t>(s) * c.max_blocks,
                   c.block_table.begin() + static_cast<int64_t>(s) * c.max_blocks + nb);
    d.slots.assign(static_cast<size_t>(nb), kFullBlock);
    d.epochs.assign(static_cast<size_t>(nb) * l.n_kv_heads, -1);
    seqs.push_back(std::move(d));
  }
  absl::StatusOr<cuda::DecodePlan> plan =
      cuda::BuildDecodePlan(l, c.num_pages, /*num_basis_epochs=*/1, seqs);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<float> want(c.q.size(), std::nanf(""));
  DecodeAttentionParams dp;
  dp.layout = l;
  dp.plan = plan->HostView();
  dp.pool = c.pool.data();
  dp.q = c.q.data();  // one row per sequence: [num_seqs, n_heads, d] either way
  dp.out = want.data();
  dp.n_heads = c.n_heads;
  dp.sm_scale = p.sm_scale;
  DecodeAttentionRef(dp);
  for (size_t row = 0; row < out.size() / hd; ++row) {
    EXPECT_LT(RelError(out.data() + row * hd, want.data() + row * hd, hd), 1e-6)
        << "sequence " << row / c.n_heads << " head " << row % c.n_heads;
  }
}

// Rows nobody asks for are not written, and the twin reads no row past a sequence's last
// query position: the case's pool is poisoned there, so reading it would give NaN.
TEST(PrefillAttentionRefLimitsTest, WritesOnlyQueryRowsAndReadsOnlyCachedTokens) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const KvPoolLayout l = Layout(1, 64, 16);
  const PrefillCase c =
      testing::RandomPrefillCase(l, 3, {{0, 0}, {9, 4}, {0, 0}, {16, 16}}, 1.0f, rng);
  std::vector<float> out(c.q.size() + 64, -7.0f);  // a guard row after the last
  PrefillAttentionRef(HostParams(c, out.data()));
  for (size_t i = 0; i < c.q.size(); ++i) ASSERT_TRUE(std::isfinite(out[i])) << i;
  for (size_t i = c.q.size(); i < out.size(); ++i) EXPECT_EQ(out[i], -7.0f);
}

}  // namespace
}  // namespace subspace::kernels
