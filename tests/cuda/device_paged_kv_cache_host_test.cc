// DevicePagedKvCache's bookkeeping, which runs on the host and needs no GPU: reservation all or
// nothing, one block table for every layer, commit/truncate/free, stats and the layer slices of
// the pool. The pool here is host memory the cache never touches (it only computes addresses).
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

#include "cuda/device_paged_kv_cache.h"

namespace subspace::cuda {
namespace {

constexpr KvCacheGeometry kGeometry{.n_layers = 3, .n_kv_heads = 2, .head_dim = 64};
constexpr int kBlock = 16;

class DeviceKvCacheHostTest : public ::testing::Test {
 protected:
  std::unique_ptr<DevicePagedKvCache> Make(int64_t blocks) {
    const int64_t bytes = blocks * DevicePagedKvCache::BlockBytes(kGeometry, kBlock);
    pool_.assign(static_cast<size_t>(bytes), 0);
    absl::StatusOr<std::unique_ptr<DevicePagedKvCache>> cache = DevicePagedKvCache::Create(
        {.geometry = kGeometry, .block_size = kBlock}, pool_.data(), bytes, nullptr);
    EXPECT_TRUE(cache.ok()) << cache.status();
    return cache.ok() ? *std::move(cache) : nullptr;
  }
  std::vector<uint8_t> pool_;
};

TEST_F(DeviceKvCacheHostTest, BlockBytesAreFp16PagesOfEveryLayer) {
  EXPECT_EQ(DevicePagedKvCache::BlockBytes(kGeometry, kBlock), 3 * 2 * 2 * kBlock * 64 * 2);
}

TEST_F(DeviceKvCacheHostTest, RejectsBadConfigs) {
  std::vector<uint8_t> pool(1 << 20);
  EXPECT_EQ(DevicePagedKvCache::Create({.geometry = kGeometry, .block_size = 65}, pool.data(),
                                       1 << 20, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DevicePagedKvCache::Create({.geometry = kGeometry, .block_size = 16}, pool.data(), 100,
                                       nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DevicePagedKvCache::Create({.geometry = {0, 2, 64}, .block_size = 16}, pool.data(),
                                       1 << 20, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(DeviceKvCacheHostTest, ReservesAllOrNothingAndCountsBlocksPerLayer) {
  auto cache = Make(4);
  ASSERT_NE(cache, nullptr);
  const SeqId a = *cache->CreateSequence();
  EXPECT_EQ(cache->BlocksNeeded(a, 17), 2 * kGeometry.n_layers);
  ASSERT_TRUE(cache->Reserve(a, 17).ok());
  EXPECT_EQ(cache->BlockTable(a).size(), 2u);
  const SeqId b = *cache->CreateSequence();
  const absl::Status full = cache->Reserve(b, 3 * kBlock);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_TRUE(cache->BlockTable(b).empty());  // nothing taken
  ASSERT_TRUE(cache->Reserve(b, 2 * kBlock).ok());
  std::set<int32_t> ids(cache->BlockTable(a).begin(), cache->BlockTable(a).end());
  ids.insert(cache->BlockTable(b).begin(), cache->BlockTable(b).end());
  EXPECT_EQ(ids.size(), 4u);  // distinct blocks
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 4);
  EXPECT_EQ(cache->Stats().blocks_free, 0);
}

TEST_F(DeviceKvCacheHostTest, CommitTruncateFreeAndStats) {
  auto cache = Make(8);
  ASSERT_NE(cache, nullptr);
  const SeqId a = *cache->CreateSequence();
  ASSERT_TRUE(cache->Reserve(a, 40).ok());
  EXPECT_EQ(cache->Commit(a, 49).code(), absl::StatusCode::kInvalidArgument);  // past 3 blocks
  ASSERT_TRUE(cache->Commit(a, 40).ok());
  EXPECT_EQ(cache->Length(a), 40);
  KvCacheStats st = cache->Stats();
  EXPECT_EQ(st.tokens_cached, 40);
  EXPECT_EQ(st.blocks_total, 8 * kGeometry.n_layers);
  EXPECT_EQ(st.blocks_free, 5 * kGeometry.n_layers);
  EXPECT_EQ(st.bytes_total, 8 * DevicePagedKvCache::BlockBytes(kGeometry, kBlock));
  EXPECT_EQ(st.bytes_full_fp16_equivalent, 40 * 3 * 2 * 2 * 64 * 2);
  EXPECT_EQ(st.sequences, 1);

  EXPECT_EQ(cache->Truncate(a, 41).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cache->Truncate(a, 16).ok());
  EXPECT_EQ(cache->Length(a), 16);
  EXPECT_EQ(cache->BlockTable(a).size(), 1u);
  EXPECT_EQ(cache->Stats().blocks_free, 7 * kGeometry.n_layers);

  ASSERT_TRUE(cache->FreeSequence(a).ok());
  EXPECT_EQ(cache->FreeSequence(a).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->Reserve(a, 1).code(), absl::StatusCode::kNotFound);
  st = cache->Stats();
  EXPECT_EQ(st.tokens_cached, 0);
  EXPECT_EQ(st.blocks_free, st.blocks_total);
  EXPECT_EQ(st.sequences, 0);
}

TEST_F(DeviceKvCacheHostTest, LayersAreConsecutiveSlicesOfThePool) {
  auto cache = Make(5);
  ASSERT_NE(cache, nullptr);
  const int64_t page = cache->layout().page_bytes;
  EXPECT_EQ(page, 2 * 2 * kBlock * 64 * 2);
  for (int l = 0; l < kGeometry.n_layers; ++l) {
    EXPECT_EQ(cache->LayerPool(l), pool_.data() + l * 5 * page);
  }
  EXPECT_EQ(cache->LayerPool(kGeometry.n_layers - 1) + 5 * page, pool_.data() + pool_.size());
}

}  // namespace
}  // namespace subspace::cuda
