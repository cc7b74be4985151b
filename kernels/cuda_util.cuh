// Device helpers shared by the kernels in kernels/: the dispatch macros that turn runtime sizes
// into template constants, warp reductions, cooperative copies into shared memory, and code
// loads. Device code only; included by .cu files.
#ifndef SUBSPACE_KERNELS_CUDA_UTIL_CUH_
#define SUBSPACE_KERNELS_CUDA_UTIL_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "core/base/coeff_codec.h"

// Runs the statements with `HEAD_DIM` a constexpr int for head_dim 64 or 128; any other value
// returns cudaErrorInvalidValue from the enclosing launcher.
#define SUBSPACE_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, ...) \
  switch (head_dim) {                                       \
    case 64: {                                              \
      constexpr int HEAD_DIM = 64;                          \
      __VA_ARGS__                                           \
      break;                                                \
    }                                                       \
    case 128: {                                             \
      constexpr int HEAD_DIM = 128;                         \
      __VA_ARGS__                                           \
      break;                                                \
    }                                                       \
    default:                                                \
      return cudaErrorInvalidValue;                         \
  }

// Runs the statements with `CODE_T` the stored coefficient type: __half or int8_t.
#define SUBSPACE_DISPATCH_CODE_TYPE(dtype, CODE_T, ...) \
  switch (dtype) {                                      \
    case ::subspace::CoeffDtype::kFp16: {               \
      using CODE_T = __half;                            \
      __VA_ARGS__                                       \
      break;                                            \
    }                                                   \
    case ::subspace::CoeffDtype::kInt8: {               \
      using CODE_T = int8_t;                            \
      __VA_ARGS__                                       \
      break;                                            \
    }                                                   \
    default:                                            \
      return cudaErrorInvalidValue;                     \
  }

namespace subspace::kernels {

// The current device (`*device`) and its opt-in shared memory per block (`*bytes`), the attribute
// read once per device: launchers ask on every call, and a decode step launches per layer.
inline cudaError_t CurrentDeviceSharedMemoryOptin(int* device, int* bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // 0: not read yet
  cudaError_t err = cudaGetDevice(device);
  if (err != cudaSuccess) return err;
  const bool cached = *device >= 0 && *device < kMaxDevices;
  if (cached) {
    *bytes = cache[*device].load(std::memory_order_relaxed);
    if (*bytes > 0) return cudaSuccess;
  }
  err = cudaDeviceGetAttribute(bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, *device);
  if (err == cudaSuccess && cached) cache[*device].store(*bytes, std::memory_order_relaxed);
  return err;
}

// Raises `kernel`'s dynamic shared-memory limit to `bytes` once per device (the attribute stays
// set), not on every launch. `done` is the caller's per-kernel bit set of devices.
template <typename Kernel>
cudaError_t SetMaxDynamicSharedMemoryOnce(Kernel* kernel, int bytes, int device,
                                          std::atomic<uint64_t>& done) {
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  return err;
}

}  // namespace subspace::kernels

namespace subspace::kernels::device {

inline constexpr int kWarpSize = 32;

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// Copies `bytes` from global to shared memory with all threads of the CTA, 16 bytes a thread
// when both ends and the size allow it (page rows always do), else 4, else 1. No barrier.
__device__ __forceinline__ void CopyToShared(void* dst, const void* src, int64_t bytes) {
  const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  const int64_t tid = threadIdx.x, n = blockDim.x;
  if (((d | s | static_cast<uintptr_t>(bytes)) & 15u) == 0) {
    auto* out = static_cast<uint4*>(dst);
    const auto* in = static_cast<const uint4*>(src);
    for (int64_t i = tid; i < bytes / 16; i += n) out[i] = __ldg(in + i);
  } else if (((d | s | static_cast<uintptr_t>(bytes)) & 3u) == 0) {
    auto* out = static_cast<uint32_t*>(dst);
    const auto* in = static_cast<const uint32_t*>(src);
    for (int64_t i = tid; i < bytes / 4; i += n) out[i] = __ldg(in + i);
  } else {
    auto* out = static_cast<uint8_t*>(dst);
    const auto* in = static_cast<const uint8_t*>(src);
    for (int64_t i = tid; i < bytes; i += n) out[i] = __ldg(in + i);
  }
}

__device__ __forceinline__ float CodeToFloat(__half c) { return __half2float(c); }
__device__ __forceinline__ float CodeToFloat(int8_t c) { return static_cast<float>(c); }

// Rows [bs, r] of float coefficients into codes [bs, r] (and, for int8, fp16 scales [bs]) as
// core's EncodeCoeffs encodes them: fp16 rounded to nearest even, or int8 with amax / 127
// rounded to an fp16 scale s and codes clamp(rint(x / s)), IEEE division and reciprocal
// (nvcc's default -prec-div=true) as the CPU computes them. All threads of the CTA (blockDim.x
// a multiple of the warp size), one warp per int8 row. No barrier.
template <typename CodeT>
__device__ __forceinline__ void EncodeCoeffRows(const float* coef, int bs, int r, uint8_t* codes,
                                                __half* scales) {
  if constexpr (sizeof(CodeT) == 2) {
    auto* out = reinterpret_cast<__half*>(codes);
    for (int idx = threadIdx.x; idx < bs * r; idx += blockDim.x)
      out[idx] = __float2half_rn(coef[idx]);
  } else {
    auto* out = reinterpret_cast<int8_t*>(codes);
    const int warps = blockDim.x / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    for (int t = threadIdx.x / kWarpSize; t < bs; t += warps) {
      const float* x = coef + t * r;
      float amax = 0.0f;
      for (int j = lane; j < r; j += kWarpSize) amax = fmaxf(amax, fabsf(x[j]));
      amax = WarpMax(amax);
      const __half s16 = __float2half_rn(amax / 127.0f);
      const float s = __half2float(s16);
      const float inv = s > 0.0f ? 1.0f / s : 0.0f;
      for (int j = lane; j < r; j += kWarpSize) {
        out[t * r + j] =
            static_cast<int8_t>(fminf(fmaxf(rintf(__fmul_rn(x[j], inv)), -127.0f), 127.0f));
      }
      if (lane == 0) scales[t] = s16;
    }
  }
}

}  // namespace subspace::kernels::device

#endif  // SUBSPACE_KERNELS_CUDA_UTIL_CUH_
