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

#include "core/base/rope.h"
#include "core/base/tensor_types.h"
#include "core/cpu/ops.h"
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
  DequantizeRow(TensorType::kQ8_0, blocks.data(), loaded.data(), 64);
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
    auto kivi2 = LastTokenAttention(*Make(BaselineKind::kKivi2), d, tokens, 2, 12);
    for (int l = 0; l < kGeom.n_layers && tokens >= 32; ++l) {
      EXPECT_GT(cache_test::RelErr(kivi2[l], full[l]), 2 * cache_test::RelErr(kivi[l], full[l]))
          << "2-bit keys must be coarser than 4-bit ones";
    }
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

TEST(BaselineKvCacheTest, ExactSinksAndWindowReadTheFormatOnlyBetweenThem) {
  const int64_t T = 150;
  const int S = 4, W = 32;
  const cache_test::Data d = cache_test::RandomKv(kGeom, T, 22);
  // The reference: a paged cache holding the q4_0 round trip of tokens [S, T - W) and the
  // exact rows of the others.
  cache_test::Data want = d;
  for (int l = 0; l < kGeom.n_layers; ++l) {
    const int64_t row = static_cast<int64_t>(kGeom.n_kv_heads) * kGeom.head_dim;
    for (int64_t i = S * row; i < (T - W) * row; i += kGeom.head_dim) {
      RoundTripQ4_0(std::span<float>(want.k[l].data() + i, kGeom.head_dim));
      RoundTripQ4_0(std::span<float>(want.v[l].data() + i, kGeom.head_dim));
    }
  }
  BaselineKvCacheConfig c{
      .geometry = kGeom, .kind = BaselineKind::kQ4_0, .sink_tokens = S, .window_tokens = W};
  c.capacity_bytes = int64_t{64} << 20;
  c.exact_sinks_window = true;
  auto got = LastTokenAttention(*BaselineKvCache::Create(c).value(), d, T, 4, 23);
  auto ref = LastTokenAttention(*Paged(), want, T, 4, 23);
  auto all = LastTokenAttention(*Make(BaselineKind::kQ4_0), d, T, 4, 23);
  for (int l = 0; l < kGeom.n_layers; ++l) {
    EXPECT_LT(cache_test::RelErr(got[l], ref[l]), 1e-5);
    EXPECT_GT(cache_test::RelErr(all[l], ref[l]), 1e-3) << "the window was quantized too";
  }
  const double fp16 = 2.0 * 2 * kGeom.n_layers * kGeom.n_kv_heads * kGeom.head_dim;
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 1000), (fp16 * 36 + fp16 * 18.0 / 64.0 * 964) / 1000.0);
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 20), fp16);
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
  c.kind = BaselineKind::kKivi2;
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 2048), fp16 * (0.25 + 4.0 / 32) / 2.0);
  c.kind = BaselineKind::kHq4_0;
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 2048), fp16 * 18.0 / 64.0);
  c.kind = BaselineKind::kHq8_0;
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 2048), fp16 * 34.0 / 64.0);
  c.kind = BaselineKind::kTurbo2_5;  // 2.5 bits + 16 per 64-value row
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 2048), fp16 * (2.5 + 0.25) / 16.0);
  c.kind = BaselineKind::kTurbo3_5;
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 2048), fp16 * (3.5 + 0.25) / 16.0);
  EXPECT_FALSE(ParseBaselineKind("q5_k").ok());
  EXPECT_FALSE(ParseBaselineKind("tc").ok()) << "needs codes";
  EXPECT_EQ(*ParseBaselineKind("kivi4"), BaselineKind::kKivi4);
  for (BaselineKind k : {BaselineKind::kHq8_0, BaselineKind::kHq4_0, BaselineKind::kTurbo2_5,
                         BaselineKind::kTurbo3_5, BaselineKind::kKivi2}) {
    EXPECT_EQ(*ParseBaselineKind(BaselineKindName(k)), k);
  }
}

TEST(BaselineKvCacheTest, RotatedCachesQuantizeInTheRotatedBasis) {
  // A row with one outlier channel: q4_0's block scale is set by it, so the rest of its block
  // loses resolution; after the rotation the energy is spread and the error drops.
  cache_test::Data d = cache_test::RandomKv(kGeom, 64, 13);
  const int64_t row = static_cast<int64_t>(kGeom.n_kv_heads) * kGeom.head_dim;
  for (int l = 0; l < kGeom.n_layers; ++l) {
    for (int64_t t = 0; t < 64; ++t) d.k[l][t * row + 3] = 40.0f;
  }
  auto full = LastTokenAttention(*Paged(), d, 64, 4, 14);
  auto plain = LastTokenAttention(*Make(BaselineKind::kQ4_0), d, 64, 4, 14);
  auto rotated = LastTokenAttention(*Make(BaselineKind::kHq4_0), d, 64, 4, 14);
  auto rotated8 = LastTokenAttention(*Make(BaselineKind::kHq8_0), d, 64, 4, 14);
  for (int l = 0; l < kGeom.n_layers; ++l) {
    const double e_plain = cache_test::RelErr(plain[l], full[l]);
    const double e_rot = cache_test::RelErr(rotated[l], full[l]);
    EXPECT_GT(e_rot, 0.0);
    EXPECT_LT(e_rot, e_plain) << l;
    EXPECT_LT(cache_test::RelErr(rotated8[l], full[l]), e_rot);
  }
  // TurboQuant: more bits, less error, on rows without the outlier.
  const cache_test::Data plain_d = cache_test::RandomKv(kGeom, 64, 20);
  auto full2 = LastTokenAttention(*Paged(), plain_d, 64, 4, 21);
  auto tq25 = LastTokenAttention(*Make(BaselineKind::kTurbo2_5), plain_d, 64, 4, 21);
  auto tq35 = LastTokenAttention(*Make(BaselineKind::kTurbo3_5), plain_d, 64, 4, 21);
  for (int l = 0; l < kGeom.n_layers; ++l) {
    const double e25 = cache_test::RelErr(tq25[l], full2[l]);
    const double e35 = cache_test::RelErr(tq35[l], full2[l]);
    EXPECT_GT(e35, 0.0);
    EXPECT_LT(e35, e25) << l;
  }
  BaselineKvCacheConfig c{.geometry = {1, 1, 96}, .kind = BaselineKind::kHq4_0};
  c.capacity_bytes = 1 << 20;
  EXPECT_FALSE(BaselineKvCache::Create(c).ok()) << "96 is no power of two";
}

// Codes of 8 bits on every component of an identity basis over [-8, 8): the decoded rows are
// within 1/32 of the exact ones.
std::shared_ptr<const std::vector<TransformCode>> FineCodes(int heads, int d, int bits) {
  auto v = std::make_shared<std::vector<TransformCode>>();
  for (int h = 0; h < heads; ++h) {
    TransformCode c;
    c.dim = d;
    c.mean.assign(static_cast<size_t>(d), 0.0f);
    c.basis.assign(static_cast<size_t>(d) * d, 0.0f);
    for (int i = 0; i < d; ++i) c.basis[static_cast<size_t>(i * d + i)] = 1.0f;
    c.components.assign(static_cast<size_t>(d),
                        {.bits = bits,
                         .offset = bits > 0 ? -8.0f : 0.0f,
                         .step = bits > 0 ? 16.0f / static_cast<float>((1 << bits) - 1) : 0.0f});
    v->push_back(std::move(c));
  }
  return v;
}

TEST(BaselineKvCacheTest, TransformCodedTokensAreDecodedCodesOutsideTheSinksAndWindow) {
  const int64_t T = 200;
  const int S = 4, W = 32;
  // 8-bit codes attend close to the full cache, 1-bit ones far from it; and a sequence no
  // longer than S + W has nothing coded at all.
  const cache_test::Data d = cache_test::RandomKv(kGeom, T, 15);
  const int heads = kGeom.n_layers * kGeom.n_kv_heads;
  BaselineKvCacheConfig c{
      .geometry = kGeom, .kind = BaselineKind::kTransform, .sink_tokens = S, .window_tokens = W};
  c.capacity_bytes = int64_t{64} << 20;
  c.key_codes = FineCodes(heads, kGeom.head_dim, 8);
  c.value_codes = FineCodes(heads, kGeom.head_dim, 8);
  auto fine = BaselineKvCache::Create(c);
  ASSERT_TRUE(fine.ok()) << fine.status();
  c.key_codes = FineCodes(heads, kGeom.head_dim, 1);
  c.value_codes = FineCodes(heads, kGeom.head_dim, 1);
  auto coarse = BaselineKvCache::Create(c);
  ASSERT_TRUE(coarse.ok());
  auto full = LastTokenAttention(*Paged(), d, T, 4, 16);
  auto got_fine = LastTokenAttention(**fine, d, T, 4, 16);
  auto got_coarse = LastTokenAttention(**coarse, d, T, 4, 16);
  auto short_coarse = LastTokenAttention(*BaselineKvCache::Create(c).value(), d, S + W, 4, 17);
  auto short_full = LastTokenAttention(*Paged(), d, S + W, 4, 17);
  for (int l = 0; l < kGeom.n_layers; ++l) {
    const double fine_err = cache_test::RelErr(got_fine[l], full[l]);
    EXPECT_LT(fine_err, 0.05);
    EXPECT_GT(cache_test::RelErr(got_coarse[l], full[l]), 5 * fine_err) << "coded nothing";
    EXPECT_LT(cache_test::RelErr(short_coarse[l], short_full[l]), 1e-5) << "all exact";
  }
  // Footprint: S + W = 36 tokens at fp16, the rest 2 x 64 bytes per layer-head.
  const double fp16 = 2.0 * 2 * heads * kGeom.head_dim;
  c.key_codes = FineCodes(heads, kGeom.head_dim, 8);
  c.value_codes = FineCodes(heads, kGeom.head_dim, 8);
  EXPECT_DOUBLE_EQ(BaselineBytesPerToken(c, 1000),
                   (fp16 * 36 + 2.0 * heads * 64 * (1000 - 36)) / 1000.0);
  c.value_codes = FineCodes(heads - 1, kGeom.head_dim, 8);
  EXPECT_FALSE(BaselineKvCache::Create(c).ok()) << "one code short";
}

TEST(BaselineKvCacheTest, PreRopeKeysAreCodedBetweenTheInverseAndTheForwardRotation) {
  // With every component at 8 bits the coded key is the exact one to ~1/32 whichever space it
  // is coded in; what differs is whether RoPE is undone first. A code with a non-zero mean
  // shows it: decoding adds the mean in the coding space, so a key coded pre-RoPE and rotated
  // again differs from one coded post-RoPE.
  const int64_t T = 120;
  const cache_test::Data d = cache_test::RandomKv(kGeom, T, 18);
  const int heads = kGeom.n_layers * kGeom.n_kv_heads;
  RopeParams rp;
  rp.dim = kGeom.head_dim;
  rp.theta = 10000.0;
  const RopeSchedule rope = *RopeSchedule::Make(rp);
  BaselineKvCacheConfig c{
      .geometry = kGeom, .kind = BaselineKind::kTransform, .sink_tokens = 0, .window_tokens = 1};
  c.capacity_bytes = int64_t{64} << 20;
  // 0-bit keys: each coded key IS the code's mean (pre-RoPE: the mean rotated to its position).
  auto mean_codes =
      std::make_shared<std::vector<TransformCode>>(*FineCodes(heads, kGeom.head_dim, 0));
  for (TransformCode& t : *mean_codes) {
    for (int i = 0; i < t.dim; ++i)
      t.mean[static_cast<size_t>(i)] = 0.1f * static_cast<float>(i % 5);
  }
  c.key_codes = mean_codes;
  c.value_codes = FineCodes(heads, kGeom.head_dim, 8);
  auto post = *BaselineKvCache::Create(c);
  c.key_rope = rope;
  auto pre = *BaselineKvCache::Create(c);
  // The reference: a paged cache holding, for tokens before the window, the mean (post) or the
  // mean rotated to the token's position (pre), and exact values.
  cache_test::Data want_post = d, want_pre = d;
  const int64_t row = static_cast<int64_t>(kGeom.n_kv_heads) * kGeom.head_dim;
  for (int l = 0; l < kGeom.n_layers; ++l) {
    for (int64_t t = 0; t + 1 < T; ++t) {
      for (int h = 0; h < kGeom.n_kv_heads; ++h) {
        const std::vector<float>& m =
            (*mean_codes)[static_cast<size_t>(l * kGeom.n_kv_heads + h)].mean;
        std::copy(m.begin(), m.end(), want_post.k[l].begin() + t * row + h * kGeom.head_dim);
        std::copy(m.begin(), m.end(), want_pre.k[l].begin() + t * row + h * kGeom.head_dim);
      }
      cpu::Rope(want_pre.k[l].data() + t * row, 1, kGeom.n_kv_heads, kGeom.head_dim, rope, &t);
    }
  }
  auto got_post = LastTokenAttention(*post, d, T, 4, 19);
  auto got_pre = LastTokenAttention(*pre, d, T, 4, 19);
  auto ref_post = LastTokenAttention(*Paged(), want_post, T, 4, 19);
  auto ref_pre = LastTokenAttention(*Paged(), want_pre, T, 4, 19);
  for (int l = 0; l < kGeom.n_layers; ++l) {
    const double e_post = cache_test::RelErr(got_post[l], ref_post[l]);
    const double e_pre = cache_test::RelErr(got_pre[l], ref_pre[l]);
    const double apart = cache_test::RelErr(ref_pre[l], ref_post[l]);
    EXPECT_LT(e_post, 0.05) << l;  // the values' 8-bit codes
    EXPECT_LT(e_pre, 0.05) << l;
    EXPECT_GT(apart, 5 * std::max(e_pre, e_post)) << "the test cannot tell them apart";
  }
}

}  // namespace
}  // namespace subspace::eval
