// RmsNormKernel: one CTA per output row. The CTA reads its fp32 row (gathered through `rows`
// when given), adds the residual branch's row into it first when fused (kAdd: stored back into
// x), reduces the sum of squares across the CTA, then writes x * scale * weight as fp16 for the
// next GEMM. 16-byte loads when the row and pointers allow it, scalar otherwise.
#include <cmath>

#include "kernels/cuda_util.cuh"
#include "kernels/rms_norm.h"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / device::kWarpSize;

// Sum of `x` over the CTA, returned to every thread.
__device__ __forceinline__ float BlockSum(float x, float* scratch /* [kWarps + 1] */) {
  const int warp = threadIdx.x / device::kWarpSize, lane = threadIdx.x % device::kWarpSize;
  x = device::WarpSum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    float y = lane < kWarps ? scratch[lane] : 0.0f;
    y = device::WarpSum(y);
    if (lane == 0) scratch[kWarps] = y;
  }
  __syncthreads();
  return scratch[kWarps];
}

// x's element j (four at kVec4) for the second pass: through the read-only cache unless this
// launch wrote it (kAdd), which that cache need not see. Each thread reads back only the
// elements it wrote itself in the first pass, so no barrier is needed between the passes.
template <bool kAdd, typename T>  // T: float or float4
__device__ __forceinline__ T LoadX(const T* x, int j) {
  if constexpr (kAdd) {
    return x[j];
  } else {
    return __ldg(x + j);
  }
}

template <bool kVec4, bool kAdd>
__global__ void __launch_bounds__(kThreads) RmsNormKernel(const __grid_constant__ RmsNormParams p) {
  __shared__ float scratch[kWarps + 1];
  const int64_t i = blockIdx.x;
  const int64_t row = p.rows != nullptr ? p.rows[i] : i;
  float* x = p.x + row * p.dim;
  __half* out = reinterpret_cast<__half*>(p.out) + i * p.dim;

  float ss = 0.0f;
  if constexpr (kVec4) {
    auto* x4 = reinterpret_cast<float4*>(x);
    for (int j = threadIdx.x; j < p.dim / 4; j += kThreads) {
      float4 v;
      if constexpr (kAdd) {
        v = x4[j];
        const float4 a = __ldg(reinterpret_cast<const float4*>(p.add + row * p.dim) + j);
        v.x += a.x;
        v.y += a.y;
        v.z += a.z;
        v.w += a.w;
        x4[j] = v;
      } else {
        v = __ldg(x4 + j);
      }
      ss = fmaf(v.x, v.x, ss);
      ss = fmaf(v.y, v.y, ss);
      ss = fmaf(v.z, v.z, ss);
      ss = fmaf(v.w, v.w, ss);
    }
  } else {
    for (int j = threadIdx.x; j < p.dim; j += kThreads) {
      float v;
      if constexpr (kAdd) {
        v = x[j] + __ldg(p.add + row * p.dim + j);
        x[j] = v;
      } else {
        v = __ldg(x + j);
      }
      ss = fmaf(v, v, ss);
    }
  }
  ss = BlockSum(ss, scratch);
  // IEEE sqrt and division (nvcc's defaults), not rsqrtf: the scale is one float per row and
  // the twin computes it exactly in double.
  const float scale = 1.0f / sqrtf(ss / static_cast<float>(p.dim) + p.eps);

  // (x * scale) * weight, in the CPU backend's order; the row is re-read from L1/L2.
  if constexpr (kVec4) {
    const auto* x4 = reinterpret_cast<const float4*>(x);
    const auto* w4 = reinterpret_cast<const float4*>(p.weight);
    auto* out4 = reinterpret_cast<uint2*>(out);
    for (int j = threadIdx.x; j < p.dim / 4; j += kThreads) {
      const float4 v = LoadX<kAdd>(x4, j), w = __ldg(w4 + j);
      const __half2 a = __floats2half2_rn(v.x * scale * w.x, v.y * scale * w.y);
      const __half2 b = __floats2half2_rn(v.z * scale * w.z, v.w * scale * w.w);
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&a);
      packed.y = *reinterpret_cast<const uint32_t*>(&b);
      out4[j] = packed;
    }
  } else {
    for (int j = threadIdx.x; j < p.dim; j += kThreads) {
      out[j] = __float2half_rn(LoadX<kAdd>(x, j) * scale * __ldg(p.weight + j));
    }
  }
}

}  // namespace

cudaError_t LaunchRmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.n <= 0 || p.dim <= 0 || !(p.eps >= 0.0f)) return cudaErrorInvalidValue;
  const auto aligned = [](const void* ptr, uintptr_t bytes) {
    return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
  };
  const bool vec4 = p.dim % 4 == 0 && aligned(p.x, 16) && aligned(p.weight, 16) &&
                    aligned(p.out, 8) && (p.add == nullptr || aligned(p.add, 16));
  if (p.add != nullptr) {
    if (vec4) {
      RmsNormKernel<true, true><<<p.n, kThreads, 0, stream>>>(p);
    } else {
      RmsNormKernel<false, true><<<p.n, kThreads, 0, stream>>>(p);
    }
  } else if (vec4) {
    RmsNormKernel<true, false><<<p.n, kThreads, 0, stream>>>(p);
  } else {
    RmsNormKernel<false, false><<<p.n, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace subspace::kernels
