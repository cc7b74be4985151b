// Calibration of the transform codec (core/compress/transform_codec.h): the keys and values a
// model writes over calibration text, kept per layer and KV head (keys both as written,
// post-RoPE, and rotated back to pre-RoPE) with the query and W_O energies per dim, and the
// codes fitted on them for a bits-per-element budget (subspace-calibrate --kv-budget, and the
// long-context evaluation's tc caches).
#ifndef SUBSPACE_CORE_COMPRESS_TRANSFORM_CALIBRATION_H_
#define SUBSPACE_CORE_COMPRESS_TRANSFORM_CALIBRATION_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "core/base/rope.h"
#include "core/compress/calibration.h"
#include "core/compress/transform_codec.h"
#include "core/kvcache/kv_cache.h"
#include "core/model/model.h"

namespace subspace {

struct KvRows {
  KvCacheGeometry geometry;
  int64_t tokens = 0;                         // rows per layer-head
  std::vector<std::vector<float>> keys_post;  // [n_layers * n_kv][tokens, d] as written
  std::vector<std::vector<float>> keys_pre;   // [n_layers * n_kv][tokens, d] RoPE undone
  std::vector<std::vector<float>> values;     // [n_layers * n_kv][tokens, d]
  // Per dim, the mean squared query (over the GQA group's heads and every query attended) and
  // the diagonal of sum_j W_j^T W_j over the group's slices of attn_output: the weights of a
  // key's and a value's squared error in the attention scores and the layer's output.
  std::vector<std::vector<float>> query_energy;   // [n_layers * n_kv][d]
  std::vector<std::vector<float>> output_energy;  // [n_layers * n_kv][d]
  RopeSchedule rope;
};

// Runs `model` over `tokens` in windows (CalibrationRunOptions, as for the bases) and keeps every
// key and value row it writes.
absl::StatusOr<KvRows> CollectKvRows(LlamaModel& model, std::span<const int32_t> tokens,
                                     const CalibrationRunOptions& options);

struct TransformFitOptions {
  // The budgets in bits per element of a coded row: keys, values (keys carry most of the
  // attention's error: the K-only / V-only ablation in docs/transform_codec.md).
  double key_bits = 4.0, value_bits = 4.0;
  bool pre_rope_keys = true;  // fit the key codes on pre-RoPE keys
  bool joint = false;         // one budget shared by all layer-heads, K and V
  // Key errors weighted by the query energy per dim (pre-RoPE: averaged over each rotated
  // pair, as the relative rotation between query and key spreads it), value errors by W_O's.
  bool attention_weighted = false;
  TransformCodeOptions code;  // widths, PCA or identity basis
};
// The streams of every layer-head's keys, then values, analysed as the options say (everything
// but the budget and joint): the expensive half, shared by fits that differ only in budget.
absl::StatusOr<std::vector<TransformStream>> AnalyzeKvRows(const KvRows& rows,
                                                           const TransformFitOptions& options);
// Allocates the budget over streams from AnalyzeKvRows.
absl::StatusOr<TransformCodes> AllocateKvCodes(std::span<const TransformStream> streams,
                                               const TransformFitOptions& options);
absl::StatusOr<TransformCodes> FitTransformCodes(const KvRows& rows,
                                                 const TransformFitOptions& options);

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_TRANSFORM_CALIBRATION_H_
