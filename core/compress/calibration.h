// Offline calibration of the compressed cache's bases (docs/design.md, "The compressed KV cache"):
// a KvCache decorator that accumulates per layer and KV head the d x d Gram matrices of
// post-RoPE keys, of the GQA group's queries and of values while the model runs, and the basis
// methods (K-SVD, Eigen, KQ-SVD) that turn those Gram matrices into an epoch. Only d x d
// matrices are ever kept, so any number of calibration tokens costs O(d^2) memory.
#ifndef SUBSPACE_CORE_COMPRESS_CALIBRATION_H_
#define SUBSPACE_CORE_COMPRESS_CALIBRATION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/compress/basis.h"
#include "core/kvcache/forwarding_kv_cache.h"
#include "core/kvcache/kv_cache.h"
#include "core/model/model.h"

namespace subspace {

enum class KeyBasisMethod : uint8_t {
  kKsvd,   // P_q = P_k = top-r eigenvectors of G_K (PCA of the keys)
  kEigen,  // P_q = P_k = top-r eigenvectors of G_K + G_Q (SVD of the stacked [K; Q])
  kKqsvd,  // optimal rank-r K Q^T (seed 002): P_k = V S^-1 U'_r, P_q = V S U'_r
};
enum class ValueBasisMethod : uint8_t {
  kKsvd,   // P_v = top-r eigenvectors of G_V, R_v = P_v^T
  kKqsvd,  // optimal rank-r V W_O (seed 002, appendix B): G_Q -> W_O W_O^T
};

const char* KeyBasisMethodName(KeyBasisMethod m);      // "ksvd" | "eigen" | "kqsvd"
const char* ValueBasisMethodName(ValueBasisMethod m);  // "ksvd" | "kqsvd"
absl::StatusOr<KeyBasisMethod> ParseKeyBasisMethod(std::string_view name);
absl::StatusOr<ValueBasisMethod> ParseValueBasisMethod(std::string_view name);

// Per layer, per KV head Gram matrices, accumulated in double. During accumulation only the
// upper triangle (row <= col) of each matrix is maintained (BLAS dsyrk); the basis methods read
// only that triangle.
struct CalibrationStats {
  KvCacheGeometry geometry;
  int n_heads = 0;  // query heads; query head j belongs to KV head j / (n_heads / n_kv_heads)
  int64_t key_tokens = 0;                // tokens written to layer 0
  int64_t query_tokens = 0;              // queries attended in layer 0
  std::vector<std::vector<double>> g_k;  // [n_layers][n_kv, d, d]  sum k k^T
  std::vector<std::vector<double>> g_q;  // [n_layers][n_kv, d, d]  sum over the group of q q^T
  std::vector<std::vector<double>> g_v;  // [n_layers][n_kv, d, d]  sum v v^T
  std::vector<std::vector<double>> g_o;  // [n_layers][n_kv, d, d]  sum over the group of W_j^T W_j

  // Zero statistics for a geometry; n_heads must be a multiple of n_kv_heads.
  static CalibrationStats Zeros(const KvCacheGeometry& g, int n_heads);
};

// Adds rows to upper-triangular Gram matrices, one per head of a [rows, n_heads_in, d] block:
// head j goes to gram[j / heads_per_gram]. x: [rows, n_heads_in, d]; grams: [*, d, d]
void AccumulateHeadGrams(const float* x, int64_t rows, int n_heads_in, int d, int heads_per_gram,
                         double* grams);

// Fills stats->g_o from the model's attn_output weights (any stored type): for query head j,
// W_j is the [dim, d] column slice of W_O that maps the head's output into the residual stream.
absl::Status AccumulateOutputGrams(const LlamaModel& model, CalibrationStats* stats);

// Forwards everything to `inner` while accumulating keys and values in Write and queries in
// Attend (they arrive post-RoPE). Thread-safe like any KvCache: accumulation takes a mutex.
class CalibratingKvCache final : public ForwardingKvCache {
 public:
  // `stats` must outlive this cache and match inner's geometry.
  CalibratingKvCache(std::unique_ptr<KvCache> inner, CalibrationStats* stats);

  void Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k, const float* v) override;
  void Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) override;

 private:
  absl::Mutex mu_;
  CalibrationStats* stats_;  // guarded by mu_ while the cache runs
};

// Runs `model` over calibration tokens and returns the statistics (g_o included). The tokens are
// cut into windows of `window` tokens (at most the context length), each run as a fresh
// sequence of one prefill, prefixed with `bos` when >= 0 so every window starts like a prompt.
struct CalibrationRunOptions {
  int window = 512;
  int64_t max_tokens = 0;  // 0: all the tokens
  int32_t bos = -1;
  // Called after each window with tokens done and total (progress reporting); may be empty.
  std::function<void(int64_t done, int64_t total)> progress;
};
absl::StatusOr<CalibrationStats> CollectCalibrationStats(LlamaModel& model,
                                                         std::span<const int32_t> tokens,
                                                         const CalibrationRunOptions& options);
// The windows of CollectCalibrationStats through any observer: `wrap` receives a paged cache
// sized for one window and returns the cache the model runs through (a ForwardingKvCache that
// watches what is written and attended).
using CacheWrapper = std::function<std::unique_ptr<KvCache>(std::unique_ptr<KvCache>)>;
absl::Status RunCalibrationWindows(LlamaModel& model, std::span<const int32_t> tokens,
                                   const CalibrationRunOptions& options, const CacheWrapper& wrap);

struct BasisMethodOptions {
  KeyBasisMethod method_k = KeyBasisMethod::kKqsvd;
  ValueBasisMethod method_v = ValueBasisMethod::kKqsvd;
  // Exactly one of: a fixed rank (1..head_dim) for every layer, or an energy fraction in (0, 1]:
  // per layer the smallest r capturing >= energy of the method's spectrum in every KV head.
  int rank = 0;
  double energy = 0.0;
  // Singular values of K (or V) below sigma_floor * sigma_max count as zero in the KQ-SVD
  // pseudo-inverse (directions the calibration data never reached).
  double sigma_floor = 1e-7;
};

struct CalibratedBasis {
  Basis basis;
  // [n_layers] fraction of the method's spectrum captured at the chosen rank (mean over heads):
  // for kqsvd the energy of K Q^T (resp. V W_O), for ksvd of K (V), for eigen of [K; Q].
  std::vector<double> energy_k, energy_v;
};

// The basis of `stats` (g_o is only needed for ValueBasisMethod::kKqsvd). INVALID_ARGUMENT for
// bad options or statistics that do not match their geometry.
absl::StatusOr<CalibratedBasis> ComputeCalibratedBasis(const CalibrationStats& stats,
                                                       const BasisMethodOptions& options);

// One head's full factorisation, columns in descending spectrum order, so that the first r
// columns are the rank-r basis: the key side gives P_k = left[:, :r], P_q = right[:, :r]; the
// value side P_v = left[:, :r], R_v = right[:, :r]^T. Exposed for tests.
struct HeadFactors {
  std::vector<double> spectrum;  // [d] descending, >= 0 (squared singular values)
  std::vector<double> left;      // [d, d] row-major
  std::vector<double> right;     // [d, d] row-major
};
// a_gram: G_K (or G_V); b_gram: G_Q (or W_O W_O^T); upper triangles read. kqsvd=false:
// orthogonal eigenvectors of a_gram + b_weight * b_gram (b_weight 0: K-SVD, 1: Eigen).
HeadFactors FactorHead(int d, const double* a_gram, const double* b_gram, bool kqsvd,
                       double b_weight, double sigma_floor);
// The smallest r in [1, d] with sum(spectrum[:r]) >= energy * sum(spectrum).
int RankForEnergy(std::span<const double> spectrum, double energy);

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_CALIBRATION_H_
