// What the background refresher (refresher.h) keeps per sequence: statistics of the blocks a
// cache codes, turned into a new epoch on demand. Two kinds: the low-rank caches' bases
// (OnlineStatistics, online_statistics.h) and the transform-coded cache's codes
// (TransformStatistics, transform_refresh.h). Single-threaded: the refresher runs them on its
// own thread (or the caller's, inline).
#ifndef SUBSPACE_CORE_COMPRESS_REFRESH_STATISTICS_H_
#define SUBSPACE_CORE_COMPRESS_REFRESH_STATISTICS_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "core/compress/basis.h"
#include "core/compress/transform_codec.h"
#include "core/kvcache/refresh_config.h"

namespace subspace {

// A new epoch: a basis (low-rank caches) or a set of codes (the transform-coded cache).
struct RefreshedEpoch {
  std::shared_ptr<const Basis> basis;
  TransformCodes codes;
};

class RefreshStatistics {
 public:
  virtual ~RefreshStatistics() = default;

  virtual int n_layers() const = 0;
  virtual const RefreshConfig& config() const = 0;
  // One coded block of `layer`: n rows per KV head, as the cache codes them.
  // keys, values: [n_kv, n, head_dim]
  virtual void ObserveBlock(int layer, const float* keys, const float* values, int n) = 0;
  // Values in one query row ([n_heads, head_dim]) when the statistics take queries; 0 when not.
  virtual int64_t query_width() const { return 0; }
  // Queries of `layer`, each row counting `weight` times. q: [n, query_width()]
  virtual void ObserveQueries(int layer, const float* q, int64_t n, double weight) {
    (void)layer, (void)q, (void)n, (void)weight;
  }
  // A new epoch from what was observed; an empty one (neither basis nor codes) when there is
  // nothing new to publish yet. An error keeps the old epoch in use.
  virtual absl::StatusOr<RefreshedEpoch> RefreshEpoch() = 0;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_REFRESH_STATISTICS_H_
