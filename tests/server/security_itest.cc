// Transport security and access control end to end, with real certificates made by the openssl
// CLI for each run: TLS and mutual TLS handshakes that succeed and fail, bearer tokens on every
// Subspace RPC (health stays open), sessions owned by the token that made them, the client
// library and the `subspace` CLI over mTLS with a token, start-up errors for unusable files, and
// a server log that holds neither prompts nor tokens.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/subspace_client.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "server/server_app.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/server/server_test_util.h"
#include "tests/server/token_caller.h"

extern char** environ;

namespace subspace {
namespace {

using ::subspace::testing::HealthCheck;
using ::subspace::testing::ReflectionListServices;
using ::subspace::testing::StringToByteBuffer;
using ::subspace::testing::TestServerConfig;
using ::subspace::testing::TextRequest;
using Caller = ::subspace::testing::TokenCaller;

constexpr int kServing = 1;
constexpr char kTokenA[] = "token-a-6b1f0c9e2d7a4f38";
constexpr char kTokenB[] = "token-b-93e5a0d4c1b87f26";
constexpr auto kCallTimeout = std::chrono::seconds(20);

struct ProgramResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `argv` (argv[0] looked up on PATH) to its end with posix_spawn, so no fork handlers run
// in this process full of gRPC threads. The environment is this process's, without
// SUBSPACE_AUTH_TOKEN, plus `env` ("NAME=value").
ProgramResult RunProgram(std::vector<std::string> argv, const std::vector<std::string>& env = {}) {
  ProgramResult result;
  int out[2];
  if (pipe(out) != 0) return result;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!absl::StartsWith(*e, "SUBSPACE_AUTH_TOKEN=")) environment.emplace_back(*e);
  }
  environment.insert(environment.end(), env.begin(), env.end());
  std::vector<char*> args, envp;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  for (std::string& e : environment) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  if (rc != 0) {
    close(out[0]);
    result.output = absl::StrCat("cannot run ", argv[0]);
    return result;
  }
  char buf[4096];
  for (ssize_t n; (n = read(out[0], buf, sizeof(buf))) > 0;) result.output.append(buf, n);
  close(out[0]);
  int status = 0;
  if (waitpid(pid, &status, 0) == pid && WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  return result;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A throwaway PKI in `dir`, made with EC P-256 keys (fast to generate): ca.{pem,key}; server.*
// for localhost and 127.0.0.1, signed by the CA; client.* signed by the CA; other_ca.* and
// other_client.*, a client certificate from a CA the server does not trust.
absl::Status MakePki(const std::string& dir) {
  const auto path = [&](const std::string& name) { return absl::StrCat(dir, "/", name); };
  const auto run = [](std::vector<std::string> argv) -> absl::Status {
    const ProgramResult r = RunProgram(std::move(argv));
    if (r.exit_code == 0) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat("openssl failed (scripts/setup.sh installs Debian's openssl): ", r.output));
  };
  const std::vector<std::string> new_key = {"-newkey", "ec", "-pkeyopt",
                                            "ec_paramgen_curve:prime256v1", "-nodes"};
  const auto make_ca = [&](const std::string& name) {
    std::vector<std::string> argv = {"openssl", "req", "-x509"};
    argv.insert(argv.end(), new_key.begin(), new_key.end());
    argv.insert(argv.end(),
                {"-keyout", path(name + ".key"), "-out", path(name + ".pem"), "-days", "2", "-subj",
                 "/CN=Subspace test " + name, "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign"});
    return run(std::move(argv));
  };
  int serial = 1;
  const auto make_leaf = [&](const std::string& name, const std::string& ca, const std::string& cn,
                             const std::string& extensions) {
    std::vector<std::string> argv = {"openssl", "req"};
    argv.insert(argv.end(), new_key.begin(), new_key.end());
    argv.insert(argv.end(), {"-keyout", path(name + ".key"), "-out", path(name + ".csr"), "-subj",
                             "/CN=" + cn});
    if (absl::Status s = run(std::move(argv)); !s.ok()) return s;
    std::ofstream(path(name + ".ext")) << extensions;
    return run({"openssl", "x509", "-req", "-in", path(name + ".csr"), "-CA", path(ca + ".pem"),
                "-CAkey", path(ca + ".key"), "-set_serial", std::to_string(serial++), "-days", "2",
                "-out", path(name + ".pem"), "-extfile", path(name + ".ext")});
  };
  const std::string leaf =
      "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n";
  const std::string client = leaf + "extendedKeyUsage=clientAuth\n";
  if (absl::Status s = make_ca("ca"); !s.ok()) return s;
  if (absl::Status s = make_leaf("server", "ca", "localhost",
                                 leaf + "extendedKeyUsage=serverAuth\n"
                                        "subjectAltName=DNS:localhost,IP:127.0.0.1\n");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = make_leaf("client", "ca", "subspace-test-client", client); !s.ok()) return s;
  if (absl::Status s = make_ca("other_ca"); !s.ok()) return s;
  return make_leaf("other_client", "other_ca", "subspace-test-client", client);
}

// Calls `method` ("/package.Service/Method") with an empty request message through gRPC's
// generic stub as a stream, which on the wire serves unary and server-streaming methods alike.
grpc::Status CallWithEmptyRequest(const std::shared_ptr<grpc::Channel>& channel,
                                  const std::string& method, const std::string& token) {
  class Reactor : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    Reactor(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
            const std::string& token)
        : stub_(channel) {
      context_.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
      if (!token.empty()) context_.AddMetadata("authorization", absl::StrCat("Bearer ", token));
      request_ = StringToByteBuffer("");
      stub_.PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
      StartWrite(&request_);
      StartRead(&response_);
      StartCall();
    }
    void OnWriteDone(bool ok) override {
      if (ok) StartWritesDone();
    }
    void OnReadDone(bool ok) override {
      if (ok) StartRead(&response_);
    }
    void OnDone(const grpc::Status& s) override { done_.set_value(s); }
    grpc::Status Wait() { return done_.get_future().get(); }

   private:
    grpc::GenericStub stub_;
    grpc::ClientContext context_;
    grpc::ByteBuffer request_;
    grpc::ByteBuffer response_;
    std::promise<grpc::Status> done_;
  };
  Reactor reactor(channel, method, token);
  return reactor.Wait();
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(absl::StrCat(::testing::TempDir(), "/subspace_security_", getpid()));
    std::filesystem::create_directories(*dir_);
    pki_ = new absl::Status(MakePki(*dir_));
    std::ofstream(Path("tokens")) << "# tokens of the security test\n\n"
                                  << kTokenA << "\n  " << kTokenB << "  \n";
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
    delete pki_;
  }
  void SetUp() override { ASSERT_TRUE(pki_->ok()) << *pki_; }
  void TearDown() override {
    if (app_ != nullptr) app_->Shutdown();
  }

  static std::string Path(const std::string& name) { return absl::StrCat(*dir_, "/", name); }

  static server::TlsConfig ServerTls(bool mutual) {
    return {.cert_path = Path("server.pem"),
            .key_path = Path("server.key"),
            .client_ca_path = mutual ? Path("ca.pem") : ""};
  }

  void StartServer(server::TlsConfig tls, bool auth) {
    absl::StatusOr<std::unique_ptr<server::ServerApp>> app =
        server::ServerApp::Start(Config(std::move(tls), auth));
    ASSERT_TRUE(app.ok()) << app.status();
    app_ = *std::move(app);
  }
  static server::ServerAppConfig Config(server::TlsConfig tls, bool auth) {
    server::ServerAppConfig config = TestServerConfig();
    config.http_port = 0;  // the HTTP API takes the same TLS files and tokens
    config.tls = std::move(tls);
    if (auth) config.auth_tokens_path = Path("tokens");
    return config;
  }

  // A channel of its own (no subchannel shared with another test's failed handshake).
  std::shared_ptr<grpc::Channel> Channel(
      const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", app_->port()), credentials, args);
  }
  std::shared_ptr<grpc::Channel> TlsChannel(const std::string& ca, const std::string& cert = "",
                                            const std::string& key = "") {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadFile(Path(ca));
    if (!cert.empty()) ssl.pem_cert_chain = ReadFile(Path(cert));
    if (!key.empty()) ssl.pem_private_key = ReadFile(Path(key));
    return Channel(grpc::SslCredentials(ssl));
  }
  std::shared_ptr<grpc::Channel> PlaintextChannel() {
    return Channel(grpc::InsecureChannelCredentials());
  }

  static std::string* dir_;
  static absl::Status* pki_;
  std::unique_ptr<server::ServerApp> app_;
};

std::string* SecurityTest::dir_ = nullptr;
absl::Status* SecurityTest::pki_ = nullptr;

// The OpenAI-compatible HTTP API on the same files: HTTPS with the client certificate the CA
// signed, bearer tokens as over gRPC; no certificate, another CA's, or plaintext get nothing.
TEST_F(SecurityTest, HttpApiTakesTheSameTlsAndTokens) {
  StartServer(ServerTls(/*mutual=*/true), /*auth=*/true);
  const int port = app_->http_port();
  ASSERT_GT(port, 0);
  const auto get = [&](const std::string& cert, const std::string& key,
                       const std::string& token) -> httplib::Result {
    httplib::SSLClient client("127.0.0.1", port, cert.empty() ? std::string() : Path(cert),
                              key.empty() ? std::string() : Path(key));
    client.set_ca_cert_path(Path("ca.pem").c_str());
    client.enable_server_certificate_verification(true);
    client.set_connection_timeout(std::chrono::seconds(10));
    if (!token.empty()) client.set_bearer_token_auth(token.c_str());
    return client.Get("/v1/models");
  };
  httplib::Result ok = get("client.pem", "client.key", kTokenA);
  ASSERT_TRUE(ok) << httplib::to_string(ok.error());
  EXPECT_EQ(ok->status, 200) << ok->body;
  httplib::Result no_token = get("client.pem", "client.key", "");
  ASSERT_TRUE(no_token);
  EXPECT_EQ(no_token->status, 401);
  httplib::Result wrong_token = get("client.pem", "client.key", "not-a-token-of-this-server");
  ASSERT_TRUE(wrong_token);
  EXPECT_EQ(wrong_token->status, 401);
  EXPECT_FALSE(get("", "", kTokenA));                                  // no client certificate
  EXPECT_FALSE(get("other_client.pem", "other_client.key", kTokenA));  // another CA's
  httplib::Client plaintext("127.0.0.1", port);
  plaintext.set_connection_timeout(std::chrono::seconds(10));
  plaintext.set_read_timeout(std::chrono::seconds(10));
  httplib::Result clear = plaintext.Get("/health");
  EXPECT_TRUE(!clear || clear->status >= 400);
}

TEST_F(SecurityTest, TlsCallsWork) {
  StartServer(ServerTls(/*mutual=*/false), /*auth=*/false);
  auto channel = TlsChannel("ca.pem");
  Caller caller(channel, "");
  EXPECT_TRUE(caller.ModelInfo().ok());
  v1::GenerateResponse response;
  const grpc::Status generated = caller.Generate(TextRequest("over TLS", 4), &response);
  ASSERT_TRUE(generated.ok()) << generated.error_message();
  EXPECT_EQ(response.usage().generated_tokens(), 4u);
  EXPECT_TRUE(caller.Stream(TextRequest("streamed over TLS", 4)).ok());
  EXPECT_EQ(HealthCheck(channel).value_or(-1), kServing);
  // The request size limit holds over TLS as over plaintext (server_itest covers that).
  const grpc::Status oversized =
      caller.Generate(TextRequest(std::string(5 << 20, 'a'), 2), &response);
  EXPECT_EQ(oversized.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << oversized.error_message();
}

TEST_F(SecurityTest, TlsServerRefusesPlaintextAndUntrustingClients) {
  StartServer(ServerTls(/*mutual=*/false), /*auth=*/false);
  const grpc::Status plaintext = Caller(PlaintextChannel(), "").ModelInfo();
  EXPECT_EQ(plaintext.error_code(), grpc::StatusCode::UNAVAILABLE) << plaintext.error_message();
  // A client that does not trust the server's CA does not talk to it either.
  const grpc::Status wrong_ca = Caller(TlsChannel("other_ca.pem"), "").ModelInfo();
  EXPECT_EQ(wrong_ca.error_code(), grpc::StatusCode::UNAVAILABLE) << wrong_ca.error_message();
}

TEST_F(SecurityTest, MutualTlsNeedsAClientCertificateFromTheCa) {
  StartServer(ServerTls(/*mutual=*/true), /*auth=*/false);
  const grpc::Status no_cert = Caller(TlsChannel("ca.pem"), "").ModelInfo();
  EXPECT_EQ(no_cert.error_code(), grpc::StatusCode::UNAVAILABLE) << no_cert.error_message();
  const grpc::Status foreign_cert =
      Caller(TlsChannel("ca.pem", "other_client.pem", "other_client.key"), "").ModelInfo();
  EXPECT_EQ(foreign_cert.error_code(), grpc::StatusCode::UNAVAILABLE)
      << foreign_cert.error_message();
  auto good = TlsChannel("ca.pem", "client.pem", "client.key");
  const grpc::Status ok = Caller(good, "").ModelInfo();
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(HealthCheck(good).value_or(-1), kServing);
}

TEST_F(SecurityTest, EveryRpcNeedsAValidTokenButHealth) {
  StartServer(server::TlsConfig(), /*auth=*/true);
  auto channel = PlaintextChannel();
  // Every method of the service, found through its descriptor, so a new RPC is covered too.
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::Subspace::service_full_name());
  ASSERT_NE(service, nullptr);
  ASSERT_GE(service->method_count(), 8);
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string method =
        absl::StrCat("/", service->full_name(), "/", service->method(i)->name());
    SCOPED_TRACE(method);
    for (const std::string token : {"", "not-a-configured-token-000"}) {
      const grpc::Status s = CallWithEmptyRequest(channel, method, token);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
    }
  }
  EXPECT_TRUE(absl::StrContains(Caller(channel, "").ModelInfo().error_message(),
                                "authorization: Bearer <token>"));
  EXPECT_EQ(Caller(channel, "not-a-configured-token-000").ModelInfo().error_message(),
            "invalid bearer token");

  for (const char* token : {kTokenA, kTokenB}) {
    Caller caller(channel, token);
    EXPECT_TRUE(caller.ModelInfo().ok());
    v1::GenerateResponse response;
    const grpc::Status generated = caller.Generate(TextRequest("with a token", 3), &response);
    EXPECT_TRUE(generated.ok()) << generated.error_message();
    EXPECT_TRUE(caller.Stream(TextRequest("with a token", 3)).ok());
  }
  // Health and reflection stay open: orchestrators probe without credentials.
  EXPECT_EQ(HealthCheck(channel).value_or(-1), kServing);
  EXPECT_EQ(HealthCheck(channel, "subspace.v1.Subspace").value_or(-1), kServing);
  EXPECT_TRUE(ReflectionListServices(channel).ok());
}

TEST_F(SecurityTest, SessionsBelongToTheTokenThatCreatedThem) {
  StartServer(ServerTls(/*mutual=*/false), /*auth=*/true);
  auto channel = TlsChannel("ca.pem");
  Caller a(channel, kTokenA);
  Caller b(channel, kTokenB);
  absl::StatusOr<std::string> session = a.CreateSession();
  ASSERT_TRUE(session.ok()) << session.status();
  v1::GenerateRequest on_session = TextRequest("the first turn", 3);
  on_session.set_session_id(*session);
  v1::GenerateResponse response;
  ASSERT_TRUE(a.Generate(on_session, &response).ok());

  // To B the session does not exist: the very status an unknown id gets.
  const std::string unknown = "0123456789abcdef0123456789abcdef";
  const grpc::Status unknown_status = b.GetSession(unknown);
  ASSERT_EQ(unknown_status.error_code(), grpc::StatusCode::NOT_FOUND);
  const auto expect_hidden = [&](const grpc::Status& s) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
    std::string expected = unknown_status.error_message();
    expected.replace(expected.find(unknown), unknown.size(), *session);
    EXPECT_EQ(s.error_message(), expected);
  };
  expect_hidden(b.GetSession(*session));
  expect_hidden(b.DeleteSession(*session));
  expect_hidden(b.Generate(on_session, &response));
  expect_hidden(b.Stream(on_session));
  EXPECT_TRUE(b.ListSessions().empty());

  // A still has it, with its history intact, and B's own session stays B's.
  EXPECT_TRUE(a.GetSession(*session).ok());
  EXPECT_EQ(a.ListSessions(), std::vector<std::string>{*session});
  on_session.set_text(" the second turn");
  const grpc::Status again = a.Generate(on_session, &response);
  ASSERT_TRUE(again.ok()) << again.error_message();
  EXPECT_GT(response.usage().reused_tokens(), 0u);
  absl::StatusOr<std::string> b_session = b.CreateSession();
  ASSERT_TRUE(b_session.ok()) << b_session.status();
  EXPECT_EQ(b.ListSessions(), std::vector<std::string>{*b_session});
  EXPECT_EQ(a.ListSessions(), std::vector<std::string>{*session});
  EXPECT_EQ(a.GetSession(*b_session).error_code(), grpc::StatusCode::NOT_FOUND);
  // Only the owner exports it, and only the owner's credentials import it.
  std::string snapshot;
  expect_hidden(b.Export(*session, &snapshot));
  EXPECT_TRUE(snapshot.empty());
  ASSERT_TRUE(a.Export(*session, &snapshot).ok());
  EXPECT_FALSE(snapshot.empty());
  const grpc::Status stolen = b.Import(snapshot);
  EXPECT_EQ(stolen.error_code(), grpc::StatusCode::PERMISSION_DENIED) << stolen.error_message();
  EXPECT_EQ(a.Import(snapshot).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_TRUE(a.DeleteSession(*session).ok());
  EXPECT_TRUE(b.DeleteSession(*b_session).ok());
}

TEST_F(SecurityTest, ClientLibraryOverMutualTlsWithAToken) {
  StartServer(ServerTls(/*mutual=*/true), /*auth=*/true);
  client::ClientOptions options;
  options.server = absl::StrCat("127.0.0.1:", app_->port());
  options.timeout = absl::Seconds(20);
  absl::StatusOr<client::ClientTls> tls =
      client::LoadClientTls(Path("ca.pem"), Path("client.pem"), Path("client.key"));
  ASSERT_TRUE(tls.ok()) << tls.status();
  options.tls = *tls;

  client::SubspaceClient anonymous(options);
  EXPECT_EQ(anonymous.GetModelInfo().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anonymous.Health().value_or(client::health_v1::HealthCheckResponse::UNKNOWN),
            client::health_v1::HealthCheckResponse::SERVING);

  options.auth_token = kTokenA;
  client::SubspaceClient with_token(options);
  absl::StatusOr<v1::GenerateResponse> generated =
      with_token.Generate(TextRequest("from the client library", 3));
  ASSERT_TRUE(generated.ok()) << generated.status();
  absl::StatusOr<v1::Session> session = with_token.CreateSession();
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_TRUE(with_token.DeleteSession(session->session_id()).ok());

  EXPECT_EQ(client::LoadClientTls(Path("ca.pem"), Path("client.pem"), "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      absl::StrContains(client::LoadClientTls("/nonexistent/ca.pem", "", "").status().message(),
                        "--tls-ca: cannot read /nonexistent/ca.pem"));
}

#ifdef SUBSPACE_CLIENT_BIN
TEST_F(SecurityTest, CliOverMutualTlsWithAToken) {
  StartServer(ServerTls(/*mutual=*/true), /*auth=*/true);
  const std::vector<std::string> base = {SUBSPACE_CLIENT_BIN,
                                         "--server",
                                         absl::StrCat("127.0.0.1:", app_->port()),
                                         "--timeout-seconds",
                                         "20",
                                         "--tls-ca",
                                         Path("ca.pem"),
                                         "--tls-cert",
                                         Path("client.pem"),
                                         "--tls-key",
                                         Path("client.key")};
  const auto run = [&](const std::vector<std::string>& tail,
                       const std::vector<std::string>& env = {}) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), tail.begin(), tail.end());
    return RunProgram(std::move(argv), env);
  };
  ProgramResult r = run({"info"}, {absl::StrCat("SUBSPACE_AUTH_TOKEN=", kTokenA)});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "tiny-random")) << r.output;
  r = run(
      {"--auth-token", kTokenB, "generate", "--prompt", "from the CLI", "--max-new-tokens", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // The flag wins over the environment.
  r = run({"--auth-token", "not-a-configured-token-000", "info"},
          {absl::StrCat("SUBSPACE_AUTH_TOKEN=", kTokenA)});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "UNAUTHENTICATED")) << r.output;
  r = run({"info"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "UNAUTHENTICATED")) << r.output;
  r = run({"health"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "SERVING")) << r.output;
}
#endif

TEST_F(SecurityTest, UnusableFilesStopTheServerAtStart) {
  std::ofstream(Path("empty.tokens")) << "";
  std::ofstream(Path("comments.tokens")) << "# nothing but a comment\n\n";
  std::ofstream(Path("garbage.pem")) << "not a certificate\n";
  const struct {
    server::TlsConfig tls;
    std::string tokens;
    std::string message;
  } cases[] = {
      {{.cert_path = Path("missing.pem"), .key_path = Path("server.key")},
       "",
       absl::StrCat("--tls-cert: cannot read ", Path("missing.pem"))},
      {{.cert_path = Path("server.pem"), .key_path = Path("missing.key")},
       "",
       absl::StrCat("--tls-key: cannot read ", Path("missing.key"))},
      {{.cert_path = Path("server.pem"), .key_path = Path("client.key")},
       "",
       "is not the key of the certificate"},
      {{.cert_path = Path("garbage.pem"), .key_path = Path("server.key")},
       "",
       "holds no PEM certificate"},
      {{.cert_path = Path("server.pem"), .key_path = Path("garbage.pem")},
       "",
       "holds no PEM private key"},
      {{.cert_path = Path("server.pem")}, "", "--tls-cert and --tls-key must be given together"},
      {{.client_ca_path = Path("ca.pem")}, "", "--tls-client-ca needs --tls-cert and --tls-key"},
      {{.cert_path = Path("server.pem"),
        .key_path = Path("server.key"),
        .client_ca_path = Path("missing-ca.pem")},
       "",
       "--tls-client-ca: cannot read"},
      {{}, Path("empty.tokens"), "holds no token"},
      {{}, Path("comments.tokens"), "holds no token"},
      {{}, Path("missing.tokens"), "--auth-tokens: cannot read"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    server::ServerAppConfig config = TestServerConfig();
    config.tls = c.tls;
    config.auth_tokens_path = c.tokens;
    absl::StatusOr<std::unique_ptr<server::ServerApp>> app = server::ServerApp::Start(config);
    EXPECT_EQ(app.status().code(), absl::StatusCode::kInvalidArgument) << app.status();
    EXPECT_TRUE(absl::StrContains(app.status().message(), c.message)) << app.status();
  }
}

#ifdef SUBSPACE_SERVER_BIN
TEST_F(SecurityTest, ServerBinaryExitsWithAMessageOnUnusableFiles) {
  std::ofstream(Path("empty.tokens")) << "";
  const std::vector<std::string> base = {SUBSPACE_SERVER_BIN,
                                         "--model",
                                         testing::TinyModelPath(),
                                         "--host",
                                         "127.0.0.1",
                                         "--port",
                                         "0",
                                         "--metrics-port",
                                         "-1",
                                         "--http-port",
                                         "-1"};
  const struct {
    std::vector<std::string> flags;
    std::string message;
  } cases[] = {
      {{"--tls-cert", Path("missing.pem"), "--tls-key", Path("server.key")},
       absl::StrCat("--tls-cert: cannot read ", Path("missing.pem"))},
      {{"--auth-tokens", Path("empty.tokens")}, "holds no token"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), c.flags.begin(), c.flags.end());
    const ProgramResult r = RunProgram(argv);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_TRUE(absl::StrContains(r.output, c.message)) << r.output;
  }
}
#endif

// Everything the server logs at info level (its default) while it serves requests carrying a
// distinctive prompt, token ids, stop string and bearer tokens: none of them may appear.
TEST_F(SecurityTest, ServerLogHoldsNoPromptOrToken) {
  std::ostringstream log;
  auto logger = std::make_shared<spdlog::logger>(
      "capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(log));
  logger->set_level(spdlog::level::info);
  const std::shared_ptr<spdlog::logger> previous = spdlog::default_logger();
  spdlog::set_default_logger(logger);

  StartServer(ServerTls(/*mutual=*/false), /*auth=*/true);
  auto channel = TlsChannel("ca.pem");
  Caller caller(channel, kTokenA);
  const std::string prompt = "Quokka-Zanzibar secret recipe 7f3a9";
  const std::string stop = "Marmalade-stop-41c";
  const std::vector<int32_t> ids = {1, 201, 202, 203, 204, 205};
  std::vector<std::string> outputs;

  v1::GenerateRequest text = TextRequest(prompt, 16);
  text.set_request_id("log-check-text");
  text.mutable_sampling()->add_stop(stop);
  v1::GenerateResponse response;
  ASSERT_TRUE(caller.Generate(text, &response).ok());
  outputs.push_back(response.text());
  text.set_request_id("log-check-stream");
  EXPECT_TRUE(caller.Stream(text).ok());

  v1::GenerateRequest tokens;
  tokens.set_request_id("log-check-tokens");
  for (int32_t id : ids) tokens.mutable_tokens()->add_ids(id);
  tokens.mutable_sampling()->set_max_new_tokens(16);
  tokens.mutable_sampling()->set_ignore_eos(true);
  ASSERT_TRUE(caller.Generate(tokens, &response).ok());
  outputs.push_back(response.text());

  absl::StatusOr<std::string> session = caller.CreateSession();
  ASSERT_TRUE(session.ok()) << session.status();
  text.set_request_id("log-check-session");
  text.set_session_id(*session);
  ASSERT_TRUE(caller.Generate(text, &response).ok());

  text.set_request_id("log-check-rejected");
  text.mutable_sampling()->set_top_p(2.0f);
  EXPECT_EQ(caller.Generate(text, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Caller(channel, "wrong-token-58d1e7c2b9").Generate(text, &response).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);

  app_->Shutdown();  // every request line is written by now
  spdlog::set_default_logger(previous);

  const std::string logged = log.str();
  // The capture works: the request lines are there, by request id.
  for (const char* id : {"log-check-text", "log-check-stream", "log-check-tokens",
                         "log-check-session", "log-check-rejected"}) {
    EXPECT_TRUE(absl::StrContains(logged, id)) << id << " missing from:\n" << logged;
  }
  for (const std::string& secret :
       {prompt, std::string("Quokka"), stop, std::string(kTokenA), std::string(kTokenB),
        std::string("wrong-token-58d1e7c2b9"), absl::StrJoin(ids, ", "), absl::StrJoin(ids, ","),
        absl::StrJoin(ids, " ")}) {
    EXPECT_FALSE(absl::StrContains(logged, secret)) << "'" << secret << "' in:\n" << logged;
  }
  for (const std::string& output : outputs) {
    if (output.size() < 12) continue;  // too short to be told from other text
    EXPECT_FALSE(absl::StrContains(logged, output)) << "'" << output << "' in:\n" << logged;
  }
}

}  // namespace
}  // namespace subspace
