// Bearer-token authentication of the Subspace RPCs: the tokens file, the check of a call's
// `authorization: Bearer <token>` header, and the principal a token stands for (the owner of
// the sessions its calls create). Health and reflection are other services and never ask.
#ifndef SUBSPACE_SERVER_AUTH_H_
#define SUBSPACE_SERVER_AUTH_H_

#include <grpcpp/server_context.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace subspace::server {

// Tokens shorter than this are refused at start: a token is the whole secret.
inline constexpr size_t kMinAuthTokenBytes = 16;

class Authenticator {
 public:
  // Authentication off: every call is the anonymous principal "".
  Authenticator() = default;

  // The tokens of `path`, one per line; surrounding whitespace is trimmed and blank lines and
  // lines starting with '#' are skipped. INVALID_ARGUMENT, naming --auth-tokens, for a file that
  // cannot be read or holds no token, and for a token that is shorter than kMinAuthTokenBytes,
  // holds a byte outside printable ASCII or a space, or repeats an earlier one (by line).
  static absl::StatusOr<Authenticator> FromFile(const std::string& path);
  // As FromFile, plus the operator tokens of `operator_path` (same format, --operator-tokens):
  // bearer tokens like the others whose principal may also list, read, export, import and
  // delete every principal's sessions (session_access.h), to move sessions off a replica. A
  // token in both files is refused (it would be two principals).
  static absl::StatusOr<Authenticator> FromFiles(const std::string& path,
                                                 const std::string& operator_path);

  bool enabled() const { return !digests_.empty(); }
  // Whether `principal` (as Authenticate returns it) is an operator token's.
  bool IsOperator(std::string_view principal) const;

  // The principal of a call carrying `authorization` (nullopt: no such header). With
  // authentication off, "" for every call. Otherwise UNAUTHENTICATED for a missing header, one
  // that is not "Bearer <token>", or an unknown token. The presented token is hashed and its
  // digest compared in constant time with every configured one, without stopping at a match,
  // so the time taken says nothing about how close a guess came or which token matched.
  absl::StatusOr<std::string> Authenticate(std::optional<std::string_view> authorization) const;
  // As above, on the call's `authorization` metadata.
  absl::StatusOr<std::string> Authenticate(const grpc::ServerContextBase& context) const;

 private:
  using Digest = std::array<uint8_t, 32>;  // SHA-256
  Authenticator(std::vector<Digest> digests, std::vector<std::string> operators)
      : digests_(std::move(digests)), operators_(std::move(operators)) {}

  std::vector<Digest> digests_;         // one per configured token, in file order
  std::vector<std::string> operators_;  // the operator tokens' principals
};

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_AUTH_H_
