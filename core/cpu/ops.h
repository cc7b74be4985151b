// CPU kernels of the Llama forward pass. fp32 activations; weights are read in their
// stored type (F32, F16, BF16 and the GGUF quantized types). Each op has a plain-loop twin in the
// tests. Threads: every op may use all cores (OpenMP); callers must not call them from inside an
// OpenMP parallel region. MatMul's prefill path calls OpenBLAS from each OpenMP thread and so
// sets OpenBLAS itself to one thread (openblas_set_num_threads(1)) on first use: one thread
// pool serves every op, instead of two pools spinning against each other.
#ifndef SUBSPACE_CORE_CPU_OPS_H_
#define SUBSPACE_CORE_CPU_OPS_H_

#include <cstdint>

#include "absl/types/span.h"
#include "core/base/rope.h"
#include "core/base/weight.h"

namespace subspace::cpu {

// Threads the ops use; 0 (the default) means OpenMP's default (OMP_NUM_THREADS, else all
// cores). Applies process-wide, whichever thread calls the ops.
void SetNumThreads(int num_threads);

// y[n, w.rows] = x[n, w.cols] · wᵀ.
// Small n (decode) streams the weight rows once in their stored type; large n (prefill)
// converts tiles of rows to fp32 and calls sgemm.
void MatMul(const WeightMatrix& w, const float* x, int64_t n, float* y);

// One weight and its output for MatMuls.   y: [n, w->rows]
struct MatMulOutput {
  const WeightMatrix* w;
  float* y;
};
// MatMul for several weights that read the same x (a layer's Q, K and V projections, its gate
// and up projections). At decode sizes, with equal w->cols, x is quantized once per activation
// type and all rows of all weights are split over the threads in one parallel region, instead
// of one fork and join, one tail of idle threads and one quantization of x per weight; weights
// of other widths get one MatMul each.
void MatMuls(absl::Span<const MatMulOutput> outputs, const float* x, int64_t n);

// out[i, :] = table row tokens[i] as fp32.   table: [vocab, dim], out: [n, dim]
void Embed(const WeightMatrix& table, const int32_t* tokens, int64_t n, float* out);

// out[i, :] = x[i, :] / rms(x[i, :]) * weight.   x, out: [n, dim]; weight: [dim]
void RmsNorm(const float* x, const float* weight, int64_t n, int64_t dim, float eps, float* out);

// In-place rotary embedding of the first rope.dim dims of every head: pair i -- (x[2i],
// x[2i+1]) or (x[i], x[i + dim/2]) by rope.layout -- rotated by pos * rope.inv_freq[i].
// x: [n, n_heads, head_dim]; positions: [n]; rope.dim <= head_dim.
void Rope(float* x, int64_t n, int n_heads, int head_dim, const RopeSchedule& rope,
          const int64_t* positions);
// The cos and sin (times rope.mscale) of position `pos` for the first `pairs` pairs, as Rope
// uses them. cos_sin: [pairs][2]
void RopeCosSin(const RopeSchedule& rope, int64_t pos, int pairs, float* cos_sin);
// One row of Rope with its angles given: the first rope.dim dims of every head rotated pair by
// pair (laid out as rope.layout says) by cos_sin ([rope.dim / 2][2]: cos, sin, the scale
// included). For callers that keep a table of them. row: [n_heads, head_dim]
void RotatePairs(float* row, int n_heads, int head_dim, const RopeSchedule& rope,
                 const float* cos_sin);

// x[i, :] += bias.   x: [n, width]; bias: [width]
void AddBias(float* x, const float* bias, int64_t n, int64_t width);

// out[i] = silu(gate[i]) * up[i].   all [n]
void SwiGlu(const float* gate, const float* up, int64_t n, float* out);

// x[i] += y[i].   [n]
void AddInPlace(float* x, const float* y, int64_t n);

// Numerically stable in-place softmax of x[0..n).
void Softmax(float* x, int64_t n);

}  // namespace subspace::cpu

#endif  // SUBSPACE_CORE_CPU_OPS_H_
