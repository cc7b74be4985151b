#include "tools/eval/baseline_kv_caches.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/base/tensor_types.h"
#include "core/cpu/ops.h"
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
    case BaselineKind::kHq8_0:
      return "hq8_0";
    case BaselineKind::kHq4_0:
      return "hq4_0";
    case BaselineKind::kTurbo2_5:
      return "tq2.5";
    case BaselineKind::kTurbo3_5:
      return "tq3.5";
    case BaselineKind::kKivi2:
      return "kivi2";
    case BaselineKind::kTransform:
      return "tc";
  }
  return "?";
}

absl::StatusOr<BaselineKind> ParseBaselineKind(std::string_view name) {
  for (BaselineKind k :
       {BaselineKind::kFull, BaselineKind::kEvict, BaselineKind::kQ8_0, BaselineKind::kQ4_0,
        BaselineKind::kKivi4, BaselineKind::kHq8_0, BaselineKind::kHq4_0, BaselineKind::kTurbo2_5,
        BaselineKind::kTurbo3_5, BaselineKind::kKivi2}) {
    if (name == BaselineKindName(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown baseline cache '%s' (full, evict, q8_0, q4_0, kivi4, hq8_0, hq4_0, tq2.5, tq3.5, "
      "kivi2)",
      name));
}

double BaselineBytesPerToken(const BaselineKvCacheConfig& c, int64_t length) {
  if (c.exact_sinks_window && length > 0 && c.kind != BaselineKind::kFull &&
      c.kind != BaselineKind::kEvict && c.kind != BaselineKind::kTransform) {
    BaselineKvCacheConfig all = c;
    all.exact_sinks_window = false;
    const int64_t exact = std::min<int64_t>(length, c.sink_tokens + c.window_tokens);
    all.kind = BaselineKind::kFull;
    const double fp16 = BaselineBytesPerToken(all, length);
    all.kind = c.kind;
    const double coded = exact < length ? BaselineBytesPerToken(all, length - exact) : 0.0;
    return (fp16 * static_cast<double>(exact) + coded * static_cast<double>(length - exact)) /
           static_cast<double>(length);
  }
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
    case BaselineKind::kHq8_0:
      return values * 34.0 / kQBlock;
    case BaselineKind::kQ4_0:
    case BaselineKind::kHq4_0:
      return values * 18.0 / kQBlock;
    case BaselineKind::kTurbo2_5:
    case BaselineKind::kTurbo3_5: {
      const double bits = c.kind == BaselineKind::kTurbo2_5 ? 2.5 : 3.5;
      return values * bits / 8.0 + values / g.head_dim * 2.0;  // codes + an fp16 norm per row
    }
    case BaselineKind::kKivi4:
    case BaselineKind::kKivi2: {
      const double code = c.kind == BaselineKind::kKivi4 ? 0.5 : 0.25;  // bytes per element
      const double half = values / 2;                                   // keys, or values
      const int64_t grouped = length <= 0 ? 0 : length / c.kivi_group * c.kivi_group;
      const double frac = length <= 0 ? 0.0 : static_cast<double>(grouped) / length;
      // Keys: codes + (scale, zero) fp16 per channel per G tokens for the grouped part; the
      // residual at fp16. Values: codes + (scale, zero) per 32 channels of every token.
      const double keys = frac * half * (code + 4.0 / c.kivi_group) + (1 - frac) * half * 2.0;
      const double vals = half * (code + 4.0 / kQBlock);
      return keys + vals;
    }
    case BaselineKind::kTransform: {
      if (length <= 0 || c.key_codes == nullptr || c.value_codes == nullptr) return fp16;
      double coded = 0.0;  // bytes of one token's codes, all layers and heads
      for (const TransformCode& t : *c.key_codes) {
        coded += c.code_keys ? static_cast<double>(t.BytesPerRow()) : 2.0 * g.head_dim;
      }
      for (const TransformCode& t : *c.value_codes) {
        coded += c.code_values ? static_cast<double>(t.BytesPerRow()) : 2.0 * g.head_dim;
      }
      const int64_t exact = std::min<int64_t>(length, c.sink_tokens + c.window_tokens);
      return (fp16 * static_cast<double>(exact) + coded * static_cast<double>(length - exact)) /
             static_cast<double>(length);
    }
  }
  return fp16;
}

// Through the server's own quantizers (core/kvcache/kv_quant.h), so the baseline and
// `--kv-cache quantized` are one format.
void RoundTripQ8_0(std::span<float> row) { RoundTripKv(KvDtype::kQ8_0, row); }
void RoundTripQ4_0(std::span<float> row) { RoundTripKv(KvDtype::kQ4_0, row); }

void RoundTripAsym(int bits, float* x, int64_t n, int64_t stride) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i * stride]);
    hi = std::max(hi, x[i * stride]);
  }
  const float top = static_cast<float>((1 << bits) - 1);
  const float scale = RoundFp16((hi - lo) / top);
  const float zero = RoundFp16(lo);
  for (int64_t i = 0; i < n; ++i) {
    float& v = x[i * stride];
    const float q = scale > 0.0f ? std::clamp(std::round((v - zero) / scale), 0.0f, top) : 0.0f;
    v = zero + q * scale;
  }
}

absl::StatusOr<std::unique_ptr<BaselineKvCache>> BaselineKvCache::Create(
    const BaselineKvCacheConfig& config) {
  const KvCacheGeometry& g = config.geometry;
  const BaselineKind kind = config.kind;
  if (kind != BaselineKind::kFull && kind != BaselineKind::kEvict &&
      kind != BaselineKind::kTransform && g.head_dim % kQBlock != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s needs head_dim a multiple of %d, got %d",
                                                      BaselineKindName(kind), kQBlock, g.head_dim));
  }
  if ((kind == BaselineKind::kHq8_0 || kind == BaselineKind::kHq4_0 ||
       kind == BaselineKind::kTurbo2_5 || kind == BaselineKind::kTurbo3_5) &&
      (g.head_dim & (g.head_dim - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s rotates with a Hadamard matrix: head_dim must be a power of two, got %d",
        BaselineKindName(kind), g.head_dim));
  }
  if (kind == BaselineKind::kTransform) {
    const size_t heads = static_cast<size_t>(g.n_layers) * g.n_kv_heads;
    if (config.key_codes == nullptr || config.value_codes == nullptr ||
        config.key_codes->size() != heads || config.value_codes->size() != heads) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tc needs key and value codes for %d layer-heads", heads));
    }
    for (const std::vector<TransformCode>* codes : {&*config.key_codes, &*config.value_codes}) {
      for (const TransformCode& t : *codes) {
        if (t.dim != g.head_dim || t.mean.size() != static_cast<size_t>(t.dim) ||
            t.basis.size() != static_cast<size_t>(t.dim) * t.dim ||
            t.components.size() != static_cast<size_t>(t.dim)) {
          return absl::InvalidArgumentError("a tc code does not match head_dim");
        }
      }
    }
    if (config.key_rope.has_value() && config.key_rope->dim > g.head_dim) {
      return absl::InvalidArgumentError("the key RoPE rotates more dims than head_dim");
    }
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
    : ForwardingKvCache(std::move(inner)),
      config_(config),
      split_(config.kind == BaselineKind::kTransform ||
             (config.exact_sinks_window && config.kind != BaselineKind::kFull &&
              config.kind != BaselineKind::kEvict)),
      rotation_(config.geometry.head_dim, config.rotation_seed) {
  if (config_.key_rope.has_value()) {
    key_unrope_ = *config_.key_rope;  // angles negated by the positions, the scale divided
    key_unrope_->mscale = 1.0 / key_unrope_->mscale;
  }
}

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
  if (config_.kind == BaselineKind::kTransform) {
    WriteTransformCodes(layer, l, pos, n);
    return;
  }
  // The format's copy: in place, or beside the exact rows when sinks and window stay exact.
  std::vector<float>& qk = split_ ? l.kc : l.k;
  std::vector<float>& qv = split_ ? l.vc : l.v;
  if (split_) {
    if (static_cast<int64_t>(l.kc.size()) < end * row) {
      l.kc.resize(static_cast<size_t>(end * row));
      l.vc.resize(static_cast<size_t>(end * row));
    }
    std::copy(k, k + n * row, l.kc.begin() + pos * row);
    std::copy(v, v + n * row, l.vc.begin() + pos * row);
  }
  for (int64_t i = pos * row; i < end * row; i += g.head_dim) {
    const std::span<float> kh(qk.data() + i, static_cast<size_t>(g.head_dim));
    const std::span<float> vh(qv.data() + i, static_cast<size_t>(g.head_dim));
    switch (config_.kind) {
      case BaselineKind::kFull:
      case BaselineKind::kEvict:
      case BaselineKind::kTransform:
        break;
      case BaselineKind::kQ8_0:
        RoundTripQ8_0(kh);
        RoundTripQ8_0(vh);
        break;
      case BaselineKind::kQ4_0:
        RoundTripQ4_0(kh);
        RoundTripQ4_0(vh);
        break;
      case BaselineKind::kHq8_0:
      case BaselineKind::kHq4_0:
        for (const std::span<float> x : {kh, vh}) {
          rotation_.Rotate(x.data());
          config_.kind == BaselineKind::kHq8_0 ? RoundTripQ8_0(x) : RoundTripQ4_0(x);
          rotation_.Unrotate(x.data());
        }
        break;
      case BaselineKind::kTurbo2_5:
      case BaselineKind::kTurbo3_5: {
        const int bits = config_.kind == BaselineKind::kTurbo2_5 ? 2 : 3;
        RoundTripTurbo(rotation_, bits, g.head_dim / 2, kh.data());
        RoundTripTurbo(rotation_, bits, g.head_dim / 2, vh.data());
        break;
      }
      case BaselineKind::kKivi4:  // values per token, 32 channels a group; keys below
      case BaselineKind::kKivi2:
        for (int c = 0; c < g.head_dim; c += kQBlock) {
          RoundTripAsym(KiviBits(), vh.data() + c, kQBlock, 1);
        }
        break;
    }
  }
  if (config_.kind == BaselineKind::kKivi4 || config_.kind == BaselineKind::kKivi2) {
    QuantizeKeyGroups(qk, l.keys_grouped, end);
  }
}

void BaselineKvCache::WriteTransformCodes(int layer, Layer& l, int64_t pos, int64_t n) {
  const KvCacheGeometry& g = config_.geometry;
  const int64_t row = static_cast<int64_t>(g.n_kv_heads) * g.head_dim;
  const int64_t end = pos + n;
  if (static_cast<int64_t>(l.kc.size()) < end * row) {
    l.kc.resize(static_cast<size_t>(end * row));
    l.vc.resize(static_cast<size_t>(end * row));
  }
  float* kc = l.kc.data() + pos * row;
  float* vc = l.vc.data() + pos * row;
  std::copy(l.k.begin() + pos * row, l.k.begin() + end * row, kc);
  std::copy(l.v.begin() + pos * row, l.v.begin() + end * row, vc);
  std::vector<int64_t> positions(static_cast<size_t>(n)), negated(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    positions[static_cast<size_t>(i)] = pos + i;
    negated[static_cast<size_t>(i)] = -(pos + i);
  }
  if (key_unrope_.has_value())
    cpu::Rope(kc, n, g.n_kv_heads, g.head_dim, *key_unrope_, negated.data());
  const auto& kcodes = *config_.key_codes;
  const auto& vcodes = *config_.value_codes;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const size_t at = static_cast<size_t>(layer) * g.n_kv_heads + static_cast<size_t>(h);
      const int64_t off = i * row + static_cast<int64_t>(h) * g.head_dim;
      if (config_.code_keys) kcodes[at].RoundTrip(kc + off);
      if (config_.code_values) vcodes[at].RoundTrip(vc + off);
    }
  }
  if (key_unrope_.has_value())
    cpu::Rope(kc, n, g.n_kv_heads, g.head_dim, *config_.key_rope, positions.data());
}

void BaselineKvCache::QuantizeKeyGroups(std::vector<float>& keys, int64_t& grouped,
                                        int64_t length) {
  const KvCacheGeometry& g = config_.geometry;
  const int64_t row = static_cast<int64_t>(g.n_kv_heads) * g.head_dim;
  const int64_t group = config_.kivi_group;
  while (grouped + group <= length) {
    float* base = keys.data() + grouped * row;
    for (int64_t c = 0; c < row; ++c) RoundTripAsym(KiviBits(), base + c, group, row);
    grouped += group;
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
    if (static_cast<int64_t>(l.kc.size()) > length * row) {
      l.kc.resize(static_cast<size_t>(length * row));
      l.vc.resize(static_cast<size_t>(length * row));
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
  // Evict drops, and split kinds read their format for, the tokens between sinks and window.
  const bool evict = config_.kind == BaselineKind::kEvict;
  const bool coded = split_;
  // One task per (request, query, head): the plain reference attention is the suite's hot
  // loop, and the queries of a prefill chunk are independent.
  std::vector<std::pair<size_t, int64_t>> tasks;  // (request, query i)
  for (size_t ri = 0; ri < requests.size(); ++ri) {
    for (int64_t i = 0; i < requests[ri].n; ++i) tasks.emplace_back(ri, i);
  }
  const int64_t n_tasks = static_cast<int64_t>(tasks.size()) * n_heads;
#pragma omp parallel
  {
    std::vector<float> w;
#pragma omp for schedule(dynamic, 4)
    for (int64_t task = 0; task < n_tasks; ++task) {
      const AttentionRequest& r = requests[tasks[static_cast<size_t>(task / n_heads)].first];
      const int64_t i = tasks[static_cast<size_t>(task / n_heads)].second;
      const int h = static_cast<int>(task % n_heads);
      const Layer& l = seqs_[static_cast<size_t>(r.seq)].layers[static_cast<size_t>(layer)];
      const int64_t p = r.pos + i;  // attends to [first, p]: all, or the sliding window
      const int64_t first = r.FirstAttended(p);
      const int64_t recent =
          evict || coded ? std::max<int64_t>(0, p - config_.window_tokens + 1) : 0;
      auto middle = [&](int64_t t) { return t >= config_.sink_tokens && t < recent; };
      const int kvh = h / group;
      const float* q = r.q + (i * n_heads + h) * d;
      float* out = r.out + (i * n_heads + h) * d;
      w.assign(static_cast<size_t>(p + 1), -INFINITY);
      float m = -INFINITY;
      for (int64_t t = first; t <= p; ++t) {
        if (evict && middle(t)) continue;
        const float* k =
            (coded && middle(t) ? l.kc : l.k).data() + t * row + static_cast<int64_t>(kvh) * d;
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
        const float* v =
            (coded && middle(t) ? l.vc : l.v).data() + t * row + static_cast<int64_t>(kvh) * d;
        for (int x = 0; x < d; ++x) out[x] += e * v[x];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int x = 0; x < d; ++x) out[x] *= inv;
    }
  }
}

}  // namespace subspace::eval
