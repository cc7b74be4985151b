// The sequence manager every KV cache uses: ids, tables per layer or shared, reservation with
// headroom, commit/truncate bounds, release callbacks and the pool's stats.
#include "core/kvcache/sequence_manager.h"

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace subspace {
namespace {

constexpr int kLayers = 3;
constexpr int kBlock = 4;

std::unique_ptr<BlockPool> Pool(int64_t blocks) {
  return *BlockPool::CreateBookkeeping(/*block_floats=*/8, blocks);
}

KvCacheGeometry Geometry() { return {.n_layers = kLayers, .n_kv_heads = 2, .head_dim = 8}; }

TEST(SequenceManagerTest, PerLayerTablesReserveCommitTruncateFree) {
  auto pool = Pool(12);  // 4 blocks per layer
  SequenceManager<int32_t> m({.n_layers = kLayers, .block_size = kBlock, .block_bytes = 32},
                             pool.get());
  const SeqId a = *m.Create();
  EXPECT_EQ(m.Length(a), 0);
  EXPECT_EQ(m.BlocksNeeded(a, 5), 2 * kLayers);  // ceil(5 / 4) blocks in every layer
  ASSERT_TRUE(m.Reserve(a, 5).ok());
  EXPECT_EQ(m.ReservedTokens(a), 8);
  EXPECT_EQ(m.BlocksNeeded(a, 3), 0);
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(m.Table(a, l)->size(), 2u);
  EXPECT_EQ(pool->num_free(), 12 - 2 * kLayers);

  EXPECT_EQ(m.Commit(a, 9).code(), absl::StatusCode::kInvalidArgument);  // past the reservation
  ASSERT_TRUE(m.Commit(a, 5).ok());
  EXPECT_EQ(m.Commit(a, 4).code(), absl::StatusCode::kInvalidArgument);  // shrinks
  EXPECT_EQ(m.tokens_cached(), 5);

  // Truncate to 3 keeps one block per layer.
  ASSERT_TRUE(m.Truncate(a, 3).ok());
  EXPECT_EQ(m.Length(a), 3);
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(m.Table(a, l)->size(), 1u);
  EXPECT_EQ(pool->num_free(), 12 - kLayers);
  EXPECT_EQ(m.Truncate(a, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.tokens_cached(), 3);

  ASSERT_TRUE(m.Free(a).ok());
  EXPECT_EQ(m.Free(a).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool->num_free(), 12);
  EXPECT_EQ(m.tokens_cached(), 0);
  EXPECT_EQ(m.live(), 0);
  // The slot is recycled, empty.
  const SeqId b = *m.Create();
  EXPECT_EQ(b, a);
  EXPECT_EQ(m.Length(b), 0);
  EXPECT_EQ(m.Table(b, 0)->size(), 0u);
}

TEST(SequenceManagerTest, ReserveIsAllOrNothingAndSaysWhy) {
  auto pool = Pool(6);  // two blocks per layer
  SequenceManager<int32_t> m({.n_layers = kLayers, .block_size = kBlock, .block_bytes = 32},
                             pool.get());
  const SeqId a = *m.Create();
  const absl::Status full = m.Reserve(a, 9);  // three blocks per layer
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("needs 9 more blocks (3 per layer x 3 layers) for 9 tokens"),
            std::string::npos)
      << full.message();
  EXPECT_NE(full.message().find("6 of 6 blocks free"), std::string::npos) << full.message();
  EXPECT_EQ(pool->num_free(), 6);
  EXPECT_EQ(m.Table(a, 0)->size(), 0u);
  EXPECT_EQ(m.Reserve(a, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.Reserve(a + 7, 1).code(), absl::StatusCode::kNotFound);
  // A hostile count is capped, never overflowed.
  EXPECT_EQ(m.Reserve(a, int64_t{1} << 62).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_GT(m.BlocksNeeded(a, int64_t{1} << 62), 0);
  ASSERT_TRUE(m.Reserve(a, 8).ok());
  EXPECT_EQ(pool->num_free(), 0);
}

// Device caches: one table, one pool id per block for every layer; counts stay per layer and
// the headroom is never handed out.
TEST(SequenceManagerTest, SharedTableCountsPerLayerAndKeepsHeadroom) {
  auto pool = Pool(5);
  SequenceManager<int32_t> m({.n_layers = kLayers,
                              .block_size = kBlock,
                              .shared_table = true,
                              .headroom = 1,
                              .block_bytes = 96},
                             pool.get());
  const SeqId a = *m.Create();
  EXPECT_EQ(m.BlocksNeeded(a, 8), 2 * kLayers);
  ASSERT_TRUE(m.Reserve(a, 8).ok());
  EXPECT_EQ(pool->num_free(), 3);
  ASSERT_TRUE(m.Commit(a, 8).ok());
  const SeqId b = *m.Create();
  // 3 free, 1 held back: 2 blocks, not 3.
  EXPECT_EQ(m.Reserve(b, 12).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(m.Reserve(b, 8).ok());
  EXPECT_EQ(pool->num_free(), 1);
  std::set<int32_t> ids(m.Table(a, 2)->begin(), m.Table(a, 2)->end());
  ids.insert(m.Table(b, 0)->begin(), m.Table(b, 0)->end());
  EXPECT_EQ(ids.size(), 4u);  // distinct ids, one table whatever the layer

  const KvCacheStats st = m.Stats(Geometry());
  EXPECT_EQ(st.blocks_total, 5 * kLayers);
  EXPECT_EQ(st.blocks_free, 0);  // the headroom is not free to anyone
  EXPECT_EQ(st.bytes_total, 5 * 96);
  EXPECT_EQ(st.bytes_used_full, 4 * 96);
  EXPECT_EQ(st.tokens_cached, 8);
  EXPECT_EQ(st.bytes_full_fp16_equivalent, Fp16Bytes(Geometry(), 8));
  EXPECT_EQ(st.sequences, 2);
}

// A cache's own entries and state: the release callback sees every dropped block, the reserved
// ones past the committed length included, and `extra` blocks are counted but not appended.
TEST(SequenceManagerTest, CustomEntriesReleaseCallbackAndExtraBlocks) {
  struct Entry {
    int32_t page = -1;
    int32_t slot = -1;
  };
  struct Extra {
    int note = 0;
  };
  auto pool = Pool(15);
  SequenceManager<Entry, Extra> m({.n_layers = kLayers, .block_size = kBlock, .block_bytes = 32},
                                  pool.get());
  const SeqId a = *m.Create();
  m[a].note = 7;
  ASSERT_TRUE(m.Reserve(a, 12).ok());  // 3 blocks per layer
  ASSERT_TRUE(m.Commit(a, 6).ok());
  EXPECT_EQ(m.Find(a)->note, 7);
  EXPECT_EQ(m.Find(a)->tables[1][0].slot, -1);

  EXPECT_EQ(m.BlocksNeeded(a, 1, /*extra=*/1), kLayers);
  absl::StatusOr<int64_t> append = m.CheckReserve(a, 10, /*extra=*/1);
  ASSERT_TRUE(append.ok());
  EXPECT_EQ(*append, 1);  // ceil(16 / 4) - 3 held; the extra block is the cache's own
  EXPECT_EQ(m.CheckReserve(a, 14, 1).status().code(), absl::StatusCode::kResourceExhausted);

  std::vector<std::pair<int, int64_t>> released;
  ASSERT_TRUE(m.Truncate(a, 2, [&](int table, int64_t b, Entry& e) {
                 released.emplace_back(table, b);
                 pool->Free(e.page);
               }).ok());
  // Blocks 1 (committed) and 2 (reserved only) of every layer.
  EXPECT_EQ(released.size(), 2u * kLayers);
  EXPECT_EQ(released.front(), std::make_pair(0, int64_t{1}));
  EXPECT_EQ(released.back(), std::make_pair(kLayers - 1, int64_t{2}));
  EXPECT_EQ(m.Find(a)->blocks(), 1);
  EXPECT_EQ(pool->num_free(), 15 - kLayers);
}

}  // namespace
}  // namespace subspace
