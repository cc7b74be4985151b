// AVX2 kernels that dot eight consecutive quantized weight rows with up to four activation rows
// at once, for the 32-value types (q4_0, q4_1, q5_0, q5_1, iq4_nl, q8_0). Twins of
// DotQuantizedRowScalar (core/base), tested against it row by row.
#include <cstdint>
#include <cstring>

#include "core/base/quant_blocks.h"
#include "core/cpu/matmul_internal.h"
#include "core/cpu/quant_avx2.h"
#include "core/cpu/simd.h"

namespace subspace::cpu::internal {

#ifdef SUBSPACE_HAVE_X86
namespace {

using namespace quant_avx2;  // NOLINT: the kernels' shared vocabulary

// One row at a time, a 32-value block costs ~21 instructions, half of them for its two fp16
// scales and the horizontal bookkeeping. Eight rows at a time (as llama.cpp's repacked q4_0
// does, but without repacking the file) the block's 16 code bytes of each row are transposed
// into four vectors of one dword per row, each multiplied with a broadcast dword of the
// activations, so the eight dot products accumulate in the eight lanes of one register; the
// eight scales convert with one instruction. (q8_0's 32 code bytes make eight such vectors.)

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
template <TensorType kType>
struct Layout8 {
  static constexpr bool kMin = kType == TensorType::kQ4_1 || kType == TensorType::kQ5_1;
  static constexpr bool kFifthBit = kType == TensorType::kQ5_0 || kType == TensorType::kQ5_1;
  static constexpr uint64_t kBytes = Block32Bytes<kType>();
  static constexpr uint64_t kHighBits = kMin ? 4 : 2;  // qh (q5_0, q5_1)
  static constexpr uint64_t kCodes = 2 + (kMin ? 2 : 0) + (kFifthBit ? 4 : 0);
  static constexpr uint64_t kActBytes = kMin ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0);
  static constexpr uint64_t kActCodes = kMin ? 4 : 2;
  // Codes are stored + kOffset (q4_0: 8, q5_0: 16); it comes off through the activation sum.
  static constexpr int kOffset = kType == TensorType::kQ4_0   ? 8
                                 : kType == TensorType::kQ5_0 ? 16
                                                              : 0;
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
template <TensorType kType, int N>
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
  // A fixed count per block (no inner loop): the block's share of the next region, rounded
  // up, plus one line for the rounding of the share itself.
  const int64_t blocks_per_row = n / kQuantBlock;
  const char* next = reinterpret_cast<const char*>(rows + 8 * row_bytes);
  const uint64_t share = (8 * row_bytes + blocks_per_row - 1) / blocks_per_row;
  constexpr int kLinesPerBlock = static_cast<int>((8 * L::kBytes + 63) / 64) + 1;
  for (int64_t b = 0; b < blocks_per_row; ++b) {
#pragma GCC unroll 8
    for (int i = 0; i < kLinesPerBlock; ++i) _mm_prefetch(next + b * share + 64 * i, _MM_HINT_T0);
    const uint8_t* blocks[8];
    const uint8_t* codes[8];
    for (int r = 0; r < 8; ++r) {
      blocks[r] = rows + r * row_bytes + b * L::kBytes;
      codes[r] = blocks[r] + L::kCodes;
    }
    const __m256 d8 = Halves8(blocks, 0);
    if constexpr (kType == TensorType::kQ8_0) {
      // 32 signed code bytes: eight dwords per row, each against a broadcast activation dword
      // with the sign trick; pairs reach 2 * 128 * 127, so each product is widened at once.
      __m256i words[8], abs_words[8];
      TransposeDwords8x4(codes, words);
      for (int r = 0; r < 8; ++r) codes[r] += 16;
      TransposeDwords8x4(codes, words + 4);
      for (int k = 0; k < 8; ++k) abs_words[k] = _mm256_sign_epi8(words[k], words[k]);
#pragma GCC unroll 4
      for (int j = 0; j < N; ++j) {
        const uint8_t* y = act + j * act_stride + b * L::kActBytes;
        __m256i dots = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          int32_t yk;
          std::memcpy(&yk, y + L::kActCodes + 4 * k, 4);
          const __m256i products =
              _mm256_maddubs_epi16(abs_words[k], _mm256_sign_epi8(_mm256_set1_epi32(yk), words[k]));
          dots = _mm256_add_epi32(dots, _mm256_madd_epi16(products, ones16));
        }
        acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(Half(y))),
                                 _mm256_cvtepi32_ps(dots), acc[j]);
      }
      continue;
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
      if constexpr (kType == TensorType::kIQ4_NL) {
        lo[k] = _mm256_shuffle_epi8(table2, lo[k]);
        hi[k] = _mm256_shuffle_epi8(table2, hi[k]);
      } else if constexpr (L::kFifthBit) {
        lo[k] = _mm256_or_si256(lo[k], FifthBits(high_bits, 4 * k));
        hi[k] = _mm256_or_si256(hi[k], FifthBits(high_bits, 16 + 4 * k));
      }
    }
    __m256 m8;
    if constexpr (L::kMin) m8 = Halves8(blocks, 2);
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) {
      const uint8_t* y = act + j * act_stride + b * L::kActBytes;
      const int8_t* yq = reinterpret_cast<const int8_t*>(y + L::kActCodes);
      __m256i dots = _mm256_setzero_si256();
      // Unsigned codes: int16 pair sums of 4-bit codes (at most 2 * 15 * 127 = 3810) add up
      // over all four chunks before one widening madd, 5-bit codes (7874) over two.
      constexpr int kChunksPerMadd = L::kFifthBit ? 2 : 4;
      __m256i pair_sums = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        int32_t y_lo, y_hi;
        std::memcpy(&y_lo, yq + 4 * k, 4);
        std::memcpy(&y_hi, yq + 16 + 4 * k, 4);
        const __m256i bl = _mm256_set1_epi32(y_lo), bh = _mm256_set1_epi32(y_hi);
        __m256i pairs;
        if constexpr (kType == TensorType::kIQ4_NL) {
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
        pair_sums = _mm256_add_epi16(pair_sums, pairs);
        if ((k + 1) % kChunksPerMadd == 0) {
          dots = _mm256_add_epi32(dots, _mm256_madd_epi16(pair_sums, ones16));
          pair_sums = _mm256_setzero_si256();
        }
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

// Dot8Rows over any number of activation rows, four at a time.
template <TensorType kType>
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

}  // namespace

QuantDot8Fn QuantDot8KernelAvx2(TensorType type) {
  switch (type) {
    case TensorType::kQ8_0:
      return Dot8RowsAnyN<TensorType::kQ8_0>;
    case TensorType::kQ4_0:
      return Dot8RowsAnyN<TensorType::kQ4_0>;
    case TensorType::kQ4_1:
      return Dot8RowsAnyN<TensorType::kQ4_1>;
    case TensorType::kQ5_0:
      return Dot8RowsAnyN<TensorType::kQ5_0>;
    case TensorType::kQ5_1:
      return Dot8RowsAnyN<TensorType::kQ5_1>;
    case TensorType::kIQ4_NL:
      return Dot8RowsAnyN<TensorType::kIQ4_NL>;
    default:
      return nullptr;
  }
}

#else  // !SUBSPACE_HAVE_X86

QuantDot8Fn QuantDot8KernelAvx2(TensorType) { return nullptr; }

#endif  // SUBSPACE_HAVE_X86

}  // namespace subspace::cpu::internal
