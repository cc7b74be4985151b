// Unicode facts the tokenizers need: UTF-8 decoding that never fails (a byte that is not part
// of a valid sequence becomes its own unit, shown to patterns as U+FFFD), the general category
// of a code point and the White_Space property. The tables are generated from the same
// python3-regex module the tests use as the oracle (tools/unicode/gen_unicode_tables.py).
#ifndef SUBSPACE_CORE_TOKENIZER_UNICODE_H_
#define SUBSPACE_CORE_TOKENIZER_UNICODE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace subspace::unicode {

// Values match tools/unicode/gen_unicode_tables.py's CATEGORIES; kCn (unassigned) is 0.
// clang-format off
enum GeneralCategory : uint8_t {
  kCn, kLu, kLl, kLt, kLm, kLo, kMn, kMc, kMe, kNd, kNl, kNo, kPc, kPd, kPs,
  kPe, kPi, kPf, kPo, kSm, kSc, kSk, kSo, kZs, kZl, kZp, kCc, kCf, kCs, kCo,
  kCategoryCount,
};
// clang-format on

// A set of general categories as a bit mask (bit c for category c).
using CategoryMask = uint32_t;
constexpr CategoryMask Bit(GeneralCategory c) { return CategoryMask{1} << c; }

// The mask a \p{NAME} names: one- or two-letter category names ("L", "Lu", "N", ...), "L&"/"LC"
// (cased letters) and "Any"; 0 when NAME is none of them.
CategoryMask CategoryMaskByName(std::string_view name);

GeneralCategory CategoryOf(char32_t cp);
bool IsWhiteSpace(char32_t cp);

constexpr char32_t kReplacementCharacter = 0xFFFD;

// One code point of a UTF-8 text and where its bytes are.
struct CodePoint {
  char32_t value;   // U+FFFD for a byte that is not part of a valid sequence
  uint32_t offset;  // of its first byte in the text
};

// Decodes `text` strictly (no overlongs, surrogates or values past U+10FFFF); each byte of an
// invalid sequence becomes one U+FFFD unit, so every byte belongs to exactly one unit and the
// units' byte ranges tile the text. Texts of 4 GiB or more are the caller's to refuse.
std::vector<CodePoint> DecodeUtf8(std::string_view text);

// UTF-8 bytes of `cp` (which must be a valid scalar value) appended to `out`.
void AppendUtf8(char32_t cp, std::string* out);

}  // namespace subspace::unicode

#endif  // SUBSPACE_CORE_TOKENIZER_UNICODE_H_
