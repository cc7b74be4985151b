// CompressBlocksKernel: one CTA per (block, KV head). Keys then values: the head's B fp16 rows
// go to shared memory, each thread projects (token, coefficient) pairs onto the basis columns
// (coalesced across coefficients), then the row is encoded as EncodeCoeffs does — fp16 round
// to nearest even, or int8 with amax / 127 rounded to an fp16 scale, codes = clamp(rint(x / s))
// — so results differ from the twin only where float and double projections round apart.
// With outlier masks, the key side also tests each token's residual |k - P_q c|^2 against
// thr^2 |k|^2 from the same fp32 coefficients, one warp per token (KeyOutlierBits).
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

// Bit t set when token t's key residual |k - P_q c|^2 exceeds thr2 |k|^2 (CompressedKvCache::
// CompressBlock's test), for the tokens of warp `warp`; the lanes of one warp cover the
// head_dim rows of k^ = P_q c. pq: [d, r] row-major, rows [B, d] fp16 and coef [B, r] float in
// shared memory. P_q's rows are strided by r across the lanes, but the head's basis (at most
// 64 KiB) stays in L1 across the B tokens. With r % 4 == 0 (P_q's rows and the coefficient
// rows then start on 16-byte boundaries) a lane reads 16 contiguous bytes per load.
template <int kHeadDim>
__device__ __forceinline__ uint64_t KeyOutlierBits(const float* __restrict__ pq, int r,
                                                   const __half* rows, const float* coef, int bs,
                                                   float thr2, int warp, int lane) {
  constexpr int kRowsPerLane = kHeadDim / device::kWarpSize;
  const bool vec4 = r % 4 == 0 && (reinterpret_cast<uintptr_t>(pq) & 15u) == 0;
  uint64_t found = 0;
  for (int t = warp; t < bs; t += kWarps) {
    const float* c = coef + t * r;
    float err = 0.0f, norm = 0.0f;
#pragma unroll
    for (int n = 0; n < kRowsPerLane; ++n) {
      const int i = lane + n * device::kWarpSize;
      const float* row = pq + i * r;  // row i of P_q
      float acc = 0.0f;
      if (vec4) {
#pragma unroll 2
        for (int j = 0; j < r; j += 4) {
          const float4 b = __ldg(reinterpret_cast<const float4*>(row + j));
          const float4 x = *reinterpret_cast<const float4*>(c + j);  // warp broadcast
          acc = fmaf(b.x, x.x, acc);
          acc = fmaf(b.y, x.y, acc);
          acc = fmaf(b.z, x.z, acc);
          acc = fmaf(b.w, x.w, acc);
        }
      } else {
#pragma unroll 4
        for (int j = 0; j < r; ++j) acc = fmaf(__ldg(row + j), c[j], acc);
      }
      const float k = __half2float(rows[t * kHeadDim + i]);
      const float diff = k - acc;
      err = fmaf(diff, diff, err);
      norm = fmaf(k, k, norm);
    }
    err = device::WarpSum(err);
    norm = device::WarpSum(norm);
    if (err > thr2 * norm) found |= uint64_t{1} << t;  // same sums on every lane
  }
  return found;
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
    device::EncodeCoeffRows<CodeT>(
        coef, bs, r, p.pool + slot + (side == 0 ? l.KCodes(h) : l.VCodes(h)),
        reinterpret_cast<__half*>(p.pool + slot + (side == 0 ? l.KScales(h) : l.VScales(h))));
    // Encoding only read rows and coef: no barrier before the residual test reads them too.
    if (side == 0 && p.outlier_masks != nullptr) {
      const float* pq = p.basis_pq + (epoch * l.n_kv_heads + h) * kHeadDim * r;  // [d, r_k]
      const uint64_t found = KeyOutlierBits<kHeadDim>(
          pq, r, rows, coef, bs, p.outlier_threshold * p.outlier_threshold, warp, lane);
      // One atomic per warp that found any: heads and layers share the block's mask.
      if (lane == 0 && found != 0) {
        atomicOr(reinterpret_cast<unsigned long long*>(p.outlier_masks + blk),
                 static_cast<unsigned long long>(found));
      }
    }
    __syncthreads();  // rows and coef are reused by the value side
  }
}

}  // namespace

cudaError_t LaunchCompressBlocks(const CompressBlocksParams& p, cudaStream_t stream) {
  if (KvPoolLayoutError(p.layout) != nullptr || p.n_blocks < 0) return cudaErrorInvalidValue;
  if (p.outlier_masks != nullptr && p.basis_pq == nullptr) return cudaErrorInvalidValue;
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
