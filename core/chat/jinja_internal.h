// Internals of the Jinja subset (jinja.h) shared by its parts: values and their printing
// (jinja_value.cc), the lexer (jinja_lex.cc), the parser (jinja_parse.cc), the renderer
// (jinja_render.cc) and the built-in filters and tests (jinja_builtins.cc).
// Not for use outside core/chat/.
#ifndef SUBSPACE_CORE_CHAT_JINJA_INTERNAL_H_
#define SUBSPACE_CORE_CHAT_JINJA_INTERNAL_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/chat/jinja.h"

// Errors travel as absl::Status (no exceptions).
#define JINJA_RETURN_IF_ERROR(expr)    \
  do {                                 \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  } while (0)
#define JINJA_ASSIGN_OR_RETURN(lhs, expr)           \
  do {                                              \
    auto value_or_ = (expr);                        \
    if (!value_or_.ok()) return value_or_.status(); \
    lhs = *std::move(value_or_);                    \
  } while (0)

namespace subspace::jinja {

inline absl::string_view AsAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

inline bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

inline absl::Status SyntaxError(int line, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("template line ", line, ": ", AsAbsl(what)));
}
// A construct outside the subset: refused, never rendered approximately.
inline absl::Status Unsupported(int line, std::string_view what) {
  return absl::UnimplementedError(
      absl::StrCat("template line ", line, ": ", AsAbsl(what), " is not supported"));
}

// Python's str() and repr() of a value, as {{ }} prints it.
std::string Str(const Value& v);
std::string Repr(const Value& v);

// The syntax tree: expressions and statements in one node type.

enum class NodeKind {
  // expressions
  kLiteral,
  kName,
  kGetAttr,
  kGetItem,
  kSlice,
  kCall,
  kFilter,
  kTest,
  kNeg,
  kPos,
  kNot,
  kBinary,
  kAnd,
  kOr,
  kCompare,
  kCond,
  kListLit,
  kDictLit,
  // statements
  kText,
  kOutput,
  kIf,
  kFor,
  kSet,
  kBreak,
  kContinue,
};

struct Node {
  NodeKind kind;
  int line = 0;
  Value literal;                            // kLiteral
  std::string name;                         // names, attributes, filters, tests, operators
  std::vector<std::unique_ptr<Node>> kids;  // operands, arguments, bodies' items
  std::vector<std::string> kwarg_names;     // trailing kids are keyword arguments
  std::vector<std::string> ops;             // kCompare: one per comparison
  bool negated = false;                     // kTest "is not"
  // Statements.
  std::vector<std::unique_ptr<Node>> body;       // kIf: alternating cond / block nodes
  std::vector<std::unique_ptr<Node>> else_body;  // kIf, kFor
  std::vector<std::string> targets;              // kFor, kSet (kSet: {name} or {ns, attr})
  std::unique_ptr<Node> filter;                  // kFor's "if"
  bool has_else = false;
};

using NodeList = std::vector<std::unique_ptr<Node>>;

// ---- Lexer (jinja_lex.cc) -------------------------------------------------------------------

enum class Tok { kName, kString, kInt, kFloat, kOp, kEnd };

struct Token {
  Tok type;
  std::string text;  // name, decoded string, number text or operator
  int line;
};

enum class SegKind { kText, kVar, kStmt };

struct Segment {
  SegKind kind;
  std::string text;           // kText
  std::vector<Token> tokens;  // kVar, kStmt
  int line;
};

// A template's source (newlines normalised) as text and tag segments.
absl::StatusOr<std::vector<Segment>> Lex(std::string source);

// ---- Python's value semantics and builtins (jinja_builtins.cc) ------------------------------

absl::Status TypeError(int line, std::string_view what);
std::string KindName(const Value& v);  // Python's type name: "str", "list", ...
bool Equal(const Value& a, const Value& b);
absl::StatusOr<bool> Less(const Value& a, const Value& b, int line);
absl::StatusOr<bool> Contains(const Value& container, const Value& item, int line);
// The items a for loop or a filter walks: a list, a mapping's keys, a string's characters;
// undefined walks as empty.
absl::StatusOr<List> Iterate(const Value& v, int line);
absl::StatusOr<int64_t> Length(const Value& v, int line);
// str.strip / lstrip / rstrip with optional characters; every occurrence of a replaced by b.
std::string Strip(const std::string& s, const Value& chars, bool left, bool right);
std::string ReplaceAll(const std::string& s, const std::string& a, const std::string& b);

// The arguments of a call, filter or test: positional, then keyword.
struct Args {
  List positional;
  Dict keyword;
  Value Get(size_t i, std::string_view name, Value fallback = Value()) const {
    if (i < positional.size()) return positional[i];
    for (const auto& [k, v] : keyword) {
      if (k == name) return v;
    }
    return fallback;
  }
};

// obj.m(args): the str, list and dict methods templates use.
absl::StatusOr<Value> Method(const Value& obj, const std::string& m, const Args& args, int line);
// The filters that map a string to a string (upper, lower, capitalize, title, ...).
absl::StatusOr<Value> StringFilter(const std::string& f, const Value& v, int line);
// "v is t(args)".
absl::StatusOr<bool> ApplyTest(const std::string& t, const Value& v, const Args& args, int line);

}  // namespace subspace::jinja

#endif  // SUBSPACE_CORE_CHAT_JINJA_INTERNAL_H_
