// Checks every CPU op against a plain-loop float64 reference written here, for each weight
// type, odd shapes, both MatMul paths, the scalar fallback and the AVX2 kernels, unaligned
// pointers, and outputs pre-filled with NaN so an element left unwritten fails.
#include "core/cpu/ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/base/quant_blocks.h"
#include "core/base/tensor_types.h"
#include "core/base/weight.h"
#include "core/cpu/matmul_internal.h"

namespace subspace::cpu {
namespace {

using internal::Isa;
using internal::ScopedMaxIsa;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// fp32-accumulation tolerance: error relative to the sum of |terms| of each output.
constexpr double kTol = 1e-5;

// The ISAs this machine can run: the scalar fallback always, AVX2 where present.
std::vector<Isa> IsasToTest() {
  std::vector<Isa> isas = {Isa::kScalar};
  if (internal::DetectedIsa() >= Isa::kAvx2) isas.push_back(Isa::kAvx2);
  return isas;
}

const char* IsaName(Isa isa) { return isa == Isa::kScalar ? "scalar" : "avx2"; }

// Decoders independent of core/base/tensor_types.cc, exact in double.
double HalfToDouble(uint16_t h) {
  const int exp = (h >> 10) & 31;
  const int mant = h & 1023;
  const double mag = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  return (h & 0x8000) ? -mag : mag;
}

double Bf16ToDouble(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Random fp16 bits with the biased exponent in [lo, hi] (0 gives zeros and subnormals).
uint16_t RandomHalf(std::mt19937& rng, int lo, int hi) {
  const int exp = std::uniform_int_distribution<int>(lo, hi)(rng);
  const int mant = std::uniform_int_distribution<int>(0, 1023)(rng);
  const int sign = std::uniform_int_distribution<int>(0, 1)(rng);
  return static_cast<uint16_t>(sign << 15 | exp << 10 | mant);
}

// A weight matrix in stored form, `offset` bytes into its buffer (1 = as unaligned as a GGUF
// with general.alignment 1 can be), plus its values decoded in double.
struct TestWeight {
  std::vector<uint8_t> storage;
  WeightMatrix w;
  std::vector<double> values;  // [rows, cols]
};

TestWeight MakeWeight(TensorType type, int64_t rows, int64_t cols, uint32_t seed, int64_t offset) {
  std::mt19937 rng(seed);
  TestWeight t;
  const uint64_t row_bytes = TensorRowBytes(type, cols);
  t.storage.assign(offset + rows * row_bytes, 0);
  t.values.resize(rows * cols);
  uint8_t* base = t.storage.data() + offset;
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = base + r * row_bytes;
    double* out = t.values.data() + r * cols;
    switch (type) {
      case TensorType::kF32:
        for (int64_t k = 0; k < cols; ++k) {
          const float v = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
          std::memcpy(row + 4 * k, &v, 4);
          out[k] = v;
        }
        break;
      case TensorType::kF16:
        for (int64_t k = 0; k < cols; ++k) {
          // Mostly magnitudes 2^-5..2^1; one in 16 is a zero or a subnormal.
          const bool tiny = std::uniform_int_distribution<int>(0, 15)(rng) == 0;
          const uint16_t h = tiny ? RandomHalf(rng, 0, 0) : RandomHalf(rng, 10, 16);
          std::memcpy(row + 2 * k, &h, 2);
          out[k] = HalfToDouble(h);
        }
        break;
      case TensorType::kBF16:
        for (int64_t k = 0; k < cols; ++k) {
          const int exp = std::uniform_int_distribution<int>(120, 128)(rng);
          const int mant = std::uniform_int_distribution<int>(0, 127)(rng);
          const int sign = std::uniform_int_distribution<int>(0, 1)(rng);
          const uint16_t h = static_cast<uint16_t>(sign << 15 | exp << 7 | mant);
          std::memcpy(row + 2 * k, &h, 2);
          out[k] = Bf16ToDouble(h);
        }
        break;
      case TensorType::kQ8_0:
        for (int64_t b = 0; b < cols / kQ8BlockSize; ++b) {
          uint8_t* block = row + b * sizeof(BlockQ8_0);
          const uint16_t scale = RandomHalf(rng, 8, 13);
          std::memcpy(block, &scale, 2);
          for (int i = 0; i < kQ8BlockSize; ++i) {
            // The full int8 range, -128 included, though ggml's quantiser never writes it.
            const int8_t q =
                static_cast<int8_t>(std::uniform_int_distribution<int>(-128, 127)(rng));
            std::memcpy(block + 2 + i, &q, 1);
            out[b * kQ8BlockSize + i] = HalfToDouble(scale) * q;
          }
        }
        break;
      default: {
        // Other quantized types: random codes, scales and mins (every value a file could
        // hold), the fp16 super-scales kept modest; values through DequantizeRow, itself
        // checked bit for bit against ggml (tests/core/base/quant_blocks_test.cc).
        for (uint64_t i = 0; i < row_bytes; ++i) {
          row[i] = static_cast<uint8_t>(std::uniform_int_distribution<int>(0, 255)(rng));
        }
        const uint64_t block_bytes = TensorBlockBytes(type);
        uint64_t fields[2];
        const int num_fields = BlockHalfFields(type, fields);
        for (uint64_t off = 0; off < row_bytes; off += block_bytes) {
          for (int f = 0; f < num_fields; ++f) {
            const uint16_t h = RandomHalf(rng, 5, 10);
            std::memcpy(row + off + fields[f], &h, 2);
          }
        }
        std::vector<float> decoded(cols);
        DequantizeRow(type, row, decoded.data(), cols);
        std::copy(decoded.begin(), decoded.end(), out);
        break;
      }
    }
  }
  t.w.type = type;
  t.w.rows = rows;
  t.w.cols = cols;
  t.w.data = base;
  return t;
}

std::vector<float> RandomFloats(int64_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& f : v) f = dist(rng);
  return v;
}

// Fails at every i where got[i] is NaN or |got[i] - want[i]| > tol * scale[i] + abs_floor,
// printing the first few and the largest normalised error.
void ExpectClose(const float* got, const std::vector<double>& want,
                 const std::vector<double>& scale, double tol, double abs_floor = 0.0) {
  int failures = 0;
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double bound = tol * scale[i] + abs_floor;
    if (std::isnan(got[i]) || !(err <= bound)) {
      if (++failures <= 5) {
        ADD_FAILURE() << "element " << i << ": got " << got[i] << ", want " << want[i] << " (bound "
                      << bound << ")";
      }
    }
    if (scale[i] > 0) worst = std::max(worst, err / scale[i]);
  }
  EXPECT_EQ(failures, 0) << "worst normalised error " << worst << ", tolerance " << tol;
}

// ---------------------------------------------------------------------------------------------
// MatMul

// x as MatMul multiplies it: for quantized weights, each row quantized to the weight type's
// activation format (q8_0 / q8_1 / q8_K) and decoded back, exactly, in double (both paths:
// the decode path's integer dots and the prefill path's sgemm on the decoded activations);
// float types see x itself.
std::vector<double> ActivationsSeenBy(TensorType type, const float* x, int64_t n, int64_t cols) {
  std::vector<double> out(x, x + n * cols);
  if (!IsQuantizedTensorType(type)) return out;
  const TensorType act_type = DotActivationType(type);
  std::vector<uint8_t> q(TensorRowBytes(act_type, cols));
  for (int64_t j = 0; j < n; ++j) {
    QuantizeActivationRow(act_type, x + j * cols, q.data(), cols);
    double* dst = out.data() + j * cols;
    if (act_type == TensorType::kQ8_K) {
      for (int64_t b = 0; b < cols / kSuperBlock; ++b) {
        BlockQ8_K block;
        std::memcpy(&block, q.data() + b * sizeof(block), sizeof(block));
        for (int i = 0; i < kSuperBlock; ++i)
          dst[b * kSuperBlock + i] = double{block.d} * block.qs[i];
      }
    } else {
      const uint64_t block_bytes = TensorBlockBytes(act_type);
      const int code_offset = act_type == TensorType::kQ8_1 ? 4 : 2;
      for (int64_t b = 0; b < cols / kQuantBlock; ++b) {
        const uint8_t* p = q.data() + b * block_bytes;
        uint16_t d;
        std::memcpy(&d, p, 2);
        for (int i = 0; i < kQuantBlock; ++i) {
          dst[b * kQuantBlock + i] = HalfToDouble(d) * static_cast<int8_t>(p[code_offset + i]);
        }
      }
    }
  }
  return out;
}

// q4_1 / q5_1 against q8_1: the weights' mins multiply the activation block's sum s, which
// q8_1 computes from the unrounded scale and stores in fp16 (as llama.cpp does): off by up to
// 2^-11 |s| for each rounding, 2^-10 |s| in all. Adds that bound, over
// kTol, to each output's error scale.
void AddQ8_1SumRounding(const TestWeight& tw, const std::vector<double>& x_seen, int64_t n,
                        std::vector<double>* scale) {
  if (DotActivationType(tw.w.type) != TensorType::kQ8_1) return;
  const int64_t rows = tw.w.rows, cols = tw.w.cols;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t r = 0; r < rows; ++r) {
      double slack = 0.0;
      for (int64_t b = 0; b < cols / kQuantBlock; ++b) {
        uint16_t m;
        std::memcpy(&m, tw.w.row(r) + b * TensorBlockBytes(tw.w.type) + 2, 2);
        double sum = 0.0;
        for (int i = 0; i < kQuantBlock; ++i) sum += x_seen[j * cols + b * kQuantBlock + i];
        slack += std::fabs(HalfToDouble(m) * sum) * std::ldexp(1.0, -10);
      }
      (*scale)[j * rows + r] += slack / kTol;
    }
  }
}

// want = w · xᵀ in double over the activations the path sees; scale = sum of |terms|.
void ExpectedProducts(const TestWeight& tw, const std::vector<double>& x, int64_t n,
                      std::vector<double>* want, std::vector<double>* scale) {
  const int64_t rows = tw.w.rows, cols = tw.w.cols;
  want->assign(n * rows, 0.0);
  scale->assign(n * rows, 0.0);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0.0, abs_sum = 0.0;
      for (int64_t k = 0; k < cols; ++k) {
        const double term = tw.values[r * cols + k] * x[j * cols + k];
        sum += term;
        abs_sum += std::fabs(term);
      }
      (*want)[j * rows + r] = sum;
      (*scale)[j * rows + r] = abs_sum;
    }
  }
}

enum class Path { kAuto, kDecode, kPrefill };
const char* PathName(Path p) {
  return p == Path::kAuto ? "auto" : (p == Path::kDecode ? "decode" : "prefill");
}

void RunMatMul(Path path, const WeightMatrix& w, const float* x, int64_t n, float* y) {
  switch (path) {
    case Path::kAuto:
      return MatMul(w, x, n, y);
    case Path::kDecode:
      return internal::MatMulDecode(w, x, n, y);
    case Path::kPrefill:
      return internal::MatMulPrefill(w, x, n, y);
  }
}

// Every weight type MatMul reads.
constexpr TensorType kAllWeightTypes[] = {
    TensorType::kF32,  TensorType::kF16,  TensorType::kBF16, TensorType::kQ8_0,  TensorType::kQ4_0,
    TensorType::kQ4_1, TensorType::kQ5_0, TensorType::kQ5_1, TensorType::kQ2_K,  TensorType::kQ3_K,
    TensorType::kQ4_K, TensorType::kQ5_K, TensorType::kQ6_K, TensorType::kIQ4_NL};

struct MatMulCase {
  TensorType type;
  int64_t rows;
  int64_t cols;
  int64_t n;
};

void PrintTo(const MatMulCase& c, std::ostream* os) {
  *os << TensorTypeName(c.type) << " " << c.rows << "x" << c.cols << " n=" << c.n;
}

// Rows and cols off multiples of 8 and 32 where the type allows (Q8_0 rows are whole
// 32-blocks); 300 x 4096 is big enough for the decode path to split rows over threads and
// for prefill to take several panels.
std::vector<MatMulCase> MatMulCases() {
  std::vector<MatMulCase> cases;
  for (TensorType type : kAllWeightTypes) {
    const int64_t block = TensorBlockElems(type);
    const std::pair<int64_t, int64_t> shapes[] = {{5, block == 1 ? 7 : block},
                                                  {37, block == 256 ? 512 : 96},
                                                  {13, block == 1 ? 200 : 7 * block},
                                                  {300, 4096}};
    for (const auto& [rows, cols] : shapes) {
      for (int64_t n : {1, 3, 8, 67}) cases.push_back({type, rows, cols, n});
    }
  }
  return cases;
}

class MatMulTest : public ::testing::TestWithParam<MatMulCase> {};

TEST_P(MatMulTest, MatchesFloat64Reference) {
  const auto [type, rows, cols, n] = GetParam();
  const uint32_t seed = static_cast<uint32_t>(rows * 7919 + cols * 31 + n);
  // x sits one float past an allocation, so it is never 32-byte aligned; y too.
  const std::vector<float> x_storage = RandomFloats(n * cols + 1, seed + 1);
  const float* x = x_storage.data() + 1;

  const TestWeight ref = MakeWeight(type, rows, cols, seed, 0);
  std::vector<double> want, scale;
  const std::vector<double> seen = ActivationsSeenBy(type, x, n, cols);
  ExpectedProducts(ref, seen, n, &want, &scale);
  AddQ8_1SumRounding(ref, seen, n, &scale);

  std::vector<float> y_storage(n * rows + 1);
  float* y = y_storage.data() + 1;
  // Offsets 4 (float-aligned, lets F32 prefill hand the weights straight to sgemm) and 1.
  for (int64_t offset : {4, 1}) {
    const TestWeight tw = MakeWeight(type, rows, cols, seed, offset);
    for (Isa isa : IsasToTest()) {
      ScopedMaxIsa cap(isa);
      for (Path path : {Path::kAuto, Path::kDecode, Path::kPrefill}) {
        SCOPED_TRACE(std::string(IsaName(isa)) + " " + PathName(path) +
                     " offset=" + std::to_string(offset));
        std::fill(y_storage.begin(), y_storage.end(), kNan);
        RunMatMul(path, tw.w, x, n, y);
        ExpectClose(y, want, scale, kTol);
        EXPECT_TRUE(std::isnan(y_storage[0])) << "wrote before y";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, MatMulTest, ::testing::ValuesIn(MatMulCases()),
                         [](const ::testing::TestParamInfo<MatMulCase>& info) {
                           const MatMulCase& c = info.param;
                           return std::string(TensorTypeName(c.type)) + "_" +
                                  std::to_string(c.rows) + "x" + std::to_string(c.cols) + "_n" +
                                  std::to_string(c.n);
                         });

// The two ISAs must agree with each other as closely as each agrees with float64.
TEST(MatMulIsaTest, ScalarAndAvx2Agree) {
  if (internal::DetectedIsa() < Isa::kAvx2) GTEST_SKIP() << "no AVX2 on this CPU";
  for (TensorType type : kAllWeightTypes) {
    SCOPED_TRACE(TensorTypeName(type));
    const int64_t rows = 70, cols = TensorBlockElems(type) == 256 ? 512 : 320, n = 5;
    const TestWeight tw = MakeWeight(type, rows, cols, 99, 1);
    const std::vector<float> x = RandomFloats(n * cols, 100);
    std::vector<float> y_scalar(n * rows, kNan), y_avx2(n * rows, kNan);
    {
      ScopedMaxIsa cap(Isa::kScalar);
      MatMul(tw.w, x.data(), n, y_scalar.data());
    }
    {
      ScopedMaxIsa cap(Isa::kAvx2);
      ASSERT_EQ(internal::ActiveIsa(), Isa::kAvx2);
      MatMul(tw.w, x.data(), n, y_avx2.data());
    }
    std::vector<double> want(y_scalar.begin(), y_scalar.end()), scale(n * rows);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t r = 0; r < rows; ++r) {
        double s = 0.0;
        for (int64_t k = 0; k < cols; ++k)
          s += std::fabs(tw.values[r * cols + k] * x[j * cols + k]);
        scale[j * rows + r] = s;
      }
    }
    ExpectClose(y_avx2.data(), want, scale, kTol);
  }
}

// Row splits differ with the thread count (including more threads than cores); results must
// not. SetNumThreads(0) restores the default.
TEST(MatMulThreadsTest, AnyThreadCountGivesTheSameResult) {
  for (TensorType type : {TensorType::kF16, TensorType::kQ8_0, TensorType::kQ4_K}) {
    const int64_t rows = 301, cols = 512;
    const TestWeight tw = MakeWeight(type, rows, cols, 11, 1);
    for (int64_t n : {2, 40}) {
      const std::vector<float> x = RandomFloats(n * cols, 12);
      std::vector<double> want, scale;
      ExpectedProducts(tw, ActivationsSeenBy(type, x.data(), n, cols), n, &want, &scale);
      for (int threads : {1, 3, 0}) {
        SetNumThreads(threads);
        for (Path path : {Path::kDecode, Path::kPrefill}) {
          SCOPED_TRACE(std::string(TensorTypeName(type)) + " n=" + std::to_string(n) +
                       " threads=" + std::to_string(threads) + " " + PathName(path));
          std::vector<float> y(n * rows, kNan);
          RunMatMul(path, tw.w, x.data(), n, y.data());
          ExpectClose(y.data(), want, scale, kTol);
        }
      }
    }
  }
}

// MatMuls (several weights over one x, one parallel region at decode sizes) is MatMul per
// weight, to the bit: mixed types reading different activation formats (q8_0, q8_1, q8_K,
// none), shapes that are not multiples of the kernels' row groups, an empty weight, decode
// and prefill batch sizes, both ISAs and several thread counts.
TEST(MatMulsTest, EqualsOneMatMulPerWeight) {
  const int64_t cols = 512;
  std::vector<TestWeight> weights;
  weights.push_back(MakeWeight(TensorType::kQ4_0, 301, cols, 21, 1));
  weights.push_back(MakeWeight(TensorType::kQ4_1, 75, cols, 22, 0));
  weights.push_back(MakeWeight(TensorType::kQ6_K, 130, cols, 23, 1));
  weights.push_back(MakeWeight(TensorType::kF16, 97, cols, 24, 0));
  weights.push_back(MakeWeight(TensorType::kQ8_0, 0, cols, 25, 0));
  weights.push_back(MakeWeight(TensorType::kQ5_0, 64, cols, 26, 1));
  for (Isa isa : IsasToTest()) {
    ScopedMaxIsa cap(isa);
    for (int64_t n : {1, 3, 40}) {
      const std::vector<float> x = RandomFloats(n * cols, 27);
      for (int threads : {1, 3, 0}) {
        SetNumThreads(threads);
        SCOPED_TRACE(std::string(IsaName(isa)) + " n=" + std::to_string(n) +
                     " threads=" + std::to_string(threads));
        std::vector<std::vector<float>> want(weights.size()), got(weights.size());
        std::vector<MatMulOutput> outputs;
        for (size_t i = 0; i < weights.size(); ++i) {
          const int64_t rows = weights[i].w.rows;
          want[i].assign(n * rows, kNan);
          got[i].assign(n * rows, kNan);
          MatMul(weights[i].w, x.data(), n, want[i].data());
          outputs.push_back({&weights[i].w, got[i].data()});
        }
        MatMuls(outputs, x.data(), n);
        for (size_t i = 0; i < weights.size(); ++i) {
          for (size_t k = 0; k < want[i].size(); ++k) {
            ASSERT_EQ(std::memcmp(&got[i][k], &want[i][k], sizeof(float)), 0)
                << TensorTypeName(weights[i].w.type) << " element " << k << ": " << got[i][k]
                << " vs " << want[i][k];
          }
        }
      }
    }
  }
  SetNumThreads(0);
}

// Weights of different widths cannot share one quantized x: MatMuls then runs one MatMul each
// (each reads x with its own row length), rather than reading past the quantized rows.
TEST(MatMulsTest, DifferentWidthsRunOneCallEach) {
  const TestWeight wide = MakeWeight(TensorType::kQ4_0, 40, 512, 31, 0);
  const TestWeight narrow = MakeWeight(TensorType::kQ8_0, 24, 256, 32, 0);
  const int64_t n = 2;
  const std::vector<float> x = RandomFloats(n * 512, 33);
  std::vector<float> want_wide(n * 40), want_narrow(n * 24), got_wide(n * 40, kNan),
      got_narrow(n * 24, kNan);
  MatMul(wide.w, x.data(), n, want_wide.data());
  MatMul(narrow.w, x.data(), n, want_narrow.data());
  MatMuls({{&wide.w, got_wide.data()}, {&narrow.w, got_narrow.data()}}, x.data(), n);
  EXPECT_EQ(std::memcmp(got_wide.data(), want_wide.data(), want_wide.size() * 4), 0);
  EXPECT_EQ(std::memcmp(got_narrow.data(), want_narrow.data(), want_narrow.size() * 4), 0);
}

TEST(MatMulIsaTest, ScopedMaxIsaRestores) {
  const Isa before = internal::ActiveIsa();
  {
    ScopedMaxIsa cap(Isa::kScalar);
    EXPECT_EQ(internal::ActiveIsa(), Isa::kScalar);
  }
  EXPECT_EQ(internal::ActiveIsa(), before);
}

// ---------------------------------------------------------------------------------------------
// Embed

TEST(EmbedTest, CopiesRowsExactly) {
  for (TensorType type :
       {TensorType::kF32, TensorType::kF16, TensorType::kBF16, TensorType::kQ8_0}) {
    const int64_t vocab = 50;
    const int64_t dim = type == TensorType::kQ8_0 ? 224 : 200;
    const TestWeight table = MakeWeight(type, vocab, dim, 7, 1);
    const std::vector<int32_t> tokens = {0, 49, 3, 3, 17, 50, -1};  // last two out of range
    const int64_t n = static_cast<int64_t>(tokens.size());
    for (Isa isa : IsasToTest()) {
      SCOPED_TRACE(std::string(TensorTypeName(type)) + " " + IsaName(isa));
      ScopedMaxIsa cap(isa);
      std::vector<float> out(n * dim, kNan);
      Embed(table.w, tokens.data(), n, out.data());
      for (int64_t i = 0; i < n; ++i) {
        const bool valid = tokens[i] >= 0 && tokens[i] < vocab;
        for (int64_t k = 0; k < dim; ++k) {
          const double want = valid ? table.values[tokens[i] * dim + k] : 0.0;
          ASSERT_EQ(out[i * dim + k], want) << "token " << i << " dim " << k;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// RmsNorm

TEST(RmsNormTest, MatchesFloat64Reference) {
  const float eps = 1e-5f;
  for (int64_t n : {1, 3, 67}) {
    for (int64_t dim : {7, 96, 4096}) {
      // Rows of varied magnitude so eps matters for some and not for others.
      std::vector<float> x = RandomFloats(n * dim, static_cast<uint32_t>(n * dim));
      for (int64_t i = 0; i < n; ++i) {
        const float row_scale = std::ldexp(1.0f, static_cast<int>(i % 9) - 6);
        for (int64_t k = 0; k < dim; ++k) x[i * dim + k] *= row_scale;
      }
      const std::vector<float> weight = RandomFloats(dim, 5, -2.0f, 2.0f);
      std::vector<double> want(n * dim), scale(n * dim);
      for (int64_t i = 0; i < n; ++i) {
        double ss = 0.0;
        for (int64_t k = 0; k < dim; ++k)
          ss += static_cast<double>(x[i * dim + k]) * x[i * dim + k];
        const double inv_rms = 1.0 / std::sqrt(ss / dim + eps);
        for (int64_t k = 0; k < dim; ++k) {
          want[i * dim + k] = x[i * dim + k] * inv_rms * weight[k];
          scale[i * dim + k] = std::fabs(want[i * dim + k]);
        }
      }
      for (Isa isa : IsasToTest()) {
        SCOPED_TRACE(std::string(IsaName(isa)) + " n=" + std::to_string(n) +
                     " dim=" + std::to_string(dim));
        ScopedMaxIsa cap(isa);
        std::vector<float> out(n * dim, kNan);
        RmsNorm(x.data(), weight.data(), n, dim, eps, out.data());
        ExpectClose(out.data(), want, scale, kTol);
        // In place is how the model calls it for the final norm.
        std::vector<float> inplace = x;
        RmsNorm(inplace.data(), weight.data(), n, dim, eps, inplace.data());
        ExpectClose(inplace.data(), want, scale, kTol);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Rope

struct RopeCase {
  int64_t n;
  int n_heads;
  int head_dim;
  int rope_dim;
  float theta;
  RopeLayout layout = RopeLayout::kAdjacentPairs;
  double freq_scale = 1.0;
  bool factors = false;  // Llama-3-style per-pair divisors
};

TEST(RopeTest, MatchesFloat64Reference) {
  const RopeCase cases[] = {
      {1, 1, 64, 64, 10000.0f},
      {3, 4, 128, 128, 10000.0f},
      {67, 8, 64, 64, 500000.0f},
      {5, 3, 128, 64, 10000.0f},
      {2, 2, 6, 4, 10000.0f},
      {67, 32, 128, 128, 1e6f},
      {9, 4, 64, 64, 1e6f, RopeLayout::kHalves},
      {9, 2, 128, 96, 10000.0f, RopeLayout::kHalves},
      {7, 4, 64, 64, 500000.0f, RopeLayout::kAdjacentPairs, 1.0, true},
      {7, 4, 64, 32, 10000.0f, RopeLayout::kHalves, 0.25, true},
  };
  for (const RopeCase& c : cases) {
    const int64_t width = static_cast<int64_t>(c.n_heads) * c.head_dim;
    const std::vector<float> x = RandomFloats(c.n * width, static_cast<uint32_t>(width + c.n));
    std::vector<int64_t> positions(c.n);
    std::mt19937 rng(3);
    for (int64_t i = 0; i < c.n; ++i) {
      positions[i] = i == 0 ? 0 : std::uniform_int_distribution<int64_t>(0, 32767)(rng);
    }
    RopeParams params{
        .dim = c.rope_dim, .theta = c.theta, .layout = c.layout, .freq_scale = c.freq_scale};
    if (c.factors) {
      for (int p = 0; p < c.rope_dim / 2; ++p) params.freq_factors.push_back(1.0f + 0.37f * p);
    }
    absl::StatusOr<RopeSchedule> rope = RopeSchedule::Make(params);
    ASSERT_TRUE(rope.ok()) << rope.status();
    const bool halves = c.layout == RopeLayout::kHalves;
    std::vector<double> want(x.begin(), x.end()), scale(x.size());
    for (int64_t i = 0; i < c.n; ++i) {
      for (int h = 0; h < c.n_heads; ++h) {
        const int64_t base = i * width + static_cast<int64_t>(h) * c.head_dim;
        for (int d = 0; d < c.head_dim; ++d) scale[base + d] = std::fabs(x[base + d]);
        for (int p = 0; p < c.rope_dim / 2; ++p) {
          double angle = positions[i] * c.freq_scale *
                         std::pow(static_cast<double>(c.theta), -2.0 * p / c.rope_dim);
          if (c.factors) angle /= 1.0f + 0.37f * p;
          const int64_t a = base + (halves ? p : 2 * p);
          const int64_t b = a + (halves ? c.rope_dim / 2 : 1);
          const double x0 = x[a], x1 = x[b];
          want[a] = x0 * std::cos(angle) - x1 * std::sin(angle);
          want[b] = x0 * std::sin(angle) + x1 * std::cos(angle);
          scale[a] = scale[b] = std::hypot(x0, x1);
        }
      }
    }
    SCOPED_TRACE("n=" + std::to_string(c.n) + " heads=" + std::to_string(c.n_heads) +
                 " head_dim=" + std::to_string(c.head_dim) +
                 " rope_dim=" + std::to_string(c.rope_dim) + " halves=" + std::to_string(halves));
    std::vector<float> out = x;
    Rope(out.data(), c.n, c.n_heads, c.head_dim, *rope, positions.data());
    // Dims past rope_dim are left alone exactly (scale = |x|, tolerance 0).
    ExpectClose(out.data(), want, scale, kTol);
    for (int64_t i = 0; i < c.n; ++i) {
      for (int h = 0; h < c.n_heads; ++h) {
        for (int d = c.rope_dim; d < c.head_dim; ++d) {
          const int64_t at = i * width + static_cast<int64_t>(h) * c.head_dim + d;
          ASSERT_EQ(out[at], x[at]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGlu, AddInPlace, Softmax

// YaRN against its formulas written out here (ggml's rope_yarn and rope_yarn_corr_dims):
// frequencies between the two correction dims blend from unscaled to interpolated, and cos
// and sin grow by 1 + 0.1 ln(factor) times the attention factor.
TEST(RopeTest, YarnMatchesItsFormulas) {
  const int dim = 64;
  const double theta = 1e6, factor = 4.0, attn = 1.25;
  const int orig = 4096;
  absl::StatusOr<RopeSchedule> rope = RopeSchedule::Make({.dim = dim,
                                                          .theta = theta,
                                                          .layout = RopeLayout::kHalves,
                                                          .freq_scale = 1.0 / factor,
                                                          .yarn = true,
                                                          .yarn_original_context = orig,
                                                          .attn_factor = attn});
  ASSERT_TRUE(rope.ok()) << rope.status();
  const auto corr = [&](double rotations) {
    return dim * std::log(orig / (rotations * 2 * M_PI)) / (2 * std::log(theta));
  };
  const double low = std::max(0.0, std::floor(corr(32.0)));
  const double high = std::min(dim - 1.0, std::ceil(corr(1.0)));
  ASSERT_LT(low, high);
  for (int i = 0; i < dim / 2; ++i) {
    const double base = std::pow(theta, -2.0 * i / dim);
    double want = base / factor;  // interpolated
    if (i <= low) want = base;    // extrapolated: turns fast enough to keep its frequency
    if (i > low && i < high) {
      const double mix = 1.0 - (i - low) / (high - low);
      want = base * ((1.0 - mix) / factor + mix);
    }
    EXPECT_NEAR(rope->inv_freq[i] / want, 1.0, 1e-12) << "pair " << i;
  }
  EXPECT_NEAR(rope->mscale, attn * (1.0 + 0.1 * std::log(factor)), 1e-12);
  // The rotation carries the magnitude factor.
  std::vector<float> x(dim, 0.0f);
  x[0] = 1.0f;
  const int64_t pos = 7;
  Rope(x.data(), 1, 1, dim, *rope, &pos);
  EXPECT_NEAR(x[0], std::cos(7 * rope->inv_freq[0]) * rope->mscale, 1e-6);
  EXPECT_NEAR(x[dim / 2], std::sin(7 * rope->inv_freq[0]) * rope->mscale, 1e-6);
  // Without YaRN (or with ext_factor 0) it is plain linear interpolation.
  absl::StatusOr<RopeSchedule> off = RopeSchedule::Make({.dim = dim,
                                                         .theta = theta,
                                                         .freq_scale = 0.25,
                                                         .yarn = true,
                                                         .yarn_original_context = orig,
                                                         .yarn_ext_factor = 0.0});
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->mscale, 1.0);
  EXPECT_NEAR(off->inv_freq[0], 0.25, 1e-15);
  EXPECT_FALSE(RopeSchedule::Make({.dim = dim, .yarn = true}).ok());  // no original context
}

TEST(RopeTest, ScheduleRejectsBadParams) {
  EXPECT_FALSE(RopeSchedule::Make({.dim = 63}).ok());
  EXPECT_FALSE(RopeSchedule::Make({.dim = 0}).ok());
  EXPECT_FALSE(RopeSchedule::Make({.dim = 64, .theta = 0.0}).ok());
  EXPECT_FALSE(RopeSchedule::Make({.dim = 64, .freq_scale = -1.0}).ok());
  EXPECT_FALSE(RopeSchedule::Make({.dim = 8, .freq_factors = {1.0f, 2.0f}}).ok());
  EXPECT_FALSE(RopeSchedule::Make({.dim = 4, .freq_factors = {1.0f, 0.0f}}).ok());
  EXPECT_TRUE(RopeSchedule::Make({.dim = 4, .freq_factors = {1.0f, 8.0f}}).ok());
}
TEST(SwiGluTest, MatchesFloat64Reference) {
  for (int64_t n : {1, 7, 64, 1000, 100003}) {
    std::vector<float> gate = RandomFloats(n, static_cast<uint32_t>(n), -20.0f, 20.0f);
    const std::vector<float> up = RandomFloats(n, static_cast<uint32_t>(n + 1), -3.0f, 3.0f);
    // Where exp over- or underflows in fp32.
    const float extremes[] = {-100.0f, -88.5f, -87.0f, 0.0f, 87.0f, 88.5f, 100.0f, -1e-30f};
    for (size_t i = 0; i < std::size(extremes) && i < gate.size(); ++i) gate[i] = extremes[i];
    std::vector<double> want(n), scale(n);
    for (int64_t i = 0; i < n; ++i) {
      const double g = gate[i];
      want[i] = g / (1.0 + std::exp(-g)) * up[i];
      scale[i] = std::fabs(want[i]);
    }
    for (Isa isa : IsasToTest()) {
      SCOPED_TRACE(std::string(IsaName(isa)) + " n=" + std::to_string(n));
      ScopedMaxIsa cap(isa);
      std::vector<float> out(n, kNan);
      SwiGlu(gate.data(), up.data(), n, out.data());
      // The floor covers results below FLT_MIN that fp32 flushes towards 0.
      ExpectClose(out.data(), want, scale, kTol, 1e-37);
    }
  }
}

TEST(AddInPlaceTest, IsExactFloatAddition) {
  for (int64_t n : {1, 9, 4099}) {
    std::vector<float> x = RandomFloats(n, 1);
    const std::vector<float> y = RandomFloats(n, 2, -100.0f, 100.0f);
    std::vector<float> want = x;
    for (int64_t i = 0; i < n; ++i) want[i] = static_cast<float>(static_cast<double>(x[i]) + y[i]);
    AddInPlace(x.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x[i], want[i]) << i;
  }
}

TEST(SoftmaxTest, MatchesFloat64Reference) {
  for (int64_t n : {1, 5, 8, 33, 4096}) {
    for (float shift : {0.0f, 1000.0f, -1000.0f}) {
      std::vector<float> x = RandomFloats(n, static_cast<uint32_t>(n), -30.0f, 30.0f);
      for (float& v : x) v += shift;
      // Masked positions, as causal attention writes them.
      for (int64_t i = 3; i < n; i += 7) x[i] = -kInf;
      double max = -INFINITY;
      for (float v : x) max = std::max(max, static_cast<double>(v));
      std::vector<double> want(n), scale(n);
      double sum = 0.0;
      for (int64_t i = 0; i < n; ++i) sum += std::exp(x[i] - max);
      for (int64_t i = 0; i < n; ++i) {
        want[i] = std::exp(x[i] - max) / sum;
        scale[i] = want[i];
      }
      for (Isa isa : IsasToTest()) {
        SCOPED_TRACE(std::string(IsaName(isa)) + " n=" + std::to_string(n) +
                     " shift=" + std::to_string(shift));
        ScopedMaxIsa cap(isa);
        std::vector<float> out = x;
        Softmax(out.data(), n);
        ExpectClose(out.data(), want, scale, kTol, 1e-37);
        double total = 0.0;
        for (float v : out) total += v;
        EXPECT_NEAR(total, 1.0, 1e-5);
      }
    }
  }
}

// Regression: DetectedIsa() read F16C through __builtin_cpu_supports("f16c"), which clang 14
// rejects at compile time (the fuzz build); it now reads CPUID. It must still pick AVX2 exactly
// when the CPU has AVX2, FMA and F16C, as /proc/cpuinfo lists them.
TEST(IsaTest, DetectsAvx2ExactlyWhenCpuHasAvx2FmaF16c) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line) && line.rfind("flags", 0) != 0) {
  }
  if (line.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags line";
  std::istringstream words(line.substr(line.find(':') + 1));
  std::vector<std::string> flags(std::istream_iterator<std::string>(words), {});
  auto has = [&](const char* f) { return std::find(flags.begin(), flags.end(), f) != flags.end(); };
  const bool avx2 = has("avx2") && has("fma") && has("f16c");
  EXPECT_EQ(internal::DetectedIsa() == Isa::kAvx2, avx2);
}

}  // namespace
}  // namespace subspace::cpu
