// The coefficient codec: fp16 / int8 / int4 round trips against the exact values, the int4
// byte layout (two codes a byte, low nibble first, code + 8), and rows that are all zero.
#include "core/base/coeff_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/base/tensor_types.h"

namespace subspace {
namespace {

TEST(CoeffCodecTest, RoundTripErrorWithinHalfAStep) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (CoeffDtype dt :
       {CoeffDtype::kFp32, CoeffDtype::kFp16, CoeffDtype::kInt8, CoeffDtype::kInt4}) {
    for (int r : {2, 8, 16, 32, 64}) {
      std::vector<float> x(r), y(r, NAN);
      for (float& v : x) v = n(rng);
      std::vector<uint8_t> codes(CodeBytes(dt, r) + 1, 0xAB);  // + a canary byte
      uint16_t scale = 0;
      EncodeCoeffs(dt, x.data(), r, codes.data(), &scale);
      EXPECT_EQ(codes.back(), 0xAB)
          << CoeffDtypeName(dt) << " wrote past its " << CodeBytes(dt, r) << " bytes";
      DecodeCoeffs(dt, codes.data(), &scale, r, y.data());
      float amax = 0.0f;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      for (int j = 0; j < r; ++j) {
        double bound = 0.0;
        if (dt == CoeffDtype::kFp16) bound = std::fabs(x[j]) * 0x1p-11;
        if (HasRowScale(dt)) {
          const double step = HalfToFloat(scale);
          const double qmax = dt == CoeffDtype::kInt8 ? 127.0 : 7.0;
          EXPECT_NEAR(step, amax / qmax, amax / qmax * 1e-3) << CoeffDtypeName(dt);
          bound = step / 2 + 1e-6;
        }
        EXPECT_LE(std::fabs(y[j] - x[j]), bound) << CoeffDtypeName(dt) << " r " << r << " j " << j;
      }
    }
  }
}

TEST(CoeffCodecTest, Int4PacksTwoCodesAByteLowNibbleFirst) {
  // Scale 1 (amax 7): the codes are the values themselves.
  const std::vector<float> x = {-7, 7, 0, 1, -1, 3, 6, -6};
  std::vector<uint8_t> codes(CodeBytes(CoeffDtype::kInt4, 8));
  ASSERT_EQ(codes.size(), 4u);
  uint16_t scale = 0;
  EncodeCoeffs(CoeffDtype::kInt4, x.data(), 8, codes.data(), &scale);
  EXPECT_EQ(HalfToFloat(scale), 1.0f);
  EXPECT_EQ(codes[0], (-7 + 8) | ((7 + 8) << 4));
  EXPECT_EQ(codes[1], (0 + 8) | ((1 + 8) << 4));
  EXPECT_EQ(codes[2], (-1 + 8) | ((3 + 8) << 4));
  EXPECT_EQ(codes[3], (6 + 8) | ((-6 + 8) << 4));
  for (int k = 0; k < 8; ++k) EXPECT_EQ(Int4Code(codes.data(), k), static_cast<int>(x[k]));
  // Every nibble decodes, -8 included (the encoder never writes it; the kernels read it).
  const uint8_t all[8] = {0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE};
  for (int k = 0; k < 16; ++k) EXPECT_EQ(Int4Code(all, k), k - 8);
}

TEST(CoeffCodecTest, ZeroRowsDecodeToZero) {
  for (CoeffDtype dt : {CoeffDtype::kInt8, CoeffDtype::kInt4}) {
    const std::vector<float> x(6, 0.0f);
    std::vector<uint8_t> codes(CodeBytes(dt, 6));
    uint16_t scale = 0xFFFF;
    EncodeCoeffs(dt, x.data(), 6, codes.data(), &scale);
    std::vector<float> y(6, NAN);
    DecodeCoeffs(dt, codes.data(), &scale, 6, y.data());
    for (float v : y) EXPECT_EQ(v, 0.0f) << CoeffDtypeName(dt);
  }
}

TEST(CoeffCodecTest, SizesAndNames) {
  EXPECT_EQ(CodeBytes(CoeffDtype::kFp32, 6), 24);
  EXPECT_EQ(CodeBytes(CoeffDtype::kFp16, 6), 12);
  EXPECT_EQ(CodeBytes(CoeffDtype::kInt8, 6), 6);
  EXPECT_EQ(CodeBytes(CoeffDtype::kInt4, 6), 3);
  EXPECT_EQ(ScaleBytes(CoeffDtype::kFp16), 0);
  EXPECT_EQ(ScaleBytes(CoeffDtype::kInt8), 2);
  EXPECT_EQ(ScaleBytes(CoeffDtype::kInt4), 2);
  EXPECT_STREQ(CoeffDtypeName(CoeffDtype::kInt4), "int4");
}

}  // namespace
}  // namespace subspace
