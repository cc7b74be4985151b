// The step planner's query readback for KQ-SVD refresh: PlanQueryRows shares a short readback
// max-min fairly and keeps an even, weighted subset of a long chunk; StepPlanner asks the device
// cache which sequences want their queries and writes their activation rows into the metadata.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "cuda/cuda_step_plan.h"
#include "cuda/device_compressed_kv_cache.h"
#include "cuda/device_paged_kv_cache.h"
#include "tests/cuda/device_compressed_kv_cache_test_util.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::cuda {
namespace {

std::vector<int32_t> Rows(std::span<const QueryChunk> chunks, int64_t capacity,
                          std::vector<QuerySpan>* spans) {
  std::vector<int32_t> rows(static_cast<size_t>(std::max<int64_t>(capacity, 0)), -7);
  const int64_t used = PlanQueryRows(chunks, capacity, rows.data(), spans);
  EXPECT_LE(used, std::max<int64_t>(capacity, 0));
  for (size_t i = static_cast<size_t>(used); i < rows.size(); ++i) {
    EXPECT_EQ(rows[i], -7) << "row " << i << " written past the rows used";
  }
  rows.resize(static_cast<size_t>(used));
  return rows;
}

TEST(PlanQueryRowsTest, EveryRowWhenTheyFit) {
  const std::vector<QueryChunk> chunks = {{.seq = 3, .first_row = 0, .n = 1},
                                          {.seq = 5, .first_row = 4, .n = 4}};
  std::vector<QuerySpan> spans;
  EXPECT_EQ(Rows(chunks, 8, &spans), (std::vector<int32_t>{0, 4, 5, 6, 7}));
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].seq, 3);
  EXPECT_EQ(spans[0].first, 0);
  EXPECT_EQ(spans[0].n, 1);
  EXPECT_EQ(spans[0].weight, 1.0);
  EXPECT_EQ(spans[1].seq, 5);
  EXPECT_EQ(spans[1].first, 1);
  EXPECT_EQ(spans[1].n, 4);
  EXPECT_EQ(spans[1].weight, 1.0);
}

// Demand 1 + 1 + 100 + 30 for 20 rows: the decodes keep theirs, the two long chunks split the
// other 18 evenly and each kept row stands for n / kept queries.
TEST(PlanQueryRowsTest, AShortReadbackIsSharedFairlyAndWeighted) {
  const std::vector<QueryChunk> chunks = {{.seq = 0, .first_row = 0, .n = 1},
                                          {.seq = 1, .first_row = 1, .n = 1},
                                          {.seq = 2, .first_row = 2, .n = 100},
                                          {.seq = 3, .first_row = 102, .n = 30}};
  std::vector<QuerySpan> spans;
  const std::vector<int32_t> rows = Rows(chunks, 20, &spans);
  ASSERT_EQ(rows.size(), 20u);
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_EQ(spans[0].n, 1);
  EXPECT_EQ(spans[1].n, 1);
  EXPECT_EQ(spans[2].n, 9);
  EXPECT_EQ(spans[3].n, 9);
  EXPECT_DOUBLE_EQ(spans[2].weight, 100.0 / 9.0);
  EXPECT_DOUBLE_EQ(spans[3].weight, 30.0 / 9.0);
  // The 100-row chunk: the middles of nine equal slices.
  for (int64_t j = 0; j < 9; ++j) {
    EXPECT_EQ(rows[static_cast<size_t>(spans[2].first + j)], 2 + (2 * j + 1) * 100 / 18);
  }
}

TEST(PlanQueryRowsTest, MoreChunksThanRowsLeavesTheLastWithout) {
  std::vector<QueryChunk> chunks;
  for (int i = 0; i < 5; ++i) chunks.push_back({.seq = i, .first_row = i, .n = 1});
  std::vector<QuerySpan> spans;
  EXPECT_EQ(Rows(chunks, 3, &spans).size(), 3u);
  EXPECT_EQ(spans.size(), 3u);
  EXPECT_TRUE(Rows(chunks, 0, &spans).empty());
  EXPECT_TRUE(spans.empty());
  EXPECT_TRUE(Rows({}, 8, &spans).empty());
  EXPECT_TRUE(spans.empty());
}

// Random demands: the readback is used up to min(capacity, demand); every chunk's rows lie in
// its range, ascending and distinct, weight x kept = n; and shares are max-min fair (a chunk cut
// short has at least the largest share, less one for rounding).
TEST(PlanQueryRowsTest, RandomDemandsKeepTheInvariants) {
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<QueryChunk> chunks;
    int64_t row = 0, demand = 0;
    const int n_chunks = static_cast<int>(rng() % 9);
    for (int i = 0; i < n_chunks; ++i) {
      const int64_t n = rng() % 3 == 0 ? 1 : 1 + static_cast<int64_t>(rng() % 300);
      chunks.push_back({.seq = i, .first_row = row, .n = n});
      row += n;
      demand += n;
    }
    const int64_t capacity = static_cast<int64_t>(rng() % 200);
    std::vector<QuerySpan> spans;
    const std::vector<int32_t> rows = Rows(chunks, capacity, &spans);
    ASSERT_EQ(static_cast<int64_t>(rows.size()), std::min(capacity, demand));
    int64_t largest = 0;
    for (const QuerySpan& s : spans) largest = std::max(largest, s.n);
    int64_t next_first = 0;
    for (const QuerySpan& s : spans) {
      const QueryChunk& ch = chunks[static_cast<size_t>(s.seq)];
      EXPECT_EQ(s.first, next_first);
      next_first += s.n;
      EXPECT_DOUBLE_EQ(s.weight * static_cast<double>(s.n), static_cast<double>(ch.n));
      if (s.n < ch.n) {
        EXPECT_GE(s.n, largest - 1) << "chunk " << s.seq << " cut unfairly";
      }
      for (int64_t j = 0; j < s.n; ++j) {
        const int32_t r = rows[static_cast<size_t>(s.first + j)];
        EXPECT_GE(r, ch.first_row);
        EXPECT_LT(r, ch.first_row + ch.n);
        if (j > 0) {
          EXPECT_GT(r, rows[static_cast<size_t>(s.first + j - 1)]);
        }
      }
    }
  }
}

// The planner over a device cache: the kqsvd sequences' rows (decodes first, then prefill
// chunks, as the activations are laid out) go into the metadata; a pca sequence's do not.
// The full-rank cache through the same planner: slots and prefill rows are its block table's
// pages, decodes describe whole pages, and nothing is expanded or read back.
TEST(StepPlannerTest, FullRankCachePlansFromItsBlockTable) {
  const KvCacheGeometry g{.n_layers = 2, .n_kv_heads = 2, .head_dim = 64};
  constexpr int kBlock = 16;
  const int64_t blocks = 12;
  std::vector<uint8_t> pool(
      static_cast<size_t>(blocks * DevicePagedKvCache::BlockBytes(g, kBlock)));
  absl::StatusOr<std::unique_ptr<DevicePagedKvCache>> made =
      DevicePagedKvCache::Create({.geometry = g, .block_size = kBlock}, pool.data(),
                                 static_cast<int64_t>(pool.size()), nullptr);
  ASSERT_TRUE(made.ok()) << made.status();
  DevicePagedKvCache& cache = **made;
  const SeqId a = *cache.CreateSequence(), b = *cache.CreateSequence();
  ASSERT_TRUE(cache.Reserve(b, 5).ok());  // b's first block, then a's three
  ASSERT_TRUE(cache.Reserve(a, 40).ok());
  ASSERT_TRUE(cache.Commit(a, 40).ok());
  ASSERT_TRUE(cache.Reserve(a, 1).ok());
  const std::vector<int32_t> one = {9}, five = {1, 2, 3, 4, 5};
  // The prefill first: the plan puts decodes first all the same.
  const std::vector<SequenceChunk> batch = {{.seq = b, .pos = 0, .tokens = five},
                                            {.seq = a, .pos = 40, .tokens = one}};
  const StepMetaLayout meta = LayoutStepMeta({.max_tokens = 16,
                                              .max_sequences = 4,
                                              .max_blocks_per_seq = 8,
                                              .pool_blocks = blocks,
                                              .n_kv_heads = g.n_kv_heads,
                                              .target_ctas = 8});
  EXPECT_EQ(meta.exp_capacity, 0);
  std::vector<uint64_t> host(static_cast<size_t>(meta.total / 8 + 1));
  const StepPlanInputs in = {.meta = &meta,
                             .meta_host = reinterpret_cast<uint8_t*>(host.data()),
                             .block_size = kBlock,
                             .n_kv_heads = g.n_kv_heads,
                             .target_ctas = 8,
                             .cache = &cache};
  StepPlanner planner;
  StepPlan plan;
  ASSERT_TRUE(planner.Plan(in, batch, &plan).ok());
  EXPECT_EQ(plan.n_decode, 1);
  EXPECT_EQ(plan.n_prefill, 1);
  EXPECT_EQ(plan.n_exp, 0);
  EXPECT_FALSE(plan.exp_outliers);
  EXPECT_EQ(plan.n_query_rows, 0);
  EXPECT_EQ(plan.table_stride, 1);
  EXPECT_GT(plan.decode.bytes(), 0);
  const std::span<const int32_t> ta = cache.BlockTable(a), tb = cache.BlockTable(b);
  ASSERT_EQ(ta.size(), 3u);
  // Row 0 is a's decode at position 40 (block 2, offset 8); rows 1..5 b's prefill.
  const auto* slots = reinterpret_cast<const int64_t*>(in.meta_host + meta.slot_mapping);
  const auto* positions = reinterpret_cast<const int32_t*>(in.meta_host + meta.positions);
  EXPECT_EQ(slots[0], int64_t{ta[2]} * kBlock + 8);
  EXPECT_EQ(positions[0], 40);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(slots[1 + i], int64_t{tb[0]} * kBlock + i);
    EXPECT_EQ(positions[1 + i], i);
  }
  const auto* table = reinterpret_cast<const int32_t*>(in.meta_host + meta.block_table);
  EXPECT_EQ(table[0], tb[0]);
  // Logit rows in the caller's order: the prefill's last row, then the decode's.
  const auto* logit_rows = reinterpret_cast<const int32_t*>(in.meta_host + meta.logit_rows);
  EXPECT_EQ(logit_rows[0], 5);
  EXPECT_EQ(logit_rows[1], 0);
  DecodeSeqDesc desc;
  cache.DescribeDecode(a, 41, &desc);
  EXPECT_EQ(desc.length, 41);
  EXPECT_EQ(desc.pages, std::vector<int32_t>(ta.begin(), ta.end()));
  EXPECT_EQ(desc.slots, std::vector<int32_t>(3, kernels::kFullBlock));
  EXPECT_EQ(desc.epochs, std::vector<int32_t>(3 * g.n_kv_heads, -1));
}

TEST(StepPlannerQueryRowsTest, OnlyKqsvdSequencesRowsAreReadBack) {
  using namespace device_cache_test;  // NOLINT(build/namespaces): this test family's helpers
  CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kFp16);
  c.refresh.method = RefreshMethod::kPca;
  c.refresh.every_tokens = 32;
  c.refresh_inline = true;
  c.n_query_heads = 2 * c.geometry.n_kv_heads;
  Pair p = MakePair(c, 256);
  ASSERT_NE(p.dev, nullptr);
  RefreshConfig kqsvd = c.refresh;
  kqsvd.method = RefreshMethod::kKqsvd;
  const cache_test::Data d = cache_test::RandomKv(c.geometry, 80, 5);
  std::vector<SeqId> seqs;  // kqsvd decode, pca decode, kqsvd prefill
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(*p.dev->CreateSequence());
    if (i != 1) {
      ASSERT_TRUE(p.dev->SetSequenceRefresh(seqs.back(), kqsvd).ok());
    }
    AppendDevice(*p.dev, *p.store, seqs.back(), d, 0, 64);  // past the window: an epoch
  }
  ASSERT_TRUE(p.dev->WantsQueries(seqs[0]));
  ASSERT_FALSE(p.dev->WantsQueries(seqs[1]));
  const std::vector<int32_t> one = {7}, six = {1, 2, 3, 4, 5, 6};
  std::vector<SequenceChunk> batch = {{.seq = seqs[2], .pos = 64, .tokens = six},
                                      {.seq = seqs[0], .pos = 64, .tokens = one},
                                      {.seq = seqs[1], .pos = 64, .tokens = one}};
  for (const SequenceChunk& ch : batch) {
    ASSERT_TRUE(p.dev->Reserve(ch.seq, static_cast<int64_t>(ch.tokens.size())).ok());
  }
  const StepMetaLayout meta = LayoutStepMeta({.max_tokens = 16,
                                              .max_sequences = 4,
                                              .max_blocks_per_seq = 16,
                                              .pool_blocks = 256,
                                              .n_kv_heads = c.geometry.n_kv_heads,
                                              .target_ctas = 8,
                                              .compressed = true,
                                              .query_rows = 4});
  std::vector<uint64_t> host(static_cast<size_t>(meta.total / 8 + 1));
  const StepPlanInputs in = {.meta = &meta,
                             .meta_host = reinterpret_cast<uint8_t*>(host.data()),
                             .block_size = c.block_size,
                             .n_kv_heads = c.geometry.n_kv_heads,
                             .target_ctas = 8,
                             .cache = p.dev.get(),
                             .scratch_pages = 16};
  StepPlanner planner;
  StepPlan plan;
  ASSERT_TRUE(planner.Plan(in, batch, &plan).ok());
  // Rows: the two decodes (kqsvd 0, pca 1), then the prefill's six (2..7), of which a readback
  // of four keeps the decode's one and three of six, each standing for two.
  ASSERT_EQ(plan.n_query_rows, 4);
  const auto* rows = reinterpret_cast<const int32_t*>(in.meta_host + meta.query_rows);
  EXPECT_EQ(std::vector<int32_t>(rows, rows + 4), (std::vector<int32_t>{3, 5, 7, 0}));
  ASSERT_EQ(plan.query_spans.size(), 2u);
  EXPECT_EQ(plan.query_spans[0].seq, seqs[2]);
  EXPECT_EQ(plan.query_spans[0].n, 3);
  EXPECT_EQ(plan.query_spans[0].weight, 2.0);
  EXPECT_EQ(plan.query_spans[1].seq, seqs[0]);
  EXPECT_EQ(plan.query_spans[1].first, 3);
  EXPECT_EQ(plan.query_spans[1].weight, 1.0);

  // Without a readback (query_rows 0) nothing is planned.
  const StepMetaLayout none = LayoutStepMeta({.max_tokens = 16,
                                              .max_sequences = 4,
                                              .max_blocks_per_seq = 16,
                                              .pool_blocks = 256,
                                              .n_kv_heads = c.geometry.n_kv_heads,
                                              .target_ctas = 8,
                                              .compressed = true});
  StepPlanInputs without = in;
  without.meta = &none;
  ASSERT_TRUE(planner.Plan(without, batch, &plan).ok());
  EXPECT_EQ(plan.n_query_rows, 0);
  EXPECT_TRUE(plan.query_spans.empty());
}

}  // namespace
}  // namespace subspace::cuda
