#include "core/compress/transform_codec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/base/pca.h"

namespace subspace {
namespace {

// Squared error of the quantizer over the samples.
double QuantizerMse(const ComponentQuantizer& q, std::span<const float> samples) {
  double err = 0.0;
  for (float x : samples) {
    const double e = static_cast<double>(x) - q.Decode(q.Encode(x));
    err += e * e;
  }
  return err / static_cast<double>(samples.size());
}

// Least-squares refinement of offset and step for the codes the samples take now (the affine
// map is linear in both), then re-assigned codes; squared error never grows.
ComponentQuantizer RefineAffine(ComponentQuantizer q, std::span<const float> samples) {
  double best = QuantizerMse(q, samples);
  for (int iter = 0; iter < 8; ++iter) {
    double sc = 0, scc = 0, sx = 0, scx = 0;
    for (float x : samples) {
      const double c = q.Encode(x);
      sc += c;
      scc += c * c;
      sx += x;
      scx += c * x;
    }
    const double n = static_cast<double>(samples.size());
    const double det = n * scc - sc * sc;
    if (!(det > 0.0)) break;
    ComponentQuantizer next = q;
    next.step = static_cast<float>((n * scx - sc * sx) / det);
    next.offset = static_cast<float>((sx - next.step * sc) / n);
    if (!(next.step > 0.0f)) break;
    const double mse = QuantizerMse(next, samples);
    if (!(mse < best * (1.0 - 1e-9))) break;
    best = mse;
    q = next;
  }
  return q;
}

}  // namespace

uint32_t ComponentQuantizer::Encode(float x) const {
  if (bits == 0 || !(step > 0.0f)) return 0;
  const float levels = static_cast<float>((1u << bits) - 1);
  const float c = std::round((x - offset) / step);
  if (!(c > 0.0f)) return 0;  // NaN included
  return static_cast<uint32_t>(std::min(c, levels));
}

CodedRunLayout LayOutCodedRun(const TransformCode& code, int block_size) {
  CodedRunLayout run;
  std::vector<int> order(code.components.size());
  for (size_t j = 0; j < order.size(); ++j) order[j] = static_cast<int>(j);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
    return code.components[static_cast<size_t>(x)].bits >
           code.components[static_cast<size_t>(y)].bits;
  });
  for (int j : order) {
    const int bits = code.components[static_cast<size_t>(j)].bits;
    if (bits == 0) break;  // widest first: the rest have none
    run.components.push_back(j);
    run.byte_at.push_back(run.run_bytes);
    run.run_bytes += (int64_t{block_size} * bits + 7) / 8;
  }
  return run;
}

int TransformCode::BitsPerRow() const {
  int bits = 0;
  for (const ComponentQuantizer& c : components) bits += c.bits;
  return bits;
}

void TransformCode::Encode(const float* x, uint8_t* codes) const {
  std::fill(codes, codes + BytesPerRow(), uint8_t{0});
  int64_t bit = 0;
  for (int j = 0; j < dim; ++j) {
    const ComponentQuantizer& q = components[static_cast<size_t>(j)];
    if (q.bits == 0) continue;
    const float* b = basis.data() + static_cast<int64_t>(j) * dim;
    double c = 0.0;
    if (scale.empty()) {
      for (int i = 0; i < dim; ++i) c += static_cast<double>(b[i]) * (x[i] - mean[i]);
    } else {
      for (int i = 0; i < dim; ++i) c += static_cast<double>(b[i]) * (x[i] - mean[i]) * scale[i];
    }
    const uint32_t code = q.Encode(static_cast<float>(c));
    for (int k = 0; k < q.bits; ++k, ++bit) {
      if ((code >> k) & 1u) codes[bit >> 3] |= static_cast<uint8_t>(1u << (bit & 7));
    }
  }
}

void TransformCode::Decode(const uint8_t* codes, float* x) const {
  std::fill(x, x + dim, 0.0f);
  int64_t bit = 0;
  for (int j = 0; j < dim; ++j) {
    const ComponentQuantizer& q = components[static_cast<size_t>(j)];
    uint32_t code = 0;
    for (int k = 0; k < q.bits; ++k, ++bit) code |= ((codes[bit >> 3] >> (bit & 7)) & 1u) << k;
    const float c = q.Decode(code);
    if (c == 0.0f) continue;
    const float* b = basis.data() + static_cast<int64_t>(j) * dim;
    for (int i = 0; i < dim; ++i) x[i] += c * b[i];
  }
  if (scale.empty()) {
    for (int i = 0; i < dim; ++i) x[i] += mean[i];
  } else {
    for (int i = 0; i < dim; ++i) x[i] = x[i] / scale[i] + mean[i];
  }
}

void TransformCode::RoundTrip(float* x) const {
  std::vector<uint8_t> codes(static_cast<size_t>(BytesPerRow()) + 1);
  Encode(x, codes.data());
  Decode(codes.data(), x);
}

FittedQuantizer FitComponentQuantizer(std::span<const float> samples, int bits) {
  FittedQuantizer f;
  f.quantizer.bits = bits;
  if (samples.empty()) return f;
  double sum = 0, sum2 = 0;
  float lo = samples[0], hi = samples[0];
  for (float x : samples) {
    sum += x;
    sum2 += static_cast<double>(x) * x;
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  const double n = static_cast<double>(samples.size());
  const double mean = sum / n;
  const double var = std::max(0.0, sum2 / n - mean * mean);
  f.quantizer.offset = static_cast<float>(mean);
  if (bits == 0 || !(hi > lo)) {
    f.quantizer.step = 0.0f;
    f.quantizer.offset = bits == 0 ? static_cast<float>(mean) : lo;
    f.mse = bits == 0 ? var : 0.0;
    return f;
  }
  const double levels = static_cast<double>((1u << bits) - 1);
  const double sd = std::sqrt(var);
  auto with_range = [&](double a, double b) {
    ComponentQuantizer q;
    q.bits = bits;
    q.offset = static_cast<float>(a);
    q.step = static_cast<float>((b - a) / levels);
    return q;
  };
  ComponentQuantizer best = with_range(lo, hi);
  double best_mse = QuantizerMse(best, samples);
  // a from 0.5 to ~12 standard deviations, geometric; ranges wider than [min, max] cannot win.
  for (double a = 0.5; a < 12.5; a *= 1.12) {
    const double a_lo = std::max<double>(lo, mean - a * sd),
                 a_hi = std::min<double>(hi, mean + a * sd);
    if (!(a_hi > a_lo)) continue;
    const ComponentQuantizer q = with_range(a_lo, a_hi);
    const double mse = QuantizerMse(q, samples);
    if (mse < best_mse) {
      best_mse = mse;
      best = q;
    }
  }
  f.quantizer = RefineAffine(best, samples);
  f.mse = QuantizerMse(f.quantizer, samples);
  return f;
}

absl::StatusOr<std::vector<int>> AllocateWidths(std::span<const std::vector<double>> distortion,
                                                std::span<const int> widths, int budget_bits) {
  for (int w : widths) {
    if (w < 0 || w > ComponentQuantizer::kMaxBits) {
      return absl::InvalidArgumentError(absl::StrFormat("width %d not in [0, 8]", w));
    }
  }
  return AllocateByCost(distortion, widths, budget_bits);
}

absl::StatusOr<std::vector<int>> AllocateByCost(std::span<const std::vector<double>> distortion,
                                                std::span<const int> costs, int budget) {
  if (costs.empty()) return absl::InvalidArgumentError("no options to allocate");
  int narrowest = costs[0];
  for (int w : costs) {
    if (w < 0 || w > 255) {
      return absl::InvalidArgumentError(absl::StrFormat("cost %d not in [0, 255]", w));
    }
    narrowest = std::min(narrowest, w);
  }
  const int64_t n = static_cast<int64_t>(distortion.size());
  for (const std::vector<double>& d : distortion) {
    if (d.size() != costs.size()) {
      return absl::InvalidArgumentError("a distortion row does not have one entry per option");
    }
  }
  if (budget < 0 || narrowest * n > budget) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "budget of %d is below the %d the cheapest options take", budget, narrowest * n));
  }
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // dp[b]: least distortion of the components so far at a cost of at most b.
  std::vector<double> dp(static_cast<size_t>(budget) + 1, 0.0), next(dp.size());
  std::vector<uint8_t> choice(static_cast<size_t>(n) * dp.size());
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<double>& d = distortion[static_cast<size_t>(i)];
    uint8_t* ch = choice.data() + i * static_cast<int64_t>(dp.size());
    for (int b = 0; b <= budget; ++b) {
      double best = kInf;
      int arg = 0;
      for (size_t o = 0; o < costs.size(); ++o) {
        if (costs[o] > b) continue;
        const double v = dp[static_cast<size_t>(b - costs[o])] + d[o];
        if (v < best) {
          best = v;
          arg = static_cast<int>(o);
        }
      }
      next[static_cast<size_t>(b)] = best;
      ch[b] = static_cast<uint8_t>(arg);
    }
    std::swap(dp, next);
  }
  std::vector<int> out(static_cast<size_t>(n));
  int b = budget;
  for (int64_t i = n - 1; i >= 0; --i) {
    const int o = choice[static_cast<size_t>(i * static_cast<int64_t>(dp.size()) + b)];
    out[static_cast<size_t>(i)] = o;
    b -= costs[static_cast<size_t>(o)];
  }
  return out;
}

namespace {

absl::Status CheckStreamArgs(int64_t n, int dim, const TransformCodeOptions& o,
                             std::span<const float> metric) {
  if (n < 2 || dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("need >= 2 rows of >= 1 dims, got %d x %d", n, dim));
  }
  for (int w : o.widths) {
    if (w < 0 || w > ComponentQuantizer::kMaxBits) {
      return absl::InvalidArgumentError(absl::StrFormat("width %d not in [0, 8]", w));
    }
  }
  if (!metric.empty() && metric.size() != static_cast<size_t>(dim)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("metric of %d weights for %d dims", metric.size(), dim));
  }
  for (float m : metric) {
    if (!(m > 0.0f) || !std::isfinite(m)) {
      return absl::InvalidArgumentError("metric weights must be positive and finite");
    }
  }
  return absl::OkStatus();
}

// The rest of a stream once its mean and scale are set: the basis from `gram` (the weighted,
// centred second moments, [dim, dim], any positive multiple; ignored without PCA), then each
// component's quantizers fitted on evenly spaced rows of `samples` ([n, dim]).
void FinishStream(TransformStream& s, const double* gram, const float* samples, int64_t n,
                  const TransformCodeOptions& o) {
  const int dim = s.dim;
  auto weight = [&](int i) { return s.scale.empty() ? 1.0 : static_cast<double>(s.scale[i]); };
  s.basis.assign(static_cast<size_t>(dim) * dim, 0.0f);
  if (o.pca) {
    std::vector<double> values(static_cast<size_t>(dim)), vecs(static_cast<size_t>(dim) * dim);
    TopEigenpairs(dim, gram, dim, EigenSolver::kLapack, values.data(), vecs.data());
    for (int j = 0; j < dim; ++j) {  // component j = column j of vecs
      for (int i = 0; i < dim; ++i) {
        s.basis[static_cast<size_t>(j) * dim + i] =
            static_cast<float>(vecs[static_cast<size_t>(i) * dim + j]);
      }
    }
  } else {
    for (int i = 0; i < dim; ++i) s.basis[static_cast<size_t>(i) * dim + i] = 1.0f;
  }
  // Coefficients of evenly spaced rows, one component at a time.
  const int64_t m = std::min<int64_t>(n, std::max<int64_t>(o.max_fit_samples, 2));
  std::vector<float> coeff(static_cast<size_t>(m));
  s.by_width.resize(static_cast<size_t>(dim));
  s.distortion.resize(static_cast<size_t>(dim));
  for (int j = 0; j < dim; ++j) {
    const float* b = s.basis.data() + static_cast<int64_t>(j) * dim;
    for (int64_t k = 0; k < m; ++k) {
      const float* x = samples + (k * n / m) * dim;
      double c = 0.0;
      for (int i = 0; i < dim; ++i) {
        c += static_cast<double>(b[i]) * (x[i] - s.mean[static_cast<size_t>(i)]) * weight(i);
      }
      coeff[static_cast<size_t>(k)] = static_cast<float>(c);
    }
    for (int w : o.widths) {
      FittedQuantizer f = FitComponentQuantizer(coeff, w);
      s.distortion[static_cast<size_t>(j)].push_back(f.mse);
      s.by_width[static_cast<size_t>(j)].push_back(f);
    }
    double mu = 0.0, v = 0.0;
    for (float c : coeff) mu += c;
    mu /= static_cast<double>(m);
    for (float c : coeff) v += (c - mu) * (c - mu);
    s.variance += v / static_cast<double>(m);
  }
}

}  // namespace

absl::StatusOr<TransformStream> AnalyzeStream(const float* rows, int64_t n, int dim,
                                              const TransformCodeOptions& o,
                                              std::span<const float> metric) {
  if (absl::Status st = CheckStreamArgs(n, dim, o, metric); !st.ok()) return st;
  TransformStream s;
  s.dim = dim;
  for (float m : metric) s.scale.push_back(std::sqrt(m));
  auto weight = [&](int i) { return s.scale.empty() ? 1.0 : static_cast<double>(s.scale[i]); };
  std::vector<double> mean(static_cast<size_t>(dim), 0.0);
  for (int64_t r = 0; r < n; ++r) {
    for (int i = 0; i < dim; ++i) mean[static_cast<size_t>(i)] += rows[r * dim + i];
  }
  for (double& m : mean) m /= static_cast<double>(n);
  s.mean.assign(mean.begin(), mean.end());
  std::vector<double> gram;
  if (o.pca) {
    std::vector<double> centred(static_cast<size_t>(n) * dim);
    for (int64_t r = 0; r < n; ++r) {
      for (int i = 0; i < dim; ++i) {
        centred[static_cast<size_t>(r * dim + i)] =
            (rows[r * dim + i] - mean[static_cast<size_t>(i)]) * weight(i);
      }
    }
    gram.resize(static_cast<size_t>(dim) * dim);
    GramOfRows(centred.data(), n, dim, gram.data());
  }
  FinishStream(s, gram.data(), rows, n, o);
  return s;
}

absl::StatusOr<TransformStream> AnalyzeMoments(std::span<const double> mean,
                                               std::span<const double> covariance,
                                               const float* samples, int64_t n, int dim,
                                               const TransformCodeOptions& o,
                                               std::span<const float> metric) {
  if (absl::Status st = CheckStreamArgs(n, dim, o, metric); !st.ok()) return st;
  const size_t d = static_cast<size_t>(dim);
  if (mean.size() != d || covariance.size() != d * d) {
    return absl::InvalidArgumentError(absl::StrFormat("moments of %d and %d numbers for %d dims",
                                                      mean.size(), covariance.size(), dim));
  }
  for (double x : covariance) {
    if (!std::isfinite(x)) return absl::InvalidArgumentError("a covariance that is not finite");
  }
  TransformStream s;
  s.dim = dim;
  for (float m : metric) s.scale.push_back(std::sqrt(m));
  for (double m : mean) {
    if (!std::isfinite(m)) return absl::InvalidArgumentError("a mean that is not finite");
    s.mean.push_back(static_cast<float>(m));
  }
  std::vector<double> gram(covariance.begin(), covariance.end());
  if (!s.scale.empty()) {
    for (size_t i = 0; i < d; ++i) {
      for (size_t j = 0; j < d; ++j) gram[i * d + j] *= double{s.scale[i]} * s.scale[j];
    }
  }
  FinishStream(s, gram.data(), samples, n, o);
  return s;
}

TransformCode MakeTransformCode(const TransformStream& s, std::span<const int> choice) {
  TransformCode c;
  c.dim = s.dim;
  c.mean = s.mean;
  c.scale = s.scale;
  c.basis = s.basis;
  c.components.resize(static_cast<size_t>(s.dim));
  for (int j = 0; j < s.dim; ++j) {
    c.components[static_cast<size_t>(j)] =
        s.by_width[static_cast<size_t>(j)][static_cast<size_t>(choice[static_cast<size_t>(j)])]
            .quantizer;
  }
  return c;
}

absl::StatusOr<std::vector<TransformCode>> AllocateTransformCodes(
    std::span<const TransformStream> streams, std::span<const int> widths, double bits_per_row,
    bool joint) {
  std::vector<TransformCode> out;
  if (streams.empty()) return out;
  for (const TransformStream& s : streams) {
    if (s.by_width.size() != static_cast<size_t>(s.dim) ||
        (s.dim > 0 && s.by_width[0].size() != widths.size())) {
      return absl::InvalidArgumentError("stream analysed with other widths");
    }
  }
  if (!joint) {
    for (const TransformStream& s : streams) {
      const int budget = static_cast<int>(std::lround(bits_per_row * s.dim));
      absl::StatusOr<std::vector<int>> choice = AllocateWidths(s.distortion, widths, budget);
      if (!choice.ok()) return choice.status();
      out.push_back(MakeTransformCode(s, *choice));
    }
    return out;
  }
  std::vector<std::vector<double>> all;
  int64_t dims = 0;
  for (const TransformStream& s : streams) {
    const double norm = s.variance > 0.0 ? 1.0 / s.variance : 1.0;
    for (const std::vector<double>& d : s.distortion) {
      std::vector<double> scaled = d;
      for (double& x : scaled) x *= norm;
      all.push_back(std::move(scaled));
    }
    dims += s.dim;
  }
  const int budget = static_cast<int>(std::lround(bits_per_row * static_cast<double>(dims)));
  absl::StatusOr<std::vector<int>> choice = AllocateWidths(all, widths, budget);
  if (!choice.ok()) return choice.status();
  size_t at = 0;
  for (const TransformStream& s : streams) {
    out.push_back(MakeTransformCode(
        s, std::span<const int>(choice->data() + at, static_cast<size_t>(s.dim))));
    at += static_cast<size_t>(s.dim);
  }
  return out;
}

}  // namespace subspace
