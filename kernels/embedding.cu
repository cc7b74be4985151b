// EmbeddingKernel: one CTA per token copies its fp16 table row into the fp32 residual stream.
// A pure gather, so the only work is moving bytes: 16-byte loads of 8 halves when the row
// and pointers allow it, scalar otherwise.
#include "kernels/cuda_util.cuh"
#include "kernels/embedding.h"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 256;

template <bool kVec8>
__global__ void __launch_bounds__(kThreads)
    EmbeddingKernel(const __grid_constant__ EmbeddingParams p) {
  const int64_t i = blockIdx.x;
  const int32_t token = p.tokens[i];
  float* out = p.out + i * p.dim;
  if (token < 0 || token >= p.n_vocab) {
    // The host validated ids; a zero row keeps a stray one from reading outside the table, as
    // cpu::Embed does.
    for (int j = threadIdx.x; j < p.dim; j += kThreads) out[j] = 0.0f;
    return;
  }
  const auto* row = reinterpret_cast<const __half*>(p.table) + static_cast<int64_t>(token) * p.dim;
  if constexpr (kVec8) {
    const auto* in8 = reinterpret_cast<const uint4*>(row);
    auto* out4 = reinterpret_cast<float4*>(out);
    for (int j = threadIdx.x; j < p.dim / 8; j += kThreads) {
      const uint4 raw = __ldg(in8 + j);
      const auto* h = reinterpret_cast<const __half2*>(&raw);
      const float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
      const float2 c = __half22float2(h[2]), d = __half22float2(h[3]);
      out4[2 * j] = make_float4(a.x, a.y, b.x, b.y);
      out4[2 * j + 1] = make_float4(c.x, c.y, d.x, d.y);
    }
  } else {
    for (int j = threadIdx.x; j < p.dim; j += kThreads) out[j] = __half2float(row[j]);
  }
}

}  // namespace

cudaError_t LaunchEmbedding(const EmbeddingParams& p, cudaStream_t stream) {
  if (p.n <= 0 || p.dim <= 0 || p.n_vocab <= 0) return cudaErrorInvalidValue;
  // Every row starts 16-byte aligned when dim % 8 == 0 and both bases are 16-byte aligned.
  const bool vec8 = p.dim % 8 == 0 && reinterpret_cast<uintptr_t>(p.table) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  if (vec8) {
    EmbeddingKernel<true><<<p.n, kThreads, 0, stream>>>(p);
  } else {
    EmbeddingKernel<false><<<p.n, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace subspace::kernels
