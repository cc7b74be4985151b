// Causal prefill attention over full-rank fp16 pages, flash-attention style on CUDA cores.
//
// One CTA per (row tile, sequence, KV head). The rows of a (sequence, KV head) are its query
// rows times the group's query heads, row R = query (R / group), head (R % group), so one CTA
// holds all query heads that share a KV head and reads every K/V tile once for them (GQA); any
// group size works, also one larger than a tile. A CTA stages its 64 rows of q (fp32, scaled by
// sm_scale * log2 e so the softmax runs on exp2f) in shared memory, then streams the sequence's
// keys in tiles of 64 positions, gathered row by row through the block table (any block size),
// only up to its last row's position (causal skipping) and, with a sliding window, from the
// first position its first row's window holds. Scores and the online softmax stay in
// registers: a thread owns 4 rows x 8 keys of S and the same 4 rows x head_dim / 8 columns of
// the output, and the 8 threads of a row group are 8 consecutive lanes of one warp, so row max
// and sum are warp shuffles and P goes through shared memory within the warp only.
//
// Correct first: no cp.async double buffering, no tensor cores; a CTA needs 51 KiB (d = 64) or
// 83 KiB (d = 128) of shared memory, opted in. Tuning needs a GPU.
#include <cmath>

#include "kernels/cuda_util.cuh"
#include "kernels/prefill_attention.h"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kRows = 64;                          // query rows (query x group head) per tile
constexpr int kKeys = 64;                          // key positions per KV tile
constexpr int kRowsPerThread = 4;                  // a row group: 4 rows
constexpr int kKeyLanes = 8;                       // threads per row group, consecutive lanes
constexpr int kKeysPerThread = kKeys / kKeyLanes;  // keys kg, kg + 8, ..., interleaved
static_assert(kThreads == kRows / kRowsPerThread * kKeyLanes);
static_assert(device::kWarpSize % kKeyLanes == 0);

// Shared-memory strides. Rows of K and V are padded by 16 bytes so the 8 keys a warp reads at
// once (rows kg + 8j) fall on distinct banks; P rows by 4 floats (float4 reads stay aligned).
// q needs no pad: the 8 lanes reading a q row together read the same address (broadcast).
template <int kHeadDim>
struct Smem {
  static constexpr int kKvStride = kHeadDim + 8;         // halves
  static constexpr int kPStride = kKeys + 4;             // floats
  static constexpr int kQ = 0;                           // [kRows, d] float
  static constexpr int kK = kQ + kRows * kHeadDim * 4;   // [kKeys, kKvStride] half
  static constexpr int kV = kK + kKeys * kKvStride * 2;  // [kKeys, kKvStride] half
  static constexpr int kP = kV + kKeys * kKvStride * 2;  // [kRows, kPStride] float
  static constexpr int kBytes = kP + kRows * kPStride * 4;
  static_assert(kK % 16 == 0 && kV % 16 == 0 && kP % 16 == 0 && kKvStride * 2 % 16 == 0);
};

// 8 fp16 (one uint4) to floats.
__device__ __forceinline__ void HalvesToFloats(const uint4& raw, float* out) {
  const auto* h2 = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __half22float2(h2[e]);
    out[2 * e] = f.x;
    out[2 * e + 1] = f.y;
  }
}

// Max and sum over the 8 lanes of a row group (lanes 8k..8k+7: xor 1, 2, 4 stays inside).
__device__ __forceinline__ float GroupMax(float x) {
#pragma unroll
  for (int off = kKeyLanes / 2; off > 0; off /= 2)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float GroupSum(float x) {
#pragma unroll
  for (int off = kKeyLanes / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    PrefillAttentionKernel(const __grid_constant__ PrefillAttentionParams p) {
  using S = Smem<kHeadDim>;
  constexpr int kChunks = kHeadDim * 2 / 16;  // uint4 chunks of one fp16 row
  constexpr int kColChunks = kHeadDim / 64;   // a thread's 8-column chunks of the output
  constexpr float kNegInf = -INFINITY;
  constexpr float kLog2e = 1.4426950408889634f;
  const KvPoolLayout& l = p.layout;
  const int s = blockIdx.y, h = blockIdx.z;
  const int group = p.n_heads / l.n_kv_heads, bs = l.block_size;
  const int32_t q_begin = p.seq_q_indptr[s];
  const int32_t n_q = p.seq_q_indptr[s + 1] - q_begin;
  const int32_t start = p.seq_q_start[s];
  const int64_t rows_total = static_cast<int64_t>(n_q) * group;  // 0 (or less): nothing to do
  const int32_t* table = p.block_table + static_cast<int64_t>(s) * p.max_blocks;  // [max_blocks]

  extern __shared__ __align__(16) uint8_t smem[];
  auto* q_s = reinterpret_cast<float*>(smem + S::kQ);
  auto* k_s = reinterpret_cast<__half*>(smem + S::kK);
  auto* v_s = reinterpret_cast<__half*>(smem + S::kV);
  auto* p_s = reinterpret_cast<float*>(smem + S::kP);

  const int tid = threadIdx.x;
  const int rg = tid / kKeyLanes, kg = tid % kKeyLanes;  // row group, lane in it
  const float q_scale = p.sm_scale * kLog2e;

  // Row tiles of this (sequence, KV head), grid-stride: the grid's x extent (max_q_per_seq)
  // sizes the launch but cannot drop rows. The loop condition is uniform over the CTA, so every
  // barrier below is reached by all threads.
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows; row0 < rows_total;
       row0 += static_cast<int64_t>(gridDim.x) * kRows) {
    const int n_rows = static_cast<int>(rows_total - row0 < kRows ? rows_total - row0 : kRows);
    // Rows are in position order, so the tile's last row has its largest position.
    const int32_t last_pos = start + static_cast<int32_t>((row0 + n_rows - 1) / group);
    const int32_t kv_len = last_pos + 1;

    // Positions of this thread's rows; rows past n_rows take last_pos (finite, never written).
    // A row attends keys (row_lo, row_pos]: row_lo is -1 without a window.
    int32_t row_pos[kRowsPerThread], row_lo[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = rg * kRowsPerThread + i;
      row_pos[i] = r < n_rows ? start + static_cast<int32_t>((row0 + r) / group) : last_pos;
      row_lo[i] = p.window > 0 ? row_pos[i] - p.window : -1;
    }
    // The tile's first row has its smallest position: keys before its window are masked for
    // every row, so the KV loop starts at the tile of keys that holds the window's first one.
    const int32_t first_pos = start + static_cast<int32_t>(row0 / group);
    const int32_t kv_lo =
        p.window > 0 && first_pos - p.window + 1 > 0 ? first_pos - p.window + 1 : 0;

    __syncthreads();  // the previous row tile's last KV tile is done with q_s
    for (int idx = tid; idx < kRows * (kHeadDim / 4); idx += kThreads) {
      const int r = idx / (kHeadDim / 4), c = idx % (kHeadDim / 4);
      float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (r < n_rows) {
        const int64_t rr = row0 + r;
        const int64_t qrow = q_begin + rr / group,
                      hq = static_cast<int64_t>(h) * group + rr % group;
        x = __ldg(reinterpret_cast<const float4*>(p.q + (qrow * p.n_heads + hq) * kHeadDim) + c);
        x.x *= q_scale;
        x.y *= q_scale;
        x.z *= q_scale;
        x.w *= q_scale;
      }
      reinterpret_cast<float4*>(q_s + r * kHeadDim)[c] = x;
    }

    float run_max[kRowsPerThread], run_sum[kRowsPerThread];
    float acc[kRowsPerThread][kColChunks * 8];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      run_max[i] = kNegInf;
      run_sum[i] = 0.0f;
#pragma unroll
      for (int c = 0; c < kColChunks * 8; ++c) acc[i][c] = 0.0f;
    }

    for (int32_t kv0 = kv_lo - kv_lo % kKeys; kv0 < kv_len; kv0 += kKeys) {
      __syncthreads();  // q_s written; the previous KV tile's K, V and P reads are done
      // K and V rows of positions kv0.., each through its block's page. Positions past kv_len
      // (never valid for any row of the tile) become zeros: they are masked, and 0 * 0 keeps
      // uninitialised shared memory (possibly NaN bits) out of the sums.
      for (int idx = tid; idx < kKeys * kChunks; idx += kThreads) {
        const int r = idx / kChunks, c = idx % kChunks;
        const int32_t pos = kv0 + r;
        uint4 kx = make_uint4(0u, 0u, 0u, 0u), vx = kx;
        if (pos < kv_len) {
          // Entry e >= 0: pool page e; e < 0: scratch page -1 - e (two selects, no branch).
          const int32_t e = table[pos / bs];
          const uint8_t* base = e < 0 ? p.scratch : p.pool;
          const int32_t page = e < 0 ? -1 - e : e;
          const int64_t row = static_cast<int64_t>(pos % bs) * kHeadDim * 2;
          kx = __ldg(reinterpret_cast<const uint4*>(base + l.FullK(page, h) + row) + c);
          vx = __ldg(reinterpret_cast<const uint4*>(base + l.FullV(page, h) + row) + c);
        }
        reinterpret_cast<uint4*>(k_s + r * S::kKvStride)[c] = kx;
        reinterpret_cast<uint4*>(v_s + r * S::kKvStride)[c] = vx;
      }
      __syncthreads();

      // S = (q * scale * log2 e) k^T for rows rg*4 + i and keys kg + 8j, 4 dims at a time.
      float sc[kRowsPerThread][kKeysPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kKeysPerThread; ++j) sc[i][j] = 0.0f;
      }
#pragma unroll 4
      for (int d0 = 0; d0 < kHeadDim; d0 += 4) {
        float4 qv[kRowsPerThread];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          qv[i] = *reinterpret_cast<const float4*>(q_s + (rg * kRowsPerThread + i) * kHeadDim + d0);
        }
#pragma unroll
        for (int j = 0; j < kKeysPerThread; ++j) {
          const uint2 raw =
              *reinterpret_cast<const uint2*>(k_s + (kg + kKeyLanes * j) * S::kKvStride + d0);
          const float2 k01 = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
          const float2 k23 = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
            float a = sc[i][j];
            a = fmaf(qv[i].x, k01.x, a);
            a = fmaf(qv[i].y, k01.y, a);
            a = fmaf(qv[i].z, k23.x, a);
            a = fmaf(qv[i].w, k23.y, a);
            sc[i][j] = a;
          }
        }
      }

      // Causal and window mask, then the online softmax per row. A row may have seen no key
      // yet (its window starts in a later tile): m_new is -inf then, and its weights stay 0.
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        float tile_max = kNegInf;
#pragma unroll
        for (int j = 0; j < kKeysPerThread; ++j) {
          const int32_t pos = kv0 + kg + kKeyLanes * j;
          if (pos > row_pos[i] || pos <= row_lo[i]) sc[i][j] = kNegInf;
          tile_max = fmaxf(tile_max, sc[i][j]);
        }
        const float m_new = fmaxf(run_max[i], GroupMax(tile_max));
        const bool none = m_new == kNegInf;
        const float corr = none ? 1.0f : exp2f(run_max[i] - m_new);  // 0 on the first real tile
        float* p_row = p_s + (rg * kRowsPerThread + i) * S::kPStride;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kKeysPerThread; ++j) {
          const float e = none ? 0.0f : exp2f(sc[i][j] - m_new);  // masked: exp2f(-inf) = 0
          p_row[kg + kKeyLanes * j] = e;
          sum += e;
        }
        run_sum[i] = run_sum[i] * corr + GroupSum(sum);
        run_max[i] = m_new;
#pragma unroll
        for (int c = 0; c < kColChunks * 8; ++c) acc[i][c] *= corr;
      }
      __syncwarp();  // a row group's P is written and read by its own 8 lanes only

      // acc += P V over the tile's keys (those past kv_len have P = 0 and V = 0).
      const int n_keys = kv_len - kv0 < kKeys ? kv_len - kv0 : kKeys;
      for (int j0 = 0; j0 < n_keys; j0 += 4) {
        float4 pv[kRowsPerThread];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          pv[i] =
              *reinterpret_cast<const float4*>(p_s + (rg * kRowsPerThread + i) * S::kPStride + j0);
        }
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
          for (int cc = 0; cc < kColChunks; ++cc) {
            float v[8];
            HalvesToFloats(
                *reinterpret_cast<const uint4*>(v_s + (j0 + jj) * S::kKvStride + cc * 64 + kg * 8),
                v);
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i) {
              const float w = jj == 0 ? pv[i].x : jj == 1 ? pv[i].y : jj == 2 ? pv[i].z : pv[i].w;
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[i][cc * 8 + e] = fmaf(w, v[e], acc[i][cc * 8 + e]);
            }
          }
        }
      }
    }

    // out = acc / sum; columns cc*64 + kg*8 .. +8 of each of the thread's valid rows.
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int r = rg * kRowsPerThread + i;
      if (r >= n_rows) continue;
      const int64_t rr = row0 + r;
      const int64_t qrow = q_begin + rr / group, hq = static_cast<int64_t>(h) * group + rr % group;
      float* out = p.out + (qrow * p.n_heads + hq) * kHeadDim;  // [d]
      const float inv = 1.0f / run_sum[i];
#pragma unroll
      for (int cc = 0; cc < kColChunks; ++cc) {
        auto* dst = reinterpret_cast<float4*>(out + cc * 64 + kg * 8);
        dst[0] = make_float4(acc[i][cc * 8] * inv, acc[i][cc * 8 + 1] * inv,
                             acc[i][cc * 8 + 2] * inv, acc[i][cc * 8 + 3] * inv);
        dst[1] = make_float4(acc[i][cc * 8 + 4] * inv, acc[i][cc * 8 + 5] * inv,
                             acc[i][cc * 8 + 6] * inv, acc[i][cc * 8 + 7] * inv);
      }
    }
  }
}

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// What the kernel can address. Full pages only, so the layout's ranks and slots are not looked
// at (KvPoolLayoutError would judge those); a page must hold [2][n_kv][B][d] fp16. The grid
// takes sequences on y (at most 65535) and KV heads on z (at most 65535).
bool ParamsOk(const PrefillAttentionParams& p) {
  const KvPoolLayout& l = p.layout;
  if (l.n_kv_heads <= 0 || l.n_kv_heads > 65535) return false;
  if (l.head_dim != 64 && l.head_dim != 128) return false;
  if (l.block_size < 1 || l.block_size > kMaxBlockSize) return false;
  if (l.page_bytes < 4 * static_cast<int64_t>(l.n_kv_heads) * l.block_size * l.head_dim ||
      l.page_bytes % 16 != 0) {
    return false;
  }
  if (p.n_heads <= 0 || p.n_heads % l.n_kv_heads != 0 || p.window < 0) return false;
  if (p.num_seqs < 1 || p.num_seqs > 65535 || p.max_q_per_seq < 1 || p.max_blocks < 1) return false;
  if (p.pool == nullptr || p.block_table == nullptr || p.seq_q_indptr == nullptr ||
      p.seq_q_start == nullptr || p.q == nullptr || p.out == nullptr) {
    return false;
  }
  // uint4 / float4 accesses: rows are multiples of 16 bytes from these bases (scratch may be
  // null: no negative table entries then).
  return Aligned16(p.pool) && Aligned16(p.scratch) && Aligned16(p.q) && Aligned16(p.out);
}

}  // namespace

cudaError_t LaunchPrefillAttention(const PrefillAttentionParams& p, cudaStream_t stream) {
  if (!ParamsOk(p)) return cudaErrorInvalidValue;
  const int group = p.n_heads / p.layout.n_kv_heads;
  const int64_t tiles = (static_cast<int64_t>(p.max_q_per_seq) * group + kRows - 1) / kRows;
  // The kernel loops over row tiles, so capping x only serialises, never drops rows.
  const dim3 grid(static_cast<unsigned>(tiles < (1 << 30) ? tiles : (1 << 30)),
                  static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.layout.n_kv_heads));
  int device = 0, optin = 0;
  cudaError_t err = CurrentDeviceSharedMemoryOptin(&device, &optin);
  if (err != cudaSuccess) return err;
  SUBSPACE_DISPATCH_HEAD_DIM(p.layout.head_dim, kHeadDim, {
    constexpr int kSmem = Smem<kHeadDim>::kBytes;
    if (kSmem > optin) return cudaErrorInvalidValue;
    auto* kernel = PrefillAttentionKernel<kHeadDim>;
    static std::atomic<uint64_t> attribute_set{0};  // per head_dim instance
    err = SetMaxDynamicSharedMemoryOnce(kernel, kSmem, device, attribute_set);
    if (err != cudaSuccess) return err;
    kernel<<<grid, kThreads, kSmem, stream>>>(p);
  })
  return cudaGetLastError();
}

}  // namespace subspace::kernels
