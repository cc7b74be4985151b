// Element-wise residual-stream kernels: ResidualAddKernel (x += y after each sub-layer),
// CastToHalfKernel (fp32 -> fp16, round to nearest even, for the output projection's input) and
// GatherRowsToHalfKernel (the same cast of chosen rows: queries read back for KQ-SVD).
// Grid-stride loops over 4-element groups when the pointers allow it, then a scalar tail.
#include <algorithm>

#include "kernels/cuda_util.cuh"
#include "kernels/residual.h"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 256;
// Enough CTAs to fill any current GPU a few times over; the grid-stride loop covers the rest.
constexpr int64_t kMaxBlocks = 4096;

int64_t Blocks(int64_t units) {
  return std::max<int64_t>(1, std::min<int64_t>((units + kThreads - 1) / kThreads, kMaxBlocks));
}

// Elements [0, vec * 4) move as groups of four, [vec * 4, n) one at a time.
__global__ void __launch_bounds__(kThreads)
    ResidualAddKernel(const __grid_constant__ ResidualAddParams p, int64_t vec) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  auto* x4 = reinterpret_cast<float4*>(p.x);
  const auto* y4 = reinterpret_cast<const float4*>(p.y);
  for (int64_t j = tid; j < vec; j += stride) {
    float4 a = x4[j];
    const float4 b = __ldg(y4 + j);
    a.x += b.x;
    a.y += b.y;
    a.z += b.z;
    a.w += b.w;
    x4[j] = a;
  }
  for (int64_t j = vec * 4 + tid; j < p.n; j += stride) p.x[j] += __ldg(p.y + j);
}

__global__ void __launch_bounds__(kThreads)
    CastToHalfKernel(const __grid_constant__ CastToHalfParams p, int64_t vec) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const auto* in4 = reinterpret_cast<const float4*>(p.in);
  auto* out4 = reinterpret_cast<uint2*>(p.out);
  for (int64_t j = tid; j < vec; j += stride) {
    const float4 v = __ldg(in4 + j);
    const __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&a);
    packed.y = *reinterpret_cast<const uint32_t*>(&b);
    out4[j] = packed;
  }
  auto* out = reinterpret_cast<__half*>(p.out);
  for (int64_t j = vec * 4 + tid; j < p.n; j += stride) out[j] = __float2half_rn(__ldg(p.in + j));
}

// One CTA per gathered row (a few hundred to a few thousand values: n_heads x head_dim).
__global__ void __launch_bounds__(kThreads)
    GatherRowsToHalfKernel(const __grid_constant__ GatherRowsToHalfParams p) {
  const float* in = p.in + static_cast<int64_t>(p.rows[blockIdx.x]) * p.width;
  auto* out = reinterpret_cast<__half*>(p.out) + static_cast<int64_t>(blockIdx.x) * p.width;
  for (int j = threadIdx.x; j < p.width; j += kThreads) out[j] = __float2half_rn(__ldg(in + j));
}

bool Aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace

cudaError_t LaunchResidualAdd(const ResidualAddParams& p, cudaStream_t stream) {
  if (p.n <= 0) return cudaErrorInvalidValue;
  const int64_t vec = Aligned(p.x, 16) && Aligned(p.y, 16) ? p.n / 4 : 0;
  ResidualAddKernel<<<static_cast<unsigned>(Blocks(vec > 0 ? vec : p.n)), kThreads, 0, stream>>>(
      p, vec);
  return cudaGetLastError();
}

cudaError_t LaunchCastToHalf(const CastToHalfParams& p, cudaStream_t stream) {
  if (p.n <= 0) return cudaErrorInvalidValue;
  const int64_t vec = Aligned(p.in, 16) && Aligned(p.out, 8) ? p.n / 4 : 0;
  CastToHalfKernel<<<static_cast<unsigned>(Blocks(vec > 0 ? vec : p.n)), kThreads, 0, stream>>>(
      p, vec);
  return cudaGetLastError();
}

cudaError_t LaunchGatherRowsToHalf(const GatherRowsToHalfParams& p, cudaStream_t stream) {
  if (p.n_rows <= 0 || p.width <= 0) return cudaErrorInvalidValue;
  GatherRowsToHalfKernel<<<static_cast<unsigned>(p.n_rows), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace subspace::kernels
