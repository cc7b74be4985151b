// Element types of GGUF tensors (numbered as in ggml) and their scalar conversions:
// fp16 and bf16 to/from fp32, the Q8_0 block layout and row sizes. The other quantized
// block layouts are in quant_blocks.h.
#ifndef SUBSPACE_CORE_BASE_TENSOR_TYPES_H_
#define SUBSPACE_CORE_BASE_TENSOR_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace subspace {

enum class TensorType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,  // activations only (the dot-product partner of q4_1 / q5_1); never in a file
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,  // activations only (the partner of the K-quants); never in a file
  kIQ4_NL = 20,
  kBF16 = 30,
};

// Q8_0: blocks of 32 weights sharing one fp16 scale; weight = scale * q.
inline constexpr int kQ8BlockSize = 32;
struct BlockQ8_0 {
  uint16_t scale_f16;
  int8_t q[kQ8BlockSize];
};
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block must be 34 bytes as in ggml");

// True for the tensor types this engine can load: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1,
// q8_0, q2_K .. q6_K and iq4_nl.
bool IsSupportedTensorType(uint32_t raw_type);
// ggml's name for any assigned type id, supported or not ("q4_K"); "unknown" otherwise.
const char* TensorTypeName(TensorType type);

// Bytes taken by `n` consecutive elements (a row). For block types `n` must be a multiple of
// the block size; returns 0 when it is not (and for negative `n`, unsupported types or a
// byte count that overflows uint64).
uint64_t TensorRowBytes(TensorType type, int64_t n);
// Elements per block (1 for scalar types, 32 for the legacy quants, 256 for the K-quants);
// 0 for unsupported types. Also defined for the activation types q8_1 and q8_K.
int64_t TensorBlockElems(TensorType type);
// Bytes per block (4 for F32, 2 for F16/BF16, 34 for Q8_0 ...); 0 for unsupported types.
uint64_t TensorBlockBytes(TensorType type);

float Fp16ToFp32(uint16_t h);
uint16_t Fp32ToFp16(float f);  // round to nearest even

inline float Bf16ToFp32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
uint16_t Fp32ToBf16(float f);  // round to nearest even, NaN kept NaN

// Converts `n` elements of a row stored as `type` into fp32.
void DequantizeRow(TensorType type, const void* src, float* dst, int64_t n);

}  // namespace subspace

#endif  // SUBSPACE_CORE_BASE_TENSOR_TYPES_H_
