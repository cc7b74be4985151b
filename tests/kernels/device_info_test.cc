// Device enumeration must work with and without a GPU; the GPU half is skipped without one.
#include "kernels/device_info.h"

#include <gtest/gtest.h>

namespace subspace::kernels {
namespace {

TEST(DeviceInfoTest, ListsDevicesOrExplainsWhyNone) {
  std::string error;
  std::vector<CudaDeviceInfo> devices = ListCudaDevices(&error);
  if (devices.empty()) GTEST_SKIP() << "no CUDA device: " << error;
  for (const CudaDeviceInfo& d : devices) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_GT(d.total_memory_bytes, 0);
    EXPECT_GE(d.compute_major, 7);
  }
}

}  // namespace
}  // namespace subspace::kernels
