// Inner loops of CPU decode/prefill attention over one block of B tokens: q·k scores for a
// GQA group, the softmax exponentials, and the probability-weighted accumulation of value
// rows. Rows are fp32 / fp16 (full-rank blocks) or low-rank coefficients in fp32 / fp16 / int8
// with one fp16 scale per row, read in their stored type. Each kernel has a scalar twin and an
// AVX2/FMA/F16C version, picked at run time like the MatMul kernels (cpu::internal::ActiveIsa).
#ifndef SUBSPACE_CORE_CPU_ATTENTION_KERNELS_H_
#define SUBSPACE_CORE_CPU_ATTENTION_KERNELS_H_

#include <cstdint>

#include "core/base/coeff_codec.h"
#include "core/cpu/matmul_internal.h"

namespace subspace::cpu {

// nb rows of `dim` elements, row stride `dim`, as the cache stores them.
struct KvRows {
  const void* data = nullptr;        // [nb, dim] fp32, fp16 bits, int8 or int4 codes (dim even)
  const uint16_t* scales = nullptr;  // [nb] fp16 row scales (kInt8 and kInt4 only)
  CoeffDtype dtype = CoeffDtype::kFp32;
};

struct AttentionKernels {
  // scores[g * nb + t] = scale * q_g · row_t for g < group, t < nb.
  // q: [group] rows of dim at stride q_stride; scores: [group, nb]
  void (*scores)(const float* q, int64_t q_stride, int group, KvRows k, int nb, int dim,
                 float scale, float* scores);
  // acc_g += sum_t p[g * nb + t] * row_t for g < group.
  // p: [group, nb]; acc: [group] rows of dim at stride acc_stride
  void (*accumulate)(const float* p, int group, KvRows v, int nb, int dim, float* acc,
                     int64_t acc_stride);
  // s[i] = exp(s[i] - max) in place; returns their sum. s: [n]
  float (*exp_sum)(float* s, int n, float max);
  // x[i] *= a. x: [n]
  void (*scale)(float* x, int n, float a);
  // out[i] = fp16(x[i]), round to nearest even (full-rank K/V rows as the cache stores them).
  // x: [n]; out: [n] fp16 bits
  void (*to_fp16)(const float* x, int n, uint16_t* out);
  // `blocks` consecutive q8_0 blocks (fp16 d, int8 q[32]: x = d q) into dst [blocks * 32],
  // the rows of a quantized paged cache (core/kvcache/kv_quant.h has the format).
  void (*dequantize_q8_0)(const uint8_t* src, int64_t blocks, float* dst);
  // The same for q4_0 blocks (fp16 d, 16 bytes: value j in the low nibble of byte j, value
  // j + 16 in its high nibble; x = d (q - 8)).
  void (*dequantize_q4_0)(const uint8_t* src, int64_t blocks, float* dst);
  // n codes of `bits` bits (1..8) packed least significant bit first from bit 0 of src (the
  // ceil(n * bits / 8) bytes of one component of a transform-coded block), as floats
  // dst[t] = offset + code_t * step. dst: [n]
  void (*dequantize_codes)(const uint8_t* src, int bits, int n, float offset, float step,
                           float* dst);
  // One KV head's run of a transform-coded block, component-major: component a < active holds
  // n codes of bits[a] bits from byte byte_at[a], packed as dequantize_codes reads them; code_a(t)
  // is the integer code. The kernels below read the codes in registers, never widening a run.
  // scores[g * n + t] += sum_a w[g * active + a] * code_a(t) for g < group, t < n.
  // w: [group, active]; scores: [group, n]
  void (*code_scores)(const uint8_t* run, const int* bits, const int64_t* byte_at, int active,
                      int n, const float* w, int group, float* scores);
  // sums[g * sums_stride + a * 8 + t % 8] += p[g * n + t] * code_a(t) for g < group, t < n:
  // per component, eight partial sums of the weighted codes (their total is the caller's).
  // p: [group, n]; sums: [group] blocks of [active, 8] at sums_stride
  void (*code_sums)(const uint8_t* run, const int* bits, const int64_t* byte_at, int active, int n,
                    const float* p, int group, float* sums, int64_t sums_stride);
};

// Asks for [p, p + bytes) to be brought into cache. Blocks sit on scattered pool pages, so
// the hardware prefetcher restarts at each one; the caches prefetch blocks a little ahead of
// the one they work on. p: [bytes]
inline void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// The kernels for an ISA (tests compare them); ActiveAttentionKernels() follows ActiveIsa().
const AttentionKernels& AttentionKernelsFor(internal::Isa isa);
const AttentionKernels& ActiveAttentionKernels();

}  // namespace subspace::cpu

#endif  // SUBSPACE_CORE_CPU_ATTENTION_KERNELS_H_
