// RopeSplitQkvKernel: one CTA per token splits its fused QKV row into Q, K and V (adding the
// Q/K/V biases when there are), rotating the first rope_dim dims of every Q and K head by the
// host-built cos/sin table, on adjacent pairs or on halves. The rotation uses
// explicitly rounded multiplies and adds (no FMA contraction) so each element is bit-identical
// to core/cpu/ops.cc Rope, which the host compiler evaluates without FMA.
#include <cmath>

#include "kernels/cuda_util.cuh"
#include "kernels/rope.h"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 128;

// (x0, x1) rotated by the angle whose (cos, sin) is cs, as cpu::Rope: x0 c - x1 s, x0 s + x1 c.
__device__ __forceinline__ float2 Rotate(float x0, float x1, float2 cs) {
  return make_float2(__fsub_rn(__fmul_rn(x0, cs.x), __fmul_rn(x1, cs.y)),
                     __fadd_rn(__fmul_rn(x0, cs.y), __fmul_rn(x1, cs.x)));
}

// Which pair dim d of a head belongs to: pair pr, its two dims a and b (offsets in the head),
// and whether d is the first of them. Adjacent pairs (2pr, 2pr + 1) or halves (pr, pr + pairs).
struct PairSlot {
  int pr, a, b;
  bool first;
};
__device__ __forceinline__ PairSlot PairOf(int d, int pairs, bool halves) {
  const bool first = halves ? d < pairs : d % 2 == 0;
  const int pr = halves ? (first ? d : d - pairs) : d / 2;
  const int a = halves ? pr : 2 * pr;
  return {pr, a, a + (halves ? pairs : 1), first};
}

// kVec: head_dim % 4 == 0 and every pointer 16-byte aligned (the table 8), so Q/K pairs move
// as float2 and V as float4. Otherwise one element per thread, each reading its pair partner.
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    RopeSplitQkvKernel(const __grid_constant__ RopeSplitQkvParams p) {
  const int64_t i = blockIdx.x;
  const int hd = p.head_dim, pairs = p.rope_dim / 2;
  const int n_q = p.n_heads * hd, n_kv = p.n_kv_heads * hd;  // floats per token
  const float* src = p.qkv + i * (n_q + 2 * n_kv);
  float* q = p.q + i * n_q;
  float* k = p.k + i * n_kv;
  float* v = p.v + i * n_kv;
  const int32_t pos = p.positions[i];
  // The host checks positions against the table; an outside one must not read past it, and a
  // NaN row makes the bug loud instead of plausible.
  const bool pos_ok = pos >= 0 && pos < p.max_position;
  const float* cs = p.cos_sin + static_cast<int64_t>(pos_ok ? pos : 0) * pairs * 2;  // [pairs, 2]
  const float nan = __int_as_float(0x7fffffff);

  if constexpr (kVec) {
    const int half = hd / 2;
    const auto* src2 = reinterpret_cast<const float2*>(src);
    // Pair j of the Q and K columns is floats 2j, 2j+1: head j / half, pair j % half.
    for (int j = threadIdx.x; j < (n_q + n_kv) / 2; j += kThreads) {
      const int pr = j % half;
      float2 x = src2[j];
      if (!pos_ok) {
        x = make_float2(nan, nan);
      } else if (pr < pairs) {
        x = Rotate(x.x, x.y, __ldg(reinterpret_cast<const float2*>(cs) + pr));
      }
      if (j < n_q / 2) {
        reinterpret_cast<float2*>(q)[j] = x;
      } else {
        reinterpret_cast<float2*>(k)[j - n_q / 2] = x;
      }
    }
    const auto* src4 = reinterpret_cast<const float4*>(src + n_q + n_kv);
    auto* v4 = reinterpret_cast<float4*>(v);
    for (int j = threadIdx.x; j < n_kv / 4; j += kThreads) v4[j] = src4[j];
  } else if (p.q_norm != nullptr) {
    // Per-head RMSNorm first (Qwen3): one warp per head sums its squares, then rotates the
    // normalised values.
    const auto value = [&](int idx) {
      return p.bias != nullptr ? __fadd_rn(src[idx], __ldg(p.bias + idx)) : src[idx];
    };
    const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    for (int h = warp; h < p.n_heads + p.n_kv_heads; h += kThreads / 32) {
      const bool is_q = h < p.n_heads;
      const int off = h * hd;
      const float* w = is_q ? p.q_norm : p.k_norm;
      double ss = 0.0;
      for (int d = lane; d < hd; d += 32) {
        const double x = value(off + d);
        ss += x * x;
      }
      for (int m = 16; m > 0; m /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, m);
      const auto scale = static_cast<float>(1.0 / sqrt(ss / hd + static_cast<double>(p.norm_eps)));
      const auto normed = [&](int d) {
        return __fmul_rn(__fmul_rn(value(off + d), scale), __ldg(w + d));
      };
      float* out = is_q ? q + off : k + (off - n_q);
      for (int d = lane; d < hd; d += 32) {
        float y = normed(d);
        if (!pos_ok) {
          y = nan;
        } else if (d < 2 * pairs) {
          const PairSlot s = PairOf(d, pairs, p.halves);
          const float2 r = Rotate(normed(s.a), normed(s.b),
                                  make_float2(__ldg(cs + 2 * s.pr), __ldg(cs + 2 * s.pr + 1)));
          y = s.first ? r.x : r.y;
        }
        out[d] = y;
      }
    }
    for (int j = threadIdx.x; j < n_kv; j += kThreads) v[j] = value(n_q + n_kv + j);
  } else {
    // The row's value at idx, its bias added first (rounded as core/cpu/ops.cc AddBias adds).
    const auto value = [&](int idx) {
      return p.bias != nullptr ? __fadd_rn(src[idx], __ldg(p.bias + idx)) : src[idx];
    };
    for (int j = threadIdx.x; j < n_q + n_kv; j += kThreads) {
      const int d = j % hd;
      float y = value(j);
      if (!pos_ok) {
        y = nan;
      } else if (d < 2 * pairs) {
        const PairSlot s = PairOf(d, pairs, p.halves);
        // Scalar table reads too: this path also serves a table that is not 8-byte aligned.
        const float2 r = Rotate(value(j - d + s.a), value(j - d + s.b),
                                make_float2(__ldg(cs + 2 * s.pr), __ldg(cs + 2 * s.pr + 1)));
        y = s.first ? r.x : r.y;
      }
      if (j < n_q) {
        q[j] = y;
      } else {
        k[j - n_q] = y;
      }
    }
    for (int j = threadIdx.x; j < n_kv; j += kThreads) v[j] = value(n_q + n_kv + j);
  }
}

}  // namespace

cudaError_t LaunchRopeSplitQkv(const RopeSplitQkvParams& p, cudaStream_t stream) {
  if (p.n <= 0 || p.n_heads <= 0 || p.n_kv_heads <= 0 || p.head_dim <= 0 || p.rope_dim <= 0 ||
      p.rope_dim % 2 != 0 || p.rope_dim > p.head_dim || p.max_position <= 0) {
    return cudaErrorInvalidValue;
  }
  // Per-token floats stay far below 2^31 for any real model; the products are int in the kernel.
  if ((static_cast<int64_t>(p.n_heads) + 2 * static_cast<int64_t>(p.n_kv_heads)) * p.head_dim >
      (int64_t{1} << 30)) {
    return cudaErrorInvalidValue;
  }
  const auto aligned = [](const void* ptr, uintptr_t bytes) {
    return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
  };
  // The vector path rotates adjacent pairs of unbiased rows only.
  if ((p.q_norm == nullptr) != (p.k_norm == nullptr)) return cudaErrorInvalidValue;
  const bool vec = !p.halves && p.bias == nullptr && p.q_norm == nullptr && p.head_dim % 4 == 0 &&
                   aligned(p.qkv, 16) && aligned(p.q, 16) && aligned(p.k, 16) && aligned(p.v, 16) &&
                   aligned(p.cos_sin, 8);
  if (vec) {
    RopeSplitQkvKernel<true><<<p.n, kThreads, 0, stream>>>(p);
  } else {
    RopeSplitQkvKernel<false><<<p.n, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace subspace::kernels
