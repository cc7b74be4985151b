// Whose sessions a call may manage. A principal manages its own sessions. An operator token's
// principal (--operator-tokens, auth.h) manages every principal's: it lists, reads, exports,
// imports and deletes them, so that an operator can move the sessions off a replica before
// draining it (docs/sessions.md); it generates only in its own. The gRPC service and the HTTP
// API both ask here.
#ifndef SUBSPACE_SERVER_SESSION_ACCESS_H_
#define SUBSPACE_SERVER_SESSION_ACCESS_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/engine/engine.h"
#include "core/engine/session_snapshot.h"

namespace subspace::server {

class SessionAccess {
 public:
  SessionAccess(std::string caller, bool is_operator)
      : caller_(std::move(caller)), operator_(is_operator) {}

  const std::string& caller() const { return caller_; }
  bool is_operator() const { return operator_; }

  // The owner to act as on session `id`: the caller, or for an operator the session's own
  // owner (the caller when there is no such session, so the call's NOT_FOUND is the usual one).
  std::string OwnerOf(const Engine& engine, std::string_view id) const;
  // The sessions listed: the caller's, or for an operator every principal's.
  std::vector<SessionInfo> List(const Engine& engine) const;
  // Whether the caller may import `image`'s session, which keeps the owner it has: its own, or
  // any for an operator. PERMISSION_DENIED otherwise.
  absl::Status CheckImport(const SessionImage& image) const;

 private:
  std::string caller_;
  bool operator_;
};

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_SESSION_ACCESS_H_
