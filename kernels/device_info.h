// Which CUDA devices this process can use. Safe to call on machines without a GPU or
// driver: it then reports no devices instead of failing.
#ifndef SUBSPACE_KERNELS_DEVICE_INFO_H_
#define SUBSPACE_KERNELS_DEVICE_INFO_H_

#include <cstdint>
#include <string>
#include <vector>

namespace subspace::kernels {

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int compute_major = 0;
  int compute_minor = 0;
  int64_t total_memory_bytes = 0;
  int multiprocessors = 0;
};

// Empty when there is no driver or no device; `error` (optional) gets the CUDA message.
std::vector<CudaDeviceInfo> ListCudaDevices(std::string* error = nullptr);

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_DEVICE_INFO_H_
