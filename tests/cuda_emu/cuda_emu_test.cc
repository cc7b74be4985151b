// The CUDA emulator's own semantics: built-in indices, CTA and warp barriers, shuffles, shared
// memory, launch checks, and the kernel bugs it must report (divergent barriers, shuffles on
// partial warps) instead of running through them.
#include "tests/cuda_emu/cuda_emu.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace subspace::emu {
namespace {

__global__ void WriteIndices(uint32_t* out) {  // [grid.z, grid.y, grid.x, block.x] linear ids
  const uint32_t block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  out[block * blockDim.x + threadIdx.x] = block * 1000 + threadIdx.x;
}

TEST(CudaEmuTest, EveryThreadOfEveryBlockRunsOnceWithItsIndices) {
  const dim3 grid(3, 2, 2);
  const int threads = 40;  // a partial second warp
  std::vector<uint32_t> out(12 * threads, 0xffffffffu);
  Launcher(grid, threads).Run(WriteIndices, out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (uint32_t b = 0; b < 12; ++b) {
    for (uint32_t t = 0; t < threads; ++t) EXPECT_EQ(out[b * threads + t], b * 1000 + t);
  }
}

// Each thread writes its slot, then reads its neighbour's: wrong without a working barrier.
__global__ void RotateThroughShared(const int* in, int* out) {
  __shared__ int slots[256];
  slots[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slots[(threadIdx.x + 1) % blockDim.x];
  __syncthreads();  // the next loop of a real kernel would rewrite slots
}

TEST(CudaEmuTest, SyncThreadsMakesEveryWriteVisible) {
  const int blocks = 3, threads = 256;
  std::vector<int> in(blocks * threads), out(in.size(), -1);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<int>(i * 7 + 1);
  Launcher(blocks, threads).Run(RotateThroughShared, in.data(), out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) {
      EXPECT_EQ(out[b * threads + t], in[b * threads + (t + 1) % threads]);
    }
  }
}

// Threads past `n` return before the barrier; the rest must still get through it.
__global__ void EarlyExitThenBarrier(int n, int* out) {
  __shared__ int total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  if (static_cast<int>(threadIdx.x) >= n) return;
  atomicOr(reinterpret_cast<unsigned*>(&total), 1u << threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) *out = total;
}

TEST(CudaEmuTest, ExitedThreadsCountAsArrived) {
  int out = 0;
  Launcher(1, 64).Run(EarlyExitThenBarrier, 5, &out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(out, 0x1f);
}

__global__ void WarpSums(const float* in, float* out) {
  float x = in[threadIdx.x];
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  out[threadIdx.x] = x;
}

TEST(CudaEmuTest, XorShuffleReducesEachWarp) {
  std::vector<float> in(96), out(96, -1.0f);
  for (int i = 0; i < 96; ++i) in[static_cast<size_t>(i)] = static_cast<float>(i);
  Launcher(1, 96).Run(WarpSums, in.data(), out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int w = 0; w < 3; ++w) {
    const float sum = static_cast<float>(32 * 32 * w + 31 * 32 / 2);
    for (int lane = 0; lane < 32; ++lane) EXPECT_EQ(out[static_cast<size_t>(w * 32 + lane)], sum);
  }
}

__global__ void CopyDynamicShared(uint8_t* out, int bytes) {
  uint8_t* smem = DynamicShared<uint8_t>();
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = smem[i];
  __syncthreads();
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) smem[i] = 0;  // the next CTA sees 0xff
}

TEST(CudaEmuTest, DynamicSharedMemoryStartsPoisonedInEveryBlock) {
  std::vector<uint8_t> out(1024, 0);
  Launcher(2, 64, out.size()).Run(CopyDynamicShared, out.data(), 1024);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (uint8_t b : out) EXPECT_EQ(b, 0xff);
}

__global__ void TouchSharedOnce(uint8_t* out, int bytes) {
  if (threadIdx.x == 0) out[0] = DynamicShared<uint8_t>()[bytes - 1];
}

TEST(CudaEmuTest, DynamicSharedMemoryOver48KiBNeedsTheAttribute) {
  uint8_t out = 0;
  const int bytes = 64 * 1024;
  Launcher(1, 32, bytes).Run(TouchSharedOnce, &out, bytes);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(out, 0);

  ASSERT_EQ(cudaFuncSetAttribute(reinterpret_cast<const void*>(TouchSharedOnce),
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
            cudaSuccess);
  Launcher(1, 32, bytes).Run(TouchSharedOnce, &out, bytes);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(out, 0xff);
  EXPECT_EQ(cudaFuncSetAttribute(reinterpret_cast<const void*>(TouchSharedOnce),
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, 228 * 1024),
            cudaErrorInvalidValue);
}

TEST(CudaEmuTest, InvalidConfigurationsAreRefused) {
  uint32_t out = 0;
  Launcher(1, 1025).Run(WriteIndices, &out);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  Launcher(0, 32).Run(WriteIndices, &out);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  Launcher(dim3(1, 65536), 32).Run(WriteIndices, &out);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // not sticky
}

// Thread 0 waits for the CTA, the rest of its warp for thread 0 at a shuffle: a hang on the device.
__global__ void BarrierAgainstShuffle(float* out) {
  float x = 1.0f;
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    x = __shfl_xor_sync(0xffffffffu, x, 1);
  }
  out[threadIdx.x] = x;
}

TEST(CudaEmuTest, ABarrierNoThreadCanReachIsADeadlockReported) {
  std::vector<float> out(32, 0.0f);
  Launcher(1, 32).Run(BarrierAgainstShuffle, out.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
}

TEST(CudaEmuTest, AFullMaskShuffleOnAPartialWarpFailsTheLaunch) {
  std::vector<float> in(40, 1.0f), out(40, 0.0f);
  Launcher(1, 40).Run(WarpSums, in.data(), out.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
}

TEST(CudaEmuTest, DeviceMemoryIsAlignedAndFreesAreChecked) {
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 1000), cudaSuccess);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 256, 0u);
  ASSERT_EQ(cudaMemset(p, 0xab, 1000), cudaSuccess);
  EXPECT_EQ(static_cast<uint8_t*>(p)[999], 0xab);
  int local = 0;
  EXPECT_EQ(cudaFree(&local), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_EQ(cudaFree(p), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace subspace::emu
