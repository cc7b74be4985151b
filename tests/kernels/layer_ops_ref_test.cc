// The per-layer kernels' CPU twins (layer_ops_ref.h) against the CPU backend's ops
// (core/cpu/ops.h) on fresh random inputs, so holding a kernel to its twin holds it to the CPU
// backend. Tolerances:
//  - EmbeddingRef, ResidualAddRef, CastToHalfRef, AppendKvRef: bit-exact (fp16 <-> fp32 and an
//    fp32 add are exact or correctly rounded everywhere).
//  - RopeSplitQkvRef: bit-exact on Q and K against cpu::Rope (same angles, same float
//    expressions), V copied exactly; RopeCosSinTable bit-exact against cpu::Rope's own angles.
//  - RmsNormRef, SwiGluRef (fp16 outputs) against the CPU's fp32 result rounded to fp16: at
//    most 1 fp16 unit apart, and at most 1% (+1) of the elements differ at all. The twins sum
//    squares in double and use std::exp; cpu::RmsNorm sums in float lanes and cpu::SwiGlu uses
//    a polynomial exp (~2 float ulp), so the fp32 values differ by a few float ulps and an
//    element that lies near an fp16 rounding midpoint may round the other way.
#include "tests/kernels/layer_ops_ref.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"
#include "core/base/weight.h"
#include "core/cpu/ops.h"
#include "cuda/rope_table.h"
#include "kernels/kv_layout.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

std::vector<float> RandomFloats(int64_t n, float sigma, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(rng);
  return x;
}

// fp16 `got` against the fp32 `want` rounded to fp16: within 1 unit, at most 1% (+1) differ.
void ExpectHalvesNear(const std::vector<uint16_t>& got, const std::vector<float>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const uint16_t w = Fp32ToFp16(want[i]);
    ASSERT_TRUE(std::isfinite(HalfToFloat(got[i]))) << what << " element " << i;
    const int d = Fp16UlpDistance(got[i], w);
    ASSERT_LE(d, 1) << what << " element " << i << ": " << HalfToFloat(got[i]) << " vs " << want[i];
    differ += d != 0;
  }
  EXPECT_LE(differ, static_cast<int64_t>(got.size()) / 100 + 1)
      << what << ": " << differ << " of " << got.size() << " differ by one fp16 unit";
}

TEST(LayerOpsRefTest, EmbeddingMatchesCpuEmbedBitForBit) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  for (int dim : {1, 7, 64, 100, 4096}) {
    const int vocab = 300, n = 37;
    std::vector<uint16_t> table(static_cast<size_t>(vocab) * dim);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint16_t& h : table) h = testing::RandomHalf(normal, rng);
    std::vector<int32_t> tokens(n);
    std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
    for (int32_t& t : tokens) t = pick(rng);
    tokens[3] = -1;  // ids outside the table: zero rows
    tokens[5] = vocab;
    tokens[6] = std::numeric_limits<int32_t>::max();
    const WeightMatrix w{TensorType::kF16, vocab, dim,
                         reinterpret_cast<const uint8_t*>(table.data())};
    std::vector<float> want(static_cast<size_t>(n) * dim), got(want.size(), -1.0f);
    cpu::Embed(w, tokens.data(), n, want.data());
    EmbeddingRef({table.data(), tokens.data(), got.data(), n, dim, vocab});
    ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
        << "dim " << dim;
    EXPECT_EQ(got[static_cast<size_t>(3) * dim], 0.0f);
  }
}

TEST(LayerOpsRefTest, RmsNormMatchesCpuRmsNormWithinOneHalfUnit) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> log_scale(-6.0f, 6.0f);
  for (int dim : {1, 5, 64, 257, 4096, 4099}) {
    for (bool gather : {false, true}) {
      const int total_rows = 40, n = gather ? 17 : total_rows;
      std::vector<float> x = RandomFloats(static_cast<int64_t>(total_rows) * dim, 1.0f, rng);
      for (int r = 0; r < total_rows; ++r) {  // rows of very different magnitudes
        const float s = std::exp2(log_scale(rng));
        for (int j = 0; j < dim; ++j) x[static_cast<size_t>(r) * dim + j] *= s;
      }
      std::vector<float> weight = RandomFloats(dim, 1.0f, rng);
      std::vector<int32_t> rows(n);
      std::uniform_int_distribution<int32_t> pick(0, total_rows - 1);
      for (int32_t& r : rows) r = pick(rng);
      // The CPU op normalises contiguous rows: gather them first.
      std::vector<float> gathered(static_cast<size_t>(n) * dim), want(gathered.size());
      for (int i = 0; i < n; ++i) {
        const int r = gather ? rows[i] : i;
        std::memcpy(gathered.data() + static_cast<size_t>(i) * dim,
                    x.data() + static_cast<size_t>(r) * dim, sizeof(float) * dim);
      }
      cpu::RmsNorm(gathered.data(), weight.data(), n, dim, 1e-5f, want.data());
      std::vector<uint16_t> got(want.size(), 0xffff);
      RmsNormRef(
          {x.data(), weight.data(), gather ? rows.data() : nullptr, got.data(), n, dim, 1e-5f});
      ExpectHalvesNear(got, want, "dim " + std::to_string(dim) + (gather ? " gathered" : ""));
    }
  }
}

// One Q, K, V row block of random values, for n tokens at random positions.
struct RopeCase {
  int n = 0, n_heads = 0, n_kv = 0, head_dim = 0, rope_dim = 0, max_position = 0;
  float theta = 0.0f;
  std::vector<float> qkv, table;
  std::vector<int32_t> positions;
};

RopeCase RandomRopeCase(int n, int n_heads, int n_kv, int head_dim, int rope_dim, int max_position,
                        float theta, std::mt19937_64& rng) {
  RopeCase c{n, n_heads, n_kv, head_dim, rope_dim, max_position, theta};
  c.qkv = RandomFloats(static_cast<int64_t>(n) * (n_heads + 2 * n_kv) * head_dim, 2.0f, rng);
  c.table = cuda::RopeCosSinTable(max_position, rope_dim, theta);
  std::uniform_int_distribution<int32_t> pick(0, max_position - 1);
  for (int i = 0; i < n; ++i) c.positions.push_back(pick(rng));
  c.positions[0] = max_position - 1;  // the table's last row and, below, its first
  if (n > 1) c.positions[1] = 0;
  return c;
}

// The case's fused rows split into Q, K and V as the CPU backend computes them.
void SplitOnCpu(const RopeCase& c, std::vector<float>* q, std::vector<float>* k,
                std::vector<float>* v) {
  const int64_t nq = static_cast<int64_t>(c.n_heads) * c.head_dim;
  const int64_t nkv = static_cast<int64_t>(c.n_kv) * c.head_dim;
  q->resize(static_cast<size_t>(c.n * nq));
  k->resize(static_cast<size_t>(c.n * nkv));
  v->resize(k->size());
  for (int i = 0; i < c.n; ++i) {
    const float* row = c.qkv.data() + i * (nq + 2 * nkv);
    std::memcpy(q->data() + i * nq, row, sizeof(float) * nq);
    std::memcpy(k->data() + i * nkv, row + nq, sizeof(float) * nkv);
    std::memcpy(v->data() + i * nkv, row + nq + nkv, sizeof(float) * nkv);
  }
}

TEST(LayerOpsRefTest, RopeSplitQkvMatchesCpuRopeBitForBit) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  struct Shape {
    int n_heads, n_kv, head_dim, rope_dim;
    float theta;
  };
  for (const Shape& s : {Shape{4, 4, 64, 64, 10000.0f}, Shape{8, 2, 128, 128, 500000.0f},
                         Shape{6, 1, 64, 32, 10000.0f}, Shape{2, 2, 10, 6, 1e6f}}) {
    const int n = 23, max_position = 9000;
    const RopeCase c =
        RandomRopeCase(n, s.n_heads, s.n_kv, s.head_dim, s.rope_dim, max_position, s.theta, rng);
    // CPU: split, then rotate Q and K in place.
    std::vector<float> want_q, want_k, want_v;
    SplitOnCpu(c, &want_q, &want_k, &want_v);
    const std::vector<int64_t> pos64(c.positions.begin(), c.positions.end());
    const RopeSchedule rope = *RopeSchedule::Make({.dim = s.rope_dim, .theta = s.theta});
    cpu::Rope(want_q.data(), n, s.n_heads, s.head_dim, rope, pos64.data());
    cpu::Rope(want_k.data(), n, s.n_kv, s.head_dim, rope, pos64.data());

    std::vector<float> q(want_q.size(), -7.0f), k(want_k.size(), -7.0f), v(want_v.size(), -7.0f);
    RopeSplitQkvRef({c.qkv.data(), c.positions.data(), c.table.data(), q.data(), k.data(), v.data(),
                     n, s.n_heads, s.n_kv, s.head_dim, s.rope_dim, max_position});
    const std::string what =
        "head_dim " + std::to_string(s.head_dim) + " rope_dim " + std::to_string(s.rope_dim);
    EXPECT_EQ(0, std::memcmp(q.data(), want_q.data(), q.size() * sizeof(float))) << what;
    EXPECT_EQ(0, std::memcmp(k.data(), want_k.data(), k.size() * sizeof(float))) << what;
    EXPECT_EQ(0, std::memcmp(v.data(), want_v.data(), v.size() * sizeof(float))) << what;
  }
}

// Qwen2-style rows: the twin adds the Q/K/V biases as cpu::AddBias does, then rotates halves
// as cpu::Rope does with a kHalves schedule, bit for bit.
TEST(LayerOpsRefTest, RopeSplitQkvWithBiasesAndHalvesMatchesCpuBitForBit) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  for (const bool halves : {true, false}) {
    const int n = 11, heads = 6, kv = 2, hd = 64, rope_dim = 64, max_position = 500;
    const RopeCase c = RandomRopeCase(n, heads, kv, hd, rope_dim, max_position, 1e6f, rng);
    const std::vector<float> bias = RandomFloats((heads + 2 * kv) * hd, 0.5f, rng);
    const int64_t nq = heads * hd, nkv = kv * hd;
    std::vector<float> want_q, want_k, want_v;
    SplitOnCpu(c, &want_q, &want_k, &want_v);
    cpu::AddBias(want_q.data(), bias.data(), n, nq);
    cpu::AddBias(want_k.data(), bias.data() + nq, n, nkv);
    cpu::AddBias(want_v.data(), bias.data() + nq + nkv, n, nkv);
    const std::vector<int64_t> pos64(c.positions.begin(), c.positions.end());
    const RopeSchedule rope =
        *RopeSchedule::Make({.dim = rope_dim,
                             .theta = 1e6,
                             .layout = halves ? RopeLayout::kHalves : RopeLayout::kAdjacentPairs});
    cpu::Rope(want_q.data(), n, heads, hd, rope, pos64.data());
    cpu::Rope(want_k.data(), n, kv, hd, rope, pos64.data());
    std::vector<float> q(want_q.size()), k(want_k.size()), v(want_v.size());
    RopeSplitQkvRef({c.qkv.data(), c.positions.data(), c.table.data(), q.data(), k.data(), v.data(),
                     n, heads, kv, hd, rope_dim, max_position, bias.data(), halves});
    EXPECT_EQ(0, std::memcmp(q.data(), want_q.data(), q.size() * sizeof(float))) << halves;
    EXPECT_EQ(0, std::memcmp(k.data(), want_k.data(), k.size() * sizeof(float))) << halves;
    EXPECT_EQ(0, std::memcmp(v.data(), want_v.data(), v.size() * sizeof(float))) << halves;
  }
}

// Qwen3-style rows: the twin normalises every Q and K head as core/model/model.cc does with
// cpu::RmsNorm before cpu::Rope (the CPU's AVX2 sum of squares accumulates in fp32 lanes, the
// twin's in double: equal to a few ulps, not bit for bit).
TEST(LayerOpsRefTest, RopeSplitQkvWithHeadNormsMatchesCpu) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const int n = 7, heads = 4, kv = 2, hd = 128, max_position = 400;
  const RopeCase c = RandomRopeCase(n, heads, kv, hd, hd, max_position, 1e6f, rng);
  std::vector<float> q_norm = RandomFloats(hd, 0.3f, rng), k_norm = RandomFloats(hd, 0.3f, rng);
  for (float& w : q_norm) w += 1.0f;
  for (float& w : k_norm) w += 1.0f;
  std::vector<float> want_q, want_k, want_v;
  SplitOnCpu(c, &want_q, &want_k, &want_v);
  cpu::RmsNorm(want_q.data(), q_norm.data(), int64_t{n} * heads, hd, 1e-6f, want_q.data());
  cpu::RmsNorm(want_k.data(), k_norm.data(), int64_t{n} * kv, hd, 1e-6f, want_k.data());
  const std::vector<int64_t> pos64(c.positions.begin(), c.positions.end());
  const RopeSchedule rope =
      *RopeSchedule::Make({.dim = hd, .theta = 1e6, .layout = RopeLayout::kHalves});
  cpu::Rope(want_q.data(), n, heads, hd, rope, pos64.data());
  cpu::Rope(want_k.data(), n, kv, hd, rope, pos64.data());
  std::vector<float> q(want_q.size()), k(want_k.size()), v(want_v.size());
  RopeSplitQkvParams p{c.qkv.data(),
                       c.positions.data(),
                       c.table.data(),
                       q.data(),
                       k.data(),
                       v.data(),
                       n,
                       heads,
                       kv,
                       hd,
                       hd,
                       max_position,
                       nullptr,
                       true};
  p.q_norm = q_norm.data();
  p.k_norm = k_norm.data();
  p.norm_eps = 1e-6f;
  RopeSplitQkvRef(p);
  for (size_t i = 0; i < q.size(); ++i)
    ASSERT_NEAR(q[i], want_q[i], 2e-6f * (1 + std::fabs(want_q[i])));
  for (size_t i = 0; i < k.size(); ++i)
    ASSERT_NEAR(k[i], want_k[i], 2e-6f * (1 + std::fabs(want_k[i])));
  EXPECT_EQ(0, std::memcmp(v.data(), want_v.data(), v.size() * sizeof(float)));
}

TEST(LayerOpsRefTest, RopeSplitQkvGivesNanRowsForPositionsOutsideTheTable) {
  std::mt19937_64 rng(7);
  RopeCase c = RandomRopeCase(3, 2, 1, 8, 8, 16, 10000.0f, rng);
  c.positions = {5, 16, -1};
  std::vector<float> q(3 * 16), k(3 * 8), v(3 * 8);
  RopeSplitQkvRef({c.qkv.data(), c.positions.data(), c.table.data(), q.data(), k.data(), v.data(),
                   3, 2, 1, 8, 8, 16});
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 16; ++j) EXPECT_EQ(std::isnan(q[i * 16 + j]), i > 0) << i << " " << j;
    for (int j = 0; j < 8; ++j) {
      EXPECT_EQ(std::isnan(k[i * 8 + j]), i > 0) << i << " " << j;
      EXPECT_EQ(v[i * 8 + j], c.qkv[i * 32 + 24 + j]);  // V is copied whatever the position
    }
  }
}

// The table's (cos, sin) are cpu::Rope's own: rotating (1, 0) gives (1 c - 0 s, 1 s + 0 c),
// exactly (c, s).
TEST(LayerOpsRefTest, RopeCosSinTableHoldsCpuRopeAngles) {
  for (const auto& [rope_dim, theta] :
       {std::pair{128, 10000.0f}, std::pair{64, 500000.0f}, std::pair{6, 1e6f}}) {
    const int max_position = 4100, pairs = rope_dim / 2;
    const RopeSchedule rope = *RopeSchedule::Make({.dim = rope_dim, .theta = theta});
    const std::vector<float> table = cuda::RopeCosSinTable(max_position, rope);
    ASSERT_EQ(table.size(), static_cast<size_t>(max_position) * rope_dim);
    std::vector<int64_t> positions(max_position);
    for (int i = 0; i < max_position; ++i) positions[i] = i;
    std::vector<float> unit(static_cast<size_t>(max_position) * rope_dim, 0.0f);
    for (size_t j = 0; j < unit.size(); j += 2) unit[j] = 1.0f;
    cpu::Rope(unit.data(), max_position, 1, rope_dim, rope, positions.data());
    ASSERT_EQ(0, std::memcmp(unit.data(), table.data(), table.size() * sizeof(float)))
        << "rope_dim " << rope_dim;
    // Spot values against long double: position 0 is the identity, the last pair turns slowest.
    EXPECT_EQ(table[0], 1.0f);
    EXPECT_EQ(table[1], 0.0f);
    const long double inv =
        std::pow(static_cast<long double>(theta), -2.0L * (pairs - 1) / rope_dim);
    const size_t at = (static_cast<size_t>(4099) * pairs + pairs - 1) * 2;
    EXPECT_NEAR(table[at], std::cos(4099.0L * inv), 1e-7);
    EXPECT_NEAR(table[at + 1], std::sin(4099.0L * inv), 1e-7);
  }
  EXPECT_TRUE(cuda::RopeCosSinTable(0, 64, 10000.0f).empty());
  EXPECT_TRUE(cuda::RopeCosSinTable(16, 0, 10000.0f).empty());
}

TEST(LayerOpsRefTest, SwiGluMatchesCpuSwiGluWithinOneHalfUnit) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  for (int ffn : {1, 13, 256, 1000, 14336}) {
    const int n = 9;
    std::vector<float> gate_up = RandomFloats(static_cast<int64_t>(n) * 2 * ffn, 3.0f, rng);
    // Saturated gates: silu -> 0 (e^-g overflows to inf) and silu -> g.
    gate_up[0] = -100.0f;
    if (ffn > 2) gate_up[2] = 95.0f;
    std::vector<float> gate(static_cast<size_t>(n) * ffn), up(gate.size()), want(gate.size());
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < ffn; ++j) {
        gate[static_cast<size_t>(i) * ffn + j] = gate_up[static_cast<size_t>(i) * 2 * ffn + j];
        up[static_cast<size_t>(i) * ffn + j] = gate_up[static_cast<size_t>(i) * 2 * ffn + ffn + j];
      }
    }
    cpu::SwiGlu(gate.data(), up.data(), static_cast<int64_t>(n) * ffn, want.data());
    std::vector<uint16_t> got(want.size(), 0xffff);
    SwiGluRef({gate_up.data(), got.data(), n, ffn});
    ExpectHalvesNear(got, want, "ffn " + std::to_string(ffn));
  }
}

TEST(LayerOpsRefTest, ResidualAddMatchesAddInPlaceBitForBit) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  for (int64_t n : {1, 3, 4097}) {
    std::vector<float> x = RandomFloats(n, 10.0f, rng), y = RandomFloats(n, 0.1f, rng);
    std::vector<float> want = x;
    cpu::AddInPlace(want.data(), y.data(), n);
    ResidualAddRef({x.data(), y.data(), n});
    EXPECT_EQ(0, std::memcmp(x.data(), want.data(), x.size() * sizeof(float))) << n;
  }
}

TEST(LayerOpsRefTest, CastToHalfRoundsToNearestEven) {
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    float in;
    uint16_t want;
  };
  const Case cases[] = {
      {1.0f, 0x3c00},
      {-2.0f, 0xc000},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {65504.0f, 0x7bff},
      {65519.99f, 0x7bff},
      {65520.0f, 0x7c00},  // the midpoint to 2^16 ties to even: infinity
      {inf, 0x7c00},
      {-inf, 0xfc00},
      {std::ldexp(1.0f, -24), 0x0001},         // smallest subnormal
      {std::ldexp(1.0f, -25), 0x0000},         // half of it ties to even: zero
      {std::ldexp(3.0f, -25), 0x0002},         // 1.5 units ties to even: 2
      {1.0f + std::ldexp(1.0f, -11), 0x3c00},  // tie between 0x3c00 and 0x3c01: even
      {1.0f + std::ldexp(3.0f, -11), 0x3c02},  // tie between 0x3c01 and 0x3c02: even
      {std::ldexp(1.0f, -14), 0x0400},         // smallest normal
  };
  for (const Case& c : cases) {
    uint16_t got = 0x1234;
    CastToHalfRef({&c.in, &got, 1});
    EXPECT_EQ(got, c.want) << c.in;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  uint16_t got = 0;
  CastToHalfRef({&nan, &got, 1});
  EXPECT_TRUE(std::isnan(HalfToFloat(got)));

  // Random values: the nearest half, and on a tie the even one.
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> log_mag(-26.0f, 15.9f);  // below the overflow to inf
  std::vector<float> in(20000);
  for (float& x : in) x = std::exp2(log_mag(rng)) * (rng() % 2 != 0 ? 1.0f : -1.0f);
  std::vector<uint16_t> out(in.size());
  CastToHalfRef({in.data(), out.data(), static_cast<int64_t>(in.size())});
  for (size_t i = 0; i < in.size(); ++i) {
    const double x = in[i], h = HalfToFloat(out[i]);
    for (int step : {-1, 1}) {  // neither neighbour is nearer
      const auto other = static_cast<uint16_t>(out[i] + step);
      if ((other & 0x7fff) >= 0x7c00 || (out[i] & 0x7fff) == 0) continue;
      const double o = HalfToFloat(other);
      ASSERT_LE(std::fabs(h - x), std::fabs(o - x)) << x;
      if (std::fabs(h - x) == std::fabs(o - x)) {
        ASSERT_EQ(out[i] & 1, 0) << x;
      }
    }
  }
}

TEST(LayerOpsRefTest, AppendKvWritesExactlyTheMappedSlots) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  for (int hd : {64, 128}) {
    for (int bs : {1, 16, 64}) {
      for (int n_kv : {1, 4}) {
        const KvPoolLayout l = MakeKvPoolLayout(n_kv, hd, bs, 8, 8, CoeffDtype::kFp16);
        const int num_pages = 5, n = 29;
        const int64_t slots = static_cast<int64_t>(num_pages) * bs;
        std::vector<int64_t> free(static_cast<size_t>(slots));
        for (int64_t s = 0; s < slots; ++s) free[static_cast<size_t>(s)] = s;
        std::shuffle(free.begin(), free.end(), rng);
        std::vector<int64_t> mapping(n);
        for (int i = 0; i < n; ++i) {
          // Distinct slots while they last; -1 padding for every third token and after that.
          mapping[i] = i % 3 == 2 || static_cast<size_t>(i) >= free.size() ? -1 : free[i];
        }
        const std::vector<float> k = RandomFloats(static_cast<int64_t>(n) * n_kv * hd, 1.0f, rng);
        const std::vector<float> v = RandomFloats(static_cast<int64_t>(n) * n_kv * hd, 1.0f, rng);
        std::vector<uint8_t> pool(static_cast<size_t>(num_pages * l.page_bytes), testing::kPoison);
        AppendKvRef({l, pool.data(), k.data(), v.data(), mapping.data(), n});

        // The [2][n_kv][B][head_dim] fp16 page written out longhand, not through KvPoolLayout.
        std::vector<uint8_t> want(pool.size(), testing::kPoison);
        for (int i = 0; i < n; ++i) {
          if (mapping[i] < 0) continue;
          const int64_t page = mapping[i] / bs, t = mapping[i] % bs;
          for (int side = 0; side < 2; ++side) {
            for (int h = 0; h < n_kv; ++h) {
              for (int d = 0; d < hd; ++d) {
                const float x = (side == 0 ? k : v)[(static_cast<size_t>(i) * n_kv + h) * hd + d];
                const uint16_t half = Fp32ToFp16(x);
                const int64_t at =
                    page * 2 * n_kv * bs * hd * 2 + (((side * n_kv + h) * bs + t) * hd + d) * 2;
                std::memcpy(want.data() + at, &half, 2);
              }
            }
          }
        }
        ASSERT_EQ(pool, want) << "head_dim " << hd << " block " << bs << " n_kv " << n_kv;
      }
    }
  }
}

}  // namespace
}  // namespace subspace::kernels
