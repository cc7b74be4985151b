// From a parsed wire request to the engine's request, the same for both APIs (gRPC and the
// OpenAI-compatible HTTP one): the one validation, the session's existence for the caller, the
// tokenization or chat rendering, the owner and the deadline. The caller has authenticated the
// call and checked that the server is not draining.
#ifndef SUBSPACE_SERVER_PREPARE_REQUEST_H_
#define SUBSPACE_SERVER_PREPARE_REQUEST_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "proto/subspace.pb.h"
#include "server/chat_request.h"
#include "server/request_validation.h"

namespace subspace::server {

// INVALID_ARGUMENT naming the field (checked before the session, so a bad request is that
// whatever its session), NOT_FOUND for a session `caller` does not have, DEADLINE_EXCEEDED when
// `deadline` has passed.
absl::StatusOr<GenerateRequest> PrepareGenerate(const Engine& engine,
                                                const v1::GenerateRequest& request,
                                                const RequestLimits& limits, std::string caller,
                                                absl::Time deadline);

// The same for a chat; FAILED_PRECONDITION when the server has no usable chat template.
absl::StatusOr<GenerateRequest> PrepareChat(const Engine& engine, const v1::ChatRequest& request,
                                            const ChatSetup& chat, const RequestLimits& limits,
                                            std::string caller, absl::Time deadline);

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_PREPARE_REQUEST_H_
