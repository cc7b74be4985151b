// What the device-resident compressed KV cache (device_compressed_kv_cache.h) asks of whoever holds
// its bytes: the CUDA backend (the pool and the basis tables in device memory, its stream) in
// production, host memory and the kernels' CPU twins in tests. The cache keeps the bookkeeping
// and the policy on the host and never touches the bytes itself.
//
// The pool is one slice per layer of [num_pages, page_bytes] (kernels/kv_layout.h); a page id
// names the same page in every layer's slice, so one operation below covers every layer. The
// basis tables hold `capacity` epochs per layer, [capacity, n_kv, head_dim, r] as the kernels
// read them. Every operation is ordered after the earlier ones and before the backend's next
// step (one CUDA stream); the host arrays passed in may be reused as soon as the call returns.
// Host-only C++; builds without nvcc.
#ifndef SUBSPACE_CUDA_COMPRESSED_KV_STORE_H_
#define SUBSPACE_CUDA_COMPRESSED_KV_STORE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/compress/basis.h"
#include "kernels/outlier_tokens.h"

namespace subspace::cuda {

// Blocks to code, in every layer: full page src_page[i] into slot dst_slot[i] of slab page
// dst_page[i], KV head h with basis-table entry epoch[i * n_kv + h].
struct CompressBatch {
  std::span<const int32_t> src_page;
  std::span<const int32_t> dst_page;
  std::span<const int32_t> dst_slot;
  std::span<const int32_t> epoch;  // [n, n_kv]
  // Outlier detection (compress_blocks.h): when not empty, [n] masks that Compress fills with
  // the tokens whose key residual exceeds outlier_threshold in some KV head of some layer, and
  // waits for (the caller places the outliers before it frees the source pages).
  std::span<uint64_t> outlier_masks;
  float outlier_threshold = 1.0f;
};

// Blocks to expand, in every layer: slot src_slot[i] of slab page src_page[i] into full page
// dst_page[i] (k^ = P_q c, v^ = R_v^T u: the keys and values as queries saw them).
struct ExpandBatch {
  std::span<const int32_t> src_page;
  std::span<const int32_t> src_slot;
  std::span<const int32_t> dst_page;
  std::span<const int32_t> epoch;  // [n, n_kv]
};

// Blocks to re-code in place, in every layer (recode_blocks.h): slot slot[i] of slab page page[i],
// KV head h from basis-table entry from[i * n_kv + h] into to[i * n_kv + h].
struct RecodeBatch {
  std::span<const int32_t> page;
  std::span<const int32_t> slot;
  std::span<const int32_t> from;  // [n, n_kv]
  std::span<const int32_t> to;    // [n, n_kv]
};

// Outlier tokens to move in every layer (outlier_tokens.h): block i's tokens mask[i] between full
// page block_page[i] and its outlier slots, first_slot[i] onwards in outlier_page[2 i] and then
// outlier_page[2 i + 1].
struct OutlierBatch {
  std::span<const int32_t> block_page;
  std::span<const uint64_t> mask;
  std::span<const int32_t> first_slot;
  std::span<const int32_t> outlier_page;  // [n, 2]
  kernels::OutlierMove direction = kernels::OutlierMove::kToOutlierPages;
};

class CompressedKvStore {
 public:
  virtual ~CompressedKvStore() = default;

  // Epochs each layer's basis tables hold.
  virtual int basis_capacity() const = 0;
  // Writes `basis` (validated against the cache's geometry and ranks) into entry `entry` of
  // every layer's tables.
  virtual absl::Status LoadBasis(int entry, const Basis& basis) = 0;
  virtual absl::Status Compress(const CompressBatch& batch) = 0;
  virtual absl::Status Expand(const ExpandBatch& batch) = 0;
  virtual absl::Status Recode(const RecodeBatch& batch) = 0;
  virtual absl::Status MoveOutliers(const OutlierBatch& batch) = 0;
  // Copies full page `page` of layer `layer` to `out` ([2][n_kv][B][head_dim] fp16), after every
  // earlier operation has finished; waits for it.
  virtual absl::Status ReadPage(int layer, int32_t page, std::span<uint16_t> out) = 0;
  // Session images: copies bytes [offset, offset + size) of layer `layer`'s slice out, or
  // writes them, after every earlier operation has finished; both wait for the copy.
  // INVALID_ARGUMENT for a range outside the slice.
  virtual absl::Status Read(int layer, int64_t offset, std::span<uint8_t> out) = 0;
  virtual absl::Status Write(int layer, int64_t offset, std::span<const uint8_t> bytes) = 0;

  // --- Readback for the background refresher: one copy in flight, never waited for ---
  // Full pages one readback holds at most (0: the store reads nothing back).
  virtual int64_t readback_capacity() const = 0;
  // Starts copying full pages `pages` of every layer to host memory, ordered after every
  // earlier operation (so later ones may rewrite them). FAILED_PRECONDITION while the previous
  // readback has not been taken; INVALID_ARGUMENT for more than readback_capacity() pages.
  virtual absl::Status StartReadback(std::span<const int32_t> pages) = 0;
  // Without waiting: false while the readback is in flight (or none was started); true once it
  // has landed, with its bytes in `out` ([n_layers][n][2][n_kv][B][head_dim] fp16, n the pages
  // it was started with), after which another may start.
  virtual absl::StatusOr<bool> TakeReadback(std::vector<uint16_t>* out) = 0;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_COMPRESSED_KV_STORE_H_
