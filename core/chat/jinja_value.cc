// Jinja values with Python's semantics: truthiness, str() / repr() printing and transformers'
// tojson.
#include <charconv>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/chat/jinja.h"
#include "core/chat/jinja_internal.h"

namespace subspace::jinja {

// ---- Values ---------------------------------------------------------------------------------

Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value Value::Bool(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.b_ = b;
  return v;
}
Value Value::Int(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.i_ = i;
  return v;
}
Value Value::Float(double d) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.d_ = d;
  return v;
}
Value Value::String(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.s_ = std::make_shared<const std::string>(std::move(s));
  return v;
}
Value Value::MakeList(List items) {
  Value v;
  v.kind_ = Kind::kList;
  v.list_ = std::make_shared<List>(std::move(items));
  return v;
}
Value Value::MakeTuple(List items) {
  Value v = MakeList(std::move(items));
  v.tuple_ = true;
  return v;
}
Value Value::MakeDict(Dict items) {
  Value v;
  v.kind_ = Kind::kDict;
  v.dict_ = std::make_shared<Dict>(std::move(items));
  return v;
}
Value Value::Function(std::string name) {
  Value v = String(std::move(name));
  v.kind_ = Kind::kFunction;
  return v;
}
Value Value::MakeNamespace(Dict items) {
  Value v = MakeDict(std::move(items));
  v.kind_ = Kind::kNamespace;
  return v;
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
      return i_ != 0;
    case Kind::kFloat:
      return d_ != 0.0;
    case Kind::kString:
      return !s_->empty();
    case Kind::kList:
      return !list_->empty();
    case Kind::kDict:
      return !dict_->empty();
    case Kind::kNamespace:
    case Kind::kFunction:
      return true;
  }
  return false;
}

Value Value::Get(std::string_view key) const {
  if (!is_mapping()) return Value();
  for (const auto& [k, v] : *dict_) {
    if (k == key) return v;
  }
  return Value();
}

namespace {

// Python's repr of a float (shortest round trip, ".0" on integral values, "inf", "nan").
std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), d);
  std::string s(buf, end);
  // Python switches to exponent notation at 1e16 and below 1e-4; to_chars' shortest form picks
  // whichever is shorter, so redo the formatting around Python's thresholds.
  const double a = std::fabs(d);
  if (a != 0 && (a >= 1e16 || a < 1e-4)) {
    auto [e2, ec2] = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
    s.assign(buf, e2);
    // Python writes e+16 / e-05 with at least two exponent digits.
    const size_t e = s.find('e');
    std::string mant = s.substr(0, e), exp = s.substr(e + 1);
    const char sign = exp[0] == '-' ? '-' : '+';
    if (exp[0] == '-' || exp[0] == '+') exp = exp.substr(1);
    while (exp.size() < 2) exp = "0" + exp;
    return mant + "e" + sign + exp;
  }
  auto [e3, ec3] = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::fixed);
  s.assign(buf, e3);
  if (s.find('.') == std::string::npos) s += ".0";
  return s;
}

void JsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          if (c == 0x7f) {
            out->push_back(static_cast<char>(c));  // json.dumps keeps DEL as is
          } else {
            *out += absl::StrFormat("\\u%04x", c);
          }
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

void ToJsonInto(const Value& v, int indent, int depth, std::string* out) {
  const auto newline = [&](int d) {
    out->push_back('\n');
    out->append(static_cast<size_t>(indent * d), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      *out += "null";
      return;
    case Value::Kind::kBool:
      *out += v.bool_value() ? "true" : "false";
      return;
    case Value::Kind::kInt:
      *out += absl::StrCat(v.int_value());
      return;
    case Value::Kind::kFloat: {
      const double d = v.float_value();
      *out += std::isnan(d)   ? "NaN"
              : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity")
                              : FloatRepr(d);
      return;
    }
    case Value::Kind::kString:
    case Value::Kind::kFunction:
      JsonString(v.string_value(), out);
      return;
    case Value::Kind::kList: {
      if (v.list().empty()) {
        *out += "[]";
        return;
      }
      out->push_back('[');
      bool first = true;
      for (const Value& item : v.list()) {
        if (!first) *out += indent >= 0 ? "," : ", ";
        first = false;
        if (indent >= 0) newline(depth + 1);
        ToJsonInto(item, indent, depth + 1, out);
      }
      if (indent >= 0) newline(depth);
      out->push_back(']');
      return;
    }
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      if (v.dict().empty()) {
        *out += "{}";
        return;
      }
      out->push_back('{');
      bool first = true;
      for (const auto& [k, item] : v.dict()) {
        if (!first) *out += indent >= 0 ? "," : ", ";
        first = false;
        if (indent >= 0) newline(depth + 1);
        JsonString(k, out);
        *out += ": ";
        ToJsonInto(item, indent, depth + 1, out);
      }
      if (indent >= 0) newline(depth);
      out->push_back('}');
      return;
    }
  }
}

}  // namespace

std::string Repr(const Value& v) {
  if (v.is_string()) {
    // Python's repr: single quotes unless the text has a single quote and no double quote.
    const std::string& s = v.string_value();
    const char q =
        s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
    std::string out(1, q);
    for (char c : s) {
      if (c == q || c == '\\') {
        out.push_back('\\');
        out.push_back(c);
      } else if (c == '\n') {
        out += "\\n";
      } else if (c == '\r') {
        out += "\\r";
      } else if (c == '\t') {
        out += "\\t";
      } else {
        out.push_back(c);
      }
    }
    out.push_back(q);
    return out;
  }
  return Str(v);
}

std::string Str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.bool_value() ? "True" : "False";
    case Value::Kind::kInt:
      return absl::StrCat(v.int_value());
    case Value::Kind::kFloat:
      return FloatRepr(v.float_value());
    case Value::Kind::kString:
      return v.string_value();
    case Value::Kind::kFunction:
      return "<built-in function " + v.string_value() + ">";
    case Value::Kind::kList: {
      std::string out = v.is_tuple() ? "(" : "[";
      for (size_t i = 0; i < v.list().size(); ++i) {
        if (i) out += ", ";
        out += Repr(v.list()[i]);
      }
      if (v.is_tuple()) return out + (v.list().size() == 1 ? ",)" : ")");
      return out + "]";
    }
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      std::string out = v.kind() == Value::Kind::kNamespace ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, item] : v.dict()) {
        if (!first) out += ", ";
        first = false;
        out += Repr(Value::String(k)) + ": " + Repr(item);
      }
      return out + (v.kind() == Value::Kind::kNamespace ? "}>" : "}");
    }
  }
  return "";
}

std::string ToJson(const Value& v, int indent) {
  std::string out;
  ToJsonInto(v, indent, 0, &out);
  return out;
}

}  // namespace subspace::jinja
