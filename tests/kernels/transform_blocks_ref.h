// CPU twins of transform_blocks.cu: the same TransformCodeParams / TransformExpandParams with
// host pointers, plain loops. Projections and reconstructions are summed in double and rounded
// once (to float for a coefficient, then quantized as ComponentQuantizer::Encode does; to fp16
// for an output), so the kernels differ from the twins only by float summation order. Also the
// random cases both the twins' and the kernels' tests draw: real codes (AnalyzeStream and the
// allocation, on rows drawn like the block rows), keys before RoPE or not. Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_TRANSFORM_BLOCKS_REF_H_
#define SUBSPACE_TESTS_KERNELS_TRANSFORM_BLOCKS_REF_H_

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "core/base/rope.h"
#include "core/compress/transform_codec.h"
#include "cuda/transform_tables.h"
#include "kernels/transform_blocks.h"

namespace subspace::kernels {

// INVALID_ARGUMENT when a batch is unsafe or out of range: a bad layout, a page outside
// [0, num_*_pages), a slot outside its page, a position past the RoPE table, two blocks with
// one destination (slot or page), or, in one pool, a destination inside a source page.
absl::Status CheckTransformCodeBatch(const TransformCodeParams& p, int64_t num_src_pages,
                                     int64_t num_dst_pages);
absl::Status CheckTransformExpandBatch(const TransformExpandParams& p, int64_t num_src_pages,
                                       int64_t num_dst_pages);

void TransformCodeRef(const TransformCodeParams& p);
void TransformExpandRef(const TransformExpandParams& p);

// Row t of one side (0 keys, 1 values) of KV head h of the coded block at `slot`, decoded in
// double as TransformExpandRef decodes it before rounding (keys rotated to `position` when
// key_rope.cos_sin is set): [head_dim] into `row`.
void TransformDecodeRowRef(const KvPoolLayout& l, const TransformTables& tables,
                           const TransformKeyRope& key_rope, const uint8_t* slot, int h, int side,
                           int t, int64_t position, double* row);

namespace testing {

// Codes of one layer fitted on rows like the case's (a few strong directions plus noise), at
// `bits` per element, keys and values alike; optionally keys before RoPE.
struct TransformCase {
  KvPoolLayout layout;  // slot_bytes: the coded block rounded up to 16
  std::vector<TransformCode> key_codes, value_codes;  // [n_kv] (one layer)
  cuda::TransformLayerTables tables;
  std::optional<RopeSchedule> rope;
  std::vector<float> cos_sin;  // RopeCosSinTable of `rope` (empty: keys as written)
  int32_t max_position = 0;
  // Full pages with random rows, and a pool of slab pages for the codes.
  int64_t num_pages = 0;
  std::vector<uint8_t> pool;                                   // [num_pages * page_bytes]
  std::vector<int32_t> full_page, slab_page, slot, first_pos;  // [n_blocks]

  int32_t n_blocks() const { return static_cast<int32_t>(full_page.size()); }
  TransformTables HostTables() const { return {tables.floats.data(), tables.ints.data()}; }
  TransformKeyRope HostRope() const;
  // Code every full page into its slot; expand every slot into `dst` pages of `dst_pool`.
  TransformCodeParams CodeParams();
  TransformExpandParams ExpandParams(std::vector<uint8_t>* dst_pool,
                                     const std::vector<int32_t>& dst_page);
};

struct TransformCaseOptions {
  int n_kv = 2, head_dim = 64, block_size = 16, n_blocks = 3;
  double bits = 3.0;
  bool pre_rope = false;
  bool halves = false;
  int rope_dim = 0;     // 0: head_dim
  double mscale = 1.0;  // the schedule's cos/sin factor (YaRN)
};
TransformCase RandomTransformCase(const TransformCaseOptions& o, std::mt19937_64& rng);

}  // namespace testing
}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_TRANSFORM_BLOCKS_REF_H_
