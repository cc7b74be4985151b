// Scalar dequantization and dot products of the quantized GGUF types. Every type is first
// decoded, block by block, into the integers its formula multiplies (q, per-sub-block scale
// and min) and its fp32 super-scales; dequantization and the dot product are then one loop
// each for all of them. Readable reference code: the SIMD kernels in core/cpu are the fast
// path and are tested against these.
#include "core/base/quant_blocks.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>

namespace subspace {
namespace {

template <typename Block>
Block LoadBlock(const uint8_t* p) {
  Block block;
  std::memcpy(&block, p, sizeof(block));
  return block;
}

// A 32-value block of a legacy type or iq4_nl: x = d * q[j] + m.
struct LegacyBlock {
  float d = 0.0f;
  float m = 0.0f;
  int8_t q[kQuantBlock];
};

// Value j's 4-bit code in a nibble-packed 32-value block.
inline int Nibble(const uint8_t* qs, int j) { return j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4; }

LegacyBlock DecodeLegacy(TensorType type, const uint8_t* p) {
  LegacyBlock out;
  switch (type) {
    case TensorType::kQ4_0: {
      const auto b = LoadBlock<BlockQ4_0>(p);
      out.d = Fp16ToFp32(b.d);
      for (int j = 0; j < kQuantBlock; ++j) out.q[j] = static_cast<int8_t>(Nibble(b.qs, j) - 8);
      break;
    }
    case TensorType::kQ4_1: {
      const auto b = LoadBlock<BlockQ4_1>(p);
      out.d = Fp16ToFp32(b.d);
      out.m = Fp16ToFp32(b.m);
      for (int j = 0; j < kQuantBlock; ++j) out.q[j] = static_cast<int8_t>(Nibble(b.qs, j));
      break;
    }
    case TensorType::kQ5_0:
    case TensorType::kQ5_1: {
      const bool q5_1 = type == TensorType::kQ5_1;
      uint32_t qh;
      const uint8_t* qs;
      if (q5_1) {
        const auto b = LoadBlock<BlockQ5_1>(p);
        out.d = Fp16ToFp32(b.d);
        out.m = Fp16ToFp32(b.m);
        std::memcpy(&qh, b.qh, 4);
        qs = p + offsetof(BlockQ5_1, qs);
      } else {
        const auto b = LoadBlock<BlockQ5_0>(p);
        out.d = Fp16ToFp32(b.d);
        std::memcpy(&qh, b.qh, 4);
        qs = p + offsetof(BlockQ5_0, qs);
      }
      for (int j = 0; j < kQuantBlock; ++j) {
        const int q = Nibble(qs, j) | (((qh >> j) & 1) << 4);
        out.q[j] = static_cast<int8_t>(q5_1 ? q : q - 16);
      }
      break;
    }
    case TensorType::kQ8_0: {
      const auto b = LoadBlock<BlockQ8_0>(p);
      out.d = Fp16ToFp32(b.scale_f16);
      std::memcpy(out.q, b.q, kQuantBlock);
      break;
    }
    case TensorType::kIQ4_NL: {
      const auto b = LoadBlock<BlockIq4Nl>(p);
      out.d = Fp16ToFp32(b.d);
      for (int j = 0; j < kQuantBlock; ++j) out.q[j] = kIq4NlValues[Nibble(b.qs, j)];
      break;
    }
    default:
      assert(false && "not a legacy block type");
  }
  return out;
}

// A 256-value K-quant super-block: x = d * scale[s] * q[v] - dmin * min[s] for the sub-block
// s = v / sub holding value v.
struct KBlock {
  float d = 0.0f;
  float dmin = 0.0f;
  int sub = 16;  // values per sub-block: 16 or 32
  int16_t scale[16] = {};
  int16_t min[16] = {};
  int8_t q[kSuperBlock];
};

KBlock DecodeK(TensorType type, const uint8_t* p) {
  KBlock out;
  switch (type) {
    case TensorType::kQ2_K: {
      const auto b = LoadBlock<BlockQ2_K>(p);
      out.d = Fp16ToFp32(b.d);
      out.dmin = Fp16ToFp32(b.dmin);
      for (int s = 0; s < 16; ++s) {
        out.scale[s] = b.scales[s] & 0xF;
        out.min[s] = b.scales[s] >> 4;
      }
      // Value n + 32 j + l of each 128-value half: bits 2j of qs[n / 4 + l].
      for (int v = 0; v < kSuperBlock; ++v) {
        const int half = v / 128, j = (v % 128) / 32, l = v % 32;
        out.q[v] = static_cast<int8_t>((b.qs[32 * half + l] >> (2 * j)) & 3);
      }
      break;
    }
    case TensorType::kQ3_K: {
      const auto b = LoadBlock<BlockQ3_K>(p);
      out.d = Fp16ToFp32(b.d);
      int8_t scales[16];
      UnpackScalesQ3K(b.scales, scales);
      for (int s = 0; s < 16; ++s) out.scale[s] = scales[s];
      for (int v = 0; v < kSuperBlock; ++v) {
        const int half = v / 128, j = (v % 128) / 32, l = v % 32;
        const int low = (b.qs[32 * half + l] >> (2 * j)) & 3;
        const bool high = (b.hmask[l] >> (4 * half + j)) & 1;
        out.q[v] = static_cast<int8_t>(low - (high ? 0 : 4));
      }
      break;
    }
    case TensorType::kQ4_K:
    case TensorType::kQ5_K: {
      const bool q5 = type == TensorType::kQ5_K;
      uint16_t d, dmin;
      std::memcpy(&d, p, 2);
      std::memcpy(&dmin, p + 2, 2);
      out.d = Fp16ToFp32(d);
      out.dmin = Fp16ToFp32(dmin);
      out.sub = 32;
      const uint8_t* scales = p + 4;
      for (int s = 0; s < 8; ++s) {
        uint8_t sc, m;
        UnpackScaleMinK4(s, scales, &sc, &m);
        out.scale[s] = sc;
        out.min[s] = m;
      }
      const uint8_t* qh = p + offsetof(BlockQ5_K, qh);
      const uint8_t* qs = p + (q5 ? offsetof(BlockQ5_K, qs) : offsetof(BlockQ4_K, qs));
      // Sub-block s: low nibbles (s even) or high nibbles (s odd) of qs[32 (s / 2) + l];
      // the fifth bit is bit s of qh[l].
      for (int v = 0; v < kSuperBlock; ++v) {
        const int s = v / 32, l = v % 32;
        const uint8_t byte = qs[32 * (s / 2) + l];
        int q = s % 2 == 0 ? byte & 0xF : byte >> 4;
        if (q5) q |= ((qh[l] >> s) & 1) << 4;
        out.q[v] = static_cast<int8_t>(q);
      }
      break;
    }
    case TensorType::kQ6_K: {
      const auto b = LoadBlock<BlockQ6_K>(p);
      out.d = Fp16ToFp32(b.d);
      for (int s = 0; s < 16; ++s) out.scale[s] = b.scales[s];
      // Value 32 k + l of each 128-value half: the low (k < 2) or high nibble of
      // ql[32 (k % 2) + l] and bits 2k of qh[l], minus 32; scale of every 16 values.
      for (int v = 0; v < kSuperBlock; ++v) {
        const int half = v / 128, k = (v % 128) / 32, l = v % 32;
        const uint8_t lo = b.ql[64 * half + 32 * (k % 2) + l];
        const int low4 = k < 2 ? lo & 0xF : lo >> 4;
        const int high2 = (b.qh[32 * half + l] >> (2 * k)) & 3;
        out.q[v] = static_cast<int8_t>((low4 | (high2 << 4)) - 32);
      }
      break;
    }
    default:
      assert(false && "not a K-quant type");
  }
  return out;
}

bool IsKQuant(TensorType type) {
  switch (type) {
    case TensorType::kQ2_K:
    case TensorType::kQ3_K:
    case TensorType::kQ4_K:
    case TensorType::kQ5_K:
    case TensorType::kQ6_K:
      return true;
    default:
      return false;
  }
}

// ggml's nearest_int: round half to even in the current (default) rounding mode.
inline int NearestInt(float x) { return static_cast<int>(std::nearbyint(x)); }

}  // namespace

void UnpackScalesQ3K(const uint8_t* packed, int8_t* scales) {
  // Low four bits: bytes 0..7 (low nibbles, then high nibbles); high two bits: bytes 8..11,
  // two bits per scale.
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? packed[i] & 0xF : packed[i - 8] >> 4;
    const int high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
    scales[i] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
}

int BlockHalfFields(TensorType type, uint64_t offsets[2]) {
  switch (type) {
    case TensorType::kQ4_1:
    case TensorType::kQ5_1:
    case TensorType::kQ4_K:
    case TensorType::kQ5_K:
      offsets[0] = 0;
      offsets[1] = 2;
      return 2;
    case TensorType::kQ2_K:
      offsets[0] = offsetof(BlockQ2_K, d);
      offsets[1] = offsetof(BlockQ2_K, dmin);
      return 2;
    case TensorType::kQ3_K:
      offsets[0] = offsetof(BlockQ3_K, d);
      return 1;
    case TensorType::kQ6_K:
      offsets[0] = offsetof(BlockQ6_K, d);
      return 1;
    case TensorType::kQ4_0:
    case TensorType::kQ5_0:
    case TensorType::kQ8_0:
    case TensorType::kIQ4_NL:
      offsets[0] = 0;
      return 1;
    default:
      return 0;
  }
}

bool IsQuantizedTensorType(TensorType type) {
  switch (type) {
    case TensorType::kQ4_0:
    case TensorType::kQ4_1:
    case TensorType::kQ5_0:
    case TensorType::kQ5_1:
    case TensorType::kQ8_0:
    case TensorType::kQ2_K:
    case TensorType::kQ3_K:
    case TensorType::kQ4_K:
    case TensorType::kQ5_K:
    case TensorType::kQ6_K:
    case TensorType::kIQ4_NL:
      return true;
    default:
      return false;
  }
}

TensorType DotActivationType(TensorType weight_type) {
  switch (weight_type) {
    case TensorType::kQ4_0:
    case TensorType::kQ5_0:
    case TensorType::kQ8_0:
    case TensorType::kIQ4_NL:
      return TensorType::kQ8_0;
    case TensorType::kQ4_1:
    case TensorType::kQ5_1:
      return TensorType::kQ8_1;
    default:
      return IsKQuant(weight_type) ? TensorType::kQ8_K : TensorType::kF32;
  }
}

void QuantizeActivationRow(TensorType act_type, const float* x, void* dst, int64_t n) {
  auto* out = static_cast<uint8_t*>(dst);
  if (act_type == TensorType::kQ8_K) {
    assert(n % kSuperBlock == 0);
    for (int64_t b = 0; b < n / kSuperBlock; ++b, x += kSuperBlock) {
      BlockQ8_K block{};
      float max = 0.0f, amax = 0.0f;
      for (int j = 0; j < kSuperBlock; ++j) {
        if (std::fabs(x[j]) > amax) {
          amax = std::fabs(x[j]);
          max = x[j];
        }
      }
      // Scaled by the signed extreme so that it maps to -127 exactly (as ggml does). Where
      // that overflows (a block of subnormals at most), the block stays zero: ggml would
      // convert NaN or infinity to int8 there.
      const float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
      if (std::isfinite(iscale) && iscale != 0.0f) {
        for (int j = 0; j < kSuperBlock; ++j) {
          block.qs[j] = static_cast<int8_t>(std::min(127, NearestInt(iscale * x[j])));
        }
        for (int g = 0; g < 16; ++g) {
          int sum = 0;
          for (int j = 0; j < 16; ++j) sum += block.qs[16 * g + j];
          block.bsums[g] = static_cast<int16_t>(sum);
        }
        block.d = 1.0f / iscale;
      }
      std::memcpy(out + b * sizeof(BlockQ8_K), &block, sizeof(block));
    }
    return;
  }
  assert(act_type == TensorType::kQ8_0 || act_type == TensorType::kQ8_1);
  assert(n % kQuantBlock == 0);
  const bool with_sum = act_type == TensorType::kQ8_1;
  const size_t block_bytes = with_sum ? sizeof(BlockQ8_1) : sizeof(BlockQ8_0);
  for (int64_t b = 0; b < n / kQuantBlock; ++b, x += kQuantBlock) {
    float amax = 0.0f;
    for (int j = 0; j < kQuantBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    // 1 / d overflows for blocks of subnormals; their codes are 0 then (ggml would convert
    // NaN or infinity to int8), and d rounds to 0 in fp16 anyway.
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    const float id = std::isfinite(inverse) ? inverse : 0.0f;
    int8_t q[kQuantBlock];
    int sum = 0;
    for (int j = 0; j < kQuantBlock; ++j) {
      q[j] = static_cast<int8_t>(std::round(x[j] * id));
      sum += q[j];
    }
    uint8_t* p = out + b * block_bytes;
    const uint16_t d16 = Fp32ToFp16(d);
    std::memcpy(p, &d16, 2);
    if (with_sum) {
      const uint16_t s16 = Fp32ToFp16(static_cast<float>(sum) * d);
      std::memcpy(p + 2, &s16, 2);
      std::memcpy(p + 4, q, kQuantBlock);
    } else {
      std::memcpy(p + 2, q, kQuantBlock);
    }
  }
}

void DecodeActivationRow(TensorType act_type, const void* src, float* out, int64_t n) {
  const auto* in = static_cast<const uint8_t*>(src);
  const int64_t block = TensorBlockElems(act_type);
  const uint64_t block_bytes = TensorBlockBytes(act_type);
  for (int64_t b = 0; b < n / block; ++b, in += block_bytes, out += block) {
    float d;
    const int8_t* q;
    if (act_type == TensorType::kQ8_K) {
      std::memcpy(&d, in, 4);
      q = reinterpret_cast<const int8_t*>(in + offsetof(BlockQ8_K, qs));
    } else {
      // q8_1's stored sum s = d * sum(q) is in fp16; the dot product uses it for the weights'
      // mins where a decoded row would use d16 * sum(q): the two paths differ by that rounding.
      uint16_t d16;
      std::memcpy(&d16, in, 2);
      d = Fp16ToFp32(d16);
      q = reinterpret_cast<const int8_t*>(in + (act_type == TensorType::kQ8_1 ? 4 : 2));
    }
    for (int64_t i = 0; i < block; ++i) out[i] = d * static_cast<float>(q[i]);
  }
}

float DotQuantizedRowScalar(TensorType type, const void* row, const void* act, int64_t n) {
  const auto* w = static_cast<const uint8_t*>(row);
  const auto* a = static_cast<const uint8_t*>(act);
  const uint64_t w_block = TensorBlockBytes(type);
  float sum = 0.0f;
  if (IsKQuant(type)) {
    for (int64_t b = 0; b < n / kSuperBlock; ++b) {
      const KBlock k = DecodeK(type, w + b * w_block);
      const auto y = LoadBlock<BlockQ8_K>(a + b * sizeof(BlockQ8_K));
      int32_t scaled = 0, mins = 0;
      for (int s = 0; s < kSuperBlock / k.sub; ++s) {
        int32_t dot = 0, ysum = 0;
        for (int v = s * k.sub; v < (s + 1) * k.sub; ++v) {
          dot += k.q[v] * y.qs[v];
          ysum += y.qs[v];
        }
        scaled += k.scale[s] * dot;
        mins += k.min[s] * ysum;
      }
      sum += y.d * k.d * static_cast<float>(scaled) - y.d * k.dmin * static_cast<float>(mins);
    }
    return sum;
  }
  const bool q8_1 = DotActivationType(type) == TensorType::kQ8_1;
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const LegacyBlock x = DecodeLegacy(type, w + b * w_block);
    int32_t dot = 0;
    if (q8_1) {
      const auto y = LoadBlock<BlockQ8_1>(a + b * sizeof(BlockQ8_1));
      for (int j = 0; j < kQuantBlock; ++j) dot += x.q[j] * y.qs[j];
      sum += x.d * Fp16ToFp32(y.d) * static_cast<float>(dot) + x.m * Fp16ToFp32(y.s);
    } else {
      const auto y = LoadBlock<BlockQ8_0>(a + b * sizeof(BlockQ8_0));
      for (int j = 0; j < kQuantBlock; ++j) dot += x.q[j] * y.q[j];
      sum += x.d * Fp16ToFp32(y.scale_f16) * static_cast<float>(dot);
    }
  }
  return sum;
}

void DequantizeQuantizedRow(TensorType type, const uint8_t* src, float* dst, int64_t n) {
  const uint64_t block_bytes = TensorBlockBytes(type);
  if (IsKQuant(type)) {
    for (int64_t b = 0; b < n / kSuperBlock; ++b) {
      const KBlock k = DecodeK(type, src + b * block_bytes);
      float* out = dst + b * kSuperBlock;
      for (int s = 0; s < kSuperBlock / k.sub; ++s) {
        // Rounded as ggml rounds: (d * scale) * q - (dmin * min).
        const float ds = k.d * static_cast<float>(k.scale[s]);
        const float ms = k.dmin * static_cast<float>(k.min[s]);
        for (int v = s * k.sub; v < (s + 1) * k.sub; ++v) {
          out[v] = ds * static_cast<float>(k.q[v]) - ms;
        }
      }
    }
    return;
  }
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const LegacyBlock x = DecodeLegacy(type, src + b * block_bytes);
    float* out = dst + b * kQuantBlock;
    const bool with_min = type == TensorType::kQ4_1 || type == TensorType::kQ5_1;
    for (int j = 0; j < kQuantBlock; ++j) {
      out[j] = with_min ? static_cast<float>(x.q[j]) * x.d + x.m : static_cast<float>(x.q[j]) * x.d;
    }
  }
}

}  // namespace subspace
