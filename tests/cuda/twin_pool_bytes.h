// The twin stores' byte copies in and out of a layer's host pool (session images): one bounds
// check for both (TwinKvStore, TwinTransformStore).
#ifndef SUBSPACE_TESTS_CUDA_TWIN_POOL_BYTES_H_
#define SUBSPACE_TESTS_CUDA_TWIN_POOL_BYTES_H_

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "absl/status/status.h"

namespace subspace::cuda {

inline bool InPool(const std::vector<uint8_t>& pool, int64_t offset, size_t n) {
  return offset >= 0 && offset + static_cast<int64_t>(n) <= static_cast<int64_t>(pool.size());
}

inline absl::Status ReadPoolBytes(const std::vector<uint8_t>& pool, int64_t offset,
                                  std::span<uint8_t> out) {
  if (!InPool(pool, offset, out.size())) {
    return absl::InvalidArgumentError("read outside the layer's pool");
  }
  if (!out.empty()) std::memcpy(out.data(), pool.data() + offset, out.size());
  return absl::OkStatus();
}

inline absl::Status WritePoolBytes(std::vector<uint8_t>& pool, int64_t offset,
                                   std::span<const uint8_t> bytes) {
  if (!InPool(pool, offset, bytes.size())) {
    return absl::InvalidArgumentError("write outside the layer's pool");
  }
  if (!bytes.empty()) std::memcpy(pool.data() + offset, bytes.data(), bytes.size());
  return absl::OkStatus();
}

}  // namespace subspace::cuda

#endif  // SUBSPACE_TESTS_CUDA_TWIN_POOL_BYTES_H_
