// Fuzzes request validation: any bytes parsed as a subspace.v1.GenerateRequest go through
// ValidateGenerateRequest and ToEngineRequest against the default model, as the service does;
// bytes that do not parse go through DiagnoseUnparsable, which must name an error. The same
// bytes parsed as a ChatRequest go through ChatToEngineRequest with a ChatML template.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/model/sampler.h"
#include "fuzz/chatml_setup.h"
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
    const server::ChatSetup* setup = &fuzz::ChatMlSetup();
    const absl::StatusOr<server::ValidChatRequest> chat_valid =
        server::ValidateChatRequest(chat, limits);
    if (!chat_valid.ok()) FUZZ_CHECK(absl::IsInvalidArgument(chat_valid.status()));
    absl::StatusOr<GenerateRequest> converted =
        chat_valid.ok() ? server::ChatToEngineRequest(*chat_valid, *setup, *model.tokenizer,
                                                      model.config, limits)
                        : chat_valid.status();
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
  const absl::StatusOr<server::ValidGenerateRequest> valid =
      server::ValidateGenerateRequest(request, model.config, limits);
  if (!valid.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(valid.status()));
    return 0;
  }
  for (bool continues : {false, true}) {
    // Conversion may still refuse what needs the tokenizer (a prompt that encodes to nothing);
    // what it builds, the engine's own check of the sampling parameters must accept.
    absl::StatusOr<GenerateRequest> converted =
        server::ToEngineRequest(*valid, *model.tokenizer, model.config, limits, continues);
    if (converted.ok()) {
      for (int32_t id : converted->prompt) FUZZ_CHECK(id >= 0 && id < model.config.n_vocab);
      FUZZ_CHECK(ValidateSamplingParams(converted->sampling).ok());
    } else {
      FUZZ_CHECK(absl::IsInvalidArgument(converted.status()));
    }
  }
  return 0;
}
