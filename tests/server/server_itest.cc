// The Subspace service end to end: a real server in-process on port 0 over a tiny random model,
// driven through the generated stub. Generation (unary and streamed), cancellation, deadlines,
// sessions, validation errors and their codes, and the cache returning to idle afterwards.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "server/server_app.h"
#include "tests/server/server_test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::ChannelTo;
using ::subspace::testing::ExpectedCompressionRatio;
using ::subspace::testing::TestServerConfig;
using ::subspace::testing::WaitFor;

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server::ServerAppConfig config = TestServerConfig();
    // Slows the engine when a test needs a request to still be running (cancel, busy session).
    config.engine.on_step = [this](const StepStats&) {
      const int ms = step_delay_ms_.load();
      if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    };
    absl::StatusOr<std::unique_ptr<server::ServerApp>> app = server::ServerApp::Start(config);
    ASSERT_TRUE(app.ok()) << app.status();
    app_ = *std::move(app);
    channel_ = ChannelTo(app_->port());
    stub_ = v1::Subspace::NewStub(channel_);
  }

  void TearDown() override {
    if (app_ != nullptr) {
      EXPECT_TRUE(app_->Shutdown());
    }
  }

  static v1::GenerateRequest TokensRequest(const std::vector<int32_t>& ids, uint32_t max_new) {
    v1::GenerateRequest r;
    for (int32_t id : ids) r.mutable_tokens()->add_ids(id);
    r.mutable_sampling()->set_max_new_tokens(max_new);
    r.mutable_sampling()->set_ignore_eos(true);
    return r;
  }

  static v1::GenerateRequest TextRequest(const std::string& text, uint32_t max_new) {
    v1::GenerateRequest r;
    r.set_text(text);
    r.mutable_sampling()->set_max_new_tokens(max_new);
    r.mutable_sampling()->set_ignore_eos(true);
    return r;
  }

  grpc::Status Generate(const v1::GenerateRequest& request, v1::GenerateResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return stub_->Generate(&context, request, response);
  }

  struct StreamResult {
    grpc::Status status;
    std::vector<v1::GenerateStreamResponse> messages;
  };
  StreamResult GenerateStream(const v1::GenerateRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    StreamResult result;
    auto reader = stub_->GenerateStream(&context, request);
    for (v1::GenerateStreamResponse m; reader->Read(&m);) result.messages.push_back(m);
    result.status = reader->Finish();
    return result;
  }

  v1::CacheStats CacheStats() {
    grpc::ClientContext context;
    v1::CacheStats stats;
    EXPECT_TRUE(stub_->GetCacheStats(&context, v1::GetCacheStatsRequest(), &stats).ok());
    return stats;
  }

  // Nothing running or queued and every block back in the pool (no sessions hold any).
  bool WaitIdle() {
    return WaitFor([this] {
      const v1::CacheStats s = CacheStats();
      return s.running() == 0 && s.waiting() == 0 && s.blocks_free() == s.blocks_total();
    });
  }

  std::string CreateSession() {
    grpc::ClientContext context;
    v1::Session session;
    const grpc::Status status =
        stub_->CreateSession(&context, v1::CreateSessionRequest(), &session);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return session.session_id();
  }

  std::atomic<int> step_delay_ms_{0};
  std::unique_ptr<server::ServerApp> app_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Subspace::Stub> stub_;
};

std::vector<int32_t> Ids(const v1::GenerateResponse& r) {
  return {r.token_ids().begin(), r.token_ids().end()};
}

TEST_F(ServerTest, UnaryGenerate) {
  v1::GenerateRequest request = TextRequest("hello world", 8);
  request.set_request_id("unary-1");
  v1::GenerateResponse response;
  const grpc::Status status = Generate(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.request_id(), "unary-1");
  EXPECT_EQ(response.token_ids_size(), 8);
  EXPECT_EQ(response.tokens_size(), 0);  // logprobs not requested
  EXPECT_EQ(response.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_GT(response.usage().prompt_tokens(), 1u);  // BOS + the words
  EXPECT_EQ(response.usage().generated_tokens(), 8u);
  EXPECT_EQ(response.usage().reused_tokens(), 0u);
  EXPECT_GT(response.timings().total_seconds(), 0.0);
  EXPECT_GE(response.timings().total_seconds(), response.timings().time_to_first_token_seconds());
  EXPECT_EQ(response.timings().inter_token_seconds_size(), 7);

  // Greedy decoding is deterministic, and logprobs come back when asked for.
  request.set_request_id("");
  request.mutable_sampling()->set_logprobs(3);
  v1::GenerateResponse again;
  ASSERT_TRUE(Generate(request, &again).ok());
  EXPECT_EQ(Ids(again), Ids(response));
  EXPECT_EQ(again.text(), response.text());
  EXPECT_EQ(again.request_id().size(), 16u);  // generated
  ASSERT_EQ(again.tokens_size(), 8);
  for (const v1::GeneratedToken& t : again.tokens()) {
    EXPECT_LE(t.logprob(), 0.0f);
    EXPECT_EQ(t.top_logprobs_size(), 3);
  }
  EXPECT_TRUE(WaitIdle());
}

TEST_F(ServerTest, StreamSendsChunksThenFinal) {
  const v1::GenerateRequest request = TextRequest("the world is", 12);
  v1::GenerateResponse unary;
  ASSERT_TRUE(Generate(request, &unary).ok());

  const StreamResult stream = GenerateStream(request);
  ASSERT_TRUE(stream.status.ok()) << stream.status.error_message();
  ASSERT_GE(stream.messages.size(), 2u);
  std::string text;
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < stream.messages.size(); ++i) {
    ASSERT_TRUE(stream.messages[i].has_chunk()) << "message " << i;
    text += stream.messages[i].chunk().text();
    for (const v1::GeneratedToken& t : stream.messages[i].chunk().tokens()) ids.push_back(t.id());
  }
  const v1::GenerateStreamResponse& last = stream.messages.back();
  ASSERT_TRUE(last.has_final());
  EXPECT_EQ(last.final().finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(last.final().usage().generated_tokens(), 12u);
  EXPECT_EQ(last.request_id(), stream.messages.front().request_id());
  EXPECT_EQ(text, unary.text());
  EXPECT_EQ(ids, Ids(unary));
  EXPECT_TRUE(WaitIdle());
}

TEST_F(ServerTest, ConcurrentStreamsAllCompleteAndCacheReturnsToIdle) {
  constexpr int kStreams = 32;
  std::vector<std::thread> threads;
  std::vector<StreamResult> results(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([this, i, &results] {
      results[i] = GenerateStream(TokensRequest({1, 300 + i % 10, 290, 301}, 10 + i % 7));
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    ASSERT_FALSE(results[i].messages.empty());
    ASSERT_TRUE(results[i].messages.back().has_final()) << i;
    EXPECT_EQ(results[i].messages.back().final().usage().generated_tokens(),
              static_cast<uint32_t>(10 + i % 7));
  }
  EXPECT_TRUE(WaitIdle());
}

TEST_F(ServerTest, CancelMidStreamFreesBlocks) {
  step_delay_ms_ = 2;
  grpc::ClientContext context;
  auto reader = stub_->GenerateStream(&context, TokensRequest({1, 300, 301}, 200));
  v1::GenerateStreamResponse first;
  ASSERT_TRUE(reader->Read(&first));
  EXPECT_TRUE(first.has_chunk());
  EXPECT_LT(CacheStats().blocks_free(), CacheStats().blocks_total());
  context.TryCancel();
  for (v1::GenerateStreamResponse m; reader->Read(&m);) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitIdle());
}

TEST_F(ServerTest, CancelUnaryFreesBlocks) {
  step_delay_ms_ = 2;
  grpc::ClientContext context;
  v1::GenerateResponse response;
  std::promise<grpc::Status> done;
  const v1::GenerateRequest request = TokensRequest({1, 300}, 200);
  stub_->async()->Generate(&context, &request, &response,
                           [&done](const grpc::Status& s) { done.set_value(s); });
  ASSERT_TRUE(WaitFor([this] { return CacheStats().running() == 1; }));
  context.TryCancel();
  EXPECT_EQ(done.get_future().get().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitIdle());
}

TEST_F(ServerTest, DeadlineExceeded) {
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1));
    v1::GenerateResponse response;
    EXPECT_EQ(stub_->Generate(&context, TokensRequest({1, 300}, 200), &response).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  // A deadline that passes while generating: the engine stops the request.
  step_delay_ms_ = 2;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(50));
    v1::GenerateResponse response;
    EXPECT_EQ(stub_->Generate(&context, TokensRequest({1, 300}, 200), &response).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(50));
    auto reader = stub_->GenerateStream(&context, TokensRequest({1, 300}, 200));
    for (v1::GenerateStreamResponse m; reader->Read(&m);) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  EXPECT_TRUE(WaitIdle());
}

TEST_F(ServerTest, SessionReuseIsExact) {
  const std::string session = CreateSession();
  ASSERT_FALSE(session.empty());
  const std::vector<int32_t> a = {1, 300, 301, 302, 290};
  const std::vector<int32_t> b = {303, 304, 291};

  v1::GenerateRequest first = TokensRequest(a, 6);
  first.set_session_id(session);
  v1::GenerateResponse r1;
  ASSERT_TRUE(Generate(first, &r1).ok());
  EXPECT_EQ(r1.session_id(), session);
  EXPECT_EQ(r1.usage().reused_tokens(), 0u);

  v1::GenerateRequest second = TokensRequest(b, 6);
  second.set_session_id(session);
  v1::GenerateResponse r2;
  ASSERT_TRUE(Generate(second, &r2).ok());
  // Everything but the last generated token (never written to the cache) is reused.
  EXPECT_EQ(r2.usage().reused_tokens(), a.size() + 6 - 1);
  EXPECT_EQ(r2.usage().prompt_tokens(), b.size());

  // Greedy tokens over two calls equal one call over the concatenation.
  std::vector<int32_t> all = a;
  all.insert(all.end(), r1.token_ids().begin(), r1.token_ids().end());
  all.insert(all.end(), b.begin(), b.end());
  v1::GenerateResponse whole;
  ASSERT_TRUE(Generate(TokensRequest(all, 6), &whole).ok());
  EXPECT_EQ(Ids(r2), Ids(whole));

  grpc::ClientContext context;
  v1::GetSessionRequest get;
  get.set_session_id(session);
  v1::Session info;
  ASSERT_TRUE(stub_->GetSession(&context, get, &info).ok());
  EXPECT_EQ(info.tokens(), all.size() + 6);
  EXPECT_FALSE(info.busy());

  // Text on a session with tokens gets no second BOS.
  v1::GenerateRequest text = TextRequest("hello", 2);
  v1::GenerateResponse fresh;
  ASSERT_TRUE(Generate(text, &fresh).ok());
  text.set_session_id(session);
  v1::GenerateResponse r3;
  ASSERT_TRUE(Generate(text, &r3).ok());
  EXPECT_EQ(r3.usage().prompt_tokens() + 1, fresh.usage().prompt_tokens());
}

// A client-proposed session id is taken as is (so a proxy can route on it before the session
// exists), a malformed one is refused naming the field, and a live one cannot be taken twice.
TEST_F(ServerTest, ProposedSessionId) {
  auto create = [this](const std::string& id, v1::Session* session) {
    grpc::ClientContext context;
    v1::CreateSessionRequest request;
    request.set_session_id(id);
    return stub_->CreateSession(&context, request, session);
  };
  const std::string hex = "00112233445566778899aabbccddeeff";
  const std::string uuid_like = "6f1c2b9e-3a4d-4e5f-8a7b-0c1d2e3f4a5b_Zz";
  for (const std::string& id : {hex, uuid_like, std::string(64, 'x')}) {
    v1::Session session;
    const grpc::Status status = create(id, &session);
    ASSERT_TRUE(status.ok()) << id << ": " << status.error_message();
    EXPECT_EQ(session.session_id(), id);
  }
  {
    // Later calls find it under that id.
    v1::GenerateRequest request = TextRequest("hello", 2);
    request.set_session_id(hex);
    v1::GenerateResponse response;
    ASSERT_TRUE(Generate(request, &response).ok());
    grpc::ClientContext context;
    v1::GetSessionRequest get;
    get.set_session_id(hex);
    v1::Session session;
    ASSERT_TRUE(stub_->GetSession(&context, get, &session).ok());
    EXPECT_GT(session.tokens(), 0u);
  }
  {
    v1::Session session;
    const grpc::Status status = create(hex, &session);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS) << status.error_message();
  }
  const std::vector<std::string> bad_ids = {std::string(31, 'a'),
                                            std::string(65, 'a'),
                                            "00112233445566778899aabbccddeef!",
                                            "00112233445566778899aabbccddeef.",
                                            "0011223344556677 8899aabbccddeeff",
                                            "00112233445566778899aabbccddeef\xc3\xa9"};
  for (const std::string& bad : bad_ids) {
    v1::Session session;
    const grpc::Status status = create(bad, &session);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_NE(status.error_message().find("session_id"), std::string::npos)
        << status.error_message();
  }
  // Only the three good ones exist.
  grpc::ClientContext context;
  v1::ListSessionsResponse list;
  ASSERT_TRUE(stub_->ListSessions(&context, v1::ListSessionsRequest(), &list).ok());
  EXPECT_EQ(list.sessions_size(), 3);
}

TEST_F(ServerTest, SessionRpcs) {
  const std::string s1 = CreateSession();
  const std::string s2 = CreateSession();
  {
    grpc::ClientContext context;
    v1::ListSessionsResponse list;
    ASSERT_TRUE(stub_->ListSessions(&context, v1::ListSessionsRequest(), &list).ok());
    EXPECT_EQ(list.sessions_size(), 2);
  }
  {
    grpc::ClientContext context;
    v1::CreateSessionRequest request;
    request.set_idle_ttl_seconds(30);
    v1::Session session;
    ASSERT_TRUE(stub_->CreateSession(&context, request, &session).ok());
    EXPECT_EQ(session.idle_ttl_seconds(), 30u);
    EXPECT_GT(session.created_unix_ms(), 0);
  }
  {
    grpc::ClientContext context;
    v1::CreateSessionRequest request;
    request.set_idle_ttl_seconds(100000000);
    v1::Session session;
    const grpc::Status status = stub_->CreateSession(&context, request, &session);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("idle_ttl_seconds"), std::string::npos);
  }
  for (const std::string& id : {s1, s2}) {
    grpc::ClientContext context;
    v1::DeleteSessionRequest request;
    request.set_session_id(id);
    v1::DeleteSessionResponse response;
    EXPECT_TRUE(stub_->DeleteSession(&context, request, &response).ok());
  }
  {
    grpc::ClientContext context;
    v1::DeleteSessionRequest request;
    request.set_session_id(s1);
    v1::DeleteSessionResponse response;
    EXPECT_EQ(stub_->DeleteSession(&context, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext context;
    v1::GetSessionRequest request;  // empty id
    v1::Session session;
    const grpc::Status status = stub_->GetSession(&context, request, &session);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("session_id"), std::string::npos);
  }
}

TEST_F(ServerTest, UnknownSessionIsNotFound) {
  v1::GenerateRequest request = TokensRequest({1, 300}, 4);
  request.set_session_id("no-such-session");
  v1::GenerateResponse response;
  const grpc::Status status = Generate(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(status.error_message().find("no-such-session"), std::string::npos);
  EXPECT_EQ(GenerateStream(request).status.error_code(), grpc::StatusCode::NOT_FOUND);

  grpc::ClientContext context;
  v1::GetSessionRequest get;
  get.set_session_id("no-such-session");
  v1::Session session;
  EXPECT_EQ(stub_->GetSession(&context, get, &session).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServerTest, BusySessionIsFailedPrecondition) {
  step_delay_ms_ = 2;
  const std::string session = CreateSession();
  v1::GenerateRequest request = TokensRequest({1, 300}, 200);
  request.set_session_id(session);
  grpc::ClientContext context;
  auto reader = stub_->GenerateStream(&context, request);
  v1::GenerateStreamResponse first;
  ASSERT_TRUE(reader->Read(&first));

  v1::GenerateResponse response;
  const grpc::Status status = Generate(TokensRequest({300}, 2), &response);  // other: fine
  EXPECT_TRUE(status.ok()) << status.error_message();
  request.mutable_sampling()->set_max_new_tokens(2);
  const grpc::Status busy = Generate(request, &response);
  EXPECT_EQ(busy.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << busy.error_message();
  EXPECT_NE(busy.error_message().find(session), std::string::npos);

  context.TryCancel();
  for (v1::GenerateStreamResponse m; reader->Read(&m);) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

struct InvalidCase {
  std::string name;
  std::function<void(v1::GenerateRequest&)> mutate;
  std::string expected;  // substring of the status message
};

TEST_F(ServerTest, EveryInvalidFieldIsInvalidArgumentNamingIt) {
  const std::vector<InvalidCase> cases = {
      {"no prompt", [](v1::GenerateRequest& r) { r.clear_prompt(); }, "prompt is required"},
      {"empty text", [](v1::GenerateRequest& r) { r.set_text(""); }, "text must not be empty"},
      {"text past context",
       [](v1::GenerateRequest& r) {
         std::string t;
         for (int i = 0; i < 300; ++i) t += " the";
         r.set_text(t);
       },
       "text encodes to"},
      {"empty ids", [](v1::GenerateRequest& r) { r.mutable_tokens()->clear_ids(); },
       "tokens.ids must not be empty"},
      {"id too large", [](v1::GenerateRequest& r) { r.mutable_tokens()->add_ids(1 << 20); },
       "tokens.ids[2] must be in [0, "},
      {"negative id", [](v1::GenerateRequest& r) { r.mutable_tokens()->set_ids(0, -1); },
       "tokens.ids[0]"},
      {"prompt fills context",
       [](v1::GenerateRequest& r) {
         for (int i = 0; i < 254; ++i) r.mutable_tokens()->add_ids(300);
       },
       "prompt"},
      {"max_new_tokens 0",
       [](v1::GenerateRequest& r) { r.mutable_sampling()->set_max_new_tokens(0); },
       "sampling.max_new_tokens must be >= 1 (0 only prefills a session), got 0"},
      {"max_new_tokens huge",
       [](v1::GenerateRequest& r) { r.mutable_sampling()->set_max_new_tokens(1000000); },
       "sampling.max_new_tokens"},
      {"temperature negative",
       [](v1::GenerateRequest& r) { r.mutable_sampling()->set_temperature(-1.0f); },
       "sampling.temperature must be in [0, 100], got -1"},
      {"temperature nan",
       [](v1::GenerateRequest& r) {
         r.mutable_sampling()->set_temperature(std::numeric_limits<float>::quiet_NaN());
       },
       "sampling.temperature"},
      {"top_k negative", [](v1::GenerateRequest& r) { r.mutable_sampling()->set_top_k(-2); },
       "sampling.top_k must be >= 0, got -2"},
      {"top_p above 1", [](v1::GenerateRequest& r) { r.mutable_sampling()->set_top_p(1.5f); },
       "sampling.top_p must be in (0, 1], got 1.5"},
      {"top_p 0", [](v1::GenerateRequest& r) { r.mutable_sampling()->set_top_p(0.0f); },
       "sampling.top_p"},
      {"min_p 1", [](v1::GenerateRequest& r) { r.mutable_sampling()->set_min_p(1.0f); },
       "sampling.min_p must be in [0, 1), got 1"},
      {"repetition_penalty 0",
       [](v1::GenerateRequest& r) { r.mutable_sampling()->set_repetition_penalty(0.0f); },
       "sampling.repetition_penalty"},
      {"repetition_penalty inf",
       [](v1::GenerateRequest& r) {
         r.mutable_sampling()->set_repetition_penalty(std::numeric_limits<float>::infinity());
       },
       "sampling.repetition_penalty"},
      {"logprobs 21", [](v1::GenerateRequest& r) { r.mutable_sampling()->set_logprobs(21); },
       "sampling.logprobs must be in [0, 20], got 21"},
      {"empty stop",
       [](v1::GenerateRequest& r) {
         r.mutable_sampling()->add_stop("x");
         r.mutable_sampling()->add_stop("");
       },
       "sampling.stop[1] must not be empty"},
      {"too many stops",
       [](v1::GenerateRequest& r) {
         for (int i = 0; i < 9; ++i) r.mutable_sampling()->add_stop()->assign("stop");
       },
       "sampling.stop has 9 entries, at most 8"},
      {"stop too long",
       [](v1::GenerateRequest& r) { r.mutable_sampling()->add_stop(std::string(300, 'x')); },
       "sampling.stop[0] is 300 bytes"},
      {"request_id with space", [](v1::GenerateRequest& r) { r.set_request_id("a b"); },
       "request_id must be printable ASCII"},
      {"session_id too long",
       [](v1::GenerateRequest& r) { r.set_session_id(std::string(200, 's')); },
       "session_id is 200 bytes, at most 128"},
  };
  for (const InvalidCase& c : cases) {
    SCOPED_TRACE(c.name);
    v1::GenerateRequest request = TokensRequest({1, 300}, 4);
    c.mutate(request);
    v1::GenerateResponse response;
    const grpc::Status unary = Generate(request, &response);
    EXPECT_EQ(unary.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << unary.error_message();
    EXPECT_NE(unary.error_message().find(c.expected), std::string::npos)
        << "message: " << unary.error_message();
    const StreamResult stream = GenerateStream(request);
    EXPECT_EQ(stream.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(stream.status.error_message(), unary.error_message());
    EXPECT_TRUE(stream.messages.empty());
  }
  EXPECT_TRUE(WaitIdle());
}

// protobuf refuses to parse a proto3 string holding invalid UTF-8; the server still names the
// field (the C++ client serializes such strings, logging an error, so the test can send them).
TEST_F(ServerTest, InvalidUtf8IsInvalidArgumentNamingTheField) {
  const std::vector<InvalidCase> cases = {
      {"text", [](v1::GenerateRequest& r) { r.set_text("bad \xff text"); },
       "text is not valid UTF-8 (bad byte at offset 4)"},
      {"stop",
       [](v1::GenerateRequest& r) {
         r.mutable_sampling()->add_stop("ok");
         r.mutable_sampling()->add_stop("\xc3(");
       },
       "sampling.stop[1] is not valid UTF-8 (bad byte at offset 0)"},
      {"request_id", [](v1::GenerateRequest& r) { r.set_request_id("\xed\xa0\x80"); },
       "request_id is not valid UTF-8"},
  };
  for (const InvalidCase& c : cases) {
    SCOPED_TRACE(c.name);
    v1::GenerateRequest request = TokensRequest({1, 300}, 4);
    c.mutate(request);
    v1::GenerateResponse response;
    const grpc::Status unary = Generate(request, &response);
    EXPECT_EQ(unary.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << unary.error_message();
    EXPECT_NE(unary.error_message().find(c.expected), std::string::npos)
        << "message: " << unary.error_message();
    const StreamResult stream = GenerateStream(request);
    EXPECT_EQ(stream.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(stream.status.error_message(), unary.error_message());
  }
}

TEST_F(ServerTest, OversizedRequestIsResourceExhausted) {
  v1::GenerateResponse response;
  const grpc::Status status = Generate(TextRequest(std::string(5 << 20, 'a'), 2), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
}

TEST_F(ServerTest, ModelInfoAndCacheStats) {
  grpc::ClientContext context;
  v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.name(), "tiny-random");
  EXPECT_EQ(info.architecture(), "llama");
  EXPECT_EQ(info.layers(), 2u);
  EXPECT_EQ(info.heads(), 4u);
  EXPECT_EQ(info.kv_heads(), 2u);
  EXPECT_EQ(info.head_dim(), 8u);
  EXPECT_EQ(info.context_length(), 256u);
  EXPECT_EQ(info.tokenizer_model(), "llama");
  EXPECT_EQ(info.bos_token_id(), 1);
  EXPECT_EQ(info.eos_token_id(), 2);
  EXPECT_EQ(info.cache().kind(), runtime::KvCacheKindName(TestServerConfig().kv_cache.kind));
  EXPECT_EQ(info.cache().block_size(), 8u);
  EXPECT_GT(info.cache().blocks_total(), 0u);

  const v1::CacheStats idle = CacheStats();
  EXPECT_EQ(idle.blocks_free(), idle.blocks_total());
  EXPECT_EQ(idle.blocks_total(), info.cache().blocks_total());
  EXPECT_LE(idle.pool_bytes_total(), 4u << 20);
  EXPECT_EQ(idle.tokens_cached(), 0u);
  EXPECT_EQ(idle.compression_ratio(), 0.0);

  const std::string session = CreateSession();
  v1::GenerateRequest request = TokensRequest({1, 300, 301}, 5);
  request.set_session_id(session);
  v1::GenerateResponse response;
  ASSERT_TRUE(Generate(request, &response).ok());
  const v1::CacheStats held = CacheStats();
  EXPECT_EQ(held.sessions(), 1u);
  EXPECT_EQ(held.tokens_cached(), 3u + 5u - 1u);
  EXPECT_LT(held.blocks_free(), held.blocks_total());
  EXPECT_GT(held.bytes_used_full(), 0u);
  EXPECT_EQ(held.bytes_used_compressed(), 0u);  // 7 tokens: all in the window
  // Full-rank fp16 bytes over pool bytes: 7 tokens * 2 layers * 2 * 2 kv_heads * 8 * 2 = 896
  // over one 512-byte block per layer (the compressed cache stores full blocks in fp16 by
  // default, --kv-full-dtype).
  EXPECT_DOUBLE_EQ(held.compression_ratio(), ExpectedCompressionRatio(held, info));
  EXPECT_DOUBLE_EQ(held.compression_ratio(), 896.0 / 1024.0);
}

}  // namespace
}  // namespace subspace
