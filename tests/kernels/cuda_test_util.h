// Device buffers and checks for the GPU kernel tests: every CUDA call's status is checked, and
// outputs are poisoned (0xff bytes: NaN in fp16 and fp32) before a launch so unwritten
// elements cannot pass.
#ifndef SUBSPACE_TESTS_KERNELS_CUDA_TEST_UTIL_H_
#define SUBSPACE_TESTS_KERNELS_CUDA_TEST_UTIL_H_

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/device_info.h"

#define SUBSPACE_ASSERT_CUDA(expr)                                                               \
  do {                                                                                           \
    const cudaError_t subspace_err_ = (expr);                                                    \
    ASSERT_EQ(subspace_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(subspace_err_); \
  } while (0)

// Skips the test when no CUDA device is usable (no driver, no GPU).
#define SUBSPACE_REQUIRE_CUDA_DEVICE()                                  \
  do {                                                                  \
    std::string subspace_why_;                                          \
    if (::subspace::kernels::ListCudaDevices(&subspace_why_).empty()) { \
      GTEST_SKIP() << "no CUDA device: " << subspace_why_;              \
    }                                                                   \
  } while (0)

namespace subspace::kernels::testing {

// Owns `count` elements of T on the device.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count > 0 && cudaMalloc(&ptr_, count * sizeof(T)) != cudaSuccess) ptr_ = nullptr;
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), count_(o.count_) {
    o.ptr_ = nullptr;
    o.count_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(count_, o.count_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  T* get() const { return static_cast<T*>(ptr_); }
  size_t count() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  bool ok() const { return count_ == 0 || ptr_ != nullptr; }

  cudaError_t Upload(const std::vector<T>& host) {
    if (host.size() != count_) return cudaErrorInvalidValue;
    return cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice);
  }
  cudaError_t UploadBytes(const void* host, size_t n) {
    if (n > bytes()) return cudaErrorInvalidValue;
    return cudaMemcpy(ptr_, host, n, cudaMemcpyHostToDevice);
  }
  cudaError_t Download(std::vector<T>* host) const {
    host->resize(count_);
    return cudaMemcpy(host->data(), ptr_, bytes(), cudaMemcpyDeviceToHost);
  }
  cudaError_t Poison() { return cudaMemset(ptr_, 0xff, bytes()); }

 private:
  void* ptr_ = nullptr;
  size_t count_ = 0;
};

template <typename T>
DeviceBuffer<T> ToDevice(const std::vector<T>& host) {
  DeviceBuffer<T> d(host.size());
  if (d.ok() && d.Upload(host) != cudaSuccess) return DeviceBuffer<T>();
  return d;
}

}  // namespace subspace::kernels::testing

#endif  // SUBSPACE_TESTS_KERNELS_CUDA_TEST_UTIL_H_
