// One sequence's running statistics for online basis refresh: per layer and KV head, what the
// chosen method keeps about the keys, values (and, for KQ-SVD, queries) of the blocks the cache
// compressed, and the turning of those statistics into a new basis epoch. Single-threaded and
// deterministic; the Refresher runs it on its own thread.
//
// Memory per sequence and (layer, KV head), d = head_dim, in doubles: pca 2 d^2, kqsvd 3 d^2,
// oja 2 d^2 (the covariance since the last refresh) + d (r_k + r_v), fd 4 d (r_k + r_v).
// At d = 128 that is 256 KiB (pca) per head-layer: 64 MiB for a 32-layer, 8-KV-head model,
// host memory, which is why refresh is opt-in per session and fd is the small one.
#ifndef SUBSPACE_CORE_COMPRESS_ONLINE_STATISTICS_H_
#define SUBSPACE_CORE_COMPRESS_ONLINE_STATISTICS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/compress/basis.h"
#include "core/compress/refresh_statistics.h"
#include "core/kvcache/refresh_config.h"

namespace subspace {

class OnlineStatistics final : public RefreshStatistics {
 public:
  // `initial`: the epoch the sequence compresses with now; Oja starts from it, and heads
  // without data keep its bases. Ranks are the cache's (every epoch has the same shapes).
  OnlineStatistics(const KvCacheGeometry& g, int n_heads, std::vector<int> r_k,
                   std::vector<int> r_v, const RefreshConfig& config, const Basis& initial);

  // One compressed block of `layer`: n tokens per KV head, as the cache stores a block.
  // keys, values: [n_kv, n, d]
  void ObserveBlock(int layer, const float* keys, const float* values, int n) override;
  // Queries of `layer` (KQ-SVD only; ignored otherwise). q: [n, n_heads, d]. Each row counts
  // `weight` times: a backend that keeps every other query of a long chunk passes 2.
  void ObserveQueries(int layer, const float* q, int64_t n, double weight = 1.0) override;
  int n_heads() const { return n_heads_; }
  int head_dim() const { return g_.head_dim; }
  bool wants_queries() const { return config_.method == RefreshMethod::kKqsvd; }
  int64_t query_width() const override {
    return wants_queries() ? static_cast<int64_t>(n_heads_) * g_.head_dim : 0;
  }

  // A new epoch from everything observed so far; Oja consumes its covariance. INTERNAL when
  // the statistics hold non-finite numbers (the old epoch stays in use).
  absl::StatusOr<Basis> Refresh();
  absl::StatusOr<RefreshedEpoch> RefreshEpoch() override;

  const RefreshConfig& config() const override { return config_; }
  int n_layers() const override { return g_.n_layers; }

 private:
  struct HeadState {
    std::vector<double> g_k, g_v, g_q;  // [d, d] upper triangles (pca, kqsvd; oja: since refresh)
    double oja_tokens = 0.0;            // oja: tokens in g_k / g_v since the last refresh
    std::vector<double> u_k, u_v;       // oja: [d, r_k], [d, r_v] orthonormal columns
    std::vector<double> fd_k, fd_v;     // fd: [2 l, d] sketch rows, l = min(2 r, d)
    int fd_rows_k = 0, fd_rows_v = 0;   // fd: rows in use
  };

  HeadState& head(int layer, int h) {
    return heads_[static_cast<size_t>(layer) * g_.n_kv_heads + h];
  }
  // fd: appends rows [n, d] to a sketch of 2l rows, shrinking to l whenever it fills.
  void FdInsert(std::vector<double>& sketch, int& used, int l, const float* rows, int n);
  // oja: U <- QR(U + eta (C U - U U^T C U)), C = the covariance over its spectral norm.
  void OjaStep(std::vector<double>& u, int r, const std::vector<double>& cov_upper) const;

  KvCacheGeometry g_;
  int n_heads_;
  std::vector<int> r_k_, r_v_;
  RefreshConfig config_;
  Basis current_;                 // the last epoch produced (or the initial one)
  std::vector<HeadState> heads_;  // [n_layers * n_kv]
};

// Residual energy of keys under a basis, as a query sees them: sum ||k - P_q P_k^T k||^2 and
// sum ||k||^2 over rows (the numerator and denominator of the residual-energy ratio).
// keys: [n, d]; p_q, p_k: [d, r]
void KeyResidualEnergy(const float* keys, int64_t n, int d, int r, const float* p_q,
                       const float* p_k, double* residual, double* energy);

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_ONLINE_STATISTICS_H_
