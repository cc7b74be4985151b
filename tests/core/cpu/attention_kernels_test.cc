// Attention block kernels: the AVX2 versions against their scalar twins and both against a
// float64 reference, for fp32 / fp16 / int8 / int4 rows (int4: even dims, every nibble), odd dims
// (tails of 1..7 and 8..15), partial blocks, GQA groups, strided q/acc, and outputs poisoned with
// NaN so an element left unwritten fails. Tolerance: |got - ref| <= 1e-5 * sum |terms| + 1e-30 for
// the products (fp32 accumulation in a different order), 3e-7 relative for exp (simd::Exp is ~2
// ulp).
#include "core/cpu/attention_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/cpu/matmul_internal.h"

namespace subspace::cpu {
namespace {

using internal::Isa;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr double kTol = 1e-5;

std::vector<Isa> IsasToTest() {
  std::vector<Isa> isas = {Isa::kScalar};
  if (internal::DetectedIsa() >= Isa::kAvx2) isas.push_back(Isa::kAvx2);
  return isas;
}

// nb rows of dim elements in one dtype, plus their exact values in double.
struct Rows {
  std::vector<float> f32;
  std::vector<uint16_t> f16;
  std::vector<int8_t> i8;
  std::vector<uint8_t> i4;  // two codes a byte, low nibble first
  std::vector<uint16_t> scales;
  std::vector<double> exact;  // [nb, dim], row scale applied
  CoeffDtype dtype;
  KvRows view() const {
    const void* data = dtype == CoeffDtype::kFp32   ? static_cast<const void*>(f32.data())
                       : dtype == CoeffDtype::kFp16 ? static_cast<const void*>(f16.data())
                       : dtype == CoeffDtype::kInt8 ? static_cast<const void*>(i8.data())
                                                    : static_cast<const void*>(i4.data());
    return {data, HasRowScale(dtype) ? scales.data() : nullptr, dtype};
  }
};

Rows MakeRows(CoeffDtype dt, int nb, int dim, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  Rows r;
  r.dtype = dt;
  const size_t count = static_cast<size_t>(nb) * dim;
  r.exact.resize(count);
  if (dt == CoeffDtype::kFp32) {
    r.f32.resize(count);
    for (size_t i = 0; i < count; ++i) r.exact[i] = r.f32[i] = n(rng);
  } else if (dt == CoeffDtype::kFp16) {
    r.f16.resize(count);
    for (size_t i = 0; i < count; ++i) {
      r.f16[i] = Fp32ToFp16(n(rng));
      r.exact[i] = HalfToFloat(r.f16[i]);
    }
  } else if (dt == CoeffDtype::kInt4) {
    r.i4.resize(count / 2);
    r.scales.resize(static_cast<size_t>(nb));
    std::uniform_int_distribution<int> nibble(0, 15);  // codes -8..7: every nibble
    for (int t = 0; t < nb; ++t) r.scales[t] = Fp32ToFp16(0.1f + 0.2f * std::fabs(n(rng)));
    for (size_t i = 0; i < count; ++i) {
      const int v = nibble(rng);
      r.i4[i / 2] |= static_cast<uint8_t>(i % 2 ? v << 4 : v);
      r.exact[i] = static_cast<double>(HalfToFloat(r.scales[i / dim])) * (v - 8);
    }
  } else {
    r.i8.resize(count);
    r.scales.resize(static_cast<size_t>(nb));
    std::uniform_int_distribution<int> code(-127, 127);
    for (int t = 0; t < nb; ++t) {
      r.scales[t] = Fp32ToFp16(0.01f + 0.02f * std::fabs(n(rng)));
      for (int d = 0; d < dim; ++d) {
        const size_t i = static_cast<size_t>(t) * dim + d;
        r.i8[i] = static_cast<int8_t>(code(rng));
        r.exact[i] = static_cast<double>(HalfToFloat(r.scales[t])) * r.i8[i];
      }
    }
  }
  return r;
}

std::string Name(Isa isa, CoeffDtype dt, int group, int nb, int dim) {
  return std::string(isa == Isa::kScalar ? "scalar " : "avx2 ") + CoeffDtypeName(dt) + " group " +
         std::to_string(group) + " nb " + std::to_string(nb) + " dim " + std::to_string(dim);
}

TEST(AttentionKernelsTest, ScoresAndAccumulateMatchFloat64) {
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 1.0f);
  double worst[2] = {0, 0};  // [scalar, avx2], error / tolerance scale
  for (CoeffDtype dt :
       {CoeffDtype::kFp32, CoeffDtype::kFp16, CoeffDtype::kInt8, CoeffDtype::kInt4}) {
    for (int dim : {1, 2, 5, 6, 8, 13, 16, 18, 24, 32, 40, 64, 100, 128}) {
      if (dt == CoeffDtype::kInt4 && dim % 2 != 0) continue;  // int4 rows hold even counts
      for (int nb : {1, 3, 4, 5, 16, 17}) {
        for (int group : {1, 3, 4}) {
          const Rows rows = MakeRows(dt, nb, dim, rng);
          const int64_t q_stride = dim + 3, acc_stride = dim + 5;  // strided, as in the caches
          std::vector<float> q(static_cast<size_t>(group) * q_stride);
          for (float& x : q) x = n(rng);
          std::vector<float> p(static_cast<size_t>(group) * nb);
          for (float& x : p) x = std::fabs(n(rng));
          std::vector<float> acc0(static_cast<size_t>(group) * acc_stride);
          for (float& x : acc0) x = n(rng);
          const float scale = 0.3f;
          for (Isa isa : IsasToTest()) {
            const AttentionKernels& k = AttentionKernelsFor(isa);
            const std::string name = Name(isa, dt, group, nb, dim);
            std::vector<float> scores(static_cast<size_t>(group) * nb, kNan);
            k.scores(q.data(), q_stride, group, rows.view(), nb, dim, scale, scores.data());
            std::vector<float> acc = acc0;
            for (int g = 0; g < group; ++g) {  // poison the gaps of the stride: must stay
              for (int64_t d = dim; d < acc_stride; ++d) acc[g * acc_stride + d] = kNan;
            }
            k.accumulate(p.data(), group, rows.view(), nb, dim, acc.data(), acc_stride);
            for (int g = 0; g < group; ++g) {
              for (int t = 0; t < nb; ++t) {
                double ref = 0, mag = 0;
                for (int d = 0; d < dim; ++d) {
                  const double term = static_cast<double>(q[g * q_stride + d]) *
                                      rows.exact[static_cast<size_t>(t) * dim + d];
                  ref += term;
                  mag += std::fabs(term);
                }
                const double got = scores[static_cast<size_t>(g) * nb + t];
                ASSERT_FALSE(std::isnan(got)) << name;
                const double err = std::fabs(got - scale * ref) / (scale * mag + 1e-30);
                worst[isa == Isa::kAvx2] = std::max(worst[isa == Isa::kAvx2], err);
                ASSERT_LE(err, kTol) << name << " score g " << g << " t " << t;
              }
              for (int d = 0; d < dim; ++d) {
                double ref = acc0[g * acc_stride + d], mag = std::fabs(ref);
                for (int t = 0; t < nb; ++t) {
                  const double term = static_cast<double>(p[static_cast<size_t>(g) * nb + t]) *
                                      rows.exact[static_cast<size_t>(t) * dim + d];
                  ref += term;
                  mag += std::fabs(term);
                }
                const double got = acc[g * acc_stride + d];
                ASSERT_FALSE(std::isnan(got)) << name;
                const double err = std::fabs(got - ref) / (mag + 1e-30);
                worst[isa == Isa::kAvx2] = std::max(worst[isa == Isa::kAvx2], err);
                ASSERT_LE(err, kTol) << name << " acc g " << g << " d " << d;
              }
              for (int64_t d = dim; d < acc_stride; ++d) {
                ASSERT_TRUE(std::isnan(acc[g * acc_stride + d])) << name << " wrote past dim";
              }
            }
          }
        }
      }
    }
  }
  std::printf("worst relative error (of sum |terms|): scalar %.3g, avx2 %.3g (tolerance %.0e)\n",
              worst[0], worst[1], kTol);
}

TEST(AttentionKernelsTest, ExpSumAndScale) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-30.0f, 0.0f);
  for (Isa isa : IsasToTest()) {
    const AttentionKernels& k = AttentionKernelsFor(isa);
    for (int n : {1, 7, 8, 16, 19, 64}) {
      std::vector<float> s(static_cast<size_t>(n));
      for (float& x : s) x = u(rng) + 2.0f;
      s[0] = -std::numeric_limits<float>::infinity();  // a masked token weighs exactly 0
      const std::vector<float> in = s;
      const float max = 2.0f;
      const float sum = k.exp_sum(s.data(), n, max);
      double ref_sum = 0;
      for (int i = 0; i < n; ++i) {
        const double ref = std::exp(static_cast<double>(in[i]) - max);
        ref_sum += ref;
        EXPECT_LE(std::fabs(s[i] - ref), 3e-7 * ref + 1e-37) << i << " of " << n;
      }
      EXPECT_EQ(s[0], 0.0f);
      EXPECT_LE(std::fabs(sum - ref_sum), 1e-6 * ref_sum + 1e-37);
      std::vector<float> x(in.begin() + 1, in.end()), y = x;
      k.scale(x.data(), n - 1, 0.25f);
      for (int i = 0; i < n - 1; ++i) EXPECT_EQ(x[i], y[i] * 0.25f);
    }
  }
}

// ActiveAttentionKernels follows the ISA cap the MatMul tests use.
// q8_0 / q4_0 blocks with random bytes (every code, scales of both signs, a zero scale) decode
// to d q and d (q - 8) exactly, and every ISA gives the scalar twin's bits.
TEST(AttentionKernelsTest, DequantizeQuantizedBlocks) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> byte(0, 255);
  const int64_t blocks = 7;
  for (const bool q4 : {false, true}) {
    const int64_t block_bytes = q4 ? 18 : 34;
    std::vector<uint8_t> src(static_cast<size_t>(blocks * block_bytes));
    for (uint8_t& b : src) b = static_cast<uint8_t>(byte(rng));
    const float scales[blocks] = {0.5f, -0.25f, 0.0f, 3.0f, -1e-3f, 65504.0f, 1.0f};
    std::vector<float> want(static_cast<size_t>(blocks * 32));
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* block = src.data() + b * block_bytes;
      const uint16_t h = Fp32ToFp16(scales[b]);
      std::memcpy(block, &h, sizeof(h));
      const float d = Fp16ToFp32(h);
      for (int j = 0; j < 32; ++j) {
        const int q = q4 ? (j < 16 ? (block[2 + j] & 0x0f) : (block[2 + j - 16] >> 4)) - 8
                         : static_cast<int8_t>(block[2 + j]);
        want[static_cast<size_t>(b * 32 + j)] = d * static_cast<float>(q);
      }
    }
    for (Isa isa : IsasToTest()) {
      SCOPED_TRACE(std::string(q4 ? "q4_0 " : "q8_0 ") + (isa == Isa::kScalar ? "scalar" : "avx2"));
      const AttentionKernels& k = AttentionKernelsFor(isa);
      std::vector<float> got(want.size(), std::numeric_limits<float>::quiet_NaN());
      (q4 ? k.dequantize_q4_0 : k.dequantize_q8_0)(src.data(), blocks, got.data());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i])) << i;
      }
    }
  }
}

// Packed codes of every width, every code value, at lengths with and without a tail of fewer
// than eight: offset + code * step within two fp32 roundings of the exact value, every ISA.
TEST(AttentionKernelsTest, DequantizeCodesOfEveryWidthAndValue) {
  std::mt19937 rng(9);
  for (int bits = 1; bits <= 8; ++bits) {
    for (int n : {1, 3, 8, 13, 16, 64, 300}) {
      std::vector<uint32_t> codes(static_cast<size_t>(n));
      for (int t = 0; t < n; ++t) {  // every value in turn, then shuffled
        codes[static_cast<size_t>(t)] = static_cast<uint32_t>(t) & ((1u << bits) - 1u);
      }
      std::shuffle(codes.begin(), codes.end(), rng);
      // Packed LSB first, plus a guard byte of ones that must not leak into the last code.
      const size_t bytes = (static_cast<size_t>(n) * bits + 7) / 8;
      std::vector<uint8_t> src(bytes + 1, 0);
      src[bytes] = 0xff;
      for (int t = 0; t < n; ++t) {
        for (int k = 0; k < bits; ++k) {
          const int at = t * bits + k;
          if ((codes[static_cast<size_t>(t)] >> k) & 1u) src[at / 8] |= uint8_t(1u << (at % 8));
        }
      }
      // Padding bits of the last byte set too: a width-aligned reader must ignore them.
      const int used = (n * bits) % 8;
      if (used != 0) src[bytes - 1] |= static_cast<uint8_t>(0xffu << used);
      const float offset = -1.75f, step = 0.3125f / static_cast<float>(bits);
      for (Isa isa : IsasToTest()) {
        SCOPED_TRACE(std::string(isa == Isa::kScalar ? "scalar" : "avx2") + " bits " +
                     std::to_string(bits) + " n " + std::to_string(n));
        std::vector<float> got(static_cast<size_t>(n) + 1, -123.0f);
        AttentionKernelsFor(isa).dequantize_codes(src.data(), bits, n, offset, step, got.data());
        for (int t = 0; t < n; ++t) {
          const double want = offset + static_cast<double>(codes[static_cast<size_t>(t)]) * step;
          ASSERT_NEAR(got[static_cast<size_t>(t)], want, 2.4e-7 * (1.75 + 0.3125 * 256)) << t;
        }
        EXPECT_EQ(got[static_cast<size_t>(n)], -123.0f) << "wrote past n";
      }
    }
  }
}

// A run of components of random widths (every width 1..8) and random codes, tails shorter than
// eight included: the weighted code sums against float64, every ISA, and the partial sums of
// each component in the lanes the contract names.
TEST(AttentionKernelsTest, CodeScoresAndSumsOverMixedWidths) {
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> width(1, 8);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (int n : {5, 8, 16, 21}) {
    for (int group : {1, 2, 3, 4, 5}) {
      const int active = 11;
      std::vector<int> bits(active);
      std::vector<int64_t> byte_at(active);
      std::vector<std::vector<uint32_t>> codes(active);
      std::vector<uint8_t> run;
      for (int a = 0; a < active; ++a) {
        bits[a] = a < 8 ? a + 1 : width(rng);
        byte_at[a] = static_cast<int64_t>(run.size());
        run.resize(run.size() + (static_cast<size_t>(n) * bits[a] + 7) / 8, 0);
        for (int t = 0; t < n; ++t) {
          const uint32_t c = static_cast<uint32_t>(rng()) & ((1u << bits[a]) - 1u);
          codes[a].push_back(c);
          for (int k = 0; k < bits[a]; ++k) {
            const int at = t * bits[a] + k;
            if ((c >> k) & 1u)
              run[static_cast<size_t>(byte_at[a] + at / 8)] |= uint8_t(1u << (at % 8));
          }
        }
      }
      std::vector<float> w(static_cast<size_t>(group) * active), p(static_cast<size_t>(group) * n);
      for (float& x : w) x = n01(rng);
      for (float& x : p) x = std::fabs(n01(rng));
      for (Isa isa : IsasToTest()) {
        SCOPED_TRACE(std::string(isa == Isa::kScalar ? "scalar" : "avx2") + " n " +
                     std::to_string(n) + " group " + std::to_string(group));
        const AttentionKernels& k = AttentionKernelsFor(isa);
        std::vector<float> scores(static_cast<size_t>(group) * n, 0.5f);
        k.code_scores(run.data(), bits.data(), byte_at.data(), active, n, w.data(), group,
                      scores.data());
        // Each query head's sums a few floats apart (the cache keeps its softmax share there).
        const int64_t stride = int64_t{active} * 8 + 3;
        std::vector<float> sums(static_cast<size_t>(group * stride), 0.25f);
        k.code_sums(run.data(), bits.data(), byte_at.data(), active, n, p.data(), group,
                    sums.data(), stride);
        for (int g = 0; g < group; ++g) {
          for (int t = 0; t < n; ++t) {
            double want = 0.5, mag = 0.5;
            for (int a = 0; a < active; ++a) {
              want += double{w[static_cast<size_t>(g * active + a)]} * codes[a][t];
              mag += std::fabs(double{w[static_cast<size_t>(g * active + a)]}) * codes[a][t];
            }
            ASSERT_NEAR(scores[static_cast<size_t>(g * n + t)], want, 1e-6 * mag) << g << " " << t;
          }
          for (int a = 0; a < active; ++a) {
            for (int lane = 0; lane < 8; ++lane) {
              double want = 0.25, mag = 0.25;
              for (int t = lane; t < n; t += 8) {
                want += double{p[static_cast<size_t>(g * n + t)]} * codes[a][t];
                mag += std::fabs(want);
              }
              ASSERT_NEAR(sums[static_cast<size_t>(g * stride + a * 8 + lane)], want, 1e-6 * mag)
                  << "group member " << g << " component " << a << " lane " << lane;
            }
          }
          for (int64_t gap = int64_t{active} * 8; gap < stride; ++gap) {
            ASSERT_EQ(sums[static_cast<size_t>(g * stride + gap)], 0.25f) << "wrote between heads";
          }
        }
      }
    }
  }
}

TEST(AttentionKernelsTest, ActiveFollowsScopedMaxIsa) {
  internal::ScopedMaxIsa cap(Isa::kScalar);
  EXPECT_EQ(&ActiveAttentionKernels(), &AttentionKernelsFor(Isa::kScalar));
}

}  // namespace
}  // namespace subspace::cpu
