// What the device-resident transform-coded KV cache (device_transform_kv_cache.h) asks of whoever
// holds its bytes: the CUDA backend (cuda_transform_store.h: the pool and the codec's tables in
// device memory, its stream) in production, host memory and the kernels' CPU twins in tests.
// As CompressedKvStore: one page id names a page in every layer's slice, so each operation
// covers every layer; operations run in order, before the backend's next step; the host arrays
// may be reused as soon as a call returns. Host-only C++; builds without nvcc.
#ifndef SUBSPACE_CUDA_TRANSFORM_KV_STORE_H_
#define SUBSPACE_CUDA_TRANSFORM_KV_STORE_H_

#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace subspace::cuda {

// Blocks to code in every layer (transform_blocks.h): full page src_page[i] into slot
// dst_slot[i] of slab page dst_page[i], the block's first token at position first_pos[i].
struct TransformCodeBatch {
  std::span<const int32_t> src_page;
  std::span<const int32_t> dst_page;
  std::span<const int32_t> dst_slot;
  std::span<const int32_t> first_pos;
};

// Blocks to decode in every layer: slot src_slot[i] of slab page src_page[i] into full page
// dst_page[i] of the pool.
struct TransformExpandBatch {
  std::span<const int32_t> src_page;
  std::span<const int32_t> src_slot;
  std::span<const int32_t> dst_page;
  std::span<const int32_t> first_pos;
};

class TransformKvStore {
 public:
  virtual ~TransformKvStore() = default;
  virtual absl::Status Code(const TransformCodeBatch& batch) = 0;
  virtual absl::Status Expand(const TransformExpandBatch& batch) = 0;
  // Copies bytes [offset, offset + out.size()) of layer `layer`'s slice of the pool to the host,
  // after every earlier operation has finished; waits for it (sequence images).
  virtual absl::Status Read(int layer, int64_t offset, std::span<uint8_t> out) = 0;
  // Copies `bytes` into layer `layer`'s slice at `offset`, ordered before later operations;
  // `bytes` may be reused as soon as the call returns.
  virtual absl::Status Write(int layer, int64_t offset, std::span<const uint8_t> bytes) = 0;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_TRANSFORM_KV_STORE_H_
