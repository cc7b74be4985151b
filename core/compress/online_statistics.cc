// Online statistics and the refresh methods; see online_statistics.h.
//
// Decay: a block of n new tokens first multiplies what was accumulated by 2^(-n / half_life),
// so the statistics are an exponentially weighted window over the sequence. Oja is the
// exception: its covariance holds only the blocks since the last refresh, and the learning rate
// sets how far one refresh moves the subspace. Frequent directions keeps 2l rows and, when
// full, shrinks to l by subtracting the (l+1)-th squared singular value from all of them
// (Liberty's sketch with the doubling of Ghashami et al.): the covariance error of the sketch
// stays below ||X||_F^2 / (l - r) for the top r directions.
#include "core/compress/online_statistics.h"

#include <cblas.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/base/pca.h"
#include "core/compress/calibration.h"

namespace subspace {
namespace {

// KQ-SVD's floor on the singular values of K (as the calibration tool).
constexpr double kSigmaFloor = 1e-7;

double TraceOf(int d, const std::vector<double>& m) {
  double t = 0.0;
  for (int i = 0; i < d; ++i) t += m[static_cast<size_t>(i) * d + i];
  return t;
}

// Largest eigenvalue of a symmetric PSD matrix ([d, d]) by power iteration: the scale that
// makes Oja's learning rate dimensionless (eta = 1 is one power-iteration-sized step).
double SpectralNorm(int d, const std::vector<double>& m) {
  std::vector<double> x(static_cast<size_t>(d), 1.0 / std::sqrt(static_cast<double>(d))),
      y(x.size());
  double lambda = 0.0;
  for (int it = 0; it < 30; ++it) {
    cblas_dgemv(CblasRowMajor, CblasNoTrans, d, d, 1.0, m.data(), d, x.data(), 1, 0.0, y.data(), 1);
    const double n = cblas_dnrm2(d, y.data(), 1);
    if (!(n > 0.0)) return 0.0;
    lambda = n;
    for (int i = 0; i < d; ++i) x[static_cast<size_t>(i)] = y[static_cast<size_t>(i)] / n;
  }
  return lambda;
}

bool AllFinite(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}

// gram (upper) = decay * gram + weight * x^T x.  x: [n, d] with row stride ldx; gram: [d, d]
void AddRows(const float* x, int64_t n, int d, int64_t ldx, double decay, std::vector<double>& gram,
             double weight = 1.0) {
  thread_local std::vector<double> rows;
  rows.resize(static_cast<size_t>(n) * d);
  for (int64_t i = 0; i < n; ++i) {
    for (int j = 0; j < d; ++j) rows[static_cast<size_t>(i * d + j)] = x[i * ldx + j];
  }
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, static_cast<int>(n), weight, rows.data(), d,
              decay, gram.data(), d);
}

// Modified Gram-Schmidt on the columns of u ([d, r]); a column that vanishes is replaced by the
// first unit vector that is independent of the ones before it.
void Orthonormalize(std::vector<double>& u, int d, int r) {
  for (int c = 0; c < r; ++c) {
    for (int attempt = 0; attempt <= d; ++attempt) {
      for (int p = 0; p < c; ++p) {
        double dot = 0.0;
        for (int i = 0; i < d; ++i)
          dot += u[static_cast<size_t>(i) * r + p] * u[static_cast<size_t>(i) * r + c];
        for (int i = 0; i < d; ++i)
          u[static_cast<size_t>(i) * r + c] -= dot * u[static_cast<size_t>(i) * r + p];
      }
      double norm = 0.0;
      for (int i = 0; i < d; ++i)
        norm += u[static_cast<size_t>(i) * r + c] * u[static_cast<size_t>(i) * r + c];
      norm = std::sqrt(norm);
      if (norm > 1e-10) {
        for (int i = 0; i < d; ++i) u[static_cast<size_t>(i) * r + c] /= norm;
        break;
      }
      for (int i = 0; i < d; ++i) u[static_cast<size_t>(i) * r + c] = i == attempt % d ? 1.0 : 0.0;
    }
  }
}

// Columns [:, :r] of a row-major [d, d] matrix as floats. out: [d, r]
void LeadingColumns(const std::vector<double>& m, int d, int r, float* out) {
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < r; ++j)
      out[static_cast<size_t>(i) * r + j] = static_cast<float>(m[static_cast<size_t>(i) * d + j]);
  }
}

// Top-r eigenvectors of a symmetric upper-triangle Gram. out: [d, r]
void TopOfGram(int d, const std::vector<double>& upper, int r, float* out) {
  TopEigenvectors(d, SymmetricFromUpper(d, upper.data()), r, out);
}

// r_v ([r, d]) = p ([d, r])^T
void Transpose(const float* p, int d, int r, float* out) {
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < r; ++j)
      out[static_cast<size_t>(j) * d + i] = p[static_cast<size_t>(i) * r + j];
  }
}

bool AllFinite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace

OnlineStatistics::OnlineStatistics(const KvCacheGeometry& g, int n_heads, std::vector<int> r_k,
                                   std::vector<int> r_v, const RefreshConfig& config,
                                   const Basis& initial)
    : g_(g),
      n_heads_(n_heads),
      r_k_(std::move(r_k)),
      r_v_(std::move(r_v)),
      config_(config),
      current_(initial),
      heads_(static_cast<size_t>(g.n_layers) * g.n_kv_heads) {
  const int d = g_.head_dim;
  const size_t dd = static_cast<size_t>(d) * d;
  for (int l = 0; l < g_.n_layers; ++l) {
    const int rk = r_k_[static_cast<size_t>(l)], rv = r_v_[static_cast<size_t>(l)];
    const LayerBasis& lb = current_.layers[static_cast<size_t>(l)];
    for (int h = 0; h < g_.n_kv_heads; ++h) {
      HeadState& s = head(l, h);
      switch (config_.method) {
        case RefreshMethod::kKqsvd:
          s.g_q.assign(dd, 0.0);
          [[fallthrough]];
        case RefreshMethod::kPca:
        case RefreshMethod::kOja:
          s.g_k.assign(dd, 0.0);
          s.g_v.assign(dd, 0.0);
          break;
        case RefreshMethod::kFd:
          s.fd_k.assign(static_cast<size_t>(4 * std::min(2 * rk, d)) * d, 0.0);
          s.fd_v.assign(static_cast<size_t>(4 * std::min(2 * rv, d)) * d, 0.0);
          break;
        case RefreshMethod::kNone:
          break;
      }
      if (config_.method != RefreshMethod::kOja) continue;
      // Oja starts from the subspace keys and values are reconstructed in: span(P_q) and
      // span(R_v^T) (for orthogonal bases the same as P_k's and P_v's).
      s.u_k.resize(static_cast<size_t>(d) * rk);
      s.u_v.resize(static_cast<size_t>(d) * rv);
      const float* pq = lb.p_q.data() + static_cast<size_t>(h) * d * rk;   // [d, r_k]
      const float* rvm = lb.r_v.data() + static_cast<size_t>(h) * rv * d;  // [r_v, d]
      for (int i = 0; i < d; ++i) {
        for (int j = 0; j < rk; ++j)
          s.u_k[static_cast<size_t>(i) * rk + j] = pq[static_cast<size_t>(i) * rk + j];
        for (int j = 0; j < rv; ++j)
          s.u_v[static_cast<size_t>(i) * rv + j] = rvm[static_cast<size_t>(j) * d + i];
      }
      Orthonormalize(s.u_k, d, rk);
      Orthonormalize(s.u_v, d, rv);
    }
  }
}

void OnlineStatistics::ObserveBlock(int layer, const float* keys, const float* values, int n) {
  assert(layer >= 0 && layer < g_.n_layers && n > 0);
  const int d = g_.head_dim;
  const double decay =
      config_.half_life_tokens > 0.0 ? std::exp2(-n / config_.half_life_tokens) : 1.0;
  const int rk = r_k_[static_cast<size_t>(layer)], rv = r_v_[static_cast<size_t>(layer)];
  for (int h = 0; h < g_.n_kv_heads; ++h) {
    HeadState& s = head(layer, h);
    const float* k = keys + static_cast<size_t>(h) * n * d;    // [n, d]
    const float* v = values + static_cast<size_t>(h) * n * d;  // [n, d]
    switch (config_.method) {
      case RefreshMethod::kPca:
      case RefreshMethod::kKqsvd:
        AddRows(k, n, d, d, decay, s.g_k);
        AddRows(v, n, d, d, decay, s.g_v);
        if (!s.g_q.empty()) {
          for (double& x : s.g_q) x *= decay;
        }
        break;
      case RefreshMethod::kOja:
        AddRows(k, n, d, d, 1.0, s.g_k);
        AddRows(v, n, d, d, 1.0, s.g_v);
        s.oja_tokens += n;
        break;
      case RefreshMethod::kFd: {
        const double scale = std::sqrt(decay);
        for (double& x : s.fd_k) x *= scale;
        for (double& x : s.fd_v) x *= scale;
        FdInsert(s.fd_k, s.fd_rows_k, std::min(2 * rk, d), k, n);
        FdInsert(s.fd_v, s.fd_rows_v, std::min(2 * rv, d), v, n);
        break;
      }
      case RefreshMethod::kNone:
        break;
    }
  }
}

void OnlineStatistics::ObserveQueries(int layer, const float* q, int64_t n, double weight) {
  if (!wants_queries() || n <= 0) return;
  const int d = g_.head_dim;
  const int group = n_heads_ / g_.n_kv_heads;
  for (int j = 0; j < n_heads_; ++j) {
    AddRows(q + static_cast<size_t>(j) * d, n, d, static_cast<int64_t>(n_heads_) * d, 1.0,
            head(layer, j / group).g_q, weight);
  }
}

void OnlineStatistics::FdInsert(std::vector<double>& sketch, int& used, int l, const float* rows,
                                int n) {
  const int d = g_.head_dim;
  for (int i = 0; i < n; ++i) {
    if (used == 2 * l) {
      // Shrink: the sketch's Gram S^T S = V diag(lambda) V^T; keep the top l directions with
      // lambda - lambda_(l+1) of their energy.
      std::vector<double> gram(static_cast<size_t>(d) * d, 0.0);
      cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, used, 1.0, sketch.data(), d, 0.0,
                  gram.data(), d);
      const int keep = std::min(l + 1, d);
      std::vector<double> lambda(static_cast<size_t>(keep)), vecs(static_cast<size_t>(d) * keep);
      TopEigenpairs(d, SymmetricFromUpper(d, gram.data()).data(), keep, EigenSolver::kLapack,
                    lambda.data(), vecs.data());
      const double delta = l < d ? std::max(lambda[static_cast<size_t>(l)], 0.0) : 0.0;
      std::fill(sketch.begin(), sketch.end(), 0.0);
      for (int r = 0; r < l; ++r) {
        const double sigma = std::sqrt(std::max(lambda[static_cast<size_t>(r)] - delta, 0.0));
        for (int c = 0; c < d; ++c) {
          sketch[static_cast<size_t>(r) * d + c] = sigma * vecs[static_cast<size_t>(c) * keep + r];
        }
      }
      used = l;
    }
    for (int c = 0; c < d; ++c)
      sketch[static_cast<size_t>(used) * d + c] = rows[static_cast<size_t>(i) * d + c];
    ++used;
  }
}

void OnlineStatistics::OjaStep(std::vector<double>& u, int r,
                               const std::vector<double>& cov_upper) const {
  const int d = g_.head_dim;
  std::vector<double> c = SymmetricFromUpper(d, cov_upper.data());
  const double norm = SpectralNorm(d, c);
  if (!(norm > 0.0)) return;
  for (double& x : c) x /= norm;
  std::vector<double> cu(static_cast<size_t>(d) * r), utcu(static_cast<size_t>(r) * r);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, d, r, d, 1.0, c.data(), d, u.data(), r,
              0.0, cu.data(), r);
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r, r, d, 1.0, u.data(), r, cu.data(), r, 0.0,
              utcu.data(), r);
  // cu <- C U - U (U^T C U), then u <- u + eta cu.
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, d, r, r, -1.0, u.data(), r, utcu.data(), r,
              1.0, cu.data(), r);
  const double eta = config_.oja_learning_rate;
  for (size_t i = 0; i < u.size(); ++i) u[i] += eta * cu[i];
  Orthonormalize(u, d, r);
}

absl::StatusOr<RefreshedEpoch> OnlineStatistics::RefreshEpoch() {
  absl::StatusOr<Basis> basis = Refresh();
  if (!basis.ok()) return basis.status();
  return RefreshedEpoch{.basis = std::make_shared<const Basis>(*std::move(basis))};
}

absl::StatusOr<Basis> OnlineStatistics::Refresh() {
  const int d = g_.head_dim;
  for (const HeadState& s : heads_) {
    for (const std::vector<double>* v : {&s.g_k, &s.g_v, &s.g_q, &s.fd_k, &s.fd_v}) {
      if (!AllFinite(*v)) return absl::InternalError("online refresh statistics are not finite");
    }
  }
  Basis next = current_;
  for (int l = 0; l < g_.n_layers; ++l) {
    const int rk = r_k_[static_cast<size_t>(l)], rv = r_v_[static_cast<size_t>(l)];
    LayerBasis& lb = next.layers[static_cast<size_t>(l)];
    for (int h = 0; h < g_.n_kv_heads; ++h) {
      HeadState& s = head(l, h);
      float* pq = lb.p_q.data() + static_cast<size_t>(h) * d * rk;   // [d, r_k]
      float* pk = lb.p_k.data() + static_cast<size_t>(h) * d * rk;   // [d, r_k]
      float* pv = lb.p_v.data() + static_cast<size_t>(h) * d * rv;   // [d, r_v]
      float* rvm = lb.r_v.data() + static_cast<size_t>(h) * rv * d;  // [r_v, d]
      // keys_new: KQ-SVD produced keys, so the PCA fallback must not overwrite them.
      bool keys_new = false, values_new = false;
      switch (config_.method) {
        case RefreshMethod::kKqsvd:
          if (TraceOf(d, s.g_q) > 0.0 && TraceOf(d, s.g_k) > 0.0) {
            const HeadFactors f =
                FactorHead(d, s.g_k.data(), s.g_q.data(), /*kqsvd=*/true, 0.0, kSigmaFloor);
            LeadingColumns(f.left, d, rk, pk);
            LeadingColumns(f.right, d, rk, pq);
            keys_new = true;
          }
          [[fallthrough]];
        case RefreshMethod::kPca:
          if (!keys_new && TraceOf(d, s.g_k) > 0.0) {
            TopOfGram(d, s.g_k, rk, pk);
            std::copy(pk, pk + static_cast<size_t>(d) * rk, pq);
          }
          if (TraceOf(d, s.g_v) > 0.0) {
            TopOfGram(d, s.g_v, rv, pv);
            values_new = true;
          }
          break;
        case RefreshMethod::kOja:
          if (s.oja_tokens > 0.0) {
            OjaStep(s.u_k, rk, s.g_k);
            OjaStep(s.u_v, rv, s.g_v);
            for (size_t i = 0; i < s.u_k.size(); ++i) pk[i] = pq[i] = static_cast<float>(s.u_k[i]);
            for (size_t i = 0; i < s.u_v.size(); ++i) pv[i] = static_cast<float>(s.u_v[i]);
            std::fill(s.g_k.begin(), s.g_k.end(), 0.0);
            std::fill(s.g_v.begin(), s.g_v.end(), 0.0);
            s.oja_tokens = 0.0;
            values_new = true;
          }
          break;
        case RefreshMethod::kFd:
          for (int side = 0; side < 2; ++side) {
            const std::vector<double>& sketch = side == 0 ? s.fd_k : s.fd_v;
            const int used = side == 0 ? s.fd_rows_k : s.fd_rows_v;
            if (used == 0) continue;
            std::vector<double> gram(static_cast<size_t>(d) * d, 0.0);
            cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, used, 1.0, sketch.data(), d, 0.0,
                        gram.data(), d);
            if (side == 0) {
              TopOfGram(d, gram, rk, pk);
              std::copy(pk, pk + static_cast<size_t>(d) * rk, pq);
            } else {
              TopOfGram(d, gram, rv, pv);
              values_new = true;
            }
          }
          break;
        case RefreshMethod::kNone:
          break;
      }
      if (values_new) Transpose(pv, d, rv, rvm);
    }
    if (!AllFinite(lb.p_q) || !AllFinite(lb.p_k) || !AllFinite(lb.p_v) || !AllFinite(lb.r_v)) {
      return absl::InternalError(
          absl::StrCat("online refresh produced a non-finite basis in layer ", l));
    }
  }
  current_ = next;
  return next;
}

void KeyResidualEnergy(const float* keys, int64_t n, int d, int r, const float* p_q,
                       const float* p_k, double* residual, double* energy) {
  std::vector<double> c(static_cast<size_t>(r));
  double res = 0.0, en = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    const float* k = keys + t * d;
    std::fill(c.begin(), c.end(), 0.0);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < r; ++j)
        c[static_cast<size_t>(j)] +=
            static_cast<double>(p_k[static_cast<size_t>(i) * r + j]) * k[i];
    }
    for (int i = 0; i < d; ++i) {
      double kh = 0.0;
      for (int j = 0; j < r; ++j)
        kh += static_cast<double>(p_q[static_cast<size_t>(i) * r + j]) * c[static_cast<size_t>(j)];
      res += (k[i] - kh) * (k[i] - kh);
      en += static_cast<double>(k[i]) * k[i];
    }
  }
  *residual += res;
  *energy += en;
}

}  // namespace subspace
