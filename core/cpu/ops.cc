// The element-wise and per-row ops of the forward pass (everything in ops.h but MatMul).
// Reductions (RmsNorm, Softmax) and exp (SwiGlu, Softmax) have AVX2 versions because the
// generic x86-64 build cannot auto-vectorise them; the rest are plain loops.
#include "core/cpu/ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/cpu/matmul_internal.h"
#include "core/cpu/simd.h"

namespace subspace::cpu {
namespace {

using internal::ActiveIsa;
using internal::Isa;

// Element count below which an OpenMP fork/join (a few microseconds) costs more than the
// loop it would split.
constexpr int64_t kMinParallelElems = 1 << 15;

bool UseAvx2() { return ActiveIsa() >= Isa::kAvx2; }

// Sum of squares of x[0..n).
double SumSquaresScalar(const float* x, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

// out[i] = x[i] * scale * weight[i].   x, weight, out: [n]
void ScaleMulScalar(const float* x, const float* weight, float scale, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

// gate, up, out: [n]
void SwiGluScalar(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

#ifdef SUBSPACE_HAVE_X86

// x: [n]
SUBSPACE_AVX2 double SumSquaresAvx2(const float* x, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i);
    const __m256 b = _mm256_loadu_ps(x + i + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  double sum = simd::HorizontalSum(_mm256_add_ps(acc0, acc1));
  return sum + SumSquaresScalar(x + i, n - i);
}

// x, weight, out: [n]
SUBSPACE_AVX2 void ScaleMulAvx2(const float* x, const float* weight, float scale, int64_t n,
                                float* out) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), s);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_loadu_ps(weight + i)));
  }
  ScaleMulScalar(x + i, weight + i, scale, n - i, out + i);
}

// gate, up, out: [n]
SUBSPACE_AVX2 void SwiGluAvx2(const float* gate, const float* up, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = simd::Exp(_mm256_xor_ps(g, sign));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  SwiGluScalar(gate + i, up + i, n - i, out + i);
}

// x: [n], n >= 1
SUBSPACE_AVX2 void SoftmaxAvx2(float* x, int64_t n) {
  int64_t i = 0;
  float max = x[0];
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    max = simd::HorizontalMax(m);
  }
  for (; i < n; ++i) max = std::max(max, x[i]);

  const __m256 vmax = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = simd::Exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  double sum = simd::HorizontalSum(acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }

  const __m256 inv = _mm256_set1_ps(static_cast<float>(1.0 / sum));
  for (i = 0; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  }
  for (; i < n; ++i) x[i] *= static_cast<float>(1.0 / sum);
}

#endif  // SUBSPACE_HAVE_X86

// x, weight, out: [dim]
void RmsNormRow(const float* x, const float* weight, int64_t dim, float eps, bool avx2,
                float* out) {
#ifdef SUBSPACE_HAVE_X86
  if (avx2) {
    const double ss = SumSquaresAvx2(x, dim);
    ScaleMulAvx2(x, weight, static_cast<float>(1.0 / std::sqrt(ss / dim + eps)), dim, out);
    return;
  }
#endif
  const double ss = SumSquaresScalar(x, dim);
  ScaleMulScalar(x, weight, static_cast<float>(1.0 / std::sqrt(ss / dim + eps)), dim, out);
}

}  // namespace

void Embed(const WeightMatrix& table, const int32_t* tokens, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    float* dst = out + i * table.cols;
    if (tokens[i] < 0 || tokens[i] >= table.rows) {
      // Callers validate ids; a zero row keeps a stray id from reading outside the table.
      std::fill_n(dst, table.cols, 0.0f);
      continue;
    }
    internal::ConvertRowsToF32(table, tokens[i], 1, dst);
  }
}

void RmsNorm(const float* x, const float* weight, int64_t n, int64_t dim, float eps, float* out) {
  const bool avx2 = UseAvx2();
  const bool parallel = n > 1 && n * dim >= kMinParallelElems;
#pragma omp parallel for schedule(static) num_threads(internal::NumThreads()) if (parallel)
  for (int64_t i = 0; i < n; ++i) {
    RmsNormRow(x + i * dim, weight, dim, eps, avx2, out + i * dim);
  }
}

void Rope(float* x, int64_t n, int n_heads, int head_dim, const RopeSchedule& rope,
          const int64_t* positions) {
  const int pairs = std::min(rope.dim, head_dim) / 2;
  // Each element costs a few flops more here than in the other ops (and a sincos per pair).
  const bool parallel = n > 1 && n * n_heads * pairs >= kMinParallelElems / 4;
#pragma omp parallel num_threads(internal::NumThreads()) if (parallel)
  {
    std::vector<float> cos_sin(2 * pairs);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      RopeCosSin(rope, positions[i], pairs, cos_sin.data());
      RotatePairs(x + i * n_heads * head_dim, n_heads, head_dim, rope, cos_sin.data());
    }
  }
}

void RopeCosSin(const RopeSchedule& rope, int64_t pos, int pairs, float* cos_sin) {
  for (int p = 0; p < pairs; ++p) {
    const double angle = static_cast<double>(pos) * rope.inv_freq[static_cast<size_t>(p)];
    cos_sin[2 * p] = static_cast<float>(std::cos(angle) * rope.mscale);
    cos_sin[2 * p + 1] = static_cast<float>(std::sin(angle) * rope.mscale);
  }
}

void RotatePairs(float* row, int n_heads, int head_dim, const RopeSchedule& rope,
                 const float* cos_sin) {
  const int pairs = std::min(rope.dim, head_dim) / 2;
  // With kHalves, pair p is (p, p + dim/2); with kAdjacentPairs (2p, 2p + 1).
  const bool halves = rope.layout == RopeLayout::kHalves;
  const int stride = halves ? 1 : 2;
  const int offset = halves ? rope.dim / 2 : 1;
  for (int h = 0; h < n_heads; ++h) {
    float* head = row + static_cast<int64_t>(h) * head_dim;
    for (int p = 0; p < pairs; ++p) {
      const float c = cos_sin[2 * p];
      const float s = cos_sin[2 * p + 1];
      float* a = head + p * stride;
      float* b = a + offset;
      const float x0 = *a;
      const float x1 = *b;
      *a = x0 * c - x1 * s;
      *b = x0 * s + x1 * c;
    }
  }
}

void AddBias(float* x, const float* bias, int64_t n, int64_t width) {
  for (int64_t i = 0; i < n; ++i) {
    float* row = x + i * width;
    for (int64_t j = 0; j < width; ++j) row[j] += bias[j];
  }
}

void SwiGlu(const float* gate, const float* up, int64_t n, float* out) {
  const bool avx2 = UseAvx2();
  // Whole multiples of 64 elements per thread keep the vector loops free of tails.
  const int64_t chunk = 64;
  const int64_t chunks = (n + chunk - 1) / chunk;
  const bool parallel = n >= kMinParallelElems;
#pragma omp parallel for schedule(static) num_threads(internal::NumThreads()) if (parallel)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * chunk;
    const int64_t count = std::min(chunk, n - begin);
#ifdef SUBSPACE_HAVE_X86
    if (avx2) {
      SwiGluAvx2(gate + begin, up + begin, count, out + begin);
      continue;
    }
#endif
    SwiGluScalar(gate + begin, up + begin, count, out + begin);
  }
}

void AddInPlace(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void Softmax(float* x, int64_t n) {
  if (n <= 0) return;
#ifdef SUBSPACE_HAVE_X86
  if (UseAvx2()) {
    SoftmaxAvx2(x, n);
    return;
  }
#endif
  float max = x[0];
  for (int64_t i = 1; i < n; ++i) max = std::max(max, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace subspace::cpu
