// Authenticator: loading the tokens and checking a call's bearer token against them.
#include "server/auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace subspace::server {
namespace {

constexpr char kBearerPrefix[] = "bearer ";  // the scheme is case-insensitive (RFC 7235)
constexpr size_t kPrincipalBytes = 8;        // of the digest: 64 bits name a token well enough

std::array<uint8_t, 32> Sha256(absl::string_view bytes) {
  std::array<uint8_t, 32> digest;
  SHA256(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), digest.data());
  return digest;
}

// Never the token itself, so sessions can name their owner without keeping the secret: a
// prefix of its digest, the same whatever the token's line in the file.
std::string PrincipalOf(const std::array<uint8_t, 32>& digest) {
  constexpr char kHex[] = "0123456789abcdef";
  std::string out = "sha256:";
  for (size_t i = 0; i < kPrincipalBytes; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 0xF];
  }
  return out;
}

// Errors say where the bad token is, never what it is.
absl::Status CheckToken(absl::string_view token, absl::string_view where) {
  if (token.size() < kMinAuthTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": a token must be at least ", kMinAuthTokenBytes, " bytes, got ", token.size()));
  }
  for (char c : token) {
    if (c <= ' ' || c > '~') {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": a token may hold only printable ASCII without spaces (an HTTP header value)"));
    }
  }
  return absl::OkStatus();
}

// The tokens of one file (`flag` names it in messages) and their line numbers.
struct TokenLine {
  const char* flag;
  int line;
  std::string where;  // "FLAG: PATH line N"
};

absl::Status ReadTokens(const std::string& path, const char* flag, std::vector<std::string>* tokens,
                        std::vector<TokenLine>* where) {
  std::ifstream in(path);
  if (!in.is_open()) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  int line_number = 0;
  bool any = false;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    const absl::string_view token = absl::StripAsciiWhitespace(line);
    if (token.empty() || absl::StartsWith(token, "#")) continue;
    tokens->emplace_back(token);
    where->push_back({flag, line_number, absl::StrCat(flag, ": ", path, " line ", line_number)});
    any = true;
  }
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  if (!any) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": ", path, " holds no token (one per line; blank and '#' lines are skipped)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Authenticator> Authenticator::FromFile(const std::string& path) {
  return FromFiles(path, /*operator_path=*/"");
}

absl::StatusOr<Authenticator> Authenticator::FromFiles(const std::string& path,
                                                       const std::string& operator_path) {
  std::vector<std::string> tokens;
  std::vector<TokenLine> where;  // of each token, for the messages
  if (absl::Status s = ReadTokens(path, "--auth-tokens", &tokens, &where); !s.ok()) return s;
  const size_t first_operator = tokens.size();
  if (!operator_path.empty()) {
    if (absl::Status s = ReadTokens(operator_path, "--operator-tokens", &tokens, &where); !s.ok()) {
      return s;
    }
  }
  std::vector<Digest> digests;
  std::vector<std::string> operators;
  absl::flat_hash_map<std::string, size_t> seen;  // digest bytes -> index
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (absl::Status s = CheckToken(tokens[i], where[i].where); !s.ok()) return s;
    const Digest digest = Sha256(tokens[i]);
    const auto [it, inserted] = seen.try_emplace(std::string(digest.begin(), digest.end()), i);
    if (!inserted) {
      const TokenLine& earlier = where[it->second];
      return absl::InvalidArgumentError(
          absl::StrCat(where[i].where, ": the token repeats the one on ",
                       earlier.flag == where[i].flag ? "" : absl::StrCat(earlier.flag, "'s "),
                       "line ", earlier.line));
    }
    digests.push_back(digest);
    if (i >= first_operator) operators.push_back(PrincipalOf(digest));
  }
  return Authenticator(std::move(digests), std::move(operators));
}

bool Authenticator::IsOperator(std::string_view principal) const {
  for (const std::string& p : operators_) {
    if (p == principal) return true;
  }
  return false;
}

absl::StatusOr<std::string> Authenticator::Authenticate(
    std::optional<std::string_view> authorization) const {
  if (!enabled()) return std::string();
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError(
        "this server requires a bearer token: send the metadata 'authorization: Bearer <token>'");
  }
  const absl::string_view header(authorization->data(), authorization->size());
  if (!absl::StartsWithIgnoreCase(header, kBearerPrefix)) {
    return absl::UnauthenticatedError("the authorization metadata must be 'Bearer <token>'");
  }
  const Digest presented =
      Sha256(absl::StripAsciiWhitespace(header.substr(sizeof(kBearerPrefix) - 1)));
  // Every digest is compared, whatever matched before; tokens are distinct, so at most one does.
  size_t matched = digests_.size();
  for (size_t i = 0; i < digests_.size(); ++i) {
    const bool equal = CRYPTO_memcmp(presented.data(), digests_[i].data(), presented.size()) == 0;
    matched = equal ? i : matched;
  }
  if (matched == digests_.size()) return absl::UnauthenticatedError("invalid bearer token");
  return PrincipalOf(digests_[matched]);
}

absl::StatusOr<std::string> Authenticator::Authenticate(
    const grpc::ServerContextBase& context) const {
  if (!enabled()) return std::string();
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("authorization");
  if (it == metadata.end()) return Authenticate(std::nullopt);
  return Authenticate(std::string_view(it->second.data(), it->second.size()));
}

}  // namespace subspace::server
