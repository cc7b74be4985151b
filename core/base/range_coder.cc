// The binary adaptive range coder (range_coder.h).
#include "core/base/range_coder.h"

#include <cstdint>
#include <span>
#include <string>

namespace subspace {

void RangeEncoder::EncodeSymbol(AdaptiveBit* tree, int bits, uint32_t symbol) {
  uint32_t node = 1;
  for (int k = bits - 1; k >= 0; --k) {
    const int bit = static_cast<int>((symbol >> k) & 1u);
    Encode(tree[node], bit);
    node = node * 2 + static_cast<uint32_t>(bit);
  }
}

void RangeEncoder::ShiftLow() {
  // A byte is final once no carry can reach it: then it and the 0xFF run behind it go out.
  if (static_cast<uint32_t>(low_) < 0xFF000000u || (low_ >> 32) != 0) {
    const auto carry = static_cast<uint8_t>(low_ >> 32);
    uint8_t pending = cache_;
    do {
      out_.push_back(static_cast<char>(static_cast<uint8_t>(pending + carry)));
      pending = 0xFF;
    } while (--cache_size_ != 0);
    cache_ = static_cast<uint8_t>(low_ >> 24);
  }
  ++cache_size_;
  low_ = (low_ & 0x00FFFFFFu) << 8;
}

void RangeEncoder::Finish(std::string* out) {
  for (int i = 0; i < 5; ++i) ShiftLow();
  out->append(out_);
  out_.clear();
}

RangeDecoder::RangeDecoder(std::span<const uint8_t> in) : in_(in) {
  for (int i = 0; i < 5; ++i) code_ = (code_ << 8) | Next();
}

uint32_t RangeDecoder::DecodeSymbol(AdaptiveBit* tree, int bits) {
  uint32_t node = 1;
  for (int k = 0; k < bits; ++k) node = node * 2 + static_cast<uint32_t>(Decode(tree[node]));
  return node - (1u << bits);
}

}  // namespace subspace
