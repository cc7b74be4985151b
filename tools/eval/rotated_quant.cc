#include "tools/eval/rotated_quant.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <random>

#include "core/base/tensor_types.h"

namespace subspace::eval {

void NormalizedHadamard(float* x, int n) {
  assert(n > 0 && (n & (n - 1)) == 0);
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  const float s = 1.0f / std::sqrt(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= s;
}

RandomizedHadamard::RandomizedHadamard(int n, uint32_t seed) : signs_(static_cast<size_t>(n)) {
  std::mt19937 rng(seed);
  for (float& s : signs_) s = (rng() & 1u) ? -1.0f : 1.0f;
}

void RandomizedHadamard::Rotate(float* x) const {
  for (int i = 0; i < n(); ++i) x[i] *= signs_[static_cast<size_t>(i)];
  NormalizedHadamard(x, n());
}

void RandomizedHadamard::Unrotate(float* x) const {
  NormalizedHadamard(x, n());
  for (int i = 0; i < n(); ++i) x[i] *= signs_[static_cast<size_t>(i)];
}

std::vector<float> GaussianLloydMax(int bits) {
  assert(bits >= 1 && bits <= 8);
  const int levels = 1 << bits;
  // The density on a fine grid over [-10, 10]; Lloyd's iteration: thresholds halfway between
  // levels, each level the conditional mean of its cell.
  constexpr int kGrid = 200001;
  constexpr double kLo = -10.0, kHi = 10.0;
  const double dx = (kHi - kLo) / (kGrid - 1);
  std::vector<double> x(kGrid), p(kGrid);
  for (int i = 0; i < kGrid; ++i) {
    x[static_cast<size_t>(i)] = kLo + i * dx;
    p[static_cast<size_t>(i)] =
        std::exp(-0.5 * x[static_cast<size_t>(i)] * x[static_cast<size_t>(i)]);
  }
  std::vector<double> c(static_cast<size_t>(levels));
  for (int k = 0; k < levels; ++k) c[static_cast<size_t>(k)] = -3.0 + 6.0 * (k + 0.5) / levels;
  for (int iter = 0; iter < 2000; ++iter) {
    std::vector<double> num(static_cast<size_t>(levels), 0.0),
        den(static_cast<size_t>(levels), 0.0);
    int k = 0;
    for (int i = 0; i < kGrid; ++i) {
      while (k + 1 < levels && x[static_cast<size_t>(i)] > 0.5 * (c[static_cast<size_t>(k)] +
                                                                  c[static_cast<size_t>(k + 1)])) {
        ++k;
      }
      num[static_cast<size_t>(k)] += x[static_cast<size_t>(i)] * p[static_cast<size_t>(i)];
      den[static_cast<size_t>(k)] += p[static_cast<size_t>(i)];
    }
    double moved = 0.0;
    for (int j = 0; j < levels; ++j) {
      if (den[static_cast<size_t>(j)] <= 0.0) continue;
      const double next = num[static_cast<size_t>(j)] / den[static_cast<size_t>(j)];
      moved = std::max(moved, std::fabs(next - c[static_cast<size_t>(j)]));
      c[static_cast<size_t>(j)] = next;
    }
    if (moved < 1e-9) break;
  }
  return std::vector<float>(c.begin(), c.end());
}

uint32_t NearestLevel(std::span<const float> levels, float x) {
  const auto it = std::lower_bound(levels.begin(), levels.end(), x);
  if (it == levels.begin()) return 0;
  if (it == levels.end()) return static_cast<uint32_t>(levels.size() - 1);
  const size_t hi = static_cast<size_t>(it - levels.begin());
  return static_cast<uint32_t>(x - levels[hi - 1] <= levels[hi] - x ? hi - 1 : hi);
}

void RoundTripTurbo(const RandomizedHadamard& rotation, int bits, int n_high, float* x) {
  assert(bits >= 1 && bits + (n_high > 0 ? 1 : 0) <= 5);
  // One codebook per width, computed once (Lloyd's iteration takes a few milliseconds).
  static const std::vector<std::vector<float>> kBooks = [] {
    std::vector<std::vector<float>> books(6);
    for (int b = 1; b <= 5; ++b) books[static_cast<size_t>(b)] = GaussianLloydMax(b);
    return books;
  }();
  const int n = rotation.n();
  rotation.Rotate(x);
  double norm2 = 0.0;
  for (int i = 0; i < n; ++i) norm2 += static_cast<double>(x[i]) * x[i];
  const float norm = Fp16ToFp32(Fp32ToFp16(static_cast<float>(std::sqrt(norm2))));
  if (norm2 > 0.0) {
    const float to_unit = static_cast<float>(std::sqrt(static_cast<double>(n) / norm2));
    const float back = norm / std::sqrt(static_cast<float>(n));
    for (int i = 0; i < n; ++i) {
      const std::vector<float>& book = kBooks[static_cast<size_t>(i < n_high ? bits + 1 : bits)];
      x[i] = book[NearestLevel(book, x[i] * to_unit)] * back;
    }
  }
  rotation.Unrotate(x);
}

}  // namespace subspace::eval
