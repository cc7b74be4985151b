// DevicePagedKvCache's bookkeeping, which runs on the host and needs no GPU: reservation all or
// nothing, one block table for every layer, commit/truncate/free, stats and the layer slices of
// the pool. The pool here is host memory the cache never touches (it only computes addresses).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "cuda/device_paged_kv_cache.h"

namespace subspace::cuda {
namespace {

constexpr KvCacheGeometry kGeometry{.n_layers = 3, .n_kv_heads = 2, .head_dim = 64};
constexpr int kBlock = 16;

// The host pool's copy: what cudaMemcpy does on the device pool.
absl::Status HostCopy(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

class DeviceKvCacheHostTest : public ::testing::Test {
 protected:
  std::unique_ptr<DevicePagedKvCache> Make(int64_t blocks, std::vector<uint8_t>* pool = nullptr) {
    if (pool == nullptr) pool = &pool_;
    const int64_t bytes = blocks * DevicePagedKvCache::BlockBytes(kGeometry, kBlock);
    pool->assign(static_cast<size_t>(bytes), 0);
    absl::StatusOr<std::unique_ptr<DevicePagedKvCache>> cache =
        DevicePagedKvCache::Create({.geometry = kGeometry, .block_size = kBlock, .copy = HostCopy},
                                   pool->data(), bytes, nullptr);
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

// What the kernels would have written for token t of layer l, head h, K (side 0) or V: a byte
// pattern that names them.
uint8_t RowByte(int l, int side, int h, int64_t t, int i) {
  return static_cast<uint8_t>(l * 61 + side * 31 + h * 17 + t * 7 + i);
}

void WriteRows(DevicePagedKvCache& cache, SeqId seq, int64_t length) {
  const kernels::KvPoolLayout& layout = cache.layout();
  const int row = kGeometry.head_dim * 2;
  for (int l = 0; l < kGeometry.n_layers; ++l) {
    for (int64_t t = 0; t < length; ++t) {
      const int32_t page = cache.BlockTable(seq)[static_cast<size_t>(t / kBlock)];
      for (int side = 0; side < 2; ++side) {
        for (int h = 0; h < kGeometry.n_kv_heads; ++h) {
          uint8_t* at = cache.LayerPool(l) +
                        (side == 0 ? layout.FullK(page, h) : layout.FullV(page, h)) +
                        (t % kBlock) * row;
          for (int i = 0; i < row; ++i) at[i] = RowByte(l, side, h, t, i);
        }
      }
    }
  }
}

// A sequence's committed rows go out through the copier and come back into another pool's
// pages; the stale rows of its last block stay behind.
TEST_F(DeviceKvCacheHostTest, ImagesCarryTheCommittedRowsOnly) {
  auto cache = Make(8);
  ASSERT_NE(cache, nullptr);
  const SeqId a = *cache->CreateSequence();
  ASSERT_TRUE(cache->Reserve(a, 40).ok());
  std::fill(pool_.begin(), pool_.end(), uint8_t{0xee});  // another session's leftovers
  WriteRows(*cache, a, 37);
  ASSERT_TRUE(cache->Commit(a, 37).ok());
  absl::StatusOr<std::string> image = cache->ExportSequence(a);
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->find(std::string(64, '\xee')), std::string::npos);

  std::vector<uint8_t> other_pool;
  auto other = Make(8, &other_pool);
  ASSERT_NE(other, nullptr);
  (void)*other->CreateSequence();  // so the copy lands in other blocks
  ASSERT_TRUE(other->Reserve(0, 16).ok());
  absl::StatusOr<SeqId> b = other->ImportSequence(*image);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(other->Length(*b), 37);
  const kernels::KvPoolLayout& layout = other->layout();
  const int row = kGeometry.head_dim * 2;
  for (int l = 0; l < kGeometry.n_layers; ++l) {
    for (int64_t t = 0; t < 48; ++t) {
      const int32_t page = other->BlockTable(*b)[static_cast<size_t>(t / kBlock)];
      for (int side = 0; side < 2; ++side) {
        for (int h = 0; h < kGeometry.n_kv_heads; ++h) {
          const uint8_t* at = other->LayerPool(l) +
                              (side == 0 ? layout.FullK(page, h) : layout.FullV(page, h)) +
                              (t % kBlock) * row;
          for (int i = 0; i < row; ++i) {
            ASSERT_EQ(at[i], t < 37 ? RowByte(l, side, h, t, i) : 0)
                << "layer " << l << " token " << t << " side " << side << " head " << h;
          }
        }
      }
    }
  }
  EXPECT_EQ(*other->ExportSequence(*b), *image);
  EXPECT_EQ(other->ImageLayout(), cache->ImageLayout());
}

TEST_F(DeviceKvCacheHostTest, ImportRefusesDamagedImagesAndLeaksNothing) {
  auto cache = Make(8);
  ASSERT_NE(cache, nullptr);
  const SeqId a = *cache->CreateSequence();
  ASSERT_TRUE(cache->Reserve(a, 40).ok());
  WriteRows(*cache, a, 40);
  ASSERT_TRUE(cache->Commit(a, 40).ok());
  const std::string image = *cache->ExportSequence(a);
  std::vector<uint8_t> other_pool;
  auto other = Make(8, &other_pool);
  for (size_t cut : {size_t{0}, size_t{20}, image.size() / 2, image.size() - 1}) {
    EXPECT_EQ(other->ImportSequence(image.substr(0, cut)).status().code(),
              absl::StatusCode::kDataLoss)
        << cut;
  }
  EXPECT_EQ(other->ImportSequence(image + "x").status().code(), absl::StatusCode::kDataLoss);
  std::vector<uint8_t> small_pool;
  auto small = Make(2, &small_pool);
  EXPECT_EQ(small->ImportSequence(image).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small->Stats().blocks_free, small->Stats().blocks_total);
  EXPECT_EQ(other->Stats().blocks_free, other->Stats().blocks_total);
  EXPECT_EQ(other->Stats().sequences, 0);
  // Without a copier (a caller that gives none) there are no images.
  auto bare = DevicePagedKvCache::Create({.geometry = kGeometry, .block_size = kBlock},
                                         other_pool.data(), other_pool.size(), nullptr);
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ((*bare)->ExportSequence(0).status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace subspace::cuda
