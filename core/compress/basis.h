// Basis epochs: the projections that give compressed coefficients their meaning, per layer and
// KV head, in a refcounted registry with global ids. A compressed block names the epoch that
// made it; attention projects each query once per live epoch (docs/design.md, "Exactness across
// basis changes").
#ifndef SUBSPACE_CORE_COMPRESS_BASIS_H_
#define SUBSPACE_CORE_COMPRESS_BASIS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/base/pca.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

using EpochId = int32_t;
inline constexpr EpochId kNoEpoch = -1;

// One layer's bases for all its KV heads. Row-major; per head h the matrix starts at
// h * rows * cols.
struct LayerBasis {
  int rank_k = 0;
  int rank_v = 0;
  std::vector<float> p_q;  // [n_kv, d, r_k]  query side: q~ = P_q^T q
  std::vector<float> p_k;  // [n_kv, d, r_k]  key side:   c  = P_k^T k
  std::vector<float> p_v;  // [n_kv, d, r_v]  value side: u  = P_v^T v
  std::vector<float> r_v;  // [n_kv, r_v, d]  expansion:  o  = R_v^T (sum alpha u)
};

// An epoch: bases for every layer. Orthogonal (PCA/K-SVD: P_q = P_k, R_v = P_v^T) and
// oblique (KQ-SVD: P_q != P_k) bases are both just matrices here.
struct Basis {
  KvCacheGeometry geometry;
  std::vector<LayerBasis> layers;  // [n_layers]

  // A zero-filled basis with the given ranks per layer (ranks: [n_layers] each).
  static Basis Zeros(const KvCacheGeometry& g, const std::vector<int>& r_k,
                     const std::vector<int>& r_v);
  // Orthogonal basis from per-layer, per-head key and value bases (columns orthonormal):
  // sets P_q = P_k = u_k and P_v = u_v, R_v = u_v^T. Fills r_v from p_v.
  void MakeOrthogonalFromPkPv();
};

// INVALID_ARGUMENT unless `b` matches the geometry and the ranks (each [n_layers]) exactly.
// Bitwise equality of two bases' ranks and matrices (an epoch read back from an image is the
// default epoch when they are equal: the importer reuses it rather than installing a copy).
bool SameBasisMatrices(const Basis& a, const Basis& b);

absl::Status ValidateBasis(const Basis& b, const KvCacheGeometry& g, const std::vector<int>& r_k,
                           const std::vector<int>& r_v);

// Epoch 0 until calibration exists: PCA of one sequence's keys and values. grams_k,
// grams_v: per layer [n_kv, d, d] (K^T K and V^T V accumulated in double); the top-r_k / r_v
// eigenvectors per head become an orthogonal basis. The 2 * n_layers * n_kv eigenproblems
// run in parallel (OpenMP); kJacobi is the slow reference (tests, benchmark).
Basis PcaBasis(const KvCacheGeometry& g, const std::vector<int>& r_k, const std::vector<int>& r_v,
               const std::vector<std::vector<double>>& grams_k,
               const std::vector<std::vector<double>>& grams_v,
               EigenSolver solver = EigenSolver::kLapack);

// Refcounted epochs. Register hands the caller one reference; Release drops one and deletes
// the epoch at zero. Not thread-safe for mutation: the cache mutates it from the engine thread
// only; Get may run concurrently with other Gets (Attend).
class BasisRegistry {
 public:
  EpochId Register(std::shared_ptr<const Basis> basis);
  // NOT_FOUND for an unknown id.
  absl::Status Acquire(EpochId id);
  void Release(EpochId id);
  // nullptr for an unknown id.
  const Basis* Get(EpochId id) const;
  // The same, shared: keeps the epoch's matrices alive past a Release (another thread's copy).
  std::shared_ptr<const Basis> GetShared(EpochId id) const;
  int32_t RefCount(EpochId id) const;
  int64_t live() const { return static_cast<int64_t>(epochs_.size()); }

 private:
  struct Entry {
    std::shared_ptr<const Basis> basis;
    int32_t refs = 0;
  };
  absl::flat_hash_map<EpochId, Entry> epochs_;
  EpochId next_id_ = 0;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_BASIS_H_
