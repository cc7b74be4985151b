// Internals of the CPU backend shared by its .cc files, the tests and the benchmark: runtime
// ISA selection (with a switch the tests use to force the scalar fallback), the two MatMul
// paths callable directly, and weight-row conversion to fp32.
#ifndef SUBSPACE_CORE_CPU_MATMUL_INTERNAL_H_
#define SUBSPACE_CORE_CPU_MATMUL_INTERNAL_H_

#include <cstdint>

#include "absl/types/span.h"
#include "core/base/weight.h"
#include "core/cpu/ops.h"

namespace subspace::cpu::internal {

// Ordered: a level implies the ones below it.
enum class Isa : int {
  kScalar = 0,
  kAvx2 = 1,  // AVX2 + FMA + F16C
};

// What this CPU supports (detected once).
Isa DetectedIsa();
// min(DetectedIsa(), the cap set by SetMaxIsa). Every kernel dispatches on this.
Isa ActiveIsa();
// Caps the ISA the kernels use, e.g. kScalar to test the fallback. Process-wide; not meant to
// be flipped while another thread runs a kernel.
void SetMaxIsa(Isa isa);

class ScopedMaxIsa {
 public:
  explicit ScopedMaxIsa(Isa isa);
  ~ScopedMaxIsa();
  ScopedMaxIsa(const ScopedMaxIsa&) = delete;
  ScopedMaxIsa& operator=(const ScopedMaxIsa&) = delete;

 private:
  Isa previous_;
};

// What SetNumThreads asked for, or OpenMP's default. Every parallel region uses this.
int NumThreads();

// MatMul uses the decode path for n <= DecodeMaxN(type) and the prefill path above it: the
// decode kernel keeps up with convert + sgemm well past n = 8 (cross-over measured with
// bench/matmul_bench.cc --paths=both; see matmul.cc).
int64_t DecodeMaxN(TensorType type);

// Both paths accept any n >= 1; MatMul picks one. Same contract as cpu::MatMul.
// x: [n, w.cols], y: [n, w.rows]
void MatMulDecode(const WeightMatrix& w, const float* x, int64_t n, float* y);
void MatMulPrefill(const WeightMatrix& w, const float* x, int64_t n, float* y);
// The decode path of MatMuls: every output in one parallel region.
void MatMulsDecode(absl::Span<const MatMulOutput> outputs, const float* x, int64_t n);

// Rows [first_row, first_row + num_rows) of w as fp32, on the calling thread.
// dst: [num_rows, w.cols]
void ConvertRowsToF32(const WeightMatrix& w, int64_t first_row, int64_t num_rows, float* dst);

// Rows of w the prefill path converts per sgemm call; 0 restores the default. For the
// benchmark's panel-size sweep.
void SetPrefillPanelRows(int64_t rows);

// Decode kernels work on blocks of this many rows; MatMulDecode's thread split keeps to them.
inline constexpr int64_t kDecodeRowAlign = 24;  // whole float tiles (3, 4) and 8-row groups

// The decode kernels behind MatMulDecode, for output rows [row_begin, row_end) on the calling
// thread; MatMulDecode splits the rows over threads.
// x: [n, w.cols], y: [n, w.rows] (only columns [row_begin, row_end) are written)
void DecodeRowsScalar(const WeightMatrix& w, const float* x, int64_t n, int64_t row_begin,
                      int64_t row_end, float* y);
void DecodeRowsAvx2(const WeightMatrix& w, const float* x, int64_t n, int64_t row_begin,
                    int64_t row_end, float* y);
// dst: [num_rows, w.cols]
void ConvertRowsToF32Avx2(const WeightMatrix& w, int64_t first_row, int64_t num_rows, float* dst);

// dot(quantized weight row, quantized activation row) over n values; the activation row is in
// DotActivationType(weight type) (core/base/quant_blocks.h).
using QuantDotFn = float (*)(const uint8_t* row, const uint8_t* act, int64_t n);
// The kernel for `type` at the active ISA: the AVX2 one, else the scalar twin.
QuantDotFn QuantDotKernel(TensorType type);
// The AVX2 kernel for `type`; nullptr where there is none (or no x86).
QuantDotFn QuantDotKernelAvx2(TensorType type);
// Eight consecutive weight rows (row_bytes apart) against n_act activation rows (act_stride
// bytes apart): out[j * out_stride + r] = dot(row r, activation row j), r = 0..7. act_sums
// [n_act, n / 32] holds each activation block's sum of codes (ActivationBlockSums); q4_0 and q5_0
// read it, the others may pass nullptr. Where a type has one (q4_0, q4_1, q5_0, q5_1, iq4_nl;
// q8_0 from two activation rows on), MatMul's decode path takes rows in groups of eight.
using QuantDot8Fn = void (*)(const uint8_t* rows, uint64_t row_bytes, const uint8_t* act,
                             uint64_t act_stride, const int32_t* act_sums, int64_t n_act, int64_t n,
                             float* out, int64_t out_stride);
QuantDot8Fn QuantDot8KernelAvx2(TensorType type);
// sums[b] = the sum of the int8 codes of block b of a q8_0 activation row of n values.
void ActivationBlockSums(const uint8_t* act, int64_t n, int32_t* sums);

// QuantizeActivationRow (core/base) for q8_0, q8_1 and q8_K with AVX2, bit for bit; false (and
// nothing written) for other types.
bool QuantizeActivationRowAvx2(TensorType act_type, const float* x, uint8_t* dst, int64_t n);
// QuantizeActivationRow at the active ISA.
void QuantizeActivations(TensorType act_type, const float* x, uint8_t* dst, int64_t n);

// Dequantizes n values of a row with AVX2 where written for `type` (q4_0, q5_0, iq4_nl, q3_K ..
// q6_K), equal to DequantizeRow to fp32 rounding of the fused multiply-add; false (and
// nothing written) for other types.
bool DequantizeRowAvx2(TensorType type, const uint8_t* row, float* out, int64_t n);

}  // namespace subspace::cpu::internal

#endif  // SUBSPACE_CORE_CPU_MATMUL_INTERNAL_H_
