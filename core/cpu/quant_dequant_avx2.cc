// AVX2 dequantization of quantized weight rows to fp32, for the panels the prefill path hands to
// sgemm. Equal to DequantizeRow (core/base) up to the rounding of a fused multiply-add.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/base/quant_blocks.h"
#include "core/cpu/matmul_internal.h"
#include "core/cpu/quant_avx2.h"
#include "core/cpu/simd.h"

namespace subspace::cpu::internal {

#ifdef SUBSPACE_HAVE_X86
namespace {

using namespace quant_avx2;  // NOLINT: the kernels' shared vocabulary

// --- Dequantization for the prefill path's sgemm panels --------------------------------------

// out[0..32) = scale * codes + bias for 32 signed bytes.
SUBSPACE_AVX2 inline void StoreSigned32(__m256i codes, float scale, float bias, float* out) {
  const __m256 s = _mm256_set1_ps(scale), b = _mm256_set1_ps(bias);
  const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i]));
    _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(v, s, b));
  }
}

// As StoreSigned32 for 16 values (the low 16 bytes of `codes`) and 16 more (the high 16) with
// their own scales: the 16-value sub-blocks of q6_K.
SUBSPACE_AVX2 inline void StoreSigned16x2(__m256i codes, float scale0, float scale1, float* out) {
  const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
  const __m256 s0 = _mm256_set1_ps(scale0), s1 = _mm256_set1_ps(scale1);
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), s0));
  _mm256_storeu_ps(
      out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), s0));
  _mm256_storeu_ps(out + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), s1));
  _mm256_storeu_ps(
      out + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), s1));
}

template <TensorType kType>
SUBSPACE_AVX2 void DequantizeQ8_0Partner(const uint8_t* row, float* out, int64_t n) {
  constexpr uint64_t kBytes = Block32Bytes<kType>();
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const uint8_t* x = row + b * kBytes;
    StoreSigned32(SignedCodes<kType>(x), Half(x), 0.0f, out + b * kQuantBlock);
  }
}

template <bool kFifthBit>
SUBSPACE_AVX2 void DequantizeQ4KOrQ5K(const uint8_t* row, float* out, int64_t n) {
  using Block = std::conditional_t<kFifthBit, BlockQ5_K, BlockQ4_K>;
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  const __m256i one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < n / kSuperBlock; ++b, out += kSuperBlock) {
    const uint8_t* x = row + b * sizeof(Block);
    const float d = Half(x), dmin = Half(x + 2);
    alignas(8) uint8_t scale[8], min[8];
    UnpackScalesMinsK4(x + 4, scale, min);
    const uint8_t* qs = x + offsetof(Block, qs);
    __m256i qh;
    if constexpr (kFifthBit) qh = Load256(x + offsetof(BlockQ5_K, qh));
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = Load256(qs + 32 * j);
      __m256i lo = _mm256_and_si256(bytes, low_mask);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
      if constexpr (kFifthBit) {
        lo = _mm256_or_si256(
            lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
        hi = _mm256_or_si256(
            hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
      }
      // Codes are 0..31: as signed bytes they read the same.
      StoreSigned32(lo, d * scale[2 * j], -dmin * min[2 * j], out + 64 * j);
      StoreSigned32(hi, d * scale[2 * j + 1], -dmin * min[2 * j + 1], out + 64 * j + 32);
    }
  }
}

SUBSPACE_AVX2 void DequantizeQ6K(const uint8_t* row, float* out, int64_t n) {
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  const __m256i two_bits = _mm256_set1_epi8(3);
  const __m256i offset = _mm256_set1_epi8(32);
  for (int64_t b = 0; b < n / kSuperBlock; ++b, out += kSuperBlock) {
    const uint8_t* x = row + b * sizeof(BlockQ6_K);
    const float d = Half(x + offsetof(BlockQ6_K, d));
    int8_t scales[16];
    std::memcpy(scales, x + offsetof(BlockQ6_K, scales), 16);
    for (int half = 0; half < 2; ++half) {
      const __m256i qh = Load256(x + offsetof(BlockQ6_K, qh) + 32 * half);
      const __m256i ql0 = Load256(x + 64 * half);
      const __m256i ql1 = Load256(x + 64 * half + 32);
      for (int k = 0; k < 4; ++k) {
        const __m256i src = k % 2 == 0 ? ql0 : ql1;
        const __m256i low4 = k < 2 ? _mm256_and_si256(src, low_mask)
                                   : _mm256_and_si256(_mm256_srli_epi16(src, 4), low_mask);
        const __m256i high2 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), two_bits);
        const __m256i codes =
            _mm256_sub_epi8(_mm256_or_si256(low4, _mm256_slli_epi16(high2, 4)), offset);
        const int s = 8 * half + 2 * k;
        StoreSigned16x2(codes, d * scales[s], d * scales[s + 1], out + 128 * half + 32 * k);
      }
    }
  }
}

// q3_K: x = d (scale - 32) (low2 - 4 !high), scale per 16 values.
SUBSPACE_AVX2 void DequantizeQ3K(const uint8_t* row, float* out, int64_t n) {
  const __m256i two_bits = _mm256_set1_epi8(3);
  const __m256i one = _mm256_set1_epi8(1);
  const __m256i four = _mm256_set1_epi8(4);
  for (int64_t b = 0; b < n / kSuperBlock; ++b, out += kSuperBlock) {
    const uint8_t* x = row + b * sizeof(BlockQ3_K);
    const float d = Half(x + offsetof(BlockQ3_K, d));
    alignas(16) int8_t scales[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(scales),
                    UnpackScalesQ3KVector(x + offsetof(BlockQ3_K, scales)));
    const __m256i hmask = Load256(x);
    for (int half = 0; half < 2; ++half) {
      const __m256i qs = Load256(x + offsetof(BlockQ3_K, qs) + 32 * half);
      for (int k = 0; k < 4; ++k) {
        const __m256i low2 = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * k), two_bits);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hmask, 4 * half + k), one);
        // low2 - 4 (1 - high) = (low2 | high << 2) - 4
        const __m256i codes =
            _mm256_sub_epi8(_mm256_or_si256(low2, _mm256_slli_epi16(high, 2)), four);
        const int s = 8 * half + 2 * k;
        StoreSigned16x2(codes, d * scales[s], d * scales[s + 1], out + 128 * half + 32 * k);
      }
    }
  }
}

}  // namespace

bool DequantizeRowAvx2(TensorType type, const uint8_t* row, float* out, int64_t n) {
  switch (type) {
    case TensorType::kQ4_0:
      DequantizeQ8_0Partner<TensorType::kQ4_0>(row, out, n);
      return true;
    case TensorType::kQ5_0:
      DequantizeQ8_0Partner<TensorType::kQ5_0>(row, out, n);
      return true;
    case TensorType::kIQ4_NL:
      DequantizeQ8_0Partner<TensorType::kIQ4_NL>(row, out, n);
      return true;
    case TensorType::kQ4_K:
      DequantizeQ4KOrQ5K<false>(row, out, n);
      return true;
    case TensorType::kQ5_K:
      DequantizeQ4KOrQ5K<true>(row, out, n);
      return true;
    case TensorType::kQ6_K:
      DequantizeQ6K(row, out, n);
      return true;
    case TensorType::kQ3_K:
      DequantizeQ3K(row, out, n);
      return true;
    default:
      return false;
  }
}

#else  // !SUBSPACE_HAVE_X86

bool DequantizeRowAvx2(TensorType, const uint8_t*, float*, int64_t) { return false; }

#endif  // SUBSPACE_HAVE_X86

}  // namespace subspace::cpu::internal
