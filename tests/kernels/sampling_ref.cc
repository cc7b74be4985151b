// Plain loops over host memory: the reference the sampling kernel is tested against. Every
// expression that decides a token is written as core/model/sampler.cc writes it.
#include "tests/kernels/sampling_ref.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

namespace subspace::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Distance of the running sum `cumulative` (just reached `target` at this candidate) and of the
// previous running sum from the target, relative to `total`. A previous sum of 0 is no
// boundary: nothing can fall below it.
double CrossingMargin(double before, double cumulative, double target, double total) {
  double m = (cumulative - target) / total;
  if (before > 0.0) m = std::min(m, (target - before) / total);
  return m;
}

}  // namespace

SampleRowResult SampleRowRef(std::span<const float> logits, float temperature, int32_t top_k,
                             float top_p, float min_p, double uniform) {
  const auto vocab = static_cast<int32_t>(logits.size());
  SampleRowResult out;
  out.margin = kInf;
  if (vocab == 0) {  // nothing to sample (the host asserts against it)
    out.log_z = -kInf;
    out.logprob = kNegInf;
    return out;
  }

  // The host's sanitising pass: NaN as -inf, +inf as the largest finite float.
  std::vector<float> x(logits.begin(), logits.end());
  float max_logit = kNegInf;
  int32_t argmax = 0;
  for (int32_t i = 0; i < vocab; ++i) {
    if (std::isnan(x[i])) {
      x[i] = kNegInf;
    } else if (x[i] > std::numeric_limits<float>::max()) {
      x[i] = std::numeric_limits<float>::max();
    }
    if (x[i] > x[argmax]) argmax = i;
    max_logit = std::max(max_logit, x[i]);
  }
  out.log_z = -kInf;
  if (max_logit > kNegInf) {
    double sum = 0.0;
    for (float v : x) sum += std::exp(v - max_logit);  // float terms, double sum
    out.log_z = static_cast<double>(max_logit) + std::log(sum);
  }

  out.token = argmax;
  if (temperature > 0.0f && max_logit > kNegInf) {
    // The strict order of the host sampler; a full sort, where the host sorts only what it must.
    std::vector<int32_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
    const bool use_top_k = top_k > 0 && top_k < vocab;
    // Without top-k and top-p the host never sorts: its draw walks the candidates by id.
    const bool sorted_walk = use_top_k || top_p < 1.0f;

    // Candidates in sorted order: the top_k best (or all), minus -inf.
    std::vector<int32_t> cand(order.begin(), use_top_k ? order.begin() + top_k : order.end());
    while (!cand.empty() && x[cand.back()] == kNegInf) cand.pop_back();

    // Weights relative to the best candidate, as the host computes them (float).
    std::vector<float> w(cand.size());
    for (size_t j = 0; j < cand.size(); ++j)
      w[j] = std::exp((x[cand[j]] - max_logit) / temperature);

    if (min_p > 0.0f) {
      size_t kept = 0;
      for (size_t j = 0; j < cand.size(); ++j) {
        out.margin = std::min(out.margin, std::fabs(static_cast<double>(w[j]) - min_p) / min_p);
        if (w[j] >= min_p) {
          cand[kept] = cand[j];
          w[kept] = w[j];
          ++kept;
        }
      }
      cand.resize(kept);
      w.resize(kept);
    }

    if (top_p < 1.0f) {
      double total = 0.0;
      for (float v : w) total += v;
      const double target = static_cast<double>(top_p) * total;
      double cumulative = 0.0;
      for (size_t j = 0; j < w.size(); ++j) {
        const double before = cumulative;
        cumulative += w[j];
        if (cumulative >= target) {
          out.margin = std::min(out.margin, CrossingMargin(before, cumulative, target, total));
          cand.resize(j + 1);
          w.resize(j + 1);
          break;
        }
      }
    }

    if (!sorted_walk) {
      // The same survivors, by id (their weights go with them).
      std::vector<size_t> by_id(cand.size());
      std::iota(by_id.begin(), by_id.end(), size_t{0});
      std::sort(by_id.begin(), by_id.end(), [&](size_t a, size_t b) { return cand[a] < cand[b]; });
      std::vector<int32_t> c2;
      std::vector<float> w2;
      for (size_t j : by_id) {
        c2.push_back(cand[j]);
        w2.push_back(w[j]);
      }
      cand.swap(c2);
      w.swap(w2);
    }

    double total = 0.0;
    for (float v : w) total += v;
    const double r = uniform * total;
    double cumulative = 0.0;
    bool drawn = false;
    for (size_t j = 0; j < w.size() && !drawn; ++j) {
      const double before = cumulative;
      cumulative += w[j];
      if (r < cumulative) {
        out.token = cand[j];
        out.margin = std::min(out.margin, CrossingMargin(before, cumulative, r, total));
        drawn = true;
      }
    }
    if (!drawn) {
      // r rounded up to the total: the last candidate with any weight, as the host.
      out.margin = 0.0;
      out.token = cand.front();
      for (size_t j = w.size(); j-- > 0;) {
        if (w[j] > 0.0f) {
          out.token = cand[j];
          break;
        }
      }
    }
  }
  out.logprob = max_logit > kNegInf
                    ? static_cast<float>(static_cast<double>(x[out.token]) - out.log_z)
                    : kNegInf;
  return out;
}

void SampleTokensRef(const SampleTokensParams& p, double* margin) {
  for (int64_t row = 0; row < p.n_rows; ++row) {
    const SampleRowResult r =
        SampleRowRef(std::span<const float>(p.logits + row * p.vocab, static_cast<size_t>(p.vocab)),
                     p.temperature[row], p.top_k[row], p.top_p[row], p.min_p[row], p.uniform[row]);
    p.token[row] = r.token;
    p.logprob[row] = r.logprob;
    if (margin != nullptr) margin[row] = r.margin;
  }
}

}  // namespace subspace::kernels
