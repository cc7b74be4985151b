// TransformStatistics; see transform_refresh.h.
#include "core/compress/transform_refresh.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <span>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace subspace {

namespace {

// What a component of each width costs in a block's run: ceil(B w / 8) bytes.
std::vector<int> ByteCosts(std::span<const int> widths, int block_size) {
  std::vector<int> costs;
  for (int w : widths) costs.push_back((block_size * w + 7) / 8);
  return costs;
}

}  // namespace

TransformStatistics::TransformStatistics(const KvCacheGeometry& g, int block_size,
                                         const RefreshConfig& config, const TransformCodes& initial)
    : g_(g), block_size_(block_size), config_(config), current_(initial) {
  const size_t d = static_cast<size_t>(g.head_dim);
  const size_t n = static_cast<size_t>(g.n_layers) * 2 * static_cast<size_t>(g.n_kv_heads);
  streams_.resize(n);
  for (int l = 0; l < g.n_layers; ++l) {
    for (int side = 0; side < 2; ++side) {
      for (int h = 0; h < g.n_kv_heads; ++h) {
        const TransformCode& c =
            (side == 0 ? *initial.keys
                       : *initial.values)[static_cast<size_t>(l * g.n_kv_heads + h)];
        budgets_.push_back(static_cast<int>(LayOutCodedRun(c, block_size).run_bytes));
        std::vector<float> metric;
        for (float x : c.scale) metric.push_back(x * x);
        metrics_.push_back(std::move(metric));
        Stream& s = stream(l, side, h);
        s.sum.assign(d, 0.0);
        s.outer.assign(d * d, 0.0);
        s.samples.assign(static_cast<size_t>(kSampleRows) * d, 0.0f);
        s.extremes.assign(static_cast<size_t>(kExtremeRows) * d, 0.0f);
        s.extreme_score.assign(kExtremeRows, 0.0);
      }
    }
  }
}

int64_t TransformStatistics::BytesFor(const KvCacheGeometry& g) {
  const int64_t d = g.head_dim;
  const int64_t per_stream = (d + d * d) * 8 + int64_t{kSampleRows + kExtremeRows} * d * 4;
  return per_stream * 2 * g.n_layers * g.n_kv_heads;
}

void TransformStatistics::Observe(Stream& s, const std::vector<float>& metric, const float* rows,
                                  int n) {
  const int d = g_.head_dim;
  if (config_.half_life_tokens > 0.0) {
    const double keep = std::exp2(-static_cast<double>(n) / config_.half_life_tokens);
    s.weight *= keep;
    for (double& x : s.sum) x *= keep;
    for (double& x : s.outer) x *= keep;
  }
  for (int t = 0; t < n; ++t) {
    const float* x = rows + static_cast<int64_t>(t) * d;
    s.weight += 1.0;
    for (int i = 0; i < d; ++i) {
      const double xi = x[i];
      s.sum[static_cast<size_t>(i)] += xi;
      double* o = s.outer.data() + static_cast<size_t>(i) * d;
      for (int j = 0; j <= i; ++j) o[j] += xi * x[j];  // lower triangle; mirrored at refresh
    }
    std::copy_n(x, d, s.samples.data() + (s.rows % kSampleRows) * d);
    ++s.rows;
    // Its distance from the running mean; kept if among the farthest seen.
    double score = 0.0;
    for (int i = 0; i < d; ++i) {
      const double c = x[i] - s.sum[static_cast<size_t>(i)] / s.weight;
      score += c * c * (metric.empty() ? 1.0 : metric[static_cast<size_t>(i)]);
    }
    int slot = s.n_extremes;
    if (slot == kExtremeRows) {
      slot = static_cast<int>(std::min_element(s.extreme_score.begin(), s.extreme_score.end()) -
                              s.extreme_score.begin());
      if (s.extreme_score[static_cast<size_t>(slot)] >= score) continue;
    } else {
      ++s.n_extremes;
    }
    s.extreme_score[static_cast<size_t>(slot)] = score;
    std::copy_n(x, d, s.extremes.data() + static_cast<int64_t>(slot) * d);
  }
}

void TransformStatistics::ObserveBlock(int layer, const float* keys, const float* values, int n) {
  if (layer < 0 || layer >= g_.n_layers || n < 1) return;
  const int64_t head = static_cast<int64_t>(n) * g_.head_dim;
  for (int h = 0; h < g_.n_kv_heads; ++h) {
    const size_t k = static_cast<size_t>((layer * 2) * g_.n_kv_heads + h);
    const size_t v = static_cast<size_t>((layer * 2 + 1) * g_.n_kv_heads + h);
    Observe(stream(layer, 0, h), metrics_[k], keys + h * head, n);
    Observe(stream(layer, 1, h), metrics_[v], values + h * head, n);
  }
}

absl::StatusOr<TransformCode> TransformStatistics::Refit(const Stream& s,
                                                         const std::vector<float>& metric,
                                                         int budget_bytes) const {
  const size_t d = static_cast<size_t>(g_.head_dim);
  std::vector<double> mean(d), cov(d * d);
  for (size_t i = 0; i < d; ++i) mean[i] = s.sum[i] / s.weight;
  for (size_t i = 0; i < d; ++i) {
    for (size_t j = 0; j <= i; ++j) {
      const double c = s.outer[i * d + j] / s.weight - mean[i] * mean[j];
      cov[i * d + j] = cov[j * d + i] = c;
    }
  }
  // The quantizers are fitted on the recent rows and the farthest ones.
  const int64_t kept = std::min<int64_t>(s.rows, kSampleRows);
  std::vector<float> samples(s.samples.begin(), s.samples.begin() + kept * g_.head_dim);
  samples.insert(samples.end(), s.extremes.begin(),
                 s.extremes.begin() + static_cast<int64_t>(s.n_extremes) * g_.head_dim);
  const TransformCodeOptions options;  // the widths and the PCA basis a calibration uses
  absl::StatusOr<TransformStream> stream =
      AnalyzeMoments(mean, cov, samples.data(), kept + s.n_extremes, g_.head_dim, options, metric);
  if (!stream.ok()) return absl::InternalError(stream.status().message());
  // Costs in bytes, so the refit's run is never longer than the slot's.
  absl::StatusOr<std::vector<int>> choice =
      AllocateByCost(stream->distortion, ByteCosts(options.widths, block_size_), budget_bytes);
  if (!choice.ok()) return absl::InternalError(choice.status().message());
  return MakeTransformCode(*stream, *choice);
}

absl::StatusOr<RefreshedEpoch> TransformStatistics::RefreshEpoch() {
  auto keys = std::make_shared<std::vector<TransformCode>>(*current_.keys);
  auto values = std::make_shared<std::vector<TransformCode>>(*current_.values);
  bool any = false;
  for (int l = 0; l < g_.n_layers; ++l) {
    for (int side = 0; side < 2; ++side) {
      for (int h = 0; h < g_.n_kv_heads; ++h) {
        const Stream& s = stream(l, side, h);
        if (s.rows < kMinRows) continue;  // too little to fit on: the code stays
        const size_t at = static_cast<size_t>((l * 2 + side) * g_.n_kv_heads + h);
        absl::StatusOr<TransformCode> code = Refit(s, metrics_[at], budgets_[at]);
        if (!code.ok()) {
          return absl::InternalError(absl::StrFormat("refit of layer %d KV head %d %s: %s", l, h,
                                                     side == 0 ? "keys" : "values",
                                                     code.status().message()));
        }
        (side == 0 ? *keys : *values)[static_cast<size_t>(l * g_.n_kv_heads + h)] =
            *std::move(code);
        any = true;
      }
    }
  }
  if (!any) return RefreshedEpoch{};
  current_ = {.keys = keys, .values = values};
  return RefreshedEpoch{.codes = current_};
}

}  // namespace subspace
