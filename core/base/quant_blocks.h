// The quantized tensor types of GGUF files: their block layouts (byte for byte as ggml defines
// them), scalar dequantization, the 8-bit activation formats the fused dot products pair each
// type with (as llama.cpp does: q8_0 for q4_0 / q5_0 / q8_0 / iq4_nl, q8_1 for q4_1 / q5_1,
// q8_K for the K-quants), and scalar dot products of a weight row with a quantized activation
// row. The scalar dots are the reference twins of the SIMD kernels in core/cpu; tests check
// both against numbers produced by ggml itself (tests/data/quants/).
//
// Block fields are read with memcpy everywhere: GGUF data need not be aligned, and K-quant
// blocks (110, 210 bytes ...) sit at odd multiples of two in any case.
#ifndef SUBSPACE_CORE_BASE_QUANT_BLOCKS_H_
#define SUBSPACE_CORE_BASE_QUANT_BLOCKS_H_

#include <cstdint>

#include "core/base/tensor_types.h"

namespace subspace {

inline constexpr int kQuantBlock = 32;   // values per block of the legacy types and iq4_nl
inline constexpr int kSuperBlock = 256;  // values per super-block of the K-quants

// x = d * (q - 8), q in 0..15; value j of the block in the low nibble of qs[j % 16] for
// j < 16, in the high nibble for j >= 16.
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[16];
};
// x = d * q + m, q in 0..15.
struct BlockQ4_1 {
  uint16_t d, m;
  uint8_t qs[16];
};
// x = d * (q - 16), q in 0..31: four bits as q4_0, the fifth of value j in bit j of qh.
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
// x = d * q + m, q in 0..31.
struct BlockQ5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[16];
};
// Activations for q4_1 / q5_1: x = d * q, s = d * sum(q) (the term the weights' mins need).
struct BlockQ8_1 {
  uint16_t d, s;
  int8_t qs[32];
};
// 16 sub-blocks of 16: x = d * (scales & 15) * q - dmin * (scales >> 4), q in 0..3.
struct BlockQ2_K {
  uint8_t scales[16];
  uint8_t qs[64];
  uint16_t d, dmin;
};
// 16 sub-blocks of 16: x = d * (scale - 32) * (q - 4 * !hbit), q in 0..3; 6-bit scales packed
// in 12 bytes.
struct BlockQ3_K {
  uint8_t hmask[32];
  uint8_t qs[64];
  uint8_t scales[12];
  uint16_t d;
};
// 8 sub-blocks of 32: x = d * scale * q - dmin * min, q in 0..15; 6-bit scales and mins
// packed in 12 bytes.
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
// As q4_K with a fifth bit per value in qh.
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
// 16 sub-blocks of 16: x = d * scale * (q - 32), q in 0..63 (4 low bits in ql, 2 in qh).
struct BlockQ6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
// Activations for the K-quants: x = d * q; bsums[i] = sum of q over values 16i..16i+15.
struct BlockQ8_K {
  float d;
  int8_t qs[256];
  int16_t bsums[16];
};
// x = d * kIq4NlValues[q], q in 0..15, packed as q4_0.
struct BlockIq4Nl {
  uint16_t d;
  uint8_t qs[16];
};

static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 &&
                  sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_1) == 36 && sizeof(BlockQ2_K) == 84 &&
                  sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 &&
                  sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210 &&
                  sizeof(BlockQ8_K) == 292 && sizeof(BlockIq4Nl) == 18,
              "block sizes must match ggml's");

// The non-linear 4-bit code book of iq4_nl.
inline constexpr int8_t kIq4NlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1,    13,   25,  38,  53,  69,  89,  113};

// True for the block types MatMul pairs with quantized activations (all quantized weight types).
bool IsQuantizedTensorType(TensorType type);

// The activation format a weight type's dot product takes: kQ8_0, kQ8_1 or kQ8_K; kF32 for
// the float types.
TensorType DotActivationType(TensorType weight_type);

// Quantizes n activations (a multiple of the type's block) to `act_type` (kQ8_0, kQ8_1 or
// kQ8_K) as ggml's reference quantizers do. dst: TensorRowBytes(act_type, n) bytes.
void QuantizeActivationRow(TensorType act_type, const float* x, void* dst, int64_t n);

// n activations quantized to `act_type` (QuantizeActivationRow's output), decoded back: q * d.
// With the quantizer, x as a quantized weight type's dot product sees it: the prefill path
// feeds these to sgemm so that a matmul gives the same result whichever path computes it (not
// for q4_1 / q5_1, whose dots use q8_1's fp16 sum: MatMul keeps those on the integer path).
void DecodeActivationRow(TensorType act_type, const void* src, float* out, int64_t n);

// dot(weight row, activation row) for n values: `row` holds n values of `type`, `act` n values
// of DotActivationType(type). Integer sums per block, combined in fp32 as ggml's reference
// kernels combine them.
float DotQuantizedRowScalar(TensorType type, const void* row, const void* act, int64_t n);

// Dequantizes n values of a quantized type (called by DequantizeRow).
void DequantizeQuantizedRow(TensorType type, const uint8_t* src, float* dst, int64_t n);

// Byte offsets, inside one block of a quantized type, of its fp16 fields: the scale, and the min
// (q4_1, q5_1) or the super-block scale of the mins (q2_K, q4_K, q5_K) where there is one.
// Returns how many (1 or 2); 0 for other types. For tests and benchmarks that write blocks.
int BlockHalfFields(TensorType type, uint64_t offsets[2]);

// The 6-bit scale and min of sub-block j (0..7) of a q4_K / q5_K block's 12 scale bytes.
inline void UnpackScaleMinK4(int j, const uint8_t* scales, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = scales[j] & 63;
    *min = scales[j + 4] & 63;
  } else {
    *scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
    *min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

// The 16 signed 6-bit scales (already minus 32) of a q3_K block's 12 scale bytes.
void UnpackScalesQ3K(const uint8_t* packed, int8_t* scales);

}  // namespace subspace

#endif  // SUBSPACE_CORE_BASE_QUANT_BLOCKS_H_
