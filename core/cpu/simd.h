// AVX2 building blocks shared by the CPU kernels. The build targets generic x86-64, so every
// function here carries a target attribute and may only be called from code that checked
// cpu::internal::ActiveIsa() (and from other SUBSPACE_AVX2 functions).
#ifndef SUBSPACE_CORE_CPU_SIMD_H_
#define SUBSPACE_CORE_CPU_SIMD_H_

#if defined(__x86_64__) || defined(_M_X64)
#define SUBSPACE_HAVE_X86 1
#include <immintrin.h>

#include <cstdint>

// GCC and Clang allow intrinsics of a wider ISA inside a function so marked.
#define SUBSPACE_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace subspace::cpu::simd {

SUBSPACE_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

SUBSPACE_AVX2 inline float HorizontalMax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight consecutive weights as fp32. The pointers may have any alignment.
// src: [8] fp16
SUBSPACE_AVX2 inline __m256 LoadF16(const uint16_t* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
// src: [8] bf16 (the high half of an fp32, so widening is a shift)
SUBSPACE_AVX2 inline __m256 LoadBf16(const uint16_t* src) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// src: [8] int8, not yet scaled
SUBSPACE_AVX2 inline __m256 LoadI8(const int8_t* src) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

SUBSPACE_AVX2 inline float F16ToF32(uint16_t h) { return _cvtsh_ss(h); }

// e^x for 8 lanes, within ~2 ulp of expf over the whole float range: x < -87.3 gives 0
// (so -inf, as in a masked attention score, gives exactly 0) and x > 88.7 gives +inf.
// Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, then a degree-6 polynomial for e^r.
SUBSPACE_AVX2 inline __m256 Exp(__m256 x) {
  const __m256 kMax = _mm256_set1_ps(88.72283935546875f);
  const __m256 kMin = _mm256_set1_ps(-87.33654022216797f);  // ln(FLT_MIN)
  const __m256 kLog2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 kLn2Hi = _mm256_set1_ps(0.693359375f);
  const __m256 kLn2Lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 too_big = _mm256_cmp_ps(x, kMax, _CMP_GT_OQ);
  const __m256 too_small = _mm256_cmp_ps(x, kMin, _CMP_LT_OQ);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, kMin), kMax);
  const __m256 k =
      _mm256_round_ps(_mm256_mul_ps(xc, kLog2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, kLn2Hi, xc);
  r = _mm256_fnmadd_ps(k, kLn2Lo, r);
  // Taylor coefficients 1/7! .. 1/2!: truncation error < 1e-8 on |r| <= 0.347.
  __m256 p = _mm256_set1_ps(1.9841270e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3888889e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333333e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666667e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666667e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  // Scale by 2^k in two halves so k = 128 (x near the top of the range) does not overflow
  // the exponent field before the multiply.
  const __m256i ki = _mm256_cvtps_epi32(k);
  const __m256i half = _mm256_srai_epi32(ki, 1);
  const __m256i rest = _mm256_sub_epi32(ki, half);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  __m256 result = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  result = _mm256_blendv_ps(result, _mm256_set1_ps(__builtin_inff()), too_big);
  result = _mm256_andnot_ps(too_small, result);
  return _mm256_blendv_ps(result, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN stays NaN
}

}  // namespace subspace::cpu::simd

#endif  // x86-64

#endif  // SUBSPACE_CORE_CPU_SIMD_H_
