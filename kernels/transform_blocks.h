// The transform codec's blocks on the device (core/compress/transform_codec.h; the layout of
// TransformKvCache's coded blocks, core/compress/transform_kv_cache.h): full fp16 pages coded
// into slab slots, and coded slots decoded back into full pages, batched over blocks and KV
// heads. Keys may be coded before RoPE: coding rotates a key back from its position, decoding
// rotates it to its position again. Decoding gives the rows attention reads (for Truncate of a
// coded block and for the history a step's attention expands into scratch pages).
//
// A coded block holds, per KV head, its keys' run and then (after every head's keys) its
// values' runs: each run component-major (CodedRunLayout: the components with bits, widest
// first, each with its B codes packed least significant bit first in ceil(B w / 8) bytes).
// The Params structs are plain C++ so the CPU twins (tests/kernels/transform_blocks_ref.h) take
// the same ones with host pointers; the launchers exist only in CUDA builds.
#ifndef SUBSPACE_KERNELS_TRANSFORM_BLOCKS_H_
#define SUBSPACE_KERNELS_TRANSFORM_BLOCKS_H_

#include <cstdint>

#include "kernels/kv_layout.h"

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

// One layer's codes, one record per side (0 keys, 1 values) and KV head, record r = side *
// n_kv + h. Float record (TransformFloats(d) values): mean [d], scale [d] (1 without a metric),
// inv_scale [d], ext [d] (what the components without bits and the mean add, in the scaled
// space: sum_{0-bit j} offset_j u_j + mean * scale), offset [d] and step [d] (the first `active`
// used, in run order), basis [d][d] (rows: the active components' basis vectors in run order;
// the rest unused). Int record (TransformInts(d) values): active, the run's byte offset in a
// coded block, bits [d] and byte_at [d] (run order; the first `active` used).
struct TransformTables {
  const float* floats = nullptr;  // [2 n_kv][TransformFloats(head_dim)]
  const int32_t* ints = nullptr;  // [2 n_kv][TransformInts(head_dim)]
};

SUBSPACE_HOST_DEVICE inline int64_t TransformFloats(int d) {
  return 6 * static_cast<int64_t>(d) + static_cast<int64_t>(d) * d;
}
SUBSPACE_HOST_DEVICE inline int64_t TransformInts(int d) { return 2 + 2 * static_cast<int64_t>(d); }

// Field offsets inside one record.
struct TransformField {
  static constexpr int kMean = 0, kScale = 1, kInvScale = 2, kExt = 3, kOffset = 4, kStep = 5,
                       kBasis = 6;  // floats: field * d (kBasis: [d][d] from 6 d)
  static constexpr int kActive = 0, kRunOffset = 1, kBits = 2;  // ints: bits at 2, byte_at at 2+d
};

// Keys coded before RoPE. cos_sin: the model's table ([max_position][rope_dim / 2][2], cos and
// sin times the schedule's mscale, cuda/rope_table.h); null when keys are coded as written.
// Rotating by -p with the table and multiplying by unscale = 1 / mscale^2 undoes a rotation by
// p. Pairs: (2i, 2i + 1), or with halves (i, i + rope_dim / 2), for i < rope_dim / 2.
struct TransformKeyRope {
  const float* cos_sin = nullptr;
  int32_t rope_dim = 0;
  int32_t max_position = 0;
  bool halves = false;
  float unscale = 1.0f;
};

// Codes block i: full page src_page[i] of src_pool into slot dst_slot[i] of slab page
// dst_page[i] of dst_pool (the coded block's payload; the slot's padding is left as it is),
// its tokens at positions first_pos[i] + t. layout: the page geometry, slot_bytes the coded
// block's slot (its rank fields are unused). Preconditions (CheckTransformCodeBatch on the
// host): no two blocks share a slot, no slot lies in a source page of the batch.
struct TransformCodeParams {
  KvPoolLayout layout;
  TransformTables tables;
  TransformKeyRope key_rope;
  const uint8_t* src_pool = nullptr;
  uint8_t* dst_pool = nullptr;  // may be src_pool
  const int32_t* src_page = nullptr;
  const int32_t* dst_page = nullptr;
  const int32_t* dst_slot = nullptr;
  const int32_t* first_pos = nullptr;
  int32_t n_blocks = 0;
};

// Decodes block i: slot src_slot[i] of slab page src_page[i] of src_pool into all B rows of
// every head of full page dst_page[i] of dst_pool, fp16, keys rotated to positions
// first_pos[i] + t when coded before RoPE. Preconditions: no two blocks share a destination
// page; with one pool, no destination page is a source page of the batch.
struct TransformExpandParams {
  KvPoolLayout layout;
  TransformTables tables;
  TransformKeyRope key_rope;
  const uint8_t* src_pool = nullptr;
  uint8_t* dst_pool = nullptr;  // may be src_pool, or scratch pages
  const int32_t* src_page = nullptr;
  const int32_t* src_slot = nullptr;
  const int32_t* dst_page = nullptr;
  const int32_t* first_pos = nullptr;
  int32_t n_blocks = 0;
};

// nullptr when the kernels and twins can address `l` as a transform-coded layer, else why not.
inline const char* TransformLayoutError(const KvPoolLayout& l) {
  if (l.n_kv_heads <= 0 || l.head_dim <= 0 || l.head_dim % 2 != 0) {
    return "n_kv_heads must be positive and head_dim positive and even";
  }
  if (l.block_size <= 0 || l.block_size > kMaxBlockSize) return "block_size must be in [1, 64]";
  if (l.page_bytes != 4 * static_cast<int64_t>(l.n_kv_heads) * l.block_size * l.head_dim) {
    return "page_bytes must be one full fp16 block";
  }
  if (l.slot_bytes <= 0 || l.slot_bytes > l.page_bytes) return "a coded block exceeds a page";
  return nullptr;
}

#if defined(SUBSPACE_WITH_CUDA)
// Grid (n_blocks, n_kv) of 128 threads; one CTA codes (decodes) one block-head, keys then
// values. head_dim 64 or 128, block sizes 1..64, widths 1..8; cudaErrorInvalidValue for anything
// else; n_blocks == 0 launches nothing. Asynchronous.
cudaError_t LaunchTransformCode(const TransformCodeParams& params, cudaStream_t stream);
cudaError_t LaunchTransformExpand(const TransformExpandParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_TRANSFORM_BLOCKS_H_
