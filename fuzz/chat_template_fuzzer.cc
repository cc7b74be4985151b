// Fuzzes the chat-template interpreter: any bytes as a template either fail to parse with a
// status or render a fixed conversation to a status or a string, within the renderer's step
// and output budget (libFuzzer's -timeout catches a hang, ASan a stack overflow from nesting).
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/chat/chat_template.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace subspace;
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Parse(source);
  if (!t.ok()) {
    FUZZ_CHECK(absl::IsFailedPrecondition(t.status()));
    return 0;
  }
  const std::vector<ChatMessage> messages = {
      {"system", "Be brief."}, {"user", "Hello {{ x }}"}, {"assistant", "Hi!"}, {"user", "Bye"}};
  for (bool generation : {true, false}) {
    absl::StatusOr<std::string> out = t->Apply(
        messages, {.add_generation_prompt = generation, .bos_token = "<s>", .eos_token = "</s>"});
    if (!out.ok()) {
      FUZZ_CHECK(absl::IsInvalidArgument(out.status()) || absl::IsFailedPrecondition(out.status()));
    }
  }
  return 0;
}
