#include "core/compress/transform_calibration.h"

#include <algorithm>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "core/cpu/ops.h"
#include "core/kvcache/forwarding_kv_cache.h"

namespace subspace {
namespace {

// Keeps the rows written to it, pre-RoPE keys recovered with the inverse rotation.
class RowRecorder final : public ForwardingKvCache {
 public:
  RowRecorder(std::unique_ptr<KvCache> inner, KvRows* rows, const RopeSchedule& rope)
      : ForwardingKvCache(std::move(inner)), rows_(rows), unrope_(rope) {
    unrope_.mscale = 1.0 / unrope_.mscale;
    q_sums_.assign(static_cast<size_t>(rows->geometry.n_layers) * rows->geometry.n_kv_heads,
                   std::vector<double>(static_cast<size_t>(rows->geometry.head_dim), 0.0));
  }

  void Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k,
             const float* v) override {
    ForwardingKvCache::Write(layer, seq, pos, n, k, v);
    const KvCacheGeometry& g = rows_->geometry;
    const int64_t row = static_cast<int64_t>(g.n_kv_heads) * g.head_dim;
    std::vector<float> pre(k, k + n * row);
    std::vector<int64_t> negated(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) negated[static_cast<size_t>(i)] = -(pos + i);
    cpu::Rope(pre.data(), n, g.n_kv_heads, g.head_dim, unrope_, negated.data());
    absl::MutexLock lock(&mu_);
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const size_t at = static_cast<size_t>(layer) * g.n_kv_heads + static_cast<size_t>(h);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t off = i * row + static_cast<int64_t>(h) * g.head_dim;
        rows_->keys_post[at].insert(rows_->keys_post[at].end(), k + off, k + off + g.head_dim);
        rows_->keys_pre[at].insert(rows_->keys_pre[at].end(), pre.data() + off,
                                   pre.data() + off + g.head_dim);
        rows_->values[at].insert(rows_->values[at].end(), v + off, v + off + g.head_dim);
      }
    }
    if (layer == 0) rows_->tokens += n;
  }

  void Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) override {
    ForwardingKvCache::Attend(layer, requests, n_heads);
    const KvCacheGeometry& g = rows_->geometry;
    const int group = n_heads / g.n_kv_heads;
    absl::MutexLock lock(&mu_);
    for (const AttentionRequest& r : requests) {
      for (int64_t i = 0; i < r.n; ++i) {
        for (int h = 0; h < n_heads; ++h) {
          const float* q = r.q + (i * n_heads + h) * g.head_dim;
          std::vector<double>& e =
              q_sums_[static_cast<size_t>(layer) * g.n_kv_heads + static_cast<size_t>(h / group)];
          for (int x = 0; x < g.head_dim; ++x) e[static_cast<size_t>(x)] += double{q[x]} * q[x];
        }
      }
      if (layer == 0) q_count_ += r.n * group;
    }
  }

  // Leaves the mean squared query per dim, per layer-head, in the rows.
  ~RowRecorder() override {
    const size_t heads = q_sums_.size();
    rows_->query_energy.assign(heads, {});
    for (size_t at = 0; at < heads; ++at) {
      for (double s : q_sums_[at]) {
        rows_->query_energy[at].push_back(
            q_count_ > 0 ? static_cast<float>(s / static_cast<double>(q_count_)) : 0.0f);
      }
    }
  }

 private:
  absl::Mutex mu_;
  KvRows* rows_;
  RopeSchedule unrope_;
  std::vector<std::vector<double>> q_sums_;  // [n_layers * n_kv][d]
  int64_t q_count_ = 0;                      // queries per head summed, layer 0
};

// The pair-averaged metric: the relative rotation between a query and a pre-RoPE key turns
// each rotated pair by an angle that varies with the distance, so the query's energy on the
// pair reaches both of its dims alike.
std::vector<float> PairAveraged(const std::vector<float>& e, const RopeSchedule& rope) {
  std::vector<float> out = e;
  const int pairs = std::min<int>(rope.dim, static_cast<int>(e.size())) / 2;
  const bool halves = rope.layout == RopeLayout::kHalves;
  for (int p = 0; p < pairs; ++p) {
    const size_t a = halves ? static_cast<size_t>(p) : static_cast<size_t>(2 * p);
    const size_t b = halves ? a + static_cast<size_t>(rope.dim / 2) : a + 1;
    out[a] = out[b] = 0.5f * (e[a] + e[b]);
  }
  return out;
}

// Weights relative to their mean, floored so that no dim drops out of the code entirely.
std::vector<float> Normalized(std::vector<float> w) {
  double mean = 0.0;
  for (float x : w) mean += x;
  mean /= static_cast<double>(w.size());
  for (float& x : w) x = static_cast<float>(std::max(x / mean, 1e-3));
  return w;
}

}  // namespace

absl::StatusOr<KvRows> CollectKvRows(LlamaModel& model, std::span<const int32_t> tokens,
                                     const CalibrationRunOptions& options) {
  absl::StatusOr<RopeSchedule> rope = model.config().rope();
  if (!rope.ok()) return rope.status();
  KvRows rows;
  rows.geometry = model.config().cache_geometry();
  const size_t heads = static_cast<size_t>(rows.geometry.n_layers) * rows.geometry.n_kv_heads;
  rows.keys_post.resize(heads);
  rows.keys_pre.resize(heads);
  rows.values.resize(heads);
  rows.rope = *rope;
  absl::Status st =  // the recorder leaves the query energies when it is destroyed
      RunCalibrationWindows(model, tokens, options, [&](std::unique_ptr<KvCache> inner) {
        return std::make_unique<RowRecorder>(std::move(inner), &rows, *rope);
      });
  if (!st.ok()) return st;
  CalibrationStats o = CalibrationStats::Zeros(rows.geometry, model.config().n_heads);
  if (absl::Status s = AccumulateOutputGrams(model, &o); !s.ok()) return s;
  const int d = rows.geometry.head_dim;
  for (int l = 0; l < rows.geometry.n_layers; ++l) {
    for (int h = 0; h < rows.geometry.n_kv_heads; ++h) {
      std::vector<float> diag(static_cast<size_t>(d));
      for (int x = 0; x < d; ++x) {
        diag[static_cast<size_t>(x)] = static_cast<float>(
            o.g_o[static_cast<size_t>(l)][(static_cast<size_t>(h) * d + x) * d + x]);
      }
      rows.output_energy.push_back(std::move(diag));
    }
  }
  return rows;
}

absl::StatusOr<std::vector<TransformStream>> AnalyzeKvRows(const KvRows& rows,
                                                           const TransformFitOptions& o) {
  const KvCacheGeometry& g = rows.geometry;
  const size_t heads = static_cast<size_t>(g.n_layers) * g.n_kv_heads;
  std::vector<TransformStream> streams;  // keys of every layer-head, then values
  for (int side = 0; side < 2; ++side) {
    for (size_t at = 0; at < heads; ++at) {
      const std::vector<float>& x =
          side == 1 ? rows.values[at] : (o.pre_rope_keys ? rows.keys_pre[at] : rows.keys_post[at]);
      std::vector<float> metric;
      if (o.attention_weighted) {
        metric = side == 1         ? Normalized(rows.output_energy[at])
                 : o.pre_rope_keys ? Normalized(PairAveraged(rows.query_energy[at], rows.rope))
                                   : Normalized(rows.query_energy[at]);
      }
      absl::StatusOr<TransformStream> s = AnalyzeStream(
          x.data(), static_cast<int64_t>(x.size()) / g.head_dim, g.head_dim, o.code, metric);
      if (!s.ok()) return s.status();
      streams.push_back(*std::move(s));
    }
  }
  return streams;
}

absl::StatusOr<TransformCodes> AllocateKvCodes(std::span<const TransformStream> streams,
                                               const TransformFitOptions& o) {
  if (streams.size() % 2 != 0) return absl::InvalidArgumentError("keys and values unpaired");
  const size_t heads = streams.size() / 2;
  std::vector<TransformCode> all;
  if (o.joint) {  // one budget: the mean of the two over every row
    absl::StatusOr<std::vector<TransformCode>> c =
        AllocateTransformCodes(streams, o.code.widths, 0.5 * (o.key_bits + o.value_bits), true);
    if (!c.ok()) return c.status();
    all = *std::move(c);
  } else {
    for (int side = 0; side < 2; ++side) {
      absl::StatusOr<std::vector<TransformCode>> c =
          AllocateTransformCodes(streams.subspan(side * heads, heads), o.code.widths,
                                 side == 0 ? o.key_bits : o.value_bits, false);
      if (!c.ok()) return c.status();
      all.insert(all.end(), c->begin(), c->end());
    }
  }
  const std::vector<TransformCode>* codes = &all;
  TransformCodes out;
  out.keys =
      std::make_shared<const std::vector<TransformCode>>(codes->begin(), codes->begin() + heads);
  out.values =
      std::make_shared<const std::vector<TransformCode>>(codes->begin() + heads, codes->end());
  return out;
}

absl::StatusOr<TransformCodes> FitTransformCodes(const KvRows& rows, const TransformFitOptions& o) {
  absl::StatusOr<std::vector<TransformStream>> streams = AnalyzeKvRows(rows, o);
  if (!streams.ok()) return streams.status();
  return AllocateKvCodes(*streams, o);
}

}  // namespace subspace
