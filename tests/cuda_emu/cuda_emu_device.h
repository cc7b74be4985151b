// What the emulator's two halves share: the emulated device's limits and the runtime's last
// error (cuda_emu_runtime.cc runs kernels; cuda_emu_api.cc is the CUDA runtime API).
#ifndef SUBSPACE_TESTS_CUDA_EMU_CUDA_EMU_DEVICE_H_
#define SUBSPACE_TESTS_CUDA_EMU_CUDA_EMU_DEVICE_H_

#include <cuda_runtime_api.h>

#include <cstddef>

namespace subspace::emu {

// An sm_90 part with Hopper's shared-memory limits, so launchers take the paths they take on an
// H100.
inline constexpr int kSharedMemoryPerBlock = 48 * 1024;        // without the opt-in attribute
inline constexpr int kSharedMemoryPerBlockOptin = 227 * 1024;  // the opt-in maximum
inline constexpr int kMaxThreadsPerBlock = 1024;
inline constexpr int kWarpSize = 32;
inline constexpr size_t kEmulatedMemoryBytes = size_t{8} << 30;

// The error cudaGetLastError returns (and clears); cudaPeekAtLastError and the synchronising
// calls return it without clearing. A launch failure is recorded here.
void RecordError(cudaError_t err);
cudaError_t PeekError();
cudaError_t TakeError();

// cudaFuncAttributeMaxDynamicSharedMemorySize of `kernel`.
void SetMaxDynamicSharedMemory(const void* kernel, int bytes);

}  // namespace subspace::emu

#endif  // SUBSPACE_TESTS_CUDA_EMU_CUDA_EMU_DEVICE_H_
