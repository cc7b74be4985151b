#include "tools/eval/baseline_kv_caches.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/base/ggml_types.h"
#include "core/kvcache/kv_quant.h"
#include "core/kvcache/paged_kv_cache.h"

namespace subspace::eval {
namespace {

void RoundTripKv(KvDtype dtype, std::span<float> row) {
  const int64_t n = static_cast<int64_t>(row.size());
  assert(n % kKvQuantBlock == 0);
  std::vector<uint8_t> bytes(static_cast<size_t>(KvRowBytes(dtype, n)));
  QuantizeKvRow(dtype, row.data(), n, bytes.data());
  DequantizeKvRows(dtype, bytes.data(), 1, n, row.data());
}

constexpr int kQBlock = 32;  // llama.cpp's q8_0 / q4_0 block, and KIVI's value channel group

float RoundFp16(float x) { return Fp16ToFp32(Fp32ToFp16(x)); }

}  // namespace

const char* BaselineKindName(BaselineKind kind) {
  switch (kind) {
    case BaselineKind::kFull:
      return "full";
    case BaselineKind::kEvict:
      return "evict";
    case BaselineKind::kQ8_0:
      return "q8_0";
    case BaselineKind::kQ4_0:
      return "q4_0";
    case BaselineKind::kKivi4:
      return "kivi4";
  }
  return "?";
}

absl::StatusOr<BaselineKind> ParseBaselineKind(std::string_view name) {
  for (BaselineKind k : {BaselineKind::kFull, BaselineKind::kEvict, BaselineKind::kQ8_0,
                         BaselineKind::kQ4_0, BaselineKind::kKivi4}) {
    if (name == BaselineKindName(k)) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("unknown baseline cache '%s' (full, evict, q8_0, q4_0, kivi4)", name));
}

double BaselineBytesPerToken(const BaselineKvCacheConfig& c, int64_t length) {
  const KvCacheGeometry& g = c.geometry;
  const double values = 2.0 * g.n_layers * g.n_kv_heads * g.head_dim;  // K and V, per token
  const double fp16 = 2.0 * values;
  switch (c.kind) {
    case BaselineKind::kFull:
      return fp16;
    case BaselineKind::kEvict:
      return length <= 0 ? fp16
                         : fp16 *
                               static_cast<double>(
                                   std::min<int64_t>(length, c.sink_tokens + c.window_tokens)) /
                               static_cast<double>(length);
    case BaselineKind::kQ8_0:
      return values * 34.0 / kQBlock;
    case BaselineKind::kQ4_0:
      return values * 18.0 / kQBlock;
    case BaselineKind::kKivi4: {
      const double half = values / 2;  // keys, or values
      const int64_t grouped = length <= 0 ? 0 : length / c.kivi_group * c.kivi_group;
      const double frac = length <= 0 ? 0.0 : static_cast<double>(grouped) / length;
      // Keys: nibbles + (scale, zero) fp16 per channel per G tokens for the grouped part; the
      // residual at fp16. Values: nibbles + (scale, zero) per 32 channels of every token.
      const double keys = frac * half * (0.5 + 4.0 / c.kivi_group) + (1 - frac) * half * 2.0;
      const double vals = half * (0.5 + 4.0 / kQBlock);
      return keys + vals;
    }
  }
  return fp16;
}

// Through the server's own quantizers (core/kvcache/kv_quant.h), so the baseline and
// `--kv-cache quantized` are one format.
void RoundTripQ8_0(std::span<float> row) { RoundTripKv(KvDtype::kQ8_0, row); }
void RoundTripQ4_0(std::span<float> row) { RoundTripKv(KvDtype::kQ4_0, row); }

void RoundTripAsym4(float* x, int64_t n, int64_t stride) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i * stride]);
    hi = std::max(hi, x[i * stride]);
  }
  const float scale = RoundFp16((hi - lo) / 15.0f);
  const float zero = RoundFp16(lo);
  for (int64_t i = 0; i < n; ++i) {
    float& v = x[i * stride];
    const float q = scale > 0.0f ? std::clamp(std::round((v - zero) / scale), 0.0f, 15.0f) : 0.0f;
    v = zero + q * scale;
  }
}

absl::StatusOr<std::unique_ptr<BaselineKvCache>> BaselineKvCache::Create(
    const BaselineKvCacheConfig& config) {
  const KvCacheGeometry& g = config.geometry;
  if ((config.kind == BaselineKind::kQ8_0 || config.kind == BaselineKind::kQ4_0 ||
       config.kind == BaselineKind::kKivi4) &&
      g.head_dim % kQBlock != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s needs head_dim a multiple of %d, got %d",
                                                      BaselineKindName(config.kind), kQBlock,
                                                      g.head_dim));
  }
  if (config.sink_tokens < 0 || config.window_tokens < 1 || config.kivi_group < 1) {
    return absl::InvalidArgumentError("sink_tokens >= 0, window_tokens >= 1, kivi_group >= 1");
  }
  PagedKvCache::Config pc;
  pc.geometry = g;
  pc.block_size = config.block_size;
  pc.capacity_bytes = config.capacity_bytes;
  absl::StatusOr<std::unique_ptr<PagedKvCache>> inner = PagedKvCache::Create(pc);
  if (!inner.ok()) return inner.status();
  return std::unique_ptr<BaselineKvCache>(new BaselineKvCache(config, *std::move(inner)));
}

BaselineKvCache::BaselineKvCache(const BaselineKvCacheConfig& config,
                                 std::unique_ptr<KvCache> inner)
    : ForwardingKvCache(std::move(inner)), config_(config) {}

absl::StatusOr<SeqId> BaselineKvCache::CreateSequence() {
  absl::StatusOr<SeqId> id = ForwardingKvCache::CreateSequence();
  if (!id.ok()) return id;
  if (static_cast<size_t>(*id) >= seqs_.size()) seqs_.resize(static_cast<size_t>(*id) + 1);
  seqs_[static_cast<size_t>(*id)].layers.assign(static_cast<size_t>(config_.geometry.n_layers),
                                                Layer{});
  return id;
}

absl::Status BaselineKvCache::FreeSequence(SeqId seq) {
  if (absl::Status st = ForwardingKvCache::FreeSequence(seq); !st.ok()) return st;
  seqs_[static_cast<size_t>(seq)].layers.clear();
  return absl::OkStatus();
}

void BaselineKvCache::Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k,
                            const float* v) {
  ForwardingKvCache::Write(layer, seq, pos, n, k, v);
  const KvCacheGeometry& g = config_.geometry;
  const int64_t row = static_cast<int64_t>(g.n_kv_heads) * g.head_dim;
  Layer& l = seqs_[static_cast<size_t>(seq)].layers[static_cast<size_t>(layer)];
  const int64_t end = pos + n;
  if (static_cast<int64_t>(l.k.size()) < end * row) {
    l.k.resize(static_cast<size_t>(end * row));
    l.v.resize(static_cast<size_t>(end * row));
  }
  std::copy(k, k + n * row, l.k.begin() + pos * row);
  std::copy(v, v + n * row, l.v.begin() + pos * row);
  for (int64_t i = pos * row; i < end * row; i += g.head_dim) {
    const std::span<float> kh(l.k.data() + i, static_cast<size_t>(g.head_dim));
    const std::span<float> vh(l.v.data() + i, static_cast<size_t>(g.head_dim));
    switch (config_.kind) {
      case BaselineKind::kFull:
      case BaselineKind::kEvict:
        break;
      case BaselineKind::kQ8_0:
        RoundTripQ8_0(kh);
        RoundTripQ8_0(vh);
        break;
      case BaselineKind::kQ4_0:
        RoundTripQ4_0(kh);
        RoundTripQ4_0(vh);
        break;
      case BaselineKind::kKivi4:  // values per token, 32 channels a group; keys below
        for (int c = 0; c < g.head_dim; c += kQBlock) RoundTripAsym4(vh.data() + c, kQBlock, 1);
        break;
    }
  }
  if (config_.kind == BaselineKind::kKivi4) QuantizeKeyGroups(l, end);
}

void BaselineKvCache::QuantizeKeyGroups(Layer& l, int64_t length) {
  const KvCacheGeometry& g = config_.geometry;
  const int64_t row = static_cast<int64_t>(g.n_kv_heads) * g.head_dim;
  const int64_t group = config_.kivi_group;
  while (l.keys_grouped + group <= length) {
    float* base = l.k.data() + l.keys_grouped * row;
    for (int64_t c = 0; c < row; ++c) RoundTripAsym4(base + c, group, row);  // per channel
    l.keys_grouped += group;
  }
}

absl::Status BaselineKvCache::Truncate(SeqId seq, int64_t length) {
  if (absl::Status st = ForwardingKvCache::Truncate(seq, length); !st.ok()) return st;
  const int64_t row = static_cast<int64_t>(config_.geometry.n_kv_heads) * config_.geometry.head_dim;
  for (Layer& l : seqs_[static_cast<size_t>(seq)].layers) {
    if (static_cast<int64_t>(l.k.size()) > length * row) {
      l.k.resize(static_cast<size_t>(length * row));
      l.v.resize(static_cast<size_t>(length * row));
    }
    // A cut group's keys stay as they were quantized; the next group starts past them.
    l.keys_grouped = std::min(l.keys_grouped, length);
  }
  return absl::OkStatus();
}

void BaselineKvCache::Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) {
  const KvCacheGeometry& g = config_.geometry;
  const int d = g.head_dim;
  const int64_t row = static_cast<int64_t>(g.n_kv_heads) * d;
  const int group = n_heads / g.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> w;
  for (const AttentionRequest& r : requests) {
    const Layer& l = seqs_[static_cast<size_t>(r.seq)].layers[static_cast<size_t>(layer)];
    for (int64_t i = 0; i < r.n; ++i) {
      const int64_t p = r.pos + i;  // attends to [first, p]: all, or the sliding window
      const int64_t first = r.FirstAttended(p);
      const bool evict = config_.kind == BaselineKind::kEvict;
      const int64_t recent = evict ? std::max<int64_t>(0, p - config_.window_tokens + 1) : 0;
      for (int h = 0; h < n_heads; ++h) {
        const int kvh = h / group;
        const float* q = r.q + (i * n_heads + h) * d;
        float* out = r.out + (i * n_heads + h) * d;
        w.assign(static_cast<size_t>(p + 1), -INFINITY);
        float m = -INFINITY;
        for (int64_t t = first; t <= p; ++t) {
          if (evict && t >= config_.sink_tokens && t < recent) continue;
          const float* k = l.k.data() + t * row + static_cast<int64_t>(kvh) * d;
          float s = 0.0f;
          for (int x = 0; x < d; ++x) s += q[x] * k[x];
          w[static_cast<size_t>(t)] = s * scale;
          m = std::max(m, w[static_cast<size_t>(t)]);
        }
        double sum = 0.0;
        std::fill(out, out + d, 0.0f);
        for (int64_t t = 0; t <= p; ++t) {
          if (w[static_cast<size_t>(t)] == -INFINITY) continue;
          const float e = std::exp(w[static_cast<size_t>(t)] - m);
          sum += e;
          const float* v = l.v.data() + t * row + static_cast<int64_t>(kvh) * d;
          for (int x = 0; x < d; ++x) out[x] += e * v[x];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int x = 0; x < d; ++x) out[x] *= inv;
      }
    }
  }
}

}  // namespace subspace::eval
