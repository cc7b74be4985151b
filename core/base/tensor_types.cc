// Scalar conversions for the ggml element types the engine loads: exact fp16/bf16 <-> fp32
// bit manipulation (no reliance on compiler half support) and row dequantisation. These are
// reference-speed paths; the fast matmul kernels read the stored types directly.
#include "core/base/tensor_types.h"

#include <bit>
#include <cassert>
#include <cstring>
#include <iterator>
#include <limits>

#include "core/base/quant_blocks.h"

namespace subspace {
namespace {

uint32_t FloatBits(float f) { return std::bit_cast<uint32_t>(f); }
float BitsFloat(uint32_t u) { return std::bit_cast<float>(u); }

}  // namespace

bool IsSupportedTensorType(uint32_t raw_type) {
  switch (static_cast<TensorType>(raw_type)) {
    case TensorType::kF32:
    case TensorType::kF16:
    case TensorType::kBF16:
      return true;
    case TensorType::kQ8_1:
    case TensorType::kQ8_K:
      return false;  // activation formats: ggml never writes them to files
    default:
      return IsQuantizedTensorType(static_cast<TensorType>(raw_type));
  }
}

const char* TensorTypeName(TensorType type) {
  // Names for every id ggml has assigned, so an unsupported-type error can say what the file
  // actually holds (e.g. "q4_K") rather than only a number. Null entries are retired ids.
  static constexpr const char* kNames[] = {
      "f32",     "f16",    "q4_0",    "q4_1",  nullptr,  nullptr, "q5_0",  "q5_1",
      "q8_0",    "q8_1",   "q2_K",    "q3_K",  "q4_K",   "q5_K",  "q6_K",  "q8_K",
      "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s", "iq4_nl", "iq3_s", "iq2_s", "iq4_xs",
      "i8",      "i16",    "i32",     "i64",   "f64",    "iq1_m", "bf16",  nullptr,
      nullptr,   nullptr,  "tq1_0",   "tq2_0", nullptr,  nullptr, nullptr, "mxfp4",
  };
  const auto id = static_cast<uint32_t>(type);
  if (id >= std::size(kNames) || kNames[id] == nullptr) return "unknown";
  return kNames[id];
}

int64_t TensorBlockElems(TensorType type) {
  switch (type) {
    case TensorType::kF32:
    case TensorType::kF16:
    case TensorType::kBF16:
      return 1;
    case TensorType::kQ4_0:
    case TensorType::kQ4_1:
    case TensorType::kQ5_0:
    case TensorType::kQ5_1:
    case TensorType::kQ8_0:
    case TensorType::kQ8_1:
    case TensorType::kIQ4_NL:
      return kQuantBlock;
    case TensorType::kQ2_K:
    case TensorType::kQ3_K:
    case TensorType::kQ4_K:
    case TensorType::kQ5_K:
    case TensorType::kQ6_K:
    case TensorType::kQ8_K:
      return kSuperBlock;
  }
  return 0;
}

uint64_t TensorBlockBytes(TensorType type) {
  switch (type) {
    case TensorType::kF32:
      return 4;
    case TensorType::kF16:
    case TensorType::kBF16:
      return 2;
    case TensorType::kQ4_0:
      return sizeof(BlockQ4_0);
    case TensorType::kQ4_1:
      return sizeof(BlockQ4_1);
    case TensorType::kQ5_0:
      return sizeof(BlockQ5_0);
    case TensorType::kQ5_1:
      return sizeof(BlockQ5_1);
    case TensorType::kQ8_0:
      return sizeof(BlockQ8_0);
    case TensorType::kQ8_1:
      return sizeof(BlockQ8_1);
    case TensorType::kQ2_K:
      return sizeof(BlockQ2_K);
    case TensorType::kQ3_K:
      return sizeof(BlockQ3_K);
    case TensorType::kQ4_K:
      return sizeof(BlockQ4_K);
    case TensorType::kQ5_K:
      return sizeof(BlockQ5_K);
    case TensorType::kQ6_K:
      return sizeof(BlockQ6_K);
    case TensorType::kQ8_K:
      return sizeof(BlockQ8_K);
    case TensorType::kIQ4_NL:
      return sizeof(BlockIq4Nl);
  }
  return 0;
}

uint64_t TensorRowBytes(TensorType type, int64_t n) {
  const int64_t block_elems = TensorBlockElems(type);
  if (block_elems == 0 || n < 0 || n % block_elems != 0) return 0;
  const uint64_t blocks = static_cast<uint64_t>(n / block_elems);
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(blocks, TensorBlockBytes(type), &bytes)) return 0;
  return bytes;
}

float Fp16ToFp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in fp32 (at most 10 significant bits).
    const float magnitude = static_cast<float>(mant) * 0x1p-24f;
    return BitsFloat(sign | FloatBits(magnitude));
  }
  if (exp == 0x1f) {
    // Inf or NaN; the payload moves up unchanged, so a quiet NaN stays quiet.
    return BitsFloat(sign | 0x7f800000u | (mant << 13));
  }
  return BitsFloat(sign | ((exp + (127 - 15)) << 23) | (mant << 13));
}

uint16_t Fp32ToFp16(float f) {
  const uint32_t bits = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;

  if (abs > 0x7f800000u) {
    // NaN: keep the top payload bits and force the quiet bit so a payload living only in the
    // low 13 bits cannot collapse into infinity.
    return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);
  }
  // 65520 = 0x477ff000 is the midpoint between 65504 (largest half, odd mantissa) and 2^16;
  // ties go to even, which is infinity.
  if (abs >= 0x477ff000u) return sign | 0x7c00u;

  if (abs < 0x38800000u) {
    // Result is a half subnormal (or zero): units of 2^-24. 2^-25 itself ties to even (zero).
    if (abs <= 0x33000000u) return sign;
    const uint32_t exp = abs >> 23;  // 102..112 here
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // value / 2^-24 = mant * 2^(exp - 126)
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t result = mant >> shift;
    if (rem > halfway || (rem == halfway && (result & 1u))) ++result;
    // A carry to 0x400 is the smallest normal half, which is the right encoding.
    return sign | static_cast<uint16_t>(result);
  }

  // Normal: rebias the exponent, then round the 13 dropped mantissa bits. A mantissa carry
  // correctly bumps the exponent; the overflow check above keeps us below infinity.
  uint32_t result = (abs >> 13) - ((127 - 15) << 10);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (result & 1u))) ++result;
  return sign | static_cast<uint16_t>(result);
}

uint16_t Fp32ToBf16(float f) {
  const uint32_t bits = FloatBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    // A NaN whose payload sits only in the low 16 bits would truncate to infinity.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Round to nearest even; a carry out of the mantissa rounds the largest finite values
  // up to infinity, as it should.
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

void DequantizeRow(TensorType type, const void* src, float* dst, int64_t n) {
  // src: n elements of `type` (n / 32 blocks for Q8_0 ...); dst: [n] fp32.
  // Byte copies keep this correct for any source alignment (general.alignment may be 1).
  const auto* bytes = static_cast<const uint8_t*>(src);
  switch (type) {
    case TensorType::kF32:
      std::memcpy(dst, bytes, static_cast<size_t>(n) * sizeof(float));
      return;
    case TensorType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, sizeof(h));
        dst[i] = Fp16ToFp32(h);
      }
      return;
    case TensorType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, sizeof(h));
        dst[i] = Bf16ToFp32(h);
      }
      return;
    case TensorType::kQ8_0: {
      assert(n % kQ8BlockSize == 0);
      const int64_t blocks = n / kQ8BlockSize;
      for (int64_t b = 0; b < blocks; ++b) {
        BlockQ8_0 block;
        std::memcpy(&block, bytes + b * sizeof(BlockQ8_0), sizeof(block));
        const float scale = Fp16ToFp32(block.scale_f16);
        for (int j = 0; j < kQ8BlockSize; ++j) {
          dst[b * kQ8BlockSize + j] = scale * static_cast<float>(block.q[j]);
        }
      }
      return;
    }
    default:
      if (IsQuantizedTensorType(type)) {
        assert(n % TensorBlockElems(type) == 0);
        DequantizeQuantizedRow(type, bytes, dst, n);
        return;
      }
      break;
  }
  // Unreachable for tensors that came through GgufFile (it rejects other types); poison the
  // output so a caller's bug shows up as NaNs instead of stale data.
  assert(false && "DequantizeRow: unsupported type");
  for (int64_t i = 0; i < n; ++i) dst[i] = std::numeric_limits<float>::quiet_NaN();
}

}  // namespace subspace
