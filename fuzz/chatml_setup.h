// The chat setup the request fuzzers render conversations with: a ChatML template, parsed once.
#ifndef SUBSPACE_FUZZ_CHATML_SETUP_H_
#define SUBSPACE_FUZZ_CHATML_SETUP_H_

#include <memory>

#include "core/chat/chat_template.h"
#include "fuzz/fuzz_util.h"
#include "server/chat_request.h"

namespace subspace::fuzz {

inline const server::ChatSetup& ChatMlSetup() {
  static const server::ChatSetup* setup = [] {
    auto* s = new server::ChatSetup;
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}");
    FUZZ_CHECK(t.ok());
    s->chat_template = std::make_shared<const ChatTemplate>(*std::move(t));
    s->source = "file";
    return s;
  }();
  return *setup;
}

}  // namespace subspace::fuzz

#endif  // SUBSPACE_FUZZ_CHATML_SETUP_H_
