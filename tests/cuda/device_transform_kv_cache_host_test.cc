// DeviceTransformKvCache's bookkeeping on the host, through a store that runs the transform
// kernels' CPU twins: which blocks a Commit codes (the CPU cache's sinks and window), that the
// slots hold the twin's codes of the pages' tokens at their positions, that the pages go back
// once the batch is issued, that truncation into a coded block decodes it back into a page, and
// what Create refuses. The attention over the coded history is compared with the CPU cache end
// to end by cuda_model_test (on the emulated device in CI).
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/compress/transform_kv_cache.h"
#include "cuda/device_transform_kv_cache.h"
#include "cuda/rope_table.h"
#include "cuda/transform_tables.h"
#include "tests/cuda/twin_transform_store_ref.h"
#include "tests/kernels/kv_test_data.h"
#include "tests/kernels/transform_blocks_ref.h"

namespace subspace::cuda {
namespace {

constexpr int kBlock = 16;

struct Rig {
  DeviceTransformKvCacheConfig config;
  std::optional<RopeSchedule> rope;  // keys coded before RoPE with it
  std::vector<kernels::KvPoolLayout> layouts;
  std::shared_ptr<TwinTransformStore> store;
  std::unique_ptr<DeviceTransformKvCache> cache;
};

// Two layers of codes fitted as the kernels' tests fit them: 3 bits in layer 0, 2 in layer 1
// (so the layers' coded blocks differ in size), keys before RoPE when `pre_rope`.
Rig Make(bool pre_rope, int64_t num_pages, std::mt19937_64& rng) {
  Rig s;
  kernels::testing::TransformCaseOptions o{
      .n_kv = 2, .head_dim = 64, .block_size = kBlock, .n_blocks = 1, .pre_rope = pre_rope};
  auto keys = std::make_shared<std::vector<TransformCode>>();
  auto values = std::make_shared<std::vector<TransformCode>>();
  std::vector<float> cos_sin;
  std::optional<RopeSchedule> rope;
  for (double bits : {3.0, 2.0}) {
    o.bits = bits;
    kernels::testing::TransformCase c = kernels::testing::RandomTransformCase(o, rng);
    keys->insert(keys->end(), c.key_codes.begin(), c.key_codes.end());
    values->insert(values->end(), c.value_codes.begin(), c.value_codes.end());
    rope = c.rope;
  }
  s.config = {.geometry = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 64},
              .block_size = kBlock,
              .sink_tokens = 4,
              .window_tokens = 32,
              .key_codes = keys,
              .value_codes = values,
              .num_pages = num_pages,
              .pre_rope_keys = pre_rope};
  s.rope = rope;
  s.layouts = DeviceTransformKvCache::Layouts(s.config);
  std::vector<TransformLayerTables> tables;
  for (int l = 0; l < 2; ++l)
    tables.push_back(BuildTransformTables(*keys, *values, l, 2, 64, kBlock));
  kernels::TransformKeyRope key_rope;
  static std::vector<float> table;  // outlives the store in every test
  if (rope.has_value()) {
    table = RopeCosSinTable(4096, *rope);
    key_rope = {.cos_sin = table.data(), .rope_dim = rope->dim, .max_position = 4096};
  }
  s.store = std::make_shared<TwinTransformStore>(s.layouts, num_pages, std::move(tables), key_rope);
  absl::StatusOr<std::unique_ptr<DeviceTransformKvCache>> cache =
      DeviceTransformKvCache::Create(s.config, s.store);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (cache.ok()) s.cache = *std::move(cache);
  return s;
}

// Random fp16 rows into the full pages of tokens [from, to) of `seq`, every layer.
void Fill(Rig& s, SeqId seq, int64_t from, int64_t to, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int l = 0; l < 2; ++l) {
    const kernels::KvPoolLayout& lay = s.layouts[static_cast<size_t>(l)];
    for (int64_t pos = from; pos < to; ++pos) {
      const DeviceBlockRef b = s.cache->BlockOf(seq, pos / kBlock);
      ASSERT_TRUE(b.full());
      for (int h = 0; h < 2; ++h) {
        for (int side = 0; side < 2; ++side) {
          auto* row = reinterpret_cast<uint16_t*>(
              s.store->pool(l) + (side == 0 ? lay.FullK(b.page, h) : lay.FullV(b.page, h)) +
              pos % kBlock * 64 * 2);
          for (int i = 0; i < 64; ++i) row[i] = Fp32ToFp16(normal(rng));
        }
      }
    }
  }
}

class DeviceTransformKvCacheHostTest : public ::testing::TestWithParam<bool> {};

TEST_P(DeviceTransformKvCacheHostTest, CodesWhatLeftTheWindowAndDecodesACutBlock) {
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  Rig s = Make(GetParam(), 32, rng);
  ASSERT_NE(s.cache, nullptr);
  DeviceTransformKvCache& cache = *s.cache;
  const SeqId seq = *cache.CreateSequence();
  ASSERT_TRUE(cache.Reserve(seq, 100).ok());
  Fill(s, seq, 0, 100, rng);
  // The pages blocks 1..3 hold now: what coding must read, at positions 16..63.
  std::vector<std::vector<uint8_t>> before;
  for (int l = 0; l < 2; ++l) before.push_back(s.store->pool_bytes(l));
  std::vector<int32_t> pages;
  for (int64_t b = 0; b < 7; ++b) pages.push_back(cache.BlockOf(seq, b).page);
  ASSERT_TRUE(cache.Commit(seq, 100).ok());
  // Block 0 holds sinks, blocks 4.. end past 100 - 32: blocks 1..3 are queued, not yet issued.
  EXPECT_EQ(cache.Detail().blocks_coded, 3);
  EXPECT_EQ(s.store->blocks_coded(), 0);
  EXPECT_EQ(cache.Detail().pages_full, 7);
  ASSERT_TRUE(cache.Flush().ok());
  EXPECT_EQ(s.store->blocks_coded(), 3);
  EXPECT_EQ(cache.Detail().pages_full, 4);
  EXPECT_EQ(cache.Detail().pages_coded, 1);
  for (int64_t b = 0; b < 7; ++b) EXPECT_EQ(cache.BlockOf(seq, b).full(), b == 0 || b >= 4) << b;
  // The slots hold the twin's codes of the original pages, each block at its own positions.
  for (int l = 0; l < 2; ++l) {
    std::vector<uint8_t> want = before[static_cast<size_t>(l)];
    std::vector<int32_t> src, dst_page, dst_slot, first;
    for (int64_t b = 1; b <= 3; ++b) {
      const DeviceBlockRef ref = cache.BlockOf(seq, b);
      src.push_back(pages[static_cast<size_t>(b)]);
      dst_page.push_back(ref.page);
      dst_slot.push_back(ref.slot);
      first.push_back(static_cast<int32_t>(b * kBlock));
    }
    // (Re-run on a copy with the same tables: the store's own tables are the cache's.)
    const std::vector<TransformLayerTables> tables = {
        BuildTransformTables(*s.config.key_codes, *s.config.value_codes, l, 2, 64, kBlock)};
    kernels::TransformKeyRope rope;
    std::vector<float> table;
    if (GetParam()) {
      absl::StatusOr<RopeSchedule> r = RopeSchedule::Make({.dim = 64});
      table = RopeCosSinTable(4096, *r);
      rope = {.cos_sin = table.data(), .rope_dim = 64, .max_position = 4096};
    }
    kernels::TransformCodeRef({.layout = s.layouts[static_cast<size_t>(l)],
                               .tables = {tables[0].floats.data(), tables[0].ints.data()},
                               .key_rope = rope,
                               .src_pool = want.data(),
                               .dst_pool = want.data(),
                               .src_page = src.data(),
                               .dst_page = dst_page.data(),
                               .dst_slot = dst_slot.data(),
                               .first_pos = first.data(),
                               .n_blocks = 3});
    const kernels::KvPoolLayout& lay = s.layouts[static_cast<size_t>(l)];
    for (size_t i = 0; i < 3; ++i) {
      const int64_t at = lay.Slot(dst_page[i], dst_slot[i]);
      const int64_t bytes = tables[0].coded_bytes;
      EXPECT_TRUE(std::equal(want.begin() + at, want.begin() + at + bytes,
                             s.store->pool_bytes(l).begin() + at))
          << "layer " << l << " block " << i + 1;
    }
  }

  // Truncation into coded block 2: it is decoded back into a page, coding restarts there.
  const std::vector<uint8_t> coded = s.store->pool_bytes(0);
  ASSERT_TRUE(cache.Truncate(seq, 40).ok());
  EXPECT_EQ(cache.Length(seq), 40);
  EXPECT_EQ(s.store->blocks_expanded(), 1);
  EXPECT_TRUE(cache.BlockOf(seq, 2).full());
  EXPECT_FALSE(cache.BlockOf(seq, 1).full());
  EXPECT_EQ(cache.Detail().blocks_coded, 1);
  // Its page holds finite rows (the decoded block); then decoding and coding go on.
  const kernels::KvPoolLayout& lay0 = s.layouts[0];
  for (int64_t i = 0; i < lay0.page_bytes / 2; ++i) {
    const double x = kernels::testing::PoolHalf(s.store->pool_bytes(0),
                                                lay0.Page(cache.BlockOf(seq, 2).page) + 2 * i);
    ASSERT_TRUE(std::isfinite(x)) << i;
  }
  ASSERT_TRUE(cache.Reserve(seq, 60).ok());
  Fill(s, seq, 40, 100, rng);
  ASSERT_TRUE(cache.Commit(seq, 100).ok());
  ASSERT_TRUE(cache.Flush().ok());
  EXPECT_EQ(cache.Detail().blocks_coded, 3);
  ASSERT_TRUE(cache.FreeSequence(seq).ok());
  EXPECT_EQ(cache.Detail().pages_full, 0);
  EXPECT_EQ(cache.Detail().pages_coded, 0);
  EXPECT_EQ(cache.Stats().blocks_free, cache.Stats().blocks_total - 2);  // headroom
}

INSTANTIATE_TEST_SUITE_P(Keys, DeviceTransformKvCacheHostTest, ::testing::Values(false, true));

// Images in the CPU cache's format: a session exported here imports into TransformKvCache
// (same codes and policy) and back, byte for byte; corrupt images change nothing.
TEST_P(DeviceTransformKvCacheHostTest, ImagesMoveBetweenTheCpuAndTheDeviceCache) {
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  Rig s = Make(GetParam(), 32, rng);
  ASSERT_NE(s.cache, nullptr);
  DeviceTransformKvCache& cache = *s.cache;
  const SeqId seq = *cache.CreateSequence();
  ASSERT_TRUE(cache.Reserve(seq, 100).ok());
  Fill(s, seq, 0, 100, rng);
  ASSERT_TRUE(cache.Commit(seq, 100).ok());  // codings queued: Export issues them
  absl::StatusOr<std::string> image = cache.ExportSequence(seq);
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(cache.Detail().blocks_coded, 3);

  TransformKvCacheConfig c;
  c.geometry = s.config.geometry;
  c.block_size = kBlock;
  c.sink_tokens = 4;
  c.window_tokens = 32;
  c.key_codes = s.config.key_codes;
  c.value_codes = s.config.value_codes;
  c.key_rope = s.rope;
  if (!GetParam()) c.key_rope.reset();
  c.capacity_bytes = int64_t{8} << 20;
  absl::StatusOr<std::unique_ptr<TransformKvCache>> cpu = TransformKvCache::Create(c);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->ImageLayout(), cache.ImageLayout());
  absl::StatusOr<SeqId> on_cpu = (*cpu)->ImportSequence(*image);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  EXPECT_EQ((*cpu)->Length(*on_cpu), 100);
  EXPECT_TRUE((*cpu)->IsCoded(*on_cpu, 1, 2));
  absl::StatusOr<std::string> back = (*cpu)->ExportSequence(*on_cpu);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, *image);
  // The storage form (range-coded codes) is one format too: either cache makes the same bytes,
  // and each imports it as the stored form.
  absl::StatusOr<std::string> compact = cache.CompactImage(*image);
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_EQ(*(*cpu)->CompactImage(*image), *compact);
  EXPECT_NE(*compact, *image);
  absl::StatusOr<SeqId> from_compact = (*cpu)->ImportSequence(*compact);
  ASSERT_TRUE(from_compact.ok()) << from_compact.status();
  EXPECT_EQ(*(*cpu)->ExportSequence(*from_compact), *image);
  ASSERT_TRUE((*cpu)->FreeSequence(*from_compact).ok());

  const DeviceTransformKvCacheDetail before = cache.Detail();
  absl::StatusOr<SeqId> again = cache.ImportSequence(*compact);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(cache.Length(*again), 100);
  EXPECT_EQ(cache.Detail().blocks_coded, 6);
  absl::StatusOr<std::string> twice = cache.ExportSequence(*again);
  ASSERT_TRUE(twice.ok());
  EXPECT_EQ(*twice, *image);
  ASSERT_TRUE(cache.FreeSequence(*again).ok());
  EXPECT_EQ(cache.Detail().pages_full, before.pages_full);

  // Truncated, or from another cache: refused, nothing taken.
  EXPECT_EQ(cache.ImportSequence(image->substr(0, image->size() - 1)).status().code(),
            absl::StatusCode::kDataLoss);
  c.window_tokens = 64;
  absl::StatusOr<std::unique_ptr<TransformKvCache>> other = TransformKvCache::Create(c);
  ASSERT_TRUE(other.ok());
  const SeqId o = *(*other)->CreateSequence();
  ASSERT_TRUE((*other)->Reserve(o, 3).ok());
  ASSERT_TRUE((*other)->Commit(o, 3).ok());
  EXPECT_EQ(cache.ImportSequence(*(*other)->ExportSequence(o)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A block coded in one layer only: the CPU cache's format allows it, one table does not.
  const DeviceTransformKvCacheConfig& dc = s.config;
  const TransformImageFormat format(dc.geometry, dc.block_size, dc.sink_tokens, dc.window_tokens,
                                    dc.pre_rope_keys, *dc.key_codes, *dc.value_codes);
  ASSERT_EQ(format.layout(), cache.ImageLayout());
  TransformImage mixed;
  mixed.length = 32;
  mixed.next_compress = 2;
  mixed.blocks = 2;
  const std::string full_rows(static_cast<size_t>(2 * 2 * kBlock * 64 * 2), '\0');
  const std::string codes(static_cast<size_t>(format.coded_bytes(0)), '\0');
  const TransformImage::Part full{.coded = false, .bytes = full_rows};
  mixed.parts = {full, {.coded = true, .bytes = codes}, full, full};
  for (bool entropy_coded : {false, true}) {
    EXPECT_EQ(cache.ImportSequence(format.Write(mixed, entropy_coded)).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  // Blocks of a refreshed epoch (a CPU session with online refresh): this cache runs none.
  TransformImage refreshed;
  refreshed.length = 32;
  refreshed.next_compress = 2;
  refreshed.blocks = 2;
  refreshed.epochs = {{.keys = dc.key_codes, .values = dc.value_codes}};
  refreshed.current_epoch = 1;
  const std::string codes1(static_cast<size_t>(format.coded_bytes(1)), '\0');
  refreshed.parts = {full,
                     {.coded = true, .epoch = 1, .bytes = codes},
                     full,
                     {.coded = true, .epoch = 1, .bytes = codes1}};
  for (bool entropy_coded : {false, true}) {
    const absl::Status st = cache.ImportSequence(format.Write(refreshed, entropy_coded)).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(st.message().find("online refresh"), std::string::npos) << st.message();
  }
  EXPECT_EQ(cache.Detail().pages_full, before.pages_full);
  EXPECT_EQ(cache.Stats().sequences, 1);
}

TEST(DeviceTransformKvCacheCreateTest, RefusesBadConfigs) {
  std::mt19937_64 rng(5);
  Rig s = Make(false, 8, rng);
  ASSERT_NE(s.cache, nullptr);
  DeviceTransformKvCacheConfig c = s.config;
  c.num_pages = 1;
  EXPECT_EQ(DeviceTransformKvCache::Create(c, s.store).status().code(),
            absl::StatusCode::kInvalidArgument);
  c = s.config;
  EXPECT_EQ(DeviceTransformKvCache::Create(c, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  c.geometry.n_layers = 3;  // codes for two
  EXPECT_EQ(DeviceTransformKvCache::Validate(c).code(), absl::StatusCode::kInvalidArgument);
  c = s.config;
  c.block_size = 65;
  EXPECT_EQ(DeviceTransformKvCache::Validate(c).code(), absl::StatusCode::kInvalidArgument);
  c = s.config;
  c.key_codes = nullptr;
  EXPECT_EQ(DeviceTransformKvCache::Validate(c).code(), absl::StatusCode::kInvalidArgument);
}

// A pool Reserve has filled but for its headroom: the first coding opens its slab page there,
// and the coded block's page, back once the batch is issued, becomes the headroom.
TEST(DeviceTransformKvCacheCreateTest, CodingOpensItsSlabInTheHeadroomPage) {
  std::mt19937_64 rng(9);
  Rig s = Make(false, 5, rng);
  ASSERT_NE(s.cache, nullptr);
  const SeqId seq = *s.cache->CreateSequence();
  ASSERT_TRUE(s.cache->Reserve(seq, 64).ok());  // 4 pages + 1 of headroom: the pool is full
  EXPECT_EQ(s.cache->Reserve(seq, 80).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(s.cache->Commit(seq, 64).ok());  // block 0 holds sinks; block 1 ends by 64 - 32
  ASSERT_TRUE(s.cache->Flush().ok());
  EXPECT_EQ(s.cache->Detail().blocks_coded, 1);
  EXPECT_EQ(s.cache->Detail().codings_deferred, 0);
  EXPECT_EQ(s.cache->Detail().pages_full, 3);
  EXPECT_EQ(s.cache->Detail().pages_coded, 1);
  // The coded block's page is the headroom now: the next coding's slab page, if it needs one.
  EXPECT_EQ(s.cache->Stats().blocks_free, 0);
}

}  // namespace
}  // namespace subspace::cuda
