// The operational surface of the server: grpc.health.v1 status through start-up, drain and
// shutdown; server reflection; the Prometheus endpoint (and `promtool check metrics` when
// promtool is installed); graceful drain; and the subspace-server binary's SIGTERM handling.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "server/server_app.h"
#include "tests/server/server_process.h"
#include "tests/server/server_test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::ChannelTo;
using ::subspace::testing::HealthCheck;
using ::subspace::testing::HttpGet;
using ::subspace::testing::MetricValue;
using ::subspace::testing::ReflectionListServices;
using ::subspace::testing::ServerProcess;
using ::subspace::testing::TestServerConfig;

constexpr int kServing = 1;
constexpr int kNotServing = 2;

class ServerOpsTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(/*metrics=*/false); }

  void StartServer(bool metrics) {
    app_.reset();
    server::ServerAppConfig config = TestServerConfig();
    if (metrics) config.metrics_port = 0;
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

  static v1::GenerateRequest Request(uint32_t max_new) {
    v1::GenerateRequest r;
    r.mutable_tokens()->add_ids(1);
    r.mutable_tokens()->add_ids(300);
    r.mutable_sampling()->set_max_new_tokens(max_new);
    r.mutable_sampling()->set_ignore_eos(true);
    return r;
  }

  std::atomic<int> step_delay_ms_{0};
  std::unique_ptr<server::ServerApp> app_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Subspace::Stub> stub_;
};

TEST_F(ServerOpsTest, HealthIsServing) {
  EXPECT_EQ(HealthCheck(channel_).value_or(-1), kServing);
  EXPECT_EQ(HealthCheck(channel_, "subspace.v1.Subspace").value_or(-1), kServing);
  EXPECT_EQ(HealthCheck(channel_, "no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ServerOpsTest, ReflectionListsTheService) {
  absl::StatusOr<std::vector<std::string>> services = ReflectionListServices(channel_);
  ASSERT_TRUE(services.ok()) << services.status();
  for (const char* name : {"subspace.v1.Subspace", "grpc.health.v1.Health"}) {
    EXPECT_NE(std::find(services->begin(), services->end(), name), services->end())
        << name << " not listed";
  }
}

TEST_F(ServerOpsTest, MetricsEndpoint) {
  EXPECT_EQ(app_->metrics_port(), -1);
  StartServer(/*metrics=*/true);
  ASSERT_GT(app_->metrics_port(), 0);
  {
    grpc::ClientContext context;
    v1::GenerateResponse response;
    ASSERT_TRUE(stub_->Generate(&context, Request(4), &response).ok());
  }
  {
    grpc::ClientContext context;
    v1::GenerateRequest bad = Request(4);
    bad.mutable_sampling()->set_top_p(2.0f);
    v1::GenerateResponse response;
    EXPECT_FALSE(stub_->Generate(&context, bad, &response).ok());
  }
  absl::StatusOr<std::pair<std::string, std::string>> got =
      HttpGet(app_->metrics_port(), "/metrics");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(absl::StrContains(got->first, "200")) << got->first;
  const std::string& body = got->second;
  for (const char* expected : {
           "subspace_requests_total{finish_reason=\"length\",status=\"OK\"} 1",
           "subspace_requests_total{finish_reason=\"none\",status=\"INVALID_ARGUMENT\"} 1",
           "subspace_prompt_tokens_total 2",
           "subspace_generation_tokens_total 4",
           "subspace_reused_tokens_total 0",
           "subspace_time_to_first_token_seconds_count 1",
           "subspace_inter_token_latency_seconds_count 3",
           "subspace_request_duration_seconds_count 1",
           "subspace_request_queue_seconds_count 1",
           "subspace_request_prompt_tokens_count 1",
           "subspace_request_generation_tokens_count 1",
           "subspace_batch_size_count",
           "subspace_step_duration_seconds_count",
           "subspace_requests_running 0",
           "subspace_requests_waiting 0",
           "subspace_sessions_active 0",
           "subspace_prompt_cache_entries 0",
           "subspace_prompt_cache_hits_total 0",
           "subspace_kv_pool_capacity_bytes",
           "subspace_kv_pool_used_bytes{kind=\"full\"} 0",
           "subspace_kv_pool_used_bytes{kind=\"compressed\"} 0",
           "subspace_kv_pool_used_bytes{kind=\"outlier\"} 0",
           "subspace_kv_cache_usage_ratio 0",
           "subspace_kv_cached_tokens 0",
           "subspace_preemptions_total 0",
           "subspace_session_tier_sessions{tier=\"host\"} 0",
           "subspace_session_tier_bytes{tier=\"disk\"} 0",
           "subspace_session_tier_restored_total{tier=\"host\"} 0",
           "subspace_session_tier_stored_total 0",
           "subspace_session_tier_dropped_total 0",
           "subspace_session_tier_restores_failed_total 0",
           "subspace_session_tier_tokens{tier=\"host\"} 0",
           "subspace_session_tier_restore_seconds_count{tier=\"disk\"} 0",
           "subspace_sessions_written_total{reason=\"checkpoint\"} 0",
           "subspace_session_snapshot_bytes_total{reason=\"drain\"} 0",
           "subspace_sessions_restored_total{result=\"refused\"} 0",
           "subspace_sessions_moved_total{direction=\"import\"} 0",
           "subspace_engine_steps_total",
       }) {
    EXPECT_TRUE(absl::StrContains(body, expected)) << "missing: " << expected;
  }
  // Nothing is cached once the request finished: the ratio is 0 by definition, not 0.5 or 1.
  absl::StatusOr<double> ratio = MetricValue(body, "subspace_kv_compression_ratio");
  ASSERT_TRUE(ratio.ok()) << ratio.status();
  EXPECT_EQ(*ratio, 0.0);

  const char* kPromtool = "/usr/bin/promtool";
  if (access(kPromtool, X_OK) != 0) GTEST_SKIP() << "promtool not installed; lint skipped";
  const std::string path = absl::StrCat(::testing::TempDir(), "/metrics_", getpid(), ".txt");
  {
    std::ofstream out(path);
    out << body;
  }
  FILE* pipe = popen(absl::StrCat(kPromtool, " check metrics < ", path, " 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string lint;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), pipe)) > 0;) lint.append(buf, n);
  const int rc = pclose(pipe);
  EXPECT_EQ(rc, 0) << lint;
  EXPECT_EQ(lint, "") << "promtool check metrics:\n" << lint;
  std::remove(path.c_str());
}

TEST_F(ServerOpsTest, DrainRefusesNewWorkAndFinishesRunning) {
  step_delay_ms_ = 2;
  grpc::ClientContext stream_context;
  auto reader = stub_->GenerateStream(&stream_context, Request(60));
  v1::GenerateStreamResponse first;
  ASSERT_TRUE(reader->Read(&first));

  app_->BeginDrain();
  EXPECT_EQ(HealthCheck(channel_).value_or(-1), kNotServing);
  EXPECT_EQ(HealthCheck(channel_, "subspace.v1.Subspace").value_or(-1), kNotServing);
  {
    grpc::ClientContext context;
    v1::GenerateResponse response;
    const grpc::Status status = stub_->Generate(&context, Request(2), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_TRUE(absl::StrContains(status.error_message(), "draining")) << status.error_message();
  }
  {
    grpc::ClientContext context;
    auto refused = stub_->GenerateStream(&context, Request(2));
    v1::GenerateStreamResponse m;
    EXPECT_FALSE(refused->Read(&m));
    EXPECT_EQ(refused->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  // Session and stats RPCs keep answering while draining.
  {
    grpc::ClientContext context;
    v1::CacheStats stats;
    EXPECT_TRUE(stub_->GetCacheStats(&context, v1::GetCacheStatsRequest(), &stats).ok());
  }

  // Shutdown waits for the running stream, which completes normally.
  std::thread shutdown([this] { EXPECT_TRUE(app_->Shutdown()); });
  int chunks = 1;
  v1::GenerateStreamResponse m;
  bool saw_final = false;
  while (reader->Read(&m)) {
    if (m.has_final()) {
      saw_final = true;
      EXPECT_EQ(m.final().usage().generated_tokens(), 60u);
    } else {
      ++chunks;
    }
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(saw_final);
  shutdown.join();
}

TEST_F(ServerOpsTest, ShutdownTimeoutCancelsWhatIsLeft) {
  app_.reset();
  server::ServerAppConfig config = TestServerConfig();
  config.drain_timeout = absl::Milliseconds(20);
  config.engine.on_step = [](const StepStats&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  };
  absl::StatusOr<std::unique_ptr<server::ServerApp>> app = server::ServerApp::Start(config);
  ASSERT_TRUE(app.ok()) << app.status();
  auto stub = v1::Subspace::NewStub(ChannelTo((*app)->port()));
  grpc::ClientContext context;
  auto reader = stub->GenerateStream(&context, Request(200));
  v1::GenerateStreamResponse m;
  ASSERT_TRUE(reader->Read(&m));
  EXPECT_FALSE((*app)->Shutdown());
  while (reader->Read(&m)) {
  }
  EXPECT_FALSE(reader->Finish().ok());
}

TEST(ServerAppConfigTest, BadConfigIsRejected) {
  server::ServerAppConfig config = TestServerConfig();
  config.block_size = 0;
  EXPECT_EQ(server::ServerApp::Start(config).status().code(), absl::StatusCode::kInvalidArgument);
  config = TestServerConfig();
  config.model_path = "/nonexistent/model.gguf";
  EXPECT_FALSE(server::ServerApp::Start(config).ok());
}

#ifdef SUBSPACE_SERVER_BIN
// The binary: dash-style flags, port 0 printed on stdout, SIGTERM drains and exits 0.
TEST(ServerBinaryTest, SigtermDrainsAndExitsZero) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> started = ServerProcess::Start(
      {SUBSPACE_SERVER_BIN, "--model", subspace::testing::TinyModelPath(), "--host", "127.0.0.1",
       "--port", "0", "--metrics-port", "0", "--http-port", "0", "--kv-cache-bytes", "1048576",
       "--drain-seconds", "5", "--log-level", "warn"},
      absl::Seconds(60));
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& server = **started;
  const int port = server.port();
  auto channel = ChannelTo(port);
  EXPECT_EQ(HealthCheck(channel).value_or(-1), kServing);
  {
    auto stub = v1::Subspace::NewStub(channel);
    grpc::ClientContext context;
    v1::GenerateRequest request;
    request.set_text("hello");
    request.mutable_sampling()->set_max_new_tokens(3);
    v1::GenerateResponse response;
    EXPECT_TRUE(stub->Generate(&context, request, &response).ok());
  }
  const int metrics_port = server.PortAfter("metrics port ");
  ASSERT_GT(metrics_port, 0) << server.line();
  absl::StatusOr<std::pair<std::string, std::string>> metrics = HttpGet(metrics_port, "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_TRUE(absl::StrContains(metrics->second, "subspace_requests_total{"));
  // The HTTP API answers on its own port, on the same engine.
  const int http_port = server.PortAfter("http port ");
  ASSERT_GT(http_port, 0) << server.line();
  absl::StatusOr<std::pair<std::string, std::string>> health = HttpGet(http_port, "/health");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(absl::StrContains(health->second, "\"status\":\"ok\"")) << health->second;
  ASSERT_TRUE(server.Signal(SIGTERM));
  absl::StatusOr<int> status = server.WaitExit(absl::Seconds(60));
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_TRUE(WIFEXITED(*status)) << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 0) << server.ReadStderr();
}

// Runs the binary on the tiny model with `flags` added, expecting it to exit by itself:
// {exit status, stderr}.
std::pair<int, std::string> RunServerUntilExit(const std::vector<std::string>& flags) {
  int err_pipe[2];
  if (pipe(err_pipe) != 0) return {-1, "pipe failed"};
  std::vector<std::string> args = {SUBSPACE_SERVER_BIN, "--model",
                                   subspace::testing::TinyModelPath()};
  for (const char* a :
       {"--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--http-port", "-1"}) {
    args.push_back(a);
  }
  args.insert(args.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return {-1, "fork failed"};
  if (pid == 0) {
    dup2(err_pipe[1], STDERR_FILENO);
    close(err_pipe[0]);
    close(err_pipe[1]);
    execv(SUBSPACE_SERVER_BIN, argv.data());
    _exit(127);
  }
  close(err_pipe[1]);
  std::string err;
  char buf[4096];
  for (ssize_t n; (n = read(err_pipe[0], buf, sizeof(buf))) > 0;) err.append(buf, n);
  close(err_pipe[0]);
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return {-1, err};
  return {WEXITSTATUS(status), err};
}

// Bad cache flags stop the binary at start with a message naming the flag: names are refused
// before anything starts (exit 2), values the model bounds once it is loaded (exit 1).
TEST(ServerBinaryTest, BadCacheFlagsExitNonZeroWithAMessage) {
  const struct {
    std::vector<std::string> flags;
    int exit_status;
    std::string message;
  } cases[] = {
      {{"--kv-cache", "paged"},
       2,
       "--kv-cache must be 'auto', 'full', 'compressed', 'quantized' or 'transform', got "
       "'paged'"},
      {{"--kv-cache=quantized", "--kv-dtype=f16"}, 2, "--kv-dtype must be 'q8_0' or 'q4_0'"},
      {{"--kv-dtype=q4_0"}, 2, "--kv-dtype applies to --kv-cache=quantized only"},
      {{"--kv-cache=quantized"},
       1,
       "a q8_0 KV cache needs a head_dim that is a multiple of 32, got 8"},
      {{"--kv-coeff-dtype=bf16"}, 2, "--kv-coeff-dtype must be 'fp16', 'int8', 'int4' or 'fp32'"},
      {{"--kv-window-tokens", "-1"}, 1, "--kv-window-tokens must be >= 0, got -1"},
      {{"--kv-outlier-threshold", "0"}, 1, "--kv-outlier-threshold must be a finite number > 0"},
      {{"--kv-rank-k", "9"}, 1, "--kv-rank-k must be in [1, 8] (the model's head_dim)"},
      {{"--kv-cache=compressed", "--block-size", "128"}, 1, "--block-size must be at most 64"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.flags[0]);
    const auto [status, err] = RunServerUntilExit(c.flags);
    EXPECT_EQ(status, c.exit_status) << err;
    EXPECT_TRUE(absl::StrContains(err, c.message)) << err;
  }
}
#endif

}  // namespace
}  // namespace subspace
