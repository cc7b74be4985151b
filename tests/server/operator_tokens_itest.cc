// Operator tokens (--operator-tokens): a token that moves every principal's sessions between
// replicas, each staying its owner's, and that cannot generate in them; refused without
// --auth-tokens. Plaintext gRPC on in-process servers (security_itest covers TLS).
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "server/server_app.h"
#include "tests/server/server_test_util.h"
#include "tests/server/token_caller.h"

namespace subspace {
namespace {

using ::subspace::testing::TestServerConfig;
using ::subspace::testing::TextRequest;
using Caller = ::subspace::testing::TokenCaller;

constexpr char kTokenA[] = "token-a-6b1f0c9e2d7a4f38";
constexpr char kTokenB[] = "token-b-93e5a0d4c1b87f26";
constexpr char kOperatorToken[] = "token-ops-0d9c4b71e2a5f863";

class OperatorTokensTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(dir_);
    std::ofstream(Path("tokens")) << kTokenA << "\n" << kTokenB << "\n";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const { return absl::StrCat(dir_, "/", name); }
  server::ServerAppConfig Config(bool auth) const {
    server::ServerAppConfig config = TestServerConfig();
    if (auth) config.auth_tokens_path = Path("tokens");
    return config;
  }

  const std::string dir_ =
      absl::StrCat(::testing::TempDir(), "/subspace_operator_tokens_", getpid());
};

// An operator token (--operator-tokens) moves every principal's sessions from one replica to
// another; each stays its owner's, and the operator cannot generate in them.
TEST_F(OperatorTokensTest, OperatorTokensMoveEveryPrincipalsSessions) {
  std::ofstream(Path("operators")) << kOperatorToken << "\n";
  server::ServerAppConfig config = Config(/*auth=*/true);
  config.operator_tokens_path = Path("operators");
  absl::StatusOr<std::unique_ptr<server::ServerApp>> source = server::ServerApp::Start(config);
  absl::StatusOr<std::unique_ptr<server::ServerApp>> target = server::ServerApp::Start(config);
  ASSERT_TRUE(source.ok() && target.ok());
  const auto channel_to = [](const std::unique_ptr<server::ServerApp>& app) {
    return grpc::CreateChannel(absl::StrCat("127.0.0.1:", app->port()),
                               grpc::InsecureChannelCredentials());
  };
  Caller a(channel_to(*source), kTokenA);
  Caller b(channel_to(*source), kTokenB);
  Caller ops(channel_to(*source), kOperatorToken);
  absl::StatusOr<std::string> a_session = a.CreateSession();
  absl::StatusOr<std::string> b_session = b.CreateSession();
  ASSERT_TRUE(a_session.ok() && b_session.ok());
  v1::GenerateRequest on_a = TextRequest("the first turn of a", 3);
  on_a.set_session_id(*a_session);
  v1::GenerateResponse response;
  ASSERT_TRUE(a.Generate(on_a, &response).ok());

  // The operator sees both; a principal still sees only its own.
  std::vector<std::string> listed = ops.ListSessions();
  std::sort(listed.begin(), listed.end());
  std::vector<std::string> both = {*a_session, *b_session};
  std::sort(both.begin(), both.end());
  EXPECT_EQ(listed, both);
  EXPECT_EQ(a.ListSessions(), std::vector<std::string>{*a_session});
  EXPECT_TRUE(ops.GetSession(*a_session).ok());
  // It manages them, but does not generate in them: to it, A's session is still not there.
  EXPECT_EQ(ops.Generate(on_a, &response).error_code(), grpc::StatusCode::NOT_FOUND);

  // Moved: exported from the source, imported into the target, deleted on the source.
  Caller ops_target(channel_to(*target), kOperatorToken);
  for (const std::string& id : both) {
    std::string snapshot;
    ASSERT_TRUE(ops.Export(id, &snapshot).ok()) << id;
    const grpc::Status imported = ops_target.Import(snapshot);
    ASSERT_TRUE(imported.ok()) << imported.error_message();
    EXPECT_TRUE(ops.DeleteSession(id).ok()) << id;
  }
  EXPECT_TRUE(ops.ListSessions().empty());
  EXPECT_EQ(a.GetSession(*a_session).error_code(), grpc::StatusCode::NOT_FOUND);

  // On the target each is its owner's: A continues on its cached history, B cannot see it.
  Caller a_target(channel_to(*target), kTokenA);
  Caller b_target(channel_to(*target), kTokenB);
  EXPECT_EQ(a_target.ListSessions(), std::vector<std::string>{*a_session});
  EXPECT_EQ(b_target.ListSessions(), std::vector<std::string>{*b_session});
  EXPECT_EQ(b_target.GetSession(*a_session).error_code(), grpc::StatusCode::NOT_FOUND);
  on_a.set_text(" the second turn of a");
  const grpc::Status again = a_target.Generate(on_a, &response);
  ASSERT_TRUE(again.ok()) << again.error_message();
  EXPECT_GT(response.usage().reused_tokens(), 0u);
  (*source)->Shutdown();
  (*target)->Shutdown();
}

// An operator token is refused without --auth-tokens (every call would be anonymous).
TEST_F(OperatorTokensTest, OperatorTokensNeedAuthTokens) {
  std::ofstream(Path("operators")) << kOperatorToken << "\n";
  server::ServerAppConfig config = Config(/*auth=*/false);
  config.operator_tokens_path = Path("operators");
  absl::StatusOr<std::unique_ptr<server::ServerApp>> app = server::ServerApp::Start(config);
  EXPECT_EQ(app.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(app.status().message(), "--operator-tokens needs --auth-tokens"))
      << app.status();
}

}  // namespace
}  // namespace subspace
