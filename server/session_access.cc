// SessionAccess: a call's principal against the sessions' owners.
#include "server/session_access.h"

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace subspace::server {

std::string SessionAccess::OwnerOf(const Engine& engine, std::string_view id) const {
  if (!operator_) return caller_;
  absl::StatusOr<std::string> owner = engine.SessionOwner(id);
  return owner.ok() ? *std::move(owner) : caller_;
}

std::vector<SessionInfo> SessionAccess::List(const Engine& engine) const {
  return operator_ ? engine.ListEverySession() : engine.ListSessions(caller_);
}

absl::Status SessionAccess::CheckImport(const SessionImage& image) const {
  if (operator_ || image.owner == caller_) return absl::OkStatus();
  return absl::PermissionDeniedError(
      "the snapshot's session belongs to another principal: import it with the credentials that "
      "created it, or an operator token's (--operator-tokens)");
}

}  // namespace subspace::server
