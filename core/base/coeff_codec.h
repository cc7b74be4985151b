// Storage formats of low-rank coefficients in compressed KV blocks: fp32 (exactness tests),
// fp16, int8 or int4 with one fp16 scale per token and head. int4 packs two codes a byte (low
// nibble first, code + 8) and needs rows of an even number of codes, so that every row starts
// on a byte. Rows are encoded one token-head at a time at compression and decoded a block at a
// time inside attention.
#ifndef SUBSPACE_CORE_BASE_COEFF_CODEC_H_
#define SUBSPACE_CORE_BASE_COEFF_CODEC_H_

#include <cstdint>
#include <cstring>

namespace subspace {

enum class CoeffDtype : uint8_t { kFp32 = 0, kFp16 = 1, kInt8 = 2, kInt4 = 3 };

const char* CoeffDtypeName(CoeffDtype dtype);

// Bytes of n codes (n even for int4; the scale is stored apart, see ScaleBytes).
inline int64_t CodeBytes(CoeffDtype dtype, int64_t n) {
  switch (dtype) {
    case CoeffDtype::kFp32:
      return 4 * n;
    case CoeffDtype::kFp16:
      return 2 * n;
    case CoeffDtype::kInt8:
      return n;
    case CoeffDtype::kInt4:
      return n / 2;
  }
  return 0;
}
// Whether the format quantizes with a per token-head fp16 scale (int8, int4).
inline bool HasRowScale(CoeffDtype dtype) {
  return dtype == CoeffDtype::kInt8 || dtype == CoeffDtype::kInt4;
}
// Bytes of the per token-head scale: 2 for int8 and int4, else 0.
inline int64_t ScaleBytes(CoeffDtype dtype) { return HasRowScale(dtype) ? 2 : 0; }
// Code k of an int4 row (or of rows packed back to back), as the signed integer it stands for.
inline int Int4Code(const uint8_t* codes, int64_t k) {
  const uint8_t b = codes[k >> 1];
  return static_cast<int>((k & 1) ? (b >> 4) : (b & 0x0f)) - 8;
}

// fp16 -> fp32 without branches on the common path, inline so decode loops stay tight
// (tensor_types' Fp16ToFp32 is out of line). Exact for normals, subnormals and zero.
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

// Encodes r floats (r even for int4). codes: CodeBytes(dtype, r) bytes; scale: [1] fp16,
// int8 and int4 only (else unused).
void EncodeCoeffs(CoeffDtype dtype, const float* x, int r, void* codes, uint16_t* scale);
// Decodes r floats. codes: CodeBytes(dtype, r) bytes; scale: [1] fp16 (int8, int4); out: [r]
void DecodeCoeffs(CoeffDtype dtype, const void* codes, const uint16_t* scale, int r, float* out);

}  // namespace subspace

#endif  // SUBSPACE_CORE_BASE_COEFF_CODEC_H_
