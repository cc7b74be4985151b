// AVX2/FMA/F16C kernels of MatMul for the float types: the decode kernel, which converts weight
// rows from their stored type in registers and multiplies them with groups of up to 4
// activation rows, and the row converter the prefill path feeds to sgemm (all types; the block
// types through quant_dot_avx2.cc). Quantized weights decode with integer dots instead
// (quant_dot_avx2.cc). Chosen at run time, hence target attributes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/cpu/matmul_internal.h"
#include "core/cpu/simd.h"

namespace subspace::cpu::internal {

#ifdef SUBSPACE_HAVE_X86
namespace {

using simd::HorizontalSum;

// Weights are consumed in chunks of 32 (one Q8_0 block): Open() reads a chunk's header,
// Sub(chunk, s) yields its s-th group of 8 weights as fp32. Tail() converts the last
// cols % 32 weights of a row (never needed for Q8_0, whose rows are whole blocks).
constexpr int64_t kChunk = 32;

struct F32Weights {
  static constexpr int64_t kChunkBytes = kChunk * 4;
  struct Chunk {
    const float* p;
  };
  SUBSPACE_AVX2 static Chunk Open(const uint8_t* p) { return {reinterpret_cast<const float*>(p)}; }
  SUBSPACE_AVX2 static __m256 Sub(const Chunk& c, int s) { return _mm256_loadu_ps(c.p + 8 * s); }
  // src: [count] fp32 (any alignment), dst: [count]
  static void Tail(const uint8_t* src, int64_t count, float* dst) {
    std::memcpy(dst, src, count * sizeof(float));
  }
};

struct F16Weights {
  static constexpr int64_t kChunkBytes = kChunk * 2;
  struct Chunk {
    const uint16_t* p;
  };
  SUBSPACE_AVX2 static Chunk Open(const uint8_t* p) {
    return {reinterpret_cast<const uint16_t*>(p)};
  }
  SUBSPACE_AVX2 static __m256 Sub(const Chunk& c, int s) { return simd::LoadF16(c.p + 8 * s); }
  // src: [count] fp16 (any alignment), dst: [count]
  SUBSPACE_AVX2 static void Tail(const uint8_t* src, int64_t count, float* dst) {
    for (int64_t i = 0; i < count; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      dst[i] = simd::F16ToF32(h);
    }
  }
};

struct Bf16Weights {
  static constexpr int64_t kChunkBytes = kChunk * 2;
  struct Chunk {
    const uint16_t* p;
  };
  SUBSPACE_AVX2 static Chunk Open(const uint8_t* p) {
    return {reinterpret_cast<const uint16_t*>(p)};
  }
  SUBSPACE_AVX2 static __m256 Sub(const Chunk& c, int s) { return simd::LoadBf16(c.p + 8 * s); }
  // src: [count] bf16 (any alignment), dst: [count]
  static void Tail(const uint8_t* src, int64_t count, float* dst) {
    for (int64_t i = 0; i < count; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      dst[i] = Bf16ToFp32(h);
    }
  }
};

struct Q8Weights {
  static constexpr int64_t kChunkBytes = sizeof(BlockQ8_0);
  struct Chunk {
    const int8_t* q;
    __m256 scale;
  };
  SUBSPACE_AVX2 static Chunk Open(const uint8_t* p) {
    uint16_t scale;
    std::memcpy(&scale, p, 2);
    return {reinterpret_cast<const int8_t*>(p + 2), _mm256_set1_ps(simd::F16ToF32(scale))};
  }
  // Scaling each weight (rather than each block's partial sum) costs one multiply per 8
  // weights and keeps one accumulator per output; the kernel is bandwidth-bound anyway.
  SUBSPACE_AVX2 static __m256 Sub(const Chunk& c, int s) {
    return _mm256_mul_ps(simd::LoadI8(c.q + 8 * s), c.scale);
  }
  static void Tail(const uint8_t*, int64_t, float*) {}
};

// Output rows per tile for N activation rows: R*N accumulators + R weight vectors + 1
// activation vector must fit the 16 ymm registers. Groups stop at N = 4 (3 x 4 tiles): each
// step then loads 7 vectors for 12 FMAs, where one 1 x 8 tile would load 9 for 8.
constexpr int RowsPerTile(int n) { return n <= 2 ? 4 : 3; }
constexpr int kMaxGroup = 4;

// y[j, r] = dot(weight row r, x row j) for R rows and N activation rows.
// rows: first of R weight rows, row_bytes apart; x: [N, x_stride];
// x_tail: [N, kChunk] the last cols % 32 activations of each row, zero-padded;
// y: [N, y_stride] (R consecutive columns written)
template <typename W, int R, int N>
SUBSPACE_AVX2 void DecodeTile(const uint8_t* rows, uint64_t row_bytes, int64_t cols, const float* x,
                              int64_t x_stride, const float* x_tail, float* y, int64_t y_stride) {
  __m256 acc[R][N];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  const int64_t chunks = cols / kChunk;
  for (int64_t c = 0; c < chunks; ++c) {
    typename W::Chunk chunk[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) chunk[r] = W::Open(rows + r * row_bytes + c * W::kChunkBytes);
    const float* xc = x + c * kChunk;
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      __m256 wv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) wv[r] = W::Sub(chunk[r], s);
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) {
        const __m256 xv = _mm256_loadu_ps(xc + j * x_stride + 8 * s);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]);
      }
    }
  }
  const int64_t tail = cols - chunks * kChunk;
  if (tail > 0) {
    float wt[R][kChunk] = {};
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      W::Tail(rows + r * row_bytes + chunks * W::kChunkBytes, tail, wt[r]);
    }
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 8
      for (int j = 0; j < N; ++j) {
        const __m256 xv = _mm256_loadu_ps(x_tail + j * kChunk + 8 * s);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(wt[r] + 8 * s), xv, acc[r][j]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) y[j * y_stride + r] = HorizontalSum(acc[r][j]);
  }
}

// Rows [row_begin, row_end) against N activation rows: full tiles, then single rows.
template <typename W, int N>
SUBSPACE_AVX2 void DecodeGroup(const WeightMatrix& w, int64_t row_begin, int64_t row_end,
                               const float* x, const float* x_tail, float* y) {
  const uint64_t row_bytes = w.row_bytes();
  int64_t r = row_begin;
  constexpr int R = RowsPerTile(N);
  for (; r + R <= row_end; r += R) {
    DecodeTile<W, R, N>(w.row(r), row_bytes, w.cols, x, w.cols, x_tail, y + r, w.rows);
  }
  for (; r < row_end; ++r) {
    DecodeTile<W, 1, N>(w.row(r), row_bytes, w.cols, x, w.cols, x_tail, y + r, w.rows);
  }
}

template <typename W>
SUBSPACE_AVX2 void DecodeRows(const WeightMatrix& w, const float* x, int64_t n, int64_t row_begin,
                              int64_t row_end, float* y) {
  constexpr int64_t kGroup = kMaxGroup;  // activation rows kept in registers at once
  const int64_t cols = w.cols;
  const int64_t tail = cols % kChunk;
  // Zero-padded copies of each activation row's last cols % 32 values, so the tail runs the
  // same vector code. Small n uses the stack; larger n allocate.
  constexpr int64_t kSmallN = 8;
  float small_tail[kSmallN * kChunk];
  std::vector<float> big_tail;
  float* x_tail = small_tail;
  if (tail > 0) {
    if (n > kSmallN) {
      big_tail.resize(n * kChunk);
      x_tail = big_tail.data();
    }
    for (int64_t j = 0; j < n; ++j) {
      std::fill_n(x_tail + j * kChunk, kChunk, 0.0f);
      std::copy_n(x + j * cols + (cols - tail), tail, x_tail + j * kChunk);
    }
  }
  // Row blocks outer, activation groups inner: a block of weight rows is read from memory
  // once and stays in L1/L2 while each group of activation rows passes over it, so the
  // weights cross the memory bus once whatever n is.
  constexpr int64_t kRowBlock = 12;  // divides kDecodeRowAlign
  for (int64_t rb = row_begin; rb < row_end; rb += kRowBlock) {
    const int64_t re = std::min(rb + kRowBlock, row_end);
    for (int64_t j0 = 0; j0 < n; j0 += kGroup) {
      const float* xg = x + j0 * cols;
      const float* tg = x_tail + j0 * kChunk;
      float* yg = y + j0 * w.rows;
      switch (std::min(kGroup, n - j0)) {
        case 1:
          DecodeGroup<W, 1>(w, rb, re, xg, tg, yg);
          break;
        case 2:
          DecodeGroup<W, 2>(w, rb, re, xg, tg, yg);
          break;
        case 3:
          DecodeGroup<W, 3>(w, rb, re, xg, tg, yg);
          break;
        default:
          DecodeGroup<W, 4>(w, rb, re, xg, tg, yg);
          break;
      }
    }
  }
}

template <typename W>
SUBSPACE_AVX2 void ConvertRows(const WeightMatrix& w, int64_t first_row, int64_t num_rows,
                               float* dst) {
  const int64_t chunks = w.cols / kChunk;
  const int64_t tail = w.cols - chunks * kChunk;
  for (int64_t i = 0; i < num_rows; ++i) {
    const uint8_t* row = w.row(first_row + i);
    float* out = dst + i * w.cols;
    for (int64_t c = 0; c < chunks; ++c) {
      const typename W::Chunk chunk = W::Open(row + c * W::kChunkBytes);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) _mm256_storeu_ps(out + c * kChunk + 8 * s, W::Sub(chunk, s));
    }
    if (tail > 0) W::Tail(row + chunks * W::kChunkBytes, tail, out + chunks * kChunk);
  }
}

}  // namespace

void DecodeRowsAvx2(const WeightMatrix& w, const float* x, int64_t n, int64_t row_begin,
                    int64_t row_end, float* y) {
  switch (w.type) {
    case TensorType::kF32:
      return DecodeRows<F32Weights>(w, x, n, row_begin, row_end, y);
    case TensorType::kF16:
      return DecodeRows<F16Weights>(w, x, n, row_begin, row_end, y);
    case TensorType::kBF16:
      return DecodeRows<Bf16Weights>(w, x, n, row_begin, row_end, y);
    default:
      break;  // quantized types take MatMulDecode's integer path (quant_dot_avx2.cc)
  }
  DecodeRowsScalar(w, x, n, row_begin, row_end, y);
}

void ConvertRowsToF32Avx2(const WeightMatrix& w, int64_t first_row, int64_t num_rows, float* dst) {
  switch (w.type) {
    case TensorType::kF32:
      return ConvertRows<F32Weights>(w, first_row, num_rows, dst);
    case TensorType::kF16:
      return ConvertRows<F16Weights>(w, first_row, num_rows, dst);
    case TensorType::kBF16:
      return ConvertRows<Bf16Weights>(w, first_row, num_rows, dst);
    case TensorType::kQ8_0:
      return ConvertRows<Q8Weights>(w, first_row, num_rows, dst);
    default:
      break;
  }
  for (int64_t i = 0; i < num_rows; ++i) {
    if (!DequantizeRowAvx2(w.type, w.row(first_row + i), dst + i * w.cols, w.cols)) {
      DequantizeRow(w.type, w.row(first_row + i), dst + i * w.cols, w.cols);
    }
  }
}

#else  // !SUBSPACE_HAVE_X86: DetectedIsa() never reports AVX2, these only keep the link whole.

void DecodeRowsAvx2(const WeightMatrix& w, const float* x, int64_t n, int64_t row_begin,
                    int64_t row_end, float* y) {
  DecodeRowsScalar(w, x, n, row_begin, row_end, y);
}

void ConvertRowsToF32Avx2(const WeightMatrix& w, int64_t first_row, int64_t num_rows, float* dst) {
  for (int64_t i = 0; i < num_rows; ++i) {
    DequantizeRow(w.type, w.row(first_row + i), dst + i * w.cols, w.cols);
  }
}

#endif  // SUBSPACE_HAVE_X86

}  // namespace subspace::cpu::internal
