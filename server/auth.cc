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

}  // namespace

absl::StatusOr<Authenticator> Authenticator::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in.is_open()) {
    return absl::InvalidArgumentError(absl::StrCat("--auth-tokens: cannot read ", path));
  }
  std::vector<std::string> tokens;
  std::vector<int> lines;  // of each token, for the messages
  int line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    const absl::string_view token = absl::StripAsciiWhitespace(line);
    if (token.empty() || absl::StartsWith(token, "#")) continue;
    tokens.emplace_back(token);
    lines.push_back(line_number);
  }
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat("--auth-tokens: cannot read ", path));
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens: ", path,
                     " holds no token (one per line; blank and '#' lines are skipped)"));
  }
  std::vector<Digest> digests;
  absl::flat_hash_map<std::string, int> seen;  // digest bytes -> line
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string where = absl::StrCat("--auth-tokens: ", path, " line ", lines[i]);
    if (absl::Status s = CheckToken(tokens[i], where); !s.ok()) return s;
    const Digest digest = Sha256(tokens[i]);
    const auto [it, inserted] =
        seen.try_emplace(std::string(digest.begin(), digest.end()), lines[i]);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the token repeats the one on line ", it->second));
    }
    digests.push_back(digest);
  }
  return Authenticator(std::move(digests));
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
