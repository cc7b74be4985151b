// Shared by the compressed-cache tests: random bases and K/V, a step-wise Append, and the
// references attention is checked against (reconstructed K/V per block epoch, dense attention
// in double).
#ifndef SUBSPACE_TESTS_CORE_COMPRESS_COMPRESSED_KV_CACHE_TEST_UTIL_H_
#define SUBSPACE_TESTS_CORE_COMPRESS_COMPRESSED_KV_CACHE_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"
#include "core/compress/compressed_kv_cache.h"
#include "gtest/gtest.h"

namespace subspace::cache_test {

// Columns orthonormal. out: [d, r]
inline std::vector<float> RandomOrthonormal(int d, int r, std::mt19937& rng) {
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> m(static_cast<size_t>(d) * r);
  for (double& x : m) x = n(rng);
  for (int j = 0; j < r; ++j) {
    for (int pass = 0; pass < 2; ++pass) {
      for (int k = 0; k < j; ++k) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += m[i * r + j] * m[i * r + k];
        for (int i = 0; i < d; ++i) m[i * r + j] -= dot * m[i * r + k];
      }
    }
    double norm = 0;
    for (int i = 0; i < d; ++i) norm += m[i * r + j] * m[i * r + j];
    for (int i = 0; i < d; ++i) m[i * r + j] /= std::sqrt(norm);
  }
  return std::vector<float>(m.begin(), m.end());
}

inline std::shared_ptr<Basis> OrthoBasis(const KvCacheGeometry& g, int rk, int rv, uint32_t seed) {
  std::mt19937 rng(seed);
  auto b = std::make_shared<Basis>(
      Basis::Zeros(g, std::vector<int>(g.n_layers, rk), std::vector<int>(g.n_layers, rv)));
  const size_t d = static_cast<size_t>(g.head_dim);
  for (LayerBasis& lb : b->layers) {
    for (int h = 0; h < g.n_kv_heads; ++h) {
      auto uk = RandomOrthonormal(g.head_dim, rk, rng);
      auto uv = RandomOrthonormal(g.head_dim, rv, rng);
      std::copy(uk.begin(), uk.end(), lb.p_k.begin() + static_cast<int64_t>(h * d * rk));
      std::copy(uv.begin(), uv.end(), lb.p_v.begin() + static_cast<int64_t>(h * d * rv));
    }
  }
  b->MakeOrthogonalFromPkPv();
  return b;
}

// KQ-SVD-like: P_q != P_k, R_v != P_v^T (arbitrary matrices; the attention math must not care).
inline std::shared_ptr<Basis> ObliqueBasis(const KvCacheGeometry& g, int rk, int rv,
                                           uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.5f);
  auto b = std::make_shared<Basis>(
      Basis::Zeros(g, std::vector<int>(g.n_layers, rk), std::vector<int>(g.n_layers, rv)));
  for (LayerBasis& lb : b->layers) {
    for (auto* m : {&lb.p_q, &lb.p_k, &lb.p_v, &lb.r_v}) {
      for (float& x : *m) x = n(rng);
    }
  }
  return b;
}

struct Data {
  // [n_layers][T, n_kv, hd]
  std::vector<std::vector<float>> k, v;
};

inline Data RandomKv(const KvCacheGeometry& g, int64_t T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  Data d;
  d.k.resize(g.n_layers);
  d.v.resize(g.n_layers);
  const size_t sz = static_cast<size_t>(T) * g.n_kv_heads * g.head_dim;
  for (int l = 0; l < g.n_layers; ++l) {
    d.k[l].resize(sz);
    d.v[l].resize(sz);
    for (float& x : d.k[l]) x = n(rng);
    for (float& x : d.v[l]) x = n(rng);
  }
  return d;
}

// K/V as full blocks of `full` store them (fp16: rounded to nearest even).
inline Data RoundTo(const Data& d, CoeffDtype full) {
  Data r = d;
  if (full == CoeffDtype::kFp32) return r;
  for (auto* part : {&r.k, &r.v}) {
    for (std::vector<float>& layer : *part) {
      for (float& x : layer) x = Fp16ToFp32(Fp32ToFp16(x));
    }
  }
  return r;
}

// Appends tokens [from, to) in one step: reserve, write every layer, commit.
inline void Append(KvCache& cache, SeqId seq, const Data& d, int64_t from, int64_t to) {
  const KvCacheGeometry& g = cache.geometry();
  const int64_t row = static_cast<int64_t>(g.n_kv_heads) * g.head_dim;
  ASSERT_TRUE(cache.Reserve(seq, to - from).ok());
  for (int l = 0; l < g.n_layers; ++l) {
    cache.Write(l, seq, from, to - from, d.k[l].data() + from * row, d.v[l].data() + from * row);
  }
  ASSERT_TRUE(cache.Commit(seq, to).ok());
}

// Attention of n queries at positions [pos, pos + n) for `layer`. out: [n, n_heads, hd]
inline std::vector<float> RunAttend(KvCache& cache, int layer, SeqId seq, int64_t pos, int64_t n,
                                    const std::vector<float>& q, int n_heads, int64_t window = 0) {
  std::vector<float> out(q.size());
  AttentionRequest req{seq, pos, n, q.data(), out.data(), window};
  cache.Attend(layer, std::span<const AttentionRequest>(&req, 1), n_heads);
  return out;
}

// The keys and values each query sees, per layer and token: reconstructed for compressed
// tokens (from the decoded codes: k^ = P_q c, v^ = R_v^T u), exact for full-rank ones.
inline Data EffectiveKv(const CompressedKvCache& cache, SeqId seq, const Data& d, int64_t T,
                        CoeffDtype dt) {
  const KvCacheGeometry& g = cache.geometry();
  const int hd = g.head_dim, n_kv = g.n_kv_heads, bs = cache.block_size();
  Data eff = d;
  for (int l = 0; l < g.n_layers; ++l) {
    const int rk = cache.r_k()[l], rv = cache.r_v()[l];
    std::vector<bool> outlier(static_cast<size_t>(T), false);
    for (int64_t p : cache.OutlierPositions(seq, l)) outlier[p] = true;
    for (int64_t t = 0; t < T; ++t) {
      if (!cache.IsCompressed(seq, l, t / bs) || outlier[t]) continue;
      for (int h = 0; h < n_kv; ++h) {
        const LayerBasis& b = cache.registry().Get(cache.BlockEpoch(seq, l, t / bs, h))->layers[l];
        const float* k = d.k[l].data() + (t * n_kv + h) * hd;
        const float* v = d.v[l].data() + (t * n_kv + h) * hd;
        std::vector<float> c(rk, 0.0f), u(rv, 0.0f), codes(std::max(rk, rv));
        for (int i = 0; i < hd; ++i) {
          for (int j = 0; j < rk; ++j) c[j] += b.p_k[(h * hd + i) * rk + j] * k[i];
          for (int j = 0; j < rv; ++j) u[j] += b.p_v[(h * hd + i) * rv + j] * v[i];
        }
        uint16_t s;
        EncodeCoeffs(dt, c.data(), rk, codes.data(), &s);
        DecodeCoeffs(dt, codes.data(), &s, rk, c.data());
        EncodeCoeffs(dt, u.data(), rv, codes.data(), &s);
        DecodeCoeffs(dt, codes.data(), &s, rv, u.data());
        float* ek = eff.k[l].data() + (t * n_kv + h) * hd;
        float* ev = eff.v[l].data() + (t * n_kv + h) * hd;
        for (int i = 0; i < hd; ++i) {
          double kk = 0, vv = 0;
          for (int j = 0; j < rk; ++j)
            kk += static_cast<double>(b.p_q[(h * hd + i) * rk + j]) * c[j];
          for (int j = 0; j < rv; ++j)
            vv += static_cast<double>(b.r_v[(h * rv + j) * hd + i]) * u[j];
          ek[i] = static_cast<float>(kk);
          ev[i] = static_cast<float>(vv);
        }
      }
    }
  }
  return eff;
}

// Dense causal attention in double. q: [n, n_heads, hd]; returns [n, n_heads, hd]
// window > 0: the query at position p sees (p - window, p] only.
inline std::vector<float> DenseAttend(const KvCacheGeometry& g, const Data& d, int layer,
                                      int64_t pos, int64_t n, const std::vector<float>& q,
                                      int n_heads, int64_t window = 0) {
  const int hd = g.head_dim, n_kv = g.n_kv_heads, group = n_heads / n_kv;
  std::vector<float> out(q.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t first = window > 0 ? std::max<int64_t>(0, pos + i - window + 1) : 0;
    for (int h = 0; h < n_heads; ++h) {
      const int kvh = h / group;
      const float* qq = q.data() + (i * n_heads + h) * hd;
      std::vector<double> logit(pos + i + 1);
      double mx = -1e300;
      for (int64_t t = first; t <= pos + i; ++t) {
        double s = 0;
        for (int x = 0; x < hd; ++x)
          s += static_cast<double>(qq[x]) * d.k[layer][(t * n_kv + kvh) * hd + x];
        logit[t] = s / std::sqrt(static_cast<double>(hd));
        mx = std::max(mx, logit[t]);
      }
      std::vector<double> o(hd, 0.0);
      double sum = 0;
      for (int64_t t = first; t <= pos + i; ++t) {
        const double p = std::exp(logit[t] - mx);
        sum += p;
        for (int x = 0; x < hd; ++x) o[x] += p * d.v[layer][(t * n_kv + kvh) * hd + x];
      }
      for (int x = 0; x < hd; ++x) out[(i * n_heads + h) * hd + x] = static_cast<float>(o[x] / sum);
    }
  }
  return out;
}

inline double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_FALSE(std::isnan(a[i]));
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

inline std::vector<float> RandomQ(int64_t n, int n_heads, int hd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n) * n_heads * hd);
  for (float& x : q) x = nd(rng);
  return q;
}

inline CompressedKvCacheConfig SmallConfig(KvCacheGeometry g, int r, CoeffDtype dt,
                                           CoeffDtype full = CoeffDtype::kFp16) {
  CompressedKvCacheConfig c;
  c.geometry = g;
  c.block_size = 4;
  c.policy.sink_tokens = 2;
  c.policy.window_tokens = 8;
  c.policy.r_k = std::vector<int>(g.n_layers, r);
  c.policy.r_v = std::vector<int>(g.n_layers, r);
  c.policy.coeff_dtype = dt;
  c.full_dtype = full;
  c.capacity_bytes = 256 * CompressedKvCache::PageBytes(g, c.block_size, full);
  return c;
}

inline std::unique_ptr<CompressedKvCache> Make(const CompressedKvCacheConfig& c) {
  auto cache = CompressedKvCache::Create(c);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? *std::move(cache) : nullptr;
}

}  // namespace subspace::cache_test

#endif  // SUBSPACE_TESTS_CORE_COMPRESS_COMPRESSED_KV_CACHE_TEST_UTIL_H_
