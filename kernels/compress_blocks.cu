// CompressBlocksKernel: one CTA per (block, KV head). Keys then values: the head's B fp16 rows
// go to shared memory, each thread projects (token, coefficient) pairs onto the basis columns
// (coalesced across coefficients), then the row is encoded as EncodeCoeffs does — fp16 round
// to nearest even, or int8 with amax / 127 rounded to an fp16 scale, codes = clamp(rint(x / s))
// — so results differ from the twin only where float and double projections round apart.
#include "kernels/compress_blocks.h"
#include "kernels/cuda_util.cuh"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / device::kWarpSize;

// Shared memory: rows [B, head_dim] fp16, then coefficients [B, max(r_k, r_v)] float.
// At most 64 x 128 x 2 + 64 x 128 x 4 = 48 KiB: no opt-in needed.
int64_t SharedBytes(const KvPoolLayout& l) {
  const int r = l.rank_k > l.rank_v ? l.rank_k : l.rank_v;
  return static_cast<int64_t>(l.block_size) * l.head_dim * 2 +
         static_cast<int64_t>(l.block_size) * r * 4;
}

template <int kHeadDim, typename CodeT>
__global__ void __launch_bounds__(kThreads)
    CompressBlocksKernel(const __grid_constant__ CompressBlocksParams p) {
  const KvPoolLayout& l = p.layout;
  const int blk = blockIdx.x, h = blockIdx.y;
  const int bs = l.block_size;
  extern __shared__ __align__(16) uint8_t smem[];
  auto* rows = reinterpret_cast<__half*>(smem);                                           // [B, d]
  auto* coef = reinterpret_cast<float*>(smem + static_cast<int64_t>(bs) * kHeadDim * 2);  // [B, r]

  const int32_t src = p.src_page[blk];
  const int64_t slot = l.Slot(p.dst_page[blk], p.dst_slot[blk]);
  const int64_t epoch = p.epoch[static_cast<int64_t>(blk) * l.n_kv_heads + h];
  const int warp = threadIdx.x / device::kWarpSize, lane = threadIdx.x % device::kWarpSize;

  for (int side = 0; side < 2; ++side) {
    const int r = side == 0 ? l.rank_k : l.rank_v;
    const float* basis = (side == 0 ? p.basis_pk : p.basis_pv) +
                         (epoch * l.n_kv_heads + h) * kHeadDim * r;  // [d, r]
    device::CopyToShared(rows, p.pool + (side == 0 ? l.FullK(src, h) : l.FullV(src, h)),
                         static_cast<int64_t>(bs) * kHeadDim * 2);
    __syncthreads();
    // coef[t, j] = sum_i rows[t, i] * basis[i, j]
    for (int idx = threadIdx.x; idx < bs * r; idx += kThreads) {
      const int t = idx / r, j = idx % r;
      const __half* x = rows + t * kHeadDim;
      float acc = 0.0f;
#pragma unroll 8
      for (int i = 0; i < kHeadDim; ++i)
        acc = fmaf(__half2float(x[i]), __ldg(basis + i * r + j), acc);
      coef[idx] = acc;
    }
    __syncthreads();
    uint8_t* codes = p.pool + slot + (side == 0 ? l.KCodes(h) : l.VCodes(h));  // [B, r]
    if constexpr (sizeof(CodeT) == 2) {
      auto* out = reinterpret_cast<__half*>(codes);
      for (int idx = threadIdx.x; idx < bs * r; idx += kThreads)
        out[idx] = __float2half_rn(coef[idx]);
    } else {
      auto* out = reinterpret_cast<int8_t*>(codes);
      auto* scales =
          reinterpret_cast<__half*>(p.pool + slot + (side == 0 ? l.KScales(h) : l.VScales(h)));
      for (int t = warp; t < bs; t += kWarps) {
        const float* x = coef + t * r;
        float amax = 0.0f;
        for (int j = lane; j < r; j += device::kWarpSize) amax = fmaxf(amax, fabsf(x[j]));
        amax = device::WarpMax(amax);
        // IEEE division and reciprocal (nvcc's default -prec-div=true), as the CPU computes them.
        const __half s16 = __float2half_rn(amax / 127.0f);
        const float s = __half2float(s16);
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        for (int j = lane; j < r; j += device::kWarpSize) {
          out[t * r + j] =
              static_cast<int8_t>(fminf(fmaxf(rintf(__fmul_rn(x[j], inv)), -127.0f), 127.0f));
        }
        if (lane == 0) scales[t] = s16;
      }
    }
    __syncthreads();  // rows and coef are reused by the value side
  }
}

}  // namespace

cudaError_t LaunchCompressBlocks(const CompressBlocksParams& p, cudaStream_t stream) {
  if (KvPoolLayoutError(p.layout) != nullptr || p.n_blocks < 0) return cudaErrorInvalidValue;
  if (p.n_blocks == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.n_blocks), static_cast<unsigned>(p.layout.n_kv_heads));
  const size_t smem = static_cast<size_t>(SharedBytes(p.layout));
  SUBSPACE_DISPATCH_HEAD_DIM(
      p.layout.head_dim, kHeadDim, {SUBSPACE_DISPATCH_CODE_TYPE(p.layout.coeff_dtype, CodeT, {
        CompressBlocksKernel<kHeadDim, CodeT><<<grid, kThreads, smem, stream>>>(p);
      })})
  return cudaGetLastError();
}

}  // namespace subspace::kernels
