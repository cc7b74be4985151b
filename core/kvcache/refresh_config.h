// How a compressed cache's bases follow a session online (docs/design.md, "Online refresh"): which
// statistic tracks the keys and values, what triggers a new epoch, and how many epochs a
// sequence may keep live. Plain data, shared by the cache, the refresher and the engine.
#ifndef SUBSPACE_CORE_KVCACHE_REFRESH_CONFIG_H_
#define SUBSPACE_CORE_KVCACHE_REFRESH_CONFIG_H_

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace subspace {

enum class RefreshMethod : uint8_t {
  kNone,   // static bases: the epoch a sequence starts with is the one it keeps
  kPca,    // exact top-r eigenvectors of decayed key and value Gram matrices
  kKqsvd,  // keys: KQ-SVD (seed 002) of decayed key and query Grams; values as kPca
  kOja,    // Oja's rule on the covariance of the blocks since the last refresh, then QR (seed 003)
  kFd,     // frequent-directions sketch of 2r rows per head (seed 000), decayed
};

const char* RefreshMethodName(RefreshMethod m);  // "none" | "pca" | "kqsvd" | "oja" | "fd"
absl::StatusOr<RefreshMethod> ParseRefreshMethod(std::string_view name);

struct RefreshConfig {
  RefreshMethod method = RefreshMethod::kNone;
  // T: a refresh is due once this many tokens were compressed since the last one (0: never by
  // count). Counted in tokens of layer 0; every layer sees the same blocks.
  int64_t every_tokens = 256;
  // A refresh is also due once the mean key residual-energy ratio ||k - k^||^2 / ||k||^2 of the
  // blocks compressed since the last one passes this (0: off). Checked once per block.
  double residual_threshold = 0.0;
  // pca, kqsvd, fd: the statistics lose half their weight over this many new tokens, so the
  // bases follow a drifting context (0: no decay, all history weighs the same).
  double half_life_tokens = 1024.0;
  // oja: step size on the covariance of the new blocks scaled to spectral norm 1 (1: a step
  // the size of one power iteration).
  double oja_learning_rate = 1.0;
  // J: epochs live per sequence once the compactor has caught up (>= 1). Blocks of older
  // epochs are re-projected into the sequence's current one.
  int max_epochs = 2;
};

// INVALID_ARGUMENT naming the field (flag-style names) for a value out of range.
absl::Status ValidateRefreshConfig(const RefreshConfig& c);

}  // namespace subspace

#endif  // SUBSPACE_CORE_KVCACHE_REFRESH_CONFIG_H_
