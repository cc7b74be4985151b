// A model's chat template (`tokenizer.chat_template` in its GGUF, or a file given with
// --chat-template) applied to a conversation, as HF transformers' apply_chat_template does:
// the template sees `messages` (dicts with "role" and "content"), `add_generation_prompt`,
// `bos_token`, `eos_token` and any extra variables (Qwen3's `enable_thinking`).
#ifndef SUBSPACE_CORE_CHAT_CHAT_TEMPLATE_H_
#define SUBSPACE_CORE_CHAT_CHAT_TEMPLATE_H_

#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/chat/jinja.h"

namespace subspace {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" or "tool"
  std::string content;
};

struct ChatTemplateInputs {
  bool add_generation_prompt = true;
  std::string bos_token;
  std::string eos_token;
  // Further template variables, e.g. {"enable_thinking", Bool(false)}.
  std::vector<std::pair<std::string, jinja::Value>> extra;
};

class ChatTemplate {
 public:
  // FAILED_PRECONDITION naming the construct (and line) when the template uses something the
  // renderer does not implement or is malformed: the server then refuses chat rather than
  // build a prompt the model was not trained on.
  static absl::StatusOr<ChatTemplate> Parse(std::string_view source);

  // The prompt text. INVALID_ARGUMENT when the template rejects the conversation
  // (raise_exception: "roles must alternate", "system role not supported", ...) with its
  // message; FAILED_PRECONDITION when rendering hits something outside the subset.
  absl::StatusOr<std::string> Apply(std::span<const ChatMessage> messages,
                                    const ChatTemplateInputs& inputs) const;

  const std::string& source() const { return source_; }

 private:
  ChatTemplate(std::string source, std::shared_ptr<const jinja::Template> t)
      : source_(std::move(source)), template_(std::move(t)) {}
  std::string source_;
  std::shared_ptr<const jinja::Template> template_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_CHAT_CHAT_TEMPLATE_H_
