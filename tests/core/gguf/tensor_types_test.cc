// Tests for the ggml scalar types: fp16 checked exhaustively against an independent
// nearest-value oracle (exact in double), bf16 rounding, row sizes and dequantisation.
#include "core/base/tensor_types.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace subspace {
namespace {

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
float FromBits(uint32_t u) { return std::bit_cast<float>(u); }

bool IsHalfNan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

// Reference fp32 -> fp16 for finite inputs: binary search over the (monotone) positive half
// encodings for the nearest value, computed in double where every comparison is exact; ties
// go to the even encoding, and anything at or beyond 65520 becomes infinity.
uint16_t ReferenceFp32ToFp16(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double x = std::fabs(static_cast<double>(f));
  if (x >= 65520.0) return sign | 0x7c00;
  int lo = 0, hi = 0x7bff;  // largest encoding whose value <= x
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (static_cast<double>(Fp16ToFp32(static_cast<uint16_t>(mid))) <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  if (lo == 0x7bff) return sign | 0x7bff;
  const double below = Fp16ToFp32(static_cast<uint16_t>(lo));
  const double above = Fp16ToFp32(static_cast<uint16_t>(lo + 1));
  const double d_lo = x - below, d_hi = above - x;
  uint16_t h = static_cast<uint16_t>(lo);
  if (d_hi < d_lo || (d_hi == d_lo && (lo & 1))) h = static_cast<uint16_t>(lo + 1);
  return sign | h;
}

TEST(Fp16Test, KnownValues) {
  EXPECT_EQ(Fp16ToFp32(0x0000), 0.0f);
  EXPECT_TRUE(std::signbit(Fp16ToFp32(0x8000)));
  EXPECT_EQ(Fp16ToFp32(0x3c00), 1.0f);
  EXPECT_EQ(Fp16ToFp32(0xc000), -2.0f);
  EXPECT_EQ(Fp16ToFp32(0x3555), 0.333251953125f);
  EXPECT_EQ(Fp16ToFp32(0x7bff), 65504.0f);
  EXPECT_EQ(Fp16ToFp32(0x0400), 0x1p-14f);  // smallest normal
  EXPECT_EQ(Fp16ToFp32(0x0001), 0x1p-24f);  // smallest subnormal
  EXPECT_EQ(Fp16ToFp32(0x03ff), 0x3ffp-24f);
  EXPECT_EQ(Fp16ToFp32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Fp16ToFp32(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Fp16ToFp32(0x7e00)));
  EXPECT_TRUE(std::isnan(Fp16ToFp32(0x7c01)));  // signalling NaN stays NaN

  EXPECT_EQ(Fp32ToFp16(1.0f), 0x3c00);
  EXPECT_EQ(Fp32ToFp16(-2.0f), 0xc000);
  EXPECT_EQ(Fp32ToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(Fp32ToFp16(65519.99f), 0x7bff);
  EXPECT_EQ(Fp32ToFp16(65520.0f), 0x7c00);  // tie rounds to even: infinity
  EXPECT_EQ(Fp32ToFp16(1e10f), 0x7c00);
  EXPECT_EQ(Fp32ToFp16(-1e10f), 0xfc00);
  EXPECT_EQ(Fp32ToFp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(Fp32ToFp16(0x1p-24f), 0x0001);
  EXPECT_EQ(Fp32ToFp16(0x1p-25f), 0x0000);         // tie between 0 and 2^-24: even is 0
  EXPECT_EQ(Fp32ToFp16(0x1.000002p-25f), 0x0001);  // just above the tie
  EXPECT_EQ(Fp32ToFp16(0x3p-25f), 0x0002);         // 1.5 * 2^-24 ties up to even 2
  EXPECT_EQ(Fp32ToFp16(-0.0f), 0x8000);
  EXPECT_EQ(Fp32ToFp16(1e-30f), 0x0000);
  EXPECT_EQ(Fp32ToFp16(0x1.ff8p-15f), 0x03ff);          // largest subnormal
  EXPECT_EQ(Fp32ToFp16(0x1.ffcp-15f), 0x0400);          // tie: rounds up into the smallest normal
  EXPECT_EQ(Fp32ToFp16(1.0f + 0x1p-11f), 0x3c00);       // tie, even stays
  EXPECT_EQ(Fp32ToFp16(1.0f + 3 * 0x1p-11f), 0x3c02);   // tie, odd rounds up
  EXPECT_EQ(Fp32ToFp16(FromBits(0x3f801001)), 0x3c01);  // above the tie
}

TEST(Fp16Test, AllHalfValuesRoundTrip) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto half = static_cast<uint16_t>(h);
    const float f = Fp16ToFp32(half);
    const uint16_t back = Fp32ToFp16(f);
    if (IsHalfNan(half)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_TRUE(IsHalfNan(back)) << std::hex << h;
      ASSERT_EQ(back & 0x8000, half & 0x8000) << std::hex << h;
    } else {
      ASSERT_EQ(back, half) << std::hex << h << " -> " << f;
    }
  }
}

TEST(Fp16Test, TiesBetweenAllAdjacentHalvesRoundToEven) {
  for (uint16_t h = 0; h < 0x7bff; ++h) {
    // The midpoint needs 12 significant bits, so it is exact in fp32.
    const float mid = (Fp16ToFp32(h) + Fp16ToFp32(h + 1)) / 2;
    const uint16_t even = (h & 1) ? h + 1 : h;
    ASSERT_EQ(Fp32ToFp16(mid), even) << std::hex << h;
    ASSERT_EQ(Fp32ToFp16(-mid), 0x8000 | even) << std::hex << h;
    ASSERT_EQ(Fp32ToFp16(std::nextafter(mid, 0.0f)), h) << std::hex << h;
    ASSERT_EQ(Fp32ToFp16(std::nextafter(mid, 1e9f)), h + 1) << std::hex << h;
  }
}

TEST(Fp16Test, MatchesReferenceAcrossFloatRange) {
  // Every 997th fp32 bit pattern, both signs: ~8.6M conversions covering zero, subnormal,
  // normal, overflow and NaN inputs.
  for (uint64_t u = 0; u <= 0xffffffffull; u += 997) {
    const float f = FromBits(static_cast<uint32_t>(u));
    const uint16_t got = Fp32ToFp16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(IsHalfNan(got)) << std::hex << u;
    } else {
      ASSERT_EQ(got, ReferenceFp32ToFp16(f)) << std::hex << u << " = " << f;
    }
  }
}

TEST(Fp16Test, NanPayloadInLowBitsStaysNan) {
  EXPECT_TRUE(IsHalfNan(Fp32ToFp16(FromBits(0x7f800001))));
  EXPECT_TRUE(IsHalfNan(Fp32ToFp16(FromBits(0xff800001))));
  EXPECT_TRUE(IsHalfNan(Fp32ToFp16(std::numeric_limits<float>::quiet_NaN())));
}

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Fp32ToBf16(-2.0f), 0xc000);
  EXPECT_EQ(Fp32ToBf16(FromBits(0x3f808000)), 0x3f80);  // tie, even stays
  EXPECT_EQ(Fp32ToBf16(FromBits(0x3f818000)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(Fp32ToBf16(FromBits(0x3f808001)), 0x3f81);  // above the tie
  EXPECT_EQ(Fp32ToBf16(FromBits(0x3f807fff)), 0x3f80);  // below the tie
  EXPECT_EQ(Fp32ToBf16(FromBits(0x7f7fffff)), 0x7f80);  // largest float rounds to infinity
  EXPECT_EQ(Fp32ToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(Fp32ToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(Fp32ToBf16(FromBits(0x00000001)), 0x0000);  // smallest subnormal rounds to 0
  EXPECT_EQ(Fp32ToBf16(FromBits(0x00008001)), 0x0001);  // subnormal rounds up
  EXPECT_EQ(Fp32ToBf16(-0.0f), 0x8000);
}

TEST(Bf16Test, NanStaysNanAndAllValuesRoundTrip) {
  for (uint32_t nan : {0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7f80ffffu}) {
    EXPECT_TRUE(std::isnan(Bf16ToFp32(Fp32ToBf16(FromBits(nan))))) << std::hex << nan;
  }
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = Bf16ToFp32(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(Bf16ToFp32(Fp32ToBf16(f)))) << std::hex << b;
    } else {
      ASSERT_EQ(Fp32ToBf16(f), b) << std::hex << b;
      ASSERT_EQ(Bits(f) & 0xffff, 0u);
    }
  }
}

TEST(TensorTypesTest, SizesAndNames) {
  EXPECT_TRUE(IsSupportedTensorType(0));
  EXPECT_TRUE(IsSupportedTensorType(1));
  EXPECT_TRUE(IsSupportedTensorType(8));
  EXPECT_TRUE(IsSupportedTensorType(30));
  for (uint32_t t : {2u, 3u, 6u, 7u, 10u, 11u, 12u, 13u, 14u, 20u}) {
    EXPECT_TRUE(IsSupportedTensorType(t)) << t;
  }
  // Retired ids, the activation-only q8_1 / q8_K, i-quants we do not read, integer types.
  for (uint32_t t : {4u, 5u, 9u, 15u, 16u, 19u, 23u, 28u, 31u, 39u, 1000u, 0xffffffffu}) {
    EXPECT_FALSE(IsSupportedTensorType(t)) << t;
  }
  EXPECT_STREQ(TensorTypeName(TensorType::kF32), "f32");
  EXPECT_STREQ(TensorTypeName(TensorType::kF16), "f16");
  EXPECT_STREQ(TensorTypeName(TensorType::kQ8_0), "q8_0");
  EXPECT_STREQ(TensorTypeName(TensorType::kBF16), "bf16");
  EXPECT_STREQ(TensorTypeName(static_cast<TensorType>(12)), "q4_K");
  EXPECT_STREQ(TensorTypeName(static_cast<TensorType>(4)), "unknown");  // retired id
  EXPECT_STREQ(TensorTypeName(static_cast<TensorType>(5000)), "unknown");

  EXPECT_EQ(TensorBlockElems(TensorType::kF32), 1);
  EXPECT_EQ(TensorBlockElems(TensorType::kQ8_0), 32);
  EXPECT_EQ(TensorBlockBytes(TensorType::kQ8_0), 34u);
  EXPECT_EQ(TensorBlockBytes(TensorType::kBF16), 2u);
  EXPECT_EQ(TensorRowBytes(TensorType::kF32, 10), 40u);
  EXPECT_EQ(TensorRowBytes(TensorType::kF16, 10), 20u);
  EXPECT_EQ(TensorRowBytes(TensorType::kBF16, 7), 14u);
  EXPECT_EQ(TensorRowBytes(TensorType::kQ8_0, 64), 68u);
  EXPECT_EQ(TensorRowBytes(TensorType::kQ8_0, 0), 0u);
  EXPECT_EQ(TensorRowBytes(TensorType::kQ4_K, 512), 288u);
  EXPECT_EQ(TensorRowBytes(TensorType::kQ6_K, 256), 210u);
  EXPECT_EQ(TensorRowBytes(TensorType::kQ4_K, 288), 0u);  // not whole super-blocks
  EXPECT_EQ(TensorRowBytes(TensorType::kQ8_0, 33), 0u);   // not a whole number of blocks
  EXPECT_EQ(TensorRowBytes(TensorType::kF32, -4), 0u);
  EXPECT_EQ(TensorRowBytes(TensorType::kF32, std::numeric_limits<int64_t>::max()), 0u);  // overflow
  EXPECT_EQ(TensorRowBytes(static_cast<TensorType>(16), 256), 0u);  // iq2_xxs: not read
}

TEST(DequantizeTest, ScalarTypes) {
  const std::vector<float> want = {0.0f, -1.5f, 3.25f, 65504.0f, -0.0f};
  std::vector<float> out(want.size());
  DequantizeRow(TensorType::kF32, want.data(), out.data(), 5);
  EXPECT_EQ(out, want);

  std::vector<uint16_t> half, bf;
  for (float x : want) half.push_back(Fp32ToFp16(x));
  for (float x : want) bf.push_back(Fp32ToBf16(x));
  DequantizeRow(TensorType::kF16, half.data(), out.data(), 5);
  EXPECT_EQ(out, want);
  DequantizeRow(TensorType::kBF16, bf.data(), out.data(), 3);
  EXPECT_EQ(out[2], 3.25f);

  // Rows inside a GGUF file may be only 1-byte aligned (general.alignment = 1).
  std::vector<uint8_t> unaligned(1 + 5 * sizeof(float));
  std::memcpy(unaligned.data() + 1, want.data(), 5 * sizeof(float));
  DequantizeRow(TensorType::kF32, unaligned.data() + 1, out.data(), 5);
  EXPECT_EQ(out, want);
}

TEST(DequantizeTest, Q8_0) {
  std::mt19937 rng(7);
  std::vector<BlockQ8_0> blocks(3);
  const float scales[] = {0.5f, 0.0078125f, -3.0f};
  for (int b = 0; b < 3; ++b) {
    blocks[b].scale_f16 = Fp32ToFp16(scales[b]);
    for (int j = 0; j < kQ8BlockSize; ++j) {
      blocks[b].q[j] = static_cast<int8_t>(static_cast<int>(rng() % 256) - 128);
    }
  }
  blocks[0].q[0] = -128;
  blocks[0].q[1] = 127;
  std::vector<float> out(3 * kQ8BlockSize);
  DequantizeRow(TensorType::kQ8_0, blocks.data(), out.data(), 3 * kQ8BlockSize);
  for (int b = 0; b < 3; ++b) {
    for (int j = 0; j < kQ8BlockSize; ++j) {
      // Scales are exact in fp16, so the product is exact in fp32.
      ASSERT_EQ(out[b * kQ8BlockSize + j], scales[b] * blocks[b].q[j]) << b << "," << j;
    }
  }
  EXPECT_EQ(out[0], -64.0f);
  EXPECT_EQ(out[1], 63.5f);
}

}  // namespace
}  // namespace subspace
