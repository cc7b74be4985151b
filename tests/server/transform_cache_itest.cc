// The server over the transform-coded KV cache (--kv-cache transform): a codec file fitted on
// the tiny model serves sessions and foreign or missing files are refused naming --codec; with
// --kv-budget the server fits the codec itself at start-up, on a text or on the model's own;
// sessions that ask for online refresh get codes fitted to their own rows.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "core/compress/basis_file.h"
#include "core/compress/codec_file.h"
#include "core/compress/transform_calibration.h"
#include "core/model/model.h"
#include "gtest/gtest.h"
#include "runtime/kv_cache_options.h"
#include "server/server_app.h"
#include "tests/server/cache_server.h"
#include "tests/server/server_test_util.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::ExpectSessionCompresses;
using ::subspace::testing::TestServerConfig;
using ::subspace::testing::TokensRequest;
using Server = ::subspace::testing::InProcessServer;

// --kv-cache transform: a codec fitted on the tiny model (subspace-calibrate --kv-budget's code
// path) serves sessions whose old blocks are stored as its codes: reported as "transform", the
// pool holds coded pages, the ratio counts them; a continuation after the session's tokens were
// coded still generates. A missing or foreign codec stops the start naming --codec.
TEST(TransformCacheServerTest, CodecFileServesSessionsAndMisusesAreRefused) {
  const std::string dir = ::testing::TempDir();
  const std::string good = dir + "/tiny.codec.gguf", other = dir + "/other.codec.gguf";
  auto fit = [](const std::shared_ptr<const GgufFile>& gguf, const std::string& path) {
    absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(gguf);
    ASSERT_TRUE(model.ok()) << model.status();
    std::vector<int32_t> tokens;
    for (int i = 0; i < 300; ++i) tokens.push_back(3 + (i * 37) % 250);
    absl::StatusOr<KvRows> rows =
        CollectKvRows(**model, tokens, {.window = 64, .max_tokens = 0, .bos = 1, .progress = {}});
    ASSERT_TRUE(rows.ok()) << rows.status();
    absl::StatusOr<TransformCodes> codes =
        FitTransformCodes(*rows, {.key_bits = 3.0, .value_bits = 2.0});
    ASSERT_TRUE(codes.ok()) << codes.status();
    CodecFile file{.info = {.key_bits = 3.0,
                            .value_bits = 2.0,
                            .calibration_tokens = 300,
                            .model_checksum = ModelChecksum(*gguf)},
                   .geometry = (*model)->config().cache_geometry(),
                   .keys = *codes->keys,
                   .values = *codes->values};
    ASSERT_TRUE(WriteCodecFile(path, file).ok());
  };
  absl::StatusOr<std::unique_ptr<GgufFile>> tiny = GgufFile::Open(testing::TinyModelPath());
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  fit(std::shared_ptr<const GgufFile>(*std::move(tiny)), good);
  fit(*GgufFile::FromBytes(testing::BuildTinyLlamaGguf({.context = 256, .seed = 2})), other);

  server::ServerAppConfig config = TestServerConfig();
  config.kv_cache.kind = runtime::KvCacheKind::kTransform;
  config.kv_cache.codec_path = good;
  config.kv_cache.window_tokens = 16;
  {
    Server s(config);
    ASSERT_TRUE(s.ok());
    const v1::ModelInfo info = s.ModelInfo();
    EXPECT_EQ(info.cache().kind(), "transform");
    const std::string session = s.CreateSession();
    ExpectSessionCompresses(s, info, session);
    // The continuation reads the coded blocks back.
    const v1::GenerateResponse more = s.Generate(TokensRequest({302, 303}, 20), session);
    EXPECT_EQ(more.token_ids_size(), 20);
    s.DeleteSession(session);
  }
  for (const auto& [path, expected] :
       {std::pair{other, "--codec " + other},
        std::pair{dir + "/no_such.codec.gguf", std::string("no_such")}}) {
    SCOPED_TRACE(path);
    config.kv_cache.codec_path = path;
    const absl::Status status = server::ServerApp::Start(config).status();
    EXPECT_FALSE(status.ok());
    EXPECT_TRUE(absl::StrContains(status.message(), expected)) << status;
  }
  config.kv_cache.codec_path = "";
  absl::Status missing = server::ServerApp::Start(config).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(missing.message(), "--codec FILE")) << missing;
  server::ServerAppConfig compressed = TestServerConfig();
  compressed.kv_cache.codec_path = good;
  absl::Status wrong = server::ServerApp::Start(compressed).status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(wrong.message(), "--codec needs --kv-cache=transform")) << wrong;
  for (const std::string& p : {good, other}) std::remove(p.c_str());
}

// --kv-budget: the server fits the codec itself at start-up, on --calib-text or on text the
// model writes itself, and serves with it; a missing text is refused naming the flag.
TEST(TransformCacheServerTest, BudgetFitsTheCodecAtStartUp) {
  const std::string text = ::testing::TempDir() + "/calib.txt";
  {
    std::ofstream out(text);
    for (int i = 0; i < 60; ++i) {
      out << "The quick brown fox " << i << " jumps over the lazy dog, and the cache keeps "
          << "its keys and values in codes. ";
    }
  }
  server::ServerAppConfig config = TestServerConfig();
  config.kv_cache.kind = runtime::KvCacheKind::kTransform;
  config.kv_cache.kv_budget = 3.0;
  config.kv_cache.kv_budget_v = 2.0;
  config.kv_cache.calib_text_path = text;
  config.kv_cache.calib_tokens = 600;
  config.kv_cache.window_tokens = 16;
  for (const bool post_rope : {false, true}) {
    SCOPED_TRACE(post_rope ? "post-RoPE keys, the model's own text" : "pre-RoPE keys");
    config.kv_cache.codec_post_rope = post_rope;
    config.kv_cache.calib_text_path = post_rope ? "" : text;
    Server s(config);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s.ModelInfo().cache().kind(), "transform");
    const std::string session = s.CreateSession();
    const v1::GenerateResponse r = s.Generate(TokensRequest({1, 300, 301}, 60), session);
    EXPECT_EQ(r.token_ids_size(), 60);
    EXPECT_GT(s.CacheStats().bytes_used_compressed(), 0u);
    s.DeleteSession(session);
  }
  config.kv_cache.codec_post_rope = false;
  config.kv_cache.calib_text_path = ::testing::TempDir() + "/no_such_text";
  const absl::Status missing = server::ServerApp::Start(config).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_TRUE(absl::StrContains(missing.message(), "--calib-text")) << missing;
  std::remove(text.c_str());
}

// A session that asks for pca refresh gets codes refitted to its own rows as it generates
// (GetCacheStats counts the refreshes and the epochs); other methods are refused by name, and
// the server's default stays static.
TEST(TransformCacheServerTest, SessionsRefreshTheirCodesOnline) {
  server::ServerAppConfig config = TestServerConfig();
  config.kv_cache.kind = runtime::KvCacheKind::kTransform;
  config.kv_cache.kv_budget = 3.0;
  config.kv_cache.kv_budget_v = 2.0;
  config.kv_cache.calib_tokens = 300;
  config.kv_cache.window_tokens = 16;
  Server s(config);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s.ModelInfo().cache().refresh_method(), "none");
  auto stub = v1::Subspace::NewStub(testing::ChannelTo(s.app().port()));
  const auto create = [&](const std::string& method, uint32_t every, v1::Session* out) {
    return testing::CreateRefreshingSession(*stub, method, every, out);
  };
  v1::Session session;
  const grpc::Status kqsvd = create("kqsvd", 16, &session);
  EXPECT_EQ(kqsvd.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(kqsvd.error_message(), "by pca")) << kqsvd.error_message();
  ASSERT_TRUE(create("pca", 16, &session).ok());
  EXPECT_EQ(session.refresh_method(), "pca");
  const std::string plain = s.CreateSession();
  s.Generate(TokensRequest({1, 300, 301, 302, 290}, 40), plain);
  EXPECT_EQ(s.CacheStats().refreshes_total(), 0u);
  s.Generate(TokensRequest({1, 300, 301, 302, 290}, 120), session.session_id());
  const v1::CacheStats stats = testing::TurnUntilARefresh(s, session.session_id());
  EXPECT_GT(stats.refreshes_total(), 0u);
  EXPECT_EQ(stats.refresh_failures_total(), 0u);
  // What was published is installed at the session's next commit: this turn's.
  const v1::GenerateResponse more = s.Generate(TokensRequest({302, 303}, 20), session.session_id());
  EXPECT_EQ(more.token_ids_size(), 20);
  EXPECT_GT(s.CacheStats().epochs_live(), 1u);
  s.DeleteSession(session.session_id());
  s.DeleteSession(plain);
  // The engine's loop frees a deleted session's sequence; its refreshed epochs go with it.
  uint64_t live = s.CacheStats().epochs_live();
  for (int i = 0; i < 100 && live != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    live = s.CacheStats().epochs_live();
  }
  EXPECT_EQ(live, 1u);
}

}  // namespace
}  // namespace subspace
