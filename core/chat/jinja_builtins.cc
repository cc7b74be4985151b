// Python's value semantics and the builtins templates call, for the renderer (jinja_render.cc):
// equality and ordering, membership, iteration, len(), the str / list / dict methods, the
// string filters and the "is" tests. Stateless: none of it reads the render's scopes.
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

absl::Status TypeError(int line, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("template line ", line, ": ", AsAbsl(what)));
}

std::string KindName(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return "list";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kNamespace:
      return "Namespace";
    case Value::Kind::kFunction:
      return "builtin_function_or_method";
  }
  return "?";
}

// Python ==.
bool Equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.float_value() == b.float_value();
  if ((a.kind() == Value::Kind::kBool) != (b.kind() == Value::Kind::kBool)) {
    // True == 1 in Python.
    const Value& x = a.kind() == Value::Kind::kBool ? a : b;
    const Value& y = a.kind() == Value::Kind::kBool ? b : a;
    return y.is_number() && y.float_value() == (x.bool_value() ? 1.0 : 0.0);
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kBool:
      return a.bool_value() == b.bool_value();
    case Value::Kind::kString:
      return a.string_value() == b.string_value();
    case Value::Kind::kList:
      if (a.is_tuple() != b.is_tuple() || a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i) {
        if (!Equal(a.list()[i], b.list()[i])) return false;
      }
      return true;
    case Value::Kind::kDict:
      if (a.dict().size() != b.dict().size()) return false;
      for (const auto& [k, v] : a.dict()) {
        const Value other = b.Get(k);
        if (other.is_undefined() || !Equal(v, other)) return false;
      }
      return true;
    case Value::Kind::kNamespace:
      return &a.dict() == &b.dict();
    default:
      return false;
  }
}

absl::StatusOr<List> Iterate(const Value& v, int line) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return List();
    case Value::Kind::kList:
      return v.list();
    case Value::Kind::kDict: {
      List keys;
      for (const auto& [k, item] : v.dict()) keys.push_back(Value::String(k));
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      const std::string& s = v.string_value();
      for (size_t i = 0; i < s.size();) {
        size_t len = 1;
        const auto c = static_cast<unsigned char>(s[i]);
        if (c >= 0xF0) {
          len = 4;
        } else if (c >= 0xE0) {
          len = 3;
        } else if (c >= 0xC0) {
          len = 2;
        }
        chars.push_back(Value::String(s.substr(i, len)));
        i += len;
      }
      return chars;
    }
    default:
      return TypeError(line, absl::StrCat("'", KindName(v), "' object is not iterable"));
  }
}

absl::StatusOr<bool> Contains(const Value& container, const Value& item, int line) {
  if (container.is_string()) {
    if (!item.is_string()) return TypeError(line, "'in <string>' requires a string");
    return container.string_value().find(item.string_value()) != std::string::npos;
  }
  if (container.is_list()) {
    for (const Value& v : container.list()) {
      if (Equal(v, item)) return true;
    }
    return false;
  }
  if (container.is_mapping())
    return item.is_string() && !container.Get(item.string_value()).is_undefined();
  if (container.is_undefined()) return false;
  return TypeError(line,
                   absl::StrCat("argument of type '", KindName(container), "' is not iterable"));
}

absl::StatusOr<bool> Less(const Value& a, const Value& b, int line) {
  if ((a.is_number() || a.kind() == Value::Kind::kBool) &&
      (b.is_number() || b.kind() == Value::Kind::kBool)) {
    const double x = a.kind() == Value::Kind::kBool ? a.bool_value() : a.float_value();
    const double y = b.kind() == Value::Kind::kBool ? b.bool_value() : b.float_value();
    return x < y;
  }
  if (a.is_string() && b.is_string()) return a.string_value() < b.string_value();
  return TypeError(
      line, absl::StrCat("'<' not supported between '", KindName(a), "' and '", KindName(b), "'"));
}

std::string Strip(const std::string& s, const Value& chars, bool left, bool right) {
  const auto strip_char = [&](char c) {
    if (chars.is_string()) return chars.string_value().find(c) != std::string::npos;
    return IsSpace(c);
  };
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e && strip_char(s[b])) ++b;
  }
  if (right) {
    while (e > b && strip_char(s[e - 1])) --e;
  }
  return s.substr(b, e - b);
}

absl::StatusOr<Value> Method(const Value& obj, const std::string& m, const Args& args, int line) {
  if (obj.is_string()) {
    const std::string& s = obj.string_value();
    if (m == "strip" || m == "lstrip" || m == "rstrip") {
      return Value::String(Strip(s, args.Get(0, "chars"), m != "rstrip", m != "lstrip"));
    }
    if (m == "upper" || m == "lower") {
      std::string out = s;
      for (char& c : out) {
        c = static_cast<char>(m == "upper" ? std::toupper(static_cast<unsigned char>(c))
                                           : std::tolower(static_cast<unsigned char>(c)));
      }
      return Value::String(std::move(out));
    }
    if (m == "startswith" || m == "endswith") {
      const Value p = args.Get(0, "prefix");
      if (!p.is_string()) return Unsupported(line, absl::StrCat(m, "() of a non-string"));
      const std::string& x = p.string_value();
      const bool r = m == "startswith"
                         ? s.compare(0, x.size(), x) == 0
                         : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
      return Value::Bool(r);
    }
    if (m == "split") {
      const Value sep = args.Get(0, "sep");
      const Value max = args.Get(1, "maxsplit", Value::Int(-1));
      List parts;
      int64_t left = max.kind() == Value::Kind::kInt ? max.int_value() : -1;
      if (sep.is_string() && !sep.string_value().empty()) {
        size_t pos = 0;
        while (left != 0) {
          const size_t at = s.find(sep.string_value(), pos);
          if (at == std::string::npos) break;
          parts.push_back(Value::String(s.substr(pos, at - pos)));
          pos = at + sep.string_value().size();
          --left;
        }
        parts.push_back(Value::String(s.substr(pos)));
      } else if (sep.is_undefined() || sep.is_none()) {
        size_t pos = 0;
        while (pos < s.size()) {
          while (pos < s.size() && IsSpace(s[pos])) ++pos;
          if (pos >= s.size()) break;
          size_t end = pos;
          if (left == 0) {
            end = s.size();
            while (end > pos && IsSpace(s[end - 1])) --end;
          } else {
            while (end < s.size() && !IsSpace(s[end])) ++end;
          }
          parts.push_back(Value::String(s.substr(pos, end - pos)));
          --left;
          pos = end;
        }
      } else {
        return TypeError(line, "empty separator");
      }
      return Value::MakeList(std::move(parts));
    }
    if (m == "replace") {
      const Value a = args.Get(0, "old"), b = args.Get(1, "new");
      if (!a.is_string() || !b.is_string()) return TypeError(line, "replace() needs strings");
      return Value::String(ReplaceAll(s, a.string_value(), b.string_value()));
    }
    if (m == "title" || m == "capitalize") return StringFilter(m, obj, line);
    return Unsupported(line, absl::StrCat("the string method ", m, "()"));
  }
  if (obj.is_mapping()) {
    if (m == "get") {
      const Value k = args.Get(0, "key");
      const Value v = k.is_string() ? obj.Get(k.string_value()) : Value();
      return v.is_undefined() ? args.Get(1, "default", Value::None()) : v;
    }
    if (m == "items" || m == "keys" || m == "values") {
      List out;
      for (const auto& [k, v] : obj.dict()) {
        if (m == "items") {
          out.push_back(Value::MakeTuple({Value::String(k), v}));
        } else {
          out.push_back(m == "keys" ? Value::String(k) : v);
        }
      }
      return Value::MakeList(std::move(out));
    }
  }
  if (obj.is_undefined()) {
    return TypeError(line,
                     absl::StrCat("'", m, "' of an undefined value (Jinja2: UndefinedError)"));
  }
  if (obj.is_list() && (m == "append" || m == "pop" || m == "insert" || m == "extend")) {
    return Unsupported(line, "modifying a list (Jinja2's sandbox forbids it)");
  }
  return Unsupported(line, absl::StrCat("the method ", m, "() of ", KindName(obj)));
}

std::string ReplaceAll(const std::string& s, const std::string& a, const std::string& b) {
  if (a.empty()) {
    std::string out = b;
    for (char c : s) {
      out.push_back(c);
      out += b;
    }
    return out;
  }
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t at = s.find(a, pos);
    if (at == std::string::npos) break;
    out.append(s, pos, at - pos);
    out += b;
    pos = at + a.size();
  }
  out.append(s, pos, std::string::npos);
  return out;
}

absl::StatusOr<Value> StringFilter(const std::string& f, const Value& v, int line) {
  std::string s = Str(v);
  if (f == "upper" || f == "lower") {
    for (char& c : s) {
      c = static_cast<char>(f == "upper" ? std::toupper(static_cast<unsigned char>(c))
                                         : std::tolower(static_cast<unsigned char>(c)));
    }
  } else if (f == "capitalize") {
    for (size_t i = 0; i < s.size(); ++i) {
      s[i] = static_cast<char>(i == 0 ? std::toupper(static_cast<unsigned char>(s[i]))
                                      : std::tolower(static_cast<unsigned char>(s[i])));
    }
  } else if (f == "title") {
    bool start = true;
    for (char& c : s) {
      const bool alpha = std::isalpha(static_cast<unsigned char>(c)) != 0;
      if (alpha) {
        c = static_cast<char>(start ? std::toupper(static_cast<unsigned char>(c))
                                    : std::tolower(static_cast<unsigned char>(c)));
      }
      start = !alpha && !std::isdigit(static_cast<unsigned char>(c)) && c != '\'';
      if (!alpha &&
          (c == ' ' || c == '-' || c == '\n' || c == '\t' || c == '(' || c == '[' || c == '{')) {
        start = true;
      }
    }
  } else {
    return Unsupported(line, absl::StrCat("the filter ", f));
  }
  return Value::String(std::move(s));
}

absl::StatusOr<bool> ApplyTest(const std::string& t, const Value& v, const Args& args, int line) {
  if (t == "defined") return !v.is_undefined();
  if (t == "undefined") return v.is_undefined();
  if (t == "none") return v.is_none();
  if (t == "string") return v.is_string();
  if (t == "number") return v.is_number();
  if (t == "integer") return v.kind() == Value::Kind::kInt;
  if (t == "float") return v.kind() == Value::Kind::kFloat;
  if (t == "boolean") return v.kind() == Value::Kind::kBool;
  if (t == "true") return v.kind() == Value::Kind::kBool && v.bool_value();
  if (t == "false") return v.kind() == Value::Kind::kBool && !v.bool_value();
  if (t == "mapping") return v.kind() == Value::Kind::kDict;
  if (t == "sequence") return v.is_list() || v.is_string() || v.kind() == Value::Kind::kDict;
  if (t == "iterable") return v.is_list() || v.is_string() || v.is_mapping() || v.is_undefined();
  if (t == "callable") return v.kind() == Value::Kind::kFunction;
  if (t == "odd" || t == "even") {
    if (v.kind() != Value::Kind::kInt) return TypeError(line, "odd/even need an integer");
    return (v.int_value() % 2 != 0) == (t == "odd");
  }
  if (t == "divisibleby") {
    const Value d = args.Get(0, "num");
    if (v.kind() != Value::Kind::kInt || d.kind() != Value::Kind::kInt || d.int_value() == 0) {
      return TypeError(line, "divisibleby needs non-zero integers");
    }
    return v.int_value() % d.int_value() == 0;
  }
  if (t == "lower" || t == "upper") {
    if (!v.is_string()) return false;
    const std::string& s = v.string_value();
    bool cased = false;
    for (char c : s) {
      if (std::isalpha(static_cast<unsigned char>(c))) {
        cased = true;
        if ((t == "lower") != (std::islower(static_cast<unsigned char>(c)) != 0)) return false;
      }
    }
    return cased;
  }
  const Value other = args.Get(0, "other");
  if (t == "equalto" || t == "eq" || t == "==" || t == "sameas") return Equal(v, other);
  if (t == "ne" || t == "!=") return !Equal(v, other);
  if (t == "lt" || t == "lessthan" || t == "<") return Less(v, other, line);
  if (t == "gt" || t == "greaterthan" || t == ">") return Less(other, v, line);
  if (t == "le" || t == "<=") {
    absl::StatusOr<bool> r = Less(other, v, line);
    if (!r.ok()) return r;
    return !*r;
  }
  if (t == "ge" || t == ">=") {
    absl::StatusOr<bool> r = Less(v, other, line);
    if (!r.ok()) return r;
    return !*r;
  }
  if (t == "in") return Contains(other, v, line);
  return Unsupported(line, absl::StrCat("the test '", t, "'"));
}

absl::StatusOr<int64_t> Length(const Value& v, int line) {
  if (v.is_string()) {
    int64_t n = 0;
    for (char c : v.string_value()) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
    return n;
  }
  if (v.is_list()) return static_cast<int64_t>(v.list().size());
  if (v.is_mapping()) return static_cast<int64_t>(v.dict().size());
  if (v.is_undefined()) return 0;
  return TypeError(line, absl::StrCat("object of type '", KindName(v), "' has no len()"));
}

}  // namespace subspace::jinja
