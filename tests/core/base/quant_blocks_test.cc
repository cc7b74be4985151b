// The quantized GGUF types against ggml itself: tests/data/quants/<type>.bin holds rows that
// ggml quantized, ggml's dequantization of those bytes, an activation row ggml quantized to
// the type's dot partner, and ggml's CPU dot products (tools/ggml_ref/, SOURCE.md there).
// Our dequantization must match bit for bit; our dots (scalar and AVX2, on ggml's activation
// bytes) to float rounding; our activation quantizer to ggml's bytes.
#include "core/base/quant_blocks.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/cpu/matmul_internal.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using testing::SourcePath;

struct Vectors {
  TensorType type{};
  TensorType act_type{};
  int rows = 0;
  int n = 0;
  std::vector<float> x;            // [rows, n] the values ggml quantized
  std::vector<uint8_t> q;          // rows * row_bytes
  std::vector<float> dequantized;  // [rows, n] ggml's dequantization of q
  std::vector<float> act;          // [n]
  std::vector<uint8_t> act_q;      // act quantized by ggml's CPU backend
  std::vector<float> dot;          // [rows] ggml's vec_dot(q row, act_q)
};

template <typename T>
void Read(std::ifstream& in, T* dst, size_t count) {
  in.read(reinterpret_cast<char*>(dst), static_cast<std::streamsize>(count * sizeof(T)));
}

Vectors Load(const std::string& name) {
  const std::string path = SourcePath("tests/data/quants/" + name + ".bin");
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  uint32_t header[6];
  uint64_t sizes[2];
  Read(in, header, 6);
  Read(in, sizes, 2);
  EXPECT_EQ(header[0], 0x56515353u);
  EXPECT_EQ(header[1], 1u);
  Vectors v;
  v.type = static_cast<TensorType>(header[2]);
  v.act_type = static_cast<TensorType>(header[3]);
  v.rows = static_cast<int>(header[4]);
  v.n = static_cast<int>(header[5]);
  v.x.resize(static_cast<size_t>(v.rows) * v.n);
  v.q.resize(sizes[0]);
  v.dequantized.resize(v.x.size());
  v.act.resize(v.n);
  v.act_q.resize(sizes[1]);
  v.dot.resize(v.rows);
  Read(in, v.x.data(), v.x.size());
  Read(in, v.q.data(), v.q.size());
  Read(in, v.dequantized.data(), v.dequantized.size());
  Read(in, v.act.data(), v.act.size());
  Read(in, v.act_q.data(), v.act_q.size());
  Read(in, v.dot.data(), v.dot.size());
  EXPECT_TRUE(in.good()) << path << " is truncated";
  in.peek();
  EXPECT_TRUE(in.eof()) << path << " has trailing bytes";
  return v;
}

// Every quantized weight type, named as ggml names them (and the data files).
const char* const kTypes[] = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0",  "q2_K",
                              "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl"};

class QuantBlocksTest : public ::testing::TestWithParam<const char*> {};

TEST_P(QuantBlocksTest, HeaderMatchesOurTypeTable) {
  const Vectors v = Load(GetParam());
  EXPECT_STREQ(TensorTypeName(v.type), GetParam());
  EXPECT_TRUE(IsSupportedTensorType(static_cast<uint32_t>(v.type)));
  EXPECT_TRUE(IsQuantizedTensorType(v.type));
  EXPECT_EQ(DotActivationType(v.type), v.act_type);
  EXPECT_EQ(TensorRowBytes(v.type, v.n) * v.rows, v.q.size());
  EXPECT_EQ(TensorRowBytes(v.act_type, v.n), v.act_q.size());
}

TEST_P(QuantBlocksTest, DequantizesBitForBitAsGgml) {
  const Vectors v = Load(GetParam());
  const uint64_t row_bytes = TensorRowBytes(v.type, v.n);
  std::vector<float> out(v.n);
  for (int r = 0; r < v.rows; ++r) {
    DequantizeRow(v.type, v.q.data() + r * row_bytes, out.data(), v.n);
    for (int i = 0; i < v.n; ++i) {
      ASSERT_EQ(out[i], v.dequantized[r * v.n + i]) << GetParam() << " row " << r << " value " << i;
    }
  }
}

TEST_P(QuantBlocksTest, GgmlQuantizationIsCloseToItsInput) {
  // Sanity of the data itself: the bytes decode to something near what was quantized.
  const Vectors v = Load(GetParam());
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < v.x.size(); ++i) {
    err += (v.x[i] - v.dequantized[i]) * (v.x[i] - v.dequantized[i]);
    norm += v.x[i] * v.x[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 0.4) << GetParam();  // q2_K, the coarsest, is ~0.3
}

// |dot| tolerance: float rounding of a sum of per-block products.
double Tolerance(const Vectors& v, int r) {
  double magnitude = 0.0;
  for (int i = 0; i < v.n; ++i) magnitude += std::fabs(v.dequantized[r * v.n + i] * v.act[i]);
  return 1e-5 * magnitude + 1e-6;
}

TEST_P(QuantBlocksTest, ScalarDotMatchesGgmlOnItsActivationBytes) {
  const Vectors v = Load(GetParam());
  const uint64_t row_bytes = TensorRowBytes(v.type, v.n);
  for (int r = 0; r < v.rows; ++r) {
    const float dot =
        DotQuantizedRowScalar(v.type, v.q.data() + r * row_bytes, v.act_q.data(), v.n);
    EXPECT_NEAR(dot, v.dot[r], Tolerance(v, r)) << GetParam() << " row " << r;
  }
}

TEST_P(QuantBlocksTest, Avx2DotMatchesGgmlAndTheScalarTwin) {
  if (cpu::internal::DetectedIsa() < cpu::internal::Isa::kAvx2) GTEST_SKIP() << "no AVX2";
  const Vectors v = Load(GetParam());
  const cpu::internal::QuantDotFn avx2 = cpu::internal::QuantDotKernelAvx2(v.type);
  ASSERT_NE(avx2, nullptr) << GetParam();
  const uint64_t row_bytes = TensorRowBytes(v.type, v.n);
  for (int r = 0; r < v.rows; ++r) {
    const uint8_t* row = v.q.data() + r * row_bytes;
    const float dot = avx2(row, v.act_q.data(), v.n);
    EXPECT_NEAR(dot, v.dot[r], Tolerance(v, r)) << GetParam() << " row " << r;
    EXPECT_NEAR(dot, DotQuantizedRowScalar(v.type, row, v.act_q.data(), v.n), Tolerance(v, r));
  }
}

TEST_P(QuantBlocksTest, Avx2DequantizationMatchesGgml) {
  if (cpu::internal::DetectedIsa() < cpu::internal::Isa::kAvx2) GTEST_SKIP() << "no AVX2";
  const Vectors v = Load(GetParam());
  const uint64_t row_bytes = TensorRowBytes(v.type, v.n);
  std::vector<float> out(v.n);
  for (int r = 0; r < v.rows; ++r) {
    if (!cpu::internal::DequantizeRowAvx2(v.type, v.q.data() + r * row_bytes, out.data(), v.n)) {
      GTEST_SKIP() << "no AVX2 dequantization for " << GetParam() << " (scalar is used)";
    }
    for (int i = 0; i < v.n; ++i) {
      // q4_K / q5_K fuse scale * q - min into one rounding; the others are exact.
      const float want = v.dequantized[r * v.n + i];
      ASSERT_NEAR(out[i], want, 1e-6f * std::fabs(want) + 1e-9f) << GetParam() << " " << i;
    }
  }
}

TEST_P(QuantBlocksTest, ActivationQuantizerMatchesGgmlBytes) {
  const Vectors v = Load(GetParam());
  std::vector<uint8_t> ours(v.act_q.size());
  QuantizeActivationRow(v.act_type, v.act.data(), ours.data(), v.n);
  // ggml's AVX2 q8_0 / q8_1 quantizers scale by 127 / max where the reference divides by d =
  // max / 127, and round halves to even: a code may differ by one where x sits on a rounding
  // edge. Compare the decoded values instead of the bytes.
  std::vector<float> a(v.n), b(v.n);
  const uint64_t block_bytes = TensorBlockBytes(v.act_type);
  const int64_t block = TensorBlockElems(v.act_type);
  int differing = 0;
  for (int64_t blk = 0; blk < v.n / block; ++blk) {
    const uint8_t* pa = ours.data() + blk * block_bytes;
    const uint8_t* pb = v.act_q.data() + blk * block_bytes;
    if (v.act_type == TensorType::kQ8_K) {
      BlockQ8_K x, y;
      std::memcpy(&x, pa, sizeof(x));
      std::memcpy(&y, pb, sizeof(y));
      EXPECT_EQ(x.d, y.d);
      for (int i = 0; i < kSuperBlock; ++i) differing += x.qs[i] != y.qs[i];
      for (int g = 0; g < 16; ++g) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += x.qs[16 * g + i];
        EXPECT_EQ(x.bsums[g], sum);
      }
    } else {
      const int offset = v.act_type == TensorType::kQ8_1 ? 4 : 2;
      EXPECT_EQ(std::memcmp(pa, pb, 2), 0) << "scale of block " << blk;
      for (int i = 0; i < kQuantBlock; ++i) {
        const auto qa = static_cast<int8_t>(pa[offset + i]);
        const auto qb = static_cast<int8_t>(pb[offset + i]);
        EXPECT_LE(std::abs(qa - qb), 1);
        differing += qa != qb;
      }
    }
  }
  EXPECT_LE(differing, v.n / 100) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(AllTypes, QuantBlocksTest, ::testing::ValuesIn(kTypes),
                         [](const auto& info) { return std::string(info.param); });

// The AVX2 kernels against the scalar twins on random bytes: every code, scale and min value
// a file could hold (not only what ggml's quantizer emits), several row lengths.
TEST(QuantBlocksRandomTest, Avx2DotEqualsScalarOnArbitraryBytes) {
  if (cpu::internal::DetectedIsa() < cpu::internal::Isa::kAvx2) GTEST_SKIP() << "no AVX2";
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const char* name : kTypes) {
    const Vectors v = Load(name);
    for (int64_t n : {256, 512, 2048}) {
      std::vector<uint8_t> row(TensorRowBytes(v.type, n));
      for (auto& b : row) b = static_cast<uint8_t>(byte(rng));
      // Keep the fp16 scales finite and modest: overwrite every block's scale fields.
      const uint64_t block_bytes = TensorBlockBytes(v.type);
      for (uint64_t off = 0; off < row.size(); off += block_bytes) {
        const uint16_t d = Fp32ToFp16(0.01f * normal(rng));
        const uint16_t m = Fp32ToFp16(0.01f * normal(rng));
        uint64_t fields[2];
        const int num_fields = BlockHalfFields(v.type, fields);
        ASSERT_GE(num_fields, 1) << name;
        std::memcpy(&row[off + fields[0]], &d, 2);
        if (num_fields == 2) std::memcpy(&row[off + fields[1]], &m, 2);
        if (v.type == TensorType::kQ8_0) {
          // q8_0 codes are -127..127 as ggml writes them.
          for (int i = 0; i < 32; ++i) {
            if (row[off + 2 + i] == 0x80) row[off + 2 + i] = 0x81;
          }
        }
      }
      std::vector<float> act(n);
      for (auto& a : act) a = normal(rng);
      std::vector<uint8_t> act_q(TensorRowBytes(v.act_type, n));
      QuantizeActivationRow(v.act_type, act.data(), act_q.data(), n);
      std::vector<float> w(n);
      DequantizeRow(v.type, row.data(), w.data(), n);
      double magnitude = 0.0;
      for (int64_t i = 0; i < n; ++i) magnitude += std::fabs(w[i] * act[i]);
      const float scalar = DotQuantizedRowScalar(v.type, row.data(), act_q.data(), n);
      const float avx2 = cpu::internal::QuantDotKernelAvx2(v.type)(row.data(), act_q.data(), n);
      EXPECT_NEAR(avx2, scalar, 1e-5 * magnitude + 1e-6) << name << " n=" << n;
      // And both near the float dot product of the dequantized row (activation rounding).
      double exact = 0.0;
      for (int64_t i = 0; i < n; ++i) exact += static_cast<double>(w[i]) * act[i];
      EXPECT_NEAR(scalar, exact, 0.02 * magnitude + 1e-6) << name << " n=" << n;
    }
  }
}

TEST(QuantBlocksRandomTest, EightRowKernelsEqualTheOneRowKernels) {
  if (cpu::internal::DetectedIsa() < cpu::internal::Isa::kAvx2) GTEST_SKIP() << "no AVX2";
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (TensorType type : {TensorType::kQ4_0, TensorType::kQ4_1, TensorType::kQ5_0,
                          TensorType::kQ5_1, TensorType::kIQ4_NL}) {
    const cpu::internal::QuantDot8Fn dot8 = cpu::internal::QuantDot8KernelAvx2(type);
    ASSERT_NE(dot8, nullptr);
    for (int64_t n : {32, 96, 2048}) {
      // Rows a stride apart that is not their length, as inside a larger matrix.
      const uint64_t block_bytes = TensorBlockBytes(type);
      const uint64_t row_bytes = TensorRowBytes(type, n), stride = row_bytes + block_bytes * 3;
      const bool with_min = type == TensorType::kQ4_1 || type == TensorType::kQ5_1;
      std::vector<uint8_t> rows(8 * stride);
      for (auto& b : rows) b = static_cast<uint8_t>(byte(rng));
      for (int r = 0; r < 8; ++r) {
        for (uint64_t off = 0; off < row_bytes; off += block_bytes) {
          for (int field = 0; field < (with_min ? 2 : 1); ++field) {
            const uint16_t d = Fp32ToFp16(0.01f * normal(rng));
            std::memcpy(&rows[r * stride + off + 2 * field], &d, 2);
          }
        }
      }
      // 1..6 activation rows: the kernel's groups of four and every remainder.
      for (int n_act = 1; n_act <= 6; ++n_act) {
        std::vector<float> act(n * n_act);
        for (auto& a : act) a = normal(rng);
        const TensorType act_type = DotActivationType(type);
        const uint64_t act_bytes = TensorRowBytes(act_type, n);
        std::vector<uint8_t> act_q(act_bytes * n_act);
        for (int j = 0; j < n_act; ++j) {
          QuantizeActivationRow(act_type, act.data() + j * n, act_q.data() + j * act_bytes, n);
        }
        std::vector<int32_t> sums(n_act * (n / 32));
        if (act_type == TensorType::kQ8_0) {
          for (int j = 0; j < n_act; ++j) {
            cpu::internal::ActivationBlockSums(act_q.data() + j * act_bytes, n,
                                               sums.data() + j * (n / 32));
          }
        }
        const int64_t out_stride = 11;
        std::vector<float> out(out_stride * n_act, -1.0f);
        dot8(rows.data(), stride, act_q.data(), act_bytes, sums.data(), n_act, n, out.data(),
             out_stride);
        for (int j = 0; j < n_act; ++j) {
          for (int r = 0; r < 8; ++r) {
            const uint8_t* row = rows.data() + r * stride;
            std::vector<float> w(n);
            DequantizeRow(type, row, w.data(), n);
            double magnitude = 0.0;
            for (int64_t i = 0; i < n; ++i) magnitude += std::fabs(w[i] * act[j * n + i]);
            const uint8_t* a = act_q.data() + j * act_bytes;
            EXPECT_NEAR(out[j * out_stride + r], DotQuantizedRowScalar(type, row, a, n),
                        1e-5 * magnitude + 1e-6)
                << TensorTypeName(type) << " n=" << n << " act row " << j << " row " << r;
          }
          for (int64_t c = 8; c < out_stride; ++c) {
            EXPECT_EQ(out[j * out_stride + c], -1.0f) << "wrote past the eight outputs";
          }
        }
      }
    }
  }
}

TEST(QuantBlocksRandomTest, ActivationTypesAreNotLoadableTensorTypes) {
  EXPECT_FALSE(IsSupportedTensorType(static_cast<uint32_t>(TensorType::kQ8_1)));
  EXPECT_FALSE(IsSupportedTensorType(static_cast<uint32_t>(TensorType::kQ8_K)));
  EXPECT_EQ(TensorRowBytes(TensorType::kQ8_K, 512), 2 * sizeof(BlockQ8_K));
  EXPECT_EQ(TensorRowBytes(TensorType::kQ4_K, 300), 0u);  // not a multiple of 256
}

TEST(QuantBlocksRandomTest, Q3KScaleUnpackingCoversAllSixBits) {
  // Scale i: low nibble from byte i (i < 8) or i - 8 (high nibble), top two bits from byte
  // 8 + i % 4 at bit 2 (i / 4).
  uint8_t packed[12];
  for (int trial = 0; trial < 64; ++trial) {
    int8_t want[16];
    std::memset(packed, 0, sizeof(packed));
    for (int i = 0; i < 16; ++i) {
      const int value = (trial * 7 + i * 13) % 64;
      want[i] = static_cast<int8_t>(value - 32);
      if (i < 8) {
        packed[i] |= value & 0xF;
      } else {
        packed[i - 8] |= (value & 0xF) << 4;
      }
      packed[8 + i % 4] |= ((value >> 4) & 3) << (2 * (i / 4));
    }
    int8_t got[16];
    UnpackScalesQ3K(packed, got);
    for (int i = 0; i < 16; ++i) ASSERT_EQ(got[i], want[i]) << trial << " " << i;
  }
}

// The AVX2 activation quantizer is the scalar one, byte for byte: random rows at several
// magnitudes, plus rows built to hit its edges: codes exactly halfway between two integers
// (q8_0 rounds those away from zero, q8_K to even), all-zero blocks, a largest magnitude held
// by a positive and a negative value (q8_K takes the first), subnormals.
TEST(QuantBlocksRandomTest, Avx2ActivationQuantizerEqualsTheScalarOne) {
  if (cpu::internal::DetectedIsa() < cpu::internal::Isa::kAvx2) GTEST_SKIP() << "no AVX2";
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> code(-127, 127);
  constexpr int64_t n = 1024;
  std::vector<std::vector<float>> rows;
  for (float magnitude : {1e-3f, 1.0f, 300.0f}) {
    std::vector<float> x(n);
    for (auto& v : x) v = magnitude * normal(rng);
    rows.push_back(x);
  }
  {
    // Halves: with the largest value 127 the scale is 1, so k + 0.5 stays k + 0.5.
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[i] = i % 32 == 0 ? 127.0f : code(rng) / 2 + 0.5f;
    rows.push_back(x);
    for (auto& v : x) v = -v;
    rows.push_back(x);
  }
  {
    std::vector<float> x(n, 0.0f);
    for (int64_t i = 512; i < n; ++i) x[i] = normal(rng);
    x[600] = 10.0f;  // ties for the largest magnitude, either sign first
    x[700] = -10.0f;
    x[800] = -12.0f;
    x[900] = 12.0f;
    x[300] = 1e-40f;  // a subnormal in an otherwise zero block
    rows.push_back(x);
  }
  for (TensorType act_type : {TensorType::kQ8_0, TensorType::kQ8_1, TensorType::kQ8_K}) {
    const uint64_t bytes = TensorRowBytes(act_type, n);
    for (size_t r = 0; r < rows.size(); ++r) {
      std::vector<uint8_t> scalar(bytes, 0xAA), avx2(bytes, 0x55);
      QuantizeActivationRow(act_type, rows[r].data(), scalar.data(), n);
      ASSERT_TRUE(
          cpu::internal::QuantizeActivationRowAvx2(act_type, rows[r].data(), avx2.data(), n));
      for (uint64_t i = 0; i < bytes; ++i) {
        ASSERT_EQ(scalar[i], avx2[i]) << TensorTypeName(act_type) << " row " << r << " byte " << i;
      }
    }
  }
  std::vector<uint8_t> unused(TensorRowBytes(TensorType::kQ8_0, n));
  EXPECT_FALSE(cpu::internal::QuantizeActivationRowAvx2(TensorType::kQ4_0, rows[0].data(),
                                                        unused.data(), n));
}

}  // namespace
}  // namespace subspace
