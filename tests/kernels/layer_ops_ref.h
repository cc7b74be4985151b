// CPU twins of the per-layer element-wise kernels (embedding.cu, rms_norm.cu, rope.cu,
// swiglu.cu, residual.cu, append_kv.cu): the same Params structs with host pointers, plain
// loops. Each is checked against core/cpu/ops.h in layer_ops_ref_test.cc, so a kernel that
// matches its twin matches the CPU backend. fp16 rounding is core's Fp32ToFp16 (nearest even,
// as __float2half_rn). Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_LAYER_OPS_REF_H_
#define SUBSPACE_TESTS_KERNELS_LAYER_OPS_REF_H_

#include <cstdint>

#include "kernels/append_kv.h"
#include "kernels/embedding.h"
#include "kernels/residual.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace subspace::kernels {

// Rows of the fp16 table as fp32, bit-exact (fp16 -> fp32 is exact); an id outside
// [0, n_vocab) gives a zero row, as cpu::Embed.
void EmbeddingRef(const EmbeddingParams& p);

// Sum of squares in double (cpu::RmsNorm accumulates in float lanes on AVX2), the scale in
// double rounded to float, then (x * scale) * weight in float, rounded to fp16.
void RmsNormRef(const RmsNormParams& p);

// cpu::Rope's float expressions on the table's (cos, sin): bit-identical to cpu::Rope on Q and
// K when the table is RopeCosSinTable; V copied. A position outside [0, max_position) gives NaN
// Q and K rows, as the kernel does (it must not read outside the table).
void RopeSplitQkvRef(const RopeSplitQkvParams& p);

// gate / (1 + exp(-gate)) * up in float (std::exp), rounded to fp16.
void SwiGluRef(const SwiGluParams& p);

void ResidualAddRef(const ResidualAddParams& p);
void CastToHalfRef(const CastToHalfParams& p);
void GatherRowsToHalfRef(const GatherRowsToHalfParams& p);

// Token i's K and V rows into slot slot_mapping[i] of the pool, fp16; -1 (any negative) skips
// the token and nothing else in the pool is touched.
void AppendKvRef(const AppendKvParams& p);

// Distance in fp16 units between two finite halves: adjacent values are 1 apart, +0 and -0 are
// the same value.
inline int Fp16UlpDistance(uint16_t a, uint16_t b) {
  const auto key = [](uint16_t h) {
    const int mag = h & 0x7fff;
    return (h & 0x8000) != 0 ? -mag : mag;
  };
  const int d = key(a) - key(b);
  return d < 0 ? -d : d;
}

}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_LAYER_OPS_REF_H_
