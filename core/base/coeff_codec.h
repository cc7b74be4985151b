// Storage formats of low-rank coefficients in compressed KV blocks: fp32 (exactness tests),
// fp16, or int8 with one fp16 scale per token and head. Rows are encoded one token-head at a
// time at compression and decoded a block at a time inside attention.
#ifndef SUBSPACE_CORE_BASE_COEFF_CODEC_H_
#define SUBSPACE_CORE_BASE_COEFF_CODEC_H_

#include <cstdint>
#include <cstring>

namespace subspace {

enum class CoeffDtype : uint8_t { kFp32 = 0, kFp16 = 1, kInt8 = 2 };

const char* CoeffDtypeName(CoeffDtype dtype);

// Bytes of one coefficient code (the int8 scale is stored apart, see ScaleBytes).
inline int64_t CoeffBytes(CoeffDtype dtype) {
  return dtype == CoeffDtype::kFp32 ? 4 : dtype == CoeffDtype::kFp16 ? 2 : 1;
}
// Bytes of the per token-head scale: int8 only.
inline int64_t ScaleBytes(CoeffDtype dtype) { return dtype == CoeffDtype::kInt8 ? 2 : 0; }

// fp16 -> fp32 without branches on the common path, inline so decode loops stay tight
// (ggml_types' Fp16ToFp32 is out of line). Exact for normals, subnormals and zero.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t bits;
  if (em >= 0x7c00u) {
    bits = 0x7f800000u | ((em & 0x3ffu) << 13);  // inf / NaN
  } else {
    // Put exponent+mantissa in fp32 position, then scale by 2^(127-15): handles subnormals.
    float f;
    const uint32_t raw = em << 13;
    std::memcpy(&f, &raw, sizeof(f));
    f *= 0x1p112f;
    std::memcpy(&bits, &f, sizeof(bits));
  }
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Encodes r floats. codes: [r] of CoeffBytes(dtype); scale: [1] fp16, int8 only (else unused).
void EncodeCoeffs(CoeffDtype dtype, const float* x, int r, void* codes, uint16_t* scale);
// Decodes r floats. codes: [r]; scale: [1] fp16 (int8 only); out: [r]
void DecodeCoeffs(CoeffDtype dtype, const void* codes, const uint16_t* scale, int r, float* out);

}  // namespace subspace

#endif  // SUBSPACE_CORE_BASE_COEFF_CODEC_H_
