// Fuzzes the HTTP API's request bodies: any bytes as a /v1/completions and a
// /v1/chat/completions body (openai_api.h), then -- when they parse -- through the gRPC API's
// validation and conversion the server runs next, against the default model. A parse error must
// be INVALID_ARGUMENT or NOT_FOUND (another model) with a message; every error body the server
// would write must be valid JSON; what is accepted, the engine's own sampling check must accept.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/model/sampler.h"
#include "fuzz/chatml_setup.h"
#include "fuzz/fuzz_util.h"
#include "nlohmann/json.hpp"
#include "server/chat_request.h"
#include "server/openai_api.h"
#include "server/request_validation.h"

namespace {

using namespace subspace;

void CheckRefusal(const absl::Status& status) {
  FUZZ_CHECK(absl::IsInvalidArgument(status) || absl::IsNotFound(status));
  FUZZ_CHECK(!status.message().empty());
  // The error body echoes client bytes: it must still be JSON.
  const nlohmann::json body = nlohmann::json::parse(server::openai::ErrorJson(status), nullptr,
                                                    /*allow_exceptions=*/false);
  FUZZ_CHECK(!body.is_discarded());
  FUZZ_CHECK(body["error"]["message"].is_string());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fuzz::FuzzModel& model = fuzz::DefaultModel();
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  const server::RequestLimits limits;
  const server::openai::ApiContext context{
      .model_id = "m", .context_length = static_cast<uint32_t>(model.config.context_length)};

  const absl::StatusOr<server::openai::CompletionRequest> completion =
      server::openai::ParseCompletionRequest(body, context);
  if (!completion.ok()) {
    CheckRefusal(completion.status());
  } else {
    const absl::StatusOr<server::ValidGenerateRequest> valid =
        server::ValidateGenerateRequest(completion->request, model.config, limits);
    if (!valid.ok()) {
      CheckRefusal(server::openai::RenameFields(valid.status(), /*chat=*/false));
    } else {
      absl::StatusOr<GenerateRequest> converted =
          server::ToEngineRequest(*valid, *model.tokenizer, model.config, limits, false);
      if (converted.ok()) {
        FUZZ_CHECK(ValidateSamplingParams(converted->sampling).ok());
      } else {
        CheckRefusal(converted.status());
      }
    }
  }

  const absl::StatusOr<server::openai::ChatCompletionRequest> chat =
      server::openai::ParseChatCompletionRequest(body, context);
  if (!chat.ok()) {
    CheckRefusal(chat.status());
  } else {
    const absl::StatusOr<server::ValidChatRequest> valid =
        server::ValidateChatRequest(chat->request, limits);
    if (!valid.ok()) {
      CheckRefusal(server::openai::RenameFields(valid.status(), /*chat=*/true));
    } else {
      absl::StatusOr<GenerateRequest> converted = server::ChatToEngineRequest(
          *valid, fuzz::ChatMlSetup(), *model.tokenizer, model.config, limits);
      if (converted.ok()) {
        FUZZ_CHECK(!converted->prompt.empty());
        FUZZ_CHECK(ValidateSamplingParams(converted->sampling).ok());
      } else {
        FUZZ_CHECK(absl::IsInvalidArgument(converted.status()) ||
                   absl::IsFailedPrecondition(converted.status()));
      }
    }
  }

  const absl::StatusOr<server::openai::SessionCreateRequest> session =
      server::openai::ParseSessionCreateRequest(body);
  if (!session.ok()) CheckRefusal(session.status());
  return 0;
}
