// The tree-walking renderer: Jinja2's scoping, loop variables, expressions, calls and filters,
// bounded in steps and output; Python's value semantics and builtins are jinja_builtins.cc.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/chat/jinja.h"
#include "core/chat/jinja_internal.h"

namespace subspace::jinja {
namespace {

// ---- Renderer -------------------------------------------------------------------------------

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  explicit Renderer(const Value& context) {
    scopes_.emplace_back();
    for (const char* f : {"raise_exception", "namespace", "range", "dict", "strftime_now"}) {
      scopes_.back().emplace_back(f, Value::Function(f));
    }
    if (context.is_mapping()) {
      for (const auto& [k, v] : context.dict()) scopes_.back().emplace_back(k, v);
    }
  }

  absl::StatusOr<Flow> Run(const NodeList& nodes, std::string* out) {
    for (const auto& n : nodes) {
      Flow flow = Flow::kNormal;
      JINJA_ASSIGN_OR_RETURN(flow, Exec(*n, out));
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

 private:
  using Scope = std::vector<std::pair<std::string, Value>>;

  Value Lookup(const std::string& name) const {
    for (auto s = scopes_.rbegin(); s != scopes_.rend(); ++s) {
      for (auto it = s->rbegin(); it != s->rend(); ++it) {
        if (it->first == name) return it->second;
      }
    }
    return Value();
  }
  void Assign(const std::string& name, Value v) {
    for (auto& [k, old] : scopes_.back()) {
      if (k == name) {
        old = std::move(v);
        return;
      }
    }
    scopes_.back().emplace_back(name, std::move(v));
  }

  // Bounds on the work and output of one render: templates come from model files and
  // --chat-template, and a loop over range(100000) inside another must not hang the server.
  static constexpr int64_t kMaxSteps = 5'000'000;
  static constexpr size_t kMaxOutput = size_t{16} << 20;
  absl::Status Budget(int line, const std::string& out) {
    if (++steps_ > kMaxSteps || out.size() > kMaxOutput) {
      return absl::ResourceExhaustedError(
          absl::StrCat("template line ", line, ": rendering exceeds ", kMaxSteps, " steps or ",
                       kMaxOutput >> 20, " MiB of output"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Flow> Exec(const Node& n, std::string* out) {
    JINJA_RETURN_IF_ERROR(Budget(n.line, *out));
    switch (n.kind) {
      case NodeKind::kText:
        *out += n.name;
        return Flow::kNormal;
      case NodeKind::kOutput: {
        Value v;
        JINJA_ASSIGN_OR_RETURN(v, Eval(*n.kids[0]));
        *out += Str(v);
        return Flow::kNormal;
      }
      case NodeKind::kIf:
        for (size_t b = 0; b + 1 < n.body.size(); b += 2) {
          Value cond;
          JINJA_ASSIGN_OR_RETURN(cond, Eval(*n.body[b]));
          if (cond.Truthy()) return Run(n.body[b + 1]->kids, out);
        }
        return Run(n.else_body, out);
      case NodeKind::kFor:
        return For(n, out);
      case NodeKind::kSet: {
        Value v;
        JINJA_ASSIGN_OR_RETURN(v, Eval(*n.kids[0]));
        if (n.targets.size() == 1) {
          Assign(n.targets[0], std::move(v));
          return Flow::kNormal;
        }
        const Value ns = Lookup(n.targets[0]);
        if (ns.kind() != Value::Kind::kNamespace) {
          return TypeError(n.line, "can only set attributes of a namespace");
        }
        Dict& d = ns.mutable_dict();
        for (auto& [k, old] : d) {
          if (k == n.targets[1]) {
            old = std::move(v);
            return Flow::kNormal;
          }
        }
        d.emplace_back(n.targets[1], std::move(v));
        return Flow::kNormal;
      }
      case NodeKind::kBreak:
        return Flow::kBreak;
      case NodeKind::kContinue:
        return Flow::kContinue;
      default:
        return absl::InternalError("expression node in statement position");
    }
  }

  absl::StatusOr<Flow> For(const Node& n, std::string* out) {
    Value seq;
    JINJA_ASSIGN_OR_RETURN(seq, Eval(*n.kids[0]));
    List items;
    JINJA_ASSIGN_OR_RETURN(items, Iterate(seq, n.line));
    scopes_.emplace_back();
    const auto bind = [&](const Value& item) -> absl::Status {
      if (n.targets.size() == 1) {
        Assign(n.targets[0], item);
        return absl::OkStatus();
      }
      List parts;
      JINJA_ASSIGN_OR_RETURN(parts, Iterate(item, n.line));
      if (parts.size() != n.targets.size()) {
        return TypeError(n.line, "cannot unpack the loop item into the loop variables");
      }
      for (size_t i = 0; i < parts.size(); ++i) Assign(n.targets[i], parts[i]);
      return absl::OkStatus();
    };
    if (n.filter != nullptr) {
      List kept;
      for (const Value& item : items) {
        JINJA_RETURN_IF_ERROR(bind(item));
        Value keep;
        JINJA_ASSIGN_OR_RETURN(keep, Eval(*n.filter));
        if (keep.Truthy()) kept.push_back(item);
      }
      items = std::move(kept);
      scopes_.back().clear();
    }
    const auto count = static_cast<int64_t>(items.size());
    absl::StatusOr<Flow> result = Flow::kNormal;
    for (int64_t i = 0; i < count; ++i) {
      scopes_.back().clear();
      Dict loop = {{"index", Value::Int(i + 1)},
                   {"index0", Value::Int(i)},
                   {"revindex", Value::Int(count - i)},
                   {"revindex0", Value::Int(count - i - 1)},
                   {"first", Value::Bool(i == 0)},
                   {"last", Value::Bool(i == count - 1)},
                   {"length", Value::Int(count)},
                   {"previtem", i > 0 ? items[i - 1] : Value()},
                   {"nextitem", i + 1 < count ? items[i + 1] : Value()}};
      Assign("loop", Value::MakeDict(std::move(loop)));
      if (absl::Status st = bind(items[i]); !st.ok()) {
        result = st;
        break;
      }
      result = Run(n.body, out);
      if (!result.ok() || *result == Flow::kBreak) break;
    }
    scopes_.pop_back();
    if (!result.ok()) return result.status();
    if (count == 0 && n.has_else) return Run(n.else_body, out);
    return Flow::kNormal;
  }

  absl::StatusOr<Value> Eval(const Node& n) {
    if (++steps_ > kMaxSteps) return Budget(n.line, std::string());
    switch (n.kind) {
      case NodeKind::kLiteral:
        return n.literal;
      case NodeKind::kName:
        return Lookup(n.name);
      case NodeKind::kGetAttr:
      case NodeKind::kGetItem: {
        Value obj;
        JINJA_ASSIGN_OR_RETURN(obj, Eval(*n.kids[0]));
        Value key = Value::String(n.name);
        if (n.kind == NodeKind::kGetItem) JINJA_ASSIGN_OR_RETURN(key, Eval(*n.kids[1]));
        return Subscript(obj, key, n.line);
      }
      case NodeKind::kSlice:
        return Slice(n);
      case NodeKind::kCall:
        return Call(n);
      case NodeKind::kFilter:
        return Filter(n);
      case NodeKind::kTest: {
        bool r = false;
        JINJA_ASSIGN_OR_RETURN(r, Test(n));
        return Value::Bool(r != n.negated);
      }
      case NodeKind::kNeg:
      case NodeKind::kPos: {
        Value v;
        JINJA_ASSIGN_OR_RETURN(v, Eval(*n.kids[0]));
        if (!v.is_number()) return TypeError(n.line, "bad operand type for unary -");
        if (n.kind == NodeKind::kPos) return v;
        if (v.kind() == Value::Kind::kInt && v.int_value() == std::numeric_limits<int64_t>::min()) {
          return Unsupported(n.line, "integers beyond 64 bits");
        }
        return v.kind() == Value::Kind::kInt ? Value::Int(-v.int_value())
                                             : Value::Float(-v.float_value());
      }
      case NodeKind::kNot: {
        Value v;
        JINJA_ASSIGN_OR_RETURN(v, Eval(*n.kids[0]));
        return Value::Bool(!v.Truthy());
      }
      case NodeKind::kAnd:
      case NodeKind::kOr: {
        Value l;
        JINJA_ASSIGN_OR_RETURN(l, Eval(*n.kids[0]));
        if ((n.kind == NodeKind::kAnd) != l.Truthy()) return l;
        return Eval(*n.kids[1]);
      }
      case NodeKind::kBinary:
        return BinaryOp(n);
      case NodeKind::kCompare:
        return CompareOp(n);
      case NodeKind::kCond: {
        Value cond;
        JINJA_ASSIGN_OR_RETURN(cond, Eval(*n.kids[1]));
        return Eval(*n.kids[cond.Truthy() ? 0 : 2]);
      }
      case NodeKind::kListLit: {
        List items;
        for (const auto& k : n.kids) {
          Value v;
          JINJA_ASSIGN_OR_RETURN(v, Eval(*k));
          items.push_back(std::move(v));
        }
        return Value::MakeList(std::move(items));
      }
      case NodeKind::kDictLit: {
        Dict items;
        for (size_t i = 0; i + 1 < n.kids.size(); i += 2) {
          Value k, v;
          JINJA_ASSIGN_OR_RETURN(k, Eval(*n.kids[i]));
          JINJA_ASSIGN_OR_RETURN(v, Eval(*n.kids[i + 1]));
          if (!k.is_string()) return Unsupported(n.line, "dict keys other than strings");
          items.emplace_back(k.string_value(), std::move(v));
        }
        return Value::MakeDict(std::move(items));
      }
      default:
        return absl::InternalError("statement node in expression position");
    }
  }

  // obj.attr / obj[key]: mappings by key, lists and strings by (negative) index; a missing one
  // is undefined. Looking into an undefined value is an error, as in Jinja2.
  absl::StatusOr<Value> Subscript(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined()) {
      return TypeError(
          line, absl::StrCat("'", Str(key), "' of an undefined value (Jinja2: UndefinedError)"));
    }
    if (obj.is_mapping()) return key.is_string() ? obj.Get(key.string_value()) : Value();
    if ((obj.is_list() || obj.is_string()) && key.kind() == Value::Kind::kInt) {
      const int64_t size = obj.is_list() ? static_cast<int64_t>(obj.list().size())
                                         : static_cast<int64_t>(obj.string_value().size());
      int64_t i = key.int_value();
      if (i < 0) i += size;
      if (i < 0 || i >= size) return Value();
      if (obj.is_list()) return obj.list()[static_cast<size_t>(i)];
      List chars;
      JINJA_ASSIGN_OR_RETURN(chars, Iterate(obj, line));
      int64_t ci = key.int_value();
      if (ci < 0) ci += static_cast<int64_t>(chars.size());
      if (ci < 0 || ci >= static_cast<int64_t>(chars.size())) return Value();
      return chars[static_cast<size_t>(ci)];
    }
    return Value();
  }

  absl::StatusOr<Value> Slice(const Node& n) {
    Value obj;
    JINJA_ASSIGN_OR_RETURN(obj, Eval(*n.kids[0]));
    std::optional<int64_t> bound[3];
    for (int i = 0; i < 3; ++i) {
      if (n.kids[i + 1] == nullptr) continue;
      Value b;
      JINJA_ASSIGN_OR_RETURN(b, Eval(*n.kids[i + 1]));
      if (b.is_none()) continue;
      if (b.kind() != Value::Kind::kInt) return TypeError(n.line, "slice indices must be integers");
      bound[i] = b.int_value();
    }
    List items;
    if (obj.is_list()) {
      items = obj.list();
    } else if (obj.is_string()) {
      JINJA_ASSIGN_OR_RETURN(items, Iterate(obj, n.line));
    } else {
      return TypeError(n.line, absl::StrCat("'", KindName(obj), "' object is not subscriptable"));
    }
    const int64_t size = static_cast<int64_t>(items.size());
    const int64_t step = bound[2].value_or(1);
    if (step == 0) return TypeError(n.line, "slice step cannot be zero");
    auto clamp = [&](std::optional<int64_t> b, int64_t dflt) {
      if (!b) return dflt;
      int64_t v = *b;
      if (v < 0) v += size;
      if (step > 0) return std::clamp<int64_t>(v, 0, size);
      return std::clamp<int64_t>(v, -1, size - 1);
    };
    const int64_t start = clamp(bound[0], step > 0 ? 0 : size - 1);
    const int64_t stop = clamp(bound[1], step > 0 ? size : -1);
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
      out.push_back(items[static_cast<size_t>(i)]);
      if (__builtin_add_overflow(i, step, &i)) break;
    }
    if (obj.is_list()) return Value::MakeList(std::move(out));
    std::string s;
    for (const Value& c : out) s += c.string_value();
    return Value::String(std::move(s));
  }

  absl::StatusOr<Value> BinaryOp(const Node& n) {
    Value a, b;
    JINJA_ASSIGN_OR_RETURN(a, Eval(*n.kids[0]));
    JINJA_ASSIGN_OR_RETURN(b, Eval(*n.kids[1]));
    const std::string& op = n.name;
    if (op == "~") return Value::String(Str(a) + Str(b));
    if (op == "+") {
      if (a.is_string() && b.is_string()) return Value::String(a.string_value() + b.string_value());
      if (a.is_list() && b.is_list()) {
        List items = a.list();
        items.insert(items.end(), b.list().begin(), b.list().end());
        return Value::MakeList(std::move(items));
      }
    }
    if (op == "*" && ((a.is_string() && b.kind() == Value::Kind::kInt) ||
                      (b.is_string() && a.kind() == Value::Kind::kInt))) {
      const Value& s = a.is_string() ? a : b;
      const int64_t times = a.is_string() ? b.int_value() : a.int_value();
      std::string out;
      for (int64_t i = 0; i < times && out.size() < (1u << 24); ++i) out += s.string_value();
      return Value::String(std::move(out));
    }
    if (op == "%" && a.is_string()) return Unsupported(n.line, "'%' string formatting");
    const auto num = [](const Value& v) { return v.is_number() || v.kind() == Value::Kind::kBool; };
    if (!num(a) || !num(b)) {
      return TypeError(n.line, absl::StrCat("unsupported operand types for ", op, ": '",
                                            KindName(a), "' and '", KindName(b), "'"));
    }
    const auto as_int = [](const Value& v) {
      return v.kind() == Value::Kind::kBool ? (v.bool_value() ? 1 : 0) : v.int_value();
    };
    const bool ints = a.kind() != Value::Kind::kFloat && b.kind() != Value::Kind::kFloat;
    const double x = a.kind() == Value::Kind::kBool ? as_int(a) : a.float_value();
    const double y = b.kind() == Value::Kind::kBool ? as_int(b) : b.float_value();
    if (op == "/") {
      if (y == 0) return TypeError(n.line, "division by zero");
      return Value::Float(x / y);
    }
    if (ints) {
      const int64_t i = as_int(a), j = as_int(b);
      // Python's integers do not overflow; ours are 64-bit and say so rather than wrap.
      int64_t r64 = 0;
      const auto overflow = [&] { return Unsupported(n.line, "integers beyond 64 bits"); };
      if (op == "+" || op == "-" || op == "*") {
        const bool wrapped = op == "+"   ? __builtin_add_overflow(i, j, &r64)
                             : op == "-" ? __builtin_sub_overflow(i, j, &r64)
                                         : __builtin_mul_overflow(i, j, &r64);
        if (wrapped) return overflow();
        return Value::Int(r64);
      }
      if (op == "//" || op == "%") {
        if (j == 0) return TypeError(n.line, "integer division or modulo by zero");
        if (i == std::numeric_limits<int64_t>::min() && j == -1) return overflow();
        int64_t q = i / j, r = i % j;
        if (r != 0 && ((r < 0) != (j < 0))) {  // Python floors
          --q;
          r += j;
        }
        return Value::Int(op == "//" ? q : r);
      }
      if (op == "**" && j >= 0) {
        int64_t r = 1;
        for (int64_t k = 0; k < j; ++k) {
          if (__builtin_mul_overflow(r, i, &r)) return overflow();
          if (r == 0 || r == 1) break;  // 0 and 1 stay put; -1 alternates below
          if (r == -1) {
            r = (j - k - 1) % 2 == 0 ? -1 : 1;
            break;
          }
        }
        return Value::Int(r);
      }
    }
    if (op == "+") return Value::Float(x + y);
    if (op == "-") return Value::Float(x - y);
    if (op == "*") return Value::Float(x * y);
    if (op == "**") return Value::Float(std::pow(x, y));
    if (op == "//" || op == "%") {
      if (y == 0) return TypeError(n.line, "float division or modulo by zero");
      const double q = std::floor(x / y);
      return Value::Float(op == "//" ? q : x - q * y);
    }
    return TypeError(n.line, absl::StrCat("unknown operator ", op));
  }

  absl::StatusOr<Value> CompareOp(const Node& n) {
    Value left;
    JINJA_ASSIGN_OR_RETURN(left, Eval(*n.kids[0]));
    for (size_t i = 0; i < n.ops.size(); ++i) {
      Value right;
      JINJA_ASSIGN_OR_RETURN(right, Eval(*n.kids[i + 1]));
      const std::string& op = n.ops[i];
      bool r = false;
      if (op == "==") {
        r = Equal(left, right);
      } else if (op == "!=") {
        r = !Equal(left, right);
      } else if (op == "in" || op == "notin") {
        JINJA_ASSIGN_OR_RETURN(r, Contains(right, left, n.line));
        if (op == "notin") r = !r;
      } else if (op == "<") {
        JINJA_ASSIGN_OR_RETURN(r, Less(left, right, n.line));
      } else if (op == ">") {
        JINJA_ASSIGN_OR_RETURN(r, Less(right, left, n.line));
      } else if (op == "<=") {
        JINJA_ASSIGN_OR_RETURN(r, Less(right, left, n.line));
        r = !r;
      } else if (op == ">=") {
        JINJA_ASSIGN_OR_RETURN(r, Less(left, right, n.line));
        r = !r;
      }
      if (!r) return Value::Bool(false);
      left = std::move(right);
    }
    return Value::Bool(true);
  }

  // Arguments of a call, filter or test node, from kids[first] on.
  absl::StatusOr<Args> EvalArgs(const Node& n, size_t first) {
    Args args;
    const size_t n_kw = n.kwarg_names.size();
    const size_t n_pos = n.kids.size() - first - n_kw;
    for (size_t i = first; i < n.kids.size(); ++i) {
      Value v;
      JINJA_ASSIGN_OR_RETURN(v, Eval(*n.kids[i]));
      if (i - first < n_pos) {
        args.positional.push_back(std::move(v));
      } else {
        args.keyword.emplace_back(n.kwarg_names[i - first - n_pos], std::move(v));
      }
    }
    return args;
  }

  absl::StatusOr<Value> Call(const Node& n) {
    Args args;
    JINJA_ASSIGN_OR_RETURN(args, EvalArgs(n, 1));
    const Node& callee = *n.kids[0];
    if (callee.kind == NodeKind::kName) {
      const Value fn = Lookup(callee.name);
      if (fn.kind() != Value::Kind::kFunction) {
        return fn.is_undefined()
                   ? TypeError(n.line, absl::StrCat("'", callee.name, "' is undefined"))
                   : TypeError(n.line, absl::StrCat("'", callee.name, "' is not callable"));
      }
      const std::string& f = fn.string_value();
      if (f == "raise_exception") {
        return absl::AbortedError(Str(args.Get(0, "message")));
      }
      if (f == "namespace") {
        Dict d;
        if (!args.positional.empty()) return TypeError(n.line, "namespace() takes keywords");
        for (auto& kv : args.keyword) d.push_back(kv);
        return Value::MakeNamespace(std::move(d));
      }
      if (f == "dict") {
        if (!args.positional.empty()) return Unsupported(n.line, "dict() of positional values");
        return Value::MakeDict(args.keyword);
      }
      if (f == "range") {
        int64_t start = 0, stop = 0, step = 1;
        for (const Value& a : args.positional) {
          if (a.kind() != Value::Kind::kInt) return TypeError(n.line, "range() needs integers");
        }
        if (args.positional.size() == 1) {
          stop = args.positional[0].int_value();
        } else if (args.positional.size() >= 2) {
          start = args.positional[0].int_value();
          stop = args.positional[1].int_value();
          if (args.positional.size() == 3) step = args.positional[2].int_value();
        }
        if (step == 0) return TypeError(n.line, "range() step must not be zero");
        List items;
        for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
          items.push_back(Value::Int(i));
          if (items.size() > 100000) return TypeError(n.line, "range() too long");
          if (__builtin_add_overflow(i, step, &i)) break;
        }
        return Value::MakeList(std::move(items));
      }
      if (f == "strftime_now") {
        const Value fmt = args.Get(0, "format");
        if (!fmt.is_string()) return TypeError(n.line, "strftime_now() needs a format string");
        const std::time_t now = std::time(nullptr);
        std::tm tm{};
        localtime_r(&now, &tm);
        char buf[256];
        const size_t len = std::strftime(buf, sizeof(buf), fmt.string_value().c_str(), &tm);
        return Value::String(std::string(buf, len));
      }
      return Unsupported(n.line, absl::StrCat("the function ", f, "()"));
    }
    if (callee.kind == NodeKind::kGetAttr) {
      Value obj;
      JINJA_ASSIGN_OR_RETURN(obj, Eval(*callee.kids[0]));
      return Method(obj, callee.name, args, n.line);
    }
    return Unsupported(n.line, "calling this expression");
  }

  absl::StatusOr<bool> Test(const Node& n) {
    Value v;
    JINJA_ASSIGN_OR_RETURN(v, Eval(*n.kids[0]));
    Args args;
    JINJA_ASSIGN_OR_RETURN(args, EvalArgs(n, 1));
    return ApplyTest(n.name, v, args, n.line);
  }

  absl::StatusOr<Value> Filter(const Node& n) {
    Value v;
    JINJA_ASSIGN_OR_RETURN(v, Eval(*n.kids[0]));
    Args args;
    JINJA_ASSIGN_OR_RETURN(args, EvalArgs(n, 1));
    const std::string& f = n.name;
    if (f == "trim") return Value::String(Strip(Str(v), args.Get(0, "chars"), true, true));
    if (f == "length" || f == "count") {
      int64_t len = 0;
      JINJA_ASSIGN_OR_RETURN(len, Length(v, n.line));
      return Value::Int(len);
    }
    if (f == "string") return Value::String(Str(v));
    if (f == "safe" || f == "e" || f == "escape") {
      if (f != "safe") return Unsupported(n.line, "HTML escaping");
      return v;
    }
    if (f == "tojson") {
      if (v.is_undefined()) return TypeError(n.line, "tojson of an undefined value");
      const Value indent = args.Get(0, "indent");
      return Value::String(ToJson(
          v, indent.kind() == Value::Kind::kInt ? static_cast<int>(indent.int_value()) : -1));
    }
    if (f == "upper" || f == "lower" || f == "capitalize" || f == "title") {
      return StringFilter(f, v, n.line);
    }
    if (f == "default" || f == "d") {
      const bool boolean = args.Get(1, "boolean", Value::Bool(false)).Truthy();
      if (v.is_undefined() || (boolean && !v.Truthy())) {
        return args.Get(0, "default_value", Value::String(""));
      }
      return v;
    }
    if (f == "int") {
      if (v.kind() == Value::Kind::kInt) return v;
      if (v.kind() == Value::Kind::kFloat) {
        const double d = v.float_value();
        // Beyond int64 (or NaN) Python would give a big integer or fail; refuse instead.
        if (!(std::fabs(d) < 9.2e18)) return Unsupported(n.line, "integers beyond 64 bits");
        return Value::Int(static_cast<int64_t>(d));
      }
      if (v.kind() == Value::Kind::kBool) return Value::Int(v.bool_value() ? 1 : 0);
      if (v.is_string()) {
        int64_t i = 0;
        const std::string s = Strip(v.string_value(), Value(), true, true);
        auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), i);
        return Value::Int(ec == std::errc() && p == s.data() + s.size() ? i : 0);
      }
      return Value::Int(0);
    }
    if (f == "abs") {
      if (v.kind() == Value::Kind::kInt) {
        if (v.int_value() == std::numeric_limits<int64_t>::min()) {
          return Unsupported(n.line, "integers beyond 64 bits");
        }
        return Value::Int(v.int_value() < 0 ? -v.int_value() : v.int_value());
      }
      if (v.kind() == Value::Kind::kFloat) return Value::Float(std::fabs(v.float_value()));
      return TypeError(n.line, "abs() of a non-number");
    }
    if (f == "list") {
      List items;
      JINJA_ASSIGN_OR_RETURN(items, Iterate(v, n.line));
      return Value::MakeList(std::move(items));
    }
    if (f == "first" || f == "last") {
      List items;
      JINJA_ASSIGN_OR_RETURN(items, Iterate(v, n.line));
      if (items.empty()) return Value();
      return f == "first" ? items.front() : items.back();
    }
    if (f == "join") {
      List items;
      JINJA_ASSIGN_OR_RETURN(items, Iterate(v, n.line));
      const Value sep = args.Get(0, "d", Value::String(""));
      const Value attr = args.Get(1, "attribute");
      std::string out;
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += Str(sep);
        Value item = items[i];
        if (attr.is_string()) JINJA_ASSIGN_OR_RETURN(item, Subscript(item, attr, n.line));
        out += Str(item);
      }
      return Value::String(std::move(out));
    }
    if (f == "replace") {
      const Value a = args.Get(0, "old"), b = args.Get(1, "new");
      if (!a.is_string() || !b.is_string()) return TypeError(n.line, "replace needs strings");
      return Value::String(ReplaceAll(Str(v), a.string_value(), b.string_value()));
    }
    if (f == "items") {
      if (v.is_undefined()) return Value::MakeList({});
      if (!v.is_mapping()) return TypeError(n.line, "items of a non-mapping");
      return Method(v, "items", Args(), n.line);
    }
    if (f == "indent") {
      const Value width = args.Get(0, "width", Value::Int(4));
      const bool first = args.Get(1, "first", Value::Bool(false)).Truthy();
      const bool blank = args.Get(2, "blank", Value::Bool(false)).Truthy();
      const std::string pad =
          width.is_string()
              ? width.string_value()
              : std::string(static_cast<size_t>(std::max<int64_t>(0, width.int_value())), ' ');
      const std::string s = Str(v);
      std::string out;
      size_t pos = 0;
      bool is_first = true;
      while (pos <= s.size()) {
        size_t nl = s.find('\n', pos);
        const std::string line =
            s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
        if ((!is_first || first) && (blank || !line.empty())) out += pad;
        out += line;
        if (nl == std::string::npos) break;
        out += "\n";
        pos = nl + 1;
        is_first = false;
      }
      return Value::String(std::move(out));
    }
    if (f == "selectattr" || f == "rejectattr" || f == "select" || f == "reject") {
      List items;
      JINJA_ASSIGN_OR_RETURN(items, Iterate(v, n.line));
      const bool by_attr = f == "selectattr" || f == "rejectattr";
      const bool keep_if = f == "selectattr" || f == "select";
      const size_t test_at = by_attr ? 1 : 0;
      Value attr;
      if (by_attr) {
        if (args.positional.empty() || !args.positional[0].is_string()) {
          return TypeError(n.line, absl::StrCat(f, " needs an attribute name"));
        }
        attr = args.positional[0];
      }
      const Value test = test_at < args.positional.size() ? args.positional[test_at] : Value();
      if (!test.is_undefined() && !test.is_string()) return TypeError(n.line, "bad test name");
      Args test_args;
      for (size_t i = test_at + 1; i < args.positional.size(); ++i) {
        test_args.positional.push_back(args.positional[i]);
      }
      List out;
      for (const Value& item : items) {
        Value subject = item;
        if (by_attr) JINJA_ASSIGN_OR_RETURN(subject, Subscript(item, attr, n.line));
        bool r = false;
        if (test.is_undefined()) {
          r = subject.Truthy();
        } else {
          JINJA_ASSIGN_OR_RETURN(r, ApplyTest(test.string_value(), subject, test_args, n.line));
        }
        if (r == keep_if) out.push_back(item);
      }
      return Value::MakeList(std::move(out));
    }
    if (f == "map") {
      List items;
      JINJA_ASSIGN_OR_RETURN(items, Iterate(v, n.line));
      const Value attr = args.Get(99, "attribute");
      if (!attr.is_string()) return Unsupported(n.line, "map() other than map(attribute=...)");
      List out;
      for (const Value& item : items) {
        Value sub;
        JINJA_ASSIGN_OR_RETURN(sub, Subscript(item, attr, n.line));
        if (sub.is_undefined()) sub = args.Get(99, "default");
        out.push_back(sub);
      }
      return Value::MakeList(std::move(out));
    }
    return Unsupported(n.line, absl::StrCat("the filter '", f, "'"));
  }

  std::vector<Scope> scopes_;
  int64_t steps_ = 0;
};

}  // namespace

Template::Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
Template::~Template() = default;

absl::StatusOr<std::string> Template::Render(const Value& context) const {
  Renderer r(context);
  std::string out;
  absl::StatusOr<Flow> flow = r.Run(nodes_, &out);
  if (!flow.ok()) return flow.status();
  return out;
}

}  // namespace subspace::jinja
