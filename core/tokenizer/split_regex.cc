// A small backtracking matcher. The pattern compiles to a tree of nodes; matching is written in
// continuation-passing style (each node gets "the rest of the match" as a callable), which gives
// Perl/Python's leftmost-first semantics directly: the first way through the tree that the
// continuation accepts wins. Repetitions of one-code-point bodies (by far the common case, e.g.
// \p{L}+) run as loops, so recursion depth depends on the pattern only.
#include "core/tokenizer/split_regex.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace subspace {
namespace {

using unicode::CategoryMask;

constexpr int kUnbounded = -1;
constexpr int kMaxBoundedRepeat = 1000;
constexpr int kMaxNesting = 64;

struct CharClass {
  bool negated = false;
  std::vector<std::pair<char32_t, char32_t>> ranges;  // inclusive
  CategoryMask categories = 0;                        // \p{..} items
  bool has_excluded = false;                          // \P{..} items: the category is outside
  CategoryMask excluded = ~CategoryMask{0};           //   the intersection of their masks
  bool white_space = false;                           // \s
  bool not_white_space = false;                       // \S

  bool Contains(const RegexUnit& u) const {
    bool in = (categories & unicode::Bit(u.category)) != 0 ||
              (has_excluded && (excluded & unicode::Bit(u.category)) == 0) ||
              (white_space && u.white_space) || (not_white_space && !u.white_space);
    for (size_t i = 0; !in && i < ranges.size(); ++i) {
      in = u.cp >= ranges[i].first && u.cp <= ranges[i].second;
    }
    return in != negated;
  }
};

enum class Kind { kClass, kSequence, kAlternation, kRepeat, kLookahead, kStart, kEnd };

struct Node {
  Kind kind;
  CharClass cls;              // kClass
  std::vector<int> children;  // kSequence, kAlternation; kRepeat and kLookahead have one
  int min = 0;                // kRepeat
  int max = 0;                // kRepeat; kUnbounded for no limit
  bool negative = false;      // kLookahead
  int min_width = 0;          // code points the node consumes at least
  int max_width = 0;          // ... and at most; kUnbounded for no limit
};

int AddWidths(int a, int b) { return a == kUnbounded || b == kUnbounded ? kUnbounded : a + b; }

}  // namespace

struct SplitRegex::Program {
  std::vector<Node> nodes;
  int root = -1;
  // When every match must begin with a greedy unbounded run of one class C (as in \s+$) and
  // the pattern has no ^, a failed attempt at a code point in C means that every later start
  // inside the same run fails too (they try a subset of the same ends, and what follows an end
  // does not depend on the start), so Find skips the rest of the run: without this, a long run
  // that cannot match costs time quadratic in its length. -1 when the pattern has no such lead.
  int lead_class = -1;
};

namespace {

absl::Status Refuse(size_t at, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("split pattern, code point ", at, ": ",
                                                 absl::string_view(what.data(), what.size())));
}

class Parser {
 public:
  Parser(std::vector<char32_t> pattern, std::vector<Node>* nodes)
      : p_(std::move(pattern)), nodes_(*nodes) {}

  absl::StatusOr<int> ParseAll() {
    absl::StatusOr<int> root = ParseAlternation(0);
    if (!root.ok()) return root;
    if (pos_ < p_.size()) return Refuse(pos_, "unbalanced ')'");
    return root;
  }

 private:
  bool AtEnd() const { return pos_ >= p_.size(); }
  char32_t Peek(size_t ahead = 0) const { return pos_ + ahead < p_.size() ? p_[pos_ + ahead] : 0; }

  int Add(Node node) {
    nodes_.push_back(std::move(node));
    return static_cast<int>(nodes_.size()) - 1;
  }

  absl::StatusOr<int> ParseAlternation(int depth) {
    if (depth > kMaxNesting) return Refuse(pos_, "groups nested too deeply");
    std::vector<int> branches;
    while (true) {
      absl::StatusOr<int> branch = ParseSequence(depth);
      if (!branch.ok()) return branch;
      branches.push_back(*branch);
      if (AtEnd() || Peek() != '|') break;
      ++pos_;
    }
    if (branches.size() == 1) return branches[0];
    Node node{.kind = Kind::kAlternation};
    node.min_width = std::numeric_limits<int>::max();
    for (int b : branches) {
      node.min_width = std::min(node.min_width, nodes_[b].min_width);
      const int mw = nodes_[b].max_width;
      node.max_width = mw == kUnbounded || node.max_width == kUnbounded
                           ? kUnbounded
                           : std::max(node.max_width, mw);
    }
    node.children = std::move(branches);
    return Add(std::move(node));
  }

  absl::StatusOr<int> ParseSequence(int depth) {
    Node node{.kind = Kind::kSequence};
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      absl::StatusOr<int> atom = ParseAtom(depth);
      if (!atom.ok()) return atom;
      absl::StatusOr<int> item = ParseQuantifier(*atom);
      if (!item.ok()) return item;
      node.min_width += nodes_[*item].min_width;
      node.max_width = AddWidths(node.max_width, nodes_[*item].max_width);
      node.children.push_back(*item);
    }
    if (node.children.size() == 1) return node.children[0];
    return Add(std::move(node));
  }

  // {n}, {n,}, {n,m}, {,m} at pos_; false (and pos_ unchanged) when the brace is a literal.
  bool ParseBraces(int* min, int* max) {
    size_t q = pos_ + 1;
    auto number = [&](int* value) {
      const size_t start = q;
      long long v = 0;
      while (q < p_.size() && p_[q] >= '0' && p_[q] <= '9') {
        v = std::min<long long>(v * 10 + (p_[q] - '0'), kMaxBoundedRepeat + 1);
        ++q;
      }
      *value = static_cast<int>(v);
      return q > start;
    };
    int lo = 0;
    int hi = 0;
    const bool has_lo = number(&lo);
    if (q < p_.size() && p_[q] == '}') {
      if (!has_lo) return false;
      hi = lo;
    } else if (q < p_.size() && p_[q] == ',') {
      ++q;
      if (!number(&hi)) hi = kUnbounded;
      if (q >= p_.size() || p_[q] != '}') return false;
      if (!has_lo) lo = 0;
    } else {
      return false;
    }
    pos_ = q + 1;
    *min = lo;
    *max = hi;
    return true;
  }

  absl::StatusOr<int> ParseQuantifier(int atom) {
    if (AtEnd()) return atom;
    const size_t at = pos_;
    int min = 0;
    int max = 0;
    const char32_t c = Peek();
    if (c == '?') {
      max = 1;
      ++pos_;
    } else if (c == '*') {
      max = kUnbounded;
      ++pos_;
    } else if (c == '+') {
      min = 1;
      max = kUnbounded;
      ++pos_;
    } else if (c != '{' || !ParseBraces(&min, &max)) {
      return atom;
    }
    if (!AtEnd() && (Peek() == '?' || Peek() == '+')) {
      return Refuse(pos_, "lazy and possessive quantifiers are not supported");
    }
    if (min > kMaxBoundedRepeat || max > kMaxBoundedRepeat) {
      return Refuse(at, "repetition count above 1000");
    }
    if (max != kUnbounded && max < min) return Refuse(at, "repetition {n,m} with m < n");
    const Node& body = nodes_[atom];
    if (body.kind == Kind::kStart || body.kind == Kind::kEnd || body.kind == Kind::kLookahead) {
      return Refuse(at, "quantifier on an assertion");
    }
    if (body.min_width == 0) return Refuse(at, "quantifier on something that can match nothing");
    const bool one_wide = body.min_width == 1 && body.max_width == 1;
    if (max == kUnbounded && !one_wide) {
      return Refuse(at, "unbounded repetition of a group wider than one code point");
    }
    Node node{.kind = Kind::kRepeat, .children = {atom}, .min = min, .max = max};
    node.min_width = body.min_width * min;
    node.max_width =
        max == kUnbounded || body.max_width == kUnbounded ? kUnbounded : body.max_width * max;
    return Add(std::move(node));
  }

  absl::StatusOr<int> ParseAtom(int depth) {
    const size_t at = pos_;
    const char32_t c = Peek();
    switch (c) {
      case '(':
        return ParseGroup(depth);
      case '[': {
        absl::StatusOr<CharClass> cls = ParseClass();
        if (!cls.ok()) return cls.status();
        return AddClass(*std::move(cls));
      }
      case '.': {
        ++pos_;
        CharClass cls;
        cls.negated = true;
        cls.ranges.push_back({'\n', '\n'});
        return AddClass(std::move(cls));
      }
      case '^':
        ++pos_;
        return Add(Node{.kind = Kind::kStart});
      case '$':
        ++pos_;
        return Add(Node{.kind = Kind::kEnd});
      case '*':
      case '+':
      case '?':
        return Refuse(at, "quantifier with nothing to repeat");
      case '{': {
        int min = 0;
        int max = 0;
        if (ParseBraces(&min, &max)) return Refuse(at, "quantifier with nothing to repeat");
        break;
      }
      case '\\': {
        CharClass cls;
        absl::Status status = ParseEscape(/*in_class=*/false, &cls);
        if (!status.ok()) return status;
        return AddClass(std::move(cls));
      }
      default:
        break;
    }
    ++pos_;
    CharClass cls;
    absl::Status status = AddLiteral(at, c, &cls);
    if (!status.ok()) return status;
    return AddClass(std::move(cls));
  }

  absl::StatusOr<int> ParseGroup(int depth) {
    const size_t at = pos_;
    ++pos_;  // '('
    bool lookahead = false;
    bool negative = false;
    bool case_insensitive = false;
    if (Peek() == '?') {
      const char32_t kind = Peek(1);
      if (kind == ':') {
        pos_ += 2;
      } else if (kind == '=' || kind == '!') {
        lookahead = true;
        negative = kind == '!';
        pos_ += 2;
      } else if (kind == 'i' && Peek(2) == ':') {
        case_insensitive = true;
        pos_ += 3;
      } else if (kind == '<' && (Peek(2) == '=' || Peek(2) == '!')) {
        return Refuse(at, "lookbehind is not supported");
      } else {
        return Refuse(at, "group syntax '(?' other than (?: (?i: (?= (?! is not supported");
      }
    }
    const bool outer_case = case_insensitive_;
    case_insensitive_ = case_insensitive_ || case_insensitive;
    absl::StatusOr<int> inner = ParseAlternation(depth + 1);
    case_insensitive_ = outer_case;
    if (!inner.ok()) return inner;
    if (AtEnd() || Peek() != ')') return Refuse(at, "unclosed '('");
    ++pos_;
    if (!lookahead) return inner;
    return Add(Node{.kind = Kind::kLookahead, .children = {*inner}, .negative = negative});
  }

  int AddClass(CharClass cls) {
    return Add(Node{.kind = Kind::kClass, .cls = std::move(cls), .min_width = 1, .max_width = 1});
  }

  // ASCII letters fold as in Python's regex module with IGNORECASE (simple case folding):
  // besides the other case, 'i' also matches U+0130, 'k' U+212A (Kelvin) and 's' U+017F.
  static void AddCaseVariants(char32_t lo, char32_t hi, CharClass* cls) {
    for (char32_t c = std::max<char32_t>(lo, 'A'); c <= std::min<char32_t>(hi, 'z'); ++c) {
      char32_t lower = 0;
      if (c >= 'A' && c <= 'Z') {
        lower = c + 32;
        cls->ranges.push_back({lower, lower});
      } else if (c >= 'a' && c <= 'z') {
        lower = c;
        cls->ranges.push_back({c - 32, c - 32});
      } else {
        continue;
      }
      if (lower == 'i') cls->ranges.push_back({0x130, 0x130});
      if (lower == 'k') cls->ranges.push_back({0x212A, 0x212A});
      if (lower == 's') cls->ranges.push_back({0x17F, 0x17F});
    }
  }

  absl::Status AddRange(size_t at, char32_t lo, char32_t hi, CharClass* cls) {
    if (hi < lo) return Refuse(at, "class range out of order");
    if (case_insensitive_ && hi >= 0x80) {
      return Refuse(at, "case-insensitive matching of non-ASCII text is not supported");
    }
    cls->ranges.push_back({lo, hi});
    if (case_insensitive_) AddCaseVariants(lo, hi, cls);
    return absl::OkStatus();
  }

  absl::Status AddLiteral(size_t at, char32_t c, CharClass* cls) { return AddRange(at, c, c, cls); }

  absl::StatusOr<char32_t> ParseHex(size_t digits, bool braced) {
    const size_t at = pos_;
    char32_t value = 0;
    size_t n = 0;
    if (braced) ++pos_;
    while (!AtEnd() && (braced ? Peek() != '}' : n < digits)) {
      const char32_t h = Peek();
      int d = -1;
      if (h >= '0' && h <= '9') d = static_cast<int>(h - '0');
      if (h >= 'a' && h <= 'f') d = static_cast<int>(h - 'a' + 10);
      if (h >= 'A' && h <= 'F') d = static_cast<int>(h - 'A' + 10);
      if (d < 0 || n >= 8) return Refuse(at, "bad hexadecimal escape");
      value = value * 16 + static_cast<char32_t>(d);
      ++n;
      ++pos_;
    }
    if (braced) {
      if (AtEnd()) return Refuse(at, "unclosed \\x{");
      ++pos_;
    }
    if (n == 0 || (!braced && n != digits) || value > 0x10FFFF) {
      return Refuse(at, "bad hexadecimal escape");
    }
    return value;
  }

  // A backslash escape at pos_: adds what it matches to `cls`. Sets *literal to the code point
  // when the escape is a single character (so it can start or end a class range).
  absl::Status ParseEscape(bool in_class, CharClass* cls, char32_t* literal = nullptr) {
    const size_t at = pos_;
    ++pos_;  // '\'
    if (AtEnd()) return Refuse(at, "pattern ends in a backslash");
    const char32_t e = Peek();
    ++pos_;
    if (literal != nullptr) *literal = 0;
    char32_t value = 0;
    switch (e) {
      case 'p':
      case 'P': {
        std::string name;
        if (Peek() == '{') {
          ++pos_;
          while (!AtEnd() && Peek() != '}') {
            if (Peek() >= 0x80) return Refuse(at, "bad property name");
            name.push_back(static_cast<char>(Peek()));
            ++pos_;
          }
          if (AtEnd()) return Refuse(at, "unclosed \\p{");
          ++pos_;
        } else if (!AtEnd() && Peek() < 0x80) {
          name.push_back(static_cast<char>(Peek()));
          ++pos_;
        }
        const CategoryMask mask = unicode::CategoryMaskByName(name);
        if (mask == 0) {
          return Refuse(at, absl::StrCat("unsupported property \\p{", name,
                                         "}: only general categories are"));
        }
        if (case_insensitive_ &&
            (mask & (unicode::Bit(unicode::kLu) | unicode::Bit(unicode::kLl) |
                     unicode::Bit(unicode::kLt))) != 0 &&
            name.size() == 2) {
          return Refuse(at, "case-insensitive \\p{Lu}/\\p{Ll}/\\p{Lt} is not supported");
        }
        if (e == 'p') {
          cls->categories |= mask;
        } else {
          cls->has_excluded = true;
          cls->excluded &= mask;
        }
        return absl::OkStatus();
      }
      case 's':
        cls->white_space = true;
        return absl::OkStatus();
      case 'S':
        cls->not_white_space = true;
        return absl::OkStatus();
      case 'd':
        cls->categories |= unicode::Bit(unicode::kNd);
        return absl::OkStatus();
      case 'D':
        cls->has_excluded = true;
        cls->excluded &= unicode::Bit(unicode::kNd);
        return absl::OkStatus();
      case 'n':
        value = '\n';
        break;
      case 'r':
        value = '\r';
        break;
      case 't':
        value = '\t';
        break;
      case 'f':
        value = '\f';
        break;
      case 'v':
        value = '\v';
        break;
      case 'a':
        value = '\a';
        break;
      case 'x': {
        absl::StatusOr<char32_t> hex = ParseHex(2, Peek() == '{');
        if (!hex.ok()) return hex.status();
        value = *hex;
        break;
      }
      case 'u':
      case 'U': {
        absl::StatusOr<char32_t> hex = ParseHex(e == 'u' ? 4 : 8, false);
        if (!hex.ok()) return hex.status();
        value = *hex;
        break;
      }
      default:
        // Escaped punctuation stands for itself; letters and digits are other escapes (\w, \b,
        // \A, \1, ...) that this matcher does not support.
        if (e < 0x80 &&
            !((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9'))) {
          value = e;
          break;
        }
        if (e >= 0x80) {
          value = e;
          break;
        }
        return Refuse(at,
                      absl::StrCat("unsupported escape \\", std::string(1, static_cast<char>(e)),
                                   in_class ? " in a class" : ""));
    }
    if (literal != nullptr) *literal = value;
    return AddLiteral(at, value, cls);
  }

  absl::StatusOr<CharClass> ParseClass() {
    const size_t at = pos_;
    ++pos_;  // '['
    CharClass cls;
    if (Peek() == '^') {
      cls.negated = true;
      ++pos_;
    }
    bool first = true;
    while (true) {
      if (AtEnd()) return Refuse(at, "unclosed '['");
      const size_t item_at = pos_;
      char32_t c = Peek();
      if (c == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      char32_t lo = 0;
      bool single = true;
      if (c == '\\') {
        CharClass item;
        absl::Status status = ParseEscape(/*in_class=*/true, &item, &lo);
        if (!status.ok()) return status;
        if (lo == 0 && item.ranges.empty()) {
          single = false;  // \p, \s, ...: a set, not a range end
        }
        if (!single || !(Peek() == '-' && Peek(1) != ']' && Peek(1) != 0)) {
          // Merge the item as is.
          cls.ranges.insert(cls.ranges.end(), item.ranges.begin(), item.ranges.end());
          cls.categories |= item.categories;
          if (item.has_excluded) {
            cls.has_excluded = true;
            cls.excluded &= item.excluded;
          }
          cls.white_space |= item.white_space;
          cls.not_white_space |= item.not_white_space;
          continue;
        }
      } else {
        if (c == '[' && Peek(1) == ':') return Refuse(item_at, "POSIX classes are not supported");
        lo = c;
        ++pos_;
      }
      if (Peek() == '-' && Peek(1) != ']' && !(pos_ + 1 >= p_.size())) {
        ++pos_;  // '-'
        char32_t hi = Peek();
        if (hi == '\\') {
          CharClass item;
          absl::Status status = ParseEscape(/*in_class=*/true, &item, &hi);
          if (!status.ok()) return status;
          if (hi == 0 && item.ranges.empty()) return Refuse(item_at, "class range ends in a set");
        } else {
          ++pos_;
        }
        absl::Status status = AddRange(item_at, lo, hi, &cls);
        if (!status.ok()) return status;
      } else {
        absl::Status status = AddLiteral(item_at, lo, &cls);
        if (!status.ok()) return status;
      }
    }
    return cls;
  }

  std::vector<char32_t> p_;
  std::vector<Node>& nodes_;
  size_t pos_ = 0;
  bool case_insensitive_ = false;
};

using Continuation = absl::FunctionRef<bool(size_t)>;

class Matcher {
 public:
  Matcher(const std::vector<Node>& nodes, std::span<const RegexUnit> subject)
      : nodes_(nodes), s_(subject) {}

  bool Match(int index, size_t pos, Continuation k) const {
    const Node& n = nodes_[index];
    switch (n.kind) {
      case Kind::kClass:
        return pos < s_.size() && n.cls.Contains(s_[pos]) && k(pos + 1);
      case Kind::kSequence:
        return MatchSequence(n, 0, pos, k);
      case Kind::kAlternation:
        for (int child : n.children) {
          if (Match(child, pos, k)) return true;
        }
        return false;
      case Kind::kRepeat:
        return nodes_[n.children[0]].max_width == 1 ? MatchRepeatOneWide(n, pos, k)
                                                    : MatchRepeat(n, 0, pos, k);
      case Kind::kLookahead: {
        const bool found = Match(n.children[0], pos, [](size_t) { return true; });
        return found != n.negative && k(pos);
      }
      case Kind::kStart:
        return pos == 0 && k(pos);
      case Kind::kEnd:
        // Python's $ without MULTILINE: at the end, or before a newline that ends the subject.
        return (pos == s_.size() || (pos + 1 == s_.size() && s_[pos].cp == '\n')) && k(pos);
    }
    return false;
  }

 private:
  bool MatchSequence(const Node& n, size_t i, size_t pos, Continuation k) const {
    if (i == n.children.size()) return k(pos);
    return Match(n.children[i], pos, [&](size_t next) { return MatchSequence(n, i + 1, next, k); });
  }

  // The body always consumes exactly one code point, so which counts are possible is known by
  // scanning forward; greedy tries the longest first.
  bool MatchRepeatOneWide(const Node& n, size_t pos, Continuation k) const {
    const int body = n.children[0];
    const Node& b = nodes_[body];
    const size_t limit =
        n.max == kUnbounded ? s_.size() - pos : std::min<size_t>(n.max, s_.size() - pos);
    size_t count = 0;
    while (count < limit) {
      const size_t at = pos + count;
      const bool ok = b.kind == Kind::kClass ? b.cls.Contains(s_[at])
                                             : Match(body, at, [](size_t) { return true; });
      if (!ok) break;
      ++count;
    }
    if (count < static_cast<size_t>(n.min)) return false;
    for (size_t c = count;; --c) {
      if (k(pos + c)) return true;
      if (c == static_cast<size_t>(n.min)) return false;
    }
  }

  // Bounded repetition of a wider body: depth at most n.max.
  bool MatchRepeat(const Node& n, int count, size_t pos, Continuation k) const {
    if (count < n.max && Match(n.children[0], pos,
                               [&](size_t next) { return MatchRepeat(n, count + 1, next, k); })) {
      return true;
    }
    return count >= n.min && k(pos);
  }

  const std::vector<Node>& nodes_;
  std::span<const RegexUnit> s_;
};

}  // namespace

std::vector<RegexUnit> ToRegexUnits(std::span<const unicode::CodePoint> code_points) {
  std::vector<RegexUnit> units;
  units.reserve(code_points.size());
  for (const unicode::CodePoint& c : code_points) {
    units.push_back({c.value, unicode::CategoryOf(c.value), unicode::IsWhiteSpace(c.value)});
  }
  return units;
}

SplitRegex::SplitRegex(std::unique_ptr<Program> program, std::string pattern)
    : program_(std::move(program)), pattern_(std::move(pattern)) {}
SplitRegex::SplitRegex(SplitRegex&&) noexcept = default;
SplitRegex& SplitRegex::operator=(SplitRegex&&) noexcept = default;
SplitRegex::~SplitRegex() = default;

absl::StatusOr<SplitRegex> SplitRegex::Compile(std::string_view pattern) {
  std::vector<char32_t> cps;
  for (const unicode::CodePoint& c : unicode::DecodeUtf8(pattern)) {
    if (c.value == unicode::kReplacementCharacter &&
        pattern.substr(c.offset, 3) != "\xef\xbf\xbd") {
      return absl::InvalidArgumentError(
          absl::StrCat("split pattern is not valid UTF-8 at byte ", c.offset));
    }
    cps.push_back(c.value);
  }
  auto program = std::make_unique<Program>();
  Parser parser(std::move(cps), &program->nodes);
  absl::StatusOr<int> root = parser.ParseAll();
  if (!root.ok()) return root.status();
  if (program->nodes[*root].min_width == 0) {
    return absl::InvalidArgumentError("split pattern can match the empty string");
  }
  program->root = *root;
  const std::vector<Node>& nodes = program->nodes;
  const bool has_start =
      std::any_of(nodes.begin(), nodes.end(), [](const Node& n) { return n.kind == Kind::kStart; });
  int lead = *root;
  if (nodes[lead].kind == Kind::kSequence) lead = nodes[lead].children[0];
  if (!has_start && nodes[lead].kind == Kind::kRepeat && nodes[lead].max == kUnbounded &&
      nodes[nodes[lead].children[0]].kind == Kind::kClass) {
    program->lead_class = nodes[lead].children[0];
  }
  return SplitRegex(std::move(program), std::string(pattern));
}

bool SplitRegex::Find(std::span<const RegexUnit> subject, size_t from, UnitSpan* match) const {
  const Matcher matcher(program_->nodes, subject);
  const CharClass* lead =
      program_->lead_class >= 0 ? &program_->nodes[program_->lead_class].cls : nullptr;
  for (size_t start = from; start < subject.size(); ++start) {
    size_t end = 0;
    if (matcher.Match(program_->root, start, [&](size_t e) {
          end = e;
          return true;
        })) {
      *match = {start, end};
      return true;
    }
    if (lead != nullptr) {
      while (start + 1 < subject.size() && lead->Contains(subject[start]) &&
             lead->Contains(subject[start + 1])) {
        ++start;
      }
    }
  }
  return false;
}

void SplitRegex::Split(std::span<const RegexUnit> units, UnitSpan span,
                       std::vector<UnitSpan>* out) const {
  const std::span<const RegexUnit> subject = units.subspan(span.begin, span.end - span.begin);
  size_t pos = 0;
  UnitSpan m;
  while (pos < subject.size() && Find(subject, pos, &m)) {
    if (m.begin > pos) out->push_back({span.begin + pos, span.begin + m.begin});
    out->push_back({span.begin + m.begin, span.begin + m.end});
    pos = m.end;
  }
  if (pos < subject.size()) out->push_back({span.begin + pos, span.end});
}

}  // namespace subspace
