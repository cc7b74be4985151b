// Re-coding of compressed blocks from one basis epoch into another on the device, in place: the
// compactor's step (DeviceCompressedKvCache keeps at most max_epochs epochs per sequence). Per
// token, the key a query sees k^ = P_q[from] c is re-projected as c' = P_k[to]^T k^ and the value
// v^ = R_v[from]^T u as u' = P_v[to]^T v^ -- CompressedKvCache's exact r x r maps
// (P_k[to]^T P_q[from] and P_v[to]^T R_v[from]^T) applied through the fp32 row instead of a
// precomputed matrix, with no fp16 page in between. The Params struct is plain C++ so the CPU
// twin (tests/kernels/recode_blocks_ref.h) takes the same one with host pointers.
#ifndef SUBSPACE_KERNELS_RECODE_BLOCKS_H_
#define SUBSPACE_KERNELS_RECODE_BLOCKS_H_

#include <cstdint>

#include "kernels/kv_layout.h"

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

// One batch: block i, in slot slot[i] of slab page page[i], is re-coded head by head from epoch
// from_epoch[i * n_kv + h] into to_epoch[i * n_kv + h] and written back into the same slot.
// Precondition (checked on the host by CheckRecodeBatch): no two blocks share a slot; CTAs of
// one launch run in any order, each reading its block-head before writing it.
struct RecodeBlocksParams {
  KvPoolLayout layout;
  uint8_t* pool = nullptr;              // [num_pages, page_bytes]
  const float* basis_pq = nullptr;      // [n_epochs, n_kv, head_dim, r_k]  k^ = P_q c (from)
  const float* basis_rv = nullptr;      // [n_epochs, n_kv, r_v, head_dim]  v^ = R_v^T u (from)
  const float* basis_pk = nullptr;      // [n_epochs, n_kv, head_dim, r_k]  c' = P_k^T k^ (to)
  const float* basis_pv = nullptr;      // [n_epochs, n_kv, head_dim, r_v]  u' = P_v^T v^ (to)
  const int32_t* page = nullptr;        // [n_blocks] slab page of the slot
  const int32_t* slot = nullptr;        // [n_blocks] slot index in page
  const int32_t* from_epoch = nullptr;  // [n_blocks, n_kv]
  const int32_t* to_epoch = nullptr;    // [n_blocks, n_kv]
  int32_t n_blocks = 0;
};

#if defined(SUBSPACE_WITH_CUDA)
// Grid (n_blocks, n_kv) of 128 threads; one CTA re-codes one block-head, keys then values.
// Supports head_dim 64 and 128, block sizes 1..64, ranks 1..head_dim, fp16 and int8 codes.
// cudaErrorInvalidValue for anything else; n_blocks == 0 launches nothing and returns
// cudaSuccess; otherwise the launch's own error. Asynchronous.
cudaError_t LaunchRecodeBlocks(const RecodeBlocksParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_RECODE_BLOCKS_H_
