#include "core/tokenizer/unicode.h"

#include <algorithm>
#include <array>
#include <iterator>

namespace subspace::unicode {
namespace {

struct CategoryRun {
  uint32_t first;
  uint8_t category;
};

struct CodePointRange {
  uint32_t first;
  uint32_t end;  // one past the last
};

#include "core/tokenizer/unicode_tables.inc"

// Latin-1 answered from a direct table: nearly all text the pre-tokenizers see is there.
struct Latin1Table {
  std::array<uint8_t, 256> category{};
  std::array<bool, 256> white_space{};
};

GeneralCategory LookupCategory(char32_t cp) {
  const auto* it = std::upper_bound(std::begin(kCategoryRuns), std::end(kCategoryRuns), cp,
                                    [](char32_t c, const CategoryRun& r) { return c < r.first; });
  // kCategoryRuns starts at U+0000, so `it` is never the first run.
  return static_cast<GeneralCategory>(std::prev(it)->category);
}

bool LookupWhiteSpace(char32_t cp) {
  for (const CodePointRange& r : kWhiteSpace) {
    if (cp < r.first) return false;
    if (cp < r.end) return true;
  }
  return false;
}

const Latin1Table& Latin1() {
  static const Latin1Table table = [] {
    Latin1Table t;
    for (char32_t c = 0; c < 256; ++c) {
      t.category[c] = LookupCategory(c);
      t.white_space[c] = LookupWhiteSpace(c);
    }
    return t;
  }();
  return table;
}

}  // namespace

CategoryMask CategoryMaskByName(std::string_view name) {
  static constexpr std::string_view kNames[] = {
      "Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps",
      "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};
  static_assert(std::size(kNames) == kCategoryCount);
  if (name == "Any") return (CategoryMask{1} << kCategoryCount) - 1;
  if (name == "L&" || name == "LC") return Bit(kLu) | Bit(kLl) | Bit(kLt);
  CategoryMask mask = 0;
  for (int c = 0; c < kCategoryCount; ++c) {
    const std::string_view n = kNames[c];
    // "L" names every category whose name starts with L; "Lu" exactly one.
    if ((name.size() == 1 && n[0] == name[0]) || n == name) {
      mask |= Bit(static_cast<GeneralCategory>(c));
    }
  }
  return mask;
}

GeneralCategory CategoryOf(char32_t cp) {
  if (cp < 256) return static_cast<GeneralCategory>(Latin1().category[cp]);
  return cp < 0x110000 ? LookupCategory(cp) : kCn;
}

bool IsWhiteSpace(char32_t cp) {
  return cp < 256 ? Latin1().white_space[cp] : LookupWhiteSpace(cp);
}

std::vector<CodePoint> DecodeUtf8(std::string_view text) {
  std::vector<CodePoint> out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const auto lead = static_cast<uint8_t>(text[pos]);
    const auto offset = static_cast<uint32_t>(pos);
    if (lead < 0x80) {
      out.push_back({lead, offset});
      ++pos;
      continue;
    }
    size_t need = 0;
    uint8_t lo = 0x80;  // allowed range of the first continuation byte (Unicode table 3-7)
    uint8_t hi = 0xBF;
    char32_t value = 0;
    if (lead >= 0xC2 && lead <= 0xDF) {
      need = 2;
      value = lead & 0x1F;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      need = 3;
      value = lead & 0x0F;
      if (lead == 0xE0) lo = 0xA0;
      if (lead == 0xED) hi = 0x9F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      need = 4;
      value = lead & 0x07;
      if (lead == 0xF0) lo = 0x90;
      if (lead == 0xF4) hi = 0x8F;
    }
    bool valid = need > 0 && pos + need <= text.size();
    for (size_t k = 1; valid && k < need; ++k) {
      const auto byte = static_cast<uint8_t>(text[pos + k]);
      valid = k == 1 ? (byte >= lo && byte <= hi) : (byte & 0xC0) == 0x80;
      value = (value << 6) | (byte & 0x3F);
    }
    if (valid) {
      out.push_back({value, offset});
      pos += need;
    } else {
      out.push_back({kReplacementCharacter, offset});
      ++pos;
    }
  }
  return out;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace subspace::unicode
