// Device enumeration through the CUDA runtime.
#include <cuda_runtime.h>

#include "kernels/device_info.h"

namespace subspace::kernels {

std::vector<CudaDeviceInfo> ListCudaDevices(std::string* error) {
  std::vector<CudaDeviceInfo> devices;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (error != nullptr) *error = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return devices;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    CudaDeviceInfo info;
    info.index = i;
    info.name = prop.name;
    info.compute_major = prop.major;
    info.compute_minor = prop.minor;
    info.total_memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
    info.multiprocessors = prop.multiProcessorCount;
    devices.push_back(info);
  }
  return devices;
}

}  // namespace subspace::kernels
