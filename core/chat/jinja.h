// A Jinja subset for chat templates: the language HF transformers renders a model's stored
// `chat_template` with, under the same settings (trim_blocks, lstrip_blocks, loop controls, a
// sandbox that forbids mutating lists and dicts, transformers' own tojson, raise_exception and
// strftime_now). What it implements renders byte for byte as Jinja2 does -- the tests hold it to
// python3-jinja2 on the stored templates of Llama 3.x, Qwen2.5, Qwen3, Mistral, Phi-3, Gemma
// and ChatML. Anything outside the subset (macros, includes, set blocks, `%` formatting, ...)
// is refused at Parse naming the construct, so a template is either rendered as Jinja2 would
// or not at all.
#ifndef SUBSPACE_CORE_CHAT_JINJA_H_
#define SUBSPACE_CORE_CHAT_JINJA_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace subspace::jinja {

class Value;
using List = std::vector<Value>;
// Insertion-ordered, as Python dicts are (items() and tojson keep the order).
using Dict = std::vector<std::pair<std::string, Value>>;

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kFunction,  // a global function (raise_exception, namespace, range, strftime_now, dict)
  };

  Value() = default;  // undefined
  static Value None();
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double d);
  static Value String(std::string s);
  static Value MakeList(List items);
  static Value MakeTuple(List items);  // a list that prints as a Python tuple
  static Value MakeDict(Dict items);
  static Value MakeNamespace(Dict items);
  static Value Function(std::string name);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_tuple() const { return kind_ == Kind::kList && tuple_; }
  bool is_mapping() const { return kind_ == Kind::kDict || kind_ == Kind::kNamespace; }

  bool bool_value() const { return b_; }
  int64_t int_value() const { return i_; }
  double float_value() const { return kind_ == Kind::kInt ? static_cast<double>(i_) : d_; }
  const std::string& string_value() const { return *s_; }
  const List& list() const { return *list_; }
  const Dict& dict() const { return *dict_; }
  Dict& mutable_dict() const { return *dict_; }  // namespaces only (set ns.attr)

  // Python truthiness.
  bool Truthy() const;
  // The mapping's value for `key`, or undefined.
  Value Get(std::string_view key) const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  bool tuple_ = false;
  int64_t i_ = 0;
  double d_ = 0;
  std::shared_ptr<const std::string> s_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
};

struct Node;

class Template {
 public:
  // INVALID_ARGUMENT for a syntax error, UNIMPLEMENTED naming a construct outside the subset;
  // both with the line.
  static absl::StatusOr<Template> Parse(std::string_view source);

  // Renders with the variables of `context` (a mapping). Errors: raise_exception's message
  // (ABORTED), and INVALID_ARGUMENT / UNIMPLEMENTED for what Jinja2 would raise on (adding a
  // string to a number, an attribute of an undefined value, an unknown filter, ...).
  absl::StatusOr<std::string> Render(const Value& context) const;

  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;
  ~Template();

 private:
  Template();
  std::vector<std::unique_ptr<Node>> nodes_;
};

// transformers' tojson: json.dumps with ensure_ascii=False, no key sorting, Python's separators
// (", " and ": "; "," and newlines with `indent`).
std::string ToJson(const Value& v, int indent = -1);

}  // namespace subspace::jinja

#endif  // SUBSPACE_CORE_CHAT_JINJA_H_
