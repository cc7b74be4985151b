// AVX2 dot products of one quantized weight row with an 8-bit quantized activation row, one per
// weight type (eight rows at once: quant_dot8_avx2.cc; building blocks: quant_avx2.h): integer
// products with maddubs (unsigned weight codes x signed activations, or the sign trick for signed
// codes), per-block scales applied with madd, one fp32 conversion per block (per super-block for
// the K-quants). Twins of DotQuantizedRowScalar (core/base).
//
// Offsets, overflow: activations are -127..127 (never -128) and weight codes at most 6 bits,
// so no maddubs pair saturates (2 * 63 * 127 < 32767), and a K-quant super-block's integer sum
// stays below 2^31 (16 sub-blocks x 16 values x 63 x 127 x scale 127 ~ 2.6e8).
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

// How far ahead of the block being read the row kernels prefetch. Two threads streaming at
// ~36 GB/s with ~100 ns of DRAM latency need ~1.8 KB each in flight: 2048 bytes ahead read
// q8_0 rows at ~38 GB/s (median) where 1024 gave ~34 (subspace-bench-matmul, 2026-11-26).
constexpr int kPrefetchAhead = 2048;

// --- 32-value blocks against q8_0 ------------------------------------------------------------

template <TensorType kType>
SUBSPACE_AVX2 inline __m256 BlockProducts(const uint8_t* x, const uint8_t* y) {
  return _mm256_cvtepi32_ps(DotSigned(SignedCodes<kType>(x), Load256(y + 2)));
}

// Four blocks per step into two accumulators: the per-block chain (unpack, maddubs, madd,
// convert, fma) is long, and several in flight keep the ports busy.
template <TensorType kType>
SUBSPACE_AVX2 float DotQ8_0Partner(const uint8_t* row, const uint8_t* act, int64_t n) {
  constexpr uint64_t kBytes = Block32Bytes<kType>();
  constexpr uint64_t kActBytes = sizeof(BlockQ8_0);
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  const int64_t blocks = n / kQuantBlock;
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    const uint8_t* x = row + b * kBytes;
    for (uint64_t off = 0; off < 4 * kBytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(x) + kPrefetchAhead + off, _MM_HINT_T0);
    }
    const uint8_t* y = act + b * kActBytes;
    const __m256 p0 = BlockProducts<kType>(x, y);
    const __m256 p1 = BlockProducts<kType>(x + kBytes, y + kActBytes);
    const __m256 p2 = BlockProducts<kType>(x + 2 * kBytes, y + 2 * kActBytes);
    const __m256 p3 = BlockProducts<kType>(x + 3 * kBytes, y + 3 * kActBytes);
    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(Half(x) * Half(y)), p0, acc0);
    acc1 = _mm256_fmadd_ps(_mm256_set1_ps(Half(x + kBytes) * Half(y + kActBytes)), p1, acc1);
    acc0 =
        _mm256_fmadd_ps(_mm256_set1_ps(Half(x + 2 * kBytes) * Half(y + 2 * kActBytes)), p2, acc0);
    acc1 =
        _mm256_fmadd_ps(_mm256_set1_ps(Half(x + 3 * kBytes) * Half(y + 3 * kActBytes)), p3, acc1);
  }
  for (; b < blocks; ++b) {
    const uint8_t* x = row + b * kBytes;
    const uint8_t* y = act + b * kActBytes;
    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(Half(x) * Half(y)), BlockProducts<kType>(x, y), acc0);
  }
  return simd::HorizontalSum(_mm256_add_ps(acc0, acc1));
}

// --- q4_1 / q5_1 against q8_1 ---------------------------------------------------------------

template <TensorType kType>
SUBSPACE_AVX2 float DotQ8_1Partner(const uint8_t* row, const uint8_t* act, int64_t n) {
  const uint64_t block_bytes = TensorBlockBytes(kType);
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.0f;
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const uint8_t* x = row + b * block_bytes;
    const uint8_t* y = act + b * sizeof(BlockQ8_1);
    __m256i codes;
    if constexpr (kType == TensorType::kQ4_1) {
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

// Eight int32 partial sums of mins[s] * (bsums[2s] + bsums[2s + 1]) over the 8 sub-blocks.
SUBSPACE_AVX2 inline __m256i MinsTimesSums(const uint8_t* mins, const uint8_t* bsums) {
  uint64_t m8;
  std::memcpy(&m8, mins, 8);
  const __m128i m = _mm_cvtsi64_si128(static_cast<int64_t>(m8));
  const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));  // m0 m0 m1 m1 ...
  return _mm256_madd_epi16(m16, Load256(bsums));
}

// v shifted left by `bits` within each 16-bit lane (right where `bits` is negative).
SUBSPACE_AVX2 inline __m256i ShiftLeft(__m256i v, int bits) {
  return bits >= 0 ? _mm256_slli_epi16(v, bits) : _mm256_srli_epi16(v, -bits);
}

// q4_K (kFifthBit false) and q5_K (true) against q8_K.
template <bool kFifthBit>
SUBSPACE_AVX2 float DotQ4KOrQ5K(const uint8_t* row, const uint8_t* act, int64_t n) {
  using Block = std::conditional_t<kFifthBit, BlockQ5_K, BlockQ4_K>;
  __m256 acc = _mm256_setzero_ps();
  __m256 acc_mins = _mm256_setzero_ps();
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(Block);
    _mm_prefetch(reinterpret_cast<const char*>(x) + kPrefetchAhead, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(x) + kPrefetchAhead + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(x) + kPrefetchAhead + 128, _MM_HINT_T0);
    const uint8_t* y = act + b * sizeof(BlockQ8_K);
    float yd;
    std::memcpy(&yd, y, 4);
    const int8_t* yq = reinterpret_cast<const int8_t*>(y + offsetof(BlockQ8_K, qs));
    alignas(8) uint8_t scale[8], min[8];
    UnpackScalesMinsK4(x + 4, scale, min);
    const __m256i mins = MinsTimesSums(min, y + offsetof(BlockQ8_K, bsums));
    acc_mins =
        _mm256_fmadd_ps(_mm256_set1_ps(Half(x + 2) * yd), _mm256_cvtepi32_ps(mins), acc_mins);
    // The eight scales as int16 in both halves; one shuffle broadcasts scale s.
    int64_t scale8;
    std::memcpy(&scale8, scale, 8);
    const __m256i scales16 =
        _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(scale8)));
    const uint8_t* qs = x + offsetof(Block, qs);
    __m256i qh;
    if constexpr (kFifthBit) qh = Load256(x + offsetof(BlockQ5_K, qh));
    __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = Load256(qs + 32 * j);
      __m256i lo = _mm256_and_si256(bytes, low_mask);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
      if constexpr (kFifthBit) {
        // Fifth bits: bit 2j (low nibbles) and 2j + 1 (high) of each qh byte, moved to bit 4
        // by one shift (16-bit shifts of at most 4 keep bit 4 of each byte within its byte).
        lo = _mm256_or_si256(lo, _mm256_and_si256(ShiftLeft(qh, 4 - 2 * j), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(ShiftLeft(qh, 3 - 2 * j), bit4));
      }
      const __m256i p_lo = _mm256_maddubs_epi16(lo, Load256(yq + 64 * j));
      const __m256i p_hi = _mm256_maddubs_epi16(hi, Load256(yq + 64 * j + 32));
      const __m256i s_lo =
          _mm256_shuffle_epi8(scales16, _mm256_set1_epi16(0x0100 + 0x0202 * 2 * j));
      const __m256i s_hi =
          _mm256_shuffle_epi8(scales16, _mm256_set1_epi16(0x0100 + 0x0202 * (2 * j + 1)));
      sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p_lo, s_lo));
      sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p_hi, s_hi));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(Half(x) * yd), _mm256_cvtepi32_ps(sumi), acc);
  }
  return simd::HorizontalSum(_mm256_sub_ps(acc, acc_mins));
}

// sum over the 16 sub-blocks s of 16 values of a K-quant super-block of scale[s] * dot(codes of
// s, activations), as eight int32 partial sums. codes(half, k) gives the 32 unsigned codes of
// values 128 half + 32 k .. + 31 (two sub-blocks); scales16 the 16 scales as int16; yq the
// super-block's activation codes.
template <typename Codes>
SUBSPACE_AVX2 inline __m256i SubBlockDots16(__m256i scales16, const int8_t* yq, Codes codes) {
  __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    const __m256i scales = _mm256_broadcastsi128_si256(
        half == 0 ? _mm256_castsi256_si128(scales16) : _mm256_extracti128_si256(scales16, 1));
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i products =
          _mm256_maddubs_epi16(codes(half, k), Load256(yq + 128 * half + 32 * k));
      sumi = _mm256_add_epi32(
          sumi, _mm256_madd_epi16(products, _mm256_shuffle_epi8(scales, ScalePairShuffle(k))));
    }
  }
  return sumi;
}

SUBSPACE_AVX2 float DotQ6K(const uint8_t* row, const uint8_t* act, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  const __m256i high_bits = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(BlockQ6_K);
    for (int i = 0; i < 4; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(x) + kPrefetchAhead + 64 * i, _MM_HINT_T0);
    }
    const uint8_t* y = act + b * sizeof(BlockQ8_K);
    float yd;
    std::memcpy(&yd, y, 4);
    const int8_t* yq = reinterpret_cast<const int8_t*>(y + offsetof(BlockQ8_K, qs));
    const __m128i scale_bytes =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + offsetof(BlockQ6_K, scales)));
    // Codes are stored +32: subtract 32 * scale * (sum of each sub-block's activations).
    const __m256i scales16 = _mm256_cvtepi8_epi16(scale_bytes);
    const __m256i offset = _mm256_madd_epi16(scales16, Load256(y + offsetof(BlockQ8_K, bsums)));
    __m256i sumi = SubBlockDots16(scales16, yq, [&](int half, int k) SUBSPACE_AVX2 {
      const __m256i src = Load256(x + 64 * half + 32 * (k % 2));
      const __m256i low4 = k < 2 ? _mm256_and_si256(src, low_mask)
                                 : _mm256_and_si256(_mm256_srli_epi16(src, 4), low_mask);
      const __m256i qh = Load256(x + offsetof(BlockQ6_K, qh) + 32 * half);
      // Bits 2k, 2k + 1 of each qh byte to bits 4, 5 in one shift (see ShiftLeft's callers).
      return _mm256_or_si256(low4, _mm256_and_si256(ShiftLeft(qh, 4 - 2 * k), high_bits));
    });
    sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(Half(x + offsetof(BlockQ6_K, d)) * yd),
                          _mm256_cvtepi32_ps(sumi), acc);
  }
  return simd::HorizontalSum(acc);
}

// q3_K: code = low2 - 4 * !high = (low2 | high << 2) - 4; the -4 goes through the bsums.
SUBSPACE_AVX2 float DotQ3K(const uint8_t* row, const uint8_t* act, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  const __m256i two_bits = _mm256_set1_epi8(3);
  const __m256i one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(BlockQ3_K);
    const uint8_t* y = act + b * sizeof(BlockQ8_K);
    float yd;
    std::memcpy(&yd, y, 4);
    const int8_t* yq = reinterpret_cast<const int8_t*>(y + offsetof(BlockQ8_K, qs));
    const __m128i scale_bytes = UnpackScalesQ3KVector(x + offsetof(BlockQ3_K, scales));
    const __m256i scales16 = _mm256_cvtepi8_epi16(scale_bytes);
    const __m256i offset = _mm256_madd_epi16(scales16, Load256(y + offsetof(BlockQ8_K, bsums)));
    const __m256i hmask = Load256(x);
    __m256i sumi = SubBlockDots16(scales16, yq, [&](int half, int k) SUBSPACE_AVX2 {
      const __m256i qs = Load256(x + offsetof(BlockQ3_K, qs) + 32 * half);
      const __m256i low2 = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * k), two_bits);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hmask, 4 * half + k), one);
      return _mm256_or_si256(low2, _mm256_slli_epi16(high, 2));
    });
    sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 2));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(Half(x + offsetof(BlockQ3_K, d)) * yd),
                          _mm256_cvtepi32_ps(sumi), acc);
  }
  return simd::HorizontalSum(acc);
}

SUBSPACE_AVX2 float DotQ2K(const uint8_t* row, const uint8_t* act, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  __m256 acc_mins = _mm256_setzero_ps();
  const __m256i two_bits = _mm256_set1_epi8(3);
  const __m128i low_mask = _mm_set1_epi8(0xF);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(BlockQ2_K);
    const uint8_t* y = act + b * sizeof(BlockQ8_K);
    float yd;
    std::memcpy(&yd, y, 4);
    const int8_t* yq = reinterpret_cast<const int8_t*>(y + offsetof(BlockQ8_K, qs));
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    const __m128i scale_bytes = _mm_and_si128(packed, low_mask);
    const __m128i min_bytes = _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask);
    const __m256i mins =
        _mm256_madd_epi16(_mm256_cvtepu8_epi16(min_bytes), Load256(y + offsetof(BlockQ8_K, bsums)));
    acc_mins = _mm256_fmadd_ps(_mm256_set1_ps(Half(x + offsetof(BlockQ2_K, dmin)) * yd),
                               _mm256_cvtepi32_ps(mins), acc_mins);
    const __m256i sumi =
        SubBlockDots16(_mm256_cvtepu8_epi16(scale_bytes), yq, [&](int half, int k) SUBSPACE_AVX2 {
          const __m256i qs = Load256(x + offsetof(BlockQ2_K, qs) + 32 * half);
          return _mm256_and_si256(_mm256_srli_epi16(qs, 2 * k), two_bits);
        });
    acc = _mm256_fmadd_ps(_mm256_set1_ps(Half(x + offsetof(BlockQ2_K, d)) * yd),
                          _mm256_cvtepi32_ps(sumi), acc);
  }
  return simd::HorizontalSum(_mm256_sub_ps(acc, acc_mins));
}

}  // namespace

QuantDotFn QuantDotKernelAvx2(TensorType type) {
  switch (type) {
    case TensorType::kQ4_0:
      return DotQ8_0Partner<TensorType::kQ4_0>;
    case TensorType::kQ5_0:
      return DotQ8_0Partner<TensorType::kQ5_0>;
    case TensorType::kQ8_0:
      return DotQ8_0Partner<TensorType::kQ8_0>;
    case TensorType::kIQ4_NL:
      return DotQ8_0Partner<TensorType::kIQ4_NL>;
    case TensorType::kQ4_1:
      return DotQ8_1Partner<TensorType::kQ4_1>;
    case TensorType::kQ5_1:
      return DotQ8_1Partner<TensorType::kQ5_1>;
    case TensorType::kQ2_K:
      return DotQ2K;
    case TensorType::kQ3_K:
      return DotQ3K;
    case TensorType::kQ4_K:
      return DotQ4KOrQ5K<false>;
    case TensorType::kQ5_K:
      return DotQ4KOrQ5K<true>;
    case TensorType::kQ6_K:
      return DotQ6K;
    default:
      return nullptr;
  }
}

#else  // !SUBSPACE_HAVE_X86

QuantDotFn QuantDotKernelAvx2(TensorType) { return nullptr; }

#endif  // SUBSPACE_HAVE_X86

}  // namespace subspace::cpu::internal
