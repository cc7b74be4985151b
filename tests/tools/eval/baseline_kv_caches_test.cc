// The evaluation's baseline caches: the formats' round trips (q8_0 read back through the GGUF
// dequantizer, q4_0's and KIVI's error bounds), attention against the paged cache, eviction
// against a cache that only ever held the sinks and the window, and the footprints.
#include "tools/eval/baseline_kv_caches.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/base/ggml_types.h"
#include "core/kvcache/paged_kv_cache.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"

namespace subspace::eval {
namespace {

constexpr KvCacheGeometry kGeom{2, 2, 64};

std::vector<float> RandomRow(int n, uint32_t seed, float spread = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, spread);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = nd(rng);
  return x;
}

TEST(BaselineFormatsTest, Q8_0RoundTripIsWhatTheGgufDequantizerReadsBack) {
  std::vector<float> x = RandomRow(64, 1, 3.0f);
  std::vector<float> rt = x;
  RoundTripQ8_0(rt);
  // Pack the blocks as a GGUF q8_0 tensor stores them, and read them back as the loader does.
  std::vector<BlockQ8_0> blocks(2);
  for (int b = 0; b < 2; ++b) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b * 32 + j]));
    const float d = amax / 127.0f;
    blocks[b].scale_f16 = Fp32ToFp16(d);
    for (int j = 0; j < 32; ++j) {
      blocks[b].q[j] = static_cast<int8_t>(std::round(x[b * 32 + j] / d));
    }
  }
  std::vector<float> loaded(64);
  DequantizeRow(GgmlType::kQ8_0, blocks.data(), loaded.data(), 64);
  for (int i = 0; i < 64; ++i) {
    EXPECT_FLOAT_EQ(rt[i], loaded[i]) << i;
    // Half a step, plus up to 127 steps of the fp16 rounding of d (2^-11 relative).
    EXPECT_NEAR(rt[i], x[i], std::fabs(Fp16ToFp32(blocks[i / 32].scale_f16)) * 0.57f) << i;
  }
}

TEST(BaselineFormatsTest, Q4_0KeepsTheLargestAndBoundsTheRest) {
  std::vector<float> x = RandomRow(32, 2, 2.0f);
  x[5] = -9.0f;  // the signed value of largest magnitude: d = -9 / -8 > 0
  std::vector<float> rt = x;
  RoundTripQ4_0(rt);
  const float d = Fp16ToFp32(Fp32ToFp16(-9.0f / -8.0f));
  EXPECT_FLOAT_EQ(rt[5], -8.0f * d);  // q = 0
  for (int i = 0; i < 32; ++i) {
    // 16 levels (q - 8) d for q in [0, 15]: half a step inside, clamped at +7 d above.
    const float hi = 7.0f * d;
    const float want_err = x[i] > hi ? x[i] - hi : 0.51f * d;
    EXPECT_LE(std::fabs(rt[i] - x[i]), want_err + 1e-6f) << i << " " << x[i];
    const float q = rt[i] / d + 8.0f;
    EXPECT_NEAR(q, std::round(q), 1e-4f) << "not on the grid: " << rt[i];
  }
  std::vector<float> zero(32, 0.0f);
  RoundTripQ4_0(zero);
  for (float v : zero) EXPECT_EQ(v, 0.0f);
}

TEST(BaselineFormatsTest, Asym4SixteenLevelsBetweenMinAndMax) {
  std::vector<float> x = RandomRow(40, 3);
  std::vector<float> rt = x;
  RoundTripAsym4(rt.data(), 20, 2);  // every other element
  float mn = x[0], mx = x[0];
  for (int i = 0; i < 20; ++i) {
    mn = std::min(mn, x[2 * i]);
    mx = std::max(mx, x[2 * i]);
  }
  const float step = (mx - mn) / 15.0f;
  for (int i = 0; i < 40; ++i) {
    if (i % 2) {
      EXPECT_EQ(rt[i], x[i]) << "outside the group";
    } else {
      EXPECT_LE(std::fabs(rt[i] - x[i]), 0.51f * step + 2e-3f * std::fabs(mx - mn)) << i;
    }
  }
}

// Both caches fed the same tokens; the last token's attention in every layer.
std::vector<std::vector<float>> LastTokenAttention(KvCache& cache, const cache_test::Data& d,
                                                   int64_t tokens, int n_heads, uint32_t seed) {
  const SeqId seq = *cache.CreateSequence();
  cache_test::Append(cache, seq, d, 0, tokens);
  std::vector<std::vector<float>> out;
  const std::vector<float> q = cache_test::RandomQ(1, n_heads, kGeom.head_dim, seed);
  for (int l = 0; l < kGeom.n_layers; ++l) {
    out.push_back(cache_test::RunAttend(cache, l, seq, tokens - 1, 1, q, n_heads));
  }
  return out;
}

std::unique_ptr<BaselineKvCache> Make(BaselineKind kind, int sinks = 4, int window = 64) {
  BaselineKvCacheConfig c;
  c.geometry = kGeom;
  c.kind = kind;
  c.sink_tokens = sinks;
  c.window_tokens = window;
  c.capacity_bytes = int64_t{64} << 20;
  absl::StatusOr<std::unique_ptr<BaselineKvCache>> cache = BaselineKvCache::Create(c);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? *std::move(cache) : nullptr;
}

std::unique_ptr<PagedKvCache> Paged() {
  PagedKvCache::Config c;
  c.geometry = kGeom;
  c.block_size = 16;
  c.capacity_bytes = int64_t{64} << 20;
  return *PagedKvCache::Create(c);
}

TEST(BaselineKvCacheTest, FullAttendsAsThePagedCache) {
  const cache_test::Data d = cache_test::RandomKv(kGeom, 300, 4);
  auto want = LastTokenAttention(*Paged(), d, 300, 6, 5);
  auto got = LastTokenAttention(*Make(BaselineKind::kFull), d, 300, 6, 5);
  for (int l = 0; l < kGeom.n_layers; ++l) EXPECT_LT(cache_test::RelErr(got[l], want[l]), 1e-5);
}

TEST(BaselineKvCacheTest, EvictionAttendsToTheSinksAndTheWindowOnly) {
  const int64_t T = 300;
  const int S = 4, W = 64;
  const cache_test::Data d = cache_test::RandomKv(kGeom, T, 6);
  // A cache that only ever held tokens [0, S) and [T - W, T): keys are post-RoPE, so where they
  // sit in the sequence does not change the attention.
  cache_test::Data kept;
  const int64_t row = static_cast<int64_t>(kGeom.n_kv_heads) * kGeom.head_dim;
  kept.k.resize(kGeom.n_layers);
  kept.v.resize(kGeom.n_layers);
  for (int l = 0; l < kGeom.n_layers; ++l) {
    for (int64_t t = 0; t < T; ++t) {
      if (t >= S && t < T - W) continue;
      kept.k[l].insert(kept.k[l].end(), d.k[l].begin() + t * row, d.k[l].begin() + (t + 1) * row);
      kept.v[l].insert(kept.v[l].end(), d.v[l].begin() + t * row, d.v[l].begin() + (t + 1) * row);
    }
  }
  auto want = LastTokenAttention(*Paged(), kept, S + W, 6, 7);
  auto got = LastTokenAttention(*Make(BaselineKind::kEvict, S, W), d, T, 6, 7);
  auto full = LastTokenAttention(*Paged(), d, T, 6, 7);
  for (int l = 0; l < kGeom.n_layers; ++l) {
    EXPECT_LT(cache_test::RelErr(got[l], want[l]), 1e-5);
    EXPECT_GT(cache_test::RelErr(got[l], full[l]), 1e-2) << "evicted nothing";
  }
  // Shorter than S + W: nothing to evict.
  auto short_full = LastTokenAttention(*Paged(), d, S + W, 6, 8);
  auto short_evict = LastTokenAttention(*Make(BaselineKind::kEvict, S, W), d, S + W, 6, 8);
  for (int l = 0; l < kGeom.n_layers; ++l) {
    EXPECT_LT(cache_test::RelErr(short_evict[l], short_full[l]), 1e-5);
  }
}

TEST(BaselineKvCacheTest, QuantizedCachesAttendCloseToFullAndInOrder) {
  const cache_test::Data d = cache_test::RandomKv(kGeom, 200, 9);
  auto full = LastTokenAttention(*Paged(), d, 200, 6, 10);
  double err[3];
  int i = 0;
  for (BaselineKind k : {BaselineKind::kQ8_0, BaselineKind::kKivi4, BaselineKind::kQ4_0}) {
    auto got = LastTokenAttention(*Make(k), d, 200, 6, 10);
    err[i] = 0;
    for (int l = 0; l < kGeom.n_layers; ++l) err[i] += cache_test::RelErr(got[l], full[l]) / 2;
    EXPECT_GT(err[i], 0.0) << BaselineKindName(k);
    EXPECT_LT(err[i], 0.3) << BaselineKindName(k);
    ++i;
  }
  EXPECT_LT(err[0], err[1]);  // 8 bits before 4
  EXPECT_LT(err[0], err[2]);
}

TEST(BaselineKvCacheTest, KiviKeepsTheNewestKeyGroupExact) {
  // One-hot values (v_t = e_t, exact in KIVI's per-token groups): the output is the attention
  // weights themselves, so it shows whether the keys were quantized.
  cache_test::Data d = cache_test::RandomKv(kGeom, 40, 11);
  const int64_t row = static_cast<int64_t>(kGeom.n_kv_heads) * kGeom.head_dim;
  for (int l = 0; l < kGeom.n_layers; ++l) {
    std::fill(d.v[l].begin(), d.v[l].end(), 0.0f);
    for (int64_t t = 0; t < 40; ++t) {
      for (int h = 0; h < kGeom.n_kv_heads; ++h) d.v[l][t * row + h * kGeom.head_dim + t] = 1.0f;
    }
  }
  for (int64_t tokens : {31, 32, 40}) {
    auto full = LastTokenAttention(*Make(BaselineKind::kFull), d, tokens, 2, 12);
    auto kivi = LastTokenAttention(*Make(BaselineKind::kKivi4), d, tokens, 2, 12);
    for (int l = 0; l < kGeom.n_layers; ++l) {
      const double err = cache_test::RelErr(kivi[l], full[l]);
      if (tokens < 32) {
        EXPECT_LT(err, 1e-3) << "the residual group's keys must be exact (values: fp16 scale)";
      } else {
        EXPECT_GT(err, 3e-3) << "a complete group's keys must be quantized (" << tokens << ")";
        EXPECT_LT(err, 0.5) << tokens;
      }
    }
  }
}

TEST(BaselineKvCacheTest, Footprints) {
  const double fp16 = 2.0 * 2 * kGeom.n_layers * kGeom.n_kv_heads * kGeom.head_dim;
  BaselineKvCacheConfig c{.geometry = kGeom};
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 2048), fp16);
  c.kind = BaselineKind::kQ8_0;
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 2048), fp16 * 34.0 / 64.0);
  c.kind = BaselineKind::kQ4_0;
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 2048), fp16 * 18.0 / 64.0);
  c.kind = BaselineKind::kEvict;
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 2048), fp16 * 68.0 / 2048.0);
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 50), fp16);
  c.kind = BaselineKind::kKivi4;
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 2048), fp16 * (0.5 + 4.0 / 32) / 2.0);
  EXPECT_FALSE(ParseBaselineKind("q5_k").ok());
  EXPECT_EQ(*ParseBaselineKind("kivi4"), BaselineKind::kKivi4);
}

}  // namespace
}  // namespace subspace::eval
