// AVX2 quantization of activation rows to q8_0, q8_1 and q8_K, the decode path's first step on
// quantized weights. Bit for bit equal to QuantizeActivationRow (core/base), which stays the
// definition: the same scale arithmetic, q8_0/q8_1's round-half-away-from-zero and q8_K's
// round-half-to-even, q8_K's scale taken from the first value of largest magnitude.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/base/quant_blocks.h"
#include "core/base/tensor_types.h"
#include "core/cpu/matmul_internal.h"
#include "core/cpu/quant_avx2.h"
#include "core/cpu/simd.h"

namespace subspace::cpu::internal {

#ifdef SUBSPACE_HAVE_X86
namespace {

using namespace quant_avx2;  // NOLINT: the kernels' shared vocabulary
using simd::HorizontalMax;

SUBSPACE_AVX2 inline __m256 Abs(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

// std::round for 8 lanes: to nearest, halves away from zero. v - trunc(v) is exact.
SUBSPACE_AVX2 inline __m256 RoundHalfAway(__m256 v) {
  const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 away = _mm256_cmp_ps(Abs(_mm256_sub_ps(v, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  const __m256 one = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
  return _mm256_add_ps(t, _mm256_and_ps(away, one));
}

// 32 int8 codes from four vectors of 8 integral floats in -127..127, in order.
SUBSPACE_AVX2 inline __m256i PackCodes(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256i ab = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
  const __m256i cd = _mm256_packs_epi32(_mm256_cvtps_epi32(c), _mm256_cvtps_epi32(d));
  // packs works within 128-bit lanes: dwords come out as a0 b0 c0 d0 a1 b1 c1 d1 (4 bytes
  // each, ai = a's half i); put them back in order.
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd),
                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Eight int32 partial sums of 32 signed codes, four codes each.
SUBSPACE_AVX2 inline __m256i QuadSums(__m256i codes) {
  return DotUnsigned(_mm256_set1_epi8(1), codes);
}

SUBSPACE_AVX2 void QuantizeQ8_0Or1(bool with_sum, const float* x, uint8_t* out, int64_t n) {
  const size_t block_bytes = with_sum ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0);
  for (int64_t b = 0; b < n / kQuantBlock; ++b, x += kQuantBlock, out += block_bytes) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
    const float amax = HorizontalMax(
        _mm256_max_ps(_mm256_max_ps(Abs(v[0]), Abs(v[1])), _mm256_max_ps(Abs(v[2]), Abs(v[3]))));
    const float d = amax / 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    const float id = std::isfinite(inverse) ? inverse : 0.0f;
    const __m256 scale = _mm256_set1_ps(id);
    for (int i = 0; i < 4; ++i) v[i] = RoundHalfAway(_mm256_mul_ps(v[i], scale));
    const __m256i codes = PackCodes(v[0], v[1], v[2], v[3]);
    const uint16_t d16 = Fp32ToFp16(d);
    std::memcpy(out, &d16, 2);
    if (with_sum) {
      const uint16_t s16 = Fp32ToFp16(static_cast<float>(HorizontalSumI32(QuadSums(codes))) * d);
      std::memcpy(out + 2, &s16, 2);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (with_sum ? 4 : 2)), codes);
  }
}

SUBSPACE_AVX2 void QuantizeQ8K(const float* x, uint8_t* out, int64_t n) {
  for (int64_t b = 0; b < n / kSuperBlock; ++b, x += kSuperBlock, out += sizeof(BlockQ8_K)) {
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < kSuperBlock; i += 8) m = _mm256_max_ps(m, Abs(_mm256_loadu_ps(x + i)));
    const float amax = HorizontalMax(m);
    int first = 0;  // the scalar code keeps the first value of largest magnitude
    while (first < kSuperBlock && std::fabs(x[first]) != amax) ++first;
    if (first == kSuperBlock) {  // NaN in the block: whatever the scalar code makes of it
      QuantizeActivationRow(TensorType::kQ8_K, x, out, kSuperBlock);
      continue;
    }
    BlockQ8_K block{};
    const float iscale = amax != 0.0f ? -127.0f / x[first] : 0.0f;
    if (std::isfinite(iscale) && iscale != 0.0f) {
      const __m256 scale = _mm256_set1_ps(iscale);
      const __m256 top = _mm256_set1_ps(127.0f);
      for (int i = 0; i < kSuperBlock; i += 32) {
        __m256 v[4];
        for (int k = 0; k < 4; ++k) {
          const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), scale);
          v[k] = _mm256_min_ps(
              _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), top);
        }
        const __m256i codes = PackCodes(v[0], v[1], v[2], v[3]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(block.qs + i), codes);
        // bsums: two groups of 16 per 32 codes.
        const __m256i quads = QuadSums(codes);
        // quads: 4 dwords of the first 16 codes, then 4 of the next 16.
        __m128i lo = _mm256_castsi256_si128(quads), hi = _mm256_extracti128_si256(quads, 1);
        lo = _mm_hadd_epi32(lo, hi);
        lo = _mm_hadd_epi32(lo, lo);
        block.bsums[i / 16] = static_cast<int16_t>(_mm_cvtsi128_si32(lo));
        block.bsums[i / 16 + 1] = static_cast<int16_t>(_mm_extract_epi32(lo, 1));
      }
      block.d = 1.0f / iscale;
    }
    std::memcpy(out, &block, sizeof(block));
  }
}

}  // namespace

bool QuantizeActivationRowAvx2(TensorType act_type, const float* x, uint8_t* dst, int64_t n) {
  switch (act_type) {
    case TensorType::kQ8_0:
      QuantizeQ8_0Or1(false, x, dst, n);
      return true;
    case TensorType::kQ8_1:
      QuantizeQ8_0Or1(true, x, dst, n);
      return true;
    case TensorType::kQ8_K:
      QuantizeQ8K(x, dst, n);
      return true;
    default:
      return false;
  }
}

#else  // !SUBSPACE_HAVE_X86

bool QuantizeActivationRowAvx2(TensorType, const float*, uint8_t*, int64_t) { return false; }

#endif  // SUBSPACE_HAVE_X86

}  // namespace subspace::cpu::internal
