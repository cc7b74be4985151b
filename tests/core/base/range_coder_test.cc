// The binary adaptive range coder: bits and symbols round trip under any probabilities, a skewed
// source codes near its entropy, a drifting one is followed, and a short or corrupt stream is
// flagged without reading outside it.
#include "core/base/range_coder.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace subspace {
namespace {

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

double EntropyBits(double p) { return -p * std::log2(p) - (1 - p) * std::log2(1 - p); }

TEST(RangeCoderTest, BitsRoundTripAtEveryBias) {
  std::mt19937 rng(7);
  for (double p1 : {0.0, 0.001, 0.1, 0.5, 0.9, 0.999, 1.0}) {
    SCOPED_TRACE(p1);
    std::bernoulli_distribution coin(p1);
    std::vector<int> bits(20000);
    for (int& b : bits) b = coin(rng) ? 1 : 0;
    RangeEncoder enc;
    AdaptiveBit model;
    for (int b : bits) enc.Encode(model, b);
    std::string out;
    enc.Finish(&out);
    RangeDecoder dec(Bytes(out));
    AdaptiveBit back;
    for (size_t i = 0; i < bits.size(); ++i) ASSERT_EQ(dec.Decode(back), bits[i]) << i;
    EXPECT_FALSE(dec.overran());
    // Near the entropy: within 2 % plus the adaptation's start and the 5 flushed bytes.
    const double ideal = bits.size() * EntropyBits(std::clamp(p1, 1e-4, 1 - 1e-4)) / 8;
    EXPECT_LT(static_cast<double>(out.size()), ideal * 1.02 + 60) << out.size();
  }
}

TEST(RangeCoderTest, SymbolsOfEveryWidthRoundTrip) {
  std::mt19937 rng(11);
  for (int bits = 1; bits <= 8; ++bits) {
    SCOPED_TRACE(bits);
    // A peaked distribution, as quantized transform coefficients are.
    std::normal_distribution<double> gauss((1 << bits) / 2.0, (1 << bits) / 6.0 + 0.3);
    std::vector<uint32_t> symbols(5000);
    for (uint32_t& s : symbols) {
      s = static_cast<uint32_t>(std::clamp<long>(std::lround(gauss(rng)), 0, (1 << bits) - 1));
    }
    symbols[0] = 0;
    symbols[1] = (1u << bits) - 1;
    RangeEncoder enc;
    std::vector<AdaptiveBit> tree(size_t{1} << bits);
    for (uint32_t s : symbols) enc.EncodeSymbol(tree.data(), bits, s);
    std::string out;
    enc.Finish(&out);
    // Near the symbols' order-0 entropy, plus what learning 2^bits - 1 probabilities costs.
    std::vector<double> count(size_t{1} << bits, 0.0);
    for (uint32_t s : symbols) count[s] += 1;
    double entropy_bytes = 0;
    for (double c : count) {
      if (c > 0) entropy_bytes -= c * std::log2(c / symbols.size()) / 8;
    }
    EXPECT_LT(static_cast<double>(out.size()), entropy_bytes * 1.03 + (1 << bits)) << out.size();
    RangeDecoder dec(Bytes(out));
    std::vector<AdaptiveBit> back(size_t{1} << bits);
    for (size_t i = 0; i < symbols.size(); ++i) {
      ASSERT_EQ(dec.DecodeSymbol(back.data(), bits), symbols[i]) << i;
    }
    EXPECT_FALSE(dec.overran());
  }
}

TEST(RangeCoderTest, FollowsADriftingSource) {
  // 1s at 5 %, then at 95 %: an adaptive model pays little for the switch; a count over the
  // whole run would pay ~1 bit each.
  std::mt19937 rng(3);
  std::vector<int> bits;
  for (double p1 : {0.05, 0.95}) {
    std::bernoulli_distribution coin(p1);
    for (int i = 0; i < 10000; ++i) bits.push_back(coin(rng) ? 1 : 0);
  }
  RangeEncoder enc;
  AdaptiveBit model;
  for (int b : bits) enc.Encode(model, b);
  std::string out;
  enc.Finish(&out);
  EXPECT_LT(out.size() * 8.0, bits.size() * EntropyBits(0.05) * 1.25);
}

TEST(RangeCoderTest, ShortOrCorruptStreamsAreFlaggedNotOverread) {
  std::mt19937 rng(5);
  RangeEncoder enc;
  std::vector<AdaptiveBit> tree(16);
  std::vector<uint32_t> symbols(3000);
  for (uint32_t& s : symbols) s = rng() % 16;
  for (uint32_t s : symbols) enc.EncodeSymbol(tree.data(), 4, s);
  std::string out;
  enc.Finish(&out);
  // Truncated: the decoder runs out of input and says so.
  const std::string cut = out.substr(0, out.size() / 2);
  RangeDecoder dec(Bytes(cut));
  std::vector<AdaptiveBit> back(16);
  for (size_t i = 0; i < symbols.size(); ++i) EXPECT_LT(dec.DecodeSymbol(back.data(), 4), 16u);
  EXPECT_TRUE(dec.overran());
  // Empty or garbage input decodes to symbols in range, never past the input.
  for (const std::string& junk : {std::string(), std::string(3, '\xff'), std::string(64, '\x5a')}) {
    RangeDecoder d(Bytes(junk));
    std::vector<AdaptiveBit> t(256);
    for (int i = 0; i < 1000; ++i) EXPECT_LT(d.DecodeSymbol(t.data(), 8), 256u);
  }
}

}  // namespace
}  // namespace subspace
