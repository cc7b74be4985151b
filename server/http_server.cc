// The HTTP API's handlers; see http_server.h. A generation request is an HttpCall: the engine's
// observer, which queues tokens from the engine thread (never blocking it) for the connection's
// thread to write. A stream writes what has arrived every time it wakes, and both a stream and
// a unary request check at least every kPollInterval that their client is still there
// (connection_probe.h): a client that hung up has its engine request cancelled within that
// interval (and its blocks freed within a step), streamed or not.
#include "server/http_server.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/connection_probe.h"
#include "server/generate_calls.h"
#include "server/openai_api.h"
#include "server/prepare_request.h"
#include "server/session_access.h"
#include "server/status_util.h"
#include "spdlog/spdlog.h"

namespace subspace::server {
namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(50);
constexpr char kJson[] = "application/json";

// One generation request between the engine and an HTTP connection.
class HttpCall : public GenerateObserver {
 public:
  HttpCall(Engine* engine, Metrics* metrics, std::string request_id, std::string session_id)
      : metrics_(metrics),
        request_id_(std::move(request_id)),
        session_id_(std::move(session_id)),
        submission_(engine) {}

  // What arrived since the last Take.
  struct Batch {
    std::vector<GeneratedTokenEvent> tokens;
    std::string text;
    std::optional<GenerateResult> result;  // set once: the request is over
  };

  absl::Status Submit(GenerateRequest request, std::shared_ptr<HttpCall> self) {
    absl::Status s = submission_.Submit(std::move(request), std::move(self));
    if (!s.ok()) RecordRequestRejected(*metrics_, request_id_, session_id_, s);
    return s;
  }

  // From any thread; the request finishes with kCancelled within a step.
  void Cancel() { submission_.Cancel(); }

  // Waits up to `timeout` (forever when nullopt) for tokens or the end, then takes them.
  Batch Take(std::optional<std::chrono::milliseconds> timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto ready = [&] { return !tokens_.empty() || result_.has_value(); };
    if (timeout.has_value()) {
      cv_.wait_for(lock, *timeout, ready);
    } else {
      cv_.wait(lock, ready);
    }
    Batch out;
    out.tokens.assign(std::make_move_iterator(tokens_.begin()),
                      std::make_move_iterator(tokens_.end()));
    tokens_.clear();
    for (const GeneratedTokenEvent& t : out.tokens) out.text += t.text;
    if (result_.has_value() && !result_taken_) {
      out.result = result_;
      result_taken_ = true;
    }
    return out;
  }

  void OnTokens(std::span<const GeneratedTokenEvent> tokens) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
    }
    cv_.notify_all();
  }

  void OnFinish(const GenerateResult& result) override {
    RecordRequestFinished(*metrics_, request_id_, session_id_, result, FinishStatus(result));
    {
      std::lock_guard<std::mutex> lock(mu_);
      result_ = result;
    }
    cv_.notify_all();
  }

 private:
  Metrics* const metrics_;
  const std::string request_id_;
  const std::string session_id_;
  EngineSubmission submission_;
  std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_:
  std::deque<GeneratedTokenEvent> tokens_;
  std::optional<GenerateResult> result_;
  bool result_taken_ = false;
};

void Reply(httplib::Response& res, int status, const std::string& body) {
  res.status = status;
  res.set_content(body, kJson);
}

void ReplyError(httplib::Response& res, const absl::Status& status) {
  res.status = openai::HttpStatusFor(status.code());
  if (res.status == 429) res.set_header("Retry-After", "1");
  if (res.status == 401) res.set_header("WWW-Authenticate", "Bearer");
  res.set_content(openai::ErrorJson(status), kJson);
}

std::optional<std::string> Header(const httplib::Request& req, const char* name) {
  if (!req.has_header(name)) return std::nullopt;
  return req.get_header_value(name);
}

}  // namespace

class HttpServer::Impl {
 public:
  Impl(HttpServerConfig config, Metrics* metrics, RequestLimits limits, Authenticator auth)
      : config_(std::move(config)),
        metrics_(metrics),
        limits_(limits),
        auth_(std::move(auth)),
        created_(absl::ToUnixSeconds(absl::Now())) {}

  absl::Status Start() {
    if (TlsEnabled(config_.tls)) {
      server_ = std::make_unique<httplib::SSLServer>(
          config_.tls.cert_path.c_str(), config_.tls.key_path.c_str(),
          config_.tls.client_ca_path.empty() ? nullptr : config_.tls.client_ca_path.c_str());
    } else {
      server_ = std::make_unique<httplib::Server>();
    }
    if (!server_->is_valid()) {
      return absl::InvalidArgumentError(
          "the HTTP API cannot use the TLS files (--tls-cert, --tls-key, --tls-client-ca)");
    }
    const int threads = config_.threads;
    server_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    server_->set_payload_max_length(static_cast<size_t>(config_.max_body_bytes));
    const auto io = absl::ToChronoMilliseconds(config_.io_timeout);
    server_->set_read_timeout(io);
    server_->set_write_timeout(io);
    server_->set_keep_alive_timeout(
        std::max<time_t>(1, static_cast<time_t>(absl::ToInt64Seconds(config_.keep_alive))));
    server_->set_tcp_nodelay(true);
    server_->set_keep_alive_max_count(1000);  // requests per connection before it is closed
    Route();
    const int port = config_.port == 0
                         ? server_->bind_to_any_port(config_.host)
                         : (server_->bind_to_port(config_.host, config_.port) ? config_.port : -1);
    if (port <= 0) {
      return absl::UnavailableError(
          absl::StrCat("the HTTP API cannot listen on ", config_.host, ":", config_.port));
    }
    port_ = port;
    thread_ = std::thread([this] {
      server_->listen_after_bind();
      listen_returned_.store(true, std::memory_order_release);
    });
    // stop() is a no-op until the accept loop runs: wait for it, so Stop cannot miss it.
    while (!server_->is_running() && !listen_returned_.load(std::memory_order_acquire)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!server_->is_running()) {
      thread_.join();
      return absl::UnavailableError(
          absl::StrCat("the HTTP API cannot listen on ", config_.host, ":", port));
    }
    return absl::OkStatus();
  }

  int port() const { return port_; }

  void AttachEngine(Engine* engine, ChatSetup chat, std::string model_id,
                    SnapshotIdentity snapshot) {
    chat_ = std::move(chat);
    model_id_ = std::move(model_id);
    snapshot_ = std::move(snapshot);
    engine_.store(engine, std::memory_order_release);
  }

  void BeginDrain() { draining_.store(true, std::memory_order_release); }

  void Stop(absl::Duration grace) {
    std::lock_guard<std::mutex> stop_lock(stop_mu_);
    if (stopped_) return;
    stopped_ = true;
    BeginDrain();
    {
      std::unique_lock<std::mutex> lock(calls_mu_);
      calls_cv_.wait_for(lock, absl::ToChronoMilliseconds(grace), [&] { return calls_.empty(); });
      stopping_ = true;
      for (const std::shared_ptr<HttpCall>& call : calls_) call->Cancel();
    }
    if (server_ != nullptr) server_->stop();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Route() {
    server_->set_error_handler([](const httplib::Request&, httplib::Response& res) {
      // Statuses the library sets itself (413, 404 of an unknown path, 400...); handlers that
      // answered an error wrote their own body.
      if (res.body.empty()) res.set_content(openai::ErrorJsonForHttpStatus(res.status), kJson);
    });
    server_->set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, const std::exception_ptr&) {
          ReplyError(res, absl::InternalError("the server failed to answer this request"));
        });
    server_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      const Engine* engine = engine_.load(std::memory_order_acquire);
      const char* state = engine == nullptr                           ? "loading"
                          : draining_.load(std::memory_order_acquire) ? "draining"
                                                                      : "ok";
      Reply(res, absl::string_view(state) == "ok" ? 200 : 503,
            absl::StrCat("{\"status\":\"", state, "\"}"));
    });
    server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics_->ExpositionText(), "text/plain; version=0.0.4");
    });
    server_->Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      absl::StatusOr<Engine*> engine = Admit(req, nullptr);
      if (!engine.ok()) return ReplyError(res, engine.status());
      Reply(res, 200, openai::ModelListJson(model_id_, created_));
    });
    server_->Get("/v1/models/(.+)", [this](const httplib::Request& req, httplib::Response& res) {
      absl::StatusOr<Engine*> engine = Admit(req, nullptr);
      if (!engine.ok()) return ReplyError(res, engine.status());
      if (req.matches[1] != model_id_) {
        return ReplyError(res, absl::NotFoundError(absl::StrCat(
                                   "the model '", ToValidUtf8(req.matches[1].str().substr(0, 128)),
                                   "' does not exist")));
      }
      Reply(res, 200, openai::ModelJson(model_id_, created_));
    });
    server_->Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      Generate(req, res, /*chat=*/false);
    });
    server_->Post("/v1/chat/completions",
                  [this](const httplib::Request& req, httplib::Response& res) {
                    Generate(req, res, /*chat=*/true);
                  });
    server_->Post("/v1/sessions", [this](const httplib::Request& req, httplib::Response& res) {
      CreateSession(req, res);
    });
    server_->Get("/v1/sessions", [this](const httplib::Request& req, httplib::Response& res) {
      std::string caller;
      absl::StatusOr<Engine*> engine = Admit(req, &caller);
      if (!engine.ok()) return ReplyError(res, engine.status());
      Reply(res, 200, openai::SessionListJson(Access(caller).List(**engine)));
    });
    // Before the routes below, whose "(.+)" would take "ID/snapshot" for an id.
    server_->Get(
        "/v1/sessions/([^/]+)/snapshot",
        [this](const httplib::Request& req, httplib::Response& res) { ExportSnapshot(req, res); });
    server_->Put(
        "/v1/sessions/([^/]+)/snapshot",
        [this](const httplib::Request& req, httplib::Response& res) { ImportSnapshot(req, res); });
    server_->Get("/v1/sessions/(.+)", [this](const httplib::Request& req, httplib::Response& res) {
      OnSession(req, res,
                [](Engine& engine, const std::string& id,
                   const std::string& owner) -> absl::StatusOr<std::string> {
                  absl::StatusOr<SessionInfo> session = engine.GetSession(id, owner);
                  if (!session.ok()) return session.status();
                  return openai::SessionJson(*session);
                });
    });
    server_->Delete("/v1/sessions/(.+)",
                    [this](const httplib::Request& req, httplib::Response& res) {
                      OnSession(req, res,
                                [](Engine& engine, const std::string& id,
                                   const std::string& owner) -> absl::StatusOr<std::string> {
                                  if (absl::Status s = engine.DeleteSession(id, owner); !s.ok()) {
                                    return s;
                                  }
                                  return absl::StrCat("{\"id\":\"", id,
                                                      "\",\"object\":\"session\","
                                                      "\"deleted\":true}");
                                });
                    });
  }

  // Authentication first (so an unauthenticated caller learns nothing else), then the engine.
  absl::StatusOr<Engine*> Admit(const httplib::Request& req, std::string* caller) const {
    const std::optional<std::string> authorization = Header(req, "Authorization");
    absl::StatusOr<std::string> principal = auth_.Authenticate(
        authorization.has_value() ? std::optional<std::string_view>(*authorization) : std::nullopt);
    if (!principal.ok()) return principal.status();
    if (caller != nullptr) *caller = *std::move(principal);
    Engine* engine = engine_.load(std::memory_order_acquire);
    if (engine == nullptr) return absl::UnavailableError("the server is still loading the model");
    return engine;
  }

  SessionAccess Access(std::string caller) const {
    const bool is_operator = auth_.IsOperator(caller);
    return SessionAccess(std::move(caller), is_operator);
  }

  // /v1/sessions/{id}: admitted, the id checked, then `action` answers with a body or an error
  // (acting as the session's owner: the caller, or any owner for an operator).
  template <typename Action>
  void OnSession(const httplib::Request& req, httplib::Response& res, Action action) {
    std::string caller;
    absl::StatusOr<Engine*> engine = Admit(req, &caller);
    if (!engine.ok()) return ReplyError(res, engine.status());
    const std::string id = req.matches[1];
    if (absl::Status s = ValidateId(id, "session id", limits_); !s.ok()) {
      return ReplyError(res, s);
    }
    absl::StatusOr<std::string> body = action(**engine, id, Access(caller).OwnerOf(**engine, id));
    if (!body.ok()) return ReplyError(res, body.status());
    Reply(res, 200, *body);
  }

  // A session's snapshot (core/engine/session_snapshot.h), the bytes ExportSession streams.
  void ExportSnapshot(const httplib::Request& req, httplib::Response& res) {
    std::string caller;
    absl::StatusOr<Engine*> engine = Admit(req, &caller);
    if (!engine.ok()) return ReplyError(res, engine.status());
    const std::string id = req.matches[1];
    if (absl::Status s = ValidateId(id, "session id", limits_); !s.ok()) return ReplyError(res, s);
    absl::StatusOr<Engine::ExportedSession> exported =
        (*engine)->ExportSession(id, Access(caller).OwnerOf(**engine, id));
    if (!exported.ok()) return ReplyError(res, exported.status());
    res.status = 200;
    res.set_content(EncodeSessionSnapshot(exported->image, snapshot_), "application/octet-stream");
    if (metrics_ != nullptr) metrics_->RecordSessionMoved("export");
  }

  // A session from a snapshot (the request body, at most --max-message-bytes), as ImportSession:
  // the body's session must have the path's id and belong to the caller.
  void ImportSnapshot(const httplib::Request& req, httplib::Response& res) {
    std::string caller;
    absl::StatusOr<Engine*> engine = Admit(req, &caller);
    if (!engine.ok()) return ReplyError(res, engine.status());
    const std::string id = req.matches[1];
    if (absl::Status s = ValidateId(id, "session id", limits_); !s.ok()) return ReplyError(res, s);
    absl::StatusOr<SessionImage> image =
        DecodeSessionSnapshot(req.body, snapshot_, static_cast<uint64_t>(req.body.size()) * 64);
    if (!image.ok()) {
      // A damaged snapshot is the request's fault: 400, naming why.
      const absl::StatusCode code = image.status().code() == absl::StatusCode::kDataLoss
                                        ? absl::StatusCode::kInvalidArgument
                                        : image.status().code();
      return ReplyError(res,
                        absl::Status(code, absl::StrCat("snapshot: ", image.status().message())));
    }
    if (image->id != id) {
      return ReplyError(res, absl::InvalidArgumentError(absl::StrCat("the snapshot holds session ",
                                                                     image->id, ", not ", id)));
    }
    if (absl::Status s = Access(caller).CheckImport(*image); !s.ok()) return ReplyError(res, s);
    absl::StatusOr<Engine::ImportedSession> imported = (*engine)->ImportSession(*image);
    if (!imported.ok()) return ReplyError(res, imported.status());
    if (metrics_ != nullptr) metrics_->RecordSessionMoved("import");
    Reply(res, 200, openai::SessionJson(imported->info));
  }

  void CreateSession(const httplib::Request& req, httplib::Response& res) {
    std::string caller;
    absl::StatusOr<Engine*> engine = Admit(req, &caller);
    if (!engine.ok()) return ReplyError(res, engine.status());
    absl::StatusOr<openai::SessionCreateRequest> request =
        openai::ParseSessionCreateRequest(req.body);
    if (!request.ok()) return ReplyError(res, request.status());
    if (request->idle_ttl_seconds > limits_.max_session_ttl_seconds) {
      return ReplyError(res, absl::InvalidArgumentError(absl::StrCat(
                                 "ttl_seconds must be at most ", limits_.max_session_ttl_seconds,
                                 ", got ", request->idle_ttl_seconds)));
    }
    if (absl::Status s = ValidateProposedSessionId(request->session_id, "session_id"); !s.ok()) {
      return ReplyError(res, s);
    }
    absl::StatusOr<SessionInfo> session = (*engine)->CreateSession(
        absl::Seconds(request->idle_ttl_seconds), request->session_id, caller);
    if (!session.ok()) return ReplyError(res, session.status());
    Reply(res, 200, openai::SessionJson(*session));
  }

  // Parses, prepares and submits; the answer is written here (unary) or by the stream's content
  // provider.
  void Generate(const httplib::Request& req, httplib::Response& res, bool chat) {
    std::string caller;
    absl::StatusOr<Engine*> admitted = Admit(req, &caller);
    if (!admitted.ok()) return ReplyError(res, admitted.status());
    Engine* engine = *admitted;
    const openai::ApiContext context{
        .model_id = model_id_,
        .context_length = static_cast<uint32_t>(engine->model_config().context_length)};
    bool stream = false;
    bool include_usage = false;
    int logprobs = -1;  // completions: alternatives shown; chat: >= 0 when logprobs is true
    std::string session_id;
    absl::StatusOr<GenerateRequest> prepared;
    if (chat) {
      absl::StatusOr<openai::ChatCompletionRequest> parsed =
          openai::ParseChatCompletionRequest(req.body, context);
      if (!parsed.ok()) return Reject(res, parsed.status());
      stream = parsed->stream;
      include_usage = parsed->include_usage;
      logprobs = parsed->logprobs ? parsed->top_logprobs : -1;
      session_id = parsed->request.session_id();
      if (draining_.load(std::memory_order_acquire)) return Reject(res, Draining());
      prepared =
          PrepareChat(*engine, parsed->request, chat_, limits_, caller, absl::InfiniteFuture());
    } else {
      absl::StatusOr<openai::CompletionRequest> parsed =
          openai::ParseCompletionRequest(req.body, context);
      if (!parsed.ok()) return Reject(res, parsed.status());
      stream = parsed->stream;
      include_usage = parsed->include_usage;
      logprobs = parsed->logprobs;
      session_id = parsed->request.session_id();
      if (draining_.load(std::memory_order_acquire)) return Reject(res, Draining());
      prepared = PrepareGenerate(*engine, parsed->request, limits_, caller, absl::InfiniteFuture());
    }
    if (!prepared.ok()) return Reject(res, openai::RenameFields(prepared.status(), chat));

    openai::ResponseMeta meta{
        .id = absl::StrCat(chat ? "chatcmpl-" : "cmpl-", prepared->request_id),
        .created = absl::ToUnixSeconds(absl::Now()),
        .model = model_id_,
        .session_id = session_id};
    const std::string prepared_id = prepared->request_id;
    auto call = std::make_shared<HttpCall>(engine, metrics_, prepared_id, session_id);
    if (absl::Status s = call->Submit(*std::move(prepared), call); !s.ok()) {
      return ReplyError(res, s);  // Submit recorded the rejection
    }
    Register(call);
    // The id the server's log line and metrics know the request by.
    res.set_header("X-Request-Id", prepared_id);
    const Tokenizer& tokenizer = engine->tokenizer();
    // This request's connection, to see a client that hangs up (-1 if not found: a stream then
    // notices at its next failed write, an unary answer when it is written).
    const int connection = FindConnectionSocket(port_, req.remote_addr, req.remote_port);
    if (!stream) {
      std::vector<GeneratedTokenEvent> tokens;
      std::string text;
      std::optional<GenerateResult> result;
      bool cancelled = false;
      while (!result.has_value()) {
        HttpCall::Batch batch =
            call->Take(connection >= 0 ? std::optional(kPollInterval) : std::nullopt);
        text += batch.text;
        tokens.insert(tokens.end(), std::make_move_iterator(batch.tokens.begin()),
                      std::make_move_iterator(batch.tokens.end()));
        result = std::move(batch.result);
        if (!result.has_value() && !cancelled && connection >= 0 && PeerHungUp(connection)) {
          call->Cancel();  // nobody will read the answer: free the engine's slot now
          cancelled = true;
        }
      }
      Unregister(call);
      if (absl::Status s = FinishStatus(*result); !s.ok()) return ReplyError(res, s);
      Reply(res, 200,
            chat ? openai::ChatCompletionJson(meta, text, tokens, logprobs >= 0, result->finish,
                                              result->usage, tokenizer)
                 : openai::CompletionJson(meta, text, tokens, logprobs, result->finish,
                                          result->usage, tokenizer));
      return;
    }

    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");  // proxies: pass events on as they come
    auto first = std::make_shared<bool>(true);
    res.set_chunked_content_provider(
        "text/event-stream",
        [call, meta, chat, logprobs, include_usage, first, connection, &tokenizer](
            size_t, httplib::DataSink& sink) {
          // The role opens a chat stream at once, before the first token.
          if (chat && *first) {
            *first = false;
            const std::string opening = openai::ChatChunk(meta, "", {}, false, /*first=*/true,
                                                          std::nullopt, include_usage, tokenizer);
            if (!sink.write(opening.data(), opening.size())) {
              call->Cancel();
              return false;
            }
          }
          HttpCall::Batch batch = call->Take(kPollInterval);
          std::string out;
          if (!batch.tokens.empty()) {
            out = chat ? openai::ChatChunk(meta, batch.text, batch.tokens, logprobs >= 0,
                                           /*first=*/false, std::nullopt, include_usage, tokenizer)
                       : openai::CompletionChunk(meta, batch.text, batch.tokens, logprobs,
                                                 std::nullopt, include_usage, tokenizer);
          }
          if (batch.result.has_value()) {
            const GenerateResult& result = *batch.result;
            if (absl::Status s = FinishStatus(result); !s.ok()) {
              out += openai::ErrorChunk(s);
            } else {
              out += chat ? openai::ChatChunk(meta, "", {}, false, /*first=*/false, result.finish,
                                              include_usage, tokenizer)
                          : openai::CompletionChunk(meta, "", {}, -1, result.finish, include_usage,
                                                    tokenizer);
              if (include_usage) out += openai::UsageChunk(meta, chat, result.usage);
            }
            out += openai::kDoneEvent;
          }
          if (!out.empty() && !sink.write(out.data(), out.size())) {
            call->Cancel();
            return false;
          }
          if (batch.result.has_value()) {
            sink.done();
          } else if (connection >= 0 ? PeerHungUp(connection)
                                     : out.empty() && !sink.is_writable()) {
            call->Cancel();  // the client went away
            return false;
          }
          return true;
        },
        [this, call](bool success) {
          if (!success) call->Cancel();
          Unregister(call);
        });
  }

  static absl::Status Draining() {
    return absl::UnavailableError("the server is draining and accepts no new requests");
  }

  // A request refused before it reached the engine.
  void Reject(httplib::Response& res, const absl::Status& status) {
    RecordRequestRejected(*metrics_, "", "", status);
    ReplyError(res, status);
  }

  void Register(const std::shared_ptr<HttpCall>& call) {
    bool cancel = false;
    {
      std::lock_guard<std::mutex> lock(calls_mu_);
      calls_.insert(call);
      cancel = stopping_;
    }
    if (cancel) call->Cancel();
  }
  void Unregister(const std::shared_ptr<HttpCall>& call) {
    {
      std::lock_guard<std::mutex> lock(calls_mu_);
      calls_.erase(call);
    }
    calls_cv_.notify_all();
  }

  const HttpServerConfig config_;
  Metrics* const metrics_;
  const RequestLimits limits_;
  const Authenticator auth_;
  const int64_t created_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> listen_returned_{false};
  int port_ = 0;
  std::atomic<Engine*> engine_{nullptr};
  ChatSetup chat_;             // written before engine_ is published, read after
  std::string model_id_;       // likewise
  SnapshotIdentity snapshot_;  // likewise
  std::atomic<bool> draining_{false};
  std::mutex calls_mu_;
  std::condition_variable calls_cv_;           // signalled when a call leaves calls_
  std::set<std::shared_ptr<HttpCall>> calls_;  // guarded by calls_mu_
  bool stopping_ = false;                      // guarded by calls_mu_
  std::mutex stop_mu_;
  bool stopped_ = false;  // guarded by stop_mu_
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerConfig config,
                                                              Metrics* metrics,
                                                              RequestLimits limits,
                                                              Authenticator auth) {
  auto impl = std::make_unique<Impl>(std::move(config), metrics, limits, std::move(auth));
  if (absl::Status s = impl->Start(); !s.ok()) return s;
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HttpServer::~HttpServer() { Stop(); }
int HttpServer::port() const { return impl_->port(); }
void HttpServer::AttachEngine(Engine* engine, ChatSetup chat, std::string model_id,
                              SnapshotIdentity snapshot) {
  impl_->AttachEngine(engine, std::move(chat), std::move(model_id), std::move(snapshot));
}
void HttpServer::BeginDrain() { impl_->BeginDrain(); }
void HttpServer::Stop(absl::Duration grace) { impl_->Stop(grace); }

}  // namespace subspace::server
