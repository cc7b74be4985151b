// AppendKvKernel: one CTA per new token writes its K and V rows of every KV head, rounded to
// fp16, into the token slot its slot_mapping entry names (vLLM's reshape_and_cache). A head's
// row is contiguous in the page, so the writes coalesce: 16-byte loads, 8-byte stores when the
// shapes and pointers allow it, single elements otherwise.
#include "kernels/append_kv.h"
#include "kernels/cuda_util.cuh"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 128;

template <bool kVec4>
__global__ void __launch_bounds__(kThreads)
    AppendKvKernel(const __grid_constant__ AppendKvParams p) {
  const KvPoolLayout& l = p.layout;
  const int64_t i = blockIdx.x;
  const int64_t slot = p.slot_mapping[i];
  if (slot < 0) return;  // padding: nothing to write
  const auto page = static_cast<int32_t>(slot / l.block_size);
  const int64_t t = slot % l.block_size;
  const int hd = l.head_dim, row = l.n_kv_heads * hd;
  const float* k = p.k + i * row;
  const float* v = p.v + i * row;
  if constexpr (kVec4) {
    for (int j = threadIdx.x; j < row / 4; j += kThreads) {
      const int h = 4 * j / hd, d = 4 * j % hd;
      const int64_t at = (t * hd + d) * 2;  // bytes into the head's [B, head_dim] rows
      for (int side = 0; side < 2; ++side) {
        const float4 x = __ldg(reinterpret_cast<const float4*>(side == 0 ? k : v) + j);
        const __half2 a = __floats2half2_rn(x.x, x.y), b = __floats2half2_rn(x.z, x.w);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&a);
        packed.y = *reinterpret_cast<const uint32_t*>(&b);
        *reinterpret_cast<uint2*>(p.pool + (side == 0 ? l.FullK(page, h) : l.FullV(page, h)) + at) =
            packed;
      }
    }
  } else {
    for (int j = threadIdx.x; j < row; j += kThreads) {
      const int h = j / hd, d = j % hd;
      const int64_t at = (t * hd + d) * 2;
      *reinterpret_cast<__half*>(p.pool + l.FullK(page, h) + at) = __float2half_rn(__ldg(k + j));
      *reinterpret_cast<__half*>(p.pool + l.FullV(page, h) + at) = __float2half_rn(__ldg(v + j));
    }
  }
}

}  // namespace

cudaError_t LaunchAppendKv(const AppendKvParams& p, cudaStream_t stream) {
  const KvPoolLayout& l = p.layout;
  if (p.n <= 0 || l.n_kv_heads <= 0 || l.head_dim <= 0 || l.block_size <= 0) {
    return cudaErrorInvalidValue;
  }
  // A page must hold both halves [2][n_kv][B][head_dim] fp16; a token's row count is an int in
  // the kernel.
  const int64_t row = static_cast<int64_t>(l.n_kv_heads) * l.head_dim;
  if (row > (int64_t{1} << 30) || l.page_bytes < 4 * row * l.block_size) {
    return cudaErrorInvalidValue;
  }
  // head_dim % 4 == 0 puts every head row, and so every 4-element group, on an 8-byte boundary
  // of the pool (page_bytes is then a multiple of 16).
  const bool vec4 = l.head_dim % 4 == 0 && l.page_bytes % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(p.pool) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(p.k) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(p.v) % 16 == 0;
  if (vec4) {
    AppendKvKernel<true><<<p.n, kThreads, 0, stream>>>(p);
  } else {
    AppendKvKernel<false><<<p.n, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace subspace::kernels
