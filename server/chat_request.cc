#include "server/chat_request.h"

#include <charconv>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace subspace::server {
namespace {

template <typename... Args>
absl::Status Invalid(const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(args...));
}

// A JSON scalar: true, false, null, a number or a double-quoted string.
absl::StatusOr<jinja::Value> ParseJsonScalar(const std::string& text) {
  if (text == "true") return jinja::Value::Bool(true);
  if (text == "false") return jinja::Value::Bool(false);
  if (text == "null") return jinja::Value::None();
  if (text.size() >= 2 && text.front() == '"' && text.back() == '"') {
    std::string out;
    for (size_t i = 1; i + 1 < text.size(); ++i) {
      char c = text[i];
      if (c == '"') return absl::InvalidArgumentError("unescaped '\"' inside the string");
      if (c == '\\') {
        if (i + 2 >= text.size()) return absl::InvalidArgumentError("dangling backslash");
        switch (text[++i]) {
          case '"':
            c = '"';
            break;
          case '\\':
            c = '\\';
            break;
          case '/':
            c = '/';
            break;
          case 'n':
            c = '\n';
            break;
          case 't':
            c = '\t';
            break;
          case 'r':
            c = '\r';
            break;
          default:
            return absl::InvalidArgumentError(
                "only \\\" \\\\ \\/ \\n \\t \\r escapes are accepted");
        }
      }
      out.push_back(c);
    }
    return jinja::Value::String(std::move(out));
  }
  int64_t i = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), i);
  if (ec == std::errc() && p == text.data() + text.size() && !text.empty()) {
    return jinja::Value::Int(i);
  }
  double d = 0;
  auto [q, ec2] = std::from_chars(text.data(), text.data() + text.size(), d);
  if (ec2 == std::errc() && q == text.data() + text.size() && !text.empty()) {
    return jinja::Value::Float(d);
  }
  return absl::InvalidArgumentError(
      "must be a JSON scalar: true, false, null, a number or a \"quoted string\"");
}

bool ValidKwargName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  }
  return !std::isdigit(static_cast<unsigned char>(name[0]));
}

}  // namespace

absl::StatusOr<ChatSetup> LoadChatSetup(const std::string& path, const GgufFile& gguf) {
  ChatSetup setup;
  if (!path.empty()) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return Invalid("--chat-template ", path, ": cannot be read");
    std::stringstream text;
    text << in.rdbuf();
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(text.str());
    if (!t.ok()) return Invalid("--chat-template ", path, ": ", t.status().message());
    setup.chat_template = std::make_shared<const ChatTemplate>(*std::move(t));
    setup.source = "file";
    return setup;
  }
  absl::StatusOr<std::string> stored = gguf.GetString("tokenizer.chat_template");
  if (!stored.ok()) {
    setup.unavailable = absl::FailedPreconditionError(
        "the model has no chat template (tokenizer.chat_template); start the server with "
        "--chat-template FILE, or use Generate");
    return setup;
  }
  setup.source = "gguf";
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(*stored);
  if (!t.ok()) {
    setup.unavailable = absl::FailedPreconditionError(
        absl::StrCat("the model's tokenizer.chat_template: ", t.status().message(),
                     "; start the server with --chat-template FILE"));
    return setup;
  }
  setup.chat_template = std::make_shared<const ChatTemplate>(*std::move(t));
  return setup;
}

absl::StatusOr<ValidChatRequest> ValidateChatRequest(const v1::ChatRequest& request,
                                                     const RequestLimits& limits) {
  if (request.messages().empty()) return Invalid("messages must not be empty");
  if (request.messages_size() > kMaxChatMessages) {
    return Invalid("messages has ", request.messages_size(), " entries, more than ",
                   kMaxChatMessages);
  }
  int64_t bytes = 0;
  for (int i = 0; i < request.messages_size(); ++i) {
    const v1::ChatMessage& m = request.messages(i);
    if (m.role() != "system" && m.role() != "user" && m.role() != "assistant" &&
        m.role() != "tool") {
      return Invalid("messages[", i, "].role must be system, user, assistant or tool, got '",
                     m.role().substr(0, 32), "'");
    }
    if (ValidUtf8Prefix(m.content()) != m.content().size()) {
      return Invalid("messages[", i, "].content is not valid UTF-8");
    }
    bytes += static_cast<int64_t>(m.content().size());
  }
  if (bytes > limits.max_prompt_bytes) {
    return Invalid("messages hold ", bytes, " bytes of content, more than ",
                   limits.max_prompt_bytes);
  }
  for (const auto& [name, value] : request.template_kwargs()) {
    if (!ValidKwargName(name)) {
      return Invalid("template_kwargs: '", name.substr(0, 64),
                     "' is not a name (letters, digits, '_')");
    }
    if (name == "messages" || name == "add_generation_prompt" || name == "bos_token" ||
        name == "eos_token") {
      return Invalid("template_kwargs[", name, "] is set by the server");
    }
    if (absl::StatusOr<jinja::Value> v = ParseJsonScalar(value); !v.ok()) {
      return Invalid("template_kwargs[", name, "] ", v.status().message());
    }
  }
  if (!request.session_id().empty()) {
    if (absl::Status s = ValidateId(request.session_id(), "session_id", limits); !s.ok()) return s;
  }
  if (!request.request_id().empty()) {
    if (absl::Status s = ValidateId(request.request_id(), "request_id", limits); !s.ok()) return s;
  }
  return ValidChatRequest(request);
}

absl::StatusOr<GenerateRequest> ChatToEngineRequest(const ValidChatRequest& valid,
                                                    const ChatSetup& chat,
                                                    const Tokenizer& tokenizer,
                                                    const ModelConfig& model,
                                                    const RequestLimits& limits) {
  const v1::ChatRequest& request = valid.get();
  if (chat.chat_template == nullptr) return chat.unavailable;
  std::vector<ChatMessage> messages;
  messages.reserve(static_cast<size_t>(request.messages_size()));
  for (const v1::ChatMessage& m : request.messages()) messages.push_back({m.role(), m.content()});
  ChatTemplateInputs inputs;
  inputs.add_generation_prompt =
      request.has_add_generation_prompt() ? request.add_generation_prompt() : true;
  if (tokenizer.bos_id() >= 0) inputs.bos_token = tokenizer.piece(tokenizer.bos_id());
  if (tokenizer.eos_id() >= 0) inputs.eos_token = tokenizer.piece(tokenizer.eos_id());
  for (const auto& [name, value] : request.template_kwargs()) {
    inputs.extra.emplace_back(name, *ParseJsonScalar(value));
  }
  absl::StatusOr<std::string> prompt = chat.chat_template->Apply(messages, inputs);
  if (!prompt.ok()) return prompt.status();
  // The template writes the special tokens (and BOS, where it wants one) as text.
  std::vector<int32_t> ids = tokenizer.Encode(*prompt, {.add_bos = false, .parse_special = true});
  if (ids.empty()) return Invalid("messages render to an empty prompt");
  if (static_cast<int64_t>(ids.size()) >= model.context_length) {
    return Invalid("messages render to ", ids.size(), " tokens, more than the context length ",
                   model.context_length, " leaves room for");
  }
  v1::GenerateRequest generate;
  generate.mutable_tokens()->mutable_ids()->Add(ids.begin(), ids.end());
  generate.set_session_id(request.session_id());
  generate.set_request_id(request.request_id());
  if (request.has_sampling()) *generate.mutable_sampling() = request.sampling();
  // The generate request checks the sampling fields (the chat check leaves them to it).
  absl::StatusOr<ValidGenerateRequest> valid_generate =
      ValidateGenerateRequest(generate, model, limits);
  if (!valid_generate.ok()) return valid_generate.status();
  absl::StatusOr<GenerateRequest> out =
      ToEngineRequest(*valid_generate, tokenizer, model, limits, /*continues_session=*/false);
  if (!out.ok()) return out.status();
  out->prompt_replaces_history = !request.session_id().empty();
  return out;
}

}  // namespace subspace::server
