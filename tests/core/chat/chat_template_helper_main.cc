// Test helper for chat_template_oracle_test.py: renders a template file with contexts given as
// JSON lines on stdin and prints, per line, the hex of the output or "ERROR <code> <message>";
// a template that does not parse prints "PARSE_ERROR <code> <message>" once.
//
//   chat_template_helper TEMPLATE.jinja < contexts.jsonl
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "core/chat/jinja.h"

namespace {

using subspace::jinja::Value;

Value FromProto(const google::protobuf::Value& v) {
  switch (v.kind_case()) {
    case google::protobuf::Value::kNullValue:
      return Value::None();
    case google::protobuf::Value::kBoolValue:
      return Value::Bool(v.bool_value());
    case google::protobuf::Value::kNumberValue: {
      const double d = v.number_value();
      if (std::floor(d) == d && std::fabs(d) < 1e15) return Value::Int(static_cast<int64_t>(d));
      return Value::Float(d);
    }
    case google::protobuf::Value::kStringValue:
      return Value::String(v.string_value());
    case google::protobuf::Value::kListValue: {
      subspace::jinja::List items;
      for (const auto& item : v.list_value().values()) items.push_back(FromProto(item));
      return Value::MakeList(std::move(items));
    }
    case google::protobuf::Value::kStructValue: {
      subspace::jinja::Dict items;
      // Struct is a map (unordered): the test's JSON keeps one key per dict or sorts its keys.
      std::vector<std::string> keys;
      for (const auto& [k, item] : v.struct_value().fields()) keys.push_back(k);
      std::sort(keys.begin(), keys.end());
      for (const std::string& k : keys)
        items.emplace_back(k, FromProto(v.struct_value().fields().at(k)));
      return Value::MakeDict(std::move(items));
    }
    default:
      return Value();
  }
}

std::string Hex(const std::string& s) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: chat_template_helper TEMPLATE\n";
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  std::stringstream source;
  source << in.rdbuf();
  absl::StatusOr<subspace::jinja::Template> t = subspace::jinja::Template::Parse(source.str());
  if (!t.ok()) {
    std::cout << "PARSE_ERROR " << absl::StatusCodeToString(t.status().code()) << " "
              << t.status().message() << "\n";
    return 0;
  }
  for (std::string line; std::getline(std::cin, line);) {
    google::protobuf::Value json;
    if (!google::protobuf::util::JsonStringToMessage(line, &json).ok()) return 2;
    absl::StatusOr<std::string> out = t->Render(FromProto(json));
    if (out.ok()) {
      std::cout << Hex(*out) << "\n";
    } else {
      std::cout << "ERROR " << absl::StatusCodeToString(out.status().code()) << " "
                << out.status().message() << "\n";
    }
  }
  return 0;
}
