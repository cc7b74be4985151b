// Tests of the C++ client library and the bench: SubspaceClient (the Subspace API and the
// grpc.health.v1 check) and RunBench against a real in-process ServerApp on port 0, the
// x-session-id header against a recording fake service, and the bench's length parsing and
// percentile arithmetic.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/load_generator.h"
#include "client/subspace_client.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace subspace::client {
namespace {

using ::subspace::testing::TestServerConfig;

TEST(ParseLengthRangeTest, FixedAndRange) {
  absl::StatusOr<LengthRange> fixed = ParseLengthRange("64");
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_EQ(fixed->min, 64);
  EXPECT_EQ(fixed->max, 64);
  absl::StatusOr<LengthRange> range = ParseLengthRange("32:128");
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(range->min, 32);
  EXPECT_EQ(range->max, 128);
  for (const char* bad : {"", "0", "-3", "5:3", "x", "3:", ":4", "1:2:3"}) {
    EXPECT_EQ(ParseLengthRange(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(SummarizeSecondsTest, NumpyLinearPercentiles) {
  const LatencyStats s = SummarizeSeconds({0.005, 0.001, 0.003, 0.002, 0.004});
  EXPECT_DOUBLE_EQ(s.mean_ms, 3.0);
  EXPECT_DOUBLE_EQ(s.p50_ms, 3.0);
  EXPECT_NEAR(s.p90_ms, 4.6, 1e-12);  // numpy.percentile([1..5], 90) = 4.6
  EXPECT_NEAR(s.p99_ms, 4.96, 1e-12);
  EXPECT_DOUBLE_EQ(s.max_ms, 5.0);
  const LatencyStats empty = SummarizeSeconds({});
  EXPECT_EQ(empty.mean_ms, 0);
  EXPECT_EQ(empty.p99_ms, 0);
}

v1::GenerateRequest TokenRequest(const std::vector<int32_t>& ids, uint32_t max_new_tokens) {
  v1::GenerateRequest request;
  for (int32_t id : ids) request.mutable_tokens()->add_ids(id);
  request.mutable_sampling()->set_max_new_tokens(max_new_tokens);
  request.mutable_sampling()->set_ignore_eos(true);
  return request;
}

// One server for the suite: starting and stopping one takes seconds.
class ClientServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server::ServerAppConfig config = TestServerConfig();
    // Slows the engine when a test needs a request to still be running (cancel, deadline).
    config.engine.on_step = [](const StepStats&) {
      const int ms = step_delay_ms_.load();
      if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    };
    absl::StatusOr<std::unique_ptr<server::ServerApp>> app = server::ServerApp::Start(config);
    ASSERT_TRUE(app.ok()) << app.status();
    app_ = std::move(app).value().release();
  }
  static void TearDownTestSuite() {
    delete app_;
    app_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(app_, nullptr);
    step_delay_ms_ = 0;
    options_.server = absl::StrCat("127.0.0.1:", app_->port());
    options_.timeout = absl::Seconds(60);
    client_ = std::make_unique<SubspaceClient>(options_);
  }

  static inline std::atomic<int> step_delay_ms_{0};
  static inline server::ServerApp* app_ = nullptr;
  ClientOptions options_;
  std::unique_ptr<SubspaceClient> client_;
};

TEST_F(ClientServerTest, GenerateAndStreamAgree) {
  const v1::GenerateRequest request = TokenRequest({5, 6, 7, 8}, 6);
  absl::StatusOr<v1::GenerateResponse> unary = client_->Generate(request);
  ASSERT_TRUE(unary.ok()) << unary.status();
  EXPECT_EQ(unary->token_ids_size(), 6);
  EXPECT_EQ(unary->finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(unary->usage().prompt_tokens(), 4u);

  std::vector<int32_t> streamed;
  std::string text;
  absl::StatusOr<StreamResult> stream =
      client_->Stream(request, [&](const v1::GenerateStreamResponse& message) {
        EXPECT_TRUE(message.has_chunk());
        EXPECT_FALSE(message.request_id().empty());
        text += message.chunk().text();
        for (const v1::GeneratedToken& t : message.chunk().tokens()) streamed.push_back(t.id());
        return true;
      });
  ASSERT_TRUE(stream.ok()) << stream.status();
  EXPECT_FALSE(stream->request_id.empty());
  EXPECT_EQ(stream->final.usage().generated_tokens(), 6u);
  EXPECT_EQ(stream->final.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(streamed, std::vector<int32_t>(unary->token_ids().begin(), unary->token_ids().end()));
  EXPECT_EQ(text, unary->text());
}

TEST_F(ClientServerTest, CallbackCancelsStream) {
  step_delay_ms_ = 20;
  int chunks = 0;
  absl::StatusOr<StreamResult> stream =
      client_->Stream(TokenRequest({5, 6, 7}, 100), [&](const v1::GenerateStreamResponse&) {
        ++chunks;
        return false;
      });
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kCancelled) << stream.status();
  EXPECT_EQ(chunks, 1);
  step_delay_ms_ = 0;
  // The server frees the request: nothing stays running.
  EXPECT_TRUE(::subspace::testing::WaitFor([&] {
    absl::StatusOr<v1::CacheStats> stats = client_->GetCacheStats();
    return stats.ok() && stats->running() == 0 && stats->waiting() == 0;
  }));
}

TEST_F(ClientServerTest, DeadlineExceeded) {
  step_delay_ms_ = 20;
  ClientOptions options = options_;
  options.timeout = absl::Milliseconds(100);
  SubspaceClient client(options);
  absl::StatusOr<v1::GenerateResponse> response = client.Generate(TokenRequest({5, 6}, 100));
  EXPECT_EQ(response.status().code(), absl::StatusCode::kDeadlineExceeded) << response.status();
}

TEST_F(ClientServerTest, ServerErrorsKeepTheirCode) {
  v1::GenerateRequest request = TokenRequest({5}, 4);
  request.mutable_sampling()->set_temperature(-1);
  EXPECT_EQ(client_->Generate(request).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Stream(request, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetSession("no-such-session").status().code(), absl::StatusCode::kNotFound);

  ClientOptions nowhere;
  nowhere.server = "127.0.0.1:1";
  SubspaceClient unreachable(nowhere);
  EXPECT_EQ(unreachable.GetModelInfo().status().code(), absl::StatusCode::kUnavailable);
}

// Our generated grpc.health.v1 messages live in this process beside gRPC's built-in health
// service (upb inside), which the server answers with.
TEST_F(ClientServerTest, HealthIsServing) {
  using health_v1::HealthCheckResponse;
  absl::StatusOr<ServingStatus> health = client_->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthCheckResponse::SERVING);
  EXPECT_EQ(client_->Health("subspace.v1.Subspace").value_or(HealthCheckResponse::UNKNOWN),
            HealthCheckResponse::SERVING);
  EXPECT_EQ(client_->Health("no.such.Service").value_or(HealthCheckResponse::UNKNOWN),
            HealthCheckResponse::SERVICE_UNKNOWN);

  ClientOptions nowhere;
  nowhere.server = "127.0.0.1:1";
  SubspaceClient unreachable(nowhere);
  EXPECT_EQ(unreachable.Health().status().code(), absl::StatusCode::kUnavailable);
}

// Draining needs a server of its own: the suite's keeps serving the other tests.
TEST(ClientHealthTest, NotServingWhileDraining) {
  using health_v1::HealthCheckResponse;
  absl::StatusOr<std::unique_ptr<server::ServerApp>> app =
      server::ServerApp::Start(TestServerConfig());
  ASSERT_TRUE(app.ok()) << app.status();
  ClientOptions options;
  options.server = absl::StrCat("127.0.0.1:", (*app)->port());
  options.timeout = absl::Seconds(30);
  SubspaceClient client(options);
  EXPECT_EQ(client.Health().value_or(HealthCheckResponse::UNKNOWN), HealthCheckResponse::SERVING);
  (*app)->BeginDrain();
  EXPECT_EQ(client.Health().value_or(HealthCheckResponse::UNKNOWN),
            HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(client.Health("subspace.v1.Subspace").value_or(HealthCheckResponse::UNKNOWN),
            HealthCheckResponse::NOT_SERVING);
  EXPECT_TRUE((*app)->Shutdown());
}

TEST_F(ClientServerTest, SessionLifecycle) {
  absl::StatusOr<v1::Session> session = client_->CreateSession(30);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(session->idle_ttl_seconds(), 30u);
  EXPECT_EQ(session->session_id().size(), 32u);  // made by the client library
  {
    // A caller-chosen id: taken by the real server, and not twice.
    const std::string id = "lifecycle-test-0123456789abcdef0123";
    absl::StatusOr<v1::Session> chosen = client_->CreateSession(0, id);
    ASSERT_TRUE(chosen.ok()) << chosen.status();
    EXPECT_EQ(chosen->session_id(), id);
    EXPECT_EQ(client_->CreateSession(0, id).status().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_EQ(client_->CreateSession(0, "short").status().code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(client_->DeleteSession(id).ok());
  }
  v1::GenerateRequest request = TokenRequest({5, 6, 7}, 2);
  request.set_session_id(session->session_id());
  absl::StatusOr<v1::GenerateResponse> first = client_->Generate(request);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->session_id(), session->session_id());

  absl::StatusOr<std::vector<v1::Session>> sessions = client_->ListSessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  bool listed = false;
  for (const v1::Session& s : *sessions) listed |= s.session_id() == session->session_id();
  EXPECT_TRUE(listed);
  absl::StatusOr<v1::Session> got = client_->GetSession(session->session_id());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GT(got->tokens(), 0u);

  // Exported, deleted and imported again (a move to the same server): the cache comes back.
  absl::StatusOr<std::string> snapshot = client_->ExportSession(session->session_id());
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  ASSERT_TRUE(client_->DeleteSession(session->session_id()).ok());
  absl::StatusOr<v1::Session> back = client_->ImportSession(session->session_id(), *snapshot);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tokens(), got->tokens());
  EXPECT_EQ(back->cached_tokens(), got->cached_tokens());
  EXPECT_EQ(client_->ImportSession(session->session_id(), *snapshot).status().code(),
            absl::StatusCode::kAlreadyExists);

  ASSERT_TRUE(client_->DeleteSession(session->session_id()).ok());
  EXPECT_EQ(client_->GetSession(session->session_id()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Generate(request).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ExportSession(session->session_id()).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ClientServerTest, BenchRunsEveryRequestAndIsReproducible) {
  BenchConfig config;
  config.num_requests = 8;
  config.concurrency = 4;
  config.prompt_tokens = {4, 12};
  config.output_tokens = {2, 6};
  config.seed = 5;
  absl::StatusOr<BenchReport> report = RunBench(*client_, config);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->successful, 8);
  EXPECT_EQ(report->failed, 0);
  int64_t output = 0;
  for (const RequestResult& r : report->requests) {
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_GE(r.prompt_tokens, 4);
    EXPECT_LE(r.prompt_tokens, 12);
    EXPECT_GE(r.output_tokens, 2);  // ignore_eos: exactly as drawn
    EXPECT_LE(r.output_tokens, 6);
    EXPECT_LE(r.ttft, r.latency);
    output += r.output_tokens;
  }
  EXPECT_EQ(report->total_output_tokens, output);
  EXPECT_GT(report->output_throughput, 0);
  EXPECT_LE(report->ttft.p50_ms, report->ttft.p99_ms);

  config.request_rate = 500;  // paced; same seed, so the same lengths
  absl::StatusOr<BenchReport> again = RunBench(*client_, config);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->requests.size(), report->requests.size());
  for (size_t i = 0; i < report->requests.size(); ++i) {
    EXPECT_EQ(again->requests[i].prompt_tokens, report->requests[i].prompt_tokens) << i;
    EXPECT_EQ(again->requests[i].output_tokens, report->requests[i].output_tokens) << i;
  }

  const std::string table = FormatReportTable(*report);
  for (const char* row : {"Successful requests:", "TTFT", "TPOT", "ITL", "E2E"}) {
    EXPECT_NE(table.find(row), std::string::npos) << row;
  }
  google::protobuf::Struct json;  // the report is valid JSON with the documented keys
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(ReportToJson(*report), &json).ok());
  EXPECT_EQ(json.fields().at("successful").number_value(), 8);
  EXPECT_EQ(json.fields().at("requests").list_value().values_size(), 8);
  EXPECT_EQ(json.fields().at("config").struct_value().fields().at("request_rate").string_value(),
            "inf");
  EXPECT_GT(json.fields().at("e2e_ms").struct_value().fields().at("p99").number_value(), 0);
}

TEST_F(ClientServerTest, BenchRejectsLengthsBeyondTheContext) {
  absl::StatusOr<v1::ModelInfo> info = client_->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  BenchConfig config;
  config.num_requests = 1;
  config.prompt_tokens = {static_cast<int32_t>(info->context_length()),
                          static_cast<int32_t>(info->context_length())};
  config.output_tokens = {1, 1};
  EXPECT_EQ(RunBench(*client_, config).status().code(), absl::StatusCode::kInvalidArgument);
}

// Records the x-session-id header of each call; answers every call OK and empty.
class RecordingService final : public v1::Subspace::Service {
 public:
  std::vector<std::string> headers() {
    absl::MutexLock lock(&mu_);
    return headers_;
  }
  std::vector<std::string> created_ids() {
    absl::MutexLock lock(&mu_);
    return created_ids_;
  }

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest*,
                        v1::GenerateResponse*) override {
    return Record(context);
  }
  grpc::Status GenerateStream(grpc::ServerContext* context, const v1::GenerateRequest*,
                              grpc::ServerWriter<v1::GenerateStreamResponse>* writer) override {
    v1::GenerateStreamResponse final;
    final.mutable_final();
    writer->Write(final);
    return Record(context);
  }
  grpc::Status GetSession(grpc::ServerContext* context, const v1::GetSessionRequest*,
                          v1::Session*) override {
    return Record(context);
  }
  // Echoes the proposed id, as the real server does.
  grpc::Status CreateSession(grpc::ServerContext* context, const v1::CreateSessionRequest* request,
                             v1::Session* session) override {
    {
      absl::MutexLock lock(&mu_);
      created_ids_.push_back(request->session_id());
    }
    session->set_session_id(request->session_id());
    return Record(context);
  }
  grpc::Status DeleteSession(grpc::ServerContext* context, const v1::DeleteSessionRequest*,
                             v1::DeleteSessionResponse*) override {
    return Record(context);
  }

 private:
  grpc::Status Record(grpc::ServerContext* context) {
    const auto& md = context->client_metadata();
    auto it = md.find(kSessionIdHeader);
    absl::MutexLock lock(&mu_);
    headers_.push_back(it == md.end() ? "<none>"
                                      : std::string(it->second.data(), it->second.size()));
    return grpc::Status::OK;
  }

  absl::Mutex mu_;
  std::vector<std::string> headers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> created_ids_ ABSL_GUARDED_BY(mu_);  // CreateSessionRequest.session_id
};

TEST(SessionHeaderTest, SetExactlyWhenASessionIsNamed) {
  RecordingService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);

  ClientOptions options;
  options.server = absl::StrCat("127.0.0.1:", port);
  options.timeout = absl::Seconds(30);
  SubspaceClient client(options);
  v1::GenerateRequest request;
  request.set_text("x");
  ASSERT_TRUE(client.Generate(request).ok());
  request.set_session_id("s-1");
  ASSERT_TRUE(client.Generate(request).ok());
  ASSERT_TRUE(client.Stream(request, nullptr).ok());
  ASSERT_TRUE(client.GetSession("s-2").ok());
  ASSERT_TRUE(client.DeleteSession("s-3").ok());
  EXPECT_EQ(service.headers(), (std::vector<std::string>{"<none>", "s-1", "s-1", "s-2", "s-3"}));
  server->Shutdown();
}

// CreateSession makes the id client-side and sends it in the request and as the header, so an
// affine proxy routes the create like every later call of the session.
TEST(SessionHeaderTest, CreateSendsItsIdAsTheHeader) {
  RecordingService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  ClientOptions options;
  options.server = absl::StrCat("127.0.0.1:", port);
  options.timeout = absl::Seconds(30);
  SubspaceClient client(options);
  absl::StatusOr<v1::Session> made = client.CreateSession();
  ASSERT_TRUE(made.ok()) << made.status();
  absl::StatusOr<v1::Session> made2 = client.CreateSession(10);
  ASSERT_TRUE(made2.ok()) << made2.status();
  const std::string given = "caller-chosen_id-0123456789abcdefABCDEF";
  absl::StatusOr<v1::Session> chosen = client.CreateSession(0, given);
  ASSERT_TRUE(chosen.ok()) << chosen.status();

  const std::vector<std::string> ids = service.created_ids();
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(service.headers(), ids);
  EXPECT_EQ(ids[0], made->session_id());
  EXPECT_EQ(ids[1], made2->session_id());
  EXPECT_EQ(ids[2], given);
  EXPECT_NE(ids[0], ids[1]);
  for (const std::string& id : {ids[0], ids[1]}) {
    EXPECT_EQ(id.size(), 32u);
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
  }
  server->Shutdown();
}

}  // namespace
}  // namespace subspace::client
