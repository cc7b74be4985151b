// Authenticator: the tokens file's format and its start-up errors, the bearer header's forms,
// and principals that name a token without revealing it.
#include "server/auth.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace subspace::server {
namespace {

constexpr char kTokenA[] = "alpha-0123456789abcdef";
constexpr char kTokenB[] = "bravo-fedcba9876543210";

class AuthTest : public ::testing::Test {
 protected:
  void TearDown() override { std::remove(path_.c_str()); }

  // Writes `contents` to the test's tokens file and returns its path.
  const std::string& Write(const std::string& contents) {
    std::ofstream(path_) << contents;
    return path_;
  }

  const std::string path_ =
      absl::StrCat(::testing::TempDir(), "/subspace_auth_test_", getpid(), ".tokens");
};

TEST_F(AuthTest, ReadsTokensSkippingCommentsAndBlankLines) {
  absl::StatusOr<Authenticator> auth = Authenticator::FromFile(
      Write(absl::StrCat("# team tokens\n\n  ", kTokenA, "  \n\t\n# ", kTokenB, "\n", kTokenB)));
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE(auth->enabled());
  absl::StatusOr<std::string> a = auth->Authenticate(absl::StrCat("Bearer ", kTokenA));
  absl::StatusOr<std::string> b = auth->Authenticate(absl::StrCat("Bearer ", kTokenB));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(*a, *b);
  // A principal is stable, short, and not the token.
  EXPECT_EQ(*a, *auth->Authenticate(absl::StrCat("Bearer ", kTokenA)));
  EXPECT_TRUE(absl::StartsWith(*a, "sha256:")) << *a;
  EXPECT_EQ(a->size(), 7u + 16u) << *a;
  EXPECT_FALSE(absl::StrContains(*a, kTokenA));
}

TEST_F(AuthTest, HeaderForms) {
  absl::StatusOr<Authenticator> auth = Authenticator::FromFile(Write(kTokenA));
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE(auth->Authenticate(absl::StrCat("bearer ", kTokenA)).ok());  // scheme any case
  EXPECT_TRUE(auth->Authenticate(absl::StrCat("BEARER  ", kTokenA, " ")).ok());
  const struct {
    std::optional<std::string> header;
    std::string message;
  } rejected[] = {
      {std::nullopt, "requires a bearer token"},
      {"", "must be 'Bearer <token>'"},
      {kTokenA, "must be 'Bearer <token>'"},
      {absl::StrCat("Basic ", kTokenA), "must be 'Bearer <token>'"},
      {"Bearer ", "invalid bearer token"},
      {absl::StrCat("Bearer ", kTokenB), "invalid bearer token"},
      {absl::StrCat("Bearer ", kTokenA, "x"), "invalid bearer token"},
      {absl::StrCat("Bearer ", std::string(kTokenA).substr(1)), "invalid bearer token"},
  };
  for (const auto& r : rejected) {
    SCOPED_TRACE(r.header.value_or("(none)"));
    const absl::Status s = r.header.has_value() ? auth->Authenticate(*r.header).status()
                                                : auth->Authenticate(std::nullopt).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated);
    EXPECT_TRUE(absl::StrContains(s.message(), r.message)) << s;
    EXPECT_FALSE(absl::StrContains(s.message(), kTokenA)) << s;
  }
}

TEST_F(AuthTest, OperatorTokensAreTokensWhosePrincipalsAreOperators) {
  constexpr char kOperator[] = "ops-team-0123456789abcdef";
  const std::string operators =
      absl::StrCat(::testing::TempDir(), "/subspace_auth_test_", getpid(), ".operators");
  std::ofstream(operators) << "# the on-call rotation\n" << kOperator << "\n";
  absl::StatusOr<Authenticator> auth = Authenticator::FromFiles(Write(kTokenA), operators);
  ASSERT_TRUE(auth.ok()) << auth.status();
  absl::StatusOr<std::string> user = auth->Authenticate(absl::StrCat("Bearer ", kTokenA));
  absl::StatusOr<std::string> op = auth->Authenticate(absl::StrCat("Bearer ", kOperator));
  ASSERT_TRUE(user.ok()) << user.status();
  ASSERT_TRUE(op.ok()) << op.status();
  EXPECT_FALSE(auth->IsOperator(*user));
  EXPECT_TRUE(auth->IsOperator(*op));
  EXPECT_FALSE(auth->IsOperator(""));
  EXPECT_FALSE(Authenticator::FromFile(Write(kTokenA))->IsOperator(*op));

  // The same token in both files would be two principals: refused, naming both places.
  std::ofstream(operators) << kTokenB << "\n" << kTokenA << "\n";
  absl::StatusOr<Authenticator> twice = Authenticator::FromFiles(Write(kTokenA), operators);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(twice.status().message(),
                                "--operator-tokens: " + operators +
                                    " line 2: the token repeats the one on --auth-tokens's line 1"))
      << twice.status();
  std::ofstream(operators) << "# nobody\n";
  EXPECT_TRUE(
      absl::StrContains(Authenticator::FromFiles(Write(kTokenA), operators).status().message(),
                        "--operator-tokens: " + operators + " holds no token"));
  std::remove(operators.c_str());
}

TEST_F(AuthTest, OffLetsEveryoneInAnonymously) {
  const Authenticator off;
  EXPECT_FALSE(off.enabled());
  EXPECT_EQ(off.Authenticate(std::nullopt).value_or("x"), "");
  EXPECT_EQ(off.Authenticate("Bearer whatever-token-at-all").value_or("x"), "");
}

TEST_F(AuthTest, BadFilesAreStartupErrors) {
  const struct {
    std::string contents;
    std::string message;
  } cases[] = {
      {"", "holds no token"},
      {"\n  \n# only a comment\n", "holds no token"},
      {"short-token\n", "line 1: a token must be at least 16 bytes, got 11"},
      {absl::StrCat(kTokenA, "\n# c\n", "has a space-0123456789"), "line 3: a token may hold only"},
      {absl::StrCat(kTokenA, "\n", kTokenB, "\n", kTokenA),
       "line 3: the token repeats the one on line 1"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.contents);
    absl::StatusOr<Authenticator> auth = Authenticator::FromFile(Write(c.contents));
    EXPECT_EQ(auth.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(auth.status().message(), "--auth-tokens")) << auth.status();
    EXPECT_TRUE(absl::StrContains(auth.status().message(), c.message)) << auth.status();
    EXPECT_FALSE(absl::StrContains(auth.status().message(), kTokenA)) << auth.status();
  }
  absl::StatusOr<Authenticator> missing = Authenticator::FromFile("/nonexistent/tokens");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(missing.status().message(),
                                "--auth-tokens: cannot read /nonexistent/tokens"))
      << missing.status();
}

}  // namespace
}  // namespace subspace::server
