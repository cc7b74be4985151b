// The paged cache's row formats: byte layouts worked out by hand from llama.cpp's reference
// quantizers (quantize_row_q8_0_ref / quantize_row_q4_0_ref), q8_0 read back through the GGUF
// weight decoder (one Q8_0 layout for weights and cache), round-trip error bounds, and names.
#include "core/kvcache/kv_quant.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/base/tensor_types.h"
#include "gtest/gtest.h"

namespace subspace {
namespace {

std::vector<uint8_t> Quantize(KvDtype dtype, const std::vector<float>& x) {
  std::vector<uint8_t> bytes(
      static_cast<size_t>(KvRowBytes(dtype, static_cast<int64_t>(x.size()))));
  QuantizeKvRow(dtype, x.data(), static_cast<int64_t>(x.size()), bytes.data());
  return bytes;
}

TEST(KvQuantTest, RowBytes) {
  EXPECT_EQ(KvRowBytes(KvDtype::kF32, 64), 256);
  EXPECT_EQ(KvRowBytes(KvDtype::kQ8_0, 64), 68);
  EXPECT_EQ(KvRowBytes(KvDtype::kQ4_0, 64), 36);
  EXPECT_EQ(KvRowBytes(KvDtype::kQ8_0, 128), 136);
  EXPECT_EQ(KvRowBytes(KvDtype::kQ8_0, 48), 0);  // not whole blocks
  EXPECT_EQ(KvRowBytes(KvDtype::kQ4_0, 0), 0);
  EXPECT_EQ(KvRowBytes(KvDtype::kF32, 8), 32);
}

// d = max|x| / 127 = 1, q = round(x / d) (halves away from zero), d as fp16 1.0 = 0x3c00.
TEST(KvQuantTest, Q8_0BytesByHand) {
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f;
  x[1] = -63.5f;
  x[2] = 2.49f;
  x[31] = -127.0f;
  const std::vector<uint8_t> b = Quantize(KvDtype::kQ8_0, x);
  ASSERT_EQ(b.size(), 34u);
  EXPECT_EQ(b[0], 0x00);
  EXPECT_EQ(b[1], 0x3c);
  EXPECT_EQ(static_cast<int8_t>(b[2]), 127);
  EXPECT_EQ(static_cast<int8_t>(b[3]), -64);
  EXPECT_EQ(static_cast<int8_t>(b[4]), 2);
  EXPECT_EQ(static_cast<int8_t>(b[5]), 0);
  EXPECT_EQ(static_cast<int8_t>(b[33]), -127);
}

// m = the value of largest magnitude (-8), d = m / -8 = 1, q = min(15, (int8)(x / d + 8.5));
// byte j holds value j in its low nibble and value j + 16 in its high one.
TEST(KvQuantTest, Q4_0BytesByHand) {
  std::vector<float> x(32, 0.0f);
  x[0] = -8.0f;   // q 0
  x[1] = 1.0f;    // q 9
  x[16] = 7.6f;   // q min(15, 16) = 15
  x[17] = -0.4f;  // (int8)(8.1) = 8
  const std::vector<uint8_t> b = Quantize(KvDtype::kQ4_0, x);
  ASSERT_EQ(b.size(), 18u);
  EXPECT_EQ(b[0], 0x00);
  EXPECT_EQ(b[1], 0x3c);
  EXPECT_EQ(b[2], 0xf0);                                        // 0 | 15 << 4
  EXPECT_EQ(b[3], 0x89);                                        // 9 | 8 << 4
  for (int j = 2; j < 16; ++j) EXPECT_EQ(b[2 + j], 0x88) << j;  // zeros: q 8
  std::vector<float> back(32);
  DequantizeKvRows(KvDtype::kQ4_0, b.data(), 1, 32, back.data());
  EXPECT_EQ(back[0], -8.0f);
  EXPECT_EQ(back[1], 1.0f);
  EXPECT_EQ(back[16], 7.0f);
  EXPECT_EQ(back[17], 0.0f);
}

TEST(KvQuantTest, ZeroBlocksStoreAZeroScale) {
  for (KvDtype dtype : {KvDtype::kQ8_0, KvDtype::kQ4_0}) {
    const std::vector<float> x(64, 0.0f);
    const std::vector<uint8_t> b = Quantize(dtype, x);
    std::vector<float> back(64, 1.0f);
    DequantizeKvRows(dtype, b.data(), 1, 64, back.data());
    for (float v : back) EXPECT_EQ(v, 0.0f) << KvDtypeName(dtype);
  }
}

// The cache's q8_0 rows are the GGUF Q8_0 blocks the weight decoder reads.
TEST(KvQuantTest, Q8_0IsTheGgufLayout) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> x(128);
  for (float& v : x) v = dist(rng);
  const std::vector<uint8_t> b = Quantize(KvDtype::kQ8_0, x);
  std::vector<float> ours(128), gguf(128);
  DequantizeKvRows(KvDtype::kQ8_0, b.data(), 1, 128, ours.data());
  DequantizeRow(TensorType::kQ8_0, b.data(), gguf.data(), 128);
  EXPECT_EQ(ours, gguf);
}

// Error per block within half a step of the fp16 scale (plus the scale's own rounding), and
// several rows at once decode as each alone.
TEST(KvQuantTest, RoundTripErrorIsWithinHalfAStep) {
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const int n = 64, rows = 5;
  std::vector<float> x(static_cast<size_t>(n * rows));
  for (float& v : x) v = dist(rng);
  for (KvDtype dtype : {KvDtype::kQ8_0, KvDtype::kQ4_0}) {
    const int64_t rb = KvRowBytes(dtype, n);
    std::vector<uint8_t> bytes(static_cast<size_t>(rb * rows));
    for (int r = 0; r < rows; ++r) QuantizeKvRow(dtype, x.data() + r * n, n, bytes.data() + r * rb);
    std::vector<float> back(x.size());
    DequantizeKvRows(dtype, bytes.data(), rows, n, back.data());
    const float levels = dtype == KvDtype::kQ8_0 ? 127.0f : 8.0f;
    for (int blk = 0; blk < rows * n / 32; ++blk) {
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[blk * 32 + j]));
      const float step = amax / levels;
      for (int j = 0; j < 32; ++j) {
        const size_t i = static_cast<size_t>(blk * 32 + j);
        // q4_0 clamps the top level (+8 d) to +7 d: a full step there.
        const float bound = (dtype == KvDtype::kQ4_0 ? 1.0f : 0.5f) * step + 2e-3f * amax;
        EXPECT_LE(std::fabs(back[i] - x[i]), bound) << KvDtypeName(dtype) << " " << i;
      }
    }
  }
}

TEST(KvQuantTest, NamesParse) {
  for (KvDtype dtype : {KvDtype::kF32, KvDtype::kQ8_0, KvDtype::kQ4_0}) {
    EXPECT_EQ(ParseKvDtype(KvDtypeName(dtype)).value(), dtype);
  }
  const absl::Status st = ParseKvDtype("q4_K", "--kv-dtype").status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "--kv-dtype must be 'f32', 'q8_0' or 'q4_0', got 'q4_K'");
}

}  // namespace
}  // namespace subspace
