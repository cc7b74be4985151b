// OpenAI's JSON in: request bodies parsed into the gRPC API's messages, and the shared
// validation's field names given back as this API's; see openai_api.h. nlohmann::json parses
// (it rejects malformed JSON and invalid UTF-8 with the byte position). The answers and the
// errors are written by openai_responses.cc.
#include "server/openai_api.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/openai_json.h"
#include "server/request_validation.h"

namespace subspace::server::openai {
namespace {

template <typename... Args>
absl::Status Invalid(const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(args...));
}

// INVALID_ARGUMENT about request field `param` (a path: "top_p", "messages[2].content"), which
// the error body names in OpenAI's `param`.
absl::Status WithParam(absl::Status status, std::string_view param) {
  status.SetPayload(kParamPayload, absl::Cord(std::string(param)));
  return status;
}
template <typename... Args>
absl::Status InvalidAt(std::string_view param, const Args&... args) {
  return WithParam(Invalid(args...), param);
}

struct TooDeep {};

absl::StatusOr<Json> ParseObject(std::string_view body) {
  if (body.empty()) return Invalid("the request body is empty: send a JSON object");
  Json j;
  try {
    j = Json::parse(body.begin(), body.end(), [](int depth, Json::parse_event_t, Json&) {
      if (depth > kMaxJsonDepth) throw TooDeep{};
      return true;
    });
  } catch (const TooDeep&) {
    return Invalid("the request body nests deeper than ", kMaxJsonDepth, " levels");
  } catch (const Json::exception& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 9: ..."
    return Invalid("the request body is not valid JSON: ", e.what());
  }
  if (!j.is_object()) {
    return Invalid("the request body must be a JSON object, got ", j.type_name());
  }
  return j;
}

// The fields of one object, read by name; whatever is left unread at the end is unknown.
class Fields {
 public:
  explicit Fields(const Json& object, std::string prefix = "")
      : object_(object), prefix_(std::move(prefix)) {}

  // The field, or nullptr when it is absent or null (clients send null for "not set").
  const Json* Get(std::string_view name) {
    read_.insert(std::string(name));
    auto it = object_.find(name);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  std::string Path(const std::string& name) const { return prefix_ + name; }

  absl::Status CheckNoneUnknown() const {
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      if (read_.count(it.key()) == 0) {
        std::string shown = it.key().substr(0, 64);
        shown = ToValidUtf8(std::move(shown));
        return InvalidAt(Path(shown), "unknown field '", Path(shown), "'");
      }
    }
    return absl::OkStatus();
  }

 private:
  const Json& object_;
  std::string prefix_;
  std::set<std::string, std::less<>> read_;
};

absl::StatusOr<bool> Bool(const Json& j, const std::string& path) {
  if (!j.is_boolean()) return InvalidAt(path, path, " must be a boolean, got ", j.type_name());
  return j.get<bool>();
}

absl::StatusOr<int64_t> Int(const Json& j, const std::string& path, int64_t lo, int64_t hi) {
  if (!j.is_number_integer())
    return InvalidAt(path, path, " must be an integer, got ", j.type_name());
  if (j.is_number_unsigned() &&
      j.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return InvalidAt(path, path, " must be in [", lo, ", ", hi, "], got ", j.get<uint64_t>());
  }
  const int64_t v = j.get<int64_t>();
  if (v < lo || v > hi) return InvalidAt(path, path, " must be in [", lo, ", ", hi, "], got ", v);
  return v;
}

absl::StatusOr<float> Float(const Json& j, const std::string& path) {
  if (!j.is_number()) return InvalidAt(path, path, " must be a number, got ", j.type_name());
  const double v = j.get<double>();
  if (!std::isfinite(v) || std::fabs(v) > std::numeric_limits<float>::max()) {
    return InvalidAt(path, path, " must be a finite number, got ", v);
  }
  return static_cast<float>(v);
}

absl::StatusOr<std::string> String(const Json& j, const std::string& path) {
  if (!j.is_string()) return InvalidAt(path, path, " must be a string, got ", j.type_name());
  return j.get<std::string>();
}

absl::Status NotSupported(const std::string& path, const std::string& what = "") {
  return InvalidAt(path, path, " is not supported by this server", what.empty() ? "" : ": ", what);
}

// `lhs` names a new variable, so it cannot be parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define SUBSPACE_ASSIGN_OR_RETURN(lhs, expr)    \
  auto lhs##_or = (expr);                       \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  auto lhs = *std::move(lhs##_or)
// NOLINTEND(bugprone-macro-parentheses)

absl::Status CheckModel(Fields& f, const ApiContext& context) {
  const Json* model = f.Get("model");
  if (model == nullptr) return InvalidAt("model", "model is required (GET /v1/models lists it)");
  SUBSPACE_ASSIGN_OR_RETURN(name, String(*model, "model"));
  if (name != context.model_id) {
    absl::Status status = absl::NotFoundError(
        absl::StrCat("the model '", ToValidUtf8(name.substr(0, 128)),
                     "' does not exist; this server serves '", context.model_id, "'"));
    status.SetPayload(kCodePayload, absl::Cord(std::string("model_not_found")));
    return status;
  }
  return absl::OkStatus();
}

// What both endpoints share: sampling, stop, streaming, the session and the features refused.
// `max_tokens_default`: the OpenAI default of the endpoint.
absl::Status ParseCommon(Fields& f, bool chat, v1::SamplingParams* sampling,
                         std::string* session_id, bool* stream, bool* include_usage,
                         uint32_t max_tokens_default) {
  // The length limit: max_completion_tokens (chat, newer clients) or max_tokens.
  const Json* max_tokens = f.Get("max_tokens");
  const Json* max_completion = chat ? f.Get("max_completion_tokens") : nullptr;
  if (max_tokens != nullptr && max_completion != nullptr) {
    return InvalidAt("max_tokens", "set max_tokens or max_completion_tokens, not both");
  }
  if (const Json* m = max_completion != nullptr ? max_completion : max_tokens; m != nullptr) {
    const char* name = max_completion != nullptr ? "max_completion_tokens" : "max_tokens";
    // 0 only prefills a session (the shared validation refuses it without one).
    SUBSPACE_ASSIGN_OR_RETURN(v, Int(*m, name, 0, std::numeric_limits<int32_t>::max()));
    sampling->set_max_new_tokens(static_cast<uint32_t>(v));
  } else {
    sampling->set_max_new_tokens(max_tokens_default);
  }
  // OpenAI samples at temperature 1 unless told otherwise (the gRPC API's default is greedy).
  sampling->set_temperature(1.0f);
  if (const Json* t = f.Get("temperature")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Float(*t, "temperature"));
    sampling->set_temperature(v);
  }
  if (const Json* p = f.Get("top_p")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Float(*p, "top_p"));
    sampling->set_top_p(v);
  }
  if (const Json* s = f.Get("seed")) {
    if (!s->is_number_integer())
      return InvalidAt("seed", "seed must be an integer, got ", s->type_name());
    // Negative seeds are fine: the bits are the seed.
    sampling->set_seed(s->is_number_unsigned() ? s->get<uint64_t>()
                                               : static_cast<uint64_t>(s->get<int64_t>()));
  }
  if (const Json* stop = f.Get("stop")) {
    if (stop->is_string()) {
      sampling->add_stop(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (size_t i = 0; i < stop->size(); ++i) {
        SUBSPACE_ASSIGN_OR_RETURN(s, String((*stop)[i], absl::StrCat("stop[", i, "]")));
        if (s.empty())
          return InvalidAt(absl::StrCat("stop[", i, "]"), "stop[", i, "] must not be empty");
        sampling->add_stop(std::move(s));
      }
    } else {
      return InvalidAt("stop", "stop must be a string or an array of strings, got ",
                       stop->type_name());
    }
  }
  // Extensions with the gRPC API's meaning.
  if (const Json* k = f.Get("top_k")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Int(*k, "top_k", 0, std::numeric_limits<int32_t>::max()));
    sampling->set_top_k(static_cast<int32_t>(v));
  }
  if (const Json* m = f.Get("min_p")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Float(*m, "min_p"));
    sampling->set_min_p(v);
  }
  if (const Json* r = f.Get("repetition_penalty")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Float(*r, "repetition_penalty"));
    sampling->set_repetition_penalty(v);
  }
  if (const Json* e = f.Get("ignore_eos")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Bool(*e, "ignore_eos"));
    sampling->set_ignore_eos(v);
  }
  if (const Json* s = f.Get("session_id")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, String(*s, "session_id"));
    *session_id = std::move(v);
  }

  if (const Json* s = f.Get("stream")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Bool(*s, "stream"));
    *stream = v;
  }
  if (const Json* o = f.Get("stream_options")) {
    if (!*stream)
      return InvalidAt("stream_options", "stream_options is only allowed when stream is true");
    if (!o->is_object()) {
      return InvalidAt("stream_options", "stream_options must be an object, got ", o->type_name());
    }
    Fields options(*o, "stream_options.");
    if (const Json* u = options.Get("include_usage")) {
      SUBSPACE_ASSIGN_OR_RETURN(v, Bool(*u, "stream_options.include_usage"));
      *include_usage = v;
    }
    // continuous_usage_stats and the like: not here.
    if (absl::Status s = options.CheckNoneUnknown(); !s.ok()) return s;
  }

  // One choice per request.
  if (const Json* n = f.Get("n")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Int(*n, "n", 1, std::numeric_limits<int32_t>::max()));
    if (v != 1) return NotSupported("n", "one choice per request (n = 1)");
  }
  for (const char* penalty : {"presence_penalty", "frequency_penalty"}) {
    if (const Json* p = f.Get(penalty)) {
      SUBSPACE_ASSIGN_OR_RETURN(v, Float(*p, penalty));
      if (v != 0.0f) return NotSupported(penalty, "use repetition_penalty");
    }
  }
  if (const Json* b = f.Get("logit_bias")) {
    if (!b->is_object())
      return InvalidAt("logit_bias", "logit_bias must be an object, got ", b->type_name());
    if (!b->empty()) return NotSupported("logit_bias");
  }
  f.Get("user");  // an end-user id for abuse monitoring: accepted, not used
  return absl::OkStatus();
}

// The prompt of /v1/completions: a string, token ids, or a one-element array of either.
absl::Status ParsePrompt(const Json& prompt, v1::GenerateRequest* out) {
  const auto tokens = [&](const Json& ids, const std::string& path) -> absl::Status {
    for (size_t i = 0; i < ids.size(); ++i) {
      SUBSPACE_ASSIGN_OR_RETURN(
          id, Int(ids[i], absl::StrCat(path, "[", i, "]"), 0, std::numeric_limits<int32_t>::max()));
      out->mutable_tokens()->add_ids(static_cast<int32_t>(id));
    }
    if (ids.empty()) return InvalidAt(path, path, " must not be empty");
    return absl::OkStatus();
  };
  if (prompt.is_string()) {
    out->set_text(prompt.get<std::string>());
    return absl::OkStatus();
  }
  if (!prompt.is_array()) {
    return InvalidAt("prompt", "prompt must be a string or an array, got ", prompt.type_name());
  }
  if (prompt.empty()) return InvalidAt("prompt", "prompt must not be empty");
  if (prompt[0].is_number()) return tokens(prompt, "prompt");
  if (prompt.size() != 1) {
    return NotSupported("prompt", absl::StrCat("one prompt per request (got ", prompt.size(), ")"));
  }
  if (prompt[0].is_string()) {
    out->set_text(prompt[0].get<std::string>());
    return absl::OkStatus();
  }
  if (prompt[0].is_array()) return tokens(prompt[0], "prompt[0]");
  return InvalidAt("prompt[0]", "prompt[0] must be a string or an array of token ids, got ",
                   prompt[0].type_name());
}

absl::Status ParseMessages(const Json& messages, v1::ChatRequest* out) {
  if (!messages.is_array()) {
    return InvalidAt("messages", "messages must be an array, got ", messages.type_name());
  }
  if (messages.empty()) return InvalidAt("messages", "messages must not be empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string path = absl::StrCat("messages[", i, "]");
    const Json& m = messages[i];
    if (!m.is_object()) return InvalidAt(path, path, " must be an object, got ", m.type_name());
    Fields f(m, path + ".");
    v1::ChatMessage* message = out->add_messages();
    const Json* role = f.Get("role");
    if (role == nullptr) return InvalidAt(path + ".role", path, ".role is required");
    SUBSPACE_ASSIGN_OR_RETURN(r, String(*role, path + ".role"));
    // OpenAI's newer name for the system prompt.
    message->set_role(r == "developer" ? "system" : r);
    if (const Json* content = f.Get("content")) {
      if (content->is_string()) {
        message->set_content(content->get<std::string>());
      } else if (content->is_array()) {
        std::string text;
        for (size_t k = 0; k < content->size(); ++k) {
          const std::string part_path = absl::StrCat(path, ".content[", k, "]");
          const Json& part = (*content)[k];
          if (!part.is_object()) {
            return InvalidAt(part_path, part_path, " must be an object, got ", part.type_name());
          }
          Fields pf(part, part_path + ".");
          const Json* type = pf.Get("type");
          if (type == nullptr)
            return InvalidAt(part_path + ".type", part_path, ".type is required");
          SUBSPACE_ASSIGN_OR_RETURN(t, String(*type, part_path + ".type"));
          if (t != "text") {
            return NotSupported(part_path + ".type",
                                absl::StrCat("'", ToValidUtf8(t.substr(0, 32)),
                                             "' (this model reads text parts only)"));
          }
          const Json* part_text = pf.Get("text");
          if (part_text == nullptr)
            return InvalidAt(part_path + ".text", part_path, ".text is required");
          SUBSPACE_ASSIGN_OR_RETURN(s, String(*part_text, part_path + ".text"));
          text += s;
          if (absl::Status st = pf.CheckNoneUnknown(); !st.ok()) return st;
        }
        message->set_content(std::move(text));
      } else {
        return InvalidAt(path + ".content", path,
                         ".content must be a string or an array of parts, got ",
                         content->type_name());
      }
    } else if (r != "assistant") {
      return InvalidAt(path + ".content", path, ".content is required");
    }
    f.Get("name");  // a participant's name: accepted, not rendered
    for (const char* tool_field : {"tool_calls", "tool_call_id", "function_call"}) {
      if (f.Get(tool_field) != nullptr) return NotSupported(path + "." + tool_field);
    }
    if (absl::Status s = f.CheckNoneUnknown(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body,
                                                         const ApiContext& context) {
  SUBSPACE_ASSIGN_OR_RETURN(json, ParseObject(body));
  Fields f(json);
  if (absl::Status s = CheckModel(f, context); !s.ok()) return s;
  CompletionRequest out;
  const Json* prompt = f.Get("prompt");
  if (prompt == nullptr) return InvalidAt("prompt", "prompt is required");
  if (absl::Status s = ParsePrompt(*prompt, &out.request); !s.ok()) return s;
  // OpenAI's default for completions is 16 tokens.
  if (absl::Status s = ParseCommon(f, /*chat=*/false, out.request.mutable_sampling(),
                                   out.request.mutable_session_id(), &out.stream,
                                   &out.include_usage, /*max_tokens_default=*/16);
      !s.ok()) {
    return s;
  }
  if (const Json* l = f.Get("logprobs")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Int(*l, "logprobs", 0, 20));
    out.logprobs = static_cast<int>(v);
    out.request.mutable_sampling()->set_logprobs(static_cast<uint32_t>(v));
  }
  if (const Json* e = f.Get("echo")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Bool(*e, "echo"));
    if (v) return NotSupported("echo");
  }
  if (const Json* s = f.Get("suffix")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, String(*s, "suffix"));
    if (!v.empty()) return NotSupported("suffix");
  }
  if (const Json* b = f.Get("best_of")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Int(*b, "best_of", 1, std::numeric_limits<int32_t>::max()));
    if (v != 1) return NotSupported("best_of", "one candidate per request (best_of = 1)");
  }
  if (absl::Status s = f.CheckNoneUnknown(); !s.ok()) return s;
  return out;
}

absl::StatusOr<ChatCompletionRequest> ParseChatCompletionRequest(std::string_view body,
                                                                 const ApiContext& context) {
  SUBSPACE_ASSIGN_OR_RETURN(json, ParseObject(body));
  Fields f(json);
  if (absl::Status s = CheckModel(f, context); !s.ok()) return s;
  ChatCompletionRequest out;
  const Json* messages = f.Get("messages");
  if (messages == nullptr) return InvalidAt("messages", "messages is required");
  if (absl::Status s = ParseMessages(*messages, &out.request); !s.ok()) return s;
  // Chat has no length default: the answer runs to its end or the context's.
  if (absl::Status s =
          ParseCommon(f, /*chat=*/true, out.request.mutable_sampling(),
                      out.request.mutable_session_id(), &out.stream, &out.include_usage,
                      /*max_tokens_default=*/context.context_length);
      !s.ok()) {
    return s;
  }
  if (const Json* l = f.Get("logprobs")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Bool(*l, "logprobs"));
    out.logprobs = v;
  }
  if (const Json* t = f.Get("top_logprobs")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Int(*t, "top_logprobs", 0, 20));
    if (!out.logprobs) return InvalidAt("top_logprobs", "top_logprobs needs logprobs set to true");
    out.top_logprobs = static_cast<int>(v);
  }
  if (out.logprobs) {
    // The gRPC API computes logprobs when it is asked for alternatives; zero alternatives still
    // gives each token's own logprob.
    out.request.mutable_sampling()->set_logprobs(static_cast<uint32_t>(out.top_logprobs));
  }
  if (const Json* r = f.Get("response_format")) {
    if (!r->is_object()) {
      return InvalidAt("response_format", "response_format must be an object, got ",
                       r->type_name());
    }
    const auto type = r->find("type");
    if (type == r->end() || !type->is_string() || type->get<std::string>() != "text" ||
        r->size() != 1) {
      return NotSupported("response_format", "only {\"type\": \"text\"}");
    }
  }
  if (const Json* t = f.Get("tools")) {
    if (!t->is_array() || !t->empty()) return NotSupported("tools");
  }
  if (const Json* t = f.Get("tool_choice")) {
    if (!t->is_string() || t->get<std::string>() != "none") return NotSupported("tool_choice");
  }
  f.Get("parallel_tool_calls");  // meaningless without tools
  if (const Json* a = f.Get("add_generation_prompt")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Bool(*a, "add_generation_prompt"));
    out.request.set_add_generation_prompt(v);
  }
  if (const Json* k = f.Get("chat_template_kwargs")) {
    if (!k->is_object()) {
      return InvalidAt("chat_template_kwargs", "chat_template_kwargs must be an object, got ",
                       k->type_name());
    }
    for (auto it = k->begin(); it != k->end(); ++it) {
      if (it->is_structured()) {
        const std::string param =
            absl::StrCat("chat_template_kwargs.", ToValidUtf8(it.key().substr(0, 64)));
        return InvalidAt(param, param, " must be a string, number, boolean or null");
      }
      (*out.request.mutable_template_kwargs())[it.key()] = Dump(*it);
    }
  }
  if (absl::Status s = f.CheckNoneUnknown(); !s.ok()) return s;
  return out;
}

absl::StatusOr<SessionCreateRequest> ParseSessionCreateRequest(std::string_view body) {
  SessionCreateRequest out;
  if (body.empty()) return out;
  SUBSPACE_ASSIGN_OR_RETURN(json, ParseObject(body));
  Fields f(json);
  if (const Json* t = f.Get("ttl_seconds")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, Int(*t, "ttl_seconds", 0, std::numeric_limits<uint32_t>::max()));
    out.idle_ttl_seconds = static_cast<uint32_t>(v);
  }
  if (const Json* s = f.Get("session_id")) {
    SUBSPACE_ASSIGN_OR_RETURN(v, String(*s, "session_id"));
    out.session_id = std::move(v);
  }
  if (absl::Status s = f.CheckNoneUnknown(); !s.ok()) return s;
  return out;
}

namespace {

// `to` with every payload of `from` (the param, the error code).
absl::Status KeepPayloads(const absl::Status& from, absl::Status to) {
  from.ForEachPayload(
      [&to](auto type_url, const absl::Cord& payload) { to.SetPayload(type_url, payload); });
  return to;
}

}  // namespace

absl::Status RenameFields(const absl::Status& status, bool chat) {
  if (status.ok()) return status;
  std::string message(status.message());
  // Longest first: "sampling.max_new_tokens" before "sampling.".
  static constexpr std::pair<std::string_view, std::string_view> kGenerate[] = {
      {"sampling.max_new_tokens", "max_tokens"},
      {"sampling.logprobs", "logprobs"},
      {"sampling.", ""},
      {"tokens.ids", "prompt"},
      {"text encodes", "prompt encodes"},
      {"text ", "prompt "},
  };
  static constexpr std::pair<std::string_view, std::string_view> kChat[] = {
      {"sampling.max_new_tokens", "max_tokens"},
      {"sampling.logprobs", "top_logprobs"},
      {"sampling.", ""},
      {"template_kwargs", "chat_template_kwargs"},
  };
  using Renames = std::span<const std::pair<std::string_view, std::string_view>>;
  for (const auto& [from, to] : chat ? Renames(kChat) : Renames(kGenerate)) {
    if (message.compare(0, from.size(), from) == 0) {
      message = std::string(to) + message.substr(from.size());
      // The message starts with the field it is about ("top_p must be ...", "prompt[3] must
      // be ..."): that is the error's param.
      const std::string param = message.substr(0, message.find(' '));
      return WithParam(KeepPayloads(status, absl::Status(status.code(), message)), param);
    }
  }
  return KeepPayloads(status, absl::Status(status.code(), message));
}

}  // namespace subspace::server::openai
