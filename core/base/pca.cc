// Eigensolvers for PCA bases. LAPACK (linked through OpenBLAS) first reduces the matrix to
// tridiagonal form (4/3 n^3, blocked) and then solves that; Jacobi stays as the reference:
// O(n^3) per sweep, ~6-10 sweeps, column-strided rotations.
//
// Which LAPACK driver, measured on the 2-core EPYC dev box, one thread, r = n/4, time per matrix:
//   n                        32       64      128      256
//   dsyevr RANGE='I' (top r) 0.09 ms  0.41 ms  1.70 ms  7.07 ms
//   dsyevd (all, D&C)        0.07 ms  0.25 ms  0.94 ms  4.29 ms
//   Jacobi (this file)                ~1.8 ms  ~20 ms
// dsyevr's partial range goes through bisection + inverse iteration (dstebz/dstein), which
// at these sizes costs more than divide and conquer computing every eigenpair, so dsyevd.
#include "core/base/pca.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <mutex>
#include <numeric>
#include <vector>

// LAPACK from OpenBLAS, 32-bit integers (Debian's libopenblas0 is not ILP64). gfortran passes
// the length of each CHARACTER argument as a hidden trailing size_t.
extern "C" void dsyevd_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda,
                        double* w, double* work, const int* lwork, int* iwork, const int* liwork,
                        int* info, size_t jobz_len, size_t uplo_len);
// OpenBLAS's own API (a netlib cblas.h lacks it); see core/cpu/matmul.cc.
extern "C" void openblas_set_num_threads(int num_threads);

namespace subspace {

namespace {

// Top-r eigenpairs by dsyevd. false if LAPACK reports an error. values: [r]; vecs: [n, r]
bool TopEigenpairsLapack(int n, const double* gram, int r, double* values, double* vecs) {
  // Row-major and column-major agree on a symmetric matrix. On return `a` holds the
  // eigenvectors as columns (column-major), eigenvalues ascending.
  std::vector<double> a(gram, gram + static_cast<size_t>(n) * n);
  std::vector<double> w(static_cast<size_t>(n));
  const int lwork = 1 + 6 * n + 2 * n * n, liwork = 3 + 5 * n;  // the documented minimums
  std::vector<double> work(static_cast<size_t>(lwork));
  std::vector<int> iwork(static_cast<size_t>(liwork));
  int info = 0;
  dsyevd_("V", "U", &n, a.data(), &n, w.data(), work.data(), &lwork, iwork.data(), &liwork, &info,
          1, 1);
  if (info != 0) return false;
  for (int j = 0; j < r; ++j) {  // ascending -> descending
    const size_t src = static_cast<size_t>(n - 1 - j);
    values[j] = w[src];
    for (int i = 0; i < n; ++i) vecs[static_cast<size_t>(i) * r + j] = a[src * n + i];
  }
  return true;
}

void TopEigenpairsJacobi(int n, const double* gram, int r, double* values, double* vecs) {
  std::vector<double> a(gram, gram + static_cast<size_t>(n) * n), all_values, all_vecs;
  SymmetricEigen(n, a, &all_values, &all_vecs);
  for (int j = 0; j < r; ++j) {
    values[j] = all_values[static_cast<size_t>(j)];
    for (int i = 0; i < n; ++i) {
      vecs[static_cast<size_t>(i) * r + j] = all_vecs[static_cast<size_t>(i) * n + j];
    }
  }
}

}  // namespace

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
        const double t =
            (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
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
    (*values)[static_cast<size_t>(j)] =
        at(a, order[static_cast<size_t>(j)], order[static_cast<size_t>(j)]);
    for (int i = 0; i < n; ++i) at(*vecs, i, j) = at(v, i, order[static_cast<size_t>(j)]);
  }
}

void TopEigenpairs(int n, const double* gram, int r, EigenSolver solver, double* values,
                   double* vecs) {
  if (r <= 0) return;
  if (solver == EigenSolver::kJacobi || !TopEigenpairsLapack(n, gram, r, values, vecs)) {
    TopEigenpairsJacobi(n, gram, r, values, vecs);
  }
  for (int j = 0; j < r; ++j) {
    int arg = 0;
    for (int i = 1; i < n; ++i) {
      if (std::fabs(vecs[static_cast<size_t>(i) * r + j]) >
          std::fabs(vecs[static_cast<size_t>(arg) * r + j])) {
        arg = i;
      }
    }
    if (vecs[static_cast<size_t>(arg) * r + j] < 0) {
      for (int i = 0; i < n; ++i)
        vecs[static_cast<size_t>(i) * r + j] = -vecs[static_cast<size_t>(i) * r + j];
    }
  }
}

void TopEigenvectors(int n, const std::vector<double>& gram, int r, float* out,
                     EigenSolver solver) {
  std::vector<double> values(static_cast<size_t>(r)), vecs(static_cast<size_t>(n) * r);
  TopEigenpairs(n, gram.data(), r, solver, values.data(), vecs.data());
  for (size_t i = 0; i < vecs.size(); ++i) out[i] = static_cast<float>(vecs[i]);
}

std::vector<double> SymmetricFromUpper(int d, const double* upper) {
  std::vector<double> full(static_cast<size_t>(d) * d);
  for (int i = 0; i < d; ++i) {
    for (int j = i; j < d; ++j) {
      const double x = upper[static_cast<size_t>(i) * d + j];
      full[static_cast<size_t>(i) * d + j] = x;
      full[static_cast<size_t>(j) * d + i] = x;
    }
  }
  return full;
}

void GramOfRows(const double* x, int64_t rows, int d, double* gram) {
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, static_cast<int>(rows), 1.0, x, d, 0.0,
              gram, d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < i; ++j)
      gram[static_cast<size_t>(i) * d + j] = gram[static_cast<size_t>(j) * d + i];
  }
}

void UseSingleThreadedBlas() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

}  // namespace subspace
