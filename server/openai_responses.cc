// OpenAI's JSON out: HTTP statuses and error bodies for a Status, whole answers, stream chunks,
// models and sessions; see openai_api.h. Every string goes through Dump (invalid bytes
// replaced), so no output can fail to serialize.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "server/openai_api.h"
#include "server/openai_json.h"
#include "server/request_validation.h"

namespace subspace::server::openai {

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAborted:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

namespace {

const char* ErrorType(int http_status) {
  switch (http_status) {
    case 401:
    case 403:
      return "authentication_error";
    case 429:
      return "rate_limit_error";
    case 503:
      return "service_unavailable";
    case 504:
      return "timeout";
    default:
      return http_status >= 500 ? "server_error" : "invalid_request_error";
  }
}

std::string ErrorJsonOf(int http_status, std::string_view message, std::string_view code,
                        std::string_view param = {}) {
  Json error = {{"message", std::string(message)},
                {"type", ErrorType(http_status)},
                {"param", param.empty() ? Json(nullptr) : Json(std::string(param))},
                {"code", code.empty() ? Json(nullptr) : Json(std::string(code))}};
  return Dump(Json{{"error", std::move(error)}});
}

}  // namespace

std::string ErrorJson(const absl::Status& status) {
  const int http = HttpStatusFor(status.code());
  std::string code;
  if (const auto named = status.GetPayload(kCodePayload); named.has_value()) {
    code = std::string(*named);
  } else if (http == 401) {
    code = "invalid_api_key";
  } else if (http == 429) {
    code = "rate_limit_exceeded";
  } else {
    code = absl::AsciiStrToLower(absl::StatusCodeToString(status.code()));
  }
  const auto param = status.GetPayload(kParamPayload);
  return ErrorJsonOf(http, std::string(status.message()), code,
                     param.has_value() ? std::string(*param) : std::string());
}

std::string ErrorJsonForHttpStatus(int http_status) {
  switch (http_status) {
    case 400:
      return ErrorJsonOf(400, "the HTTP request is malformed", "bad_request");
    case 404:
      return ErrorJsonOf(404,
                         "no such endpoint (see GET /v1/models, POST /v1/completions, "
                         "POST /v1/chat/completions)",
                         "not_found");
    case 405:
      return ErrorJsonOf(405, "method not allowed on this endpoint", "method_not_allowed");
    case 408:
      return ErrorJsonOf(408, "the request was not received in time", "request_timeout");
    case 413:
      return ErrorJsonOf(413, "the request body is larger than the server accepts",
                         "payload_too_large");
    case 414:
      return ErrorJsonOf(414, "the request URI is too long", "uri_too_long");
    case 431:
      return ErrorJsonOf(431, "the request headers are too large", "headers_too_large");
    default:
      return ErrorJsonOf(http_status, absl::StrCat("HTTP ", http_status), "");
  }
}

std::string_view FinishReasonString(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
    case FinishReason::kEos:
      return "stop";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kDeadline:
      return "deadline";
    case FinishReason::kNone:
      break;
  }
  return "stop";
}

namespace {

Json Bytes(std::string_view bytes) {
  Json out = Json::array();
  for (const char c : bytes) out.push_back(static_cast<int>(static_cast<unsigned char>(c)));
  return out;
}

// Chat's logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}.
Json ChatLogprobs(std::span<const GeneratedTokenEvent> tokens, const Tokenizer& tokenizer) {
  Json content = Json::array();
  for (const GeneratedTokenEvent& t : tokens) {
    const std::string& bytes = tokenizer.TokenToBytes(t.token);
    Json top = Json::array();
    for (const TokenLogprob& alt : t.top) {
      const std::string& alt_bytes = tokenizer.TokenToBytes(alt.token);
      top.push_back({{"token", ToValidUtf8(alt_bytes)},
                     {"logprob", alt.logprob},
                     {"bytes", Bytes(alt_bytes)}});
    }
    content.push_back({{"token", ToValidUtf8(bytes)},
                       {"logprob", t.logprob},
                       {"bytes", Bytes(bytes)},
                       {"top_logprobs", std::move(top)}});
  }
  return Json{{"content", std::move(content)}};
}

// Completions' logprobs: parallel arrays, text_offset counted from `offset` (the bytes of the
// answer before these tokens).
Json CompletionLogprobs(std::span<const GeneratedTokenEvent> tokens, int logprobs,
                        const Tokenizer& tokenizer, int64_t offset) {
  Json token_strings = Json::array();
  Json token_logprobs = Json::array();
  Json top_logprobs = Json::array();
  Json text_offset = Json::array();
  for (const GeneratedTokenEvent& t : tokens) {
    token_strings.push_back(ToValidUtf8(tokenizer.TokenToBytes(t.token)));
    token_logprobs.push_back(t.logprob);
    Json top = Json::object();
    for (size_t i = 0; i < t.top.size() && static_cast<int>(i) < logprobs; ++i) {
      top[ToValidUtf8(tokenizer.TokenToBytes(t.top[i].token))] = t.top[i].logprob;
    }
    top_logprobs.push_back(std::move(top));
    text_offset.push_back(offset);
    offset += static_cast<int64_t>(t.text.size());
  }
  return Json{{"tokens", std::move(token_strings)},
              {"token_logprobs", std::move(token_logprobs)},
              {"top_logprobs", std::move(top_logprobs)},
              {"text_offset", std::move(text_offset)}};
}

Json UsageJson(const GenerateUsage& usage) {
  return Json{{"prompt_tokens", usage.prompt_tokens},
              {"completion_tokens", usage.generated_tokens},
              {"total_tokens", usage.prompt_tokens + usage.generated_tokens},
              {"prompt_tokens_details", {{"cached_tokens", usage.reused_tokens}}}};
}

Json Envelope(const ResponseMeta& meta, std::string_view object) {
  Json out = {{"id", meta.id},
              {"object", std::string(object)},
              {"created", meta.created},
              {"model", meta.model},
              {"system_fingerprint", nullptr}};
  if (!meta.session_id.empty()) out["session_id"] = meta.session_id;
  return out;
}

std::string Event(const Json& j) { return absl::StrCat("data: ", Dump(j), "\n\n"); }

}  // namespace

std::string CompletionJson(const ResponseMeta& meta, std::string_view text,
                           std::span<const GeneratedTokenEvent> tokens, int logprobs,
                           FinishReason finish, const GenerateUsage& usage,
                           const Tokenizer& tokenizer) {
  Json out = Envelope(meta, "text_completion");
  Json choice = {{"index", 0},
                 {"text", ToValidUtf8(std::string(text))},
                 {"logprobs", logprobs >= 0 ? CompletionLogprobs(tokens, logprobs, tokenizer, 0)
                                            : Json(nullptr)},
                 {"finish_reason", FinishReasonString(finish)}};
  out["choices"] = Json::array({std::move(choice)});
  out["usage"] = UsageJson(usage);
  return Dump(out);
}

std::string ChatCompletionJson(const ResponseMeta& meta, std::string_view text,
                               std::span<const GeneratedTokenEvent> tokens, bool logprobs,
                               FinishReason finish, const GenerateUsage& usage,
                               const Tokenizer& tokenizer) {
  Json out = Envelope(meta, "chat.completion");
  Json choice = {{"index", 0},
                 {"message", {{"role", "assistant"}, {"content", ToValidUtf8(std::string(text))}}},
                 {"logprobs", logprobs ? ChatLogprobs(tokens, tokenizer) : Json(nullptr)},
                 {"finish_reason", FinishReasonString(finish)}};
  out["choices"] = Json::array({std::move(choice)});
  out["usage"] = UsageJson(usage);
  return Dump(out);
}

std::string CompletionChunk(const ResponseMeta& meta, std::string_view text,
                            std::span<const GeneratedTokenEvent> tokens, int logprobs,
                            std::optional<FinishReason> finish, bool include_usage,
                            const Tokenizer& tokenizer) {
  Json out = Envelope(meta, "text_completion");
  // text_offset restarts in each chunk: a client adds the text it already has.
  Json choice = {
      {"index", 0},
      {"text", ToValidUtf8(std::string(text))},
      {"logprobs", logprobs >= 0 && !tokens.empty()
                       ? CompletionLogprobs(tokens, logprobs, tokenizer, 0)
                       : Json(nullptr)},
      {"finish_reason", finish.has_value() ? Json(FinishReasonString(*finish)) : Json(nullptr)}};
  out["choices"] = Json::array({std::move(choice)});
  if (include_usage) out["usage"] = nullptr;
  return Event(out);
}

std::string ChatChunk(const ResponseMeta& meta, std::string_view text,
                      std::span<const GeneratedTokenEvent> tokens, bool logprobs, bool first,
                      std::optional<FinishReason> finish, bool include_usage,
                      const Tokenizer& tokenizer) {
  Json out = Envelope(meta, "chat.completion.chunk");
  Json delta = Json::object();
  if (first) delta["role"] = "assistant";
  if (!text.empty() || first) delta["content"] = ToValidUtf8(std::string(text));
  Json choice = {
      {"index", 0},
      {"delta", std::move(delta)},
      {"logprobs", logprobs && !tokens.empty() ? ChatLogprobs(tokens, tokenizer) : Json(nullptr)},
      {"finish_reason", finish.has_value() ? Json(FinishReasonString(*finish)) : Json(nullptr)}};
  out["choices"] = Json::array({std::move(choice)});
  if (include_usage) out["usage"] = nullptr;
  return Event(out);
}

std::string UsageChunk(const ResponseMeta& meta, bool chat, const GenerateUsage& usage) {
  Json out = Envelope(meta, chat ? "chat.completion.chunk" : "text_completion");
  out["choices"] = Json::array();
  out["usage"] = UsageJson(usage);
  return Event(out);
}

std::string ErrorChunk(const absl::Status& status) {
  return absl::StrCat("data: ", ErrorJson(status), "\n\n");
}

std::string ModelJson(std::string_view id, int64_t created) {
  return Dump(Json{{"id", std::string(id)},
                   {"object", "model"},
                   {"created", created},
                   {"owned_by", "subspace"}});
}

std::string ModelListJson(std::string_view id, int64_t created) {
  return Dump(
      Json{{"object", "list"}, {"data", Json::array({Json::parse(ModelJson(id, created))})}});
}

namespace {

Json SessionObject(const SessionInfo& session) {
  return Json{{"id", session.id},
              {"object", "session"},
              {"owner", session.owner},
              {"tokens", session.tokens},
              {"cached_tokens", session.cached_tokens},
              {"cache_location", CacheLocationName(session.cache_location)},
              {"ttl_seconds", absl::ToInt64Seconds(session.idle_ttl)},
              {"created", absl::ToUnixSeconds(session.created)},
              {"last_used", absl::ToUnixSeconds(session.last_used)},
              {"busy", session.busy}};
}

}  // namespace

std::string SessionJson(const SessionInfo& session) { return Dump(SessionObject(session)); }

std::string SessionListJson(const std::vector<SessionInfo>& sessions) {
  Json data = Json::array();
  for (const SessionInfo& s : sessions) data.push_back(SessionObject(s));
  return Dump(Json{{"object", "list"}, {"data", std::move(data)}});
}

#undef SUBSPACE_ASSIGN_OR_RETURN

}  // namespace subspace::server::openai
