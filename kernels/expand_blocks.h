// Expansion of compressed blocks back to full-rank fp16 pages on the device, batched over blocks
// and KV heads: k^ = P_q c and v^ = R_v^T u per token, the rows queries see (what
// CompressedKvCache::Decompress rebuilds, without its outliers). For Truncate of a compressed
// block and for expanding a sequence's compressed history into scratch pages before prefill.
// The Params struct is plain C++ so the CPU twin (tests/kernels/expand_blocks_ref.h) takes the
// same one with host pointers; the launcher exists only in CUDA builds.
#ifndef SUBSPACE_KERNELS_EXPAND_BLOCKS_H_
#define SUBSPACE_KERNELS_EXPAND_BLOCKS_H_

#include <cstdint>

#include "kernels/kv_layout.h"

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

// One batch: block i reads the compressed block in slot src_slot[i] of page src_page[i] of
// src_pool and writes all B rows of every head, fp16 [2][n_kv][B][head_dim], into page
// dst_page[i] of dst_pool. Precondition (checked on the host by CheckExpandBatch): no two
// blocks share a destination page and, when the pools are one buffer, no destination page is a
// source page of the batch; CTAs of one launch run in any order. The caller frees the source
// slots after the launch (the CPU cache frees first: it works one block at a time).
struct ExpandBlocksParams {
  KvPoolLayout layout;
  const uint8_t* src_pool = nullptr;  // [num_src_pages, page_bytes] holds the slots
  uint8_t* dst_pool = nullptr;        // [num_dst_pages, page_bytes]; may be src_pool or scratch
  const float* basis_pq = nullptr;    // [n_epochs, n_kv, head_dim, r_k]  k^ = P_q c
  const float* basis_rv = nullptr;    // [n_epochs, n_kv, r_v, head_dim]  v^ = R_v^T u
  const int32_t* src_page = nullptr;  // [n_blocks] slab page of the source slot
  const int32_t* src_slot = nullptr;  // [n_blocks] slot index in src_page
  const int32_t* dst_page = nullptr;  // [n_blocks] page index in dst_pool
  const int32_t* epoch = nullptr;     // [n_blocks, n_kv] basis-table epoch of each head
  int32_t n_blocks = 0;
};

#if defined(SUBSPACE_WITH_CUDA)
// Grid (n_blocks, n_kv) of 128 threads; one CTA expands one block-head, keys then values.
// Supports head_dim 64 and 128, block sizes 1..64, ranks 1..head_dim, fp16 and int8 codes.
// cudaErrorInvalidValue for anything else; n_blocks == 0 launches nothing and returns
// cudaSuccess; otherwise the launch's own error. Asynchronous.
cudaError_t LaunchExpandBlocks(const ExpandBlocksParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_EXPAND_BLOCKS_H_
