// Graceful drain under load, end to end: a real subspace-server process on the default model
// serves a fixed-concurrency mix of Generate and GenerateStream calls when it gets SIGTERM. No
// accepted request may be lost: every call either completes OK with all its tokens or is
// refused with UNAVAILABLE before the engine took it, none hangs, and the process exits 0. The
// server's own request log is the ledger that tells "refused" from "accepted, then lost".
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "tests/server/server_process.h"
#include "tests/server/server_test_util.h"

namespace subspace {
namespace {

constexpr char kDefaultModel[] = SUBSPACE_SOURCE_DIR "/models/subspace-tiny.gguf";

using ::subspace::testing::ChannelTo;
using ::subspace::testing::HealthCheck;
using ::subspace::testing::ServerProcess;
using ::subspace::testing::WaitFor;

constexpr int kWorkers = 8;
// Long enough that calls are certainly mid-generation when the signal lands (hundreds of ms
// each at this concurrency on the default model), short enough for the whole test to take
// seconds. Prompt + output stay far inside the model's 512-token context.
constexpr uint32_t kMaxNew = 128;
constexpr absl::Duration kCallDeadline = absl::Seconds(120);  // a call past it counts as hung

struct CallRecord {
  std::string request_id;
  bool stream = false;
  absl::Time start;
  absl::Time end;
  grpc::Status status;
  uint32_t tokens = 0;  // token ids received (unary) or summed over chunks (stream)
  bool has_final = false;
  v1::StreamFinal final;
};

// What the server's log says about a request id: finished (with a status) or rejected.
struct LoggedRequest {
  std::string status;  // "OK", "CANCELLED", ... or "rejected"
  int64_t generated = -1;
  bool after_drain = false;  // logged after "received <signal>; draining"
};

// Reads the request lines of the server log: "request ID session=S status=CODE finish=F ...
// generated_tokens=N ..." for finished requests, "request ID session=S rejected: ..." for refused.
std::map<std::string, LoggedRequest> ParseRequestLog(const std::string& log) {
  std::map<std::string, LoggedRequest> out;
  bool draining = false;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, "draining (a second signal")) draining = true;
    const size_t at = line.find("] request ");
    if (at == absl::string_view::npos) continue;
    std::vector<absl::string_view> words =
        absl::StrSplit(line.substr(at + 10), ' ', absl::SkipEmpty());
    if (words.size() < 3) continue;
    LoggedRequest r;
    r.after_drain = draining;
    if (words[2] == "rejected:") {
      r.status = "rejected";
    } else {
      for (absl::string_view w : words) {
        if (absl::ConsumePrefix(&w, "status=")) r.status = std::string(w);
        if (absl::ConsumePrefix(&w, "generated_tokens=")) (void)absl::SimpleAtoi(w, &r.generated);
      }
    }
    out[std::string(words[0])] = r;
  }
  return out;
}

v1::GenerateRequest Request(const std::string& id, int worker, int n) {
  static const char* kPrompts[] = {"In the beginning", "And God said, Let there be light",
                                   "Blessed are they that", "The words of the preacher"};
  v1::GenerateRequest r;
  r.set_request_id(id);
  r.set_text(kPrompts[(worker + n) % 4]);
  r.mutable_sampling()->set_max_new_tokens(kMaxNew);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

CallRecord Call(v1::Subspace::Stub& stub, const v1::GenerateRequest& request, bool stream) {
  CallRecord rec;
  rec.request_id = request.request_id();
  rec.stream = stream;
  rec.start = absl::Now();
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(rec.start + kCallDeadline));
  if (stream) {
    auto reader = stub.GenerateStream(&context, request);
    for (v1::GenerateStreamResponse m; reader->Read(&m);) {
      if (m.has_chunk()) rec.tokens += m.chunk().tokens_size();
      if (m.has_final()) {
        rec.has_final = true;
        rec.final = m.final();
      }
    }
    rec.status = reader->Finish();
  } else {
    v1::GenerateResponse response;
    rec.status = stub.Generate(&context, request, &response);
    rec.tokens = response.token_ids_size();
  }
  rec.end = absl::Now();
  return rec;
}

TEST(DrainTest, SigtermUnderLoadLosesNoAcceptedRequest) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> started =
      ServerProcess::Start({SUBSPACE_SERVER_BIN, "--model", kDefaultModel, "--host", "127.0.0.1",
                            "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
                            "--drain-seconds", "120", "--log-level", "info"},
                           absl::Seconds(120));
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& server = **started;
  ASSERT_EQ(HealthCheck(ChannelTo(server.port())).value_or(-1), 1);

  absl::Mutex mu;
  std::vector<CallRecord> records;
  std::atomic<int> completed_ok{0};
  // Each worker is one client: calls back to back until one is refused (UNAVAILABLE: the
  // server is draining or gone); even workers call Generate, odd ones GenerateStream.
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      auto stub = v1::Subspace::NewStub(ChannelTo(server.port()));
      for (int n = 0;; ++n) {
        CallRecord rec = Call(*stub, Request(absl::StrCat("drain-", w, "-", n), w, n), w % 2 == 1);
        const bool refused = rec.status.error_code() == grpc::StatusCode::UNAVAILABLE;
        if (rec.status.ok()) ++completed_ok;
        {
          absl::MutexLock lock(&mu);
          records.push_back(std::move(rec));
        }
        if (refused || n > 10000) break;
      }
    });
  }

  // Steady load first, then the signal while requests are certainly running.
  auto stub = v1::Subspace::NewStub(ChannelTo(server.port()));
  EXPECT_TRUE(WaitFor([&] { return completed_ok.load() >= 2 * kWorkers; }));
  EXPECT_TRUE(WaitFor([&] {
    grpc::ClientContext context;
    v1::CacheStats stats;
    return stub->GetCacheStats(&context, v1::GetCacheStatsRequest(), &stats).ok() &&
           stats.running() >= 2;
  }));
  const absl::Time sigterm_at = absl::Now();
  ASSERT_TRUE(server.Signal(SIGTERM));

  absl::StatusOr<int> exit_status = server.WaitExit(absl::Seconds(240));
  ASSERT_TRUE(exit_status.ok()) << exit_status.status();
  EXPECT_TRUE(WIFEXITED(*exit_status) && WEXITSTATUS(*exit_status) == 0)
      << "wait status " << *exit_status;
  for (std::thread& t : workers) t.join();  // bounded: every call has a deadline

  const std::string log = server.ReadStderr();
  EXPECT_TRUE(absl::StrContains(log, "server stopped")) << log;
  const std::map<std::string, LoggedRequest> logged = ParseRequestLog(log);

  int ok = 0, refused = 0, refused_draining = 0, in_flight_at_sigterm = 0;
  int cancelled_by_grpc_shutdown = 0;
  std::set<std::string> client_ok;
  for (const CallRecord& r : records) {
    SCOPED_TRACE(absl::StrCat(r.request_id, r.stream ? " (stream)" : " (unary)"));
    const auto it = logged.find(r.request_id);
    const grpc::StatusCode code = r.status.error_code();
    if (code == grpc::StatusCode::OK) {
      ++ok;
      client_ok.insert(r.request_id);
      if (r.start < sigterm_at && r.end > sigterm_at) ++in_flight_at_sigterm;
      EXPECT_EQ(r.tokens, kMaxNew);
      if (r.stream) {
        EXPECT_TRUE(r.has_final);
        EXPECT_EQ(r.final.usage().generated_tokens(), kMaxNew);
        EXPECT_EQ(r.final.finish_reason(), v1::FINISH_REASON_LENGTH);
      }
      ASSERT_NE(it, logged.end()) << "the server did not log a request the client got";
      EXPECT_EQ(it->second.status, "OK");
    } else if (code == grpc::StatusCode::UNAVAILABLE) {
      ++refused;
      if (absl::StrContains(r.status.error_message(), "draining")) ++refused_draining;
      // Refused before the engine took it, or never reached the server -- not accepted, then
      // dropped: that would show as a finished line in the log.
      if (it != logged.end()) {
        EXPECT_EQ(it->second.status, "rejected")
            << "accepted (" << it->second.status
            << ") but the client got UNAVAILABLE: " << r.status.error_message();
      }
    } else if (code == grpc::StatusCode::CANCELLED && it == logged.end() && r.start > sigterm_at &&
               r.status.error_message() == "CANCELLED") {
      // gRPC core's answer (RST_STREAM CANCEL; our handlers never say just "CANCELLED") to a
      // call that reaches the listener in the instant after the drained server begins
      // grpc::Server::Shutdown: it is zombied before any handler runs (grpc/grpc#41785). Never
      // accepted, so nothing was lost; docs/api.md (drain) says to retry it like UNAVAILABLE.
      ++cancelled_by_grpc_shutdown;
    } else {
      ADD_FAILURE() << "unexpected status " << code << ": " << r.status.error_message();
    }
  }
  // Every request the server finished reached its client whole.
  int finished_after_drain = 0;
  for (const auto& [id, r] : logged) {
    if (r.status == "rejected") continue;
    EXPECT_EQ(r.status, "OK") << id << ": drain must let accepted requests finish";
    EXPECT_EQ(r.generated, static_cast<int64_t>(kMaxNew)) << id;
    EXPECT_TRUE(client_ok.contains(id)) << id << " finished on the server but not at the client";
    if (r.after_drain) ++finished_after_drain;
  }
  EXPECT_GE(refused, kWorkers);  // each worker stops at its first refusal
  // The drain was exercised: requests running when the signal came finished after it.
  EXPECT_GE(finished_after_drain, 1);
  EXPECT_GE(in_flight_at_sigterm, 1);
  std::printf(
      "drain: %zu calls: %d OK (%d in flight at SIGTERM, %d finished after drain began), %d "
      "UNAVAILABLE (%d \"draining\"), %d refused by gRPC's shutdown as CANCELLED\n",
      records.size(), ok, in_flight_at_sigterm, finished_after_drain, refused, refused_draining,
      cancelled_by_grpc_shutdown);
  if (HasFailure()) std::printf("server log:\n%s\n", log.c_str());
}

}  // namespace
}  // namespace subspace
