// Internals of the Jinja subset (jinja.h) shared by its three parts: values and their printing
// (jinja_value.cc), the lexer and parser (jinja_parse.cc) and the renderer (jinja_render.cc).
// Not for use outside core/chat/.
#ifndef SUBSPACE_CORE_CHAT_JINJA_INTERNAL_H_
#define SUBSPACE_CORE_CHAT_JINJA_INTERNAL_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
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

// Template::Parse without the wrapper: source (newlines not yet normalised) to nodes.
absl::Status ParseNodes(std::string_view source, NodeList* out);

}  // namespace subspace::jinja

#endif  // SUBSPACE_CORE_CHAT_JINJA_INTERNAL_H_
