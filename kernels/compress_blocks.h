// Compression of full-rank blocks into low-rank coefficients on the device, batched over blocks
// and KV heads: c = P_k^T k and u = P_v^T v per token, encoded exactly as
// CompressedKvCache::CompressBlock stores them (EncodeCoeffs: fp16, or int8 with a per-token
// fp16 scale). The Params struct is plain C++ so the CPU twin (tests/kernels/compress_blocks_ref.h)
// takes the same one with host pointers; the launcher exists only in CUDA builds.
#ifndef SUBSPACE_KERNELS_COMPRESS_BLOCKS_H_
#define SUBSPACE_KERNELS_COMPRESS_BLOCKS_H_

#include <cstdint>

#include "kernels/kv_layout.h"

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

// One batch: block i reads full page src_page[i] and writes the compressed block into slot
// dst_slot[i] of page dst_page[i], each head with its own epoch. Precondition (checked on the
// host by CheckCompressBatch): no destination slot lies in a source page of the same batch and
// no two destinations coincide; CTAs of one launch run in any order. The caller frees the
// source pages after the launch (the CPU cache frees first: it works one block at a time).
struct CompressBlocksParams {
  KvPoolLayout layout;
  uint8_t* pool = nullptr;            // [num_pages, page_bytes]
  const float* basis_pk = nullptr;    // [n_epochs, n_kv, head_dim, r_k]  c = P_k^T k
  const float* basis_pv = nullptr;    // [n_epochs, n_kv, head_dim, r_v]  u = P_v^T v
  const int32_t* src_page = nullptr;  // [n_blocks] full fp16 block [2][n_kv][B][head_dim]
  const int32_t* dst_page = nullptr;  // [n_blocks] slab page of the destination slot
  const int32_t* dst_slot = nullptr;  // [n_blocks] slot index in dst_page
  const int32_t* epoch = nullptr;     // [n_blocks, n_kv] basis-table epoch of each head
  int32_t n_blocks = 0;
  // Outlier detection, off while outlier_masks is null: token t of block i is an outlier when,
  // in some KV head, its key residual |k - P_q c|^2 exceeds outlier_threshold^2 |k|^2, with c
  // the fp32 coefficients before encoding (CompressedKvCache::CompressBlock's test). Bit t of
  // outlier_masks[i] is OR-ed in atomically, so the heads and the layers of one batch (one
  // launch per layer) share one mask: the caller zeroes the masks before the first launch.
  const float* basis_pq = nullptr;    // [n_epochs, n_kv, head_dim, r_k]  k^ = P_q c
  uint64_t* outlier_masks = nullptr;  // [n_blocks]
  float outlier_threshold = 1.0f;
};

#if defined(SUBSPACE_WITH_CUDA)
// Grid (n_blocks, n_kv) of 128 threads; one CTA codes one block-head, keys then values.
// Supports head_dim 64 and 128, block sizes 1..64, ranks 1..head_dim, fp16 and int8 codes.
// cudaErrorInvalidValue for anything else; otherwise the launch's own error. Asynchronous.
cudaError_t LaunchCompressBlocks(const CompressBlocksParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_COMPRESS_BLOCKS_H_
