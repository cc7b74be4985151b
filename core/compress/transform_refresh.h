// Online refresh of the transform-coded cache's codes (docs/transform_codec.md, "Online
// refresh"): the rows a sequence's cache codes, per layer, KV head and side, folded into a
// decayed mean and covariance, with its most recent rows kept to fit quantizers on. A refresh
// makes every stream's code anew from them -- mean, PCA basis, quantizers and the widths the
// rate-distortion allocation picks for that basis -- under the bytes a block's run of the
// stream's codes took at the start (CodedRunLayout: a component of w bits costs ceil(B w / 8)
// bytes), so a jointly allocated codec file keeps each stream's share and a block coded with
// any epoch fits the slot the first one sized. Single-threaded; the Refresher runs it.
#ifndef SUBSPACE_CORE_COMPRESS_TRANSFORM_REFRESH_H_
#define SUBSPACE_CORE_COMPRESS_TRANSFORM_REFRESH_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/compress/refresh_statistics.h"
#include "core/compress/transform_codec.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

class TransformStatistics final : public RefreshStatistics {
 public:
  // Rows kept per stream to fit the quantizers on (the most recent ones).
  static constexpr int kSampleRows = 256;
  // And the rows farthest from the running mean the session has shown (metric-weighted), so
  // the quantizers' ranges still reach what a rare token wrote.
  static constexpr int kExtremeRows = 64;
  // Fewer rows than this in a stream: its code stays as it was.
  static constexpr int kMinRows = 32;

  // `initial`: the codes the sequence starts with (n_layers * n_kv_heads each, of dim
  // head_dim: the cache checked them); their runs' bytes in blocks of `block_size` rows are
  // every refresh's budgets and their scales its error metric. config.method is kPca (the
  // cache checks it); its half_life_tokens sets the decay.
  TransformStatistics(const KvCacheGeometry& g, int block_size, const RefreshConfig& config,
                      const TransformCodes& initial);

  int n_layers() const override { return g_.n_layers; }
  const RefreshConfig& config() const override { return config_; }
  // keys (as coded: before RoPE when the codes are), values: [n_kv, n, head_dim]
  void ObserveBlock(int layer, const float* keys, const float* values, int n) override;
  // New codes for every stream with enough rows; no codes (RefreshedEpoch{}) when none has.
  // INTERNAL when the statistics hold non-finite numbers.
  absl::StatusOr<RefreshedEpoch> RefreshEpoch() override;

  // Host bytes the statistics of one sequence take (docs; tests).
  static int64_t BytesFor(const KvCacheGeometry& g);

 private:
  struct Stream {
    double weight = 0.0;          // decayed row count
    std::vector<double> sum;      // [d] decayed
    std::vector<double> outer;    // [d, d] decayed sum of x x^T
    std::vector<float> samples;   // [kSampleRows, d] ring
    int64_t rows = 0;             // rows seen (the ring holds min(rows, kSampleRows))
    std::vector<float> extremes;  // [kExtremeRows, d], the first `n_extremes` in use
    std::vector<double> extreme_score;
    int n_extremes = 0;
  };
  // side 0: keys, 1: values
  Stream& stream(int layer, int side, int h) {
    return streams_[static_cast<size_t>((layer * 2 + side) * g_.n_kv_heads + h)];
  }
  void Observe(Stream& s, const std::vector<float>& metric, const float* rows, int n);
  absl::StatusOr<TransformCode> Refit(const Stream& s, const std::vector<float>& metric,
                                      int budget_bytes) const;

  KvCacheGeometry g_;
  int block_size_;
  RefreshConfig config_;
  TransformCodes current_;    // the last codes made (or the initial ones)
  std::vector<int> budgets_;  // [n_layers][2][n_kv] bytes of a block's run, initially
  std::vector<std::vector<float>> metrics_;  // [n_layers][2][n_kv] the initial scales squared
  std::vector<Stream> streams_;              // [n_layers][2][n_kv]
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_TRANSFORM_REFRESH_H_
