// RecodeBlocksKernel: one CTA per (block, KV head). Keys then values: the head's B rows of codes
// are decoded to float in shared memory as DecodeCoeffs does (expand_blocks.cu), the rows queries
// see are rebuilt in float (k^ = P_q[from] c, v^ = R_v[from]^T u), projected on the new epoch's
// basis (compress_blocks.cu's loop, on float rows) and encoded as EncodeCoeffs does, into the
// slot they came from -- so results differ from the twin only where float and double sums round
// apart, and never by an fp16 rounding of the rebuilt rows (the expand-then-compress path's).
#include <atomic>

#include "kernels/cuda_util.cuh"
#include "kernels/recode_blocks.h"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 128;

// Shared memory: coefficients [B, max(r_k, r_v)] float, then rebuilt rows [B, head_dim] float.
// At most 64 x 128 x 4 x 2 = 64 KiB: past the default 48 KiB, hence the opt-in.
constexpr int kMaxSharedBytes = 64 * 128 * 4 * 2;
int64_t SharedBytes(const KvPoolLayout& l) {
  const int r = l.rank_k > l.rank_v ? l.rank_k : l.rank_v;
  return static_cast<int64_t>(l.block_size) * (r + l.head_dim) * 4;
}

template <int kHeadDim, typename CodeT>
__global__ void __launch_bounds__(kThreads)
    RecodeBlocksKernel(const __grid_constant__ RecodeBlocksParams p) {
  const KvPoolLayout& l = p.layout;
  const int blk = blockIdx.x, h = blockIdx.y;
  const int bs = l.block_size;
  const int r_max = l.rank_k > l.rank_v ? l.rank_k : l.rank_v;
  extern __shared__ __align__(16) uint8_t smem[];
  auto* coef = reinterpret_cast<float*>(smem);  // [B, r]
  float* rows = coef + bs * r_max;              // [B, d]

  uint8_t* slot = p.pool + l.Slot(p.page[blk], p.slot[blk]);
  const int64_t from = p.from_epoch[static_cast<int64_t>(blk) * l.n_kv_heads + h];
  const int64_t to = p.to_epoch[static_cast<int64_t>(blk) * l.n_kv_heads + h];

  for (int side = 0; side < 2; ++side) {
    const int r = side == 0 ? l.rank_k : l.rank_v;
    uint8_t* codes = slot + (side == 0 ? l.KCodes(h) : l.VCodes(h));  // [B, r]
    auto* scales = reinterpret_cast<__half*>(slot + (side == 0 ? l.KScales(h) : l.VScales(h)));
    // Decode (expand_blocks.cu).
    if constexpr (sizeof(CodeT) == 2) {
      const auto* in = reinterpret_cast<const __half*>(codes);
      for (int idx = threadIdx.x; idx < bs * r; idx += kThreads)
        coef[idx] = device::CodeToFloat(in[idx]);
    } else {
      const auto* in = reinterpret_cast<const int8_t*>(codes);
#pragma unroll 1  // as in expand_blocks.cu: the per-element division spills when unrolled
      for (int idx = threadIdx.x; idx < bs * r; idx += kThreads)
        coef[idx] = __half2float(scales[idx / r]) * device::CodeToFloat(in[idx]);
    }
    __syncthreads();
    // rows[t, i] = sum_j old(i, j) coef[t, j]: P_q[from] rows for keys, R_v[from] columns for
    // values.
    const float* old_basis = (side == 0 ? p.basis_pq : p.basis_rv) +
                             (from * l.n_kv_heads + h) * kHeadDim * r;  // [d, r_k] or [r_v, d]
    for (int idx = threadIdx.x; idx < bs * kHeadDim; idx += kThreads) {
      const int t = idx / kHeadDim, i = idx % kHeadDim;
      const float* c = coef + t * r;
      float acc = 0.0f;
      if (side == 0) {
        const float* row = old_basis + i * r;
        for (int j = 0; j < r; ++j) acc = fmaf(__ldg(row + j), c[j], acc);
      } else {
        for (int j = 0; j < r; ++j) acc = fmaf(__ldg(old_basis + j * kHeadDim + i), c[j], acc);
      }
      rows[idx] = acc;
    }
    __syncthreads();
    // coef[t, j] = sum_i rows[t, i] new(i, j) (compress_blocks.cu, on float rows).
    const float* new_basis =
        (side == 0 ? p.basis_pk : p.basis_pv) + (to * l.n_kv_heads + h) * kHeadDim * r;  // [d, r]
    for (int idx = threadIdx.x; idx < bs * r; idx += kThreads) {
      const int t = idx / r, j = idx % r;
      const float* x = rows + t * kHeadDim;
      float acc = 0.0f;
#pragma unroll 8
      for (int i = 0; i < kHeadDim; ++i) acc = fmaf(x[i], __ldg(new_basis + i * r + j), acc);
      coef[idx] = acc;
    }
    __syncthreads();
    device::EncodeCoeffRows<CodeT>(coef, bs, r, codes, scales);
    __syncthreads();  // coef and rows are reused by the value side
  }
}

}  // namespace

cudaError_t LaunchRecodeBlocks(const RecodeBlocksParams& p, cudaStream_t stream) {
  if (KvPoolLayoutError(p.layout) != nullptr || p.n_blocks < 0) return cudaErrorInvalidValue;
  if (p.n_blocks == 0) return cudaSuccess;
  const int64_t smem = SharedBytes(p.layout);
  int device = 0, optin = 0;
  cudaError_t err = CurrentDeviceSharedMemoryOptin(&device, &optin);
  if (err != cudaSuccess) return err;
  if (smem > optin) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.n_blocks), static_cast<unsigned>(p.layout.n_kv_heads));
  SUBSPACE_DISPATCH_HEAD_DIM(
      p.layout.head_dim, kHeadDim, {SUBSPACE_DISPATCH_CODE_TYPE(p.layout.coeff_dtype, CodeT, {
        auto* kernel = RecodeBlocksKernel<kHeadDim, CodeT>;
        static std::atomic<uint64_t> attribute_set{0};  // per instance
        err = SetMaxDynamicSharedMemoryOnce(
            kernel, optin < kMaxSharedBytes ? optin : kMaxSharedBytes, device, attribute_set);
        if (err != cudaSuccess) return err;
        kernel<<<grid, kThreads, static_cast<size_t>(smem), stream>>>(p);
      })})
  return cudaGetLastError();
}

}  // namespace subspace::kernels
