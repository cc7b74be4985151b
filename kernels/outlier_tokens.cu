// OutlierTokensKernel: one CTA per block. The block's outlier tokens are first listed in
// shared memory (k-th set bit -> token), then the CTA copies every (outlier, side, head) row as
// 16-byte chunks, consecutive threads on consecutive chunks of one row and consecutive rows on
// consecutive outliers, so both the block page's and the outlier page's accesses coalesce.
// A plain copy: the result is the twin's byte for byte.
#include "kernels/cuda_util.cuh"
#include "kernels/outlier_tokens.h"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kChunkBytes = 16;  // one uint4

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    OutlierTokensKernel(const __grid_constant__ OutlierTokensParams p) {
  constexpr int kChunks = kHeadDim * 2 / kChunkBytes;  // per fp16 row: 8 or 16
  const KvPoolLayout& l = p.layout;
  const int blk = blockIdx.x;
  const int bs = l.block_size;
  __shared__ int8_t token[kMaxBlockSize];  // [popcount(mask)] token of the k-th outlier

  // Bits past B would address rows outside the page: CheckOutlierBatch rejects them; drop them
  // here too rather than write out of bounds.
  const uint64_t mask = p.mask[blk] & (bs == 64 ? ~uint64_t{0} : (uint64_t{1} << bs) - 1);
  const int n = __popcll(mask);
  if (n == 0) return;  // uniform across the CTA: no barrier is skipped by some threads only
  if (static_cast<int>(threadIdx.x) < bs && ((mask >> threadIdx.x) & 1u)) {
    const uint64_t below = mask & ((uint64_t{1} << threadIdx.x) - 1);
    token[__popcll(below)] = static_cast<int8_t>(threadIdx.x);
  }
  __syncthreads();

  const int32_t block_page = p.block_page[blk];
  const int32_t first = p.first_slot[blk];
  const int32_t page0 = p.outlier_page[2 * static_cast<int64_t>(blk)];
  // The second page only when the outliers run past the first (else it may be anything).
  const int32_t page1 = first + n > bs ? p.outlier_page[2 * static_cast<int64_t>(blk) + 1] : -1;
  const bool to_outliers = p.direction == OutlierMove::kToOutlierPages;
  const int rows_per_side = n * l.n_kv_heads;
  const int total = 2 * rows_per_side * kChunks;
  for (int idx = threadIdx.x; idx < total; idx += kThreads) {
    const int chunk = idx % kChunks;
    const int row = idx / kChunks;  // (side, head, k), k fastest
    const int k = row % n;
    const int h = row / n % l.n_kv_heads;
    const bool keys = row < rows_per_side;
    const int t = token[k];
    const int s = first + k;  // the outlier's slot, counted across its two pages
    const int32_t opage = s < bs ? page0 : page1;
    const int oslot = s < bs ? s : s - bs;
    const int64_t block_at = (keys ? l.FullK(block_page, h) : l.FullV(block_page, h)) +
                             static_cast<int64_t>(t) * kHeadDim * 2 + chunk * kChunkBytes;
    const int64_t outlier_at = (keys ? l.FullK(opage, h) : l.FullV(opage, h)) +
                               static_cast<int64_t>(oslot) * kHeadDim * 2 + chunk * kChunkBytes;
    // Plain loads, not __ldg: with one pool the batch writes the same buffer it reads (other
    // rows, CheckOutlierBatch guarantees), which the read-only path does not allow.
    const uint8_t* src = to_outliers ? p.block_pool + block_at : p.outlier_pool + outlier_at;
    uint8_t* dst = to_outliers ? p.outlier_pool + outlier_at : p.block_pool + block_at;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  }
}

bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

cudaError_t LaunchOutlierTokens(const OutlierTokensParams& p, cudaStream_t stream) {
  if (KvPoolLayoutError(p.layout) != nullptr || p.n_blocks < 0) return cudaErrorInvalidValue;
  // uint4 copies: rows are 16-byte multiples, the pools must start on 16-byte boundaries
  // (cudaMalloc's do) or a misaligned access would poison the whole context.
  if (!Aligned16(p.block_pool) || !Aligned16(p.outlier_pool)) return cudaErrorInvalidValue;
  if (p.direction != OutlierMove::kToOutlierPages && p.direction != OutlierMove::kToBlockPages) {
    return cudaErrorInvalidValue;
  }
  if (p.n_blocks == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.n_blocks));
  SUBSPACE_DISPATCH_HEAD_DIM(p.layout.head_dim, kHeadDim,
                             { OutlierTokensKernel<kHeadDim><<<grid, kThreads, 0, stream>>>(p); })
  return cudaGetLastError();
}

}  // namespace subspace::kernels
