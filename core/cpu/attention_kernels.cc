// Attention block kernels: the scalar twins (reference and fallback) and the AVX2/FMA/F16C
// versions. The AVX2 versions keep fp16/int8/int4 rows in their stored type and widen 8
// elements at a time in registers (F16C vcvtph2ps, vpmovsxbd + vcvtdq2ps; int4: four bytes
// broadcast, shifted per lane, masked, minus 8); an int8 or int4 row's scale multiplies the
// finished dot product (scores) or the softmax weight (accumulation), never the elements.
#include "core/cpu/attention_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/base/tensor_types.h"
#include "core/cpu/simd.h"

namespace subspace::cpu {
namespace {

using internal::Isa;

// Element i of row t, widened (scalar path). The int8/int4 row scale is applied by the caller.
inline float Elem(const KvRows& r, int64_t idx) {
  switch (r.dtype) {
    case CoeffDtype::kFp32:
      return static_cast<const float*>(r.data)[idx];
    case CoeffDtype::kFp16:
      return HalfToFloat(static_cast<const uint16_t*>(r.data)[idx]);
    case CoeffDtype::kInt8:
      return static_cast<float>(static_cast<const int8_t*>(r.data)[idx]);
    case CoeffDtype::kInt4:
      return static_cast<float>(Int4Code(static_cast<const uint8_t*>(r.data), idx));
  }
  return 0.0f;
}

inline float RowScale(const KvRows& r, int t) {
  return HasRowScale(r.dtype) ? HalfToFloat(r.scales[t]) : 1.0f;
}

void ScoresScalar(const float* q, int64_t q_stride, int group, KvRows k, int nb, int dim,
                  float scale, float* scores) {
  for (int g = 0; g < group; ++g) {
    const float* qg = q + g * q_stride;
    for (int t = 0; t < nb; ++t) {
      float sum = 0.0f;
      for (int d = 0; d < dim; ++d) sum += qg[d] * Elem(k, static_cast<int64_t>(t) * dim + d);
      scores[static_cast<int64_t>(g) * nb + t] = scale * RowScale(k, t) * sum;
    }
  }
}

void AccumulateScalar(const float* p, int group, KvRows v, int nb, int dim, float* acc,
                      int64_t acc_stride) {
  for (int g = 0; g < group; ++g) {
    float* ag = acc + g * acc_stride;
    for (int t = 0; t < nb; ++t) {
      const float w = p[static_cast<int64_t>(g) * nb + t] * RowScale(v, t);
      for (int d = 0; d < dim; ++d) ag[d] += w * Elem(v, static_cast<int64_t>(t) * dim + d);
    }
  }
}

float ExpSumScalar(float* s, int n, float max) {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - max);
    sum += s[i];
  }
  return sum;
}

void ScaleScalar(float* x, int n, float a) {
  for (int i = 0; i < n; ++i) x[i] *= a;
}

void ToFp16Scalar(const float* x, int n, uint16_t* out) {
  for (int i = 0; i < n; ++i) out[i] = Fp32ToFp16(x[i]);
}

float BlockScale(const uint8_t* block) {
  uint16_t h;
  std::memcpy(&h, block, sizeof(h));
  return Fp16ToFp32(h);
}

constexpr int64_t kQ8_0Bytes = 34;  // fp16 d + 32 int8
constexpr int64_t kQ4_0Bytes = 18;  // fp16 d + 16 bytes of nibbles

void DequantizeQ8_0Scalar(const uint8_t* src, int64_t blocks, float* dst) {
  for (int64_t b = 0; b < blocks; ++b, src += kQ8_0Bytes, dst += 32) {
    const float d = BlockScale(src);
    const auto* q = reinterpret_cast<const int8_t*>(src + 2);
    for (int j = 0; j < 32; ++j) dst[j] = d * static_cast<float>(q[j]);
  }
}

void DequantizeQ4_0Scalar(const uint8_t* src, int64_t blocks, float* dst) {
  for (int64_t b = 0; b < blocks; ++b, src += kQ4_0Bytes, dst += 32) {
    const float d = BlockScale(src);
    for (int j = 0; j < 16; ++j) {
      dst[j] = d * static_cast<float>((src[2 + j] & 0x0f) - 8);
      dst[16 + j] = d * static_cast<float>((src[2 + j] >> 4) - 8);
    }
  }
}

// Code t spans bits [t * bits, (t + 1) * bits): at most two bytes.
inline uint32_t CodeAt(const uint8_t* src, int bits, int t) {
  const int at = t * bits;
  const int byte = at >> 3;
  uint32_t window = src[byte];
  if ((at & 7) + bits > 8) window |= static_cast<uint32_t>(src[byte + 1]) << 8;
  return (window >> (at & 7)) & ((1u << bits) - 1u);
}

void DequantizeCodesScalar(const uint8_t* src, int bits, int n, float offset, float step,
                           float* dst) {
  for (int t = 0; t < n; ++t) dst[t] = offset + static_cast<float>(CodeAt(src, bits, t)) * step;
}

void CodeScoresScalar(const uint8_t* run, const int* bits, const int64_t* byte_at, int active,
                      int n, const float* w, int group, float* scores) {
  for (int g = 0; g < group; ++g) {
    for (int a = 0; a < active; ++a) {
      const float wa = w[static_cast<int64_t>(g) * active + a];
      for (int t = 0; t < n; ++t) {
        scores[static_cast<int64_t>(g) * n + t] +=
            wa * static_cast<float>(CodeAt(run + byte_at[a], bits[a], t));
      }
    }
  }
}

void CodeSumsScalar(const uint8_t* run, const int* bits, const int64_t* byte_at, int active, int n,
                    const float* p, int group, float* sums, int64_t sums_stride) {
  for (int g = 0; g < group; ++g) {
    for (int a = 0; a < active; ++a) {
      float* lanes = sums + g * sums_stride + static_cast<int64_t>(a) * 8;
      for (int t = 0; t < n; ++t) {
        lanes[t % 8] += p[static_cast<int64_t>(g) * n + t] *
                        static_cast<float>(CodeAt(run + byte_at[a], bits[a], t));
      }
    }
  }
}

constexpr AttentionKernels kScalarKernels = {
    ScoresScalar,     AccumulateScalar,     ExpSumScalar,         ScaleScalar,
    ToFp16Scalar,     DequantizeQ8_0Scalar, DequantizeQ4_0Scalar, DequantizeCodesScalar,
    CodeScoresScalar, CodeSumsScalar};

#ifdef SUBSPACE_HAVE_X86

// Eight elements of a row as fp32, and the scalar tail, per stored type.
template <CoeffDtype D>
SUBSPACE_AVX2 inline __m256 Load8(const void* base, int64_t idx) {
  if constexpr (D == CoeffDtype::kFp32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + idx);
  } else if constexpr (D == CoeffDtype::kFp16) {
    return simd::LoadF16(static_cast<const uint16_t*>(base) + idx);
  } else if constexpr (D == CoeffDtype::kInt8) {
    return simd::LoadI8(static_cast<const int8_t*>(base) + idx);
  } else {
    // idx is even (rows hold an even number of codes, d steps by 8): 8 codes in 4 bytes.
    uint32_t packed;
    std::memcpy(&packed, static_cast<const uint8_t*>(base) + idx / 2, sizeof(packed));
    const __m256i nibbles =
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(packed)),
                                           _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                         _mm256_set1_epi32(0x0f));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(nibbles, _mm256_set1_epi32(8)));
  }
}

template <CoeffDtype D>
SUBSPACE_AVX2 inline float Load1(const void* base, int64_t idx) {
  if constexpr (D == CoeffDtype::kFp32) {
    return static_cast<const float*>(base)[idx];
  } else if constexpr (D == CoeffDtype::kFp16) {
    return simd::F16ToF32(static_cast<const uint16_t*>(base)[idx]);
  } else if constexpr (D == CoeffDtype::kInt8) {
    return static_cast<float>(static_cast<const int8_t*>(base)[idx]);
  } else {
    return static_cast<float>(Int4Code(static_cast<const uint8_t*>(base), idx));
  }
}

template <CoeffDtype D>
SUBSPACE_AVX2 inline float RowScaleAvx2(const KvRows& r, int t) {
  if constexpr (D == CoeffDtype::kInt8 || D == CoeffDtype::kInt4) {
    return simd::F16ToF32(r.scales[t]);
  } else {
    return 1.0f;
  }
}

// q · row over dim elements. q: [dim]
template <CoeffDtype D>
SUBSPACE_AVX2 inline float Dot1(const float* q, const void* k, int64_t row0, int dim) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int d = 0;
  for (; d + 16 <= dim; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8<D>(k, row0 + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), Load8<D>(k, row0 + d + 8), a1);
  }
  if (d + 8 <= dim) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8<D>(k, row0 + d), a0);
    d += 8;
  }
  float sum = simd::HorizontalSum(_mm256_add_ps(a0, a1));
  for (; d < dim; ++d) sum += q[d] * Load1<D>(k, row0 + d);
  return sum;
}

// Per query, four rows at once with two accumulators each: eight FMA chains hide the FMA
// latency. (Tiling several queries per row slice, which loads each row once per group,
// measured slower with GCC 12: it reloads q from memory per FMA and spills the tails.)
// noinline: with all three dtypes inlined into the dispatching switch, GCC 12 ran out of
// registers and spilled q and the row pointers inside the hot loop (2x slower).
template <CoeffDtype D>
SUBSPACE_AVX2 __attribute__((noinline)) void ScoresAvx2T(const float* q, int64_t q_stride,
                                                         int group, KvRows k, int nb, int dim,
                                                         float scale, float* scores) {
  const void* kd = k.data;
  for (int g = 0; g < group; ++g) {
    const float* qg = q + g * q_stride;
    float* sg = scores + static_cast<int64_t>(g) * nb;
    int t = 0;
    for (; t + 4 <= nb; t += 4) {
      const int64_t r0 = static_cast<int64_t>(t) * dim, r1 = r0 + dim, r2 = r1 + dim, r3 = r2 + dim;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      int d = 0;
      for (; d + 16 <= dim; d += 16) {
        const __m256 qa = _mm256_loadu_ps(qg + d), qb = _mm256_loadu_ps(qg + d + 8);
        a0 = _mm256_fmadd_ps(qa, Load8<D>(kd, r0 + d), a0);
        a1 = _mm256_fmadd_ps(qa, Load8<D>(kd, r1 + d), a1);
        a2 = _mm256_fmadd_ps(qa, Load8<D>(kd, r2 + d), a2);
        a3 = _mm256_fmadd_ps(qa, Load8<D>(kd, r3 + d), a3);
        b0 = _mm256_fmadd_ps(qb, Load8<D>(kd, r0 + d + 8), b0);
        b1 = _mm256_fmadd_ps(qb, Load8<D>(kd, r1 + d + 8), b1);
        b2 = _mm256_fmadd_ps(qb, Load8<D>(kd, r2 + d + 8), b2);
        b3 = _mm256_fmadd_ps(qb, Load8<D>(kd, r3 + d + 8), b3);
      }
      if (d + 8 <= dim) {
        const __m256 qa = _mm256_loadu_ps(qg + d);
        a0 = _mm256_fmadd_ps(qa, Load8<D>(kd, r0 + d), a0);
        a1 = _mm256_fmadd_ps(qa, Load8<D>(kd, r1 + d), a1);
        a2 = _mm256_fmadd_ps(qa, Load8<D>(kd, r2 + d), a2);
        a3 = _mm256_fmadd_ps(qa, Load8<D>(kd, r3 + d), a3);
        d += 8;
      }
      float s[4] = {
          simd::HorizontalSum(_mm256_add_ps(a0, b0)), simd::HorizontalSum(_mm256_add_ps(a1, b1)),
          simd::HorizontalSum(_mm256_add_ps(a2, b2)), simd::HorizontalSum(_mm256_add_ps(a3, b3))};
      for (; d < dim; ++d) {
        s[0] += qg[d] * Load1<D>(kd, r0 + d);
        s[1] += qg[d] * Load1<D>(kd, r1 + d);
        s[2] += qg[d] * Load1<D>(kd, r2 + d);
        s[3] += qg[d] * Load1<D>(kd, r3 + d);
      }
      for (int i = 0; i < 4; ++i) sg[t + i] = scale * RowScaleAvx2<D>(k, t + i) * s[i];
    }
    for (; t < nb; ++t) {
      sg[t] = scale * RowScaleAvx2<D>(k, t) * Dot1<D>(qg, kd, static_cast<int64_t>(t) * dim, dim);
    }
  }
}

// G accumulator rows x C vectors of 8 columns stay in registers across all nb rows (acc is
// read and written once per block, not once per token); each widened row slice feeds all G.
// p: [G, nb] weights; acc: [G] rows at acc_stride, columns [d0, d0 + 8C)
template <CoeffDtype D, int G, int C>
SUBSPACE_AVX2 inline void AccumulateTile(const float* p, const KvRows& v, int nb, int dim, int d0,
                                         float* acc, int64_t acc_stride) {
  const void* vd = v.data;
  __m256 a[G][C];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) a[g][c] = _mm256_loadu_ps(acc + g * acc_stride + d0 + 8 * c);
  }
  for (int t = 0; t < nb; ++t) {
    const float rs = RowScaleAvx2<D>(v, t);
    __m256 rows[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) rows[c] = Load8<D>(vd, static_cast<int64_t>(t) * dim + d0 + 8 * c);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m256 w = _mm256_set1_ps(p[static_cast<int64_t>(g) * nb + t] * rs);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) a[g][c] = _mm256_fmadd_ps(w, rows[c], a[g][c]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * acc_stride + d0 + 8 * c, a[g][c]);
  }
}

template <CoeffDtype D, int G, int C>
SUBSPACE_AVX2 inline void AccumulateGroup(const float* p, const KvRows& v, int nb, int dim,
                                          float* acc, int64_t acc_stride) {
  int d = 0;
  for (; d + 8 * C <= dim; d += 8 * C) AccumulateTile<D, G, C>(p, v, nb, dim, d, acc, acc_stride);
  for (; d + 8 <= dim; d += 8) AccumulateTile<D, G, 1>(p, v, nb, dim, d, acc, acc_stride);
  for (; d < dim; ++d) {
    for (int g = 0; g < G; ++g) {
      float s = acc[g * acc_stride + d];
      for (int t = 0; t < nb; ++t) {
        s += p[static_cast<int64_t>(g) * nb + t] * RowScaleAvx2<D>(v, t) *
             Load1<D>(v.data, static_cast<int64_t>(t) * dim + d);
      }
      acc[g * acc_stride + d] = s;
    }
  }
}

template <CoeffDtype D>
SUBSPACE_AVX2 __attribute__((noinline)) void AccumulateAvx2T(const float* p, int group, KvRows v,
                                                             int nb, int dim, float* acc,
                                                             int64_t acc_stride) {
  int g = 0;
  for (; g + 4 <= group; g += 4) {
    AccumulateGroup<D, 4, 2>(p + static_cast<int64_t>(g) * nb, v, nb, dim, acc + g * acc_stride,
                             acc_stride);
  }
  const float* pg = p + static_cast<int64_t>(g) * nb;
  float* ag = acc + g * acc_stride;
  switch (group - g) {
    case 3:
      return AccumulateGroup<D, 3, 2>(pg, v, nb, dim, ag, acc_stride);
    case 2:
      return AccumulateGroup<D, 2, 4>(pg, v, nb, dim, ag, acc_stride);
    case 1:
      return AccumulateGroup<D, 1, 4>(pg, v, nb, dim, ag, acc_stride);
    default:
      return;
  }
}

SUBSPACE_AVX2 void ScoresAvx2(const float* q, int64_t q_stride, int group, KvRows k, int nb,
                              int dim, float scale, float* scores) {
  switch (k.dtype) {
    case CoeffDtype::kFp32:
      return ScoresAvx2T<CoeffDtype::kFp32>(q, q_stride, group, k, nb, dim, scale, scores);
    case CoeffDtype::kFp16:
      return ScoresAvx2T<CoeffDtype::kFp16>(q, q_stride, group, k, nb, dim, scale, scores);
    case CoeffDtype::kInt8:
      return ScoresAvx2T<CoeffDtype::kInt8>(q, q_stride, group, k, nb, dim, scale, scores);
    case CoeffDtype::kInt4:
      return ScoresAvx2T<CoeffDtype::kInt4>(q, q_stride, group, k, nb, dim, scale, scores);
  }
}

SUBSPACE_AVX2 void AccumulateAvx2(const float* p, int group, KvRows v, int nb, int dim, float* acc,
                                  int64_t acc_stride) {
  switch (v.dtype) {
    case CoeffDtype::kFp32:
      return AccumulateAvx2T<CoeffDtype::kFp32>(p, group, v, nb, dim, acc, acc_stride);
    case CoeffDtype::kFp16:
      return AccumulateAvx2T<CoeffDtype::kFp16>(p, group, v, nb, dim, acc, acc_stride);
    case CoeffDtype::kInt8:
      return AccumulateAvx2T<CoeffDtype::kInt8>(p, group, v, nb, dim, acc, acc_stride);
    case CoeffDtype::kInt4:
      return AccumulateAvx2T<CoeffDtype::kInt4>(p, group, v, nb, dim, acc, acc_stride);
  }
}

SUBSPACE_AVX2 float ExpSumAvx2(float* s, int n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 sum8 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = simd::Exp(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
    _mm256_storeu_ps(s + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = simd::HorizontalSum(sum8);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - max);
    sum += s[i];
  }
  return sum;
}

SUBSPACE_AVX2 void ScaleAvx2(float* x, int n, float a) {
  const __m256 a8 = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), a8));
  for (; i < n; ++i) x[i] *= a;
}

// F16C rounds to nearest even like Fp32ToFp16, so both ISAs store the same bits.
SUBSPACE_AVX2 void ToFp16Avx2(const float* x, int n, uint16_t* out) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), kRound));
  }
  for (; i < n; ++i) out[i] = Fp32ToFp16(x[i]);
}

// The products are the scalar twin's (one fp32 multiply of exactly converted integers), so both
// ISAs give the same bits.
SUBSPACE_AVX2 void DequantizeQ8_0Avx2(const uint8_t* src, int64_t blocks, float* dst) {
  for (int64_t b = 0; b < blocks; ++b, src += kQ8_0Bytes, dst += 32) {
    const __m256 d = _mm256_set1_ps(BlockScale(src));
    for (int j = 0; j < 32; j += 8) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 2 + j));
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(d, q));
    }
  }
}

SUBSPACE_AVX2 void DequantizeQ4_0Avx2(const uint8_t* src, int64_t blocks, float* dst) {
  const __m256i low = _mm256_set1_epi32(0x0f);
  const __m256i eight = _mm256_set1_epi32(8);
  for (int64_t b = 0; b < blocks; ++b, src += kQ4_0Bytes, dst += 32) {
    const __m256 d = _mm256_set1_ps(BlockScale(src));
    for (int j = 0; j < 16; j += 8) {
      const __m256i bytes =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 2 + j)));
      const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(bytes, low), eight);
      const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), eight);
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
      _mm256_storeu_ps(dst + 16 + j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)));
    }
  }
}

// The W bytes at src (W = 1..8) as the low bytes of a word, reading no further, as loads of
// whole integers (a memcpy of W bytes into a stack word stalls on store-to-load forwarding when
// W is not a power of two).
template <int W>
SUBSPACE_AVX2 inline uint64_t LoadBytesW(const uint8_t* src) {
  uint32_t u32 = 0;
  uint16_t u16 = 0;
  if constexpr (W == 8) {
    uint64_t u64;
    std::memcpy(&u64, src, 8);
    return u64;
  } else if constexpr (W >= 4) {
    std::memcpy(&u32, src, 4);
    uint64_t v = u32;
    if constexpr (W >= 6) {
      std::memcpy(&u16, src + 4, 2);
      v |= static_cast<uint64_t>(u16) << 32;
    }
    if constexpr (W == 5) v |= static_cast<uint64_t>(src[4]) << 32;
    if constexpr (W == 7) v |= static_cast<uint64_t>(src[6]) << 48;
    return v;
  } else if constexpr (W >= 2) {
    std::memcpy(&u16, src, 2);
    return W == 3 ? (u16 | (static_cast<uint64_t>(src[2]) << 16)) : u16;
  } else {
    return src[0];
  }
}

// Eight codes of W bits are W whole bytes: codes 0-3 in the low 4W bits, 4-7 in the next 4W
// (at most 32 bits each), broadcast to four lanes apiece, shifted per lane and masked.
template <int W>
SUBSPACE_AVX2 inline __m256 Codes8F(const uint8_t* src) {
  if constexpr (W == 8) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
  } else {
    const uint64_t v = LoadBytesW<W>(src);
    const auto lo = static_cast<int>(static_cast<uint32_t>(v));
    const auto hi = static_cast<int>(static_cast<uint32_t>(v >> (4 * W)));
    const __m256i shifts = _mm256_setr_epi32(0, W, 2 * W, 3 * W, 0, W, 2 * W, 3 * W);
    const __m256i codes = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi), shifts),
        _mm256_set1_epi32((1 << W) - 1));
    return _mm256_cvtepi32_ps(codes);
  }
}

// Calls f.template operator()<W>(a_begin, a_end) for each run of components of one width W:
// a run's codes widen with compile-time shifts. Runs are long when components are ordered by
// width, as the transform-coded cache stores them.
template <class F>
SUBSPACE_AVX2 __attribute__((always_inline)) inline void ForEachWidthRun(const int* bits,
                                                                         int active, F&& f) {
  for (int a = 0; a < active;) {
    int end = a + 1;
    while (end < active && bits[end] == bits[a]) ++end;
    switch (bits[a]) {
      case 1:
        f.template operator()<1>(a, end);
        break;
      case 2:
        f.template operator()<2>(a, end);
        break;
      case 3:
        f.template operator()<3>(a, end);
        break;
      case 4:
        f.template operator()<4>(a, end);
        break;
      case 5:
        f.template operator()<5>(a, end);
        break;
      case 6:
        f.template operator()<6>(a, end);
        break;
      case 7:
        f.template operator()<7>(a, end);
        break;
      default:
        f.template operator()<8>(a, end);
        break;
    }
    a = end;
  }
}

// offset + code * step as two roundings, like the scalar twin, so both give the same bits.
SUBSPACE_AVX2 void DequantizeCodesAvx2(const uint8_t* src, int bits, int n, float offset,
                                       float step, float* dst) {
  const __m256 off = _mm256_set1_ps(offset), st = _mm256_set1_ps(step);
  int t = 0;
  ForEachWidthRun(
      &bits, 1, [&]<int W>(int, int) SUBSPACE_AVX2 __attribute__((always_inline)) {
        for (; t + 8 <= n; t += 8, src += W) {
          _mm256_storeu_ps(dst + t, _mm256_add_ps(off, _mm256_mul_ps(Codes8F<W>(src), st)));
        }
      });
  // The tail: src has advanced t * bits bits (whole bytes).
  for (int i = 0; t < n; ++t, ++i) {
    dst[t] = offset + static_cast<float>(CodeAt(src, bits, i)) * step;
  }
}

// Up to four query heads' scores of eight tokens stay in registers over every component; each
// component's eight codes are widened once for all of them.
template <int G>
SUBSPACE_AVX2 inline void CodeScoresTile(const uint8_t* run, const int* bits,
                                         const int64_t* byte_at, int active, int n, int t0,
                                         const float* w, float* scores) {
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_loadu_ps(scores + static_cast<int64_t>(g) * n + t0);
  ForEachWidthRun(
      bits, active, [&]<int W>(int begin, int end) SUBSPACE_AVX2 __attribute__((always_inline)) {
        for (int a = begin; a < end; ++a) {
          const __m256 c = Codes8F<W>(run + byte_at[a] + (t0 / 8) * W);
          for (int g = 0; g < G; ++g) {
            acc[g] =
                _mm256_fmadd_ps(_mm256_set1_ps(w[static_cast<int64_t>(g) * active + a]), c, acc[g]);
          }
        }
      });
  for (int g = 0; g < G; ++g) _mm256_storeu_ps(scores + static_cast<int64_t>(g) * n + t0, acc[g]);
}

// Calls f.template operator()<G>(g0) for tiles of G <= 4 query heads from g0 covering
// [0, group): kernels keep a tile's accumulators in registers.
template <class F>
SUBSPACE_AVX2 __attribute__((always_inline)) inline void ForEachGroupTile(int group, F&& f) {
  int g = 0;
  for (; g + 4 <= group; g += 4) f.template operator()<4>(g);
  switch (group - g) {
    case 3:
      f.template operator()<3>(g);
      break;
    case 2:
      f.template operator()<2>(g);
      break;
    case 1:
      f.template operator()<1>(g);
      break;
    default:
      break;
  }
}

SUBSPACE_AVX2 void CodeScoresAvx2(const uint8_t* run, const int* bits, const int64_t* byte_at,
                                  int active, int n, const float* w, int group, float* scores) {
  const int whole = n / 8 * 8;
  for (int t0 = 0; t0 < whole; t0 += 8) {
    ForEachGroupTile(
        group, [&]<int G>(int g) SUBSPACE_AVX2 __attribute__((always_inline)) {
          CodeScoresTile<G>(run, bits, byte_at, active, n, t0, w + static_cast<int64_t>(g) * active,
                            scores + static_cast<int64_t>(g) * n);
        });
  }
  for (int g = 0; g < group; ++g) {
    for (int a = 0; a < active; ++a) {
      const float wa = w[static_cast<int64_t>(g) * active + a];
      for (int t = whole; t < n; ++t) {
        scores[static_cast<int64_t>(g) * n + t] +=
            wa * static_cast<float>(CodeAt(run + byte_at[a], bits[a], t));
      }
    }
  }
}

// Up to four query heads' partial sums of one component stay in registers over the tokens;
// each eight codes are widened once for all of them.
template <int G, int W>
SUBSPACE_AVX2 inline void CodeSumsTile(const uint8_t* src, int n, const float* p, float* sums,
                                       int64_t sums_stride) {
  const int whole = n / 8 * 8;
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_loadu_ps(sums + g * sums_stride);
  for (int t0 = 0; t0 < whole; t0 += 8) {
    const __m256 c = Codes8F<W>(src + (t0 / 8) * W);
    for (int g = 0; g < G; ++g) {
      acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(p + static_cast<int64_t>(g) * n + t0), c, acc[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* lanes = sums + g * sums_stride;
    _mm256_storeu_ps(lanes, acc[g]);
    for (int t = whole; t < n; ++t) {
      lanes[t % 8] += p[static_cast<int64_t>(g) * n + t] * static_cast<float>(CodeAt(src, W, t));
    }
  }
}

SUBSPACE_AVX2 void CodeSumsAvx2(const uint8_t* run, const int* bits, const int64_t* byte_at,
                                int active, int n, const float* p, int group, float* sums,
                                int64_t sums_stride) {
  ForEachWidthRun(
      bits, active, [&]<int W>(int begin, int end) SUBSPACE_AVX2 __attribute__((always_inline)) {
        for (int a = begin; a < end; ++a) {
          const uint8_t* src = run + byte_at[a];
          float* sa = sums + static_cast<int64_t>(a) * 8;
          ForEachGroupTile(
              group, [&]<int G>(int g) SUBSPACE_AVX2 __attribute__((always_inline)) {
                CodeSumsTile<G, W>(src, n, p + static_cast<int64_t>(g) * n, sa + g * sums_stride,
                                   sums_stride);
              });
        }
      });
}

constexpr AttentionKernels kAvx2Kernels = {
    ScoresAvx2,         AccumulateAvx2,     ExpSumAvx2,          ScaleAvx2,      ToFp16Avx2,
    DequantizeQ8_0Avx2, DequantizeQ4_0Avx2, DequantizeCodesAvx2, CodeScoresAvx2, CodeSumsAvx2};

#endif  // SUBSPACE_HAVE_X86

}  // namespace

const AttentionKernels& AttentionKernelsFor(Isa isa) {
#ifdef SUBSPACE_HAVE_X86
  if (isa >= Isa::kAvx2 && internal::DetectedIsa() >= Isa::kAvx2) return kAvx2Kernels;
#endif
  return kScalarKernels;
}

const AttentionKernels& ActiveAttentionKernels() {
  return AttentionKernelsFor(internal::ActiveIsa());
}

}  // namespace subspace::cpu
