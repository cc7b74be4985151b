// Outlier tokens on the device: the tokens of a compressed block whose keys the basis represents
// badly (compress_blocks.h detects them) are kept full-rank, B to an outlier page, in position
// order, as CompressedKvCache keeps them. This kernel moves them between a block's full page and
// the outlier pages, every KV head's K and V row of each token: into the outlier pages when the
// block is compressed (from its source page, before that page is freed), and back into a full
// page whenever the block is expanded (Truncate, the prefill scratch), so the expanded block holds
// the exact outliers beside the low-rank rows. The Params struct is plain C++ so the CPU twin
// (tests/kernels/outlier_tokens_ref.h) takes the same one with host pointers.
#ifndef SUBSPACE_KERNELS_OUTLIER_TOKENS_H_
#define SUBSPACE_KERNELS_OUTLIER_TOKENS_H_

#include <cstdint>

#include "kernels/kv_layout.h"

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

enum class OutlierMove : int32_t {
  kToOutlierPages = 0,  // block page token t -> outlier slot (compression)
  kToBlockPages = 1,    // outlier slot -> block page token t (expansion)
};

// One batch: block i has outlier tokens `mask[i]` (bit t: token t of the block). Its k-th
// outlier (k counted from 0 over the set bits, lowest first) sits in slot first_slot[i] + k of
// page outlier_page[2 i] when that is below B, else in slot first_slot[i] + k - B of page
// outlier_page[2 i + 1] (a block's outliers span at most two outlier pages). A token is its K
// rows and V rows of every KV head: [n_kv][head_dim] fp16 each, at FullK(page, h) + t * head_dim
// and FullV(page, h) + t * head_dim. Precondition (CheckOutlierBatch on the host): pages in
// range, no two blocks of the batch write one destination token, and within one pool no
// destination token is a source token of the batch.
struct OutlierTokensParams {
  KvPoolLayout layout;                    // page geometry (ranks and codes unused)
  uint8_t* block_pool = nullptr;          // [num_block_pages, page_bytes]: the pool or the scratch
  uint8_t* outlier_pool = nullptr;        // [num_pages, page_bytes]: the pool
  const int32_t* block_page = nullptr;    // [n_blocks] full page in block_pool
  const uint64_t* mask = nullptr;         // [n_blocks] outlier tokens of the block
  const int32_t* first_slot = nullptr;    // [n_blocks] 0..B-1
  const int32_t* outlier_page = nullptr;  // [n_blocks, 2] pages in outlier_pool; the second is
                                          //   read only when the outliers run past the first
  int32_t n_blocks = 0;
  OutlierMove direction = OutlierMove::kToOutlierPages;
};

#if defined(SUBSPACE_WITH_CUDA)
// Grid (n_blocks) of 128 threads; one CTA moves one block's outliers, 16 bytes per thread and
// step. Supports head_dim 64 and 128, block sizes 1..64, pools on 16-byte boundaries (as
// cudaMalloc's are). cudaErrorInvalidValue for anything else; n_blocks == 0 launches nothing and
// returns cudaSuccess; otherwise the launch's own error. Asynchronous.
cudaError_t LaunchOutlierTokens(const OutlierTokensParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_OUTLIER_TOKENS_H_
