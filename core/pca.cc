// Cyclic Jacobi: each rotation zeroes one off-diagonal pair; sweeps until the off-diagonal
// mass is negligible. O(n^3) per sweep, ~6-10 sweeps; quadratic convergence at the end.
#include "core/pca.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace subspace {

void SymmetricEigen(int n, std::vector<double>& a, std::vector<double>* values,
                    std::vector<double>* vecs) {
  const auto at = [n](std::vector<double>& m, int i, int j) -> double& {
    return m[static_cast<size_t>(i) * n + j];
  };
  std::vector<double> v(static_cast<size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i) at(v, i, i) = 1.0;
  double total = 0.0;
  for (double x : a) total += x * x;
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0.0;
    for (int i = 0; i < n; ++i) {
      for (int j = i + 1; j < n; ++j) off += at(a, i, j) * at(a, i, j);
    }
    if (off <= 1e-30 * total || off == 0.0) break;
    for (int p = 0; p < n; ++p) {
      for (int q = p + 1; q < n; ++q) {
        const double apq = at(a, p, q);
        if (std::fabs(apq) < 1e-300) continue;
        const double theta = (at(a, q, q) - at(a, p, p)) / (2.0 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0);
        const double s = t * c;
        for (int k = 0; k < n; ++k) {  // columns p, q
          const double akp = at(a, k, p), akq = at(a, k, q);
          at(a, k, p) = c * akp - s * akq;
          at(a, k, q) = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // rows p, q
          const double apk = at(a, p, k), aqk = at(a, q, k);
          at(a, p, k) = c * apk - s * aqk;
          at(a, q, k) = s * apk + c * aqk;
        }
        for (int k = 0; k < n; ++k) {
          const double vkp = at(v, k, p), vkq = at(v, k, q);
          at(v, k, p) = c * vkp - s * vkq;
          at(v, k, q) = s * vkp + c * vkq;
        }
      }
    }
  }
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return at(a, x, x) > at(a, y, y); });
  values->assign(static_cast<size_t>(n), 0.0);
  vecs->assign(static_cast<size_t>(n) * n, 0.0);
  for (int j = 0; j < n; ++j) {
    (*values)[static_cast<size_t>(j)] = at(a, order[static_cast<size_t>(j)], order[static_cast<size_t>(j)]);
    for (int i = 0; i < n; ++i) at(*vecs, i, j) = at(v, i, order[static_cast<size_t>(j)]);
  }
}

void TopEigenvectors(int n, const std::vector<double>& gram, int r, float* out) {
  std::vector<double> a = gram, values, vecs;
  SymmetricEigen(n, a, &values, &vecs);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < r; ++j) {
      out[static_cast<size_t>(i) * r + j] = static_cast<float>(vecs[static_cast<size_t>(i) * n + j]);
    }
  }
}

}  // namespace subspace
