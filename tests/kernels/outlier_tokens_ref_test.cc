// The CPU twin of outlier_tokens.cu: a round trip (block pages to outlier pages and back into
// fresh pages) checked against offsets spelled out here, the slot arithmetic where a block's
// outliers cross into their second page, and the batch checks that guard the kernel's
// no-aliasing precondition, one rejection at a time.
#include "tests/kernels/outlier_tokens_ref.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

using testing::OutlierCase;
using testing::RandomOutlierCase;

// Byte offset of token t's row of head h (side 0: K, 1: V) in `page`: [2][n_kv][B][d] fp16,
// spelled out rather than through KvPoolLayout's accessors.
int64_t RowAt(const KvPoolLayout& l, int32_t page, int side, int h, int t) {
  return page * l.page_bytes +
         ((static_cast<int64_t>(side) * l.n_kv_heads + h) * l.block_size + t) * l.head_dim * 2;
}

// Marks the row bytes [at, at + 2 d) in `written`.
void Mark(std::vector<bool>& written, int64_t at, const KvPoolLayout& l) {
  std::fill(written.begin() + at, written.begin() + at + 2 * l.head_dim, true);
}

// "" when every byte of `after` not marked in `written` equals `before`'s, else the first that
// does not.
std::string WrittenElsewhere(const std::vector<uint8_t>& before, const std::vector<uint8_t>& after,
                             const std::vector<bool>& written) {
  for (size_t i = 0; i < after.size(); ++i) {
    if (!written[i] && after[i] != before[i]) return "byte " + std::to_string(i) + " was written";
  }
  return "";
}

// head_dim, block size, one pool.
using Shape = std::tuple<int, int, bool>;

std::string ShapeName(const Shape& s) {
  return "d" + std::to_string(std::get<0>(s)) + "_b" + std::to_string(std::get<1>(s)) +
         (std::get<2>(s) ? "_onepool" : "_twopools");
}

class OutlierTokensRefTest : public ::testing::TestWithParam<Shape> {};

TEST_P(OutlierTokensRefTest, RoundTripMovesExactlyTheOutlierRows) {
  const auto [hd, bs, same_pool] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const int n_kv = 3;
  const KvPoolLayout l = MakeKvPoolLayout(n_kv, hd, bs, 8, 8, CoeffDtype::kFp16);
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  OutlierCase c = RandomOutlierCase(l, /*n_blocks=*/9, same_pool, /*p_outlier=*/0.3, rng);
  const std::vector<uint8_t> blocks0 = c.block_bytes(), outliers0 = c.outlier_pool;

  // Where each outlier belongs, from the header's rule: the k-th set bit goes to slot
  // first_slot + k of the first page, or past B, to slot first_slot + k - B of the second.
  struct Move {
    int32_t block_page, spare_page, token, outlier_page, outlier_slot;
  };
  std::vector<Move> moves;
  for (int32_t i = 0; i < c.n_blocks(); ++i) {
    int k = 0;
    for (int t = 0; t < bs; ++t) {
      if (!((c.mask[i] >> t) & 1u)) continue;
      const int s = c.first_slot[i] + k++;
      moves.push_back({c.block_page[i], c.spare_page[i], t, c.outlier_page[2 * i + (s >= bs)],
                       s >= bs ? s - bs : s});
    }
  }
  ASSERT_FALSE(moves.empty());

  // Into the outlier pages.
  OutlierTokensParams to = c.HostParams(OutlierMove::kToOutlierPages, c.block_page);
  ASSERT_TRUE(CheckOutlierBatch(to, c.num_block_pages, c.num_outlier_pages, same_pool).ok());
  OutlierTokensRef(to);
  std::vector<bool> written(c.outlier_pool.size(), false);
  for (const Move& m : moves) {
    for (int side = 0; side < 2; ++side) {
      for (int h = 0; h < n_kv; ++h) {
        const int64_t from = RowAt(l, m.block_page, side, h, m.token);
        const int64_t to_at = RowAt(l, m.outlier_page, side, h, m.outlier_slot);
        ASSERT_EQ(std::memcmp(c.outlier_pool.data() + to_at, blocks0.data() + from, 2 * hd), 0)
            << "token " << m.token << " of page " << m.block_page << " head " << h;
        Mark(written, to_at, l);
      }
    }
  }
  ASSERT_EQ(WrittenElsewhere(outliers0, c.outlier_pool, written), "");
  if (!same_pool) {
    ASSERT_EQ(c.block_pool, blocks0) << "a source byte changed";
  }
  const std::vector<uint8_t> outliers1 = c.outlier_pool;

  // And back, into fresh poisoned pages.
  const std::vector<uint8_t> blocks1 = c.block_bytes();
  OutlierTokensParams back = c.HostParams(OutlierMove::kToBlockPages, c.spare_page);
  ASSERT_TRUE(CheckOutlierBatch(back, c.num_block_pages, c.num_outlier_pages, same_pool).ok());
  OutlierTokensRef(back);
  written.assign(c.block_bytes().size(), false);
  for (const Move& m : moves) {
    for (int side = 0; side < 2; ++side) {
      for (int h = 0; h < n_kv; ++h) {
        const int64_t from = RowAt(l, m.block_page, side, h, m.token);
        const int64_t to_at = RowAt(l, m.spare_page, side, h, m.token);
        ASSERT_EQ(std::memcmp(c.block_bytes().data() + to_at, blocks0.data() + from, 2 * hd), 0)
            << "token " << m.token << " of page " << m.spare_page << " head " << h;
        Mark(written, to_at, l);
      }
    }
  }
  // Every other byte of the spare pages is still poison, every byte elsewhere unchanged.
  ASSERT_EQ(WrittenElsewhere(blocks1, c.block_bytes(), written), "");
  if (!same_pool) {
    ASSERT_EQ(c.outlier_pool, outliers1) << "a source byte changed";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, OutlierTokensRefTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(1, 16, 64), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return ShapeName(info.param);
                         });

// One block of B = 16, two pools, the outlier pages 2 then 0 (page 1 nobody names).
struct BoundaryCase {
  KvPoolLayout layout = MakeKvPoolLayout(2, 64, 16, 8, 8, CoeffDtype::kFp16);
  std::vector<uint8_t> block_pool, outlier_pool;
  int32_t block_page = 0;
  uint64_t mask = 0;
  int32_t first_slot = 0;
  std::vector<int32_t> outlier_page = {2, 0};

  void Run(std::mt19937_64& rng) {
    block_pool.assign(static_cast<size_t>(layout.page_bytes), testing::kPoison);
    outlier_pool.assign(static_cast<size_t>(3 * layout.page_bytes), testing::kPoison);
    testing::FillFullPage(layout, block_pool, 0, rng);
    OutlierTokensParams p;
    p.layout = layout;
    p.block_pool = block_pool.data();
    p.outlier_pool = outlier_pool.data();
    p.block_page = &block_page;
    p.mask = &mask;
    p.first_slot = &first_slot;
    p.outlier_page = outlier_page.data();
    p.n_blocks = 1;
    ASSERT_TRUE(CheckOutlierBatch(p, 1, 3, false).ok());
    OutlierTokensRef(p);
  }
  // Token t of the block landed in `slot` of `page` (every head, both sides).
  void ExpectAt(int t, int32_t page, int slot) {
    expected.resize(outlier_pool.size(), false);
    for (int side = 0; side < 2; ++side) {
      for (int h = 0; h < layout.n_kv_heads; ++h) {
        Mark(expected, RowAt(layout, page, side, h, slot), layout);
        EXPECT_EQ(
            std::memcmp(outlier_pool.data() + RowAt(layout, page, side, h, slot),
                        block_pool.data() + RowAt(layout, 0, side, h, t), 2 * layout.head_dim),
            0)
            << "token " << t << " in slot " << slot << " of page " << page;
      }
    }
  }
  // "" when nothing outside the rows ExpectAt named was written.
  std::string WrittenOutsideExpected() const {
    const std::vector<uint8_t> poison(outlier_pool.size(), testing::kPoison);
    return WrittenElsewhere(poison, outlier_pool, expected);
  }

  std::vector<bool> expected;  // bytes of outlier_pool ExpectAt named
};

TEST(OutlierTokensRefSlotsTest, OutliersCrossIntoTheSecondPage) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);

  // Five outliers from slot 13: three fill page 2, two start page 0.
  BoundaryCase a;
  a.mask = (1u << 0) | (1u << 3) | (1u << 7) | (1u << 8) | (1u << 15);
  a.first_slot = 13;
  ASSERT_NO_FATAL_FAILURE(a.Run(rng));
  a.ExpectAt(0, 2, 13);
  a.ExpectAt(3, 2, 14);
  a.ExpectAt(7, 2, 15);
  a.ExpectAt(8, 0, 0);
  a.ExpectAt(15, 0, 1);
  EXPECT_EQ(a.WrittenOutsideExpected(), "");

  // Ending exactly at B: the second page is never touched (it may be -1).
  BoundaryCase b;
  b.mask = 0x1f;
  b.first_slot = 11;
  b.outlier_page = {2, -1};
  ASSERT_NO_FATAL_FAILURE(b.Run(rng));
  for (int k = 0; k < 5; ++k) b.ExpectAt(k, 2, 11 + k);
  EXPECT_EQ(b.WrittenOutsideExpected(), "");

  // A whole block from slot 9: 7 in the first page, 9 in the second.
  BoundaryCase c;
  c.mask = 0xffff;
  c.first_slot = 9;
  ASSERT_NO_FATAL_FAILURE(c.Run(rng));
  for (int t = 0; t < 16; ++t) c.ExpectAt(t, t < 7 ? 2 : 0, t < 7 ? 9 + t : t - 7);
  EXPECT_EQ(c.WrittenOutsideExpected(), "");
}

// Two valid blocks; each rejection changes one thing and restores it.
TEST(OutlierTokensRefCheckTest, RejectsUnsafeBatchesOneByOne) {
  OutlierTokensParams p;
  p.layout = MakeKvPoolLayout(2, 64, 16, 8, 8, CoeffDtype::kFp16);
  // Block 0: tokens 0, 1, 3 -> slots 14, 15 of page 2 and 0 of page 3.
  // Block 1: tokens 4..7 -> slots 1..4 of page 3.
  std::vector<int32_t> block_page = {0, 1}, first_slot = {14, 1}, outlier_page = {2, 3, 3, -1};
  std::vector<uint64_t> mask = {0b1011, 0xf0};
  p.block_page = block_page.data();
  p.mask = mask.data();
  p.first_slot = first_slot.data();
  p.outlier_page = outlier_page.data();
  p.n_blocks = 2;
  const auto ok = [&](bool same_pool) { return CheckOutlierBatch(p, 4, 4, same_pool).ok(); };
  const auto rejected = [&](bool same_pool) {
    const absl::Status s = CheckOutlierBatch(p, 4, 4, same_pool);
    return s.code() == absl::StatusCode::kInvalidArgument;
  };
  for (OutlierMove dir : {OutlierMove::kToOutlierPages, OutlierMove::kToBlockPages}) {
    p.direction = dir;
    EXPECT_TRUE(ok(false));
    EXPECT_TRUE(ok(true));
  }
  p.direction = OutlierMove::kToOutlierPages;

  p.layout = MakeKvPoolLayout(2, 64, 65, 8, 8, CoeffDtype::kFp16);
  EXPECT_TRUE(rejected(false)) << "block size 65";
  p.layout = MakeKvPoolLayout(2, 96, 16, 8, 8, CoeffDtype::kFp16);
  EXPECT_TRUE(rejected(false)) << "head_dim 96";
  p.layout = MakeKvPoolLayout(2, 64, 16, 8, 8, CoeffDtype::kFp16);

  p.n_blocks = -1;
  EXPECT_TRUE(rejected(false)) << "negative n_blocks";
  p.n_blocks = 2;

  mask[1] = 0x10f0;  // bit 12 is fine, bit 16 is past B
  EXPECT_TRUE(ok(false));
  mask[1] = 0x100f0;
  EXPECT_TRUE(rejected(false)) << "mask bit past B";
  mask[1] = 0xf0;

  for (int32_t bad : {-1, 16}) {
    first_slot[1] = bad;
    EXPECT_TRUE(rejected(false)) << "first slot " << bad;
  }
  first_slot[1] = 1;

  for (int32_t bad : {-1, 4}) {
    block_page[0] = bad;
    EXPECT_TRUE(rejected(false)) << "block page " << bad;
  }
  block_page[0] = 0;

  for (int32_t bad : {-1, 4}) {
    outlier_page[2] = bad;
    EXPECT_TRUE(rejected(false)) << "first outlier page " << bad;
  }
  outlier_page[2] = 3;

  // Block 0 straddles: its second page must exist; block 1's -1 is never read.
  for (int32_t bad : {-1, 4}) {
    outlier_page[1] = bad;
    EXPECT_TRUE(rejected(false)) << "second outlier page " << bad;
  }
  outlier_page[1] = 3;

  // A block without outliers names no pages.
  mask[1] = 0;
  outlier_page[2] = -1;
  EXPECT_TRUE(ok(false));
  mask[1] = 0xf0;
  outlier_page[2] = 3;

  // Block 1 from slot 0 of page 3: block 0's third outlier is there.
  first_slot[1] = 0;
  EXPECT_TRUE(rejected(false)) << "one outlier slot written twice";
  first_slot[1] = 1;

  // Expanding both blocks into page 0: disjoint tokens are fine, one token twice is not.
  p.direction = OutlierMove::kToBlockPages;
  block_page[1] = 0;
  EXPECT_TRUE(ok(false));
  mask[1] = 0xf2;  // token 1 of page 0 from both blocks
  EXPECT_TRUE(rejected(false)) << "one block token written twice";
  mask[1] = 0xf0;
  block_page[1] = 1;
  p.direction = OutlierMove::kToOutlierPages;

  // One pool: block 1's outliers into tokens 0..3 of page 0, which block 0 reads (0, 1, 3).
  // Two pools: page 0 of the outlier pool is another buffer.
  outlier_page[2] = 0;
  first_slot[1] = 0;
  EXPECT_TRUE(ok(false));
  EXPECT_TRUE(rejected(true)) << "a destination token read by the batch";
  first_slot[1] = 4;  // tokens 4..7 of page 0: not read by block 0 (they are block 0's, unmasked)
  EXPECT_TRUE(ok(true));
}

}  // namespace
}  // namespace subspace::kernels
