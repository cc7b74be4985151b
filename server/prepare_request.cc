// See prepare_request.h.
#include "server/prepare_request.h"

#include <utility>

#include "absl/time/clock.h"

namespace subspace::server {
namespace {

absl::StatusOr<GenerateRequest> Finish(absl::StatusOr<GenerateRequest> out, std::string caller,
                                       absl::Time deadline) {
  if (!out.ok()) return out.status();
  out->session_owner = std::move(caller);
  out->deadline = deadline;
  if (out->deadline <= absl::Now()) {
    return absl::DeadlineExceededError("the deadline passed before the request was scheduled");
  }
  return out;
}

}  // namespace

absl::StatusOr<GenerateRequest> PrepareGenerate(const Engine& engine,
                                                const v1::GenerateRequest& request,
                                                const RequestLimits& limits, std::string caller,
                                                absl::Time deadline) {
  const ModelConfig& model = engine.model_config();
  absl::StatusOr<ValidGenerateRequest> valid = ValidateGenerateRequest(request, model, limits);
  if (!valid.ok()) return valid.status();
  // A session with tokens continues its sequence, so its text gets no BOS.
  bool continues_session = false;
  if (!request.session_id().empty()) {
    absl::StatusOr<SessionInfo> session = engine.GetSession(request.session_id(), caller);
    if (!session.ok()) return session.status();
    continues_session = session->tokens > 0;
  }
  return Finish(ToEngineRequest(*valid, engine.tokenizer(), model, limits, continues_session),
                std::move(caller), deadline);
}

absl::StatusOr<GenerateRequest> PrepareChat(const Engine& engine, const v1::ChatRequest& request,
                                            const ChatSetup& chat, const RequestLimits& limits,
                                            std::string caller, absl::Time deadline) {
  absl::StatusOr<ValidChatRequest> valid = ValidateChatRequest(request, limits);
  if (!valid.ok()) return valid.status();
  if (!request.session_id().empty()) {
    absl::StatusOr<SessionInfo> session = engine.GetSession(request.session_id(), caller);
    if (!session.ok()) return session.status();
  }
  return Finish(
      ChatToEngineRequest(*valid, chat, engine.tokenizer(), engine.model_config(), limits),
      std::move(caller), deadline);
}

}  // namespace subspace::server
