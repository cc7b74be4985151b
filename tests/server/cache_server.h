// An in-process server with a stub for the tests of the server's KV caches
// (server_cache_itest, transform_cache_itest), and the token requests they send.
#ifndef SUBSPACE_TESTS_SERVER_CACHE_SERVER_H_
#define SUBSPACE_TESTS_SERVER_CACHE_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "server/server_app.h"
#include "tests/server/server_test_util.h"

namespace subspace::testing {

// A request for `ids` that generates exactly max_new tokens (EOS ignored).
inline v1::GenerateRequest TokensRequest(const std::vector<int32_t>& ids, uint32_t max_new) {
  v1::GenerateRequest r;
  for (int32_t id : ids) r.mutable_tokens()->add_ids(id);
  r.mutable_sampling()->set_max_new_tokens(max_new);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

inline std::vector<int32_t> Ids(const v1::GenerateResponse& r) {
  return {r.token_ids().begin(), r.token_ids().end()};
}

// One in-process server and a stub for it.
class InProcessServer {
 public:
  explicit InProcessServer(const server::ServerAppConfig& config) {
    absl::StatusOr<std::unique_ptr<server::ServerApp>> app = server::ServerApp::Start(config);
    EXPECT_TRUE(app.ok()) << app.status();
    if (!app.ok()) return;
    app_ = *std::move(app);
    stub_ = v1::Subspace::NewStub(ChannelTo(app_->port()));
  }
  ~InProcessServer() {
    if (app_ != nullptr) {
      EXPECT_TRUE(app_->Shutdown());
    }
  }
  bool ok() const { return app_ != nullptr; }
  server::ServerApp& app() { return *app_; }

  v1::GenerateResponse Generate(const v1::GenerateRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::GenerateResponse response;
    const grpc::Status status = stub_->Generate(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }
  v1::GenerateResponse Generate(const v1::GenerateRequest& request, const std::string& session) {
    v1::GenerateRequest with_session = request;
    with_session.set_session_id(session);
    return Generate(with_session);
  }
  std::string CreateSession() {
    grpc::ClientContext context;
    v1::Session session;
    EXPECT_TRUE(stub_->CreateSession(&context, v1::CreateSessionRequest(), &session).ok());
    return session.session_id();
  }
  void DeleteSession(const std::string& id) {
    grpc::ClientContext context;
    v1::DeleteSessionRequest request;
    request.set_session_id(id);
    v1::DeleteSessionResponse response;
    EXPECT_TRUE(stub_->DeleteSession(&context, request, &response).ok());
  }
  v1::ModelInfo ModelInfo() {
    grpc::ClientContext context;
    v1::ModelInfo info;
    EXPECT_TRUE(stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
    return info;
  }
  v1::CacheStats CacheStats() {
    grpc::ClientContext context;
    v1::CacheStats stats;
    EXPECT_TRUE(stub_->GetCacheStats(&context, v1::GetCacheStatsRequest(), &stats).ok());
    return stats;
  }

 private:
  std::unique_ptr<server::ServerApp> app_;
  std::unique_ptr<v1::Subspace::Stub> stub_;
};

// A 3-token prompt and 60 generated tokens in `session`: every token but the last is cached,
// some blocks are coded, and the reported compression ratio is the one the stats give.
inline void ExpectSessionCompresses(InProcessServer& s, const v1::ModelInfo& info,
                                    const std::string& session) {
  const v1::GenerateResponse r = s.Generate(TokensRequest({1, 300, 301}, 60), session);
  EXPECT_EQ(r.token_ids_size(), 60);
  const v1::CacheStats held = s.CacheStats();
  EXPECT_EQ(held.tokens_cached(), 3u + 60u - 1u);
  EXPECT_GT(held.bytes_used_compressed(), 0u);
  EXPECT_DOUBLE_EQ(held.compression_ratio(), ExpectedCompressionRatio(held, info));
}

// The refresher publishes from its own thread and a new epoch is installed at the session's
// next commit: a hundred tokens take a few ms, which a loaded machine may not give that thread.
// Short turns in `session`, time apart, until GetCacheStats counts a refresh (at most ten; the
// context holds them all). Returns the last stats.
inline v1::CacheStats TurnUntilARefresh(InProcessServer& s, const std::string& session) {
  v1::CacheStats stats = s.CacheStats();
  for (int turn = 0; turn < 10 && stats.refreshes_total() == 0; ++turn) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    s.Generate(TokensRequest({305}, 8), session);
    stats = s.CacheStats();
  }
  return stats;
}

}  // namespace subspace::testing

#endif  // SUBSPACE_TESTS_SERVER_CACHE_SERVER_H_
