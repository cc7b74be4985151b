// The HTTP API of an in-process server on the tiny model, through cpp-httplib's client and raw
// sockets: the same greedy answer as gRPC, the bad-input matrix (each a 4xx with an OpenAI error
// body, the server serving on), bearer tokens, a full queue (429 with Retry-After), draining
// (503), a client that disconnects mid-stream or before a unary answer (its request cancelled
// at once) and /metrics.
// The official OpenAI client drives the same API in tests/http/openai_client_test.mjs.
#include <httplib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server/cache_server.h"
#include "tests/server/server_test_util.h"

namespace subspace::testing {
namespace {

using Json = nlohmann::json;

constexpr char kChatMl[] =
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

std::string WriteTemp(const std::string& name, const std::string& text) {
  std::string path = absl::StrCat(::testing::TempDir(), "/", name, "_", getpid());
  std::ofstream(path) << text;
  return path;
}

server::ServerAppConfig HttpConfig() {
  server::ServerAppConfig c = TestServerConfig();
  c.http_port = 0;
  c.chat_template_path = WriteTemp("chatml.jinja", kChatMl);
  return c;
}

// One raw HTTP/1.1 exchange on a fresh connection: the whole response as the server wrote it.
std::string RawExchange(int port, const std::string& request) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return "";
  // The whole request, not half-closed after it: the server takes a peer that closed its side
  // for one that went away and answers nothing (cpp-httplib checks before writing).
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) response.append(buf, n);
  close(fd);
  return response;
}

std::string Post(const std::string& path, const std::string& body) {
  return absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n",
                      "Content-Type: application/json\r\nContent-Length: ", body.size(), "\r\n\r\n",
                      body);
}

class HttpApiTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(HttpConfig()); }
  // Closes the client's connection `fd` to a running request and expects the request
  // cancelled soon after: seen within the poll interval and a step or two, far sooner than the
  // second it had left (a loose bound: the machine may be loaded), its blocks back, and the
  // metrics saying CANCELLED, not run to its end.
  void HangUpAndExpectCancelled(int fd) {
    close(fd);
    const absl::Time left = absl::Now();
    const absl::Time deadline = left + absl::Seconds(5);
    while (server_->app().engine().Stats().running > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(server_->app().engine().Stats().running, 0);
    // Seen within the stream's poll interval and a step or two, far sooner than the second the
    // request had left (a loose bound: the machine may be loaded).
    EXPECT_LT(absl::Now() - left, absl::Milliseconds(500));
    // Its blocks are back: nothing of it stays cached.
    const EngineStats stats = server_->app().engine().Stats();
    EXPECT_EQ(stats.cache.blocks_free, stats.cache.blocks_total);
    // It was cancelled, not run to its end. The engine counts it out of `running` before the
    // observer records its finish, so the metric may lag by a moment.
    const auto cancelled = [this] {
      return MetricValue(client_->Get("/metrics")->body,
                         "subspace_requests_total{finish_reason=\"cancelled\","
                         "status=\"CANCELLED\"}")
          .value_or(0);
    };
    while (cancelled() != 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
    const std::string metrics = client_->Get("/metrics")->body;
    EXPECT_EQ(MetricValue(metrics,
                          "subspace_requests_total{finish_reason=\"cancelled\","
                          "status=\"CANCELLED\"}")
                  .value_or(0),
              1)
        << metrics;
  }

  void Start(const server::ServerAppConfig& config) {
    server_ = std::make_unique<InProcessServer>(config);
    ASSERT_TRUE(server_->ok());
    port_ = server_->app().http_port();
    ASSERT_GT(port_, 0);
    client_ = std::make_unique<httplib::Client>("127.0.0.1", port_);
    client_->set_read_timeout(std::chrono::seconds(60));
  }
  httplib::Result PostJson(const std::string& path, const Json& body) {
    return client_->Post(path.c_str(), body.dump(), "application/json");
  }
  static Json Body(const httplib::Result& r) { return Json::parse(r->body); }

  std::unique_ptr<InProcessServer> server_;
  std::unique_ptr<httplib::Client> client_;
  int port_ = 0;
};

TEST_F(HttpApiTest, GreedyAnswerEqualsGrpc) {
  v1::GenerateRequest grpc_request;
  grpc_request.set_text("Once upon a time");
  grpc_request.mutable_sampling()->set_max_new_tokens(12);
  grpc_request.mutable_sampling()->set_ignore_eos(true);
  const v1::GenerateResponse grpc_answer = server_->Generate(grpc_request);

  const std::string id = Body(client_->Get("/v1/models"))["data"][0]["id"];
  // The model file's name.
  EXPECT_EQ(id, std::filesystem::path(TinyModelPath()).stem().string());
  httplib::Result r = PostJson("/v1/completions", {{"model", id},
                                                   {"prompt", "Once upon a time"},
                                                   {"max_tokens", 12},
                                                   {"temperature", 0},
                                                   {"ignore_eos", true}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const Json answer = Body(r);
  EXPECT_EQ(answer["choices"][0]["text"], grpc_answer.text());
  EXPECT_EQ(answer["usage"]["completion_tokens"], 12);
  EXPECT_EQ(answer["usage"]["prompt_tokens"], grpc_answer.usage().prompt_tokens());

  // The stream's text is the same.
  r = PostJson("/v1/completions", {{"model", id},
                                   {"prompt", "Once upon a time"},
                                   {"max_tokens", 12},
                                   {"temperature", 0},
                                   {"ignore_eos", true},
                                   {"stream", true}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
  std::string text;
  int events = 0;
  for (const std::string& event :
       std::vector<std::string>(absl::StrSplit(r->body, "\n\n", absl::SkipEmpty()))) {
    ASSERT_TRUE(absl::StartsWith(event, "data: ")) << event;
    ++events;
    if (event == "data: [DONE]") continue;
    text += Json::parse(event.substr(6))["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, grpc_answer.text());
  EXPECT_GE(events, 3);
  EXPECT_TRUE(absl::EndsWith(r->body, "data: [DONE]\n\n"));
}

TEST_F(HttpApiTest, ChatUsesTheTemplate) {
  const std::string id = Body(client_->Get("/v1/models"))["data"][0]["id"];
  v1::ChatRequest grpc_chat;
  v1::ChatMessage* m = grpc_chat.add_messages();
  m->set_role("user");
  m->set_content("Hello");
  grpc_chat.mutable_sampling()->set_max_new_tokens(6);
  grpc_chat.mutable_sampling()->set_ignore_eos(true);
  grpc::ClientContext context;
  v1::GenerateResponse grpc_answer;
  ASSERT_TRUE(v1::Subspace::NewStub(ChannelTo(server_->app().port()))
                  ->Chat(&context, grpc_chat, &grpc_answer)
                  .ok());
  httplib::Result r =
      PostJson("/v1/chat/completions", {{"model", id},
                                        {"messages", {{{"role", "user"}, {"content", "Hello"}}}},
                                        {"max_tokens", 6},
                                        {"temperature", 0},
                                        {"ignore_eos", true}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(Body(r)["choices"][0]["message"]["content"], grpc_answer.text());
  EXPECT_EQ(Body(r)["usage"]["prompt_tokens"], grpc_answer.usage().prompt_tokens());
}

// Every malformed request: a 4xx with an OpenAI error body, and the server keeps serving.
TEST_F(HttpApiTest, BadInputMatrix) {
  const std::string id = Body(client_->Get("/v1/models"))["data"][0]["id"];
  const std::string model = absl::StrCat("\"model\": \"", id, "\"");
  const struct {
    std::string request;  // raw HTTP
    int status;
    std::string message;  // a substring of error.message ("" when the library answers)
  } cases[] = {
      {Post("/v1/chat/completions", "{"), 400, "not valid JSON"},
      {Post("/v1/chat/completions", "null"), 400, "must be a JSON object"},
      {Post("/v1/completions", absl::StrCat("{", model, ", \"prompt\": 7}")), 400,
       "prompt must be a string or an array"},
      {Post("/v1/completions",
            absl::StrCat("{", model, ", \"prompt\": \"a\", \"max_tokens\": ", "1e999}")),
       400, "not valid JSON"},
      {Post("/v1/completions",
            absl::StrCat("{", model, ", \"prompt\": \"a\", \"max_tokens\": 1000000}")),
       400, "max_tokens must be at most the context length"},
      {Post("/v1/completions", absl::StrCat("{", model, ", \"prompt\": \"a\", \"seed\": ",
                                            "123456789012345678901234567890}")),
       400, "seed must be an integer"},
      {Post("/v1/completions", absl::StrCat("{", model, ", \"prompt\": \"a\", \"x\": 1}")), 400,
       "unknown field 'x'"},
      {Post("/v1/completions", absl::StrCat("{", model, ", \"prompt\": \"\xc3\x28\"}")), 400,
       "not valid JSON"},
      {Post("/v1/completions", absl::StrCat("{", model, ", \"prompt\": \"\"}")), 400,
       "prompt must not be empty"},
      {Post("/v1/completions", absl::StrCat("{", model, ", \"prompt\": [99999999]}")), 400,
       "prompt[0] must be in [0, "},
      {Post("/v1/chat/completions",
            absl::StrCat("{", model,
                         ", \"messages\": [{\"role\": \"robot\", \"content\": "
                         "\"x\"}]}")),
       400, "role"},
      {Post("/v1/completions",
            absl::StrCat("{", model, ", \"prompt\": \"a\", \"session_id\": ", "\"nope\"}")),
       404, "session"},
      {Post("/v1/completions", std::string(40, '[') + std::string(40, ']')), 400, "nests deeper"},
      // A body past --max-message-bytes.
      {Post("/v1/completions", std::string((4 << 20) + 1, ' ')), 413, ""},
      {"GET /v1/nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404, ""},
      {"DELETE /v1/sessions/%00 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 400,
       "session id"},
      {"GARBAGE\r\n\r\n", 400, ""},
  };
  for (const auto& c : cases) {
    const std::string response = RawExchange(port_, c.request);
    const std::string shown = c.request.substr(0, 120);
    ASSERT_TRUE(absl::StartsWith(response, absl::StrCat("HTTP/1.1 ", c.status, " ")))
        << shown << "\n-> " << response.substr(0, 300);
    const size_t body_at = response.find("\r\n\r\n");
    ASSERT_NE(body_at, std::string::npos);
    const Json body = Json::parse(response.substr(body_at + 4), nullptr, false);
    ASSERT_FALSE(body.is_discarded()) << shown << "\n-> " << response;
    ASSERT_TRUE(body["error"]["message"].is_string()) << response;
    EXPECT_TRUE(absl::StrContains(body["error"]["message"].get<std::string>(), c.message))
        << shown << "\n-> " << body.dump();
  }
  // A body cut short: the client promises more than it sends and closes. Nothing comes back but
  // the connection's end, and the server serves the next request.
  {
    const int fd = ConnectLoopback(port_);
    ASSERT_GE(fd, 0);
    const std::string cut =
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mo";
    ASSERT_EQ(send(fd, cut.data(), cut.size(), MSG_NOSIGNAL), static_cast<ssize_t>(cut.size()));
    close(fd);
  }
  httplib::Result r =
      PostJson("/v1/completions", {{"model", id}, {"prompt", "a"}, {"max_tokens", 2}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(server_->app().engine().Stats().running, 0);
}

TEST_F(HttpApiTest, SessionsOverHttp) {
  const std::string id = Body(client_->Get("/v1/models"))["data"][0]["id"];
  httplib::Result created = client_->Post("/v1/sessions", "", "application/json");
  ASSERT_TRUE(created);
  ASSERT_EQ(created->status, 200) << created->body;
  const std::string session = Body(created)["id"];
  Json request = {{"model", id},      {"prompt", "Once upon"}, {"max_tokens", 4},
                  {"temperature", 0}, {"session_id", session}, {"ignore_eos", true}};
  httplib::Result first = PostJson("/v1/completions", request);
  ASSERT_EQ(first->status, 200) << first->body;
  EXPECT_EQ(Body(first)["session_id"], session);
  request["prompt"] = " a time";
  httplib::Result second = PostJson("/v1/completions", request);
  ASSERT_EQ(second->status, 200) << second->body;
  // The second turn continues the first: its cache is reused, not prefilled again.
  EXPECT_GT(Body(second)["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 0);
  const Json info = Body(client_->Get(("/v1/sessions/" + session).c_str()));
  const Json list = Body(client_->Get("/v1/sessions"));
  ASSERT_EQ(list["data"].size(), 1u);
  EXPECT_EQ(list["data"][0], info);
  EXPECT_FALSE(first->get_header_value("X-Request-Id").empty());
  EXPECT_EQ("cmpl-" + first->get_header_value("X-Request-Id"), Body(first)["id"]);
  EXPECT_EQ(info["tokens"], Body(first)["usage"]["total_tokens"].get<int>() +
                                Body(second)["usage"]["total_tokens"].get<int>());
  // max_tokens 0 only prefills: a new session warmed with a document, nothing generated.
  const std::string warm = Body(client_->Post("/v1/sessions", "{}", "application/json"))["id"];
  httplib::Result warmed = PostJson("/v1/completions", {{"model", id},
                                                        {"prompt", "Once upon a time there was"},
                                                        {"max_tokens", 0},
                                                        {"session_id", warm}});
  ASSERT_EQ(warmed->status, 200) << warmed->body;
  EXPECT_EQ(Body(warmed)["choices"][0]["text"], "");
  EXPECT_EQ(Body(warmed)["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(Body(warmed)["usage"]["completion_tokens"], 0);
  const Json warm_info = Body(client_->Get(("/v1/sessions/" + warm).c_str()));
  EXPECT_EQ(warm_info["tokens"], Body(warmed)["usage"]["prompt_tokens"]);
  EXPECT_EQ(warm_info["cached_tokens"], warm_info["tokens"]);
  httplib::Result nothing =
      PostJson("/v1/completions", {{"model", id}, {"prompt", "a"}, {"max_tokens", 0}});
  ASSERT_EQ(nothing->status, 400);
  EXPECT_EQ(Body(nothing)["error"]["message"],
            "max_tokens must be >= 1 (0 only prefills a session), got 0");
  EXPECT_EQ(client_->Delete(("/v1/sessions/" + session).c_str())->status, 200);
  EXPECT_EQ(client_->Get(("/v1/sessions/" + session).c_str())->status, 404);
  EXPECT_EQ(PostJson("/v1/completions", request)->status, 404);
}

// A session moved over HTTP: its snapshot read, the session deleted, the snapshot put back
// (another replica would do the same), and the next turn continues as it would have, its cache
// reused. Damaged, foreign-id and duplicate snapshots are refused with a 4xx naming why.
TEST_F(HttpApiTest, SessionSnapshotsMoveASession) {
  const std::string id = Body(client_->Get("/v1/models"))["data"][0]["id"];
  const std::string session = Body(client_->Post("/v1/sessions", "{}", "application/json"))["id"];
  Json request = {{"model", id},      {"prompt", "Once upon a time"}, {"max_tokens", 6},
                  {"temperature", 0}, {"session_id", session},        {"ignore_eos", true}};
  ASSERT_EQ(PostJson("/v1/completions", request)->status, 200);
  const Json before = Body(client_->Get(("/v1/sessions/" + session).c_str()));
  const std::string path = "/v1/sessions/" + session + "/snapshot";
  httplib::Result snapshot = client_->Get(path.c_str());
  ASSERT_TRUE(snapshot);
  ASSERT_EQ(snapshot->status, 200) << snapshot->body;
  EXPECT_EQ(snapshot->get_header_value("Content-Type"), "application/octet-stream");
  const std::string bytes = snapshot->body;
  EXPECT_EQ(bytes.substr(0, 16), "SUBSPACE-SESSION");

  // What the next turn gives without the move.
  const std::string other = Body(client_->Post("/v1/sessions", "{}", "application/json"))["id"];
  request["session_id"] = other;
  ASSERT_EQ(PostJson("/v1/completions", request)->status, 200);
  request["prompt"] = " there was";
  const Json want = Body(PostJson("/v1/completions", request));

  ASSERT_EQ(client_->Delete(("/v1/sessions/" + session).c_str())->status, 200);
  httplib::Result put = client_->Put(path.c_str(), bytes, "application/octet-stream");
  ASSERT_EQ(put->status, 200) << put->body;
  EXPECT_EQ(Body(put)["id"], session);
  EXPECT_EQ(Body(put)["tokens"], before["tokens"]);
  EXPECT_EQ(Body(put)["cached_tokens"], before["cached_tokens"]);
  request["session_id"] = session;
  const Json got = Body(PostJson("/v1/completions", request));
  EXPECT_EQ(got["choices"][0]["text"], want["choices"][0]["text"]);
  EXPECT_EQ(got["usage"]["prompt_tokens_details"]["cached_tokens"], before["cached_tokens"]);

  EXPECT_EQ(client_->Put(path.c_str(), bytes, "application/octet-stream")->status, 409);
  httplib::Result damaged =
      client_->Put(path.c_str(), bytes.substr(0, bytes.size() / 2), "application/octet-stream");
  EXPECT_EQ(damaged->status, 400);
  EXPECT_NE(Body(damaged)["error"]["message"].get<std::string>().find("snapshot: "),
            std::string::npos);
  const std::string elsewhere = "/v1/sessions/" + other + "/snapshot";
  EXPECT_EQ(client_->Put(elsewhere.c_str(), bytes, "application/octet-stream")->status, 400);
  EXPECT_EQ(client_->Get("/v1/sessions/no-such-session-id-0123456789abcdef/snapshot")->status, 404);
}

TEST_F(HttpApiTest, ClientThatLeavesMidStreamIsCancelledAtOnce) {
  // Every engine step takes at least 5 ms, so the 200 tokens asked for take a second: the
  // request cannot end on its own before the client's departure is seen.
  server::ServerAppConfig config = HttpConfig();
  config.engine.on_step = [](const StepStats&) { absl::SleepFor(absl::Milliseconds(5)); };
  Start(config);
  const std::string id = Body(client_->Get("/v1/models"))["data"][0]["id"];
  const Json body = {
      {"model", id}, {"prompt", "a"}, {"max_tokens", 200}, {"stream", true}, {"ignore_eos", true}};
  const int fd = ConnectLoopback(port_);
  ASSERT_GE(fd, 0);
  const std::string request = Post("/v1/completions", body.dump());
  ASSERT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  // Read until the first token's event, then hang up.
  std::string seen;
  char buf[256];
  while (!absl::StrContains(seen, "\"text\"")) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0);
    seen.append(buf, n);
  }
  HangUpAndExpectCancelled(fd);
}

TEST_F(HttpApiTest, UnaryRequestWhoseClientLeavesIsCancelled) {
  // As above, but not streamed: the client sends the request and hangs up before any answer.
  server::ServerAppConfig config = HttpConfig();
  config.engine.on_step = [](const StepStats&) { absl::SleepFor(absl::Milliseconds(5)); };
  Start(config);
  const std::string id = Body(client_->Get("/v1/models"))["data"][0]["id"];
  const Json body = {{"model", id}, {"prompt", "a"}, {"max_tokens", 200}, {"ignore_eos", true}};
  const int fd = ConnectLoopback(port_);
  ASSERT_GE(fd, 0);
  const std::string request = Post("/v1/completions", body.dump());
  ASSERT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  // Hang up once the request is running.
  const absl::Time started = absl::Now() + absl::Seconds(5);
  while (server_->app().engine().Stats().running == 0 && absl::Now() < started) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(server_->app().engine().Stats().running, 1);
  HangUpAndExpectCancelled(fd);
  // A unary client that stays gets its whole answer, as before.
  httplib::Result kept = client_->Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(kept);
  EXPECT_EQ(kept->status, 200) << kept->body;
  EXPECT_EQ(Body(kept)["usage"]["completion_tokens"], 200);
}

TEST_F(HttpApiTest, HealthAndMetrics) {
  httplib::Result health = client_->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(Body(health)["status"], "ok");
  httplib::Result metrics = client_->Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_TRUE(absl::StrContains(metrics->body, "subspace_requests_running"));
  server_->app().BeginDrain();
  health = client_->Get("/health");
  EXPECT_EQ(health->status, 503);
  EXPECT_EQ(Body(health)["status"], "draining");
  const std::string id = Body(client_->Get("/v1/models"))["data"][0]["id"];
  httplib::Result r = PostJson("/v1/completions", {{"model", id}, {"prompt", "a"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_TRUE(absl::StrContains(Body(r)["error"]["message"].get<std::string>(), "draining"));
}

TEST(HttpApiAuthTest, BearerTokens) {
  server::ServerAppConfig config = HttpConfig();
  config.auth_tokens_path = WriteTemp("tokens", "http-api-test-token-0123456789\n");
  InProcessServer server(config);
  ASSERT_TRUE(server.ok());
  httplib::Client client("127.0.0.1", server.app().http_port());
  httplib::Result r = client.Get("/v1/models");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(r->get_header_value("WWW-Authenticate"), "Bearer");
  EXPECT_EQ(Json::parse(r->body)["error"]["type"], "authentication_error");
  client.set_bearer_token_auth("wrong-token-wrong-token");
  EXPECT_EQ(client.Get("/v1/models")->status, 401);
  client.set_bearer_token_auth("http-api-test-token-0123456789");
  EXPECT_EQ(client.Get("/v1/models")->status, 200);
  // Health needs no token (orchestrators probe it).
  httplib::Client anonymous("127.0.0.1", server.app().http_port());
  EXPECT_EQ(anonymous.Get("/health")->status, 200);
}

TEST(HttpApiQueueTest, FullQueueIs429WithRetryAfter) {
  server::ServerAppConfig config = HttpConfig();
  config.engine.max_running = 1;
  config.engine.max_queue = 1;
  InProcessServer server(config);
  ASSERT_TRUE(server.ok());
  httplib::Client client("127.0.0.1", server.app().http_port());
  const std::string id = Json::parse(client.Get("/v1/models")->body)["data"][0]["id"];
  // Eight long requests at once for one running slot and one queue place: some are refused.
  constexpr int kRequests = 8;
  std::vector<int> statuses(kRequests, 0);
  std::vector<std::string> retry_after(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      httplib::Client c("127.0.0.1", server.app().http_port());
      c.set_read_timeout(std::chrono::seconds(60));
      httplib::Result r = c.Post(
          "/v1/completions",
          Json{{"model", id}, {"prompt", "a"}, {"max_tokens", 200}, {"ignore_eos", true}}.dump(),
          "application/json");
      if (!r) return;
      statuses[i] = r->status;
      retry_after[i] = r->get_header_value("Retry-After");
      if (r->status == 429) {
        EXPECT_EQ(Json::parse(r->body)["error"]["code"], "rate_limit_exceeded");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  int ok = 0;
  int refused = 0;
  for (int i = 0; i < kRequests; ++i) {
    if (statuses[i] == 200) ++ok;
    if (statuses[i] == 429) {
      ++refused;
      EXPECT_EQ(retry_after[i], "1");
    }
  }
  EXPECT_EQ(ok + refused, kRequests);
  EXPECT_GE(ok, 1);
  EXPECT_GE(refused, 1);
}

}  // namespace
}  // namespace subspace::testing
