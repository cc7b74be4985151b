// The per-layer kernels (embedding.cu, rms_norm.cu, rope.cu, swiglu.cu, residual.cu,
// append_kv.cu) against their CPU twins (layer_ops_ref.h, themselves checked against
// core/cpu/ops.h in layer_ops_ref_test.cc) across token counts, widths that are and are not
// multiples of the vector width and the CTA size, head_dim x GQA ratio, and block sizes.
// Fresh random inputs per case (the seed is printed; SUBSPACE_TEST_SEED pins it); outputs are
// poisoned (0xff: NaN) before each launch, and misaligned pointers drive the scalar paths.
//
// Tolerances:
//  - Embedding, RoPE split, residual add, fp16 cast, KV append: bit-exact. fp16 <-> fp32
//    conversions and single fp32 adds / multiplies are correctly rounded on both sides, and the
//    RoPE kernel uses explicitly rounded multiplies and adds (no FMA contraction), as the twin.
//  - RMSNorm and SwiGLU (fp16 outputs): at most 1 fp16 unit from the twin, and at most 1% (+1)
//    of the elements differ at all. RMSNorm's sum of squares is a float tree across the CTA
//    against the twin's double; SwiGLU's expf (<= 2 ulp) against std::exp. Both move the fp32
//    value by a few float ulps, enough to round an element near an fp16 midpoint the other way.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"
#include "cuda/rope_table.h"
#include "kernels/append_kv.h"
#include "kernels/embedding.h"
#include "kernels/kv_layout.h"
#include "kernels/residual.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "tests/kernels/cuda_test_util.h"
#include "tests/kernels/kv_test_data.h"
#include "tests/kernels/layer_ops_ref.h"

namespace subspace::kernels {
namespace {

using testing::DeviceBuffer;

// `count` elements starting `offset` elements into a device allocation: offset 1 misaligns the
// pointer so the launchers take their scalar paths.
template <typename T>
class DeviceSlice {
 public:
  DeviceSlice(size_t count, size_t offset) : buf_(count + offset), offset_(offset), count_(count) {}
  explicit DeviceSlice(const std::vector<T>& host, size_t offset = 0)
      : DeviceSlice(host.size(), offset) {
    if (buf_.ok() && Upload(host) != cudaSuccess) ok_ = false;
  }
  bool ok() const { return ok_ && buf_.ok(); }
  T* get() const { return buf_.get() + offset_; }
  cudaError_t Upload(const std::vector<T>& host) {
    if (host.size() != count_) return cudaErrorInvalidValue;
    return cudaMemcpy(get(), host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  cudaError_t Download(std::vector<T>* host) const {
    host->resize(count_);
    return cudaMemcpy(host->data(), get(), count_ * sizeof(T), cudaMemcpyDeviceToHost);
  }
  cudaError_t Poison() { return buf_.Poison(); }

 private:
  DeviceBuffer<T> buf_;
  size_t offset_ = 0, count_ = 0;
  bool ok_ = true;
};

std::vector<float> RandomFloats(int64_t n, float sigma, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(rng);
  return x;
}

// fp16 outputs: finite, within 1 unit of the twin, at most 1% (+1) differ.
void ExpectHalvesNear(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  ASSERT_EQ(got.size(), want.size());
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(HalfToFloat(got[i]))) << "element " << i << " is not finite";
    const int d = Fp16UlpDistance(got[i], want[i]);
    ASSERT_LE(d, 1) << "element " << i << ": " << HalfToFloat(got[i]) << " vs "
                    << HalfToFloat(want[i]);
    differ += d != 0;
  }
  EXPECT_LE(differ, static_cast<int64_t>(got.size()) / 100 + 1)
      << differ << " of " << got.size() << " differ by one fp16 unit";
}

void ExpectFloatsIdentical(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << "element " << i << " is NaN";
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
        << "element " << i << ": " << got[i] << " vs " << want[i];
  }
}

#define SUBSPACE_TRACE_SEED(seed) \
  SCOPED_TRACE(::testing::Message() << "seed " << (seed) << " (SUBSPACE_TEST_SEED pins it)")

// ---- Row-wise ops: embedding, RMSNorm, SwiGLU, residual --------------------------------------

// Tokens (rows), width (dim or ffn), misaligned pointers.
using RowShape = std::tuple<int, int, bool>;

std::string RowShapeName(const ::testing::TestParamInfo<RowShape>& info) {
  const auto& [n, width, misaligned] = info.param;
  return absl::StrCat("n", n, "_w", width, misaligned ? "_misaligned" : "");
}

// Widths: vector multiples (8, 128, 4096), multiples of 4 but not 8 (100), neither (1030, 4099);
// 1030 and 4099 are not multiples of the CTA size either.
const auto kRowShapes =
    ::testing::Combine(::testing::Values(1, 3, 17, 130),
                       ::testing::Values(8, 100, 128, 1030, 4096, 4099), ::testing::Bool());

class RowOpsGpuTest : public ::testing::TestWithParam<RowShape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(RowOpsGpuTest, EmbeddingIsBitExact) {
  const auto [n, dim, misaligned] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  const int vocab = 257;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> table(static_cast<size_t>(vocab) * dim);
  for (uint16_t& h : table) h = testing::RandomHalf(normal, rng);
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
  for (int32_t& t : tokens) t = pick(rng);
  if (n > 2) tokens[2] = vocab;  // outside the table: a zero row
  tokens[0] = n > 1 ? -5 : tokens[0];

  std::vector<float> want(static_cast<size_t>(n) * dim);
  EmbeddingRef({table.data(), tokens.data(), want.data(), n, dim, vocab});

  const size_t off = misaligned ? 1 : 0;
  DeviceSlice<uint16_t> d_table(table, off);
  DeviceSlice<int32_t> d_tokens(tokens);
  DeviceSlice<float> d_out(want.size(), off);
  ASSERT_TRUE(d_table.ok() && d_tokens.ok() && d_out.ok());
  SUBSPACE_ASSERT_CUDA(d_out.Poison());
  SUBSPACE_ASSERT_CUDA(
      LaunchEmbedding({d_table.get(), d_tokens.get(), d_out.get(), n, dim, vocab}, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> got;
  SUBSPACE_ASSERT_CUDA(d_out.Download(&got));
  ExpectFloatsIdentical(got, want);
}

TEST_P(RowOpsGpuTest, RmsNormWithinOneHalfUnit) {
  const auto [n, dim, misaligned] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  const int total_rows = n + 5;
  std::vector<float> x = RandomFloats(static_cast<int64_t>(total_rows) * dim, 1.0f, rng);
  std::uniform_real_distribution<float> log_scale(-6.0f, 6.0f);
  for (int r = 0; r < total_rows; ++r) {  // rows of very different magnitudes
    const float s = std::exp2(log_scale(rng));
    for (int j = 0; j < dim; ++j) x[static_cast<size_t>(r) * dim + j] *= s;
  }
  const std::vector<float> weight = RandomFloats(dim, 1.0f, rng);
  // The residual branch a fused add brings in, of its own magnitudes.
  const std::vector<float> add = RandomFloats(static_cast<int64_t>(total_rows) * dim, 4.0f, rng);
  // Distinct rows (a fused add must not add twice into one row), in a random order.
  std::vector<int32_t> rows(static_cast<size_t>(total_rows));
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(static_cast<size_t>(n));

  const size_t off = misaligned ? 1 : 0;
  DeviceSlice<float> d_w(weight, off), d_add(add, off);
  DeviceSlice<int32_t> d_rows(rows);
  DeviceSlice<uint16_t> d_out(static_cast<size_t>(n) * dim, off);
  ASSERT_TRUE(d_w.ok() && d_add.ok() && d_rows.ok() && d_out.ok());
  for (bool fused : {false, true}) {
    for (bool gather : {false, true}) {
      SCOPED_TRACE(absl::StrCat(gather ? "gathered rows" : "rows 0..n-1",
                                fused ? ", residual add fused" : ""));
      std::vector<float> x_ref = x;  // the twin adds into its rows as the kernel does
      DeviceSlice<float> d_x(x, off);
      ASSERT_TRUE(d_x.ok());
      std::vector<uint16_t> want(static_cast<size_t>(n) * dim);
      RmsNormRef({x_ref.data(), weight.data(), gather ? rows.data() : nullptr, want.data(), n, dim,
                  1e-5f, fused ? add.data() : nullptr});
      SUBSPACE_ASSERT_CUDA(d_out.Poison());
      SUBSPACE_ASSERT_CUDA(
          LaunchRmsNorm({d_x.get(), d_w.get(), gather ? d_rows.get() : nullptr, d_out.get(), n, dim,
                         1e-5f, fused ? d_add.get() : nullptr},
                        nullptr));
      SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<uint16_t> got;
      SUBSPACE_ASSERT_CUDA(d_out.Download(&got));
      ExpectHalvesNear(got, want);
      // The residual stream: the sums in the rows read, every other row untouched.
      std::vector<float> x_got;
      SUBSPACE_ASSERT_CUDA(d_x.Download(&x_got));
      ExpectFloatsIdentical(x_got, x_ref);
      if (fused) {
        EXPECT_NE(x_ref, x) << "the fused add changed nothing";
      }
    }
  }
}

TEST_P(RowOpsGpuTest, SwiGluWithinOneHalfUnit) {
  const auto [n, ffn, misaligned] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  std::vector<float> gate_up = RandomFloats(static_cast<int64_t>(n) * 2 * ffn, 3.0f, rng);
  gate_up[0] = -100.0f;  // e^-gate overflows: silu -> -0
  gate_up[1] = 95.0f;    // silu -> gate
  std::vector<uint16_t> want(static_cast<size_t>(n) * ffn);
  SwiGluRef({gate_up.data(), want.data(), n, ffn});

  const size_t off = misaligned ? 1 : 0;
  DeviceSlice<float> d_in(gate_up, off);
  DeviceSlice<uint16_t> d_out(want.size(), off);
  ASSERT_TRUE(d_in.ok() && d_out.ok());
  SUBSPACE_ASSERT_CUDA(d_out.Poison());
  SUBSPACE_ASSERT_CUDA(LaunchSwiGlu({d_in.get(), d_out.get(), n, ffn}, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> got;
  SUBSPACE_ASSERT_CUDA(d_out.Download(&got));
  ExpectHalvesNear(got, want);
}

TEST_P(RowOpsGpuTest, ResidualAddAndCastToHalfAreBitExact) {
  const auto [n, dim, misaligned] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  const int64_t count = static_cast<int64_t>(n) * dim;
  std::vector<float> x = RandomFloats(count, 10.0f, rng), y = RandomFloats(count, 0.5f, rng);
  // The cast's edge cases: fp16 overflow, its midpoint, subnormals, ties to even.
  const float edge[] = {65504.0f,
                        65520.0f,
                        1e6f,
                        -1e6f,
                        std::ldexp(1.0f, -24),
                        std::ldexp(1.0f, -25),
                        std::ldexp(3.0f, -25),
                        1.0f + std::ldexp(1.0f, -11),
                        -0.0f};
  for (size_t i = 0; i < std::size(edge) && i < x.size(); ++i) x[x.size() - 1 - i] = edge[i];

  const size_t off = misaligned ? 1 : 0;
  DeviceSlice<float> d_x(x, off), d_y(y, off);
  DeviceSlice<uint16_t> d_half(static_cast<size_t>(count), off);
  ASSERT_TRUE(d_x.ok() && d_y.ok() && d_half.ok());

  std::vector<uint16_t> want_half(static_cast<size_t>(count));
  CastToHalfRef({x.data(), want_half.data(), count});
  SUBSPACE_ASSERT_CUDA(d_half.Poison());
  SUBSPACE_ASSERT_CUDA(LaunchCastToHalf({d_x.get(), d_half.get(), count}, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> got_half;
  SUBSPACE_ASSERT_CUDA(d_half.Download(&got_half));
  for (int64_t i = 0; i < count; ++i) {
    ASSERT_EQ(got_half[i], want_half[i]) << "cast of element " << i << " = " << x[i];
  }

  std::vector<float> want = x;
  ResidualAddRef({want.data(), y.data(), count});
  SUBSPACE_ASSERT_CUDA(LaunchResidualAdd({d_x.get(), d_y.get(), count}, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> got;
  SUBSPACE_ASSERT_CUDA(d_x.Download(&got));
  ExpectFloatsIdentical(got, want);
}

// Rows in any order, repeated or skipped; the rows not gathered are never read (NaN there).
TEST_P(RowOpsGpuTest, GatherRowsToHalfIsBitExact) {
  const auto [n, dim, misaligned] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  const int64_t count = static_cast<int64_t>(n) * dim;
  std::vector<float> x = RandomFloats(count, 10.0f, rng);
  std::vector<int32_t> rows;
  for (int i = 0; i < n; i += 2) rows.push_back(n - 1 - i);  // every other row, backwards
  rows.push_back(0);
  rows.push_back(0);
  for (int i = 0; i < n; ++i) {
    if (std::find(rows.begin(), rows.end(), i) == rows.end()) {
      std::fill_n(x.begin() + static_cast<int64_t>(i) * dim, dim, std::nanf(""));
    }
  }
  const int32_t n_rows = static_cast<int32_t>(rows.size());
  const size_t off = misaligned ? 1 : 0;
  DeviceSlice<float> d_x(x, off);
  DeviceSlice<int32_t> d_rows(rows, 0);
  DeviceSlice<uint16_t> d_out(static_cast<size_t>(n_rows) * dim, off);
  ASSERT_TRUE(d_x.ok() && d_rows.ok() && d_out.ok());
  std::vector<uint16_t> want(static_cast<size_t>(n_rows) * dim);
  GatherRowsToHalfRef({x.data(), rows.data(), want.data(), n_rows, dim});
  SUBSPACE_ASSERT_CUDA(d_out.Poison());
  SUBSPACE_ASSERT_CUDA(
      LaunchGatherRowsToHalf({d_x.get(), d_rows.get(), d_out.get(), n_rows, dim}, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> got;
  SUBSPACE_ASSERT_CUDA(d_out.Download(&got));
  ASSERT_EQ(got, want);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RowOpsGpuTest, kRowShapes, RowShapeName);

// ---- RoPE + QKV split ------------------------------------------------------------------------

// head_dim, tokens, (n_heads, n_kv_heads), rope_dim == head_dim (else head_dim / 2).
using RopeShape = std::tuple<int, int, std::pair<int, int>, bool>;

std::string RopeShapeName(const ::testing::TestParamInfo<RopeShape>& info) {
  const auto& [hd, n, heads, full] = info.param;
  return absl::StrCat("d", hd, "_n", n, "_h", heads.first, "_kv", heads.second,
                      full ? "" : "_partial");
}

struct RopeRun {
  std::vector<float> q, k, v;
};

// Runs the kernel and the twin on one case; pointers misaligned by `off` floats.
void RunRope(const RopeSplitQkvParams& shape, const std::vector<float>& qkv,
             const std::vector<int32_t>& positions, const std::vector<float>& table, size_t off,
             RopeRun* want, RopeRun* got, const std::vector<float>& bias = {},
             const std::vector<float>& norms = {}) {
  const size_t nq = static_cast<size_t>(shape.n) * shape.n_heads * shape.head_dim;
  const size_t nkv = static_cast<size_t>(shape.n) * shape.n_kv_heads * shape.head_dim;
  want->q.assign(nq, 0.0f);
  want->k.assign(nkv, 0.0f);
  want->v.assign(nkv, 0.0f);
  RopeSplitQkvParams p = shape;
  p.qkv = qkv.data();
  p.positions = positions.data();
  p.cos_sin = table.data();
  p.q = want->q.data();
  p.k = want->k.data();
  p.v = want->v.data();
  p.bias = bias.empty() ? nullptr : bias.data();
  // norms: [q_norm | k_norm], head_dim each.
  p.q_norm = norms.empty() ? nullptr : norms.data();
  p.k_norm = norms.empty() ? nullptr : norms.data() + shape.head_dim;
  RopeSplitQkvRef(p);

  DeviceSlice<float> d_qkv(qkv, off), d_table(table, off);
  DeviceSlice<float> d_bias(bias.empty() ? std::vector<float>{0.0f} : bias);
  ASSERT_TRUE(d_bias.ok());
  p.bias = bias.empty() ? nullptr : d_bias.get();
  DeviceSlice<float> d_norms(norms.empty() ? std::vector<float>{0.0f} : norms);
  ASSERT_TRUE(d_norms.ok());
  p.q_norm = norms.empty() ? nullptr : d_norms.get();
  p.k_norm = norms.empty() ? nullptr : d_norms.get() + shape.head_dim;
  DeviceSlice<int32_t> d_pos(positions);
  DeviceSlice<float> d_q(nq, off), d_k(nkv, off), d_v(nkv, off);
  ASSERT_TRUE(d_qkv.ok() && d_table.ok() && d_pos.ok() && d_q.ok() && d_k.ok() && d_v.ok());
  SUBSPACE_ASSERT_CUDA(d_q.Poison());
  SUBSPACE_ASSERT_CUDA(d_k.Poison());
  SUBSPACE_ASSERT_CUDA(d_v.Poison());
  p.qkv = d_qkv.get();
  p.positions = d_pos.get();
  p.cos_sin = d_table.get();
  p.q = d_q.get();
  p.k = d_k.get();
  p.v = d_v.get();
  SUBSPACE_ASSERT_CUDA(LaunchRopeSplitQkv(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  SUBSPACE_ASSERT_CUDA(d_q.Download(&got->q));
  SUBSPACE_ASSERT_CUDA(d_k.Download(&got->k));
  SUBSPACE_ASSERT_CUDA(d_v.Download(&got->v));
}

class RopeGpuTest : public ::testing::TestWithParam<RopeShape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(RopeGpuTest, SplitAndRotationAreBitExact) {
  const auto [hd, n, heads, full] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  RopeSplitQkvParams shape;
  shape.n = n;
  shape.n_heads = heads.first;
  shape.n_kv_heads = heads.second;
  shape.head_dim = hd;
  shape.rope_dim = full ? hd : hd / 2;
  shape.max_position = 4096;
  const std::vector<float> qkv =
      RandomFloats(static_cast<int64_t>(n) * (heads.first + 2 * heads.second) * hd, 2.0f, rng);
  const std::vector<float> table =
      cuda::RopeCosSinTable(shape.max_position, shape.rope_dim, full ? 500000.0f : 10000.0f);
  std::vector<int32_t> positions(static_cast<size_t>(n));
  std::uniform_int_distribution<int32_t> pick(0, shape.max_position - 1);
  for (int32_t& p : positions) p = pick(rng);
  positions[0] = shape.max_position - 1;  // the table's last row
  RopeRun want, got;
  ASSERT_NO_FATAL_FAILURE(RunRope(shape, qkv, positions, table, 0, &want, &got));
  {
    SCOPED_TRACE("q");
    ExpectFloatsIdentical(got.q, want.q);
  }
  {
    SCOPED_TRACE("k");
    ExpectFloatsIdentical(got.k, want.k);
  }
  {
    SCOPED_TRACE("v");
    ExpectFloatsIdentical(got.v, want.v);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeGpuTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(1, 3, 17, 70),
                                            ::testing::Values(std::pair{4, 4}, std::pair{8, 2},
                                                              std::pair{14, 2}, std::pair{32, 8}),
                                            ::testing::Bool()),
                         RopeShapeName);

// The scalar path: misaligned pointers, and a head_dim that is not a multiple of 4.
TEST(RopeGpuScalarTest, MisalignedAndOddShapesAreBitExact) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  struct Case {
    int head_dim, rope_dim;
    size_t off;
  };
  for (const Case& c : {Case{64, 64, 1}, Case{128, 64, 1}, Case{10, 6, 0}, Case{18, 18, 1}}) {
    SCOPED_TRACE(::testing::Message()
                 << "head_dim " << c.head_dim << " rope_dim " << c.rope_dim << " offset " << c.off);
    RopeSplitQkvParams shape;
    shape.n = 19;
    shape.n_heads = 6;
    shape.n_kv_heads = 2;
    shape.head_dim = c.head_dim;
    shape.rope_dim = c.rope_dim;
    shape.max_position = 300;
    const std::vector<float> qkv = RandomFloats(19 * 10 * c.head_dim, 2.0f, rng);
    const std::vector<float> table = cuda::RopeCosSinTable(300, c.rope_dim, 10000.0f);
    std::vector<int32_t> positions(19);
    std::uniform_int_distribution<int32_t> pick(0, 299);
    for (int32_t& p : positions) p = pick(rng);
    RopeRun want, got;
    ASSERT_NO_FATAL_FAILURE(RunRope(shape, qkv, positions, table, c.off, &want, &got));
    ExpectFloatsIdentical(got.q, want.q);
    ExpectFloatsIdentical(got.k, want.k);
    ExpectFloatsIdentical(got.v, want.v);
  }
}

// Qwen2-style rows: Q/K/V biases added first and the halves pair layout, bit-exact with the
// twin (which the ref test holds to cpu::AddBias + cpu::Rope), aligned and misaligned.
TEST(RopeGpuScalarTest, BiasesAndHalvesAreBitExact) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  struct Case {
    int head_dim, rope_dim;
    size_t off;
    bool halves, bias;
  };
  for (const Case& c :
       {Case{64, 64, 0, true, true}, Case{128, 128, 0, true, false}, Case{64, 64, 0, false, true},
        Case{128, 64, 1, true, true}, Case{10, 6, 0, true, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << "head_dim " << c.head_dim << " rope_dim " << c.rope_dim << " offset " << c.off
                 << " halves " << c.halves << " bias " << c.bias);
    RopeSplitQkvParams shape;
    shape.n = 13;
    shape.n_heads = 6;
    shape.n_kv_heads = 2;
    shape.head_dim = c.head_dim;
    shape.rope_dim = c.rope_dim;
    shape.max_position = 300;
    shape.halves = c.halves;
    const std::vector<float> qkv = RandomFloats(13 * 10 * c.head_dim, 2.0f, rng);
    const std::vector<float> bias =
        c.bias ? RandomFloats(10 * c.head_dim, 0.5f, rng) : std::vector<float>{};
    const std::vector<float> table = cuda::RopeCosSinTable(300, c.rope_dim, 1e6f);
    std::vector<int32_t> positions(13);
    std::uniform_int_distribution<int32_t> pick(0, 299);
    for (int32_t& p : positions) p = pick(rng);
    RopeRun want, got;
    ASSERT_NO_FATAL_FAILURE(RunRope(shape, qkv, positions, table, c.off, &want, &got, bias));
    ExpectFloatsIdentical(got.q, want.q);
    ExpectFloatsIdentical(got.k, want.k);
    ExpectFloatsIdentical(got.v, want.v);
  }
}

// Qwen3-style rows: per-head RMSNorm of Q and K (one warp per head, the sum of squares in
// double in another order than the twin's, so equal to ~1 ulp rather than bit for bit).
TEST(RopeGpuScalarTest, HeadNormsMatchTheTwin) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  for (const int head_dim : {64, 128}) {
    SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim);
    RopeSplitQkvParams shape;
    shape.n = 9;
    shape.n_heads = 8;
    shape.n_kv_heads = 2;
    shape.head_dim = head_dim;
    shape.rope_dim = head_dim;
    shape.max_position = 300;
    shape.halves = true;
    shape.norm_eps = 1e-6f;
    const std::vector<float> qkv = RandomFloats(9 * 12 * head_dim, 2.0f, rng);
    std::vector<float> norms = RandomFloats(2 * head_dim, 0.3f, rng);
    for (float& w : norms) w += 1.0f;
    const std::vector<float> table = cuda::RopeCosSinTable(300, head_dim, 1e6f);
    std::vector<int32_t> positions(9);
    std::uniform_int_distribution<int32_t> pick(0, 299);
    for (int32_t& p : positions) p = pick(rng);
    RopeRun want, got;
    ASSERT_NO_FATAL_FAILURE(RunRope(shape, qkv, positions, table, 0, &want, &got, {}, norms));
    for (auto [g, w] : {std::pair{&got.q, &want.q}, std::pair{&got.k, &want.k}}) {
      ASSERT_EQ(g->size(), w->size());
      for (size_t i = 0; i < g->size(); ++i) {
        ASSERT_NEAR((*g)[i], (*w)[i], 2e-6f * (1.0f + std::fabs((*w)[i]))) << i;
      }
    }
    ExpectFloatsIdentical(got.v, want.v);
  }
}

// A position outside the table: NaN Q and K rows (never a read past the table), V still copied.
TEST(RopeGpuScalarTest, PositionsOutsideTheTableGiveNanRows) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  std::mt19937_64 rng(1);
  for (size_t off : {0, 1}) {
    RopeSplitQkvParams shape;
    shape.n = 3;
    shape.n_heads = 4;
    shape.n_kv_heads = 2;
    shape.head_dim = 64;
    shape.rope_dim = 64;
    shape.max_position = 16;
    const std::vector<float> qkv = RandomFloats(3 * 8 * 64, 1.0f, rng);
    const std::vector<float> table = cuda::RopeCosSinTable(16, 64, 10000.0f);
    RopeRun want, got;
    ASSERT_NO_FATAL_FAILURE(RunRope(shape, qkv, {3, 16, -1}, table, off, &want, &got));
    for (size_t i = 0; i < got.q.size(); ++i) {
      ASSERT_EQ(std::isnan(got.q[i]), i >= 4 * 64) << "q element " << i;
      if (i < 4 * 64) {
        ASSERT_EQ(got.q[i], want.q[i]) << "q element " << i;
      }
    }
    for (size_t i = 0; i < got.k.size(); ++i) {
      ASSERT_EQ(std::isnan(got.k[i]), i >= 2 * 64) << "k element " << i;
    }
    ExpectFloatsIdentical(got.v, want.v);
  }
}

// ---- KV append -------------------------------------------------------------------------------

// head_dim, block size, tokens, n_kv_heads, misaligned k/v.
using AppendShape = std::tuple<int, int, int, int, bool>;

std::string AppendShapeName(const ::testing::TestParamInfo<AppendShape>& info) {
  const auto& [hd, bs, n, n_kv, misaligned] = info.param;
  return absl::StrCat("d", hd, "_b", bs, "_n", n, "_kv", n_kv, misaligned ? "_misaligned" : "");
}

// Runs kernel and twin on a poisoned pool; every pool byte must agree.
void CheckAppendKv(const KvPoolLayout& l, int n, bool misaligned, std::mt19937_64& rng) {
  // Enough pages for every token plus two nobody writes; slots scattered over them, every
  // fifth token padding (-1).
  const int64_t num_pages = (n + l.block_size - 1) / l.block_size + 2;
  std::vector<int64_t> free(static_cast<size_t>(num_pages * l.block_size));
  for (size_t s = 0; s < free.size(); ++s) free[s] = static_cast<int64_t>(s);
  std::shuffle(free.begin(), free.end(), rng);
  std::vector<int64_t> mapping(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) mapping[i] = i % 5 == 4 ? -1 : free[static_cast<size_t>(i)];
  const int64_t row = static_cast<int64_t>(l.n_kv_heads) * l.head_dim;
  const std::vector<float> k = RandomFloats(n * row, 1.0f, rng);
  const std::vector<float> v = RandomFloats(n * row, 1.0f, rng);
  std::vector<uint8_t> want(static_cast<size_t>(num_pages * l.page_bytes), testing::kPoison);
  AppendKvParams p;
  p.layout = l;
  p.pool = want.data();
  p.k = k.data();
  p.v = v.data();
  p.slot_mapping = mapping.data();
  p.n = n;
  AppendKvRef(p);

  const size_t off = misaligned ? 1 : 0;
  DeviceSlice<uint8_t> d_pool(want.size(), 0);
  DeviceSlice<float> d_k(k, off), d_v(v, off);
  DeviceSlice<int64_t> d_map(mapping);
  ASSERT_TRUE(d_pool.ok() && d_k.ok() && d_v.ok() && d_map.ok());
  SUBSPACE_ASSERT_CUDA(d_pool.Poison());
  p.pool = d_pool.get();
  p.k = d_k.get();
  p.v = d_v.get();
  p.slot_mapping = d_map.get();
  SUBSPACE_ASSERT_CUDA(LaunchAppendKv(p, nullptr));
  SUBSPACE_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> got;
  SUBSPACE_ASSERT_CUDA(d_pool.Download(&got));
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "pool byte " << i << " (page " << i / l.page_bytes << ")";
  }
}

class AppendKvGpuTest : public ::testing::TestWithParam<AppendShape> {
 protected:
  void SetUp() override { SUBSPACE_REQUIRE_CUDA_DEVICE(); }
};

TEST_P(AppendKvGpuTest, WritesExactlyTheMappedSlots) {
  const auto [hd, bs, n, n_kv, misaligned] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  const KvPoolLayout l = MakeKvPoolLayout(n_kv, hd, bs, 8, 8, CoeffDtype::kFp16);
  CheckAppendKv(l, n, misaligned, rng);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AppendKvGpuTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(1, 16, 64),
                                            ::testing::Values(1, 3, 17, 70),
                                            ::testing::Values(1, 2, 8), ::testing::Bool()),
                         AppendShapeName);

TEST(AppendKvGpuScalarTest, HeadDimNotAMultipleOfFour) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const uint64_t seed = testing::FreshSeed();
  SUBSPACE_TRACE_SEED(seed);
  std::mt19937_64 rng(seed);
  KvPoolLayout l;  // only the fields the kernel reads
  l.n_kv_heads = 3;
  l.head_dim = 10;
  l.block_size = 16;
  l.page_bytes = 2 * 3 * 16 * 10 * 2;
  CheckAppendKv(l, 40, false, rng);
}

// ---- Launcher validation ---------------------------------------------------------------------

TEST(LayerOpsGpuLimitsTest, LaunchersRejectBadSizes) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  EXPECT_EQ(LaunchEmbedding({nullptr, nullptr, nullptr, 0, 64, 10}, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchEmbedding({nullptr, nullptr, nullptr, 1, -1, 10}, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchEmbedding({nullptr, nullptr, nullptr, 1, 64, 0}, nullptr), cudaErrorInvalidValue);

  EXPECT_EQ(LaunchRmsNorm({nullptr, nullptr, nullptr, nullptr, 0, 64, 1e-5f}, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchRmsNorm({nullptr, nullptr, nullptr, nullptr, 2, 0, 1e-5f}, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchRmsNorm({nullptr, nullptr, nullptr, nullptr, 2, 64, -1.0f}, nullptr),
            cudaErrorInvalidValue);

  RopeSplitQkvParams rope;
  rope.n = 1;
  rope.n_heads = 4;
  rope.n_kv_heads = 2;
  rope.head_dim = 64;
  rope.rope_dim = 64;
  rope.max_position = 16;
  const auto rope_with = [&](auto edit) {
    RopeSplitQkvParams p = rope;
    edit(p);
    return LaunchRopeSplitQkv(p, nullptr);
  };
  EXPECT_EQ(rope_with([](RopeSplitQkvParams& p) { p.n = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(rope_with([](RopeSplitQkvParams& p) { p.n_heads = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(rope_with([](RopeSplitQkvParams& p) { p.n_kv_heads = -2; }), cudaErrorInvalidValue);
  EXPECT_EQ(rope_with([](RopeSplitQkvParams& p) { p.head_dim = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(rope_with([](RopeSplitQkvParams& p) { p.rope_dim = 0; }), cudaErrorInvalidValue);
  EXPECT_EQ(rope_with([](RopeSplitQkvParams& p) { p.rope_dim = 63; }), cudaErrorInvalidValue);
  EXPECT_EQ(rope_with([](RopeSplitQkvParams& p) { p.rope_dim = 66; }), cudaErrorInvalidValue);
  EXPECT_EQ(rope_with([](RopeSplitQkvParams& p) { p.max_position = 0; }), cudaErrorInvalidValue);

  EXPECT_EQ(LaunchSwiGlu({nullptr, nullptr, 0, 64}, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchSwiGlu({nullptr, nullptr, 3, -64}, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchGatherRowsToHalf({nullptr, nullptr, nullptr, 0, 64}, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchGatherRowsToHalf({nullptr, nullptr, nullptr, 2, 0}, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchResidualAdd({nullptr, nullptr, 0}, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchCastToHalf({nullptr, nullptr, -4}, nullptr), cudaErrorInvalidValue);

  AppendKvParams append;
  append.layout = MakeKvPoolLayout(2, 64, 16, 8, 8, CoeffDtype::kFp16);
  append.n = 0;
  EXPECT_EQ(LaunchAppendKv(append, nullptr), cudaErrorInvalidValue);
  append.n = 1;
  append.layout.page_bytes -= 2;  // the V half would spill into the next page
  EXPECT_EQ(LaunchAppendKv(append, nullptr), cudaErrorInvalidValue);
  append.layout = MakeKvPoolLayout(2, 64, 16, 8, 8, CoeffDtype::kFp16);
  append.layout.block_size = 0;
  EXPECT_EQ(LaunchAppendKv(append, nullptr), cudaErrorInvalidValue);
  // Nothing above reached the device: no launch error is pending.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace subspace::kernels
