// Device helpers shared by the kernels that read the transform codec's coded blocks
// (transform_blocks.cu, decode_attention.cu): the rotary pairs of a head and the decoding of one
// KV head's run of codes into fp16 rows. Include only from .cu files.
#ifndef SUBSPACE_KERNELS_TRANSFORM_ROWS_CUH_
#define SUBSPACE_KERNELS_TRANSFORM_ROWS_CUH_

#include "kernels/cuda_util.cuh"
#include "kernels/transform_blocks.h"

namespace subspace::kernels::device {

// The two dims of pair p (p < d / 2): RoPE's pair while p < rope_dim / 2 (rotated), the
// remaining dims two by two after it (never rotated).
__device__ __forceinline__ void TransformPairDims(int p, const TransformKeyRope& r, int* i0,
                                                  int* i1, bool* rotated) {
  const int rp = r.cos_sin != nullptr ? r.rope_dim / 2 : 0;
  *rotated = p < rp;
  if (r.halves && p < rp) {
    *i0 = p;
    *i1 = p + rp;
  } else if (r.halves) {  // after the rotated dims [0, rope_dim)
    *i0 = 2 * rp + 2 * (p - rp);
    *i1 = *i0 + 1;
  } else {
    *i0 = 2 * p;
    *i1 = 2 * p + 1;
  }
}

// The coefficients offset + code * step of rows [0, nb) of one side of one KV head (record `f` /
// `n` of TransformTables, codes at `run`) into `coef` (shared, [nb, active] floats). Every thread
// of the CTA (kThreads of them) calls it; it syncs before it returns.
template <int kHeadDim, int kThreads>
__device__ void TransformCoefficients(const float* f, const int32_t* n, const uint8_t* run, int nb,
                                      float* coef) {
  constexpr int d = kHeadDim;
  const int active = n[TransformField::kActive];
  for (int idx = threadIdx.x; idx < nb * active; idx += kThreads) {
    const int a = idx / nb, t = idx % nb;
    const int bits = n[TransformField::kBits + a];
    const uint8_t* codes = run + n[TransformField::kBits + d + a];
    const int at = t * bits;
    uint32_t v = codes[at >> 3];
    if ((at & 7) + bits > 8) v |= static_cast<uint32_t>(codes[(at >> 3) + 1]) << 8;
    const uint32_t code = (v >> (at & 7)) & ((1u << bits) - 1u);
    coef[t * active + a] = f[TransformField::kOffset * d + a] +
                           static_cast<float>(code) * f[TransformField::kStep * d + a];
  }
  __syncthreads();
}

// Decodes rows [0, nb) of one side of one KV head into fp16 `out` ([nb, kHeadDim], global or
// shared memory): the coefficients into `coef` (TransformCoefficients), then per row and pair
// ext + sum_a c_a u_a, unweighted, rotated to position first + t when `rotate`, rounded once.
// Every thread of the CTA calls it; it syncs before it returns.
template <int kHeadDim, int kThreads>
__device__ void DecodeTransformRun(const float* f, const int32_t* n, const uint8_t* run, int nb,
                                   bool rotate, const TransformKeyRope& rope, int64_t first,
                                   float* coef, __half* out) {
  constexpr int d = kHeadDim;
  const int active = n[TransformField::kActive];
  TransformCoefficients<kHeadDim, kThreads>(f, n, run, nb, coef);
  const float* basis = f + TransformField::kBasis * d;
  for (int idx = threadIdx.x; idx < nb * (d / 2); idx += kThreads) {
    const int t = idx / (d / 2), pair = idx % (d / 2);
    int i0, i1;
    bool rotated;
    TransformPairDims(pair, rope, &i0, &i1, &rotated);
    float x0 = f[TransformField::kExt * d + i0], x1 = f[TransformField::kExt * d + i1];
    const float* c = coef + t * active;
    for (int a = 0; a < active; ++a) {
      x0 = fmaf(c[a], __ldg(basis + static_cast<int64_t>(a) * d + i0), x0);
      x1 = fmaf(c[a], __ldg(basis + static_cast<int64_t>(a) * d + i1), x1);
    }
    x0 *= f[TransformField::kInvScale * d + i0];
    x1 *= f[TransformField::kInvScale * d + i1];
    if (rotate && rotated) {
      const float* cs = rope.cos_sin + ((first + t) * (rope.rope_dim / 2) + pair) * 2;
      const float cc = cs[0], s = cs[1];
      const float y0 = cc * x0 - s * x1, y1 = s * x0 + cc * x1;
      x0 = y0;
      x1 = y1;
    }
    out[t * d + i0] = __float2half_rn(x0);
    out[t * d + i1] = __float2half_rn(x1);
  }
  __syncthreads();
}

}  // namespace subspace::kernels::device

#endif  // SUBSPACE_KERNELS_TRANSFORM_ROWS_CUH_
