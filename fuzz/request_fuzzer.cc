// Fuzzes request validation: any bytes parsed as a subspace.v1.GenerateRequest go through
// ValidateGenerateRequest and ToEngineRequest against the default model, as the service does;
// bytes that do not parse go through DiagnoseUnparsable, which must name an error. The same
// bytes parsed as a ChatRequest go through ChatToEngineRequest with a ChatML template.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz/fuzz_util.h"
#include "proto/subspace.pb.h"
#include "server/chat_request.h"
#include "server/request_validation.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace subspace;
  const fuzz::FuzzModel& model = fuzz::DefaultModel();
  const std::string_view wire(reinterpret_cast<const char*>(data), size);
  const server::RequestLimits limits;

  // The UTF-8 helpers see client bytes too.
  const std::string fixed = server::ToValidUtf8(std::string(wire));
  FUZZ_CHECK(fuzz::IsValidUtf8(fixed));
  FUZZ_CHECK(server::ValidUtf8Prefix(fixed) == fixed.size());
  FUZZ_CHECK(server::ValidUtf8Prefix(wire) <= wire.size());
  if (fuzz::IsValidUtf8(wire)) FUZZ_CHECK(fixed == wire);

  v1::ChatRequest chat;
  if (chat.ParseFromArray(data, static_cast<int>(size))) {
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
    const absl::Status chat_valid = server::ValidateChatRequest(chat, limits);
    absl::StatusOr<GenerateRequest> converted =
        server::ChatToEngineRequest(chat, *setup, *model.tokenizer, model.config, limits);
    if (!chat_valid.ok()) FUZZ_CHECK(!converted.ok());
    if (converted.ok()) {
      FUZZ_CHECK(!converted->prompt.empty());
      for (int32_t id : converted->prompt) FUZZ_CHECK(id >= 0 && id < model.config.n_vocab);
      FUZZ_CHECK(converted->prompt_replaces_history == !chat.session_id().empty());
    } else {
      FUZZ_CHECK(absl::IsInvalidArgument(converted.status()) ||
                 absl::IsFailedPrecondition(converted.status()));
    }
  }

  v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) {
    FUZZ_CHECK(!server::DiagnoseUnparsable(wire, *v1::GenerateRequest::descriptor()).ok());
    return 0;
  }
  const absl::Status valid = server::ValidateGenerateRequest(request, model.config, limits);
  for (bool continues : {false, true}) {
    absl::StatusOr<GenerateRequest> converted =
        server::ToEngineRequest(request, *model.tokenizer, model.config, limits, continues);
    // Conversion validates first: it may fail where validation passed (e.g. a prompt that
    // encodes to nothing), never succeed where validation failed.
    if (!valid.ok()) FUZZ_CHECK(!converted.ok());
    if (converted.ok()) {
      for (int32_t id : converted->prompt) FUZZ_CHECK(id >= 0 && id < model.config.n_vocab);
    }
  }
  return 0;
}
