#include "core/chat/chat_template.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace subspace {

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  absl::StatusOr<jinja::Template> t = jinja::Template::Parse(source);
  if (!t.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the chat template cannot be rendered: ", t.status().message()));
  }
  return ChatTemplate(std::string(source), std::make_shared<const jinja::Template>(*std::move(t)));
}

absl::StatusOr<std::string> ChatTemplate::Apply(std::span<const ChatMessage> messages,
                                                const ChatTemplateInputs& inputs) const {
  jinja::List list;
  list.reserve(messages.size());
  for (const ChatMessage& m : messages) {
    list.push_back(jinja::Value::MakeDict(
        {{"role", jinja::Value::String(m.role)}, {"content", jinja::Value::String(m.content)}}));
  }
  jinja::Dict context = {
      {"messages", jinja::Value::MakeList(std::move(list))},
      {"add_generation_prompt", jinja::Value::Bool(inputs.add_generation_prompt)},
      {"bos_token", jinja::Value::String(inputs.bos_token)},
      {"eos_token", jinja::Value::String(inputs.eos_token)},
  };
  for (const auto& kv : inputs.extra) context.push_back(kv);
  absl::StatusOr<std::string> out = template_->Render(jinja::Value::MakeDict(std::move(context)));
  if (out.ok()) return out;
  if (absl::IsAborted(out.status())) {
    return absl::InvalidArgumentError(
        absl::StrCat("the chat template rejects the conversation: ", out.status().message()));
  }
  return absl::FailedPreconditionError(
      absl::StrCat("the chat template cannot be rendered: ", out.status().message()));
}

}  // namespace subspace
