// Building blocks shared by the AVX2 kernels of quantized weights: quant_dot_avx2.cc (one weight
// row at a time), quant_dot8_avx2.cc (eight rows at a time) and quant_dequant_avx2.cc (panels for
// the prefill path's sgemm). Every function is inline and carries SUBSPACE_AVX2; include only
// under SUBSPACE_HAVE_X86 and call only where ActiveIsa() allows AVX2.
#ifndef SUBSPACE_CORE_CPU_QUANT_AVX2_H_
#define SUBSPACE_CORE_CPU_QUANT_AVX2_H_

#include "core/cpu/simd.h"

#ifdef SUBSPACE_HAVE_X86

#include <cstdint>
#include <cstring>

#include "core/base/quant_blocks.h"
#include "core/base/tensor_types.h"

namespace subspace::cpu::internal::quant_avx2 {

// Bytes of one block of a 32-value type.
template <TensorType kType>
constexpr uint64_t Block32Bytes() {
  switch (kType) {
    case TensorType::kQ4_1:
      return sizeof(BlockQ4_1);
    case TensorType::kQ5_0:
      return sizeof(BlockQ5_0);
    case TensorType::kQ5_1:
      return sizeof(BlockQ5_1);
    case TensorType::kQ8_0:
      return sizeof(BlockQ8_0);
    default:
      return sizeof(BlockQ4_0);  // q4_0, iq4_nl
  }
}

SUBSPACE_AVX2 inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return simd::F16ToF32(h);
}
SUBSPACE_AVX2 inline __m256i Load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
// 32 4-bit codes of a nibble-packed block, in value order (low nibbles then high), 0..15.
SUBSPACE_AVX2 inline __m256i Nibbles(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0xF));
}
// Byte i = 0xFF where bit i of the 32-bit word is set, else 0.
SUBSPACE_AVX2 inline __m256i BitsToBytes(uint32_t bits) {
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x7fbfdfeff7fbfdfe));
  bytes = _mm256_or_si256(bytes, bit);
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}
// Eight int32 partial sums of x * y for signed bytes x, y (|x| <= 128, y != -128).
SUBSPACE_AVX2 inline __m256i DotSigned(__m256i x, __m256i y) {
  const __m256i products = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
  return _mm256_madd_epi16(products, _mm256_set1_epi16(1));
}
// Eight int32 partial sums of u * y for unsigned bytes u (< 128) and signed bytes y.
SUBSPACE_AVX2 inline __m256i DotUnsigned(__m256i u, __m256i y) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1));
}
SUBSPACE_AVX2 inline int HorizontalSumI32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}
// Signed codes of block b of the weight type, -127..127.
template <TensorType kType>
SUBSPACE_AVX2 inline __m256i SignedCodes(const uint8_t* block) {
  if constexpr (kType == TensorType::kQ8_0) {
    return Load256(block + 2);
  } else if constexpr (kType == TensorType::kQ4_0) {
    return _mm256_sub_epi8(Nibbles(block + 2), _mm256_set1_epi8(8));
  } else if constexpr (kType == TensorType::kQ5_0) {
    uint32_t qh;
    std::memcpy(&qh, block + 2, 4);
    const __m256i high = _mm256_and_si256(BitsToBytes(qh), _mm256_set1_epi8(0x10));
    return _mm256_sub_epi8(_mm256_or_si256(Nibbles(block + 6), high), _mm256_set1_epi8(16));
  } else {
    static_assert(kType == TensorType::kIQ4_NL);
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues));
    return _mm256_shuffle_epi8(_mm256_set_m128i(table, table), Nibbles(block + 2));
  }
}
// The 6-bit scales (bytes 0..7 of *scales) and mins (*mins) of a q4_K / q5_K block's 12 packed
// bytes, four at a time in 32-bit words (UnpackScaleMinK4 one at a time).
inline void UnpackScalesMinsK4(const uint8_t* packed, uint8_t* scales, uint8_t* mins) {
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  const uint32_t s_lo = w[0] & 0x3f3f3f3fu;
  const uint32_t m_lo = w[1] & 0x3f3f3f3fu;
  const uint32_t s_hi = (w[2] & 0x0f0f0f0fu) | ((w[0] >> 2) & 0x30303030u);
  const uint32_t m_hi = ((w[2] >> 4) & 0x0f0f0f0fu) | ((w[1] >> 2) & 0x30303030u);
  std::memcpy(scales, &s_lo, 4);
  std::memcpy(scales + 4, &s_hi, 4);
  std::memcpy(mins, &m_lo, 4);
  std::memcpy(mins + 4, &m_hi, 4);
}
// Shuffle controls that spread int16 scale 2k over the low 128 bits and 2k + 1 over the high
// 128 bits of a vector holding 8 int16 scales in both halves (k = 0..3).
SUBSPACE_AVX2 inline __m256i ScalePairShuffle(int k) {
  const int8_t a = static_cast<int8_t>(4 * k), b = static_cast<int8_t>(4 * k + 2);
  return _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a,
                          a + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b,
                          b + 1, b, b + 1);
}
// The 16 signed 6-bit scales of a q3_K block (UnpackScalesQ3K), four at a time in words.
SUBSPACE_AVX2 inline __m128i UnpackScalesQ3KVector(const uint8_t* packed) {
  uint32_t w[3];
  std::memcpy(w, packed, 12);
  const uint32_t low = 0x0f0f0f0fu, high = 0x03030303u;
  const __m128i s =
      _mm_setr_epi32(static_cast<int>((w[0] & low) | ((w[2] & high) << 4)),
                     static_cast<int>((w[1] & low) | (((w[2] >> 2) & high) << 4)),
                     static_cast<int>(((w[0] >> 4) & low) | (((w[2] >> 4) & high) << 4)),
                     static_cast<int>(((w[1] >> 4) & low) | (((w[2] >> 6) & high) << 4)));
  return _mm_sub_epi8(s, _mm_set1_epi8(32));
}
}  // namespace subspace::cpu::internal::quant_avx2

#endif  // SUBSPACE_HAVE_X86

#endif  // SUBSPACE_CORE_CPU_QUANT_AVX2_H_
