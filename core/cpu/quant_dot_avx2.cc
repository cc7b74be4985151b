// AVX2 dot products of quantized weight rows with 8-bit quantized activation rows, one per
// weight type: integer products with maddubs (unsigned weight codes x signed activations, or
// the sign trick for signed codes), per-block scales applied with madd, one fp32 conversion per
// block (per super-block for the K-quants). Twins of DotQuantizedRowScalar (core/base).
//
// Offsets, overflow: activations are -127..127 (never -128) and weight codes at most 6 bits,
// so no maddubs pair saturates (2 * 63 * 127 < 32767), and a K-quant super-block's integer sum
// stays below 2^31 (16 sub-blocks x 16 values x 63 x 127 x scale 127 ~ 2.6e8).
#include <cstdint>
#include <cstring>

#include "core/base/ggml_quants.h"
#include "core/cpu/matmul_internal.h"
#include "core/cpu/simd.h"

namespace subspace::cpu::internal {

#ifdef SUBSPACE_HAVE_X86
namespace {

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
  const __m128i low = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
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

// int16 multipliers: the first eight lanes (values 0..15 of a 32-value chunk) `low`, the
// rest `high`.
SUBSPACE_AVX2 inline __m256i PairScales(int low, int high) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(high)),
                          _mm_set1_epi16(static_cast<int16_t>(low)));
}

// --- 32-value blocks against q8_0 ------------------------------------------------------------

// Signed codes of block b of the weight type, -127..127.
template <GgmlType kType>
SUBSPACE_AVX2 inline __m256i SignedCodes(const uint8_t* block) {
  if constexpr (kType == GgmlType::kQ8_0) {
    return Load256(block + 2);
  } else if constexpr (kType == GgmlType::kQ4_0) {
    return _mm256_sub_epi8(Nibbles(block + 2), _mm256_set1_epi8(8));
  } else if constexpr (kType == GgmlType::kQ5_0) {
    uint32_t qh;
    std::memcpy(&qh, block + 2, 4);
    const __m256i high = _mm256_and_si256(BitsToBytes(qh), _mm256_set1_epi8(0x10));
    return _mm256_sub_epi8(_mm256_or_si256(Nibbles(block + 6), high), _mm256_set1_epi8(16));
  } else {
    static_assert(kType == GgmlType::kIQ4_NL);
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues));
    return _mm256_shuffle_epi8(_mm256_set_m128i(table, table), Nibbles(block + 2));
  }
}

template <GgmlType kType>
SUBSPACE_AVX2 float DotQ8_0Partner(const uint8_t* row, const uint8_t* act, int64_t n) {
  const uint64_t block_bytes = GgmlBlockBytes(kType);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const uint8_t* x = row + b * block_bytes;
    const uint8_t* y = act + b * sizeof(BlockQ8_0);
    const __m256i sums = DotSigned(SignedCodes<kType>(x), Load256(y + 2));
    const __m256 d = _mm256_set1_ps(Half(x) * Half(y));
    acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums), acc);
  }
  return simd::HorizontalSum(acc);
}

// --- q4_1 / q5_1 against q8_1 ---------------------------------------------------------------

template <GgmlType kType>
SUBSPACE_AVX2 float DotQ8_1Partner(const uint8_t* row, const uint8_t* act, int64_t n) {
  const uint64_t block_bytes = GgmlBlockBytes(kType);
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.0f;
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const uint8_t* x = row + b * block_bytes;
    const uint8_t* y = act + b * sizeof(BlockQ8_1);
    __m256i codes;
    if constexpr (kType == GgmlType::kQ4_1) {
      codes = Nibbles(x + 4);
    } else {
      uint32_t qh;
      std::memcpy(&qh, x + 4, 4);
      codes = _mm256_or_si256(Nibbles(x + 8),
                              _mm256_and_si256(BitsToBytes(qh), _mm256_set1_epi8(0x10)));
    }
    const __m256i sums = DotUnsigned(codes, Load256(y + 4));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(Half(x) * Half(y)), _mm256_cvtepi32_ps(sums), acc);
    mins += Half(x + 2) * Half(y + 2);
  }
  return simd::HorizontalSum(acc) + mins;
}

// --- K-quants against q8_K ------------------------------------------------------------------

struct Q8KView {
  float d;
  const int8_t* qs;
  int16_t bsums[16];
};

SUBSPACE_AVX2 inline Q8KView ViewQ8K(const uint8_t* p) {
  Q8KView v;
  std::memcpy(&v.d, p, 4);
  v.qs = reinterpret_cast<const int8_t*>(p + offsetof(BlockQ8_K, qs));
  std::memcpy(v.bsums, p + offsetof(BlockQ8_K, bsums), sizeof(v.bsums));
  return v;
}

SUBSPACE_AVX2 float DotQ4K(const uint8_t* row, const uint8_t* act, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  float mins_total = 0.0f;
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(BlockQ4_K);
    const Q8KView y = ViewQ8K(act + b * sizeof(BlockQ8_K));
    uint8_t scale[8], min[8];
    int mins = 0;
    for (int s = 0; s < 8; ++s) {
      UnpackScaleMinK4(s, x + 4, &scale[s], &min[s]);
      mins += min[s] * (y.bsums[2 * s] + y.bsums[2 * s + 1]);
    }
    const uint8_t* qs = x + offsetof(BlockQ4_K, qs);
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = Load256(qs + 32 * j);
      const __m256i lo = _mm256_and_si256(bytes, low_mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
      const __m256i p_lo = _mm256_maddubs_epi16(lo, Load256(y.qs + 64 * j));
      const __m256i p_hi = _mm256_maddubs_epi16(hi, Load256(y.qs + 64 * j + 32));
      sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p_lo, _mm256_set1_epi16(scale[2 * j])));
      sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p_hi, _mm256_set1_epi16(scale[2 * j + 1])));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(Half(x) * y.d), _mm256_cvtepi32_ps(sumi), acc);
    mins_total += Half(x + 2) * y.d * static_cast<float>(mins);
  }
  return simd::HorizontalSum(acc) - mins_total;
}

SUBSPACE_AVX2 float DotQ5K(const uint8_t* row, const uint8_t* act, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  float mins_total = 0.0f;
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  const __m256i one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(BlockQ5_K);
    const Q8KView y = ViewQ8K(act + b * sizeof(BlockQ8_K));
    uint8_t scale[8], min[8];
    int mins = 0;
    for (int s = 0; s < 8; ++s) {
      UnpackScaleMinK4(s, x + 4, &scale[s], &min[s]);
      mins += min[s] * (y.bsums[2 * s] + y.bsums[2 * s + 1]);
    }
    const uint8_t* qs = x + offsetof(BlockQ5_K, qs);
    const __m256i qh = Load256(x + offsetof(BlockQ5_K, qh));
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = Load256(qs + 32 * j);
      // Fifth bits: bit 2j (low nibbles) and 2j + 1 (high) of each qh byte, moved to bit 4.
      const __m256i h_lo =
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4);
      const __m256i h_hi =
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4);
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(bytes, low_mask), h_lo);
      const __m256i hi =
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask), h_hi);
      const __m256i p_lo = _mm256_maddubs_epi16(lo, Load256(y.qs + 64 * j));
      const __m256i p_hi = _mm256_maddubs_epi16(hi, Load256(y.qs + 64 * j + 32));
      sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p_lo, _mm256_set1_epi16(scale[2 * j])));
      sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p_hi, _mm256_set1_epi16(scale[2 * j + 1])));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(Half(x) * y.d), _mm256_cvtepi32_ps(sumi), acc);
    mins_total += Half(x + 2) * y.d * static_cast<float>(mins);
  }
  return simd::HorizontalSum(acc) - mins_total;
}

SUBSPACE_AVX2 float DotQ6K(const uint8_t* row, const uint8_t* act, int64_t n) {
  float sum = 0.0f;
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  const __m256i two_bits = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(BlockQ6_K);
    const Q8KView y = ViewQ8K(act + b * sizeof(BlockQ8_K));
    int8_t scales[16];
    std::memcpy(scales, x + offsetof(BlockQ6_K, scales), 16);
    // Codes are stored +32: subtract 32 * scale * (sum of the sub-block's activations).
    int offset = 0;
    for (int s = 0; s < 16; ++s) offset += scales[s] * y.bsums[s];
    __m256i sumi = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = x + 64 * half;
      const __m256i qh = Load256(x + offsetof(BlockQ6_K, qh) + 32 * half);
      const __m256i ql0 = Load256(ql);
      const __m256i ql1 = Load256(ql + 32);
      for (int k = 0; k < 4; ++k) {
        const __m256i src = k % 2 == 0 ? ql0 : ql1;
        const __m256i low4 = k < 2 ? _mm256_and_si256(src, low_mask)
                                   : _mm256_and_si256(_mm256_srli_epi16(src, 4), low_mask);
        const __m256i high2 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), two_bits);
        const __m256i codes = _mm256_or_si256(low4, _mm256_slli_epi16(high2, 4));
        const __m256i products = _mm256_maddubs_epi16(codes, Load256(y.qs + 128 * half + 32 * k));
        const int s = 8 * half + 2 * k;
        sumi = _mm256_add_epi32(sumi,
                                _mm256_madd_epi16(products, PairScales(scales[s], scales[s + 1])));
      }
    }
    const int total = HorizontalSumI32(sumi) - 32 * offset;
    sum += Half(x + offsetof(BlockQ6_K, d)) * y.d * static_cast<float>(total);
  }
  return sum;
}

SUBSPACE_AVX2 float DotQ3K(const uint8_t* row, const uint8_t* act, int64_t n) {
  float sum = 0.0f;
  const __m256i two_bits = _mm256_set1_epi8(3);
  const __m256i one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(BlockQ3_K);
    const Q8KView y = ViewQ8K(act + b * sizeof(BlockQ8_K));
    int8_t scales[16];
    UnpackScalesQ3K(x + offsetof(BlockQ3_K, scales), scales);
    const __m256i hmask = Load256(x);
    __m256i sumi = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const __m256i qs = Load256(x + offsetof(BlockQ3_K, qs) + 32 * half);
      for (int k = 0; k < 4; ++k) {
        const __m256i low2 = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * k), two_bits);
        // 4 where the high bit is clear: code = low2 - 4 * !high.
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hmask, 4 * half + k), one);
        const __m256i minus4 = _mm256_slli_epi16(_mm256_xor_si256(high, one), 2);
        const __m256i yv = Load256(y.qs + 128 * half + 32 * k);
        const __m256i products =
            _mm256_sub_epi16(_mm256_maddubs_epi16(low2, yv), _mm256_maddubs_epi16(minus4, yv));
        const int s = 8 * half + 2 * k;
        sumi = _mm256_add_epi32(sumi,
                                _mm256_madd_epi16(products, PairScales(scales[s], scales[s + 1])));
      }
    }
    sum += Half(x + offsetof(BlockQ3_K, d)) * y.d * static_cast<float>(HorizontalSumI32(sumi));
  }
  return sum;
}

SUBSPACE_AVX2 float DotQ2K(const uint8_t* row, const uint8_t* act, int64_t n) {
  float sum = 0.0f;
  const __m256i two_bits = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(BlockQ2_K);
    const Q8KView y = ViewQ8K(act + b * sizeof(BlockQ8_K));
    const uint8_t* sc = x;
    int mins = 0;
    for (int s = 0; s < 16; ++s) mins += (sc[s] >> 4) * y.bsums[s];
    __m256i sumi = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const __m256i qs = Load256(x + offsetof(BlockQ2_K, qs) + 32 * half);
      for (int k = 0; k < 4; ++k) {
        const __m256i codes = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * k), two_bits);
        const __m256i products = _mm256_maddubs_epi16(codes, Load256(y.qs + 128 * half + 32 * k));
        const int s = 8 * half + 2 * k;
        sumi = _mm256_add_epi32(
            sumi, _mm256_madd_epi16(products, PairScales(sc[s] & 0xF, sc[s + 1] & 0xF)));
      }
    }
    const float d = Half(x + offsetof(BlockQ2_K, d)) * y.d;
    const float dmin = Half(x + offsetof(BlockQ2_K, dmin)) * y.d;
    sum += d * static_cast<float>(HorizontalSumI32(sumi)) - dmin * static_cast<float>(mins);
  }
  return sum;
}

}  // namespace

QuantDotFn QuantDotKernelAvx2(GgmlType type) {
  switch (type) {
    case GgmlType::kQ4_0:
      return DotQ8_0Partner<GgmlType::kQ4_0>;
    case GgmlType::kQ5_0:
      return DotQ8_0Partner<GgmlType::kQ5_0>;
    case GgmlType::kQ8_0:
      return DotQ8_0Partner<GgmlType::kQ8_0>;
    case GgmlType::kIQ4_NL:
      return DotQ8_0Partner<GgmlType::kIQ4_NL>;
    case GgmlType::kQ4_1:
      return DotQ8_1Partner<GgmlType::kQ4_1>;
    case GgmlType::kQ5_1:
      return DotQ8_1Partner<GgmlType::kQ5_1>;
    case GgmlType::kQ2_K:
      return DotQ2K;
    case GgmlType::kQ3_K:
      return DotQ3K;
    case GgmlType::kQ4_K:
      return DotQ4K;
    case GgmlType::kQ5_K:
      return DotQ5K;
    case GgmlType::kQ6_K:
      return DotQ6K;
    default:
      return nullptr;
  }
}

#else  // !SUBSPACE_HAVE_X86

QuantDotFn QuantDotKernelAvx2(GgmlType) { return nullptr; }

#endif  // SUBSPACE_HAVE_X86

}  // namespace subspace::cpu::internal
