// Device memory taken once at start-up and carved into the backend's buffers (weights,
// activations, KV pool, plan mirror), and page-locked host memory for the per-step plan and the
// logits: after start-up the request path never calls cudaMalloc or cudaHostAlloc.
#ifndef SUBSPACE_CUDA_DEVICE_MEMORY_H_
#define SUBSPACE_CUDA_DEVICE_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace subspace::cuda {

// Alignment of every carved buffer: cudaMalloc's, enough for any vector load and for cuBLAS.
inline constexpr int64_t kDeviceAlignment = 256;
inline int64_t AlignUp(int64_t bytes, int64_t to = kDeviceAlignment) {
  return (bytes + to - 1) / to * to;
}

// Hands out consecutive aligned ranges of [base, base + capacity). With a null base it only
// counts (sizing pass): the same carving code first measures what it needs, then runs again on
// the real allocation, so the two can never disagree.
class Carver {
 public:
  Carver(uint8_t* base, int64_t capacity) : base_(base), capacity_(capacity) {}
  // nullptr while counting; otherwise the range, or nullptr when it does not fit (check ok()).
  uint8_t* Take(int64_t bytes) {
    const int64_t at = used_;
    used_ += AlignUp(bytes);
    if (base_ == nullptr) return nullptr;
    if (used_ > capacity_) {
      overflow_ = true;
      return nullptr;
    }
    return base_ + at;
  }
  template <typename T>
  T* TakeArray(int64_t count) {
    return reinterpret_cast<T*>(Take(count * static_cast<int64_t>(sizeof(T))));
  }
  int64_t used() const { return used_; }
  bool ok() const { return !overflow_; }

 private:
  uint8_t* base_;
  int64_t capacity_;
  int64_t used_ = 0;
  bool overflow_ = false;
};

// One cudaMalloc on the current device, freed on destruction.
class DeviceAllocation {
 public:
  // RESOURCE_EXHAUSTED when the device cannot hold `bytes` (the message says how much is free).
  static absl::StatusOr<std::unique_ptr<DeviceAllocation>> Create(int64_t bytes,
                                                                  std::string_view what);
  ~DeviceAllocation();
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;

  uint8_t* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  DeviceAllocation(uint8_t* data, int64_t bytes) : data_(data), bytes_(bytes) {}
  uint8_t* data_;
  int64_t bytes_;
};

// Page-locked host memory (cudaHostAlloc): asynchronous copies to and from it overlap the host.
class PinnedHostBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> Create(int64_t bytes,
                                                                  std::string_view what);
  ~PinnedHostBuffer();
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  uint8_t* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  PinnedHostBuffer(uint8_t* data, int64_t bytes) : data_(data), bytes_(bytes) {}
  uint8_t* data_;
  int64_t bytes_;
};

// Free and total memory of the current device.
absl::StatusOr<std::pair<int64_t, int64_t>> DeviceMemoryInfo();

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_DEVICE_MEMORY_H_
