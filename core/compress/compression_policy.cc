#include "core/compress/compression_policy.h"

#include <cmath>

#include "absl/strings/str_format.h"

namespace subspace {

absl::StatusOr<CompressionPolicy> ResolvePolicy(const CompressionPolicy& policy,
                                                const KvCacheGeometry& g) {
  if (policy.sink_tokens < 0 || policy.window_tokens < 0) {
    return absl::InvalidArgumentError("sink_tokens and window_tokens must be >= 0");
  }
  if (!(policy.outlier_threshold > 0.0f) || !std::isfinite(policy.outlier_threshold)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outlier_threshold must be > 0 (>= 1 disables outliers), got %g",
                        policy.outlier_threshold));
  }
  CompressionPolicy out = policy;
  for (auto [ranks, name] : {std::pair{&out.r_k, "r_k"}, std::pair{&out.r_v, "r_v"}}) {
    if (ranks->empty()) {
      ranks->assign(static_cast<size_t>(g.n_layers), CompressionPolicy::DefaultRank(g.head_dim));
      continue;
    }
    if (ranks->size() != static_cast<size_t>(g.n_layers)) {
      return absl::InvalidArgumentError(absl::StrFormat("%s needs one rank per layer (%d), got %d",
                                                        name, g.n_layers, ranks->size()));
    }
    for (size_t l = 0; l < ranks->size(); ++l) {
      const int r = (*ranks)[l];
      if (r < 1 || r > g.head_dim) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s rank %d outside [1, %d]", name, r, g.head_dim));
      }
      // Two int4 codes share a byte: an odd rank would start every other row mid-byte.
      if (out.coeff_dtype == CoeffDtype::kInt4 && r % 2 != 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("int4 coefficients need even ranks; layer %d has %s %d", l, name, r));
      }
    }
  }
  return out;
}

}  // namespace subspace
