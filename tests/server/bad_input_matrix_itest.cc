// The bad-input matrix: every bad or hostile request the API documents a status for, one row
// each, sent over gRPC to a fresh in-process server on the tiny random model (context 256). A
// row names the exact status code and a piece of its message; after every row the server must
// show it kept nothing: health SERVING, nothing running or queued, the KV pool at its idle level
// (the cache holds exactly what live sessions hold, and every block is free once they are
// deleted), and a normal Generate and GenerateStream still work. docs/api.md's "bad input ->
// status" table lists the same rows.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "server/server_app.h"
#include "tests/server/fault_injection.h"
#include "tests/server/server_test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::ChannelTo;
using ::subspace::testing::EngineGate;
using ::subspace::testing::HealthCheck;
using ::subspace::testing::kTestWait;
using ::subspace::testing::LengthDelimitedField;
using ::subspace::testing::RawStream;
using ::subspace::testing::RawUnary;
using ::subspace::testing::TcpProxy;
using ::subspace::testing::TestServerConfig;
using ::subspace::testing::WaitFor;

constexpr int kServing = 1;
constexpr int kContext = 256;  // the tiny model's context
// Long enough that a request which is not stopped runs far past the point where a row checks
// it was (kLongSteps steps of kStepDelay each once the gate opens: >= 5 s).
constexpr uint32_t kLongRequest = 200;
constexpr absl::Duration kStepDelay = absl::Milliseconds(25);

// What a row works with: the server, a stub on it and the engine gate.
struct Env {
  server::ServerApp* app;
  std::shared_ptr<grpc::Channel> channel;
  v1::Subspace::Stub* stub;
  EngineGate* gate;
};

std::chrono::system_clock::time_point In(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

v1::GenerateRequest Tokens(int n, uint32_t max_new) {
  v1::GenerateRequest r;
  r.mutable_tokens()->add_ids(1);                                        // BOS
  for (int i = 1; i < n; ++i) r.mutable_tokens()->add_ids(3 + i % 300);  // vocab 316
  r.mutable_sampling()->set_max_new_tokens(max_new);
  r.mutable_sampling()->set_ignore_eos(true);
  return r;
}

v1::GenerateRequest With(const std::function<void(v1::GenerateRequest&)>& mutate) {
  v1::GenerateRequest r = Tokens(3, 4);
  mutate(r);
  return r;
}

grpc::Status Unary(Env& env, const v1::GenerateRequest& request,
                   v1::GenerateResponse* response = nullptr) {
  grpc::ClientContext context;
  context.set_deadline(In(kTestWait));
  v1::GenerateResponse ignored;
  return env.stub->Generate(&context, request, response != nullptr ? response : &ignored);
}

struct StreamOutcome {
  grpc::Status status;
  int chunks = 0;
  uint32_t tokens = 0;  // over every chunk
  bool has_final = false;
  v1::StreamFinal final;
};

StreamOutcome DrainStream(grpc::ClientReader<v1::GenerateStreamResponse>& reader) {
  StreamOutcome out;
  for (v1::GenerateStreamResponse m; reader.Read(&m);) {
    if (m.has_chunk()) {
      ++out.chunks;
      out.tokens += m.chunk().tokens_size();
    } else if (m.has_final()) {
      out.has_final = true;
      out.final = m.final();
    }
  }
  out.status = reader.Finish();
  return out;
}

StreamOutcome Stream(Env& env, const v1::GenerateRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(In(kTestWait));
  auto reader = env.stub->GenerateStream(&context, request);
  return DrainStream(*reader);
}

// A request refused before it reaches the engine: Generate and GenerateStream must agree on
// the status, and the stream must carry no message. Returns Generate's status.
grpc::Status BothRefuse(Env& env, const v1::GenerateRequest& request) {
  grpc::Status unary = Unary(env, request);
  const StreamOutcome stream = Stream(env, request);
  EXPECT_EQ(stream.status.error_code(), unary.error_code()) << stream.status.error_message();
  EXPECT_EQ(stream.status.error_message(), unary.error_message());
  EXPECT_EQ(stream.chunks, 0);
  EXPECT_FALSE(stream.has_final);
  return unary;
}

// Hand-encoded request bytes through both Generate RPCs, as BothRefuse.
grpc::Status BothRefuseRaw(Env& env, const std::string& bytes) {
  grpc::Status unary = RawUnary(env.channel, "/subspace.v1.Subspace/Generate", bytes);
  int messages = -1;
  const grpc::Status stream =
      RawStream(env.channel, "/subspace.v1.Subspace/GenerateStream", bytes, &messages);
  EXPECT_EQ(stream.error_code(), unary.error_code()) << stream.error_message();
  EXPECT_EQ(stream.error_message(), unary.error_message());
  EXPECT_EQ(messages, 0);
  return unary;
}

// A valid request's bytes with `extra` appended: protobuf merges a repeated occurrence of a
// field, so this overrides or adds fields the typed API cannot express.
std::string WireWith(const std::string& extra) { return Tokens(3, 4).SerializeAsString() + extra; }

std::string CreateSession(Env& env) {
  grpc::ClientContext context;
  v1::Session session;
  const grpc::Status status =
      env.stub->CreateSession(&context, v1::CreateSessionRequest(), &session);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return session.session_id();
}

grpc::Status DeleteSession(Env& env, const std::string& id) {
  grpc::ClientContext context;
  v1::DeleteSessionRequest request;
  request.set_session_id(id);
  v1::DeleteSessionResponse response;
  return env.stub->DeleteSession(&context, request, &response);
}

v1::CacheStats CacheStats(Env& env) {
  grpc::ClientContext context;
  v1::CacheStats stats;
  EXPECT_TRUE(env.stub->GetCacheStats(&context, v1::GetCacheStatsRequest(), &stats).ok());
  return stats;
}

int64_t StepsTotal(Env& env) { return env.app->engine().Stats().steps_total; }

// Rows that stop a long request early: the gate holds the engine while the row acts, then lets
// it run slowly; a request the server failed to stop would run all kLongRequest steps.
void ReleaseSlowly(Env& env) {
  env.gate->SetStepDelay(kStepDelay);
  env.gate->Open();
}
void ExpectStoppedEarly(Env& env, int64_t steps_before) {
  EXPECT_TRUE(WaitFor([&] {
    const v1::CacheStats s = CacheStats(env);
    return s.running() == 0 && s.waiting() == 0;
  }));
  EXPECT_LT(StepsTotal(env) - steps_before, static_cast<int64_t>(kLongRequest) / 2)
      << "the server kept generating for a request that was stopped";
}

struct BadInputCase {
  std::string name;  // the gtest parameter name
  grpc::StatusCode code;
  std::string message;  // a substring of the status message
  std::function<grpc::Status(Env&)> run;
  std::function<void(server::ServerAppConfig&)> configure = nullptr;
};

// gtest prints a row by its name instead of its bytes.
void PrintTo(const BadInputCase& c, std::ostream* os) { *os << c.name; }

std::string Repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

void OneRunningOneQueued(server::ServerAppConfig& c) {
  c.engine.max_running = 1;
  c.engine.max_queue = 1;
}

// With one request running (held by the gate), a second one waits in the queue until the client
// cancels it or its deadline passes; then the first finishes. The second's status.
grpc::Status StopWhileQueued(Env& env, bool cancel) {
  env.gate->Close();
  grpc::ClientContext running_context;
  running_context.set_deadline(In(kTestWait));
  auto running = env.stub->GenerateStream(&running_context, Tokens(4, 20));
  v1::GenerateStreamResponse first;
  EXPECT_TRUE(running->Read(&first));
  grpc::ClientContext queued_context;
  const absl::Time deadline = absl::Now() + (cancel ? kTestWait : absl::Seconds(1));
  queued_context.set_deadline(absl::ToChronoTime(deadline));
  const v1::GenerateRequest queued_request = Tokens(5, 5);
  v1::GenerateResponse queued_response;
  std::promise<grpc::Status> queued;
  env.stub->async()->Generate(&queued_context, &queued_request, &queued_response,
                              [&queued](grpc::Status s) { queued.set_value(std::move(s)); });
  EXPECT_TRUE(WaitFor([&] { return env.app->engine().Stats().waiting == 1; }));
  if (cancel) {
    queued_context.TryCancel();
  } else {
    absl::SleepFor(deadline - absl::Now() + absl::Milliseconds(50));
  }
  grpc::Status status = queued.get_future().get();
  env.gate->Open();
  const StreamOutcome rest = DrainStream(*running);
  EXPECT_TRUE(rest.status.ok()) << rest.status.error_message();
  EXPECT_EQ(first.chunk().tokens_size() + rest.tokens, 20u);
  EXPECT_TRUE(WaitFor([&] { return env.app->engine().Stats().waiting == 0; }));
  return status;
}

std::vector<BadInputCase> Cases() {
  using grpc::StatusCode;
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const float kInf = std::numeric_limits<float>::infinity();
  auto refuse = [](const std::function<void(v1::GenerateRequest&)>& mutate) {
    return [mutate](Env& env) { return BothRefuse(env, With(mutate)); };
  };
  auto sampling = [](std::function<void(v1::SamplingParams&)> set) {
    return [set](Env& env) {
      return BothRefuse(env, With([&](v1::GenerateRequest& r) { set(*r.mutable_sampling()); }));
    };
  };
  auto raw = [](const std::string& bytes) {
    return [bytes](Env& env) { return BothRefuseRaw(env, bytes); };
  };

  return {
      // --- The prompt ---------------------------------------------------------------------
      {"EmptyText", StatusCode::INVALID_ARGUMENT, "text must not be empty",
       refuse([](v1::GenerateRequest& r) { r.set_text(""); })},
      {"NoPrompt", StatusCode::INVALID_ARGUMENT, "prompt is required: set text or tokens",
       refuse([](v1::GenerateRequest& r) { r.clear_prompt(); })},
      {"EmptyTokenList", StatusCode::INVALID_ARGUMENT, "tokens.ids must not be empty",
       refuse([](v1::GenerateRequest& r) { r.mutable_tokens()->clear_ids(); })},
      {"TextLongerThanContext", StatusCode::INVALID_ARGUMENT,
       "tokens, more than the context length 256",
       refuse([](v1::GenerateRequest& r) { r.set_text(Repeat(" the", 300)); })},
      {"TokensLongerThanContext", StatusCode::INVALID_ARGUMENT,
       "tokens.ids has 300 tokens, more than the context length 256",
       [](Env& env) { return BothRefuse(env, Tokens(300, 4)); }},
      {"PromptFillsContext", StatusCode::INVALID_ARGUMENT,
       "leave no room to generate in the context of 256",
       [](Env& env) { return BothRefuse(env, Tokens(kContext, 4)); }},
      // History + prompt past the context: refused, and the session keeps its cache.
      {"SessionHistoryPlusPromptPastContext", StatusCode::INVALID_ARGUMENT,
       "(session history 220 + prompt 40)",
       [](Env& env) {
         const std::string session = CreateSession(env);
         v1::GenerateRequest first = Tokens(200, 20);
         first.set_session_id(session);
         EXPECT_TRUE(Unary(env, first).ok());
         v1::GenerateRequest next = Tokens(40, 4);
         next.mutable_tokens()->set_ids(0, 300);  // a continuation has no BOS
         next.set_session_id(session);
         return BothRefuse(env, next);
       }},

      // --- max_new_tokens ---------------------------------------------------------------
      {"MaxNewTokensZero", StatusCode::INVALID_ARGUMENT,
       "sampling.max_new_tokens must be >= 1 (0 only prefills a session), got 0",
       sampling([](v1::SamplingParams& s) { s.set_max_new_tokens(0); })},
      // uint32 on the wire: a client encoding -1 (ten-byte varint) sends 4294967295.
      {"MaxNewTokensNegative", StatusCode::INVALID_ARGUMENT,
       "sampling.max_new_tokens must be at most the context length 256, got 4294967295",
       raw(WireWith(LengthDelimitedField(4, "\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")))},
      {"MaxNewTokensHuge", StatusCode::INVALID_ARGUMENT,
       "sampling.max_new_tokens must be at most the context length 256, got 1000000",
       sampling([](v1::SamplingParams& s) { s.set_max_new_tokens(1000000); })},
      // Within the context but past what the prompt leaves: clamped, not refused.
      {"MaxNewTokensPastContextLeftIsClamped", StatusCode::OK, "",
       [](Env& env) {
         v1::GenerateResponse response;
         grpc::Status status = Unary(env, Tokens(250, kContext), &response);
         EXPECT_EQ(response.token_ids_size(), kContext - 250);
         EXPECT_EQ(response.finish_reason(), v1::FINISH_REASON_LENGTH);
         const StreamOutcome stream = Stream(env, Tokens(250, kContext));
         EXPECT_TRUE(stream.status.ok()) << stream.status.error_message();
         EXPECT_EQ(stream.tokens, static_cast<uint32_t>(kContext - 250));
         return status;
       }},

      // --- Sampling -----------------------------------------------------------------------
      {"TemperatureNegative", StatusCode::INVALID_ARGUMENT,
       "sampling.temperature must be in [0, 100], got -1",
       sampling([](v1::SamplingParams& s) { s.set_temperature(-1.0f); })},
      {"TemperatureNaN", StatusCode::INVALID_ARGUMENT,
       "sampling.temperature must be in [0, 100], got nan",
       sampling([kNaN](v1::SamplingParams& s) { s.set_temperature(kNaN); })},
      {"TemperatureInfinite", StatusCode::INVALID_ARGUMENT,
       "sampling.temperature must be in [0, 100], got inf",
       sampling([kInf](v1::SamplingParams& s) { s.set_temperature(kInf); })},
      {"TopPZero", StatusCode::INVALID_ARGUMENT, "sampling.top_p must be in (0, 1], got 0",
       sampling([](v1::SamplingParams& s) { s.set_top_p(0.0f); })},
      {"TopPNegative", StatusCode::INVALID_ARGUMENT, "sampling.top_p must be in (0, 1], got -0.5",
       sampling([](v1::SamplingParams& s) { s.set_top_p(-0.5f); })},
      {"TopPAboveOne", StatusCode::INVALID_ARGUMENT, "sampling.top_p must be in (0, 1], got 1.5",
       sampling([](v1::SamplingParams& s) { s.set_top_p(1.5f); })},
      {"TopPNaN", StatusCode::INVALID_ARGUMENT, "sampling.top_p must be in (0, 1], got nan",
       sampling([kNaN](v1::SamplingParams& s) { s.set_top_p(kNaN); })},
      {"TopKNegative", StatusCode::INVALID_ARGUMENT, "sampling.top_k must be >= 0, got -1",
       sampling([](v1::SamplingParams& s) { s.set_top_k(-1); })},

      // --- Encoding and size --------------------------------------------------------------
      {"InvalidUtf8Text", StatusCode::INVALID_ARGUMENT,
       "text is not valid UTF-8 (bad byte at offset 4)",
       raw(LengthDelimitedField(1, "bad \xff text"))},
      {"InvalidUtf8StopSequence", StatusCode::INVALID_ARGUMENT,
       "sampling.stop[0] is not valid UTF-8 (bad byte at offset 0)",
       raw(WireWith(LengthDelimitedField(4, LengthDelimitedField(8, "\xc3("))))},
      {"InvalidUtf8SessionId", StatusCode::INVALID_ARGUMENT,
       "session_id is not valid UTF-8 (bad byte at offset 0)",
       raw(WireWith(LengthDelimitedField(3, "\xed\xa0\x80")))},  // a UTF-16 surrogate
      {"NotAProtobufMessage", StatusCode::INVALID_ARGUMENT,
       "request is not a valid subspace.v1.GenerateRequest message", raw("\xff\xff\xff\xff")},
      {"MessageOverReceiveLimit", StatusCode::RESOURCE_EXHAUSTED, "larger than max",
       [](Env& env) {
         return BothRefuse(
             env, With([](v1::GenerateRequest& r) { r.set_text(std::string(100 << 10, 'a')); }));
       },
       [](server::ServerAppConfig& c) { c.max_message_bytes = 64 << 10; }},

      // --- Sessions ---------------------------------------------------------------------
      {"UnknownSession", StatusCode::NOT_FOUND, "session no-such-session not found",
       refuse([](v1::GenerateRequest& r) { r.set_session_id("no-such-session"); })},
      {"UnknownSessionGetAndDelete", StatusCode::NOT_FOUND, "session no-such-session not found",
       [](Env& env) {
         grpc::ClientContext context;
         v1::GetSessionRequest get;
         get.set_session_id("no-such-session");
         v1::Session session;
         const grpc::Status got = env.stub->GetSession(&context, get, &session);
         EXPECT_EQ(got.error_code(), grpc::StatusCode::NOT_FOUND) << got.error_message();
         return DeleteSession(env, "no-such-session");
       }},
      {"DeletedSession", StatusCode::NOT_FOUND, "not found",
       [](Env& env) {
         const std::string session = CreateSession(env);
         v1::GenerateRequest request = Tokens(5, 6);
         request.set_session_id(session);
         EXPECT_TRUE(Unary(env, request).ok());
         EXPECT_TRUE(DeleteSession(env, session).ok());
         EXPECT_EQ(DeleteSession(env, session).error_code(), grpc::StatusCode::NOT_FOUND);
         return BothRefuse(env, request);
       }},
      // A session serves one request at a time; the one running finishes untouched.
      {"SecondRequestOnBusySession", StatusCode::FAILED_PRECONDITION, "is busy with request",
       [](Env& env) {
         const std::string session = CreateSession(env);
         v1::GenerateRequest request = Tokens(4, 40);
         request.set_session_id(session);
         env.gate->Close();
         grpc::ClientContext context;
         context.set_deadline(In(kTestWait));
         auto reader = env.stub->GenerateStream(&context, request);
         v1::GenerateStreamResponse first;
         EXPECT_TRUE(reader->Read(&first));
         v1::GenerateRequest second = Tokens(3, 4);
         second.mutable_tokens()->set_ids(0, 300);
         second.set_session_id(session);
         grpc::Status busy = BothRefuse(env, second);
         env.gate->Open();
         StreamOutcome rest = DrainStream(*reader);
         EXPECT_TRUE(rest.status.ok()) << rest.status.error_message();
         EXPECT_EQ(first.chunk().tokens_size() + rest.tokens, 40u);
         EXPECT_EQ(rest.final.usage().generated_tokens(), 40u);
         return busy;
       }},
      // DeleteSession cancels the request running on it: its stream gets a final message with
      // FINISH_REASON_CANCELLED, then CANCELLED.
      {"DeleteSessionWhileRunning", StatusCode::CANCELLED, "the request was cancelled",
       [](Env& env) {
         const std::string session = CreateSession(env);
         v1::GenerateRequest request = Tokens(4, kLongRequest);
         request.set_session_id(session);
         const int64_t steps = StepsTotal(env);
         env.gate->Close();
         grpc::ClientContext context;
         context.set_deadline(In(kTestWait));
         auto reader = env.stub->GenerateStream(&context, request);
         v1::GenerateStreamResponse first;
         EXPECT_TRUE(reader->Read(&first));
         EXPECT_TRUE(DeleteSession(env, session).ok());
         ReleaseSlowly(env);
         const StreamOutcome rest = DrainStream(*reader);
         EXPECT_TRUE(rest.has_final);
         EXPECT_EQ(rest.final.finish_reason(), v1::FINISH_REASON_CANCELLED);
         ExpectStoppedEarly(env, steps);
         return rest.status;
       }},
      // The client's CANCELLED comes at once; the engine reaps the request at its next step, so
      // until then the session is still busy (the gate holds that step back).
      {"SessionCallRightAfterCancel", StatusCode::FAILED_PRECONDITION, "is busy with request",
       [](Env& env) {
         const std::string session = CreateSession(env);
         v1::GenerateRequest request = Tokens(4, kLongRequest);
         request.set_session_id(session);
         const int64_t steps = StepsTotal(env);
         env.gate->Close();
         grpc::ClientContext context;
         context.set_deadline(In(kTestWait));
         auto reader = env.stub->GenerateStream(&context, request);
         v1::GenerateStreamResponse first;
         EXPECT_TRUE(reader->Read(&first));
         context.TryCancel();
         EXPECT_EQ(DrainStream(*reader).status.error_code(), grpc::StatusCode::CANCELLED);
         v1::GenerateRequest next = Tokens(3, 4);
         next.mutable_tokens()->set_ids(0, 300);
         next.set_session_id(session);
         grpc::Status busy = BothRefuse(env, next);
         ReleaseSlowly(env);
         ExpectStoppedEarly(env, steps);
         // Reaped: the session takes calls again, its history holding what was generated.
         EXPECT_TRUE(Unary(env, next).ok());
         return busy;
       }},
      {"TooManySessions", StatusCode::RESOURCE_EXHAUSTED, "too many sessions (max_sessions = 2)",
       [](Env& env) {
         CreateSession(env);
         CreateSession(env);
         grpc::ClientContext context;
         v1::Session session;
         return env.stub->CreateSession(&context, v1::CreateSessionRequest(), &session);
       },
       [](server::ServerAppConfig& c) { c.engine.max_sessions = 2; }},

      // --- Cancellation, deadlines, disconnects -----------------------------------------
      {"CancelMidStream", StatusCode::CANCELLED, "CANCELLED",
       [](Env& env) {
         const int64_t steps = StepsTotal(env);
         env.gate->Close();
         grpc::ClientContext context;
         context.set_deadline(In(kTestWait));
         auto reader = env.stub->GenerateStream(&context, Tokens(4, kLongRequest));
         v1::GenerateStreamResponse first;
         EXPECT_TRUE(reader->Read(&first));
         context.TryCancel();
         const StreamOutcome rest = DrainStream(*reader);
         ReleaseSlowly(env);
         ExpectStoppedEarly(env, steps);
         return rest.status;
       }},
      {"CancelUnary", StatusCode::CANCELLED, "CANCELLED",
       [](Env& env) {
         const int64_t steps = StepsTotal(env);
         env.gate->Close();
         grpc::ClientContext context;
         context.set_deadline(In(kTestWait));
         const v1::GenerateRequest request = Tokens(4, kLongRequest);
         v1::GenerateResponse response;
         std::promise<grpc::Status> done;
         env.stub->async()->Generate(&context, &request, &response,
                                     [&done](grpc::Status s) { done.set_value(std::move(s)); });
         EXPECT_TRUE(WaitFor([&] { return env.app->engine().Stats().running == 1; }));
         context.TryCancel();
         grpc::Status status = done.get_future().get();
         ReleaseSlowly(env);
         ExpectStoppedEarly(env, steps);
         return status;
       }},
      {"Deadline1msUnary", StatusCode::DEADLINE_EXCEEDED, "eadline",
       [](Env& env) {
         grpc::ClientContext context;
         context.set_deadline(In(absl::Milliseconds(1)));
         v1::GenerateResponse response;
         return env.stub->Generate(&context, Tokens(4, kLongRequest), &response);
       }},
      {"Deadline1msStream", StatusCode::DEADLINE_EXCEEDED, "eadline",
       [](Env& env) {
         grpc::ClientContext context;
         context.set_deadline(In(absl::Milliseconds(1)));
         auto reader = env.stub->GenerateStream(&context, Tokens(4, kLongRequest));
         return DrainStream(*reader).status;
       }},
      // The deadline passes while the request runs: the engine stops it and frees its blocks.
      {"DeadlinePassesMidStream", StatusCode::DEADLINE_EXCEEDED, "eadline",
       [](Env& env) {
         const int64_t steps = StepsTotal(env);
         env.gate->Close();
         grpc::ClientContext context;
         const absl::Time deadline = absl::Now() + absl::Seconds(2);
         context.set_deadline(absl::ToChronoTime(deadline));
         auto reader = env.stub->GenerateStream(&context, Tokens(4, kLongRequest));
         v1::GenerateStreamResponse first;
         reader->Read(&first);
         absl::SleepFor(deadline - absl::Now() + absl::Milliseconds(50));
         ReleaseSlowly(env);
         const StreamOutcome rest = DrainStream(*reader);
         ExpectStoppedEarly(env, steps);
         return rest.status;
       }},
      // The client's connection drops (a TCP reset mid-stream): the client sees UNAVAILABLE,
      // the server cancels the request and frees its blocks.
      {"ClientDisconnectMidStream", StatusCode::UNAVAILABLE, "",
       [](Env& env) {
         const int64_t steps = StepsTotal(env);
         TcpProxy proxy(env.app->port());
         auto stub = v1::Subspace::NewStub(ChannelTo(proxy.port()));
         env.gate->Close();
         grpc::ClientContext context;
         context.set_deadline(In(kTestWait));
         auto reader = stub->GenerateStream(&context, Tokens(4, kLongRequest));
         v1::GenerateStreamResponse first;
         EXPECT_TRUE(reader->Read(&first));
         EXPECT_EQ(CacheStats(env).running(), 1u);
         proxy.Kill();
         const StreamOutcome rest = DrainStream(*reader);
         ReleaseSlowly(env);
         ExpectStoppedEarly(env, steps);
         return rest.status;
       }},

      // --- Load limits --------------------------------------------------------------------
      // One running (held by the gate), one queued, the third refused; the two accepted finish.
      {"QueueFull", StatusCode::RESOURCE_EXHAUSTED, "request queue is full (1 waiting)",
       [](Env& env) {
         env.gate->Close();
         grpc::ClientContext running_context;
         running_context.set_deadline(In(kTestWait));
         auto running = env.stub->GenerateStream(&running_context, Tokens(4, 20));
         v1::GenerateStreamResponse first;
         EXPECT_TRUE(running->Read(&first));
         grpc::ClientContext queued_context;
         queued_context.set_deadline(In(kTestWait));
         const v1::GenerateRequest queued_request = Tokens(5, 5);
         v1::GenerateResponse queued_response;
         std::promise<grpc::Status> queued;
         env.stub->async()->Generate(&queued_context, &queued_request, &queued_response,
                                     [&queued](grpc::Status s) { queued.set_value(std::move(s)); });
         EXPECT_TRUE(WaitFor([&] { return env.app->engine().Stats().waiting == 1; }));
         grpc::Status refused = BothRefuse(env, Tokens(6, 5));
         env.gate->Open();
         const StreamOutcome rest = DrainStream(*running);
         EXPECT_TRUE(rest.status.ok()) << rest.status.error_message();
         EXPECT_EQ(first.chunk().tokens_size() + rest.tokens, 20u);
         const grpc::Status queued_status = queued.get_future().get();
         EXPECT_TRUE(queued_status.ok()) << queued_status.error_message();
         EXPECT_EQ(queued_response.token_ids_size(), 5);
         return refused;
       },
       OneRunningOneQueued},
      // A request stopped while it waits in the queue (never scheduled): it leaves the queue and
      // the one running finishes.
      {"CancelWhileQueued", StatusCode::CANCELLED, "CANCELLED",
       [](Env& env) { return StopWhileQueued(env, /*cancel=*/true); }, OneRunningOneQueued},
      {"DeadlinePassesWhileQueued", StatusCode::DEADLINE_EXCEEDED, "eadline",
       [](Env& env) { return StopWhileQueued(env, /*cancel=*/false); }, OneRunningOneQueued},
      {"RequestLargerThanThePool", StatusCode::RESOURCE_EXHAUSTED, "the whole KV cache pool holds",
       [](Env& env) { return BothRefuse(env, Tokens(200, 50)); },
       [](server::ServerAppConfig& c) { c.kv_cache_bytes = 16 << 10; }},
  };
}

class BadInputMatrixTest : public ::testing::TestWithParam<BadInputCase> {
 protected:
  void SetUp() override {
    server::ServerAppConfig config = TestServerConfig();
    config.engine.on_step = [this](const StepStats&) { gate_.OnStep(); };
    if (GetParam().configure) GetParam().configure(config);
    absl::StatusOr<std::unique_ptr<server::ServerApp>> app = server::ServerApp::Start(config);
    ASSERT_TRUE(app.ok()) << app.status();
    app_ = *std::move(app);
    channel_ = ChannelTo(app_->port());
    stub_ = v1::Subspace::NewStub(channel_);
    env_ = Env{app_.get(), channel_, stub_.get(), &gate_};
  }

  void TearDown() override {
    gate_.Open();  // a failed row may have left it closed
    if (app_ != nullptr) {
      EXPECT_TRUE(app_->Shutdown());
    }
  }

  std::vector<v1::Session> Sessions() {
    grpc::ClientContext context;
    v1::ListSessionsResponse list;
    EXPECT_TRUE(stub_->ListSessions(&context, v1::ListSessionsRequest(), &list).ok());
    return {list.sessions().begin(), list.sessions().end()};
  }

  // Nothing running or queued, and the cache holds exactly what the live sessions hold (every
  // block free when there are none). Frees happen on the engine thread, hence the poll.
  void ExpectIdleLevel() {
    v1::CacheStats stats;
    uint64_t session_tokens = 0;
    size_t sessions = 0;
    const bool idle = WaitFor([&] {
      stats = CacheStats(env_);
      const std::vector<v1::Session> list = Sessions();
      sessions = list.size();
      session_tokens = 0;
      for (const v1::Session& s : list) session_tokens += s.cached_tokens();
      return stats.running() == 0 && stats.waiting() == 0 && stats.sessions() == sessions &&
             stats.tokens_cached() == session_tokens &&
             (sessions > 0 || stats.blocks_free() == stats.blocks_total());
    });
    EXPECT_TRUE(idle) << "running " << stats.running() << ", waiting " << stats.waiting()
                      << ", tokens cached " << stats.tokens_cached() << " (sessions hold "
                      << session_tokens << " in " << sessions << "), blocks free "
                      << stats.blocks_free() << " of " << stats.blocks_total();
  }

  void ExpectNormalGenerateWorks() {
    v1::GenerateResponse response;
    const grpc::Status unary = Unary(env_, Tokens(3, 8), &response);
    EXPECT_TRUE(unary.ok()) << unary.error_message();
    EXPECT_EQ(response.token_ids_size(), 8);
    const StreamOutcome stream = Stream(env_, Tokens(3, 8));
    EXPECT_TRUE(stream.status.ok()) << stream.status.error_message();
    EXPECT_EQ(stream.tokens, 8u);
    EXPECT_TRUE(stream.has_final);
  }

  // Deletes what the row left and expects every block back in the pool.
  void ExpectAllFreeAfterDeletingSessions() {
    for (const v1::Session& s : Sessions()) {
      EXPECT_TRUE(DeleteSession(env_, s.session_id()).ok()) << s.session_id();
    }
    v1::CacheStats stats;
    EXPECT_TRUE(WaitFor([&] {
      stats = CacheStats(env_);
      return stats.sessions() == 0 && stats.tokens_cached() == 0 &&
             stats.blocks_free() == stats.blocks_total();
    })) << "blocks free "
        << stats.blocks_free() << " of " << stats.blocks_total() << ", " << stats.tokens_cached()
        << " tokens cached";
  }

  EngineGate gate_;
  std::unique_ptr<server::ServerApp> app_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Subspace::Stub> stub_;
  Env env_{};
};

TEST_P(BadInputMatrixTest, StatusThenServerStillIdleAndServing) {
  const BadInputCase& c = GetParam();
  const grpc::Status status = c.run(env_);
  RecordProperty("grpc_status", absl::StrCat(status.error_code(), ": ", status.error_message()));
  EXPECT_EQ(status.error_code(), c.code) << "message: " << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), c.message))
      << "message: \"" << status.error_message() << "\", expected to contain \"" << c.message
      << "\"";
  gate_.Open();
  gate_.SetStepDelay(absl::ZeroDuration());

  EXPECT_EQ(HealthCheck(channel_).value_or(-1), kServing);
  ExpectIdleLevel();
  ExpectNormalGenerateWorks();
  ExpectIdleLevel();
  ExpectAllFreeAfterDeletingSessions();
}

INSTANTIATE_TEST_SUITE_P(Matrix, BadInputMatrixTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<BadInputCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace subspace
