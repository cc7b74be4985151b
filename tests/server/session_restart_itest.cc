// Sessions across a restart (--session-dir): a server shut down writes its sessions, a server
// started on the same directory restores them, and a restored session continues bitwise as an
// uninterrupted one would, reusing its cached tokens (compressed and full-rank caches). Files it
// cannot restore are moved aside with the server still serving; the binary does the same on
// SIGTERM and exits 0.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "server/server_app.h"
#include "tests/server/server_process.h"
#include "tests/server/server_test_util.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::ChannelTo;
using ::subspace::testing::FilesIn;
using ::subspace::testing::TempDir;
using ::subspace::testing::TestServerConfig;

struct Turn {
  std::vector<int32_t> tokens;
  uint32_t reused = 0;
};

Turn Generate(v1::Subspace::Stub& stub, const std::string& session, const std::string& text,
              uint32_t max_new) {
  grpc::ClientContext context;
  v1::GenerateRequest request;
  request.set_text(text);
  request.set_session_id(session);
  request.mutable_sampling()->set_max_new_tokens(max_new);
  request.mutable_sampling()->set_ignore_eos(true);
  v1::GenerateResponse response;
  const grpc::Status st = stub.Generate(&context, request, &response);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return {{response.token_ids().begin(), response.token_ids().end()},
          response.usage().reused_tokens()};
}

std::string CreateSession(v1::Subspace::Stub& stub) {
  grpc::ClientContext context;
  v1::Session session;
  const grpc::Status st = stub.CreateSession(&context, v1::CreateSessionRequest(), &session);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return session.session_id();
}

absl::StatusOr<v1::Session> GetSession(v1::Subspace::Stub& stub, const std::string& id) {
  grpc::ClientContext context;
  v1::GetSessionRequest request;
  request.set_session_id(id);
  v1::Session session;
  const grpc::Status st = stub.GetSession(&context, request, &session);
  if (!st.ok()) return absl::Status(static_cast<absl::StatusCode>(st.error_code()), "");
  return session;
}

class SessionRestartTest : public ::testing::TestWithParam<runtime::KvCacheKind> {
 protected:
  std::unique_ptr<server::ServerApp> Start() {
    server::ServerAppConfig config = TestServerConfig();
    config.session_dir = dir_.path();
    config.kv_cache.kind = GetParam();
    absl::StatusOr<std::unique_ptr<server::ServerApp>> app = server::ServerApp::Start(config);
    EXPECT_TRUE(app.ok()) << app.status();
    return app.ok() ? *std::move(app) : nullptr;
  }

  TempDir dir_;
};

TEST_P(SessionRestartTest, RestoredSessionsContinueAsUninterruptedOnes) {
  // Long enough that the compressed cache codes blocks (sinks 4, window 64).
  const std::string first = "The quick brown fox jumps over the lazy dog and keeps on running";
  const std::string second = " then the dog wakes up";
  std::string restarted, uninterrupted;
  Turn want;
  {
    auto app = Start();
    ASSERT_NE(app, nullptr);
    auto stub = v1::Subspace::NewStub(ChannelTo(app->port()));
    restarted = CreateSession(*stub);
    uninterrupted = CreateSession(*stub);
    const Turn a = Generate(*stub, restarted, first, 60);
    const Turn b = Generate(*stub, uninterrupted, first, 60);
    ASSERT_EQ(a.tokens, b.tokens);
    want = Generate(*stub, uninterrupted, second, 30);
    EXPECT_TRUE(app->Shutdown());
  }
  std::vector<std::string> files = FilesIn(dir_.path());
  ASSERT_EQ(files.size(), 2u);
  // A file that is no snapshot is refused, kept aside, and stops nothing.
  std::ofstream(dir_.path() + "/garbage.session") << "not a snapshot";

  auto app = Start();
  ASSERT_NE(app, nullptr);
  auto stub = v1::Subspace::NewStub(ChannelTo(app->port()));
  absl::StatusOr<v1::Session> info = GetSession(*stub, restarted);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_GT(info->tokens(), 60u);
  EXPECT_EQ(info->cached_tokens(), info->tokens() - 1);
  const uint32_t cached = info->cached_tokens();
  const Turn got = Generate(*stub, restarted, second, 30);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.reused, cached);  // nothing recomputed
  EXPECT_EQ(got.reused, want.reused);
  info = GetSession(*stub, uninterrupted);
  ASSERT_TRUE(info.ok()) << info.status();
  // Restored snapshots stay as the sessions' checkpoints (consumed without checkpoints); the
  // disk tier's directory is there while the server runs.
  std::vector<std::string> names = {"garbage.session.rejected", restarted + ".session", "tier",
                                    uninterrupted + ".session"};
  std::sort(names.begin(), names.end());
  EXPECT_EQ(FilesIn(dir_.path()), names);
}

INSTANTIATE_TEST_SUITE_P(Caches, SessionRestartTest,
                         ::testing::Values(runtime::KvCacheKind::kCompressed,
                                           runtime::KvCacheKind::kFull),
                         [](const auto& info) {
                           return std::string(runtime::KvCacheKindName(info.param));
                         });

absl::StatusOr<std::string> Export(v1::Subspace::Stub& stub, const std::string& id) {
  grpc::ClientContext context;
  v1::ExportSessionRequest request;
  request.set_session_id(id);
  auto reader = stub.ExportSession(&context, request);
  std::string bytes;
  int chunks = 0;
  for (v1::SessionSnapshotChunk chunk; reader->Read(&chunk); ++chunks) bytes += chunk.data();
  const grpc::Status st = reader->Finish();
  if (!st.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  }
  EXPECT_EQ(chunks, static_cast<int>((bytes.size() + (1 << 20) - 1) >> 20));
  return bytes;
}

// Uploads `bytes` in pieces of `piece` bytes.
grpc::Status Import(v1::Subspace::Stub& stub, const std::string& bytes, v1::Session* session,
                    size_t piece = 1000) {
  grpc::ClientContext context;
  auto writer = stub.ImportSession(&context, session);
  for (size_t at = 0; at < bytes.size(); at += piece) {
    v1::SessionSnapshotChunk chunk;
    chunk.set_data(bytes.substr(at, piece));
    if (!writer->Write(chunk)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

// ExportSession on one server, ImportSession on another: the session moves with its cache and
// continues there as it would have here.
TEST(SessionMoveRpcTest, ExportedSessionContinuesOnAnotherServer) {
  server::ServerAppConfig config = TestServerConfig();
  absl::StatusOr<std::unique_ptr<server::ServerApp>> a = server::ServerApp::Start(config);
  absl::StatusOr<std::unique_ptr<server::ServerApp>> b = server::ServerApp::Start(config);
  ASSERT_TRUE(a.ok() && b.ok());
  auto stub_a = v1::Subspace::NewStub(ChannelTo((*a)->port()));
  auto stub_b = v1::Subspace::NewStub(ChannelTo((*b)->port()));
  const std::string id = CreateSession(*stub_a);
  Generate(*stub_a, id, "The quick brown fox jumps over the lazy dog and keeps on running", 60);

  absl::StatusOr<std::string> snapshot = Export(*stub_a, id);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(Export(*stub_a, "no-such-session").status().code(), absl::StatusCode::kNotFound);
  v1::Session moved;
  const grpc::Status imported = Import(*stub_b, *snapshot, &moved);
  ASSERT_TRUE(imported.ok()) << imported.error_message();
  EXPECT_EQ(moved.session_id(), id);
  EXPECT_EQ(moved.cached_tokens(), moved.tokens() - 1);

  const Turn here = Generate(*stub_a, id, " then the dog wakes up", 30);
  const Turn there = Generate(*stub_b, id, " then the dog wakes up", 30);
  EXPECT_EQ(there.tokens, here.tokens);
  EXPECT_EQ(there.reused, here.reused);
  EXPECT_EQ(there.reused, moved.cached_tokens());

  // Refused, and the server keeps serving: the same id again, a cut or corrupted snapshot.
  v1::Session none;
  EXPECT_EQ(Import(*stub_b, *snapshot, &none).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Import(*stub_b, snapshot->substr(0, snapshot->size() / 2), &none).error_code(),
            grpc::StatusCode::DATA_LOSS);
  std::string corrupt = *snapshot;
  corrupt[corrupt.size() / 2] ^= 0x10;
  EXPECT_EQ(Import(*stub_b, corrupt, &none).error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(Import(*stub_b, "", &none).error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(Generate(*stub_b, id, " and", 3).tokens.size(), 3u);
}

// The server binary on the tiny model with `dir` as its session directory (null, the test
// failed, when it did not start); killed when the test leaves it running.
std::unique_ptr<testing::ServerProcess> LaunchServer(const std::string& dir,
                                                     const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {SUBSPACE_SERVER_BIN,
                                   "--model",
                                   testing::TinyModelPath(),
                                   "--host",
                                   "127.0.0.1",
                                   "--port",
                                   "0",
                                   "--metrics-port",
                                   "-1",
                                   "--http-port",
                                   "-1",
                                   "--block-size",
                                   "8",
                                   "--session-dir",
                                   dir,
                                   "--log-level",
                                   "warn"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  absl::StatusOr<std::unique_ptr<testing::ServerProcess>> server =
      testing::ServerProcess::Start(std::move(argv), absl::Seconds(60));
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

// SIGTERM, then the exit status: 0.
void StopServer(testing::ServerProcess& server) {
  ASSERT_TRUE(server.Signal(SIGTERM));
  absl::StatusOr<int> status = server.WaitExit(absl::Seconds(60));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status << server.ReadStderr();
}

// kill -9: nothing of the process runs after it.
void KillServer(testing::ServerProcess& server) {
  ASSERT_TRUE(server.Signal(SIGKILL));
  EXPECT_TRUE(server.WaitExit(absl::Seconds(60)).ok());
}

// The binary: SIGTERM drains, writes the session and exits 0; started again on the directory
// (without checkpoints here: the restored file is consumed) it serves the session.
TEST(SessionRestartBinaryTest, SigtermWritesSessionsAndARestartServesThem) {
  TempDir dir;
  const std::vector<std::string> flags = {"--kv-cache-bytes", "2097152",
                                          "--session-checkpoint-seconds", "0"};
  auto server = LaunchServer(dir.path(), flags);
  ASSERT_NE(server, nullptr);
  int port = server->port();
  std::string id;
  uint32_t tokens = 0;
  {
    auto stub = v1::Subspace::NewStub(ChannelTo(port));
    id = CreateSession(*stub);
    Generate(*stub, id, "hello there, how are you", 20);
    absl::StatusOr<v1::Session> info = GetSession(*stub, id);
    ASSERT_TRUE(info.ok());
    tokens = info->tokens();
  }
  StopServer(*server);
  EXPECT_EQ(FilesIn(dir.path()), std::vector<std::string>{id + ".session"});

  server = LaunchServer(dir.path(), flags);
  ASSERT_NE(server, nullptr);
  port = server->port();
  {
    auto stub = v1::Subspace::NewStub(ChannelTo(port));
    absl::StatusOr<v1::Session> info = GetSession(*stub, id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->tokens(), tokens);
    EXPECT_EQ(info->cached_tokens(), tokens - 1);
    EXPECT_EQ(Generate(*stub, id, " fine", 5).reused, tokens - 1);
    EXPECT_EQ(FilesIn(dir.path()), std::vector<std::string>{"tier"});
  }
  StopServer(*server);
}

// A session whose cache the pool gave up to the disk tier survives kill -9: the next start
// recovers its file and serves it with its cache.
TEST(SessionRestartBinaryTest, SessionOnTheDiskTierSurvivesKill9) {
  TempDir dir;
  // 48 KiB of fp32 pages: 192 tokens of the tiny model; no host tier, so the session's cache
  // goes straight to disk when the big request needs its blocks.
  const std::vector<std::string> flags = {"--kv-cache",        "full", "--kv-cache-bytes", "49152",
                                          "--session-host-mb", "0"};
  auto server = LaunchServer(dir.path(), flags);
  ASSERT_NE(server, nullptr);
  int port = server->port();
  std::string id;
  uint32_t tokens = 0;
  {
    auto stub = v1::Subspace::NewStub(ChannelTo(port));
    id = CreateSession(*stub);
    Generate(*stub, id, "hello there, how are you", 20);
    absl::StatusOr<v1::Session> info = GetSession(*stub, id);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->cache_location(), "pool");
    tokens = info->tokens();
    Generate(*stub, "", std::string(150, 'x'), 20);  // needs the idle session's blocks
    for (absl::Time end = absl::Now() + absl::Seconds(30); absl::Now() < end;) {
      info = GetSession(*stub, id);
      if (info.ok() && info->cache_location() == "disk") break;
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->cache_location(), "disk");
    EXPECT_EQ(info->cached_tokens(), tokens - 1);
  }
  KillServer(*server);
  EXPECT_EQ(FilesIn(dir.path() + "/tier"), std::vector<std::string>{id + ".session"});

  server = LaunchServer(dir.path(), flags);
  ASSERT_NE(server, nullptr);
  port = server->port();
  {
    auto stub = v1::Subspace::NewStub(ChannelTo(port));
    absl::StatusOr<v1::Session> info = GetSession(*stub, id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->tokens(), tokens);
    EXPECT_EQ(info->cached_tokens(), tokens - 1);
    EXPECT_EQ(info->cache_location(), "pool");
    EXPECT_EQ(Generate(*stub, id, " fine", 5).reused, tokens - 1);
  }
  StopServer(*server);
}

// Checkpoints while serving: a killed process's next start serves the sessions as of the last
// checkpoint, and a session deleted before the kill stays deleted.
TEST(SessionRestartBinaryTest, CheckpointsSurviveKill9AndDeletionsStay) {
  TempDir dir;
  const std::vector<std::string> flags = {"--kv-cache-bytes", "2097152",
                                          "--session-checkpoint-seconds", "0.1"};
  const auto file = [&](const std::string& id) { return dir.path() + "/" + id + ".session"; };
  // Waits for the session's file to be written anew (another modification time).
  const auto rewritten = [&](const std::string& id, std::filesystem::file_time_type before) {
    for (absl::Time end = absl::Now() + absl::Seconds(30); absl::Now() < end;) {
      std::error_code ec;
      const auto t = std::filesystem::last_write_time(file(id), ec);
      if (!ec && t != before) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  };
  auto server = LaunchServer(dir.path(), flags);
  ASSERT_NE(server, nullptr);
  int port = server->port();
  std::string kept, deleted;
  uint32_t tokens = 0;
  {
    auto stub = v1::Subspace::NewStub(ChannelTo(port));
    kept = CreateSession(*stub);
    deleted = CreateSession(*stub);
    Generate(*stub, kept, "hello there, how are you", 10);
    Generate(*stub, deleted, "and who are you", 10);
    ASSERT_TRUE(rewritten(kept, {}));
    ASSERT_TRUE(rewritten(deleted, {}));
    const auto first = std::filesystem::last_write_time(file(kept));
    Generate(*stub, kept, " fine, thanks", 10);
    ASSERT_TRUE(rewritten(kept, first)) << "the second turn was not checkpointed";
    absl::StatusOr<v1::Session> info = GetSession(*stub, kept);
    ASSERT_TRUE(info.ok());
    tokens = info->tokens();
    grpc::ClientContext context;
    v1::DeleteSessionRequest request;
    request.set_session_id(deleted);
    v1::DeleteSessionResponse response;
    ASSERT_TRUE(stub->DeleteSession(&context, request, &response).ok());
    for (absl::Time end = absl::Now() + absl::Seconds(30);
         absl::Now() < end && std::filesystem::exists(file(deleted));) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_FALSE(std::filesystem::exists(file(deleted)));
  }
  KillServer(*server);

  server = LaunchServer(dir.path(), flags);
  ASSERT_NE(server, nullptr);
  port = server->port();
  {
    auto stub = v1::Subspace::NewStub(ChannelTo(port));
    absl::StatusOr<v1::Session> info = GetSession(*stub, kept);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->tokens(), tokens);
    EXPECT_EQ(info->cached_tokens(), tokens - 1);
    EXPECT_EQ(Generate(*stub, kept, " and you?", 5).reused, tokens - 1);
    EXPECT_EQ(GetSession(*stub, deleted).status().code(), absl::StatusCode::kNotFound);
  }
  StopServer(*server);
}

}  // namespace
}  // namespace subspace
