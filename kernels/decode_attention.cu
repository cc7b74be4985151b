// Split-K decode attention over mixed blocks, and the merge of its partials.
//
// DecodeSplitKernel, one CTA per (work item, KV head), all `group` query heads of that KV head
// together so each block is read once per KV head: the group's queries and their projections
// q~_e = P_q[e]^T q (every live epoch of the sequence) sit in shared memory; per block, the
// head's rows (fp16 full rows or coefficient codes) are staged in shared memory, scores are
// computed (a warp per token for full rows, a thread per (query, token) for coefficients),
// the running max / sum are updated a warp per query, and the values accumulate in d-space for
// full rows and in each epoch's coefficient space for compressed ones. The partial row keeps
// both. DecodeMergeKernel, one CTA per (sequence, query head), rescales the partials to the
// common max, sums them, and expands each epoch's coefficients once with R_v[e]^T.
//
// The transform cache's coded blocks are read in code space as well: a block's coefficients
// (offset + code * step) are widened into shared memory, keys scored against the query's
// projections on the key components (q / scale) . u_a plus (q / scale) . e, values summed per
// component with their weights, and expanded once by the merge (e * weight + sum_a U_a u_a,
// unweighted). Keys coded before RoPE are decoded into fp16 rows instead (a rotation per
// position does not commute with the basis).
//
// Correct first: no cp.async pipelining, no tensor cores, fp32 bases. The numbers to beat
// are in docs/design.md ("Performance model"); tuning needs a GPU.
#include <cmath>

#include "kernels/cuda_util.cuh"
#include "kernels/decode_attention.h"
#include "kernels/transform_rows.cuh"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / device::kWarpSize;

// Shared memory of a split CTA: floats first, then the two 16-byte aligned row tiles.
struct SplitSmem {
  // int offsets: a CTA's shared memory is far below 2^31 bytes, and 64-bit ones cost registers.
  int q, q_coef, acc, u, prob, run_max, run_sum, corr, k_scale, v_scale, coef;  // floats
  int k_tile, v_tile, bytes;                                                    // byte offsets

  // transform: the transform cache's code space. q_coef is [G, d] key projections q~ then [G]
  // constants q . e; u is [G, d] value coefficient sums then [G] coded weights; coef holds a
  // coded block's coefficients ([B, active <= d] floats).
  __host__ __device__ SplitSmem(int group, int max_epochs, int head_dim, int rank_k, int rank_v,
                                int block_size, bool transform) {
    const int qk = transform ? group * (head_dim + 1) : group * max_epochs * rank_k;
    const int uv = transform ? group * (head_dim + 1) : group * max_epochs * rank_v;
    q = 0;                                // [G, d]
    q_coef = q + group * head_dim;        // [G, E, r_k]
    acc = q_coef + qk;                    // [G, d]
    u = acc + group * head_dim;           // [G, E, r_v]
    prob = u + uv;                        // [G, B]
    run_max = prob + group * block_size;  // [G]
    run_sum = run_max + group;            // [G]
    corr = run_sum + group;               // [G]
    k_scale = corr + group;               // [B]
    v_scale = k_scale + block_size;       // [B]
    coef = v_scale + block_size;          // [B, active] (transform)
    const int floats = coef + (transform ? block_size * head_dim : 0);
    k_tile = (floats * 4 + 15) / 16 * 16;         // [B, d] fp16 rows, or [B, r_k] codes
    v_tile = k_tile + block_size * head_dim * 2;  // [B, d] fp16 rows, or [B, r_v] codes
    bytes = v_tile + block_size * head_dim * 2;
  }
};

template <int kHeadDim, typename CodeT>
__global__ void __launch_bounds__(kThreads)
    DecodeSplitKernel(const __grid_constant__ DecodeAttentionParams p) {
  constexpr bool kInt8 = sizeof(CodeT) == 1;
  constexpr float kNegInf = -INFINITY;
  const KvPoolLayout& l = p.layout;
  const DecodePlanView& plan = p.plan;
  const int w = blockIdx.x, h = blockIdx.y;
  const int n_kv = l.n_kv_heads, group = p.n_heads / n_kv;
  const int bs = l.block_size, rk = l.rank_k, rv = l.rank_v;
  const int s = plan.work_seq[w];
  const bool transform = p.transform.floats != nullptr;
  // Transform keys coded before RoPE are decoded into rows; otherwise read in code space.
  const bool key_rows = transform && p.key_rope.cos_sin != nullptr;
  const int n_ep = transform ? 0 : plan.SeqEpochs(s);
  const int32_t* epochs = plan.seq_epochs + plan.seq_epoch_indptr[s];  // [n_ep]
  const int tid = threadIdx.x, warp = tid / device::kWarpSize, lane = tid % device::kWarpSize;

  extern __shared__ __align__(16) uint8_t smem[];
  const SplitSmem at(group, plan.max_seq_epochs, kHeadDim, rk, rv, bs, transform);
  float* f = reinterpret_cast<float*>(smem);
  float* q_s = f + at.q;
  float* q_coef = f + at.q_coef;  // [G, n_ep, r_k] (stride n_ep <= max_seq_epochs)
  float* acc = f + at.acc;
  float* u = f + at.u;  // [G, n_ep, r_v]
  float* prob = f + at.prob;
  float* run_max = f + at.run_max;
  float* run_sum = f + at.run_sum;
  float* corr = f + at.corr;
  float* k_scale = f + at.k_scale;
  float* v_scale = f + at.v_scale;
  uint8_t* k_tile = smem + at.k_tile;
  uint8_t* v_tile = smem + at.v_tile;

  const float* q = p.q + (static_cast<int64_t>(s) * p.n_heads + h * group) * kHeadDim;  // [G, d]
  for (int i = tid; i < group * kHeadDim; i += kThreads) {
    q_s[i] = q[i];
    acc[i] = 0.0f;
  }
  const int u_row = transform ? kHeadDim : n_ep * rv;  // u's floats per query head
  for (int i = tid; i < group * (transform ? kHeadDim + 1 : u_row); i += kThreads) u[i] = 0.0f;
  for (int g = tid; g < group; g += kThreads) {
    run_max[g] = kNegInf;
    run_sum[g] = 0.0f;
  }
  __syncthreads();
  // q~[g, e, j] = sum_i q[g, i] P_q[e][i, j]; j fastest, so a warp reads P_q rows coalesced.
  for (int idx = tid; idx < group * n_ep * rk; idx += kThreads) {
    const int j = idx % rk, e = idx / rk % n_ep, g = idx / (rk * n_ep);
    const float* pq = p.basis_pq + (static_cast<int64_t>(epochs[e]) * n_kv + h) * kHeadDim * rk;
    const float* qg = q_s + g * kHeadDim;
    float a = 0.0f;
#pragma unroll 8
    for (int i = 0; i < kHeadDim; ++i) a = fmaf(qg[i], __ldg(pq + i * rk + j), a);
    q_coef[idx] = a;
  }
  // Transform keys in code space, record h of the keys: q~[g, a] = (q_g / scale) . u_a for the
  // active components, then the constant (q_g / scale) . e at q_coef[G d + g].
  // (Null without the transform cache: no offset is applied to a null pointer.)
  const int64_t key_rec = h, val_rec = static_cast<int64_t>(n_kv) + h;
  const float* key_f =
      transform ? p.transform.floats + key_rec * TransformFloats(kHeadDim) : nullptr;
  const int32_t* key_n = transform ? p.transform.ints + key_rec * TransformInts(kHeadDim) : nullptr;
  const float* val_f =
      transform ? p.transform.floats + val_rec * TransformFloats(kHeadDim) : nullptr;
  const int32_t* val_n = transform ? p.transform.ints + val_rec * TransformInts(kHeadDim) : nullptr;
  if (transform && !key_rows) {
    const int active = key_n[TransformField::kActive];
    for (int idx = tid; idx < group * (active + 1); idx += kThreads) {
      const int g = idx / (active + 1), a = idx % (active + 1);
      const float* vec = a < active ? key_f + TransformField::kBasis * kHeadDim + a * kHeadDim
                                    : key_f + TransformField::kExt * kHeadDim;
      const float* inv = key_f + TransformField::kInvScale * kHeadDim;
      const float* qg = q_s + g * kHeadDim;
      float x = 0.0f;
      for (int i = 0; i < kHeadDim; ++i) x = fmaf(qg[i] * inv[i], __ldg(vec + i), x);
      q_coef[a < active ? g * kHeadDim + a : group * kHeadDim + g] = x;
    }
  }
  __syncthreads();

  const int b_end = plan.work_block_end[w];
  for (int b = plan.work_block_begin[w]; b < b_end; ++b) {
    const int nb = plan.block_tokens[b];
    const int32_t page = plan.block_page[b];
    // Rows not attended here: outliers (read from their page) and rows before a sliding window.
    // A block with every row masked adds nothing; the branch is uniform over the CTA.
    const uint64_t masked = plan.block_masked[b];
    if (masked == (nb >= 64 ? ~uint64_t{0} : (uint64_t{1} << nb) - 1)) continue;
    // Kinds: a full page (rows); a transform-coded block (code space, or key rows decoded
    // before RoPE); a compressed block (an epoch's coefficient codes).
    const bool coded = plan.block_slot[b] != kFullBlock;
    const bool tc = coded && transform;
    const bool key_full = !coded || (tc && key_rows);  // keys scored as fp16 rows in k_tile
    const int e_blk =
        coded && !transform ? plan.block_epoch[static_cast<int64_t>(b) * n_kv + h] : -1;
    float* coef = f + at.coef;
    if (tc) {
      const uint8_t* slot = p.pool + l.Slot(page, plan.block_slot[b]);
      const uint8_t* run = slot + key_n[TransformField::kRunOffset];
      if (key_rows) {
        const int64_t first = static_cast<int64_t>(b - plan.seq_block_indptr[s]) * bs;
        device::DecodeTransformRun<kHeadDim, kThreads>(key_f, key_n, run, nb, true, p.key_rope,
                                                       first, coef,
                                                       reinterpret_cast<__half*>(k_tile));
      } else {
        device::TransformCoefficients<kHeadDim, kThreads>(key_f, key_n, run, nb, coef);
      }
    } else if (!coded) {
      device::CopyToShared(k_tile, p.pool + l.FullK(page, h),
                           static_cast<int64_t>(nb) * kHeadDim * 2);
      device::CopyToShared(v_tile, p.pool + l.FullV(page, h),
                           static_cast<int64_t>(nb) * kHeadDim * 2);
    } else {
      const uint8_t* slot = p.pool + l.Slot(page, plan.block_slot[b]);
      device::CopyToShared(k_tile, slot + l.KCodes(h),
                           static_cast<int64_t>(nb) * rk * sizeof(CodeT));
      device::CopyToShared(v_tile, slot + l.VCodes(h),
                           static_cast<int64_t>(nb) * rv * sizeof(CodeT));
      if constexpr (kInt8) {
        const auto* ks = reinterpret_cast<const __half*>(slot + l.KScales(h));  // [B]
        const auto* vs = reinterpret_cast<const __half*>(slot + l.VScales(h));  // [B]
        for (int t = tid; t < nb; t += kThreads) {
          k_scale[t] = __half2float(ks[t]);
          v_scale[t] = __half2float(vs[t]);
        }
      }
    }
    __syncthreads();

    // Scores prob[g, t], times 1/sqrt(d); -inf for masked rows.
    if (key_full) {
      const auto* kt = reinterpret_cast<const __half*>(k_tile);  // [nb, d]
      for (int t = warp; t < nb; t += kWarps) {
        float k_reg[kHeadDim / device::kWarpSize];
#pragma unroll
        for (int c = 0; c < kHeadDim / device::kWarpSize; ++c) {
          k_reg[c] = __half2float(kt[t * kHeadDim + c * device::kWarpSize + lane]);
        }
        for (int g = 0; g < group; ++g) {
          float part = 0.0f;
#pragma unroll
          for (int c = 0; c < kHeadDim / device::kWarpSize; ++c) {
            part = fmaf(q_s[g * kHeadDim + c * device::kWarpSize + lane], k_reg[c], part);
          }
          part = device::WarpSum(part);
          if (lane == 0) prob[g * bs + t] = (masked >> t) & 1u ? kNegInf : part * p.sm_scale;
        }
      }
    } else if (tc) {  // q . e + sum_a q~_a c_a
      const int active = key_n[TransformField::kActive];
      for (int idx = tid; idx < group * nb; idx += kThreads) {
        const int g = idx / nb, t = idx % nb;
        float score = kNegInf;
        if (!((masked >> t) & 1u)) {
          const float* qc = q_coef + g * kHeadDim;
          const float* c = coef + t * active;
          float a = q_coef[group * kHeadDim + g];
          for (int j = 0; j < active; ++j) a = fmaf(qc[j], c[j], a);
          score = a * p.sm_scale;
        }
        prob[g * bs + t] = score;
      }
    } else {
      const auto* kc = reinterpret_cast<const CodeT*>(k_tile);  // [nb, r_k]
      for (int idx = tid; idx < group * nb; idx += kThreads) {
        const int g = idx / nb, t = idx % nb;
        float score = kNegInf;
        if (!((masked >> t) & 1u)) {
          const float* qc = q_coef + (g * n_ep + e_blk) * rk;
          float a = 0.0f;
          for (int j = 0; j < rk; ++j) a = fmaf(qc[j], device::CodeToFloat(kc[t * rk + j]), a);
          if constexpr (kInt8) a *= k_scale[t];
          score = a * p.sm_scale;
        }
        prob[g * bs + t] = score;
      }
    }
    __syncthreads();

    // Online softmax, a warp per query head: new max, rescale factor, weights, running sum.
    for (int g = warp; g < group; g += kWarps) {
      float* pg = prob + g * bs;
      float block_max = kNegInf;
      for (int t = lane; t < nb; t += device::kWarpSize) block_max = fmaxf(block_max, pg[t]);
      block_max = device::WarpMax(block_max);
      const float m_old = run_max[g];
      const float m_new = fmaxf(m_old, block_max);
      float sum = 0.0f;
      for (int t = lane; t < nb; t += device::kWarpSize) {
        const float e = m_new == kNegInf ? 0.0f : expf(pg[t] - m_new);  // masked: exp(-inf) = 0
        pg[t] = e;
        sum += e;
      }
      sum = device::WarpSum(sum);
      // Every lane read run_max[g] above and lane 0 overwrites it: shuffles order registers, not
      // shared memory, so the warp syncs first (racecheck on an H200 reported the hazard).
      __syncwarp();
      if (lane == 0) {
        // Nothing seen yet: keep the zeros. Else exp(-inf) = 0 on the first real block.
        const float c = m_new == kNegInf ? 1.0f : expf(m_old - m_new);
        corr[g] = c;
        run_sum[g] = run_sum[g] * c + sum;
        run_max[g] = m_new;
      }
    }
    __syncthreads();

    // A transform-coded block's value coefficients, into coef (its keys' are no longer read).
    if (tc) {
      device::TransformCoefficients<kHeadDim, kThreads>(
          val_f, val_n,
          p.pool + l.Slot(page, plan.block_slot[b]) + val_n[TransformField::kRunOffset], nb, coef);
    }

    // Values: full rows into acc [G, d]; compressed codes into their epoch's u [G, n_ep, r_v];
    // transform coefficients into u [G, d] and their weight into u[G d + g]. Every accumulator
    // is rescaled to the new max, whatever the block's kind.
    for (int idx = tid; idx < group * kHeadDim; idx += kThreads) {
      const int g = idx / kHeadDim, d = idx % kHeadDim;
      float a = acc[idx] * corr[g];
      if (!coded) {
        const auto* vt = reinterpret_cast<const __half*>(v_tile);  // [nb, d]
        const float* pg = prob + g * bs;
        for (int t = 0; t < nb; ++t) a = fmaf(pg[t], __half2float(vt[t * kHeadDim + d]), a);
      }
      acc[idx] = a;
    }
    if (transform) {
      const int active = val_n[TransformField::kActive];
      for (int idx = tid; idx < group * (active + 1); idx += kThreads) {
        const int g = idx / (active + 1), j = idx % (active + 1);
        float* target = j < active ? u + g * kHeadDim + j : u + group * kHeadDim + g;
        float a = *target * corr[g];
        if (tc) {
          const float* pg = prob + g * bs;
          if (j < active) {
            for (int t = 0; t < nb; ++t) a = fmaf(pg[t], coef[t * active + j], a);
          } else {
            for (int t = 0; t < nb; ++t) a += pg[t];
          }
        }
        *target = a;
      }
    } else {
      for (int idx = tid; idx < group * n_ep * rv; idx += kThreads) {
        const int j = idx % rv, e = idx / rv % n_ep, g = idx / (rv * n_ep);
        float a = u[idx] * corr[g];
        if (e == e_blk) {
          const auto* vc = reinterpret_cast<const CodeT*>(v_tile);  // [nb, r_v]
          const float* pg = prob + g * bs;
          for (int t = 0; t < nb; ++t) {
            float wt = pg[t];
            if constexpr (kInt8) wt *= v_scale[t];
            a = fmaf(wt, device::CodeToFloat(vc[t * rv + j]), a);
          }
        }
        u[idx] = a;
      }
    }
    __syncthreads();  // the tiles and prob are overwritten by the next block
  }

  // Partial rows [max, sum, coded, -, acc[d], u] of the group's query heads.
  const int64_t stride = DecodePartialStride(plan, l, transform);
  float* rows = p.workspace + (static_cast<int64_t>(w) * p.n_heads + h * group) * stride;
  for (int g = tid; g < group; g += kThreads) {
    rows[g * stride] = run_max[g];
    rows[g * stride + 1] = run_sum[g];
    rows[g * stride + 2] = transform ? u[group * kHeadDim + g] : 0.0f;
  }
  for (int idx = tid; idx < group * kHeadDim; idx += kThreads) {
    rows[idx / kHeadDim * stride + 4 + idx % kHeadDim] = acc[idx];
  }
  for (int idx = tid; idx < group * u_row; idx += kThreads) {
    rows[idx / u_row * stride + 4 + kHeadDim + idx % u_row] = u[idx];
  }
}

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    DecodeMergeKernel(const __grid_constant__ DecodeAttentionParams p) {
  constexpr float kNegInf = -INFINITY;
  const KvPoolLayout& l = p.layout;
  const DecodePlanView& plan = p.plan;
  const int s = blockIdx.x, hq = blockIdx.y;
  const int n_kv = l.n_kv_heads, h = hq / (p.n_heads / n_kv), rv = l.rank_v;
  const bool transform = p.transform.floats != nullptr;
  const int n_ep = transform ? 0 : plan.SeqEpochs(s);
  const int32_t* epochs = plan.seq_epochs + plan.seq_epoch_indptr[s];
  const int w0 = plan.seq_work_indptr[s], w1 = plan.seq_work_indptr[s + 1];
  const int64_t stride = DecodePartialStride(plan, l, transform);
  const int u_row = transform ? kHeadDim : n_ep * rv;
  const auto row = [&](int w) {
    return p.workspace + (static_cast<int64_t>(w) * p.n_heads + hq) * stride;
  };
  extern __shared__ float u_sum[];  // [n_ep, r_v], or transform [d] then the coded weight

  float m = kNegInf;
  for (int w = w0; w < w1; ++w) m = fmaxf(m, row(w)[0]);
  // A work item whose tokens were all masked has max -inf and adds nothing.
  const auto weight = [&](int w) {
    const float mw = row(w)[0];
    return mw == kNegInf ? 0.0f : expf(mw - m);
  };
  float sum = 0.0f;
  for (int w = w0; w < w1; ++w) sum = fmaf(weight(w), row(w)[1], sum);
  for (int idx = threadIdx.x; idx < u_row; idx += kThreads) {
    float a = 0.0f;
    for (int w = w0; w < w1; ++w) a = fmaf(weight(w), row(w)[4 + kHeadDim + idx], a);
    u_sum[idx] = a;
  }
  if (transform && threadIdx.x == 0) {
    float a = 0.0f;
    for (int w = w0; w < w1; ++w) a = fmaf(weight(w), row(w)[2], a);
    u_sum[kHeadDim] = a;
  }
  __syncthreads();
  // The transform cache's values, record n_kv + h: o += (e * coded + sum_a U_a u_a) / scale.
  const int64_t val_rec = static_cast<int64_t>(n_kv) + h;
  const float* val_f =
      transform ? p.transform.floats + val_rec * TransformFloats(kHeadDim) : nullptr;
  const int active =
      transform ? p.transform.ints[val_rec * TransformInts(kHeadDim) + TransformField::kActive] : 0;
  for (int d = threadIdx.x; d < kHeadDim; d += kThreads) {
    float o = 0.0f;
    for (int w = w0; w < w1; ++w) o = fmaf(weight(w), row(w)[4 + d], o);
    if (transform) {
      float x = val_f[TransformField::kExt * kHeadDim + d] * u_sum[kHeadDim];
      const float* basis = val_f + TransformField::kBasis * kHeadDim + d;
      for (int a = 0; a < active; ++a) x = fmaf(u_sum[a], __ldg(basis + a * kHeadDim), x);
      o = fmaf(x, val_f[TransformField::kInvScale * kHeadDim + d], o);
    }
    for (int e = 0; e < n_ep; ++e) {  // o += R_v[e]^T u_e, once per epoch
      const float* rvm = p.basis_rv + (static_cast<int64_t>(epochs[e]) * n_kv + h) * rv * kHeadDim;
      for (int j = 0; j < rv; ++j) o = fmaf(u_sum[e * rv + j], __ldg(rvm + j * kHeadDim + d), o);
    }
    p.out[(static_cast<int64_t>(s) * p.n_heads + hq) * kHeadDim + d] = o / sum;
  }
}

}  // namespace

cudaError_t LaunchDecodeAttention(const DecodeAttentionParams& p, cudaStream_t stream) {
  const KvPoolLayout& l = p.layout;
  const DecodePlanView& plan = p.plan;
  if (KvPoolLayoutError(l) != nullptr || p.n_heads <= 0 || p.n_heads % l.n_kv_heads != 0 ||
      plan.n_kv_heads != l.n_kv_heads || plan.max_seq_epochs < 0 ||
      plan.max_seq_epochs > kMaxSeqEpochs || plan.num_seqs < 0 || plan.num_work < plan.num_seqs) {
    return cudaErrorInvalidValue;
  }
  if (p.transform.floats != nullptr &&
      (TransformLayoutError(l) != nullptr || p.transform.ints == nullptr ||
       (p.key_rope.cos_sin != nullptr && (p.key_rope.rope_dim < 2 || p.key_rope.rope_dim % 2 != 0 ||
                                          p.key_rope.rope_dim > l.head_dim)))) {
    return cudaErrorInvalidValue;
  }
  if (plan.num_seqs == 0) return cudaSuccess;
  const int group = p.n_heads / l.n_kv_heads;
  const SplitSmem split(group, plan.max_seq_epochs, l.head_dim, l.rank_k, l.rank_v, l.block_size,
                        p.transform.floats != nullptr);
  const size_t split_smem = static_cast<size_t>(split.bytes);
  const size_t merge_smem =
      (p.transform.floats != nullptr ? static_cast<size_t>(l.head_dim) + 1
                                     : static_cast<size_t>(plan.max_seq_epochs) * l.rank_v) *
      sizeof(float);
  int device = 0, optin = 0;
  cudaError_t err = CurrentDeviceSharedMemoryOptin(&device, &optin);
  if (err != cudaSuccess) return err;
  if (split_smem > static_cast<size_t>(optin)) return cudaErrorInvalidValue;
  const dim3 split_grid(static_cast<unsigned>(plan.num_work), static_cast<unsigned>(l.n_kv_heads));
  const dim3 merge_grid(static_cast<unsigned>(plan.num_seqs), static_cast<unsigned>(p.n_heads));
  SUBSPACE_DISPATCH_HEAD_DIM(l.head_dim, kHeadDim, {
    SUBSPACE_DISPATCH_CODE_TYPE(l.coeff_dtype, CodeT, {
      auto* kernel = DecodeSplitKernel<kHeadDim, CodeT>;
      if (split_smem > 48 * 1024) {
        // Once per device, to the device's whole opt-in limit: any plan's CTA fits after that.
        static std::atomic<uint64_t> attribute_set{0};  // per (head_dim, code type) instance
        err = SetMaxDynamicSharedMemoryOnce(kernel, optin, device, attribute_set);
        if (err != cudaSuccess) return err;
      }
      kernel<<<split_grid, kThreads, split_smem, stream>>>(p);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    })
    DecodeMergeKernel<kHeadDim><<<merge_grid, kThreads, merge_smem, stream>>>(p);
  })
  return cudaGetLastError();
}

}  // namespace subspace::kernels
