// transform_blocks.cu against its CPU twins (TransformCodeRef / TransformExpandRef, themselves
// held to core's TransformCode in transform_blocks_ref_test.cc) across head_dim x block size x
// keys before or after RoPE (adjacent pairs and halves, partial rotary dims, a YaRN-like
// mscale). Fresh random inputs per case; every byte outside the written payloads must come back
// untouched.
//
// Tolerance. Coding: the kernel projects in float, the twin in double, then both quantize
// alike, so a code may round the other way: each differs by at most one step, and at most 1 %
// differ at all. Decoding (both from the twin's codes): both round once to fp16, the kernel
// after a float sum, so |gpu - twin| <= 2e-3 (|twin| + 1e-2 max|row|), two fp16 units with a
// floor for cancellation (as expand_blocks_test.cc argues).
#include "kernels/transform_blocks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/kv_test_data.h"
#include "tests/kernels/transform_blocks_ref.h"

namespace subspace::kernels {
namespace {

using testing::DeviceBuffer;
using testing::ToDevice;
using testing::TransformCase;

// Code `code_index` of token t of block `blk`'s run (side, head), from a pool.
uint32_t CodeAt(const TransformCase& c, const std::vector<uint8_t>& pool, int blk, int side, int h,
                int a, int t) {
  const KvPoolLayout& l = c.layout;
  const int d = l.head_dim;
  const int32_t* n = c.tables.ints.data() + (int64_t{side} * l.n_kv_heads + h) * TransformInts(d);
  const int bits = n[TransformField::kBits + a];
  const uint8_t* p =
      pool.data() +
      l.Slot(c.slab_page[static_cast<size_t>(blk)], c.slot[static_cast<size_t>(blk)]) +
      n[TransformField::kRunOffset] + n[TransformField::kBits + d + a];
  uint32_t v = 0;
  for (int k = 0; k < bits; ++k) {
    const int bit = t * bits + k;
    v |= static_cast<uint32_t>((p[bit >> 3] >> (bit & 7)) & 1u) << k;
  }
  return v;
}

struct Shape {
  int head_dim, block_size;
  bool pre_rope, halves;
  int rope_dim;
  double mscale;
};

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return "d" + std::to_string(s.head_dim) + "_b" + std::to_string(s.block_size) +
         (s.pre_rope ? (s.halves ? "_prerope_halves" : "_prerope") : "_postrope") +
         (s.rope_dim > 0 ? "_rot" + std::to_string(s.rope_dim) : "") +
         (s.mscale != 1.0 ? "_mscale" : "");
}

class TransformBlocksGpuTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(TransformBlocksGpuTest, MatchesCpuTwins) {
  const Shape s = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  TransformCase c = testing::RandomTransformCase({.n_kv = 3,
                                                  .head_dim = s.head_dim,
                                                  .block_size = s.block_size,
                                                  .n_blocks = 5,
                                                  .bits = 2.5,
                                                  .pre_rope = s.pre_rope,
                                                  .halves = s.halves,
                                                  .rope_dim = s.rope_dim,
                                                  .mscale = s.mscale},
                                                 rng);
  const KvPoolLayout& l = c.layout;
  const std::vector<uint8_t> before = c.pool;

  // ---- Coding: the twin on the host pool, the kernel on a copy on the device. ----
  TransformCodeParams p = c.CodeParams();
  ASSERT_TRUE(CheckTransformCodeBatch(p, c.num_pages, c.num_pages).ok());
  TransformCodeRef(p);
  const std::vector<uint8_t> want = c.pool;
  DeviceBuffer<uint8_t> pool = ToDevice(before);
  DeviceBuffer<float> floats = ToDevice(c.tables.floats), cos_sin = ToDevice(c.cos_sin);
  DeviceBuffer<int32_t> ints = ToDevice(c.tables.ints), full = ToDevice(c.full_page),
                        slab = ToDevice(c.slab_page), slot = ToDevice(c.slot),
                        first = ToDevice(c.first_pos);
  ASSERT_TRUE(pool.ok() && floats.ok() && cos_sin.ok() && ints.ok() && full.ok() && slab.ok() &&
              slot.ok() && first.ok());
  p.tables = {floats.get(), ints.get()};
  if (c.rope.has_value()) p.key_rope.cos_sin = cos_sin.get();
  p.src_pool = p.dst_pool = pool.get();
  p.src_page = full.get();
  p.dst_page = slab.get();
  p.dst_slot = slot.get();
  p.first_pos = first.get();
  SUBSPACE_ASSERT_CUDA(LaunchTransformCode(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got;
  SUBSPACE_ASSERT_CUDA(pool.Download(&got));
  // Bytes outside the payloads: as before.
  for (int32_t page = 0; page < c.num_pages; ++page) {
    for (int64_t i = 0; i < l.page_bytes; ++i) {
      bool payload = false;
      for (int b = 0; b < c.n_blocks(); ++b) {
        const int64_t start = int64_t{c.slot[static_cast<size_t>(b)]} * l.slot_bytes;
        payload = payload || (c.slab_page[static_cast<size_t>(b)] == page && i >= start &&
                              i < start + c.tables.coded_bytes);
      }
      const auto at = static_cast<size_t>(l.Page(page) + i);
      if (!payload) {
        ASSERT_EQ(got[at], before[at]) << "page " << page << " byte " << i;
      }
    }
  }
  int64_t codes = 0, differing = 0;
  const int d = l.head_dim;
  for (int b = 0; b < c.n_blocks(); ++b) {
    for (int side = 0; side < 2; ++side) {
      for (int h = 0; h < l.n_kv_heads; ++h) {
        const int32_t* n =
            c.tables.ints.data() + (int64_t{side} * l.n_kv_heads + h) * TransformInts(d);
        for (int a = 0; a < n[TransformField::kActive]; ++a) {
          for (int t = 0; t < l.block_size; ++t) {
            const int64_t g = CodeAt(c, got, b, side, h, a, t),
                          w = CodeAt(c, want, b, side, h, a, t);
            ++codes;
            if (g == w) continue;
            ++differing;
            ASSERT_LE(std::abs(g - w), 1) << "block " << b << " side " << side << " head " << h
                                          << " component " << a << " token " << t;
          }
        }
      }
    }
  }
  ASSERT_GT(codes, 0);
  EXPECT_LE(differing * 100, codes) << differing << " of " << codes << " codes differ";

  // ---- Decoding the twin's codes, into the pool's own full pages (the sources are slab
  // pages), by the twin and by the kernel. ----
  std::vector<int32_t> dst_page(c.full_page.rbegin(), c.full_page.rend());
  std::vector<uint8_t> host = want;
  TransformExpandParams e = c.ExpandParams(&host, dst_page);
  e.src_pool = host.data();
  ASSERT_TRUE(CheckTransformExpandBatch(e, c.num_pages, c.num_pages).ok());
  TransformExpandRef(e);
  DeviceBuffer<uint8_t> pool2 = ToDevice(want);
  DeviceBuffer<int32_t> dst = ToDevice(dst_page);
  ASSERT_TRUE(pool2.ok() && dst.ok());
  e.tables = {floats.get(), ints.get()};
  if (c.rope.has_value()) e.key_rope.cos_sin = cos_sin.get();
  e.src_pool = e.dst_pool = pool2.get();
  e.src_page = slab.get();
  e.src_slot = slot.get();
  e.dst_page = dst.get();
  e.first_pos = first.get();
  SUBSPACE_ASSERT_CUDA(LaunchTransformExpand(e, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  SUBSPACE_ASSERT_CUDA(pool2.Download(&got));
  for (int32_t page = 0; page < c.num_pages; ++page) {
    const bool written = std::find(dst_page.begin(), dst_page.end(), page) != dst_page.end();
    for (int64_t row = 0; row < (written ? 2 * l.Rows() : 0); ++row) {
      const int64_t at = l.Page(page) + 2 * row * d;
      double amax = 0.0;
      for (int i = 0; i < d; ++i)
        amax = std::max(amax, std::fabs(testing::PoolHalf(host, at + 2 * i)));
      for (int i = 0; i < d; ++i) {
        const double w = testing::PoolHalf(host, at + 2 * i),
                     g = testing::PoolHalf(got, at + 2 * i);
        ASSERT_TRUE(std::isfinite(g) && std::fabs(g - w) <= 2e-3 * (std::fabs(w) + 1e-2 * amax))
            << "page " << page << " row " << row << " (K then V, head-major) dim " << i << ": " << g
            << " vs " << w;
      }
    }
    if (!written) {
      for (int64_t i = 0; i < l.page_bytes; ++i) {
        const auto at = static_cast<size_t>(l.Page(page) + i);
        ASSERT_EQ(got[at], want[at]) << "page " << page << " byte " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, TransformBlocksGpuTest,
    ::testing::Values(Shape{64, 16, false, false, 0, 1.0}, Shape{128, 16, false, false, 0, 1.0},
                      Shape{64, 7, false, false, 0, 1.0}, Shape{128, 64, true, false, 0, 1.0},
                      Shape{64, 16, true, true, 0, 1.0}, Shape{64, 5, true, true, 32, 1.3},
                      Shape{128, 16, true, false, 64, 1.0}),
    ShapeName);

TEST(TransformBlocksLaunchTest, RefusesWhatItCannotRun) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  std::mt19937_64 rng(3);
  TransformCase c = testing::RandomTransformCase({.head_dim = 64}, rng);
  TransformCodeParams p = c.CodeParams();
  p.n_blocks = 0;
  EXPECT_EQ(LaunchTransformCode(p, nullptr), cudaSuccess);
  p.layout.head_dim = 96;  // no kernel for it (and no longer one fp16 block a page)
  p.n_blocks = 1;
  EXPECT_EQ(LaunchTransformCode(p, nullptr), cudaErrorInvalidValue);
  TransformExpandParams e{};
  e.layout = c.layout;
  e.layout.slot_bytes = e.layout.page_bytes + 16;
  e.n_blocks = 1;
  EXPECT_EQ(LaunchTransformExpand(e, nullptr), cudaErrorInvalidValue);
  (void)cudaGetLastError();
}

}  // namespace
}  // namespace subspace::kernels
