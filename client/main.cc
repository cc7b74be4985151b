// subspace: the command-line client of the Subspace gRPC service: generate, stream, sessions,
// model info, cache stats, health and a serving benchmark. Errors exit non-zero with the gRPC
// code name.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/flags.h"
#include "client/load_generator.h"
#include "client/subspace_client.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"

ABSL_FLAG(std::string, server, "localhost:50051", "server address, host:port");
ABSL_FLAG(double, timeout_seconds, 0, "deadline of each call in seconds; 0 = none");
ABSL_FLAG(bool, wait_for_ready, false,
          "wait for the server to become reachable instead of failing with UNAVAILABLE");
ABSL_FLAG(bool, json, false, "print responses as JSON (stream: one JSON message per line)");
ABSL_FLAG(bool, tls, false, "connect over TLS, verifying the server with gRPC's default roots");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle that signed the server's certificate; implies --tls");
ABSL_FLAG(std::string, tls_cert, "",
          "mutual TLS: PEM client certificate chain (with --tls-key); implies --tls");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: PEM private key of --tls-cert");
ABSL_FLAG(std::string, auth_token, "",
          "bearer token sent with every call; default: $SUBSPACE_AUTH_TOKEN (which keeps it out "
          "of the process list)");

ABSL_FLAG(std::string, prompt, "", "prompt text");
ABSL_FLAG(std::string, request, "",
          "a whole GenerateRequest as JSON; the flags given beside it override its fields");
ABSL_FLAG(std::optional<int32_t>, max_new_tokens, std::nullopt, "tokens to generate at most");
ABSL_FLAG(std::optional<float>, temperature, std::nullopt, "sampling temperature; 0 = greedy");
ABSL_FLAG(std::optional<int32_t>, top_k, std::nullopt, "top-k sampling; 0 = off");
ABSL_FLAG(std::optional<float>, top_p, std::nullopt, "nucleus sampling threshold in (0, 1]");
ABSL_FLAG(std::optional<float>, min_p, std::nullopt, "min-p threshold in [0, 1)");
ABSL_FLAG(std::optional<float>, repetition_penalty, std::nullopt, "repetition penalty; 1 = off");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt,
          "sampling seed; for bench, the seed of the whole workload (default 0)");
ABSL_FLAG(std::vector<std::string>, stop, {},
          "stop sequences, comma-separated; the flag may be repeated");
ABSL_FLAG(int32_t, logprobs, 0, "top alternatives to return per token, [0, 20]");
ABSL_FLAG(bool, ignore_eos, false, "keep generating past the end-of-sequence token");
ABSL_FLAG(std::string, session, "", "session id to continue");
ABSL_FLAG(std::string, system, "", "chat: a system message before the conversation");
ABSL_FLAG(bool, interactive, false,
          "chat: read one user message per line from stdin and stream each reply, keeping the "
          "conversation (and a session, so only new tokens are prefilled)");
ABSL_FLAG(std::vector<std::string>, template_kwargs, {},
          "chat: extra template variables NAME=JSON, e.g. enable_thinking=false");
ABSL_FLAG(uint32_t, ttl_seconds, 0, "session create: idle TTL; 0 = the server's default");
ABSL_FLAG(std::string, refresh, "",
          "session create: online basis refresh, none|pca|kqsvd|oja|fd; empty = the server's");
ABSL_FLAG(uint32_t, refresh_every_tokens, 0,
          "session create: refresh every N compressed tokens; 0 = the server's");
ABSL_FLAG(std::string, id, "",
          "session create: the session's id, 32 to 64 characters from [A-Za-z0-9_-] with at least "
          "128 random bits; empty = 128 random bits made here");

ABSL_FLAG(std::string, service, "", "health: the service to check; empty = the whole server");
ABSL_FLAG(double, wait_seconds, 0,
          "health: poll until SERVING for up to this many seconds; 0 = check once");

ABSL_FLAG(int32_t, num_requests, 100, "bench: number of requests");
ABSL_FLAG(int32_t, concurrency, 16, "bench: requests in flight at most");
ABSL_FLAG(double, request_rate, std::numeric_limits<double>::infinity(),
          "bench: Poisson arrival rate in requests/s; inf = all at once");
ABSL_FLAG(std::string, prompt_tokens, "64", "bench: prompt length, N or MIN:MAX (uniform)");
ABSL_FLAG(std::string, output_tokens, "64", "bench: output length, N or MIN:MAX (uniform)");
ABSL_FLAG(std::string, prompt_kind, "tokens",
          "bench: 'tokens' (random ids) or 'text' (random words, one per prompt token)");
ABSL_FLAG(std::string, json_file, "",
          "bench: also write the full report as JSON to this file (`bench --json FILE` is the "
          "same)");

namespace subspace::client {
namespace {

constexpr char kUsage[] = R"(subspace [--server host:port] [--timeout-seconds S] [--tls-ca FILE]
         [--tls-cert FILE --tls-key FILE] [--auth-token T | $SUBSPACE_AUTH_TOKEN] COMMAND [flags]

Commands:
  generate --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P --min-p P
           --repetition-penalty R --seed S --stop A,B --logprobs N --ignore-eos
           --session ID --request JSON --json]
  stream   (the flags of generate) prints tokens as they arrive, then usage on stderr
  chat     --prompt TEXT [--system TEXT --template-kwargs enable_thinking=false
           --interactive] (and the sampling flags of generate): the conversation rendered
           with the model's chat template, the reply streamed
  session create [--ttl-seconds N] [--id ID] [--refresh METHOD] [--refresh-every-tokens N]
         | get ID | list | delete ID
         | export ID > FILE | import ID < FILE   (a snapshot: move a session to another
           server of the same model, docs/sessions.md)
  info     model description
  stats    KV cache statistics
  health   [--service NAME --wait-seconds N] prints SERVING, NOT_SERVING, UNKNOWN or
           SERVICE_UNKNOWN; exits 0 only when SERVING. --wait-seconds polls until SERVING
           (an unreachable server counts as not ready) or the time runs out
  bench    [--num-requests N --concurrency C --request-rate R --prompt-tokens 64|32:128
            --output-tokens N|MIN:MAX --prompt-kind tokens|text --seed S --json FILE]
)";

constexpr const char* kCommands[] = {"generate", "stream", "session", "info",
                                     "stats",    "health", "bench",   "chat"};

bool IsCommand(const std::string& arg) {
  for (const char* c : kCommands) {
    if (arg == c) return true;
  }
  return false;
}

// `bench --json FILE` names a file while every other command's --json is a switch; a flag has
// one type, so for bench the name is rewritten to --json_file before parsing.
void RenameBenchJsonFlag(std::vector<std::string>& args) {
  bool bench = false;
  for (size_t i = 1; i < args.size() && args[i] != "--"; ++i) {
    if (args[i][0] != '-' && IsCommand(args[i])) {
      bench = args[i] == "bench";
      break;
    }
  }
  if (!bench) return;
  for (size_t i = 1; i < args.size() && args[i] != "--"; ++i) {
    if (args[i] == "--json" || args[i].rfind("--json=", 0) == 0) {
      args[i].replace(0, 6, "--json_file");
    }
  }
}

// absl replaces a repeated flag's value; --stop accumulates, so collect every occurrence.
std::vector<std::string> CollectStops(const std::vector<std::string>& args) {
  std::vector<std::string> stops;
  auto add = [&](const std::string& value) {
    for (absl::string_view s : absl::StrSplit(value, ',', absl::SkipEmpty())) {
      stops.emplace_back(s);
    }
  };
  for (size_t i = 1; i < args.size() && args[i] != "--"; ++i) {
    if (args[i].rfind("--stop=", 0) == 0) {
      add(args[i].substr(7));
    } else if (args[i] == "--stop" && i + 1 < args.size()) {
      add(args[++i]);
    }
  }
  return stops;
}

std::string ToJson(const google::protobuf::Message& message, bool pretty) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = pretty;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  // Printing a well-formed message cannot fail; an empty string would be the only symptom.
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  if (pretty && !json.empty() && json.back() != '\n') json += '\n';
  return json;
}

std::string FinishName(v1::FinishReason reason) {
  std::string name = v1::FinishReason_Name(reason);
  constexpr absl::string_view kPrefix = "FINISH_REASON_";
  if (absl::StartsWith(name, kPrefix)) name = name.substr(kPrefix.size());
  return absl::AsciiStrToLower(name);
}

void PrintUsageLine(const std::string& request_id, v1::FinishReason finish, const v1::Usage& usage,
                    const v1::Timings& timings) {
  const double decode_s = timings.total_seconds() - timings.time_to_first_token_seconds();
  const double rate = usage.generated_tokens() > 1 && decode_s > 0
                          ? (usage.generated_tokens() - 1) / decode_s
                          : 0.0;
  std::fprintf(stderr,
               "[%s] prompt %u tokens (%u reused), generated %u tokens, finish: %s; "
               "ttft %.1f ms, total %.1f ms, %.1f tokens/s\n",
               request_id.c_str(), usage.prompt_tokens(), usage.reused_tokens(),
               usage.generated_tokens(), FinishName(finish).c_str(),
               1e3 * timings.time_to_first_token_seconds(), 1e3 * timings.total_seconds(), rate);
}

absl::Status FillSampling(const std::vector<std::string>& stops, v1::SamplingParams* sampling);

absl::StatusOr<v1::GenerateRequest> BuildRequest(const std::vector<std::string>& stops) {
  v1::GenerateRequest request;
  if (const std::string json = absl::GetFlag(FLAGS_request); !json.empty()) {
    auto status = google::protobuf::util::JsonStringToMessage(json, &request);
    if (!status.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--request: ", status.ToString()));
    }
  }
  if (const std::string prompt = absl::GetFlag(FLAGS_prompt); !prompt.empty()) {
    request.set_text(prompt);
  }
  if (request.prompt_case() == v1::GenerateRequest::PROMPT_NOT_SET) {
    return absl::InvalidArgumentError("--prompt (or a prompt in --request) is required");
  }
  if (const std::string session = absl::GetFlag(FLAGS_session); !session.empty()) {
    request.set_session_id(session);
  }
  if (absl::Status st = FillSampling(stops, request.mutable_sampling()); !st.ok()) return st;
  return request;
}

// The sampling flags over `s` (a request's own values stay where a flag is not given).
absl::Status FillSampling(const std::vector<std::string>& stops, v1::SamplingParams* sampling) {
  v1::SamplingParams& s = *sampling;
  if (auto v = absl::GetFlag(FLAGS_max_new_tokens)) {
    if (*v < 0) return absl::InvalidArgumentError("--max-new-tokens must be >= 0");
    s.set_max_new_tokens(static_cast<uint32_t>(*v));
  }
  if (auto v = absl::GetFlag(FLAGS_temperature)) s.set_temperature(*v);
  if (auto v = absl::GetFlag(FLAGS_top_k)) s.set_top_k(*v);
  if (auto v = absl::GetFlag(FLAGS_top_p)) s.set_top_p(*v);
  if (auto v = absl::GetFlag(FLAGS_min_p)) s.set_min_p(*v);
  if (auto v = absl::GetFlag(FLAGS_repetition_penalty)) s.set_repetition_penalty(*v);
  if (auto v = absl::GetFlag(FLAGS_seed)) s.set_seed(*v);
  if (!stops.empty()) {
    s.clear_stop();
    for (const std::string& stop : stops) s.add_stop(stop);
  }
  if (const int32_t n = absl::GetFlag(FLAGS_logprobs); n != 0) {
    if (n < 0) return absl::InvalidArgumentError("--logprobs must be >= 0");
    s.set_logprobs(static_cast<uint32_t>(n));
  }
  if (absl::GetFlag(FLAGS_ignore_eos)) s.set_ignore_eos(true);
  return absl::OkStatus();
}

// One streamed chat turn: prints the reply as it arrives and returns its text.
absl::StatusOr<std::string> StreamChatTurn(SubspaceClient& client, const v1::ChatRequest& request) {
  std::string reply;
  absl::StatusOr<StreamResult> result =
      client.ChatStream(request, [&](const v1::GenerateStreamResponse& message) {
        std::fputs(message.chunk().text().c_str(), stdout);
        std::fflush(stdout);
        reply += message.chunk().text();
        return true;
      });
  std::fputs("\n", stdout);
  std::fflush(stdout);
  if (!result.ok()) return result.status();
  PrintUsageLine(result->request_id, result->final.finish_reason(), result->final.usage(),
                 result->final.timings());
  return reply;
}

absl::Status RunChat(SubspaceClient& client, const std::vector<std::string>& stops) {
  v1::ChatRequest request;
  if (const std::string system = absl::GetFlag(FLAGS_system); !system.empty()) {
    v1::ChatMessage* m = request.add_messages();
    m->set_role("system");
    m->set_content(system);
  }
  if (absl::Status st = FillSampling(stops, request.mutable_sampling()); !st.ok()) return st;
  for (const std::string& kv : absl::GetFlag(FLAGS_template_kwargs)) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--template-kwargs: '", kv, "' is not NAME=JSON"));
    }
    (*request.mutable_template_kwargs())[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  std::string session = absl::GetFlag(FLAGS_session);
  const bool interactive = absl::GetFlag(FLAGS_interactive);
  if (!interactive) {
    const std::string prompt = absl::GetFlag(FLAGS_prompt);
    if (prompt.empty()) return absl::InvalidArgumentError("chat needs --prompt or --interactive");
    v1::ChatMessage* m = request.add_messages();
    m->set_role("user");
    m->set_content(prompt);
    request.set_session_id(session);
    return StreamChatTurn(client, request).status();
  }
  // The conversation lives here and is sent whole each turn; the session keeps its cache, so
  // the server prefills only what each turn adds.
  if (session.empty()) {
    absl::StatusOr<v1::Session> created = client.CreateSession();
    if (!created.ok()) return created.status();
    session = created->session_id();
  }
  request.set_session_id(session);
  std::fprintf(stderr, "session %s; one message per line, end with Ctrl-D\n", session.c_str());
  for (std::string line; std::getline(std::cin, line);) {
    if (line.empty()) continue;
    v1::ChatMessage* m = request.add_messages();
    m->set_role("user");
    m->set_content(line);
    absl::StatusOr<std::string> reply = StreamChatTurn(client, request);
    if (!reply.ok()) return reply.status();
    v1::ChatMessage* a = request.add_messages();
    a->set_role("assistant");
    a->set_content(*reply);
  }
  return absl::OkStatus();
}

absl::Status RunGenerate(SubspaceClient& client, const std::vector<std::string>& stops) {
  absl::StatusOr<v1::GenerateRequest> request = BuildRequest(stops);
  if (!request.ok()) return request.status();
  absl::StatusOr<v1::GenerateResponse> response = client.Generate(*request);
  if (!response.ok()) return response.status();
  if (absl::GetFlag(FLAGS_json)) {
    std::fputs(ToJson(*response, /*pretty=*/true).c_str(), stdout);
    return absl::OkStatus();
  }
  std::printf("%s\n", response->text().c_str());
  std::fflush(stdout);  // the text before the usage on stderr, also when both go to one file
  for (const v1::GeneratedToken& t : response->tokens()) {
    std::string alternatives;
    for (const v1::TokenLogprob& a : t.top_logprobs()) {
      absl::StrAppendFormat(&alternatives, " %d:%.3f", a.id(), a.logprob());
    }
    std::fprintf(stderr, "token %d %-12s logprob %.4f  top:%s\n", t.id(),
                 absl::StrCat("\"", t.text(), "\"").c_str(), t.logprob(), alternatives.c_str());
  }
  PrintUsageLine(response->request_id(), response->finish_reason(), response->usage(),
                 response->timings());
  return absl::OkStatus();
}

absl::Status RunStream(SubspaceClient& client, const std::vector<std::string>& stops) {
  absl::StatusOr<v1::GenerateRequest> request = BuildRequest(stops);
  if (!request.ok()) return request.status();
  const bool json = absl::GetFlag(FLAGS_json);
  bool printed = false;
  absl::StatusOr<StreamResult> result =
      client.Stream(*request, [&](const v1::GenerateStreamResponse& message) {
        if (json) {
          std::printf("%s\n", ToJson(message, /*pretty=*/false).c_str());
        } else {
          std::fputs(message.chunk().text().c_str(), stdout);
          printed = true;
        }
        std::fflush(stdout);
        return true;
      });
  if (!result.ok()) {
    if (printed) std::fputs("\n", stdout);  // end the partial line before the error
    return result.status();
  }
  if (json) {
    v1::GenerateStreamResponse message;
    message.set_request_id(result->request_id);
    *message.mutable_final() = result->final;
    std::printf("%s\n", ToJson(message, /*pretty=*/false).c_str());
    return absl::OkStatus();
  }
  std::fputs("\n", stdout);
  std::fflush(stdout);
  PrintUsageLine(result->request_id, result->final.finish_reason(), result->final.usage(),
                 result->final.timings());
  return absl::OkStatus();
}

std::string FormatUnixMs(int64_t ms) {
  if (ms == 0) return "-";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixMillis(ms), absl::UTCTimeZone());
}

void PrintSessionTable(const std::vector<v1::Session>& sessions) {
  std::printf("%-36s %8s %8s %6s %6s %-20s %-20s %s\n", "SESSION", "TOKENS", "CACHED", "TTL",
              "BUSY", "CREATED", "LAST USED", "OWNER");
  for (const v1::Session& s : sessions) {
    std::printf("%-36s %8u %8u %6u %6s %-20s %-20s %s\n", s.session_id().c_str(), s.tokens(),
                s.cached_tokens(), s.idle_ttl_seconds(), s.busy() ? "yes" : "no",
                FormatUnixMs(s.created_unix_ms()).c_str(),
                FormatUnixMs(s.last_used_unix_ms()).c_str(),
                s.owner().empty() ? "-" : s.owner().c_str());
  }
}

// The session id of `session get|delete ID` (or --session).
absl::StatusOr<std::string> SessionIdArg(const std::vector<char*>& args) {
  if (args.size() > 3) return absl::InvalidArgumentError("expected one session id");
  if (args.size() == 3) return std::string(args[2]);
  if (const std::string id = absl::GetFlag(FLAGS_session); !id.empty()) return id;
  return absl::InvalidArgumentError("a session id is required");
}

absl::Status RunSession(SubspaceClient& client, const std::vector<char*>& args) {
  const bool json = absl::GetFlag(FLAGS_json);
  const std::string verb = args.size() > 1 ? args[1] : "";
  if (verb == "create") {
    std::optional<v1::BasisRefresh> refresh;
    if (!absl::GetFlag(FLAGS_refresh).empty() || absl::GetFlag(FLAGS_refresh_every_tokens) > 0) {
      refresh.emplace();
      refresh->set_method(absl::GetFlag(FLAGS_refresh));
      refresh->set_every_tokens(absl::GetFlag(FLAGS_refresh_every_tokens));
    }
    absl::StatusOr<v1::Session> session =
        client.CreateSession(absl::GetFlag(FLAGS_ttl_seconds), absl::GetFlag(FLAGS_id), refresh);
    if (!session.ok()) return session.status();
    if (json) {
      std::fputs(ToJson(*session, true).c_str(), stdout);
    } else {
      std::printf("%s\n", session->session_id().c_str());  // bare, for $(subspace session create)
    }
    return absl::OkStatus();
  }
  if (verb == "list") {
    absl::StatusOr<std::vector<v1::Session>> sessions = client.ListSessions();
    if (!sessions.ok()) return sessions.status();
    if (json) {
      v1::ListSessionsResponse response;
      for (const v1::Session& s : *sessions) *response.add_sessions() = s;
      std::fputs(ToJson(response, true).c_str(), stdout);
    } else {
      PrintSessionTable(*sessions);
    }
    return absl::OkStatus();
  }
  if (verb == "export" || verb == "import") {
    absl::StatusOr<std::string> id = SessionIdArg(args);
    if (!id.ok()) return id.status();
    if (verb == "export") {
      absl::StatusOr<std::string> snapshot = client.ExportSession(*id);
      if (!snapshot.ok()) return snapshot.status();
      if (std::fwrite(snapshot->data(), 1, snapshot->size(), stdout) != snapshot->size() ||
          std::fflush(stdout) != 0) {
        return absl::UnavailableError("cannot write the snapshot to stdout");
      }
      return absl::OkStatus();
    }
    std::string snapshot;
    char buffer[1 << 16];
    for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), stdin)) > 0;)
      snapshot.append(buffer, n);
    if (std::ferror(stdin)) return absl::UnavailableError("cannot read the snapshot from stdin");
    absl::StatusOr<v1::Session> session = client.ImportSession(*id, snapshot);
    if (!session.ok()) return session.status();
    if (json) {
      std::fputs(ToJson(*session, true).c_str(), stdout);
    } else {
      PrintSessionTable({*session});
    }
    return absl::OkStatus();
  }
  if (verb == "get" || verb == "delete") {
    absl::StatusOr<std::string> id = SessionIdArg(args);
    if (!id.ok()) return id.status();
    if (verb == "delete") return client.DeleteSession(*id);
    absl::StatusOr<v1::Session> session = client.GetSession(*id);
    if (!session.ok()) return session.status();
    if (json) {
      std::fputs(ToJson(*session, true).c_str(), stdout);
    } else {
      PrintSessionTable({*session});
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      "usage: subspace session create|get ID|list|delete ID|export ID|import ID");
}

// Prints a message as aligned `name: value` lines, nested messages as `outer.inner`; every
// field, defaults included, so the output has a fixed shape.
void PrintFields(const google::protobuf::Message& message, const std::string& prefix) {
  const google::protobuf::Descriptor* d = message.GetDescriptor();
  const google::protobuf::Reflection* r = message.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    const std::string name = prefix + f->name();
    if (f->is_repeated()) continue;  // none in ModelInfo or CacheStats
    if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
      PrintFields(r->GetMessage(message, f), name + ".");
      continue;
    }
    std::string value;
    google::protobuf::TextFormat::PrintFieldValueToString(message, f, -1, &value);
    std::printf("%-24s %s\n", (name + ":").c_str(), value.c_str());
  }
}

absl::Status RunInfo(SubspaceClient& client) {
  absl::StatusOr<v1::ModelInfo> info = client.GetModelInfo();
  if (!info.ok()) return info.status();
  if (absl::GetFlag(FLAGS_json)) {
    std::fputs(ToJson(*info, true).c_str(), stdout);
  } else {
    PrintFields(*info, "");
  }
  return absl::OkStatus();
}

absl::Status RunStats(SubspaceClient& client) {
  absl::StatusOr<v1::CacheStats> stats = client.GetCacheStats();
  if (!stats.ok()) return stats.status();
  if (absl::GetFlag(FLAGS_json)) {
    std::fputs(ToJson(*stats, true).c_str(), stdout);
  } else {
    PrintFields(*stats, "");
  }
  return absl::OkStatus();
}

// Polls health every kHealthPollInterval until SERVING or --wait-seconds pass; each check gets
// at most kHealthCallTimeout, so one hung connection cannot eat the whole wait.
constexpr absl::Duration kHealthPollInterval = absl::Milliseconds(200);
constexpr absl::Duration kHealthCallTimeout = absl::Seconds(2);

// A channel that failed to connect waits out gRPC's reconnect backoff and re-resolution delay
// (5 s and more) before it tries again, so each check after a failure gets a fresh channel,
// with a subchannel of its own rather than the old one from the process-wide pool.
std::unique_ptr<SubspaceClient> FreshClient(const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return std::make_unique<SubspaceClient>(
      grpc::CreateCustomChannel(options.server, ChannelCredentials(options), args), options);
}

absl::Status RunHealth(ClientOptions options) {
  const double wait_seconds = absl::GetFlag(FLAGS_wait_seconds);
  if (!(wait_seconds >= 0)) return absl::InvalidArgumentError("--wait-seconds must be >= 0");
  const std::string service = absl::GetFlag(FLAGS_service);
  const bool wait = wait_seconds > 0;
  if (wait) options.timeout = std::min(options.timeout, kHealthCallTimeout);
  const absl::Time deadline = absl::Now() + absl::Seconds(wait_seconds);
  std::unique_ptr<SubspaceClient> client = FreshClient(options);
  absl::StatusOr<ServingStatus> health = client->Health(service);
  while (wait && !(health.ok() && *health == health_v1::HealthCheckResponse::SERVING) &&
         health.status().code() != absl::StatusCode::kUnimplemented) {  // no health service
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    absl::SleepFor(std::min(kHealthPollInterval, left));
    if (!health.ok()) client = FreshClient(options);
    health = client->Health(service);
  }
  const std::string waited = wait ? absl::StrFormat(" (waited %g s)", wait_seconds) : std::string();
  if (!health.ok()) {
    return absl::Status(health.status().code(), absl::StrCat(health.status().message(), waited));
  }
  const std::string name = health_v1::HealthCheckResponse::ServingStatus_Name(*health);
  std::printf("%s\n", name.c_str());
  if (*health != health_v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(
        absl::StrCat(service.empty() ? "the server" : absl::StrCat("service '", service, "'"),
                     " is ", name, waited));
  }
  return absl::OkStatus();
}

absl::Status RunBenchCommand(SubspaceClient& client) {
  BenchConfig config;
  config.num_requests = absl::GetFlag(FLAGS_num_requests);
  config.concurrency = absl::GetFlag(FLAGS_concurrency);
  config.request_rate = absl::GetFlag(FLAGS_request_rate);
  absl::StatusOr<LengthRange> prompt = ParseLengthRange(absl::GetFlag(FLAGS_prompt_tokens));
  if (!prompt.ok()) return prompt.status();
  absl::StatusOr<LengthRange> output = ParseLengthRange(absl::GetFlag(FLAGS_output_tokens));
  if (!output.ok()) return output.status();
  config.prompt_tokens = *prompt;
  config.output_tokens = *output;
  const std::string kind = absl::GetFlag(FLAGS_prompt_kind);
  if (kind == "tokens") {
    config.prompt_kind = PromptKind::kTokens;
  } else if (kind == "text") {
    config.prompt_kind = PromptKind::kText;
  } else {
    return absl::InvalidArgumentError("--prompt-kind must be 'tokens' or 'text'");
  }
  config.seed = absl::GetFlag(FLAGS_seed).value_or(0);
  config.temperature = absl::GetFlag(FLAGS_temperature).value_or(0.0f);

  absl::StatusOr<BenchReport> report = RunBench(client, config);
  if (!report.ok()) return report.status();
  std::fputs(FormatReportTable(*report).c_str(), stdout);
  if (const std::string path = absl::GetFlag(FLAGS_json_file); !path.empty()) {
    std::ofstream out(path);
    out << ReportToJson(*report);
    out.close();
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  }
  if (report->successful == 0) return absl::UnavailableError("every request failed");
  return absl::OkStatus();
}

absl::Status Run(const std::vector<char*>& positional, const std::vector<std::string>& stops) {
  // positional[0] is the program; the command and its arguments follow.
  if (positional.size() < 2) return absl::InvalidArgumentError("no command given");
  const std::vector<char*> args(positional.begin() + 1, positional.end());
  const std::string command = args[0];
  const bool takes_args = command == "session";
  if (!takes_args && args.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected argument: ", args[1]));
  }

  ClientOptions options;
  options.server = absl::GetFlag(FLAGS_server);
  const double timeout = absl::GetFlag(FLAGS_timeout_seconds);
  if (timeout < 0) return absl::InvalidArgumentError("--timeout-seconds must be >= 0");
  if (timeout > 0) options.timeout = absl::Seconds(timeout);
  options.wait_for_ready = absl::GetFlag(FLAGS_wait_for_ready);
  const std::string tls_ca = absl::GetFlag(FLAGS_tls_ca);
  const std::string tls_cert = absl::GetFlag(FLAGS_tls_cert);
  const std::string tls_key = absl::GetFlag(FLAGS_tls_key);
  if (absl::GetFlag(FLAGS_tls) || !tls_ca.empty() || !tls_cert.empty() || !tls_key.empty()) {
    absl::StatusOr<ClientTls> tls = LoadClientTls(tls_ca, tls_cert, tls_key);
    if (!tls.ok()) return tls.status();
    options.tls = *std::move(tls);
  }
  options.auth_token = absl::GetFlag(FLAGS_auth_token);
  if (const char* env = std::getenv("SUBSPACE_AUTH_TOKEN");
      options.auth_token.empty() && env != nullptr) {
    options.auth_token = env;
  }
  if (command == "health") return RunHealth(options);  // with its own channel settings
  SubspaceClient client(options);

  if (command == "generate") return RunGenerate(client, stops);
  if (command == "stream") return RunStream(client, stops);
  if (command == "chat") return RunChat(client, stops);
  if (command == "session") return RunSession(client, args);
  if (command == "info") return RunInfo(client);
  if (command == "stats") return RunStats(client);
  if (command == "bench") return RunBenchCommand(client);
  return absl::InvalidArgumentError(absl::StrCat("unknown command: ", command));
}

}  // namespace
}  // namespace subspace::client

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(subspace::client::kUsage);
  std::vector<std::string> args = subspace::cli::NormalizeDashFlags(argc, argv);
  subspace::cli::ExitOnHelp(args, subspace::client::kUsage);
  subspace::client::RenameBenchJsonFlag(args);
  const std::vector<std::string> stops = subspace::client::CollectStops(args);
  std::vector<char*> argv_fixed;
  for (std::string& a : args) argv_fixed.push_back(a.data());
  argv_fixed.push_back(nullptr);
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), argv_fixed.data());

  absl::Status status = subspace::client::Run(positional, stops);
  if (!status.ok()) {
    // absl's "CODE: message" uses the gRPC code names (UNAVAILABLE, INVALID_ARGUMENT, ...).
    std::fprintf(stderr, "subspace: %s\n", status.ToString().c_str());
    if (status.code() == absl::StatusCode::kInvalidArgument && positional.size() < 2) {
      std::fputs(subspace::client::kUsage, stderr);
    }
    return 1;
  }
  return 0;
}
