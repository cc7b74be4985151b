// A recursive-descent parser with Jinja2's operator precedence over the lexer's segments
// (jinja_lex.cc), refusing what the subset lacks.
#include <algorithm>
#include <charconv>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/chat/jinja.h"
#include "core/chat/jinja_internal.h"

namespace subspace::jinja {
namespace {

std::unique_ptr<Node> MakeNode(NodeKind kind, int line) {
  auto n = std::make_unique<Node>();
  n->kind = kind;
  n->line = line;
  return n;
}

// ---- Parser ---------------------------------------------------------------------------------

class ExprParser {
 public:
  ExprParser(const std::vector<Token>& tokens, size_t start, int line)
      : t_(tokens), pos_(start), line_(line) {}

  size_t pos() const { return pos_; }
  bool AtEnd() const { return pos_ >= t_.size(); }
  const Token* Peek(size_t ahead = 0) const {
    return pos_ + ahead < t_.size() ? &t_[pos_ + ahead] : nullptr;
  }
  bool IsOp(std::string_view op, size_t ahead = 0) const {
    const Token* t = Peek(ahead);
    return t != nullptr && t->type == Tok::kOp && t->text == op;
  }
  bool IsName(std::string_view name, size_t ahead = 0) const {
    const Token* t = Peek(ahead);
    return t != nullptr && t->type == Tok::kName && t->text == name;
  }
  absl::Status Expect(std::string_view op) {
    if (!IsOp(op)) return SyntaxError(line_, absl::StrCat("expected '", AsAbsl(op), "'"));
    ++pos_;
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectName() {
    const Token* t = Peek();
    if (t == nullptr || t->type != Tok::kName) return SyntaxError(line_, "expected a name");
    ++pos_;
    return t->text;
  }

  // expression := or ["if" or ["else" expression]]
  absl::StatusOr<std::unique_ptr<Node>> Expression(bool allow_cond = true) {
    // Nesting is bounded so that neither this parser nor the renderer can run out of stack.
    if (++depth_ > kMaxDepth) return SyntaxError(line_, "expression nested too deeply");
    struct Leave {
      int* d;
      ~Leave() { --*d; }
    } leave{&depth_};
    std::unique_ptr<Node> e;
    JINJA_ASSIGN_OR_RETURN(e, Or());
    while (allow_cond && IsName("if")) {
      ++pos_;
      auto cond = MakeNode(NodeKind::kCond, line_);
      std::unique_ptr<Node> test;
      JINJA_ASSIGN_OR_RETURN(test, Or());
      std::unique_ptr<Node> otherwise;
      if (IsName("else")) {
        ++pos_;
        JINJA_ASSIGN_OR_RETURN(otherwise, Expression());
      } else {
        otherwise = MakeNode(NodeKind::kLiteral, line_);  // undefined
      }
      cond->kids.push_back(std::move(e));
      cond->kids.push_back(std::move(test));
      cond->kids.push_back(std::move(otherwise));
      e = std::move(cond);
    }
    return e;
  }

 private:
  absl::StatusOr<std::unique_ptr<Node>> Or() {
    std::unique_ptr<Node> l;
    JINJA_ASSIGN_OR_RETURN(l, And());
    while (IsName("or")) {
      ++pos_;
      auto n = MakeNode(NodeKind::kOr, line_);
      std::unique_ptr<Node> r;
      JINJA_ASSIGN_OR_RETURN(r, And());
      n->kids.push_back(std::move(l));
      n->kids.push_back(std::move(r));
      l = std::move(n);
    }
    return l;
  }
  absl::StatusOr<std::unique_ptr<Node>> And() {
    std::unique_ptr<Node> l;
    JINJA_ASSIGN_OR_RETURN(l, Not());
    while (IsName("and")) {
      ++pos_;
      auto n = MakeNode(NodeKind::kAnd, line_);
      std::unique_ptr<Node> r;
      JINJA_ASSIGN_OR_RETURN(r, Not());
      n->kids.push_back(std::move(l));
      n->kids.push_back(std::move(r));
      l = std::move(n);
    }
    return l;
  }
  absl::StatusOr<std::unique_ptr<Node>> Not() {
    if (IsName("not")) {
      ++pos_;
      auto n = MakeNode(NodeKind::kNot, line_);
      std::unique_ptr<Node> operand;
      JINJA_ASSIGN_OR_RETURN(operand, Not());
      n->kids.push_back(std::move(operand));
      return n;
    }
    return Compare();
  }
  absl::StatusOr<std::unique_ptr<Node>> Compare() {
    std::unique_ptr<Node> l;
    JINJA_ASSIGN_OR_RETURN(l, Math1());
    std::unique_ptr<Node> cmp;
    while (true) {
      std::string op;
      if (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp(">") || IsOp("<=") || IsOp(">=")) {
        op = Peek()->text;
        ++pos_;
      } else if (IsName("in")) {
        op = "in";
        ++pos_;
      } else if (IsName("not") && IsName("in", 1)) {
        op = "notin";
        pos_ += 2;
      } else {
        break;
      }
      if (cmp == nullptr) {
        cmp = MakeNode(NodeKind::kCompare, line_);
        cmp->kids.push_back(std::move(l));
      }
      std::unique_ptr<Node> r;
      JINJA_ASSIGN_OR_RETURN(r, Math1());
      cmp->kids.push_back(std::move(r));
      cmp->ops.push_back(op);
    }
    return cmp != nullptr ? std::move(cmp) : std::move(l);
  }
  absl::StatusOr<std::unique_ptr<Node>> Binary(
      const std::vector<std::string_view>& ops,
      absl::StatusOr<std::unique_ptr<Node>> (ExprParser::*next)()) {
    std::unique_ptr<Node> l;
    JINJA_ASSIGN_OR_RETURN(l, (this->*next)());
    while (true) {
      std::string op;
      for (std::string_view o : ops) {
        if (IsOp(o)) op = std::string(o);
      }
      if (op.empty()) break;
      ++pos_;
      auto n = MakeNode(NodeKind::kBinary, line_);
      n->name = op;
      std::unique_ptr<Node> r;
      JINJA_ASSIGN_OR_RETURN(r, (this->*next)());
      n->kids.push_back(std::move(l));
      n->kids.push_back(std::move(r));
      l = std::move(n);
    }
    return l;
  }
  absl::StatusOr<std::unique_ptr<Node>> Math1() { return Binary({"+", "-"}, &ExprParser::Concat); }
  absl::StatusOr<std::unique_ptr<Node>> Concat() { return Binary({"~"}, &ExprParser::Math2); }
  absl::StatusOr<std::unique_ptr<Node>> Math2() {
    return Binary({"*", "/", "//", "%"}, &ExprParser::Pow);
  }
  absl::StatusOr<std::unique_ptr<Node>> Pow() { return Binary({"**"}, &ExprParser::Unary); }
  absl::StatusOr<std::unique_ptr<Node>> Unary() { return UnaryExpr(/*with_filter=*/true); }
  // As Jinja2: the sign binds tighter than filters and tests (-3|abs is abs(-3)).
  absl::StatusOr<std::unique_ptr<Node>> UnaryExpr(bool with_filter) {
    std::unique_ptr<Node> e;
    if (IsOp("-") || IsOp("+")) {
      const bool neg = IsOp("-");
      ++pos_;
      e = MakeNode(neg ? NodeKind::kNeg : NodeKind::kPos, line_);
      std::unique_ptr<Node> operand;
      if (++depth_ > kMaxDepth) return SyntaxError(line_, "expression nested too deeply");
      JINJA_ASSIGN_OR_RETURN(operand, UnaryExpr(/*with_filter=*/false));
      --depth_;
      e->kids.push_back(std::move(operand));
    } else {
      JINJA_ASSIGN_OR_RETURN(e, Primary());
      JINJA_ASSIGN_OR_RETURN(e, Postfix(std::move(e)));
    }
    if (!with_filter) return e;
    return FilterExpr(std::move(e));
  }

  absl::Status Arguments(Node* call) {
    JINJA_RETURN_IF_ERROR(Expect("("));
    while (!IsOp(")")) {
      if (Peek() != nullptr && Peek()->type == Tok::kName && IsOp("=", 1)) {
        call->kwarg_names.push_back(Peek()->text);
        pos_ += 2;
      } else if (!call->kwarg_names.empty()) {
        return SyntaxError(line_, "positional argument after a keyword argument");
      }
      std::unique_ptr<Node> arg;
      JINJA_ASSIGN_OR_RETURN(arg, Expression());
      call->kids.push_back(std::move(arg));
      if (!IsOp(",")) break;
      ++pos_;
    }
    return Expect(")");
  }

  absl::StatusOr<std::unique_ptr<Node>> Postfix(std::unique_ptr<Node> e) {
    while (true) {
      if (IsOp(".")) {
        ++pos_;
        auto n = MakeNode(NodeKind::kGetAttr, line_);
        const Token* t = Peek();
        if (t == nullptr || (t->type != Tok::kName && t->type != Tok::kInt)) {
          return SyntaxError(line_, "expected an attribute name after '.'");
        }
        n->name = t->text;
        ++pos_;
        n->kids.push_back(std::move(e));
        e = std::move(n);
      } else if (IsOp("[")) {
        ++pos_;
        // Index or slice.
        std::unique_ptr<Node> parts[3];
        int colons = 0;
        while (!IsOp("]")) {
          if (IsOp(":")) {
            if (++colons > 2) return SyntaxError(line_, "bad slice");
            ++pos_;
            continue;
          }
          if (parts[colons] != nullptr) return SyntaxError(line_, "bad subscript");
          JINJA_ASSIGN_OR_RETURN(parts[colons], Expression());
        }
        ++pos_;
        if (colons == 0) {
          if (parts[0] == nullptr) return SyntaxError(line_, "empty subscript");
          auto n = MakeNode(NodeKind::kGetItem, line_);
          n->kids.push_back(std::move(e));
          n->kids.push_back(std::move(parts[0]));
          e = std::move(n);
        } else {
          auto n = MakeNode(NodeKind::kSlice, line_);
          n->kids.push_back(std::move(e));
          for (auto& p : parts) n->kids.push_back(std::move(p));  // may be null
          e = std::move(n);
        }
      } else if (IsOp("(")) {
        auto n = MakeNode(NodeKind::kCall, line_);
        n->kids.push_back(std::move(e));
        JINJA_RETURN_IF_ERROR(Arguments(n.get()));
        e = std::move(n);
      } else {
        return e;
      }
    }
  }

  absl::StatusOr<std::unique_ptr<Node>> FilterExpr(std::unique_ptr<Node> e) {
    while (true) {
      if (IsOp("|")) {
        ++pos_;
        auto n = MakeNode(NodeKind::kFilter, line_);
        JINJA_ASSIGN_OR_RETURN(n->name, ExpectName());
        n->kids.push_back(std::move(e));
        if (IsOp("(")) JINJA_RETURN_IF_ERROR(Arguments(n.get()));
        e = std::move(n);
      } else if (IsName("is")) {
        ++pos_;
        auto n = MakeNode(NodeKind::kTest, line_);
        if (IsName("not")) {
          n->negated = true;
          ++pos_;
        }
        const Token* t = Peek();
        if (t != nullptr && t->type == Tok::kName) {
          n->name = t->text;
          ++pos_;
        } else if (t != nullptr && t->type == Tok::kOp &&
                   (t->text == "==" || t->text == "!=" || t->text == "<" || t->text == ">" ||
                    t->text == "<=" || t->text == ">=")) {
          n->name = t->text;
          ++pos_;
        } else {
          return SyntaxError(line_, "expected a test name after 'is'");
        }
        n->kids.push_back(std::move(e));
        if (IsOp("(")) {
          JINJA_RETURN_IF_ERROR(Arguments(n.get()));
        } else if (Peek() != nullptr && !IsName("and") && !IsName("or") && !IsName("if") &&
                   !IsName("else") && !IsName("is") && !IsName("in") && !IsName("not") &&
                   (Peek()->type != Tok::kOp ||
                    (Peek()->text != ")" && Peek()->text != "]" && Peek()->text != "}" &&
                     Peek()->text != "," && Peek()->text != ":" && Peek()->text != "|" &&
                     Peek()->text != "==" && Peek()->text != "!=" && Peek()->text != "+" &&
                     Peek()->text != "-" && Peek()->text != "~"))) {
          // A test with one argument without parentheses: `x is divisibleby 3`.
          std::unique_ptr<Node> arg;
          JINJA_ASSIGN_OR_RETURN(arg, Primary());
          JINJA_ASSIGN_OR_RETURN(arg, Postfix(std::move(arg)));
          n->kids.push_back(std::move(arg));
        }
        e = std::move(n);
      } else {
        return e;
      }
    }
  }

  absl::StatusOr<std::unique_ptr<Node>> Primary() {
    const Token* t = Peek();
    if (t == nullptr) return SyntaxError(line_, "unexpected end of expression");
    ++pos_;
    switch (t->type) {
      case Tok::kString: {
        std::string s = t->text;
        // Adjacent literals concatenate, as in Python.
        while (Peek() != nullptr && Peek()->type == Tok::kString) s += t_[pos_++].text;
        auto n = MakeNode(NodeKind::kLiteral, line_);
        n->literal = Value::String(std::move(s));
        return n;
      }
      case Tok::kInt: {
        auto n = MakeNode(NodeKind::kLiteral, line_);
        int64_t v = 0;
        auto [p, ec] = std::from_chars(t->text.data(), t->text.data() + t->text.size(), v);
        if (ec != std::errc()) return SyntaxError(line_, "integer out of range");
        n->literal = Value::Int(v);
        return n;
      }
      case Tok::kFloat: {
        auto n = MakeNode(NodeKind::kLiteral, line_);
        double v = 0;
        std::from_chars(t->text.data(), t->text.data() + t->text.size(), v);
        n->literal = Value::Float(v);
        return n;
      }
      case Tok::kName: {
        auto n = MakeNode(NodeKind::kLiteral, line_);
        if (t->text == "true" || t->text == "True") {
          n->literal = Value::Bool(true);
        } else if (t->text == "false" || t->text == "False") {
          n->literal = Value::Bool(false);
        } else if (t->text == "none" || t->text == "None") {
          n->literal = Value::None();
        } else {
          n->kind = NodeKind::kName;
          n->name = t->text;
        }
        return n;
      }
      case Tok::kOp:
        if (t->text == "(") {
          std::unique_ptr<Node> e;
          JINJA_ASSIGN_OR_RETURN(e, Expression());
          if (IsOp(",")) return Unsupported(line_, "tuple literals");
          JINJA_RETURN_IF_ERROR(Expect(")"));
          return e;
        }
        if (t->text == "[") {
          auto n = MakeNode(NodeKind::kListLit, line_);
          while (!IsOp("]")) {
            std::unique_ptr<Node> item;
            JINJA_ASSIGN_OR_RETURN(item, Expression());
            n->kids.push_back(std::move(item));
            if (!IsOp(",")) break;
            ++pos_;
          }
          JINJA_RETURN_IF_ERROR(Expect("]"));
          return n;
        }
        if (t->text == "{") {
          auto n = MakeNode(NodeKind::kDictLit, line_);
          while (!IsOp("}")) {
            std::unique_ptr<Node> key, value;
            JINJA_ASSIGN_OR_RETURN(key, Expression());
            JINJA_RETURN_IF_ERROR(Expect(":"));
            JINJA_ASSIGN_OR_RETURN(value, Expression());
            n->kids.push_back(std::move(key));
            n->kids.push_back(std::move(value));
            if (!IsOp(",")) break;
            ++pos_;
          }
          JINJA_RETURN_IF_ERROR(Expect("}"));
          return n;
        }
        break;
      default:
        break;
    }
    return SyntaxError(line_, absl::StrCat("unexpected '", t->text, "'"));
  }

  static constexpr int kMaxDepth = 64;
  const std::vector<Token>& t_;
  size_t pos_;
  int line_;
  int depth_ = 0;
};

class Parser {
 public:
  explicit Parser(std::vector<Segment> segments) : segs_(std::move(segments)) {}

  absl::Status Run(NodeList* out) {
    std::string end;
    JINJA_RETURN_IF_ERROR(Block(out, {}, &end));
    if (!end.empty()) return SyntaxError(line_, absl::StrCat("unexpected {% ", end, " %}"));
    return absl::OkStatus();
  }

 private:
  // Parses nodes until a statement whose keyword is in `ends` (returned in *end, the segment
  // left current) or the end of input (*end empty).
  absl::Status Block(NodeList* out, const std::vector<std::string>& ends, std::string* end) {
    end->clear();
    while (i_ < segs_.size()) {
      const Segment& s = segs_[i_];
      line_ = s.line;
      if (s.kind == SegKind::kText) {
        auto n = MakeNode(NodeKind::kText, s.line);
        n->name = s.text;
        out->push_back(std::move(n));
        ++i_;
        continue;
      }
      if (s.kind == SegKind::kVar) {
        ExprParser p(s.tokens, 0, s.line);
        auto n = MakeNode(NodeKind::kOutput, s.line);
        std::unique_ptr<Node> e;
        JINJA_ASSIGN_OR_RETURN(e, p.Expression());
        if (!p.AtEnd()) return SyntaxError(s.line, "unexpected tokens in {{ }}");
        n->kids.push_back(std::move(e));
        out->push_back(std::move(n));
        ++i_;
        continue;
      }
      if (s.tokens.empty() || s.tokens[0].type != Tok::kName) {
        return SyntaxError(s.line, "empty or malformed {% %}");
      }
      const std::string& kw = s.tokens[0].text;
      if (std::find(ends.begin(), ends.end(), kw) != ends.end()) {
        *end = kw;
        return absl::OkStatus();
      }
      ++i_;
      if ((kw == "if" || kw == "for") && depth_ >= kMaxBlockDepth) {
        return SyntaxError(s.line, "blocks nested too deeply");
      }
      if (kw == "if") {
        ++depth_;
        absl::Status st = If(s, out);
        --depth_;
        JINJA_RETURN_IF_ERROR(st);
      } else if (kw == "for") {
        ++depth_;
        absl::Status st = For(s, out);
        --depth_;
        JINJA_RETURN_IF_ERROR(st);
      } else if (kw == "set") {
        JINJA_RETURN_IF_ERROR(Set(s, out));
      } else if (kw == "break" || kw == "continue") {
        if (s.tokens.size() != 1) return SyntaxError(s.line, "unexpected tokens");
        out->push_back(MakeNode(kw == "break" ? NodeKind::kBreak : NodeKind::kContinue, s.line));
      } else if (kw == "elif" || kw == "else" || kw == "endif" || kw == "endfor") {
        return SyntaxError(s.line, absl::StrCat("unexpected {% ", kw, " %}"));
      } else {
        return Unsupported(s.line, absl::StrCat("the {% ", kw, " %} statement"));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<Node>> WholeExpression(const Segment& s, size_t start) {
    ExprParser p(s.tokens, start, s.line);
    std::unique_ptr<Node> e;
    JINJA_ASSIGN_OR_RETURN(e, p.Expression());
    if (!p.AtEnd()) return SyntaxError(s.line, "unexpected tokens after the expression");
    return e;
  }

  absl::Status If(const Segment& first, NodeList* out) {
    auto n = MakeNode(NodeKind::kIf, first.line);
    const Segment* s = &first;
    while (true) {
      std::unique_ptr<Node> cond;
      JINJA_ASSIGN_OR_RETURN(cond, WholeExpression(*s, 1));
      auto block = MakeNode(NodeKind::kText, s->line);  // holder of the branch body
      std::string end;
      JINJA_RETURN_IF_ERROR(Block(&block->kids, {"elif", "else", "endif"}, &end));
      n->body.push_back(std::move(cond));
      n->body.push_back(std::move(block));
      if (end.empty()) return SyntaxError(first.line, "{% if %} without {% endif %}");
      s = &segs_[i_++];
      if (end == "elif") continue;
      if (end == "else") {
        n->has_else = true;
        JINJA_RETURN_IF_ERROR(Block(&n->else_body, {"endif"}, &end));
        if (end.empty()) return SyntaxError(first.line, "{% if %} without {% endif %}");
        ++i_;
      }
      break;
    }
    out->push_back(std::move(n));
    return absl::OkStatus();
  }

  absl::Status For(const Segment& s, NodeList* out) {
    auto n = MakeNode(NodeKind::kFor, s.line);
    ExprParser p(s.tokens, 1, s.line);
    while (true) {
      std::string target;
      JINJA_ASSIGN_OR_RETURN(target, p.ExpectName());
      n->targets.push_back(target);
      if (!p.IsOp(",")) break;
      JINJA_RETURN_IF_ERROR(p.Expect(","));
    }
    if (!p.IsName("in")) return SyntaxError(s.line, "expected 'in' in {% for %}");
    JINJA_RETURN_IF_ERROR(absl::OkStatus());
    // Skip "in".
    ExprParser q(s.tokens, p.pos() + 1, s.line);
    std::unique_ptr<Node> iter;
    JINJA_ASSIGN_OR_RETURN(iter, q.Expression(/*allow_cond=*/false));
    n->kids.push_back(std::move(iter));
    if (q.IsName("if")) {
      ExprParser f(s.tokens, q.pos() + 1, s.line);
      JINJA_ASSIGN_OR_RETURN(n->filter, f.Expression(/*allow_cond=*/false));
      if (f.IsName("recursive")) return Unsupported(s.line, "recursive loops");
      if (!f.AtEnd()) return SyntaxError(s.line, "unexpected tokens in {% for %}");
    } else if (q.IsName("recursive")) {
      return Unsupported(s.line, "recursive loops");
    } else if (!q.AtEnd()) {
      return SyntaxError(s.line, "unexpected tokens in {% for %}");
    }
    std::string end;
    JINJA_RETURN_IF_ERROR(Block(&n->body, {"else", "endfor"}, &end));
    if (end.empty()) return SyntaxError(s.line, "{% for %} without {% endfor %}");
    ++i_;
    if (end == "else") {
      n->has_else = true;
      JINJA_RETURN_IF_ERROR(Block(&n->else_body, {"endfor"}, &end));
      if (end.empty()) return SyntaxError(s.line, "{% for %} without {% endfor %}");
      ++i_;
    }
    out->push_back(std::move(n));
    return absl::OkStatus();
  }

  absl::Status Set(const Segment& s, NodeList* out) {
    auto n = MakeNode(NodeKind::kSet, s.line);
    ExprParser p(s.tokens, 1, s.line);
    std::string name;
    JINJA_ASSIGN_OR_RETURN(name, p.ExpectName());
    n->targets.push_back(name);
    if (p.IsOp(".")) {
      JINJA_RETURN_IF_ERROR(p.Expect("."));
      JINJA_ASSIGN_OR_RETURN(name, p.ExpectName());
      n->targets.push_back(name);
    }
    if (p.IsOp(",")) return Unsupported(s.line, "{% set %} of several names");
    if (p.AtEnd()) return Unsupported(s.line, "{% set %} blocks");
    JINJA_RETURN_IF_ERROR(p.Expect("="));
    std::unique_ptr<Node> value;
    JINJA_ASSIGN_OR_RETURN(value, WholeExpression(s, p.pos()));
    n->kids.push_back(std::move(value));
    out->push_back(std::move(n));
    return absl::OkStatus();
  }

  static constexpr int kMaxBlockDepth = 64;
  std::vector<Segment> segs_;
  size_t i_ = 0;
  int line_ = 1;
  int depth_ = 0;
};

}  // namespace

absl::StatusOr<Template> Template::Parse(std::string_view source) {
  // Newlines normalised to \n, one trailing newline dropped (keep_trailing_newline=False).
  std::string src;
  src.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      src.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      src.push_back(source[i]);
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();
  absl::StatusOr<std::vector<Segment>> segments = Lex(std::move(src));
  if (!segments.ok()) return segments.status();
  Template t;
  JINJA_RETURN_IF_ERROR(Parser(*std::move(segments)).Run(&t.nodes_));
  return t;
}

}  // namespace subspace::jinja
