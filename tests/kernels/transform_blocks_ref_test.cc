// The transform codec's block twins (transform_blocks_ref.h) against core's codec, the
// reference for what a coded row means (TransformCode::Encode / Decode, one row at a time,
// components in index order): the twin's codes, unpacked through the shared run layout, are the
// codec's codes of the same rows (keys rotated back from their positions first when coded
// before RoPE), and its expansion is the codec's decoding of those codes (rotated to the
// positions again), at fp16.
#include "tests/kernels/transform_blocks_ref.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/cpu/ops.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

using testing::TransformCase;
using testing::TransformCaseOptions;

// Row t of head h's keys (side 0) or values of block `blk`'s full page, widened; keys rotated
// back from their positions when the case codes them before RoPE (as TransformKvCache does).
std::vector<float> PageRow(const TransformCase& c, int blk, int h, int side, int t) {
  const KvPoolLayout& l = c.layout;
  const int d = l.head_dim;
  const int64_t at = (side == 0 ? l.FullK(c.full_page[static_cast<size_t>(blk)], h)
                                : l.FullV(c.full_page[static_cast<size_t>(blk)], h)) +
                     int64_t{t} * d * 2;
  std::vector<float> row(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) row[static_cast<size_t>(i)] = testing::PoolHalf(c.pool, at + 2 * i);
  if (side == 0 && c.rope.has_value()) {
    RopeSchedule back = *c.rope;
    back.mscale = 1.0 / back.mscale;
    const int64_t pos = -(int64_t{c.first_pos[static_cast<size_t>(blk)]} + t);
    cpu::Rope(row.data(), 1, 1, d, back, &pos);
  }
  return row;
}

// The twin's codes of row t, by component index (0 for components without bits).
std::vector<uint32_t> SlotCodes(const TransformCase& c, const TransformCode& code, int blk, int h,
                                int side, int t) {
  const KvPoolLayout& l = c.layout;
  const int d = l.head_dim;
  const int32_t* n = c.tables.ints.data() + (int64_t{side} * l.n_kv_heads + h) * TransformInts(d);
  const uint8_t* run =
      c.pool.data() +
      l.Slot(c.slab_page[static_cast<size_t>(blk)], c.slot[static_cast<size_t>(blk)]) +
      n[TransformField::kRunOffset];
  const CodedRunLayout layout = LayOutCodedRun(code, l.block_size);
  std::vector<uint32_t> codes(static_cast<size_t>(d), 0);
  for (int a = 0; a < layout.active(); ++a) {
    const int bits =
        code.components[static_cast<size_t>(layout.components[static_cast<size_t>(a)])].bits;
    const uint8_t* p = run + layout.byte_at[static_cast<size_t>(a)];
    uint32_t v = 0;
    for (int k = 0; k < bits; ++k) {
      const int bit = t * bits + k;
      v |= static_cast<uint32_t>((p[bit >> 3] >> (bit & 7)) & 1u) << k;
    }
    codes[static_cast<size_t>(layout.components[static_cast<size_t>(a)])] = v;
  }
  return codes;
}

// The codec's packed row of `codes` (component order, least significant bit first).
std::vector<uint8_t> PackRow(const TransformCode& code, const std::vector<uint32_t>& codes) {
  std::vector<uint8_t> row(static_cast<size_t>(code.BytesPerRow()) + 1, 0);
  int64_t bit = 0;
  for (int j = 0; j < code.dim; ++j) {
    for (int k = 0; k < code.components[static_cast<size_t>(j)].bits; ++k, ++bit) {
      if ((codes[static_cast<size_t>(j)] >> k) & 1u)
        row[static_cast<size_t>(bit >> 3)] |= 1u << (bit & 7);
    }
  }
  return row;
}

std::vector<uint32_t> UnpackRow(const TransformCode& code, const std::vector<uint8_t>& row) {
  std::vector<uint32_t> codes(static_cast<size_t>(code.dim), 0);
  int64_t bit = 0;
  for (int j = 0; j < code.dim; ++j) {
    for (int k = 0; k < code.components[static_cast<size_t>(j)].bits; ++k, ++bit) {
      codes[static_cast<size_t>(j)] |=
          static_cast<uint32_t>((row[static_cast<size_t>(bit >> 3)] >> (bit & 7)) & 1u) << k;
    }
  }
  return codes;
}

struct Shape {
  int head_dim, block_size;
  bool pre_rope, halves;
  int rope_dim;
  double mscale;
};

class TransformBlocksRefTest : public ::testing::TestWithParam<Shape> {};

TEST_P(TransformBlocksRefTest, CodesAreTheCodecsAndExpansionDecodesThem) {
  const Shape s = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  TransformCaseOptions o;
  o.head_dim = s.head_dim;
  o.block_size = s.block_size;
  o.pre_rope = s.pre_rope;
  o.halves = s.halves;
  o.rope_dim = s.rope_dim;
  o.mscale = s.mscale;
  TransformCase c = testing::RandomTransformCase(o, rng);
  const KvPoolLayout& l = c.layout;
  const TransformCodeParams cp = c.CodeParams();
  ASSERT_TRUE(CheckTransformCodeBatch(cp, c.num_pages, c.num_pages).ok());
  const std::vector<uint8_t> before = c.pool;
  TransformCodeRef(cp);
  // Only the slots' payloads changed.
  for (int32_t page = 0; page < c.num_pages; ++page) {
    for (int64_t i = 0; i < l.page_bytes; ++i) {
      const int64_t at = l.Page(page) + i;
      bool in_slot = false;
      for (int b = 0; b < c.n_blocks(); ++b) {
        in_slot =
            in_slot || (c.slab_page[static_cast<size_t>(b)] == page &&
                        i >= c.slot[static_cast<size_t>(b)] * l.slot_bytes &&
                        i < c.slot[static_cast<size_t>(b)] * l.slot_bytes + c.tables.coded_bytes);
      }
      if (!in_slot)
        ASSERT_EQ(c.pool[static_cast<size_t>(at)], before[static_cast<size_t>(at)]) << at;
    }
  }

  std::vector<uint8_t> dst(static_cast<size_t>(c.n_blocks() * l.page_bytes), testing::kPoison);
  std::vector<int32_t> dst_page(static_cast<size_t>(c.n_blocks()));
  for (int b = 0; b < c.n_blocks(); ++b) dst_page[static_cast<size_t>(b)] = c.n_blocks() - 1 - b;
  const TransformExpandParams ep = c.ExpandParams(&dst, dst_page);
  ASSERT_TRUE(CheckTransformExpandBatch(ep, c.num_pages, c.n_blocks()).ok());
  TransformExpandRef(ep);

  int64_t codes = 0, differing = 0;
  const int d = l.head_dim;
  for (int b = 0; b < c.n_blocks(); ++b) {
    for (int side = 0; side < 2; ++side) {
      for (int h = 0; h < l.n_kv_heads; ++h) {
        const TransformCode& code =
            (side == 0 ? c.key_codes : c.value_codes)[static_cast<size_t>(h)];
        for (int t = 0; t < l.block_size; ++t) {
          std::vector<float> x = PageRow(c, b, h, side, t);
          std::vector<uint8_t> packed(static_cast<size_t>(code.BytesPerRow()) + 1, 0);
          code.Encode(x.data(), packed.data());
          const std::vector<uint32_t> want = UnpackRow(code, packed);
          const std::vector<uint32_t> got = SlotCodes(c, code, b, h, side, t);
          for (int j = 0; j < d; ++j) {
            if (code.components[static_cast<size_t>(j)].bits == 0) continue;
            ++codes;
            const int64_t diff =
                int64_t{got[static_cast<size_t>(j)]} - want[static_cast<size_t>(j)];
            if (diff == 0) continue;
            ++differing;
            ASSERT_LE(std::abs(diff), 1) << "block " << b << " side " << side << " head " << h
                                         << " token " << t << " component " << j;
          }
          // The expansion: the codec's decoding of the twin's own codes, rotated back to the
          // token's position, at fp16.
          std::vector<float> y(static_cast<size_t>(d));
          code.Decode(PackRow(code, got).data(), y.data());
          if (side == 0 && c.rope.has_value()) {
            const int64_t pos = c.first_pos[static_cast<size_t>(b)] + t;
            cpu::Rope(y.data(), 1, 1, d, *c.rope, &pos);
          }
          double amax = 0.0;
          for (float v : y) amax = std::max(amax, std::fabs(double{v}));
          const int64_t at = (side == 0 ? l.FullK(dst_page[static_cast<size_t>(b)], h)
                                        : l.FullV(dst_page[static_cast<size_t>(b)], h)) +
                             int64_t{t} * d * 2;
          for (int i = 0; i < d; ++i) {
            const double g = testing::PoolHalf(dst, at + 2 * i);
            ASSERT_NEAR(g, y[static_cast<size_t>(i)],
                        2e-3 * std::fabs(y[static_cast<size_t>(i)]) + 1e-5 * amax)
                << "block " << b << " side " << side << " head " << h << " token " << t << " dim "
                << i;
          }
        }
      }
    }
  }
  EXPECT_GT(codes, 0);
  EXPECT_LE(differing * 100, codes) << differing << " of " << codes << " codes differ";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, TransformBlocksRefTest,
    ::testing::Values(Shape{64, 16, false, false, 0, 1.0}, Shape{128, 16, false, false, 0, 1.0},
                      Shape{64, 7, false, false, 0, 1.0}, Shape{64, 16, true, false, 0, 1.0},
                      Shape{128, 32, true, true, 0, 1.0}, Shape{64, 5, true, true, 32, 1.3},
                      Shape{128, 16, true, false, 64, 1.0}));

TEST(TransformBlocksCheckTest, RefusesUnsafeBatches) {
  std::mt19937_64 rng(7);
  TransformCase c = testing::RandomTransformCase({.n_blocks = 2}, rng);
  TransformCodeParams p = c.CodeParams();
  EXPECT_TRUE(CheckTransformCodeBatch(p, c.num_pages, c.num_pages).ok());
  std::vector<int32_t> same = {c.slot[0], c.slot[0]}, pages = {c.slab_page[0], c.slab_page[0]};
  p.dst_slot = same.data();
  p.dst_page = pages.data();
  EXPECT_EQ(CheckTransformCodeBatch(p, c.num_pages, c.num_pages).code(),
            absl::StatusCode::kInvalidArgument);
  p = c.CodeParams();
  std::vector<int32_t> into_source = {0, 0};
  p.dst_page = into_source.data();
  EXPECT_EQ(CheckTransformCodeBatch(p, c.num_pages, c.num_pages).code(),
            absl::StatusCode::kInvalidArgument);
  p = c.CodeParams();
  p.layout.slot_bytes = p.layout.page_bytes + 16;
  EXPECT_EQ(CheckTransformCodeBatch(p, c.num_pages, c.num_pages).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> dst(static_cast<size_t>(2 * c.layout.page_bytes));
  std::vector<int32_t> twice = {0, 0};
  TransformExpandParams e = c.ExpandParams(&dst, twice);
  EXPECT_EQ(CheckTransformExpandBatch(e, c.num_pages, 2).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace subspace::kernels
