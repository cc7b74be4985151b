// The regular expressions that split text before BPE ("pre-tokenizers"), matched over code
// points with the semantics of Python's `regex` module (and of HF tokenizers' Split): leftmost
// match, alternatives tried in order, greedy quantifiers that backtrack.
//
// Only what pre-tokenizer patterns use is accepted: literals, classes with ranges, \p{..}/\P{..}
// (general categories), \s \S \d \D, '.', groups (?:..) and (..), case-insensitive groups (?i:..)
// over ASCII letters, lookaheads (?=..) (?!..), ^ and $, and the quantifiers ? * + {n} {n,}
// {n,m}. Anything else (lookbehind, backreferences, lazy or possessive quantifiers, \w, \b, ...)
// is refused at Compile with the construct named, never matched approximately. So that matching
// time cannot explode with the input and recursion stays bounded by the pattern, a group wider
// than one code point may only repeat a bounded number of times, and no repeated part or whole
// pattern may match the empty string.
#ifndef SUBSPACE_CORE_TOKENIZER_SPLIT_REGEX_H_
#define SUBSPACE_CORE_TOKENIZER_SPLIT_REGEX_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tokenizer/unicode.h"

namespace subspace {

// One code point of the subject with the properties patterns test, computed once per text.
struct RegexUnit {
  char32_t cp;
  unicode::GeneralCategory category;
  bool white_space;
};

std::vector<RegexUnit> ToRegexUnits(std::span<const unicode::CodePoint> code_points);

// A half-open range of unit indices.
struct UnitSpan {
  size_t begin;
  size_t end;
};

class SplitRegex {
 public:
  // INVALID_ARGUMENT naming the construct and its offset when the pattern is malformed or uses
  // something outside the supported subset.
  static absl::StatusOr<SplitRegex> Compile(std::string_view pattern);

  SplitRegex(SplitRegex&&) noexcept;
  SplitRegex& operator=(SplitRegex&&) noexcept;
  ~SplitRegex();

  // The first match in `subject` starting at or after `from`. The subject is the whole string to
  // the pattern: ^, $ and lookaheads see nothing outside it. Matches are never empty.
  bool Find(std::span<const RegexUnit> subject, size_t from, UnitSpan* match) const;

  // Cuts units[span] into the matches and the stretches between them, in order (HF tokenizers'
  // Split with the "isolated" behaviour): the pieces tile the span.
  void Split(std::span<const RegexUnit> units, UnitSpan span, std::vector<UnitSpan>* out) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Program;
  explicit SplitRegex(std::unique_ptr<Program> program, std::string pattern);

  std::unique_ptr<Program> program_;
  std::string pattern_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_TOKENIZER_SPLIT_REGEX_H_
