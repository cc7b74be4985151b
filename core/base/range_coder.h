// A binary adaptive range coder: bits coded under probabilities that learn as they go, and
// symbols of up to 8 bits coded as a tree of such bits. What the transform-coded cache's images
// use to store codes near their entropy (core/compress/transform_kv_cache_image.cc).
//
// The coder is the carry-propagating range coder of LZMA (32-bit range, one cache byte), with
// 12-bit probabilities. Each probability starts at 1/2 and moves towards every bit it codes by
// 1 / (n + 1.5) of the distance, n the bits it has coded so far capped at kAdaptLimit: quick to
// learn at first, then a sliding average that follows a drifting source. Everything is integer
// arithmetic, so every machine decodes what any other encoded.
//
// The decoder never reads outside its input: past the end it reads zeros and says so
// (overran()), so garbage decodes to garbage, never to a crash.
#ifndef SUBSPACE_CORE_BASE_RANGE_CODER_H_
#define SUBSPACE_CORE_BASE_RANGE_CODER_H_

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace subspace {

namespace range_coder_internal {
inline constexpr int kProbBits = 12;
inline constexpr uint32_t kTop = 1u << 24;
}  // namespace range_coder_internal

// One adaptive probability (of a 1 bit).
struct AdaptiveBit {
  static constexpr int kAdaptLimit = 30;
  uint16_t p = 1u << 15;  // P(1) in 1/65536
  uint8_t n = 0;          // bits coded, capped at kAdaptLimit
  void Update(int bit) {
    // 2^16 * 2 / (2n + 1): a step of 1 / (n + 1/2) towards the bit after its n-th use, less
    // than the whole distance, so p stays inside [0, 65535].
    static constexpr std::array<int32_t, kAdaptLimit + 1> kRate = [] {
      std::array<int32_t, kAdaptLimit + 1> r{};
      for (int i = 0; i <= kAdaptLimit; ++i) r[static_cast<size_t>(i)] = (65536 * 2) / (2 * i + 1);
      return r;
    }();
    n = static_cast<uint8_t>(n + (n < kAdaptLimit ? 1 : 0));
    const int64_t target = bit != 0 ? 65535 : 0;
    p = static_cast<uint16_t>(int64_t{p} + (((target - p) * kRate[n]) >> 16));
  }
  // P(1) in the coder's 12 bits, kept inside [1, 4095] so both outcomes stay codable.
  uint32_t P12() const {
    constexpr int kBits = range_coder_internal::kProbBits;
    return std::clamp<uint32_t>(p >> (16 - kBits), 1, (1u << kBits) - 1);
  }
};

class RangeEncoder {
 public:
  void Encode(AdaptiveBit& model, int bit) {
    const uint32_t bound = (range_ >> range_coder_internal::kProbBits) * model.P12();
    low_ += bit != 0 ? 0 : bound;
    range_ = bit != 0 ? bound : range_ - bound;
    model.Update(bit);
    while (range_ < range_coder_internal::kTop) {
      range_ <<= 8;
      ShiftLow();
    }
  }
  // `bits` (1..8) bits of `symbol`, most significant first, each under its node of the tree
  // `tree` (at least 2^bits entries; entry 0 unused).
  void EncodeSymbol(AdaptiveBit* tree, int bits, uint32_t symbol);
  // Appends the coded bytes to `out`; the encoder is spent.
  void Finish(std::string* out);

 private:
  void ShiftLow();
  uint64_t low_ = 0;
  uint32_t range_ = 0xFFFFFFFFu;
  uint8_t cache_ = 0;
  uint64_t cache_size_ = 1;
  std::string out_;
};

class RangeDecoder {
 public:
  explicit RangeDecoder(std::span<const uint8_t> in);
  int Decode(AdaptiveBit& model) {
    const uint32_t bound = (range_ >> range_coder_internal::kProbBits) * model.P12();
    // Selects, not branches: the bits of a good code are what a predictor cannot guess.
    const int bit = code_ < bound ? 1 : 0;
    code_ -= bit != 0 ? 0 : bound;
    range_ = bit != 0 ? bound : range_ - bound;
    model.Update(bit);
    while (range_ < range_coder_internal::kTop) {
      range_ <<= 8;
      code_ = (code_ << 8) | Next();
    }
    return bit;
  }
  uint32_t DecodeSymbol(AdaptiveBit* tree, int bits);
  // Whether the decoder needed bytes past its input (a truncated or corrupt stream).
  bool overran() const { return overran_; }

 private:
  uint8_t Next() {
    if (at_ < in_.size()) return in_[at_++];
    overran_ = true;
    return 0;
  }
  std::span<const uint8_t> in_;
  size_t at_ = 0;
  uint32_t range_ = 0xFFFFFFFFu;
  uint32_t code_ = 0;
  bool overran_ = false;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_BASE_RANGE_CODER_H_
