// The OpenAI-compatible HTTP API's bodies, without any HTTP: a JSON request of
// /v1/completions or /v1/chat/completions parsed into the same wire messages the gRPC API takes
// (so both go through one validation, one chat template and one engine request), and the
// engine's tokens written back as OpenAI's JSON -- whole responses, stream chunks and errors.
// The shapes follow OpenAI's API reference; docs/http_api.md lists what is supported, the
// extensions (session_id, top_k, min_p, repetition_penalty, ignore_eos, chat_template_kwargs)
// and what is refused.
#ifndef SUBSPACE_SERVER_OPENAI_API_H_
#define SUBSPACE_SERVER_OPENAI_API_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/engine/engine.h"
#include "core/tokenizer/tokenizer.h"
#include "proto/subspace.pb.h"

namespace subspace::server::openai {

// Bodies nest no deeper than this (objects and arrays); deeper ones are refused before they are
// built, so no input can exhaust the stack.
inline constexpr int kMaxJsonDepth = 16;
// The status payload naming the request field an INVALID_ARGUMENT is about (a path such as
// "top_p" or "messages[2].content"), which ErrorJson writes as OpenAI's `param`.
inline constexpr char kParamPayload[] = "type.subspace.dev/openai-param";
// The status payload carrying OpenAI's error `code` where the status code alone does not say it
// ("model_not_found" for a NOT_FOUND about the model, not a session); ErrorJson writes it.
inline constexpr char kCodePayload[] = "type.subspace.dev/openai-code";

// What the parsers need of the server.
struct ApiContext {
  std::string model_id;  // the one id GET /v1/models lists; a request naming another is 404
  uint32_t context_length = 0;
};

// POST /v1/completions.
struct CompletionRequest {
  v1::GenerateRequest request;  // prompt, sampling and session as the gRPC API takes them
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  int logprobs = -1;           // alternatives per token in the answer's logprobs; -1: none
};

// POST /v1/chat/completions.
struct ChatCompletionRequest {
  v1::ChatRequest request;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;
  int top_logprobs = 0;
};

// INVALID_ARGUMENT naming the field for a body that is not a JSON object, a field of the wrong
// type or out of range, an unknown field and a feature this server does not have (n > 1, echo,
// tools...); NOT_FOUND for another model. Ranges the gRPC API shares (temperature, top_p, stop
// sequences...) are left to its validation: see RenameFields.
absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body,
                                                         const ApiContext& context);
absl::StatusOr<ChatCompletionRequest> ParseChatCompletionRequest(std::string_view body,
                                                                 const ApiContext& context);

// POST /v1/sessions (an extension): optional ttl_seconds and session_id.
struct SessionCreateRequest {
  uint32_t idle_ttl_seconds = 0;  // 0: the server's default
  std::string session_id;         // empty: the server draws one
};
absl::StatusOr<SessionCreateRequest> ParseSessionCreateRequest(std::string_view body);

// A status of the shared validation with its gRPC field names ("sampling.top_p must be...")
// given the names this API's clients sent ("top_p must be...").
absl::Status RenameFields(const absl::Status& status, bool chat);

// The HTTP status for a status code: 400 INVALID_ARGUMENT / OUT_OF_RANGE, 401 UNAUTHENTICATED,
// 403 PERMISSION_DENIED, 404 NOT_FOUND, 409 ALREADY_EXISTS / FAILED_PRECONDITION / ABORTED,
// 429 RESOURCE_EXHAUSTED, 499 CANCELLED, 501 UNIMPLEMENTED, 503 UNAVAILABLE, 504
// DEADLINE_EXCEEDED, 500 for the rest.
int HttpStatusFor(absl::StatusCode code);
// {"error": {"message", "type", "param", "code"}} for a non-OK status.
std::string ErrorJson(const absl::Status& status);
// The same for an HTTP status the library produced on its own (413, 400, 404 of a path...).
std::string ErrorJsonForHttpStatus(int http_status);

// What every answer of one request carries.
struct ResponseMeta {
  std::string id;  // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;
  std::string model;
  std::string session_id;  // echoed when set (an extension)
};

// OpenAI's finish_reason: "length" for the length limit, "stop" for a stop sequence or EOS.
std::string_view FinishReasonString(FinishReason reason);

// Whole answers.
std::string CompletionJson(const ResponseMeta& meta, std::string_view text,
                           std::span<const GeneratedTokenEvent> tokens, int logprobs,
                           FinishReason finish, const GenerateUsage& usage,
                           const Tokenizer& tokenizer);
std::string ChatCompletionJson(const ResponseMeta& meta, std::string_view text,
                               std::span<const GeneratedTokenEvent> tokens, bool logprobs,
                               FinishReason finish, const GenerateUsage& usage,
                               const Tokenizer& tokenizer);

// One server-sent event each ("data: {...}\n\n"). `finish` set: the chunk that ends the choice.
// `first` (chat): the delta opens with the assistant role. With include_usage every chunk carries
// "usage": null and UsageChunk follows the last.
std::string CompletionChunk(const ResponseMeta& meta, std::string_view text,
                            std::span<const GeneratedTokenEvent> tokens, int logprobs,
                            std::optional<FinishReason> finish, bool include_usage,
                            const Tokenizer& tokenizer);
std::string ChatChunk(const ResponseMeta& meta, std::string_view text,
                      std::span<const GeneratedTokenEvent> tokens, bool logprobs, bool first,
                      std::optional<FinishReason> finish, bool include_usage,
                      const Tokenizer& tokenizer);
std::string UsageChunk(const ResponseMeta& meta, bool chat, const GenerateUsage& usage);
// An error inside a stream whose 200 has been sent: the error object as an event.
std::string ErrorChunk(const absl::Status& status);
inline constexpr std::string_view kDoneEvent = "data: [DONE]\n\n";

// GET /v1/models and /v1/models/{id}.
std::string ModelJson(std::string_view id, int64_t created);
std::string ModelListJson(std::string_view id, int64_t created);
// A session as the extension's endpoints show it.
std::string SessionJson(const SessionInfo& session);
// GET /v1/sessions: {"object": "list", "data": [session...]}, the caller's sessions.
std::string SessionListJson(const std::vector<SessionInfo>& sessions);

}  // namespace subspace::server::openai

#endif  // SUBSPACE_SERVER_OPENAI_API_H_
