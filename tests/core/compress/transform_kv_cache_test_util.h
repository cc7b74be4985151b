// The transform-coded cache tests' fixture and reference (transform_kv_cache_test.cc,
// transform_kv_cache_image_test.cc): codes fitted on correlated random rows, the rows the cache
// must hold, attention in double over them.
#ifndef SUBSPACE_TESTS_CORE_COMPRESS_TRANSFORM_KV_CACHE_TEST_UTIL_H_
#define SUBSPACE_TESTS_CORE_COMPRESS_TRANSFORM_KV_CACHE_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/compress/transform_kv_cache.h"
#include "core/cpu/ops.h"
#include "gtest/gtest.h"

namespace subspace::transform_cache_test {

inline constexpr int kLayers = 2, kKv = 2, kHeads = 4, kDim = 32, kBlock = 4, kSinks = 4,
                     kWindow = 8;

struct Variant {
  bool pre_rope = true;   // keys coded before RoPE
  bool weighted = false;  // codes fitted under a per-dim error metric (TransformCode::scale)
  int block = kBlock, sinks = kSinks, window = kWindow;
};

inline KvCacheGeometry Geometry() {
  return {.n_layers = kLayers, .n_kv_heads = kKv, .head_dim = kDim};
}

inline float Fp16(float x) { return HalfToFloat(Fp32ToFp16(x)); }

// Codes fitted on correlated random rows (a few strong directions, as real keys have), under a
// budget of `bits` per component, for every (layer, KV head).
inline std::shared_ptr<const std::vector<TransformCode>> FitCodes(double bits, uint32_t seed,
                                                                  bool weighted = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<TransformStream> streams;
  for (int s = 0; s < kLayers * kKv; ++s) {
    const int rows = 400;
    std::vector<float> mix(kDim * kDim), x(static_cast<size_t>(rows) * kDim);
    for (float& m : mix) m = n01(rng) * 0.3f;
    for (int r = 0; r < rows; ++r) {
      std::vector<float> z(kDim);
      for (int i = 0; i < kDim; ++i) z[i] = n01(rng) * (i < 6 ? 3.0f : 0.3f);
      for (int j = 0; j < kDim; ++j) {
        float acc = 0.5f;
        for (int i = 0; i < kDim; ++i) acc += mix[i * kDim + j] * z[i];
        x[static_cast<size_t>(r) * kDim + j] = acc + z[j];
      }
    }
    std::vector<float> metric;
    for (int i = 0; weighted && i < kDim; ++i) metric.push_back(0.25f + (i % 5) * 0.5f);
    absl::StatusOr<TransformStream> st = AnalyzeStream(x.data(), rows, kDim, {}, metric);
    EXPECT_TRUE(st.ok()) << st.status();
    streams.push_back(*std::move(st));
  }
  const std::vector<int> widths = {0, 2, 3, 4, 8};
  absl::StatusOr<std::vector<TransformCode>> codes =
      AllocateTransformCodes(streams, widths, bits, /*joint=*/false);
  EXPECT_TRUE(codes.ok()) << codes.status();
  return std::make_shared<const std::vector<TransformCode>>(*std::move(codes));
}

struct Fixture {
  Variant variant;
  RopeSchedule rope;
  std::shared_ptr<const std::vector<TransformCode>> kc, vc;
  std::unique_ptr<TransformKvCache> cache;
  // What the cache must hold: [layer][pos][kv head][dim], post-RoPE keys.
  std::vector<std::vector<float>> k_ref, v_ref;
};

inline Fixture Make(int64_t tokens, uint32_t seed, const Variant& variant = {}, int64_t pages = 200,
                    const RefreshConfig& refresh = {}, bool refresh_inline = true) {
  Fixture f;
  f.variant = variant;
  f.rope = *RopeSchedule::Make({.dim = kDim, .theta = 10000.0});
  f.kc = FitCodes(3.0, seed, variant.weighted);
  f.vc = FitCodes(2.0, seed + 1, variant.weighted);
  std::optional<RopeSchedule> key_rope;
  if (variant.pre_rope) key_rope = f.rope;
  absl::StatusOr<std::unique_ptr<TransformKvCache>> cache = TransformKvCache::Create(
      {.geometry = Geometry(),
       .block_size = variant.block,
       .sink_tokens = variant.sinks,
       .window_tokens = variant.window,
       .key_codes = f.kc,
       .value_codes = f.vc,
       .key_rope = key_rope,
       .capacity_bytes = pages * TransformKvCache::PageBytes(Geometry(), variant.block),
       .refresh = refresh,
       .refresh_inline = refresh_inline});
  EXPECT_TRUE(cache.ok()) << cache.status();
  f.cache = *std::move(cache);
  f.k_ref.assign(kLayers, std::vector<float>(static_cast<size_t>(tokens) * kKv * kDim));
  f.v_ref = f.k_ref;
  return f;
}

// Random K/V for positions [pos, pos + n) of every layer, written to the cache and, as stored
// full-rank (fp16), to the reference.
inline void WriteTokens(Fixture& f, SeqId seq, int64_t pos, int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> k(static_cast<size_t>(n) * kKv * kDim), v(k.size());
    for (float& x : k) x = n01(rng) * 2.0f + 0.5f;
    for (float& x : v) x = n01(rng);
    f.cache->Write(l, seq, pos, n, k.data(), v.data());
    for (size_t i = 0; i < k.size(); ++i) {
      f.k_ref[l][static_cast<size_t>(pos) * kKv * kDim + i] = Fp16(k[i]);
      f.v_ref[l][static_cast<size_t>(pos) * kKv * kDim + i] = Fp16(v[i]);
    }
  }
}

// Layer l's reference rows of block b after one more coding with `kc` / `vc`: the value's
// round trip; the key's, rotated back to before RoPE and forward again when coded before RoPE.
inline void RecodeReference(Fixture& f, int l, int64_t b, const std::vector<TransformCode>& kc,
                            const std::vector<TransformCode>& vc) {
  RopeSchedule unrope = f.rope;
  unrope.mscale = 1.0 / unrope.mscale;
  const int bs = f.variant.block;
  for (int64_t p = b * bs; p < (b + 1) * bs; ++p) {
    const int64_t neg = -p;
    float* k = f.k_ref[l].data() + p * kKv * kDim;
    float* v = f.v_ref[l].data() + p * kKv * kDim;
    if (f.variant.pre_rope) cpu::Rope(k, 1, kKv, kDim, unrope, &neg);
    for (int h = 0; h < kKv; ++h) {
      kc[static_cast<size_t>(l * kKv + h)].RoundTrip(k + h * kDim);
      vc[static_cast<size_t>(l * kKv + h)].RoundTrip(v + h * kDim);
    }
    if (f.variant.pre_rope) cpu::Rope(k, 1, kKv, kDim, f.rope, &p);
  }
}

// The reference's rows of block b as the codec file's codes code them, in every layer.
inline void CodeReferenceBlock(Fixture& f, int64_t b) {
  for (int l = 0; l < kLayers; ++l) RecodeReference(f, l, b, *f.kc, *f.vc);
}

// Attention in double of queries at [pos, pos + n) over the reference's rows [0, p].
inline std::vector<float> ReferenceAttend(const Fixture& f, int layer, int64_t pos, int64_t n,
                                          const std::vector<float>& q) {
  std::vector<float> out(q.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < kHeads; ++h) {
      const int kvh = h / (kHeads / kKv);
      const float* qh = q.data() + (i * kHeads + h) * kDim;
      std::vector<double> w;
      double m = -1e300;
      for (int64_t p = 0; p <= pos + i; ++p) {
        const float* k = f.k_ref[layer].data() + (p * kKv + kvh) * kDim;
        double s = 0.0;
        for (int d = 0; d < kDim; ++d) s += static_cast<double>(qh[d]) * k[d];
        w.push_back(s * scale);
        m = std::max(m, w.back());
      }
      double sum = 0.0;
      for (double& x : w) sum += (x = std::exp(x - m));
      for (int d = 0; d < kDim; ++d) {
        double acc = 0.0;
        for (int64_t p = 0; p <= pos + i; ++p) {
          acc += w[static_cast<size_t>(p)] * f.v_ref[layer][(p * kKv + kvh) * kDim + d];
        }
        out[(i * kHeads + h) * kDim + d] = static_cast<float>(acc / sum);
      }
    }
  }
  return out;
}

inline void ExpectAttentionMatches(Fixture& f, SeqId seq, int64_t pos, int64_t n,
                                   std::mt19937& rng) {
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> q(static_cast<size_t>(n) * kHeads * kDim), out(q.size());
    for (float& x : q) x = n01(rng);
    const AttentionRequest req{.seq = seq, .pos = pos, .n = n, .q = q.data(), .out = out.data()};
    f.cache->Attend(l, {&req, 1}, kHeads);
    const std::vector<float> want = ReferenceAttend(f, l, pos, n, q);
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_NEAR(out[i], want[i], 2e-4 * (1.0 + std::abs(want[i])))
          << "layer " << l << " element " << i << " (queries at " << pos << ")";
    }
  }
}

// Attention of the same random queries in every layer, on two caches: bitwise equal.
inline void ExpectSameAttention(Fixture& a, SeqId sa, Fixture& b, SeqId sb, int64_t pos, int64_t n,
                                uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> q(static_cast<size_t>(n) * kHeads * kDim), oa(q.size()), ob(q.size());
    for (float& x : q) x = n01(rng);
    const AttentionRequest ra{.seq = sa, .pos = pos, .n = n, .q = q.data(), .out = oa.data()};
    const AttentionRequest rb{.seq = sb, .pos = pos, .n = n, .q = q.data(), .out = ob.data()};
    a.cache->Attend(l, {&ra, 1}, kHeads);
    b.cache->Attend(l, {&rb, 1}, kHeads);
    ASSERT_EQ(oa, ob) << "layer " << l;
  }
}

inline RefreshConfig Refresh(int max_epochs) {
  return {.method = RefreshMethod::kPca,
          .every_tokens = 16,
          .half_life_tokens = 64,
          .max_epochs = max_epochs};
}

// Keys coded before and after RoPE, codes with and without an error metric.
inline auto Variants() {
  return ::testing::Values(Variant{}, Variant{.pre_rope = false}, Variant{.weighted = true},
                           Variant{.pre_rope = false, .weighted = true});
}
inline std::string VariantName(const ::testing::TestParamInfo<Variant>& info) {
  return std::string(info.param.pre_rope ? "PreRope" : "PostRope") +
         (info.param.weighted ? "Weighted" : "");
}

}  // namespace subspace::transform_cache_test

#endif  // SUBSPACE_TESTS_CORE_COMPRESS_TRANSFORM_KV_CACHE_TEST_UTIL_H_
