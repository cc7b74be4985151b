// Turns wire requests into core requests. Every field is checked here, before the engine sees
// it, and a bad one gives INVALID_ARGUMENT whose message names the field and the value, e.g.
// "sampling.top_p must be in (0, 1], got 1.5".
#ifndef SUBSPACE_SERVER_REQUEST_VALIDATION_H_
#define SUBSPACE_SERVER_REQUEST_VALIDATION_H_

#include <google/protobuf/descriptor.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/tokenizer/tokenizer.h"
#include "proto/subspace.pb.h"

namespace subspace::server {

struct RequestLimits {
  int max_stop_sequences = 8;
  int max_stop_bytes = 256;  // per stop sequence
  int max_id_bytes = 128;    // request_id and session_id
  int64_t max_prompt_bytes = 1 << 20;
  int64_t max_session_ttl_seconds = 7 * 24 * 3600;
  int32_t default_max_new_tokens = 64;
};

// Length of the longest valid UTF-8 prefix of `text` (text.size() when all of it is valid).
// Rejects overlong forms, surrogates and code points past U+10FFFF, like RFC 3629.
size_t ValidUtf8Prefix(std::string_view text);

// `bytes` with every byte that is not part of a valid UTF-8 sequence replaced by U+FFFD, so it
// can go into a proto3 string field (protobuf refuses to parse one holding invalid UTF-8).
std::string ToValidUtf8(std::string bytes);

// Why `wire` does not parse as a `descriptor` message. protobuf refuses a proto3 string field
// holding invalid UTF-8 -- before any server code sees the request -- so this walks the raw
// fields and names the first such string at any depth: INVALID_ARGUMENT "sampling.stop[1] is not
// valid UTF-8 (bad byte at offset 3)". Bytes that are no protobuf at all get a generic message.
absl::Status DiagnoseUnparsable(std::string_view wire,
                                const google::protobuf::Descriptor& descriptor);

// request_id and session_id: 1..max_id_bytes printable ASCII bytes (they are logged and used as
// keys). `field` names the field in the message.
absl::Status ValidateId(std::string_view id, std::string_view field, const RequestLimits& limits);

// CreateSessionRequest.session_id when set (empty is fine: the server makes the id):
// kMinProposedSessionIdBytes..kMaxProposedSessionIdBytes characters from [A-Za-z0-9_-]. The
// minimum keeps ids long enough to hold 128 random bits in hex; the alphabet is safe in headers,
// logs and URLs. `field` names the field in the message.
inline constexpr int kMinProposedSessionIdBytes = 32;
inline constexpr int kMaxProposedSessionIdBytes = 64;
absl::Status ValidateProposedSessionId(std::string_view id, std::string_view field);

class ValidGenerateRequest;

// Everything in `request` that needs no tokenizer: the prompt is set and non-empty, text is valid
// UTF-8 within the size limit, token ids lie in [0, vocab), ids are well-formed and every
// sampling parameter is in range. The one check of a wire request: its answer is the proof
// ToEngineRequest takes.
absl::StatusOr<ValidGenerateRequest> ValidateGenerateRequest(const v1::GenerateRequest& request,
                                                             const ModelConfig& model,
                                                             const RequestLimits& limits);

// A GenerateRequest that ValidateGenerateRequest passed (only it makes one). It refers to the
// request, which must outlive it.
class ValidGenerateRequest {
 public:
  const v1::GenerateRequest& get() const { return *request_; }

 private:
  friend absl::StatusOr<ValidGenerateRequest> ValidateGenerateRequest(
      const v1::GenerateRequest& request, const ModelConfig& model, const RequestLimits& limits);
  explicit ValidGenerateRequest(const v1::GenerateRequest& request) : request_(&request) {}
  const v1::GenerateRequest* request_;
};

// Builds the core request from a validated one: encodes text (BOS when the tokenizer asks for
// one and the request starts a sequence rather than continuing a session that has tokens),
// fills the documented defaults, draws a seed when none is given and generates a request id
// when empty. INVALID_ARGUMENT only for what needs the tokenizer: text that encodes to no
// tokens or to more than the context. (The engine checks the sampling parameters again at
// Submit, as its own API: a drift between the two checks surfaces there.)
absl::StatusOr<GenerateRequest> ToEngineRequest(const ValidGenerateRequest& valid,
                                                const Tokenizer& tokenizer,
                                                const ModelConfig& model,
                                                const RequestLimits& limits,
                                                bool continues_session);

// A fresh request id: 16 hex digits, unique within the process.
std::string NewRequestId();

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_REQUEST_VALIDATION_H_
