// The compressed KV caches' policy in one place: which tokens stay full-rank (sinks, window,
// outliers), at what ranks and precision the rest is coded, and how the first basis is
// calibrated. The CPU cache (CompressedKvCache), the device cache (DeviceCompressedKvCache), the
// CUDA backend's options and the server's --kv-* flags all carry this one struct, so a default or
// a rule changes here or nowhere.
#ifndef SUBSPACE_CORE_COMPRESS_COMPRESSION_POLICY_H_
#define SUBSPACE_CORE_COMPRESS_COMPRESSION_POLICY_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/base/coeff_codec.h"
#include "core/base/int_math.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

// Blocks [begin, end) of a sequence.
struct BlockRange {
  int64_t begin = 0;
  int64_t end = 0;
  bool empty() const { return begin >= end; }
};

struct CompressionPolicy {
  static constexpr int kDefaultSinkTokens = 4;
  static constexpr int kDefaultWindowTokens = 64;
  // Tokens a self-calibrated basis is built from, at most.
  static constexpr int64_t kPcaMaxTokens = 1024;
  // Ranks when none are given: a quarter of the head dimension (at least 1).
  static int DefaultRank(int head_dim) { return std::max(1, head_dim / 4); }

  int sink_tokens = kDefaultSinkTokens;      // S: blocks overlapping [0, S) stay full-rank
  int window_tokens = kDefaultWindowTokens;  // W: a block is coded once it ends before length - W
  std::vector<int> r_k;  // [n_layers] key ranks; empty: DefaultRank(head_dim) in every layer
  std::vector<int> r_v;  // [n_layers] value ranks; empty: likewise
  CoeffDtype coeff_dtype = CoeffDtype::kFp16;
  // Relative key residual ||k - P_q P_k^T k|| / ||k|| above which a token stays full-rank (all
  // its KV heads). >= 1 disables outliers.
  float outlier_threshold = 1.0f;
  // Without a default epoch, the first sequence to compress builds one by PCA of its own keys
  // and values, and it becomes the default for everyone (self-calibration). true: every
  // sequence builds its own instead (experiments, tests).
  bool per_sequence_pca = false;

  bool outliers_enabled() const { return outlier_threshold < 1.0f; }
  // Whether a key with squared residual `residual2` and squared norm `norm2` is an outlier.
  bool IsOutlier(double residual2, double norm2) const {
    const double t = outlier_threshold;
    return outliers_enabled() && residual2 > t * t * norm2;
  }

  // The blocks a Commit to `length` codes: from `next` (the first block not yet considered) and
  // past the sinks, those that end at or before length - W.
  BlockRange CompressibleBlocks(int64_t next, int64_t length, int block_size) const {
    const int64_t begin = std::max<int64_t>(next, CeilDiv(sink_tokens, block_size));
    const int64_t limit = length - window_tokens;
    return {begin, limit > 0 ? std::max(begin, limit / block_size) : begin};
  }

  // Self-calibration reads whole blocks spread evenly over the sequence: every `stride`-th of
  // its CeilDiv(length, B) blocks, at most ~kPcaMaxTokens tokens in all (every block up to that
  // length). Whole blocks because the device cache reads pages back; the CPU cache samples the
  // same ones so that both calibrate the same basis.
  static int64_t PcaBlockStride(int64_t length, int block_size) {
    return std::max<int64_t>(
        1, CeilDiv(CeilDiv(length, block_size), CeilDiv(kPcaMaxTokens, block_size)));
  }
};

// `policy` with its ranks filled in for `geometry` (an empty list: DefaultRank in every layer).
// INVALID_ARGUMENT for negative S or W, a rank list of the wrong length or a rank outside
// [1, head_dim], or an outlier threshold that is not a positive finite number.
absl::StatusOr<CompressionPolicy> ResolvePolicy(const CompressionPolicy& policy,
                                                const KvCacheGeometry& geometry);

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_COMPRESSION_POLICY_H_
