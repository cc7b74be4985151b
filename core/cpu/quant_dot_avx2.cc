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
#include <type_traits>

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
SUBSPACE_AVX2 inline __m256 BlockProducts(const uint8_t* x, const uint8_t* y) {
  return _mm256_cvtepi32_ps(DotSigned(SignedCodes<kType>(x), Load256(y + 2)));
}

// Four blocks per step into two accumulators: the per-block chain (unpack, maddubs, madd,
// convert, fma) is long, and several in flight keep the ports busy.
template <GgmlType kType>
SUBSPACE_AVX2 float DotQ8_0Partner(const uint8_t* row, const uint8_t* act, int64_t n) {
  constexpr uint64_t kBytes = kType == GgmlType::kQ8_0   ? sizeof(BlockQ8_0)
                              : kType == GgmlType::kQ5_0 ? sizeof(BlockQ5_0)
                                                         : sizeof(BlockQ4_0);  // q4_0, iq4_nl
  constexpr uint64_t kActBytes = sizeof(BlockQ8_0);
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  const int64_t blocks = n / kQuantBlock;
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    const uint8_t* x = row + b * kBytes;
    for (uint64_t off = 0; off < 4 * kBytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(x) + 1024 + off, _MM_HINT_T0);
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

// --- Eight rows at once: the 32-value types but q8_0
// --------------------------------------------------------
//
// One row at a time, a 32-value block costs ~21 instructions, half of them for its two fp16
// scales and the horizontal bookkeeping. Eight rows at a time (as llama.cpp's repacked q4_0
// does, but without repacking the file) the block's 16 code bytes of each row are transposed
// into four vectors of one dword per row, each multiplied with a broadcast dword of the
// activations, so the eight dot products accumulate in the eight lanes of one register; the
// eight scales convert with one instruction.

// dword k (k = 0..3) of the 16 bytes at p[r] for r = 0..7 -> out[k], row r in lane r.
SUBSPACE_AVX2 inline void TransposeDwords8x4(const uint8_t* const p[8], __m256i out[4]) {
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[i + 4])),
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[i])));
  }
  const __m256i t0 = _mm256_unpacklo_epi32(q[0], q[1]);
  const __m256i t1 = _mm256_unpackhi_epi32(q[0], q[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(q[2], q[3]);
  const __m256i t3 = _mm256_unpackhi_epi32(q[2], q[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2);
  out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3);
  out[3] = _mm256_unpackhi_epi64(t1, t3);
}

// Where the parts of a 32-value block sit, per type (bytes from the block's start).
template <GgmlType kType>
struct Layout8 {
  static constexpr bool kMin = kType == GgmlType::kQ4_1 || kType == GgmlType::kQ5_1;
  static constexpr bool kFifthBit = kType == GgmlType::kQ5_0 || kType == GgmlType::kQ5_1;
  static constexpr uint64_t kBytes = kType == GgmlType::kQ4_1   ? sizeof(BlockQ4_1)
                                     : kType == GgmlType::kQ5_0 ? sizeof(BlockQ5_0)
                                     : kType == GgmlType::kQ5_1 ? sizeof(BlockQ5_1)
                                                                : sizeof(BlockQ4_0);
  static constexpr uint64_t kHighBits = kMin ? 4 : 2;  // qh (q5_0, q5_1)
  static constexpr uint64_t kCodes = 2 + (kMin ? 2 : 0) + (kFifthBit ? 4 : 0);
  static constexpr uint64_t kActBytes = kMin ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0);
  static constexpr uint64_t kActCodes = kMin ? 4 : 2;
  // Codes are stored + kOffset (q4_0: 8, q5_0: 16); it comes off through the activation sum.
  static constexpr int kOffset = kType == GgmlType::kQ4_0 ? 8 : kType == GgmlType::kQ5_0 ? 16 : 0;
};

// The eight fp16 values at byte `at` of blocks[0..7], as fp32.
SUBSPACE_AVX2 inline __m256 Halves8(const uint8_t* const blocks[8], uint64_t at) {
  uint16_t h[8];
  for (int r = 0; r < 8; ++r) std::memcpy(&h[r], blocks[r] + at, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// 0x10 in byte i of each 32-bit lane where bit (shift + i) of that lane's word is set, i = 0..3.
SUBSPACE_AVX2 inline __m256i FifthBits(__m256i words, int shift) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0,
                                          0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
  const __m256i bit = _mm256_set1_epi32(0x08040201);
  const __m256i bytes =
      _mm256_shuffle_epi8(_mm256_srl_epi32(words, _mm_cvtsi32_si128(shift)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit),
                          _mm256_set1_epi8(0x10));
}

// out[j * out_stride + r] = dot(row r, activation row j) for rows[r] = rows + r * row_bytes,
// r = 0..7, and N activation rows act_stride bytes apart. The transposed, unpacked weight codes
// of a block serve all N activation rows.
template <GgmlType kType, int N>
SUBSPACE_AVX2 void Dot8Rows(const uint8_t* rows, uint64_t row_bytes, const uint8_t* act,
                            uint64_t act_stride, const int32_t* act_sums, int64_t n, float* out,
                            int64_t out_stride) {
  using L = Layout8<kType>;
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlValues));
  const __m256i table2 = _mm256_set_m128i(table, table);
  __m256 acc[N], acc_min[N];
  for (int j = 0; j < N; ++j) acc[j] = acc_min[j] = _mm256_setzero_ps();
  // The eight rows are one contiguous region, read as eight interleaved streams, which the
  // hardware prefetcher follows poorly when rows are short (2048 values: 1152 bytes). Prefetch
  // the next group's region in order instead, spread over this group's blocks.
  const int64_t blocks_per_row = n / kQuantBlock;
  const char* next = reinterpret_cast<const char*>(rows + 8 * row_bytes);
  const int64_t next_lines = static_cast<int64_t>(8 * row_bytes / 64);
  const int64_t lines_per_block = (next_lines + blocks_per_row - 1) / blocks_per_row;
  for (int64_t b = 0; b < blocks_per_row; ++b) {
    for (int64_t i = 0; i < lines_per_block; ++i) {
      _mm_prefetch(next + (b * lines_per_block + i) * 64, _MM_HINT_T0);
    }
    const uint8_t* blocks[8];
    const uint8_t* codes[8];
    for (int r = 0; r < 8; ++r) {
      blocks[r] = rows + r * row_bytes + b * L::kBytes;
      codes[r] = blocks[r] + L::kCodes;
    }
    __m256i words[4];
    TransposeDwords8x4(codes, words);
    __m256i high_bits;
    if constexpr (L::kFifthBit) {
      int32_t qh[8];
      for (int r = 0; r < 8; ++r) std::memcpy(&qh[r], blocks[r] + L::kHighBits, 4);
      high_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    }
    // Each chunk's 4-bit (or 5-bit) codes in value order: chunk k holds values 4k..4k+3 (lo)
    // and 16+4k..16+4k+3 (hi) of every row; iq4_nl's mapped to their signed values.
    __m256i lo[4], hi[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      lo[k] = _mm256_and_si256(words[k], low_mask);
      hi[k] = _mm256_and_si256(_mm256_srli_epi16(words[k], 4), low_mask);
      if constexpr (kType == GgmlType::kIQ4_NL) {
        lo[k] = _mm256_shuffle_epi8(table2, lo[k]);
        hi[k] = _mm256_shuffle_epi8(table2, hi[k]);
      } else if constexpr (L::kFifthBit) {
        lo[k] = _mm256_or_si256(lo[k], FifthBits(high_bits, 4 * k));
        hi[k] = _mm256_or_si256(hi[k], FifthBits(high_bits, 16 + 4 * k));
      }
    }
    const __m256 d8 = Halves8(blocks, 0);
    __m256 m8;
    if constexpr (L::kMin) m8 = Halves8(blocks, 2);
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) {
      const uint8_t* y = act + j * act_stride + b * L::kActBytes;
      const int8_t* yq = reinterpret_cast<const int8_t*>(y + L::kActCodes);
      __m256i dots = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        int32_t y_lo, y_hi;
        std::memcpy(&y_lo, yq + 4 * k, 4);
        std::memcpy(&y_hi, yq + 16 + 4 * k, 4);
        const __m256i bl = _mm256_set1_epi32(y_lo), bh = _mm256_set1_epi32(y_hi);
        __m256i pairs;
        if constexpr (kType == GgmlType::kIQ4_NL) {
          // Signed values up to 127 in magnitude: the sign trick, pairs widened at once.
          const __m256i pl =
              _mm256_maddubs_epi16(_mm256_sign_epi8(lo[k], lo[k]), _mm256_sign_epi8(bl, lo[k]));
          const __m256i ph =
              _mm256_maddubs_epi16(_mm256_sign_epi8(hi[k], hi[k]), _mm256_sign_epi8(bh, hi[k]));
          dots = _mm256_add_epi32(
              dots, _mm256_add_epi32(_mm256_madd_epi16(pl, ones16), _mm256_madd_epi16(ph, ones16)));
          continue;
        } else {
          // Unsigned codes (0..31) x signed activations: a pair is at most 2 * 31 * 127.
          pairs =
              _mm256_add_epi16(_mm256_maddubs_epi16(lo[k], bl), _mm256_maddubs_epi16(hi[k], bh));
        }
        dots = _mm256_add_epi32(dots, _mm256_madd_epi16(pairs, ones16));
      }
      if constexpr (L::kOffset != 0) {
        // sum((q - offset) y) = sum(q y) - offset sum(y).
        dots = _mm256_sub_epi32(dots,
                                _mm256_set1_epi32(L::kOffset * act_sums[j * blocks_per_row + b]));
      }
      acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(Half(y))), _mm256_cvtepi32_ps(dots),
                               acc[j]);
      if constexpr (L::kMin) {
        // + m * s: the weights' mins times q8_1's stored activation sum.
        acc_min[j] = _mm256_fmadd_ps(m8, _mm256_set1_ps(Half(y + 2)), acc_min[j]);
      }
    }
  }
  for (int j = 0; j < N; ++j) {
    _mm256_storeu_ps(out + j * out_stride, _mm256_add_ps(acc[j], acc_min[j]));
  }
}

// q8_0, eight rows at once: the 32 code bytes of each row's block transposed into eight vectors
// of one dword per row, each multiplied (sign trick) with a broadcast activation dword.
template <int N>
SUBSPACE_AVX2 void Dot8RowsQ8_0(const uint8_t* rows, uint64_t row_bytes, const uint8_t* act,
                                uint64_t act_stride, const int32_t* /*act_sums*/, int64_t n,
                                float* out, int64_t out_stride) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  const int64_t blocks_per_row = n / kQuantBlock;
  const char* next = reinterpret_cast<const char*>(rows + 8 * row_bytes);
  const int64_t next_lines = static_cast<int64_t>(8 * row_bytes / 64);
  const int64_t lines_per_block = (next_lines + blocks_per_row - 1) / blocks_per_row;
  for (int64_t b = 0; b < blocks_per_row; ++b) {
    for (int64_t i = 0; i < lines_per_block; ++i) {
      _mm_prefetch(next + (b * lines_per_block + i) * 64, _MM_HINT_T0);
    }
    const uint8_t* blocks[8];
    const uint8_t* codes[8];
    for (int r = 0; r < 8; ++r) {
      blocks[r] = rows + r * row_bytes + b * sizeof(BlockQ8_0);
      codes[r] = blocks[r] + 2;
    }
    __m256i words[8];
    TransposeDwords8x4(codes, words);
    for (int r = 0; r < 8; ++r) codes[r] += 16;
    TransposeDwords8x4(codes, words + 4);
    __m256i abs_words[8];
    for (int k = 0; k < 8; ++k) abs_words[k] = _mm256_sign_epi8(words[k], words[k]);
    const __m256 d8 = Halves8(blocks, 0);
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) {
      const uint8_t* y = act + j * act_stride + b * sizeof(BlockQ8_0);
      __m256i dots = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        int32_t yk;
        std::memcpy(&yk, y + 2 + 4 * k, 4);
        const __m256i products =
            _mm256_maddubs_epi16(abs_words[k], _mm256_sign_epi8(_mm256_set1_epi32(yk), words[k]));
        dots = _mm256_add_epi32(dots, _mm256_madd_epi16(products, ones16));
      }
      acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(Half(y))), _mm256_cvtepi32_ps(dots),
                               acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) _mm256_storeu_ps(out + j * out_stride, acc[j]);
}

SUBSPACE_AVX2 void Dot8RowsQ8_0AnyN(const uint8_t* rows, uint64_t row_bytes, const uint8_t* act,
                                    uint64_t act_stride, const int32_t* act_sums, int64_t n_act,
                                    int64_t n, float* out, int64_t out_stride) {
  int64_t j = 0;
  for (; j + 4 <= n_act; j += 4) {
    Dot8RowsQ8_0<4>(rows, row_bytes, act + j * act_stride, act_stride, nullptr, n,
                    out + j * out_stride, out_stride);
  }
  const uint8_t* a = act + j * act_stride;
  float* o = out + j * out_stride;
  switch (n_act - j) {
    case 3:
      return Dot8RowsQ8_0<3>(rows, row_bytes, a, act_stride, act_sums, n, o, out_stride);
    case 2:
      return Dot8RowsQ8_0<2>(rows, row_bytes, a, act_stride, act_sums, n, o, out_stride);
    case 1:
      return Dot8RowsQ8_0<1>(rows, row_bytes, a, act_stride, act_sums, n, o, out_stride);
    default:
      return;
  }
}

// Dot8Rows over any number of activation rows, four at a time.
template <GgmlType kType>
SUBSPACE_AVX2 void Dot8RowsAnyN(const uint8_t* rows, uint64_t row_bytes, const uint8_t* act,
                                uint64_t act_stride, const int32_t* act_sums, int64_t n_act,
                                int64_t n, float* out, int64_t out_stride) {
  const int64_t blocks = n / kQuantBlock;
  int64_t j = 0;
  for (; j + 4 <= n_act; j += 4) {
    Dot8Rows<kType, 4>(rows, row_bytes, act + j * act_stride, act_stride, act_sums + j * blocks, n,
                       out + j * out_stride, out_stride);
  }
  const uint8_t* a = act + j * act_stride;
  const int32_t* sums = act_sums + j * blocks;
  float* o = out + j * out_stride;
  switch (n_act - j) {
    case 3:
      return Dot8Rows<kType, 3>(rows, row_bytes, a, act_stride, sums, n, o, out_stride);
    case 2:
      return Dot8Rows<kType, 2>(rows, row_bytes, a, act_stride, sums, n, o, out_stride);
    case 1:
      return Dot8Rows<kType, 1>(rows, row_bytes, a, act_stride, sums, n, o, out_stride);
    default:
      return;
  }
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

// Eight int32 partial sums of mins[s] * (bsums[2s] + bsums[2s + 1]) over the 8 sub-blocks.
SUBSPACE_AVX2 inline __m256i MinsTimesSums(const uint8_t* mins, const uint8_t* bsums) {
  uint64_t m8;
  std::memcpy(&m8, mins, 8);
  const __m128i m = _mm_cvtsi64_si128(static_cast<int64_t>(m8));
  const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));  // m0 m0 m1 m1 ...
  return _mm256_madd_epi16(m16, Load256(bsums));
}

// q4_K (kFifthBit false) and q5_K (true) against q8_K.
template <bool kFifthBit>
SUBSPACE_AVX2 float DotQ4KOrQ5K(const uint8_t* row, const uint8_t* act, int64_t n) {
  using Block = std::conditional_t<kFifthBit, BlockQ5_K, BlockQ4_K>;
  __m256 acc = _mm256_setzero_ps();
  __m256 acc_mins = _mm256_setzero_ps();
  const __m256i low_mask = _mm256_set1_epi8(0xF);
  const __m256i one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(Block);
    _mm_prefetch(reinterpret_cast<const char*>(x) + 1024, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(x) + 1024 + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(x) + 1024 + 128, _MM_HINT_T0);
    const uint8_t* y = act + b * sizeof(BlockQ8_K);
    float yd;
    std::memcpy(&yd, y, 4);
    const int8_t* yq = reinterpret_cast<const int8_t*>(y + offsetof(BlockQ8_K, qs));
    alignas(8) uint8_t scale[8], min[8];
    UnpackScalesMinsK4(x + 4, scale, min);
    const __m256i mins = MinsTimesSums(min, y + offsetof(BlockQ8_K, bsums));
    acc_mins =
        _mm256_fmadd_ps(_mm256_set1_ps(Half(x + 2) * yd), _mm256_cvtepi32_ps(mins), acc_mins);
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
        // Fifth bits: bit 2j (low nibbles) and 2j + 1 (high) of each qh byte, moved to bit 4.
        lo = _mm256_or_si256(
            lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
        hi = _mm256_or_si256(
            hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
      }
      const __m256i p_lo = _mm256_maddubs_epi16(lo, Load256(yq + 64 * j));
      const __m256i p_hi = _mm256_maddubs_epi16(hi, Load256(yq + 64 * j + 32));
      sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p_lo, _mm256_set1_epi16(scale[2 * j])));
      sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p_hi, _mm256_set1_epi16(scale[2 * j + 1])));
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(Half(x) * yd), _mm256_cvtepi32_ps(sumi), acc);
  }
  return simd::HorizontalSum(_mm256_sub_ps(acc, acc_mins));
}

// Shuffle controls that spread int16 scale 2k over the low 128 bits and 2k + 1 over the high
// 128 bits of a vector holding 8 int16 scales in both halves (k = 0..3).
SUBSPACE_AVX2 inline __m256i ScalePairShuffle(int k) {
  const int8_t a = static_cast<int8_t>(4 * k), b = static_cast<int8_t>(4 * k + 2);
  return _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a,
                          a + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b,
                          b + 1, b, b + 1);
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
  const __m256i two_bits = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const uint8_t* x = row + b * sizeof(BlockQ6_K);
    for (int i = 0; i < 4; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(x) + 1024 + 64 * i, _MM_HINT_T0);
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
      const __m256i high2 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), two_bits);
      return _mm256_or_si256(low4, _mm256_slli_epi16(high2, 4));
    });
    sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(Half(x + offsetof(BlockQ6_K, d)) * yd),
                          _mm256_cvtepi32_ps(sumi), acc);
  }
  return simd::HorizontalSum(acc);
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

template <GgmlType kType>
SUBSPACE_AVX2 void DequantizeQ8_0Partner(const uint8_t* row, float* out, int64_t n) {
  constexpr uint64_t kBytes = kType == GgmlType::kQ8_0   ? sizeof(BlockQ8_0)
                              : kType == GgmlType::kQ5_0 ? sizeof(BlockQ5_0)
                                                         : sizeof(BlockQ4_0);
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

QuantDot8Fn QuantDot8KernelAvx2(GgmlType type) {
  switch (type) {
    case GgmlType::kQ8_0:
      return Dot8RowsQ8_0AnyN;
    case GgmlType::kQ4_0:
      return Dot8RowsAnyN<GgmlType::kQ4_0>;
    case GgmlType::kQ4_1:
      return Dot8RowsAnyN<GgmlType::kQ4_1>;
    case GgmlType::kQ5_0:
      return Dot8RowsAnyN<GgmlType::kQ5_0>;
    case GgmlType::kQ5_1:
      return Dot8RowsAnyN<GgmlType::kQ5_1>;
    case GgmlType::kIQ4_NL:
      return Dot8RowsAnyN<GgmlType::kIQ4_NL>;
    default:
      return nullptr;
  }
}

bool DequantizeRowAvx2(GgmlType type, const uint8_t* row, float* out, int64_t n) {
  switch (type) {
    case GgmlType::kQ4_0:
      DequantizeQ8_0Partner<GgmlType::kQ4_0>(row, out, n);
      return true;
    case GgmlType::kQ5_0:
      DequantizeQ8_0Partner<GgmlType::kQ5_0>(row, out, n);
      return true;
    case GgmlType::kIQ4_NL:
      DequantizeQ8_0Partner<GgmlType::kIQ4_NL>(row, out, n);
      return true;
    case GgmlType::kQ4_K:
      DequantizeQ4KOrQ5K<false>(row, out, n);
      return true;
    case GgmlType::kQ5_K:
      DequantizeQ4KOrQ5K<true>(row, out, n);
      return true;
    case GgmlType::kQ6_K:
      DequantizeQ6K(row, out, n);
      return true;
    case GgmlType::kQ3_K:
      DequantizeQ3K(row, out, n);
      return true;
    default:
      return false;
  }
}

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
      return DotQ4KOrQ5K<false>;
    case GgmlType::kQ5_K:
      return DotQ4KOrQ5K<true>;
    case GgmlType::kQ6_K:
      return DotQ6K;
    default:
      return nullptr;
  }
}

#else  // !SUBSPACE_HAVE_X86

QuantDotFn QuantDotKernelAvx2(GgmlType) { return nullptr; }
bool DequantizeRowAvx2(GgmlType, const uint8_t*, float*, int64_t) { return false; }
QuantDot8Fn QuantDot8KernelAvx2(GgmlType) { return nullptr; }

#endif  // SUBSPACE_HAVE_X86

}  // namespace subspace::cpu::internal
