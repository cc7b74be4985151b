// The Chat RPC's request: validated, its messages rendered with the model's chat template and
// encoded (special tokens parsed, no BOS added: the template writes what it wants), then made
// into the engine's request the way Generate's are. On a session the rendered conversation
// replaces the session's history, keeping the cache of the prefix the two share.
#ifndef SUBSPACE_SERVER_CHAT_REQUEST_H_
#define SUBSPACE_SERVER_CHAT_REQUEST_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/chat/chat_template.h"
#include "core/engine/engine.h"
#include "core/gguf/gguf.h"
#include "core/model/model_runner.h"
#include "core/tokenizer/tokenizer.h"
#include "proto/subspace.pb.h"
#include "server/request_validation.h"

namespace subspace::server {

// The server's chat template and where it came from.
struct ChatSetup {
  std::shared_ptr<const ChatTemplate> chat_template;  // null: Chat is unavailable
  std::string source;                                 // "gguf", "file" or "" (none)
  absl::Status unavailable;  // FAILED_PRECONDITION saying why, when chat_template is null
};

// `path` set: that file's template (INVALID_ARGUMENT when it cannot be read or rendered: the
// operator asked for it). Otherwise the GGUF's tokenizer.chat_template; one the renderer
// refuses leaves Chat unavailable with the reason, the rest of the server serving.
absl::StatusOr<ChatSetup> LoadChatSetup(const std::string& path, const GgufFile& gguf);

inline constexpr int kMaxChatMessages = 4096;

class ValidChatRequest;

// What needs no template: messages present (at most kMaxChatMessages), roles among system,
// user, assistant and tool, the content within max_prompt_bytes in all, template_kwargs names
// and JSON-scalar values, ids well-formed; INVALID_ARGUMENT naming the field otherwise. The one
// check of a wire request: its answer is the proof ChatToEngineRequest takes.
absl::StatusOr<ValidChatRequest> ValidateChatRequest(const v1::ChatRequest& request,
                                                     const RequestLimits& limits);

// A ChatRequest that ValidateChatRequest passed (only it makes one). It refers to the request,
// which must outlive it.
class ValidChatRequest {
 public:
  const v1::ChatRequest& get() const { return *request_; }

 private:
  friend absl::StatusOr<ValidChatRequest> ValidateChatRequest(const v1::ChatRequest& request,
                                                              const RequestLimits& limits);
  explicit ValidChatRequest(const v1::ChatRequest& request) : request_(&request) {}
  const v1::ChatRequest* request_;
};

// Renders, encodes and builds the engine request from a validated one (sampling as for
// Generate, checked in the generate request it becomes). FAILED_PRECONDITION when chat is
// unavailable or the template cannot be rendered; INVALID_ARGUMENT for bad sampling fields, a
// conversation the template rejects, or a prompt past the context.
absl::StatusOr<GenerateRequest> ChatToEngineRequest(const ValidChatRequest& valid,
                                                    const ChatSetup& chat,
                                                    const Tokenizer& tokenizer,
                                                    const ModelConfig& model,
                                                    const RequestLimits& limits);

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_CHAT_REQUEST_H_
