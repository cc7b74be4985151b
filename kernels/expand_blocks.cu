// ExpandBlocksKernel: one CTA per (block, KV head). Keys then values: the head's B rows of codes
// are decoded to float in shared memory as DecodeCoeffs does (fp16, or int8 times the row's
// fp16 scale, a product exact in float), then each thread computes output elements (token, i),
// consecutive threads on consecutive i so the fp16 stores coalesce, and rounds once to fp16
// (nearest even) — so results differ from the twin only where float and double sums round apart.
#include "kernels/cuda_util.cuh"
#include "kernels/expand_blocks.h"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 128;

// Shared memory: decoded coefficients [B, max(r_k, r_v)] float, keys' then values'.
// At most 64 x 128 x 4 = 32 KiB: no opt-in needed.
int64_t SharedBytes(const KvPoolLayout& l) {
  const int r = l.rank_k > l.rank_v ? l.rank_k : l.rank_v;
  return static_cast<int64_t>(l.block_size) * r * 4;
}

template <int kHeadDim, typename CodeT>
__global__ void __launch_bounds__(kThreads)
    ExpandBlocksKernel(const __grid_constant__ ExpandBlocksParams p) {
  const KvPoolLayout& l = p.layout;
  const int blk = blockIdx.x, h = blockIdx.y;
  const int bs = l.block_size;
  extern __shared__ __align__(16) uint8_t smem[];
  auto* coef = reinterpret_cast<float*>(smem);  // [B, r]

  const uint8_t* slot = p.src_pool + l.Slot(p.src_page[blk], p.src_slot[blk]);
  const int32_t dst = p.dst_page[blk];
  const int64_t epoch = p.epoch[static_cast<int64_t>(blk) * l.n_kv_heads + h];

  for (int side = 0; side < 2; ++side) {
    const int r = side == 0 ? l.rank_k : l.rank_v;
    const auto* codes =
        reinterpret_cast<const CodeT*>(slot + (side == 0 ? l.KCodes(h) : l.VCodes(h)));  // [B, r]
    if constexpr (sizeof(CodeT) == 2) {
      for (int idx = threadIdx.x; idx < bs * r; idx += kThreads)
        coef[idx] = device::CodeToFloat(__ldg(codes + idx));
    } else {
      const auto* scales =  // [B]
          reinterpret_cast<const __half*>(slot + (side == 0 ? l.KScales(h) : l.VScales(h)));
#pragma unroll 1  // unrolled, the per-element division by r spills registers on sm_80
      for (int idx = threadIdx.x; idx < bs * r; idx += kThreads)
        coef[idx] = __half2float(__ldg(scales + idx / r)) * device::CodeToFloat(__ldg(codes + idx));
    }
    __syncthreads();
    const float* basis = (side == 0 ? p.basis_pq : p.basis_rv) +
                         (epoch * l.n_kv_heads + h) * kHeadDim * r;  // [d, r_k] or [r_v, d]
    auto* out = reinterpret_cast<__half*>(
        p.dst_pool + (side == 0 ? l.FullK(dst, h) : l.FullV(dst, h)));  // [B, d]
    // out[t, i] = sum_j basis(i, j) coef[t, j]. The coefficient reads are warp broadcasts; the
    // values' R_v reads coalesce across i, the keys' P_q rows are strided by r but the head's
    // basis (at most 64 KiB) stays in L1 across the B tokens.
    for (int idx = threadIdx.x; idx < bs * kHeadDim; idx += kThreads) {
      const int t = idx / kHeadDim, i = idx % kHeadDim;
      const float* c = coef + t * r;
      float acc = 0.0f;
      if (side == 0) {
        const float* row = basis + i * r;  // row i of P_q
        for (int j = 0; j < r; ++j) acc = fmaf(__ldg(row + j), c[j], acc);
      } else {
        for (int j = 0; j < r; ++j) acc = fmaf(__ldg(basis + j * kHeadDim + i), c[j], acc);
      }
      out[idx] = __float2half_rn(acc);
    }
    __syncthreads();  // coef is reused by the value side
  }
}

}  // namespace

cudaError_t LaunchExpandBlocks(const ExpandBlocksParams& p, cudaStream_t stream) {
  if (KvPoolLayoutError(p.layout) != nullptr || p.n_blocks < 0) return cudaErrorInvalidValue;
  if (p.n_blocks == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.n_blocks), static_cast<unsigned>(p.layout.n_kv_heads));
  const size_t smem = static_cast<size_t>(SharedBytes(p.layout));
  SUBSPACE_DISPATCH_HEAD_DIM(
      p.layout.head_dim, kHeadDim, {SUBSPACE_DISPATCH_CODE_TYPE(p.layout.coeff_dtype, CodeT, {
        ExpandBlocksKernel<kHeadDim, CodeT><<<grid, kThreads, smem, stream>>>(p);
      })})
  return cudaGetLastError();
}

}  // namespace subspace::kernels
