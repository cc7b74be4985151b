// Test helper for pretokenizer_oracle_test.py: splits lines of text with a named pre-tokenizer
// (or one pattern) and prints the pieces' lengths in code points, so Python can compare them
// with python3-regex running the published patterns.
//
//   pretokenize_helper --pre NAME     < lines of hex-encoded UTF-8
//   pretokenize_helper --pattern HEX  < lines of hex-encoded UTF-8
//   pretokenize_helper --names        (prints every known pre-tokenizer name)
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/tokenizer/pretokenizer.h"
#include "core/tokenizer/split_regex.h"
#include "core/tokenizer/unicode.h"

namespace {

std::optional<std::string> FromHex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    unsigned value = 0;
    if (std::sscanf(std::string(hex.substr(i, 2)).c_str(), "%2x", &value) != 1) {
      return std::nullopt;
    }
    out.push_back(static_cast<char>(value));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using subspace::Pretokenizer;
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "--names") {
    for (const std::string& name : Pretokenizer::Names()) std::cout << name << "\n";
    return 0;
  }
  if (argc != 3 || (mode != "--pre" && mode != "--pattern")) {
    std::cerr << "usage: pretokenize_helper --pre NAME | --pattern HEX | --names\n";
    return 2;
  }
  std::optional<Pretokenizer> pre;
  std::optional<subspace::SplitRegex> regex;
  if (mode == "--pre") {
    auto p = Pretokenizer::ForName(argv[2]);
    if (!p.ok()) {
      std::cerr << p.status() << "\n";
      return 1;
    }
    pre = *std::move(p);
  } else {
    const std::optional<std::string> pattern = FromHex(argv[2]);
    if (!pattern) return 2;
    auto r = subspace::SplitRegex::Compile(*pattern);
    if (!r.ok()) {
      std::cout << "ERROR " << r.status().message() << "\n";
      return 0;
    }
    regex = *std::move(r);
  }
  for (std::string line; std::getline(std::cin, line);) {
    const std::optional<std::string> text = FromHex(line);
    if (!text) return 2;
    const std::vector<subspace::unicode::CodePoint> cps = subspace::unicode::DecodeUtf8(*text);
    std::vector<size_t> lengths;
    if (pre) {
      for (const subspace::ByteSpan& w : pre->Split(*text)) {
        size_t n = 0;
        for (const auto& c : cps) n += c.offset >= w.offset && c.offset < w.offset + w.length;
        lengths.push_back(n);
      }
    } else {
      const std::vector<subspace::RegexUnit> units = subspace::ToRegexUnits(cps);
      std::vector<subspace::UnitSpan> pieces;
      regex->Split(units, {0, units.size()}, &pieces);
      for (const auto& p : pieces) lengths.push_back(p.end - p.begin);
    }
    for (size_t i = 0; i < lengths.size(); ++i) std::cout << (i ? " " : "") << lengths[i];
    std::cout << "\n";
  }
  return 0;
}
