#include "cuda/device_memory.h"

#include <cuda_runtime_api.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cuda/cuda_status.h"

namespace subspace::cuda {

absl::StatusOr<std::pair<int64_t, int64_t>> DeviceMemoryInfo() {
  size_t free_bytes = 0, total_bytes = 0;
  if (absl::Status st = CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
      !st.ok()) {
    return st;
  }
  return std::make_pair(static_cast<int64_t>(free_bytes), static_cast<int64_t>(total_bytes));
}

absl::StatusOr<std::unique_ptr<DeviceAllocation>> DeviceAllocation::Create(int64_t bytes,
                                                                           std::string_view what) {
  if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": no bytes"));
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, static_cast<size_t>(bytes));
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so later calls do not see it
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: cannot allocate %d MiB on the device (%d MiB free of %d MiB): %s", std::string(what),
        bytes >> 20, free_bytes >> 20, total_bytes >> 20, cudaGetErrorString(err)));
  }
  return std::unique_ptr<DeviceAllocation>(new DeviceAllocation(static_cast<uint8_t*>(p), bytes));
}

DeviceAllocation::~DeviceAllocation() { cudaFree(data_); }

absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> PinnedHostBuffer::Create(int64_t bytes,
                                                                           std::string_view what) {
  if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": no bytes"));
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, static_cast<size_t>(bytes), cudaHostAllocDefault);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrFormat("%s: cannot pin %d MiB of host memory: %s",
                                                        std::string(what), bytes >> 20,
                                                        cudaGetErrorString(err)));
  }
  return std::unique_ptr<PinnedHostBuffer>(new PinnedHostBuffer(static_cast<uint8_t*>(p), bytes));
}

PinnedHostBuffer::~PinnedHostBuffer() { cudaFreeHost(data_); }

}  // namespace subspace::cuda
