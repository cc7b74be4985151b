// BuildDecodePlan: the split-K partition covers every block of a sequence exactly once, in
// order, a sliding window masks exactly the rows before it, and the builder rejects block
// tables the kernels would misread.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <random>
#include <vector>

#include "cuda/decode_plan_builder.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

const KvPoolLayout kLayout = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kInt8);

void ExpectPartitionCoversBlocks(const cuda::DecodePlan& plan) {
  const DecodePlanView v = plan.HostView();
  ASSERT_EQ(v.seq_block_indptr[0], 0);
  ASSERT_EQ(v.seq_work_indptr[0], 0);
  ASSERT_EQ(v.seq_block_indptr[v.num_seqs], v.num_blocks);
  ASSERT_EQ(v.seq_work_indptr[v.num_seqs], v.num_work);
  for (int s = 0; s < v.num_seqs; ++s) {
    int32_t next = v.seq_block_indptr[s];
    ASSERT_LT(v.seq_work_indptr[s], v.seq_work_indptr[s + 1]) << "sequence " << s << " has no work";
    for (int w = v.seq_work_indptr[s]; w < v.seq_work_indptr[s + 1]; ++w) {
      EXPECT_EQ(v.work_seq[w], s);
      EXPECT_EQ(v.work_block_begin[w], next);
      EXPECT_LT(v.work_block_begin[w], v.work_block_end[w]) << "empty work item " << w;
      EXPECT_LE(v.work_block_end[w] - v.work_block_begin[w], plan.layout.max_work_blocks);
      next = v.work_block_end[w];
    }
    EXPECT_EQ(next, v.seq_block_indptr[s + 1]);
    int64_t tokens = 0;
    for (int b = v.seq_block_indptr[s]; b < v.seq_block_indptr[s + 1]; ++b) {
      tokens += v.block_tokens[b] - std::popcount(v.block_masked[b]);
      for (int h = 0; h < v.n_kv_heads; ++h) {
        const int32_t e = v.block_epoch[static_cast<int64_t>(b) * v.n_kv_heads + h];
        if (v.IsFull(b)) {
          EXPECT_EQ(e, -1);
        } else {
          EXPECT_GE(e, 0);
          EXPECT_LT(e, v.SeqEpochs(s));
        }
      }
    }
    EXPECT_EQ(tokens, v.seq_len[s]) << "sequence " << s;
  }
}

TEST(DecodePlanTest, SplitsCoverEveryBlockOnceInOrder) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const testing::DecodeCase c = testing::RandomDecodeCase(kLayout, 9, {}, rng);
  for (cuda::DecodePlanOptions o :
       {cuda::DecodePlanOptions{}, cuda::DecodePlanOptions{.blocks_per_split = 1},
        cuda::DecodePlanOptions{.blocks_per_split = 5},
        cuda::DecodePlanOptions{.target_ctas = 264}}) {
    absl::StatusOr<cuda::DecodePlan> plan =
        cuda::BuildDecodePlan(kLayout, c.num_pages, 4, c.seqs, o);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectPartitionCoversBlocks(*plan);
    if (o.blocks_per_split == 0 && o.target_ctas == 0) {
      EXPECT_EQ(plan->layout.num_work, 9);
    }
    if (o.blocks_per_split > 0) {
      EXPECT_LE(plan->layout.max_work_blocks, o.blocks_per_split);
    }
    EXPECT_EQ(plan->layout.total_bytes % 16, 0);
  }
}

TEST(DecodePlanTest, AutomaticSplitsAimAtTheTargetAndKeepAMinimum) {
  std::vector<cuda::DecodeSeqDesc> seqs(2);
  for (cuda::DecodeSeqDesc& d : seqs) {
    d.length = 64 * 16;
    d.pages.assign(64, 0);
    d.slots.assign(64, kFullBlock);
    d.epochs.assign(128, -1);
  }
  // 128 blocks x 2 heads over 64 CTAs: 4 blocks a work item, 16 work items a sequence.
  absl::StatusOr<cuda::DecodePlan> plan =
      cuda::BuildDecodePlan(kLayout, 1, 0, seqs, {.target_ctas = 64});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->layout.num_work, 32);
  // A huge target still leaves at least 4 blocks a work item.
  plan = cuda::BuildDecodePlan(kLayout, 1, 0, seqs, {.target_ctas = 100000});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->layout.max_work_blocks, 4);
  // Already one CTA per sequence and head at the target: no split.
  plan = cuda::BuildDecodePlan(kLayout, 1, 0, seqs, {.target_ctas = 4});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->layout.num_work, 2);
}

// The CUDA backend sizes its plan buffer and split-K workspace once, from LayoutDecodePlan of
// the largest counts and MaxDecodeWork: every plan a step builds must fit them.
TEST(DecodePlanTest, PlansFitTheBoundsTheBackendSizesBuffersWith) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int batch : {1, 3, 9, 17}) {
    const testing::DecodeCase c = testing::RandomDecodeCase(kLayout, batch, {}, rng);
    int64_t blocks = 0, epochs = 0;
    for (const cuda::DecodeSeqDesc& d : c.seqs) {
      blocks += static_cast<int64_t>(d.pages.size() + d.outlier_pages.size());
    }
    for (int target : {0, 1, 8, 64, 264, 100000}) {
      const cuda::DecodePlanOptions o{.target_ctas = target};
      absl::StatusOr<cuda::DecodePlan> plan =
          cuda::BuildDecodePlan(kLayout, c.num_pages, 4, c.seqs, o);
      ASSERT_TRUE(plan.ok()) << plan.status();
      const int64_t max_work = cuda::MaxDecodeWork(batch, o);
      EXPECT_LE(plan->layout.num_work, max_work) << "batch " << batch << " target " << target;
      epochs = plan->layout.num_epochs;
      const DecodePlanLayout bound = cuda::LayoutDecodePlan(batch, blocks, batch * kMaxSeqEpochs,
                                                            max_work, kLayout.n_kv_heads);
      EXPECT_LE(plan->bytes(), bound.total_bytes);
      EXPECT_EQ(plan->bytes(), cuda::LayoutDecodePlan(batch, blocks, epochs, plan->layout.num_work,
                                                      kLayout.n_kv_heads)
                                   .total_bytes);
    }
  }
  EXPECT_EQ(cuda::MaxDecodeWork(4, {.blocks_per_split = 2}), -1);
}

TEST(DecodePlanTest, RejectsBadBlockTables) {
  // One full block then one compressed block of 16 tokens; slot 0 of page 1.
  cuda::DecodeSeqDesc good;
  good.length = 20;
  good.pages = {1, 0};
  good.slots = {0, kFullBlock};
  good.epochs = {0, 1, -1, -1};
  good.outlier_masks = {0b101, 0};
  good.outlier_pages = {2};
  good.n_outliers = 2;
  const auto build = [](const cuda::DecodeSeqDesc& d) {
    return cuda::BuildDecodePlan(kLayout, 3, 2, std::vector<cuda::DecodeSeqDesc>{d});
  };
  ASSERT_TRUE(build(good).ok()) << build(good).status();
  EXPECT_EQ(build(good)->layout.max_seq_epochs, 2);

  auto bad = good;
  bad.length = 0;
  EXPECT_FALSE(build(bad).ok());
  bad = good;
  bad.length = 40;  // needs three blocks
  EXPECT_FALSE(build(bad).ok());
  bad = good;
  bad.pages[0] = 3;  // past the pool
  EXPECT_FALSE(build(bad).ok());
  bad = good;
  bad.slots[0] = kLayout.SlotsPerPage();
  EXPECT_FALSE(build(bad).ok());
  bad = good;
  bad.epochs[1] = 2;  // past the basis table
  EXPECT_FALSE(build(bad).ok());
  bad = good;
  bad.epochs[2] = 0;  // an epoch on a full block
  EXPECT_FALSE(build(bad).ok());
  bad = good;
  bad.outlier_masks[1] = 1;  // a mask on a full block
  EXPECT_FALSE(build(bad).ok());
  bad = good;
  bad.outlier_masks = {0b10000000000000000, 0};  // past the block's 16 tokens
  EXPECT_FALSE(build(bad).ok());
  bad = good;
  bad.n_outliers = 1;  // masks say 2
  EXPECT_FALSE(build(bad).ok());
  bad = good;
  bad.outlier_pages = {};
  EXPECT_FALSE(build(bad).ok());
  EXPECT_TRUE(cuda::BuildDecodePlan(kLayout, 3, 2, std::vector<cuda::DecodeSeqDesc>{}).ok());
}

// A sliding window masks every row before its start, in the blocks and in the outlier pages
// (outliers are in position order), and drops no block; seq_len counts what is left.
TEST(DecodePlanTest, WindowMasksEveryRowBeforeItsStart) {
  // A compressed block (outliers at tokens 0 and 2) then a full block of 4 tokens.
  cuda::DecodeSeqDesc d;
  d.length = 20;
  d.pages = {1, 0};
  d.slots = {0, kFullBlock};
  d.epochs = {0, 1, -1, -1};
  d.outlier_masks = {0b101, 0};
  d.outlier_pages = {2};
  d.n_outliers = 2;
  const auto leading = [](int n) { return n <= 0 ? uint64_t{0} : (uint64_t{1} << n) - 1; };
  for (int start : {0, 1, 2, 3, 15, 16, 17, 19}) {
    SCOPED_TRACE(::testing::Message() << "window start " << start);
    d.window_start = start;
    absl::StatusOr<cuda::DecodePlan> plan =
        cuda::BuildDecodePlan(kLayout, 3, 2, std::vector<cuda::DecodeSeqDesc>{d});
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectPartitionCoversBlocks(*plan);
    const DecodePlanView v = plan->HostView();
    ASSERT_EQ(v.num_blocks, 3);
    EXPECT_EQ(v.seq_len[0], 20 - start);
    EXPECT_EQ(v.block_masked[0], 0b101 | leading(std::min(start, 16)));
    EXPECT_EQ(v.block_masked[1], leading(start - 16));
    const int outliers_before = (start > 0) + (start > 2);
    EXPECT_EQ(v.block_masked[2], leading(outliers_before)) << "the outlier page";
  }
  for (int64_t start : {int64_t{-1}, int64_t{20}, int64_t{21}}) {
    d.window_start = start;
    EXPECT_FALSE(cuda::BuildDecodePlan(kLayout, 3, 2, std::vector<cuda::DecodeSeqDesc>{d}).ok())
        << "window start " << start;
  }
}

TEST(DecodePlanTest, RandomWindowsKeepThePartitionAndTheTokenCount) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  testing::DecodeCase c = testing::RandomDecodeCase(kLayout, 9, {}, rng);
  for (cuda::DecodeSeqDesc& d : c.seqs) {
    d.window_start = std::uniform_int_distribution<int64_t>(0, d.length - 1)(rng);
  }
  for (cuda::DecodePlanOptions o :
       {cuda::DecodePlanOptions{}, cuda::DecodePlanOptions{.blocks_per_split = 1}}) {
    absl::StatusOr<cuda::DecodePlan> plan =
        cuda::BuildDecodePlan(kLayout, c.num_pages, 4, c.seqs, o);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectPartitionCoversBlocks(*plan);
    for (size_t s = 0; s < c.seqs.size(); ++s) {
      EXPECT_EQ(plan->HostView().seq_len[s], c.seqs[s].length - c.seqs[s].window_start);
    }
  }
}

TEST(DecodePlanTest, RejectsMoreEpochsThanACtaHolds) {
  const KvPoolLayout l = MakeKvPoolLayout(1, 64, 16, 8, 8, CoeffDtype::kFp16);
  cuda::DecodeSeqDesc d;
  const int nb = kMaxSeqEpochs + 1;
  d.length = nb * 16;
  for (int b = 0; b < nb; ++b) {
    d.pages.push_back(b / 4);
    d.slots.push_back(b % 4);
    d.epochs.push_back(b);
  }
  EXPECT_FALSE(cuda::BuildDecodePlan(l, 3, nb, std::vector<cuda::DecodeSeqDesc>{d}).ok());
  d.epochs.back() = 0;
  EXPECT_TRUE(cuda::BuildDecodePlan(l, 3, nb, std::vector<cuda::DecodeSeqDesc>{d}).ok());
}

}  // namespace
}  // namespace subspace::kernels
