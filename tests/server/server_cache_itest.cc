// The server over the compressed KV cache: GetModelInfo reports the cache's configuration,
// long generations compress blocks (GetCacheStats, /metrics and the compression ratio agree),
// at rank = head_dim with fp32 coefficients and fp32 full blocks greedy outputs equal the full
// cache's (sessions included), bad cache settings are INVALID_ARGUMENT naming the flag, and a
// calibrated --bases file is installed at start (mismatched ones rejected).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "core/compress/basis_file.h"
#include "core/compress/calibration.h"
#include "core/model/model.h"
#include "gtest/gtest.h"
#include "proto/subspace.grpc.pb.h"
#include "runtime/kv_cache_options.h"
#include "server/server_app.h"
#include "tests/server/cache_server.h"
#include "tests/server/server_test_util.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::ChannelTo;
using ::subspace::testing::CreateRefreshingSession;
using ::subspace::testing::ExpectedCompressionRatio;
using ::subspace::testing::HttpGet;
using ::subspace::testing::MetricValue;
using ::subspace::testing::TestServerConfig;
using ::subspace::testing::WaitFor;

// The tiny model has head_dim 8 and B = 8 here: with S = 4 and W = 8 a sequence keeps block 0
// and its last one or two blocks full-rank and compresses everything between.
server::ServerAppConfig CompressedConfig(int rank, CoeffDtype dtype,
                                         CoeffDtype full_dtype = CoeffDtype::kFp16) {
  server::ServerAppConfig c = TestServerConfig();
  c.kv_cache.kind = runtime::KvCacheKind::kCompressed;
  c.kv_cache.sink_tokens = 4;
  c.kv_cache.window_tokens = 8;
  c.kv_cache.rank_k = rank;
  c.kv_cache.rank_v = rank;
  c.kv_cache.coeff_dtype = dtype;
  c.kv_cache.full_dtype = full_dtype;
  return c;
}

server::ServerAppConfig FullConfig() {
  server::ServerAppConfig c = TestServerConfig();
  c.kv_cache.kind = runtime::KvCacheKind::kFull;
  return c;
}

using ::subspace::testing::ExpectSessionCompresses;
using ::subspace::testing::Ids;
using ::subspace::testing::TokensRequest;
using Server = ::subspace::testing::InProcessServer;

TEST(CompressedCacheServerTest, ModelInfoReportsTheCacheConfig) {
  server::ServerAppConfig config = CompressedConfig(/*rank=*/0, CoeffDtype::kInt8);
  config.kv_cache.window_tokens = 16;
  config.kv_cache.rank_v = 3;
  config.kv_cache.outlier_threshold = 0.5f;
  {
    Server s(config);
    ASSERT_TRUE(s.ok());
    const v1::CacheConfig cache = s.ModelInfo().cache();
    EXPECT_EQ(cache.kind(), "compressed");
    EXPECT_EQ(cache.block_size(), 8u);
    EXPECT_GT(cache.blocks_total(), 0u);
    EXPECT_EQ(cache.pool_bytes(), s.CacheStats().pool_bytes_total());
    // A page is one fp16 full block (the default --kv-full-dtype): [2][2 kv heads][8][8] x 2 B.
    EXPECT_EQ(cache.pool_bytes() / cache.blocks_total(), 512u);
    EXPECT_EQ(cache.sink_tokens(), 4u);
    EXPECT_EQ(cache.window_tokens(), 16u);
    EXPECT_EQ(cache.rank_k(), 2u);  // 0 resolves to head_dim / 4
    EXPECT_EQ(cache.rank_v(), 3u);
    EXPECT_EQ(cache.coeff_dtype(), "int8");
    EXPECT_EQ(cache.outlier_threshold(), 0.5f);
  }
  Server full(FullConfig());
  ASSERT_TRUE(full.ok());
  const v1::CacheConfig cache = full.ModelInfo().cache();
  EXPECT_EQ(cache.kind(), "full");
  EXPECT_EQ(cache.block_size(), 8u);
  EXPECT_EQ(cache.rank_k(), 0u);  // the compressed policy is not reported for the full cache
  EXPECT_EQ(cache.coeff_dtype(), "");
}

// A session holds its tokens after the call, so the stats show what a long sequence takes.
TEST(CompressedCacheServerTest, LongGenerationCompressesBlocksAndReportsThem) {
  server::ServerAppConfig config = CompressedConfig(/*rank=*/0, CoeffDtype::kFp16);
  config.metrics_port = 0;
  Server s(config);
  ASSERT_TRUE(s.ok());
  const v1::ModelInfo info = s.ModelInfo();
  const v1::CacheStats idle = s.CacheStats();
  EXPECT_EQ(idle.tokens_cached(), 0u);
  EXPECT_EQ(idle.compression_ratio(), 0.0);

  const std::string session = s.CreateSession();
  const v1::GenerateResponse r = s.Generate(TokensRequest({1, 300, 301}, 240), session);
  ASSERT_EQ(r.token_ids_size(), 240);
  const v1::CacheStats held = s.CacheStats();
  EXPECT_EQ(held.tokens_cached(), 3u + 240u - 1u);  // the last token is never written
  EXPECT_GT(held.bytes_used_compressed(), 0u);
  EXPECT_GT(held.bytes_used_full(), 0u);
  EXPECT_EQ(held.bytes_used_outlier(), 0u);  // threshold 1: outliers off
  EXPECT_EQ(held.blocks_total() - held.blocks_free(),
            (held.bytes_used_full() + held.bytes_used_compressed()) /
                (held.pool_bytes_total() / held.blocks_total()));
  EXPECT_DOUBLE_EQ(held.compression_ratio(), ExpectedCompressionRatio(held, info));
  // 242 tokens at rank d/4 in fp16: most blocks are compressed, so fewer bytes than fp16.
  EXPECT_GT(held.compression_ratio(), 1.0);

  absl::StatusOr<std::pair<std::string, std::string>> scrape =
      HttpGet(s.app().metrics_port(), "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  const std::string& body = scrape->second;
  absl::StatusOr<double> compressed =
      MetricValue(body, "subspace_kv_pool_used_bytes{kind=\"compressed\"}");
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  EXPECT_GT(*compressed, 0.0);
  EXPECT_EQ(*compressed, static_cast<double>(held.bytes_used_compressed()));
  absl::StatusOr<double> full = MetricValue(body, "subspace_kv_pool_used_bytes{kind=\"full\"}");
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(*full, static_cast<double>(held.bytes_used_full()));
  absl::StatusOr<double> ratio = MetricValue(body, "subspace_kv_compression_ratio");
  ASSERT_TRUE(ratio.ok()) << ratio.status();
  EXPECT_NEAR(*ratio, held.compression_ratio(), 1e-9 * held.compression_ratio());

  // Deleting the session gives every page back, compressed ones included.
  s.DeleteSession(session);
  ASSERT_TRUE(WaitFor([&s] {
    const v1::CacheStats st = s.CacheStats();
    return st.blocks_free() == st.blocks_total();
  }));
  const v1::CacheStats after = s.CacheStats();
  EXPECT_EQ(after.bytes_used_compressed(), 0u);
  EXPECT_EQ(after.compression_ratio(), 0.0);
}

// A block-sized sequence held by the full cache: 7 tokens in one 8-token fp32 block per layer,
// 7 * 2 layers * 2 * 2 kv_heads * 8 * 2 bytes = 896 fp16 bytes over 2 * 1024 pool bytes.
TEST(CompressedCacheServerTest, FullCacheRatioIsBelowOneHalf) {
  Server s(FullConfig());
  ASSERT_TRUE(s.ok());
  const std::string session = s.CreateSession();
  s.Generate(TokensRequest({1, 300, 301}, 5), session);
  const v1::CacheStats held = s.CacheStats();
  EXPECT_EQ(held.tokens_cached(), 7u);
  EXPECT_EQ(held.bytes_used_full(), 2048u);
  EXPECT_EQ(held.bytes_used_compressed(), 0u);
  EXPECT_DOUBLE_EQ(held.compression_ratio(), ExpectedCompressionRatio(held, s.ModelInfo()));
  EXPECT_DOUBLE_EQ(held.compression_ratio(), 896.0 / 2048.0);
}

// At rank = head_dim the PCA basis is a complete orthonormal basis and fp32 coefficients over
// fp32 full blocks lose nothing, so attention equals the full cache's up to rounding and greedy
// tokens are equal.
TEST(CompressedCacheServerTest, FullRankFp32MatchesTheFullCache) {
  const std::vector<std::vector<int32_t>> prompts = {
      {1, 300, 301}, {1, 290, 291, 292, 293, 294, 295, 296, 297, 298, 299}, {1, 305}};
  std::vector<std::vector<int32_t>> expected;
  {
    Server full(FullConfig());
    ASSERT_TRUE(full.ok());
    for (const auto& p : prompts) expected.push_back(Ids(full.Generate(TokensRequest(p, 120))));
  }
  Server s(CompressedConfig(/*rank=*/8, CoeffDtype::kFp32, CoeffDtype::kFp32));
  ASSERT_TRUE(s.ok());
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(i);
    const std::string session = s.CreateSession();
    EXPECT_EQ(Ids(s.Generate(TokensRequest(prompts[i], 120), session)), expected[i]);
    EXPECT_GT(s.CacheStats().bytes_used_compressed(), 0u);  // the comparison covered compression
    s.DeleteSession(session);
  }
}

// A session continued over two calls equals one call over the concatenation: the first call's
// old blocks are compressed when the second call attends to them. Exact at full rank only:
// below it, the one-call prefill attends to its own early tokens full-rank and builds its PCA
// basis from more tokens (compressed_kv_cache.cc, "Policy").
TEST(CompressedCacheServerTest, FullRankSessionOverTwoCallsEqualsOneCall) {
  Server s(CompressedConfig(/*rank=*/8, CoeffDtype::kFp32, CoeffDtype::kFp32));
  ASSERT_TRUE(s.ok());
  const std::vector<int32_t> a = {1, 300, 301, 302, 290};
  const std::vector<int32_t> b = {303, 304, 291};
  const std::string session = s.CreateSession();
  const v1::GenerateResponse r1 = s.Generate(TokensRequest(a, 60), session);
  EXPECT_GT(s.CacheStats().bytes_used_compressed(), 0u);
  const v1::GenerateResponse r2 = s.Generate(TokensRequest(b, 60), session);
  EXPECT_EQ(r2.usage().reused_tokens(), a.size() + 60 - 1);

  std::vector<int32_t> all = a;
  all.insert(all.end(), r1.token_ids().begin(), r1.token_ids().end());
  all.insert(all.end(), b.begin(), b.end());
  EXPECT_EQ(Ids(r2), Ids(s.Generate(TokensRequest(all, 60))));
}

// Below full rank outputs may differ from the full cache's, but a session still reuses its
// compressed blocks, and the same calls give the same tokens.
TEST(CompressedCacheServerTest, LowRankSessionsAreDeterministic) {
  for (CoeffDtype dtype : {CoeffDtype::kFp16, CoeffDtype::kInt8}) {
    SCOPED_TRACE(CoeffDtypeName(dtype));
    Server s(CompressedConfig(/*rank=*/0, dtype));
    ASSERT_TRUE(s.ok());
    std::vector<std::vector<int32_t>> runs;
    for (int run = 0; run < 2; ++run) {
      const std::string session = s.CreateSession();
      const v1::GenerateResponse r1 =
          s.Generate(TokensRequest({1, 300, 301, 302, 290}, 60), session);
      const v1::GenerateResponse r2 = s.Generate(TokensRequest({303, 304, 291}, 60), session);
      EXPECT_EQ(r2.usage().reused_tokens(), 5u + 60u - 1u);
      EXPECT_GT(s.CacheStats().bytes_used_compressed(), 0u);
      std::vector<int32_t> ids = Ids(r1);
      ids.insert(ids.end(), r2.token_ids().begin(), r2.token_ids().end());
      runs.push_back(ids);
      s.DeleteSession(session);
    }
    EXPECT_EQ(runs[0], runs[1]);
  }
}

struct BadCacheCase {
  std::string name;
  std::function<void(server::ServerAppConfig&)> mutate;
  std::string expected;  // substring of the status message
};

TEST(CompressedCacheServerTest, BadCacheConfigIsInvalidArgumentNamingTheFlag) {
  const std::vector<BadCacheCase> cases = {
      {"sinks", [](server::ServerAppConfig& c) { c.kv_cache.sink_tokens = -1; },
       "--kv-sink-tokens must be >= 0, got -1"},
      {"window", [](server::ServerAppConfig& c) { c.kv_cache.window_tokens = -8; },
       "--kv-window-tokens must be >= 0, got -8"},
      {"rank_k negative", [](server::ServerAppConfig& c) { c.kv_cache.rank_k = -1; },
       "--kv-rank-k must be >= 0"},
      {"rank_v negative", [](server::ServerAppConfig& c) { c.kv_cache.rank_v = -2; },
       "--kv-rank-v must be >= 0"},
      {"rank_k above head_dim", [](server::ServerAppConfig& c) { c.kv_cache.rank_k = 9; },
       "--kv-rank-k must be in [1, 8] (the model's head_dim) or 0, got 9"},
      {"rank_v above head_dim", [](server::ServerAppConfig& c) { c.kv_cache.rank_v = 64; },
       "--kv-rank-v must be in [1, 8]"},
      {"threshold 0", [](server::ServerAppConfig& c) { c.kv_cache.outlier_threshold = 0.0f; },
       "--kv-outlier-threshold must be a finite number > 0"},
      {"threshold nan",
       [](server::ServerAppConfig& c) {
         c.kv_cache.outlier_threshold = std::numeric_limits<float>::quiet_NaN();
       },
       "--kv-outlier-threshold"},
      {"threshold inf",
       [](server::ServerAppConfig& c) {
         c.kv_cache.outlier_threshold = std::numeric_limits<float>::infinity();
       },
       "--kv-outlier-threshold"},
      {"full dtype", [](server::ServerAppConfig& c) { c.kv_cache.full_dtype = CoeffDtype::kInt8; },
       "--kv-full-dtype must be fp16 or fp32"},
      {"fp32 coefficients at full rank over fp16 full blocks",
       [](server::ServerAppConfig& c) {
         c.kv_cache.rank_k = c.kv_cache.rank_v = 8;
         c.kv_cache.coeff_dtype = CoeffDtype::kFp32;
       },
       "use fp32 full blocks"},
      {"block size", [](server::ServerAppConfig& c) { c.block_size = 128; },
       "--block-size must be at most 64 with --kv-cache=compressed, got 128"},
      {"refresh epochs",
       [](server::ServerAppConfig& c) {
         c.kv_cache.refresh.method = RefreshMethod::kPca;
         c.kv_cache.refresh.max_epochs = 0;
       },
       "--refresh-max-epochs must be >= 1, got 0"},
      {"refresh without a trigger",
       [](server::ServerAppConfig& c) {
         c.kv_cache.refresh.method = RefreshMethod::kOja;
         c.kv_cache.refresh.every_tokens = 0;
       },
       "--refresh-every-tokens > 0 or --refresh-residual-threshold > 0"},
      {"refresh half-life",
       [](server::ServerAppConfig& c) { c.kv_cache.refresh.half_life_tokens = -1; },
       "--refresh-half-life-tokens must be finite and >= 0"},
  };
  for (const BadCacheCase& c : cases) {
    SCOPED_TRACE(c.name);
    server::ServerAppConfig config = CompressedConfig(/*rank=*/0, CoeffDtype::kFp16);
    c.mutate(config);
    const absl::Status status = server::ServerApp::Start(config).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), c.expected)) << status;
  }
  // The compressed policy does not constrain the full cache.
  server::ServerAppConfig full = FullConfig();
  full.block_size = 128;
  full.kv_cache.rank_k = 64;
  EXPECT_TRUE(server::ServerApp::Start(full).ok());
}

// Online refresh per session: a session that asks for it gets new epochs while it generates
// (GetCacheStats counts them, the session reports its method), one that does not
// keeps the server's static default; bad requests get precise statuses, and a full-cache
// server refuses refresh.
TEST(CompressedCacheServerTest, SessionsChooseTheirOnlineRefresh) {
  Server s(CompressedConfig(/*rank=*/2, CoeffDtype::kFp16));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s.ModelInfo().cache().refresh_method(), "none");
  auto stub = v1::Subspace::NewStub(ChannelTo(s.app().port()));
  const auto create = [&](const std::string& method, uint32_t every, v1::Session* out) {
    return CreateRefreshingSession(*stub, method, every, out);
  };
  v1::Session session;
  ASSERT_TRUE(create("oja", 8, &session).ok());
  EXPECT_EQ(session.refresh_method(), "oja");
  const std::string plain = s.CreateSession();
  s.Generate(TokensRequest({1, 300, 301, 302, 290}, 40), plain);
  EXPECT_EQ(s.CacheStats().refreshes_total(), 0u);  // the default is static
  s.Generate(TokensRequest({1, 300, 301, 302, 290}, 60), session.session_id());
  const v1::GenerateResponse again =
      s.Generate(TokensRequest({303, 304, 291}, 40), session.session_id());
  EXPECT_EQ(again.usage().reused_tokens(), 5u + 60u - 1u);  // its sequence kept its epochs
  const v1::CacheStats stats = testing::TurnUntilARefresh(s, session.session_id());
  EXPECT_GT(stats.refreshes_total(), 0u);
  EXPECT_EQ(stats.refresh_failures_total(), 0u);
  EXPECT_GT(stats.epochs_live(), 1u);

  EXPECT_EQ(create("bogus", 0, &session).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const grpc::Status no_trigger = [&] {
    grpc::ClientContext context;
    v1::CreateSessionRequest request;
    request.mutable_refresh()->set_method("pca");
    return stub->CreateSession(&context, request, &session);
  }();
  EXPECT_TRUE(no_trigger.ok()) << no_trigger.error_message();  // the server's T applies

  Server full(FullConfig());
  ASSERT_TRUE(full.ok());
  auto full_stub = v1::Subspace::NewStub(ChannelTo(full.app().port()));
  grpc::ClientContext context;
  v1::CreateSessionRequest request;
  request.mutable_refresh()->set_method("pca");
  EXPECT_EQ(full_stub->CreateSession(&context, request, &session).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

// A basis file calibrated on the tiny model (subspace-calibrate's code path) is installed at
// start: its per-layer ranks size the cache, generation compresses blocks with it; a file
// calibrated on another model, or of another geometry, stops the start with INVALID_ARGUMENT.
TEST(CompressedCacheServerTest, BasesFileIsInstalledAndMismatchesAreRejected) {
  auto calibrate = [](const std::shared_ptr<const GgufFile>& gguf, const std::string& path) {
    absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(gguf);
    ASSERT_TRUE(model.ok()) << model.status();
    std::vector<int32_t> tokens;
    for (int i = 0; i < 200; ++i) tokens.push_back(3 + (i * 37) % 250);
    absl::StatusOr<CalibrationStats> stats = CollectCalibrationStats(
        **model, tokens, {.window = 64, .max_tokens = 0, .bos = 1, .progress = {}});
    ASSERT_TRUE(stats.ok()) << stats.status();
    absl::StatusOr<CalibratedBasis> basis = ComputeCalibratedBasis(*stats, {.energy = 0.9});
    ASSERT_TRUE(basis.ok()) << basis.status();
    const BasisFileInfo info{.method_k = "kqsvd",
                             .method_v = "kqsvd",
                             .energy = 0.9,
                             .calibration_tokens = static_cast<uint64_t>(stats->key_tokens),
                             .model_checksum = ModelChecksum(*gguf)};
    ASSERT_TRUE(WriteBasisFile(path, info, basis->basis).ok());
  };
  const std::string dir = ::testing::TempDir();
  const std::string good = dir + "/bases_good.gguf", other = dir + "/bases_other_model.gguf",
                    geometry = dir + "/bases_other_geometry.gguf";
  absl::StatusOr<std::unique_ptr<GgufFile>> tiny = GgufFile::Open(testing::TinyModelPath());
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  calibrate(std::shared_ptr<const GgufFile>(*std::move(tiny)), good);
  calibrate(*GgufFile::FromBytes(testing::BuildTinyLlamaGguf({.context = 256, .seed = 2})), other);
  calibrate(*GgufFile::FromBytes(testing::BuildTinyLlamaGguf({.kv_heads = 1, .context = 256})),
            geometry);
  absl::StatusOr<BasisFile> file = ReadBasisFile(good);
  ASSERT_TRUE(file.ok()) << file.status();
  uint32_t max_rank_k = 0, max_rank_v = 0;
  for (const LayerBasis& lb : file->basis.layers) {
    max_rank_k = std::max<uint32_t>(max_rank_k, lb.rank_k);
    max_rank_v = std::max<uint32_t>(max_rank_v, lb.rank_v);
  }

  server::ServerAppConfig config = CompressedConfig(/*rank=*/0, CoeffDtype::kFp16);
  config.kv_cache.bases_path = good;
  {
    Server s(config);
    ASSERT_TRUE(s.ok());
    const v1::ModelInfo info = s.ModelInfo();
    EXPECT_EQ(info.cache().kind(), "compressed");
    EXPECT_EQ(info.cache().rank_k(), max_rank_k);  // reported: the largest layer rank
    EXPECT_EQ(info.cache().rank_v(), max_rank_v);
    const std::string session = s.CreateSession();
    ExpectSessionCompresses(s, info, session);
    s.DeleteSession(session);
  }
  for (const auto& [path, expected] :
       {std::pair{other, "calibrated on a different model"}, std::pair{geometry, "geometry"},
        std::pair{dir + "/no_such_bases.gguf", "no_such_bases.gguf"}}) {
    SCOPED_TRACE(path);
    config.kv_cache.bases_path = path;
    const absl::Status status = server::ServerApp::Start(config).status();
    EXPECT_FALSE(status.ok());
    EXPECT_TRUE(absl::StrContains(status.message(), expected)) << status;
    if (path != dir + "/no_such_bases.gguf") {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    }
  }
  config.kv_cache.bases_path = good;
  config.kv_cache.rank_k = 2;
  EXPECT_EQ(server::ServerApp::Start(config).status().code(), absl::StatusCode::kInvalidArgument);
  server::ServerAppConfig full = FullConfig();
  full.kv_cache.bases_path = good;
  EXPECT_EQ(server::ServerApp::Start(full).status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& p : {good, other, geometry}) std::remove(p.c_str());
}

// The compressed cache on every architecture the forward pass runs (random-weight fixtures of
// tests/reference/make_reference.py): Qwen2 with 64-wide heads and biases, Qwen3 with 128-wide
// heads and Q/K norms, Phi-3's fused tensors (also with a 13-token sliding window, which the
// 109-token sessions cross many times), Llama 3's RoPE factors. At full rank with fp32
// codes greedy tokens equal the full cache's; a basis calibrated on the model (subspace-
// calibrate's code path) is installed and serves, and a session's online refresh publishes
// epochs without failures.
TEST(CompressedCacheServerTest, EveryArchitectureFullRankEqualsFullCalibrationAndRefreshWork) {
  struct Arch {
    const char* gguf;
    int head_dim;
  };
  for (const Arch& arch : {Arch{"qwen2_hd64_f16.gguf", 64}, Arch{"qwen3_hd128_f16.gguf", 128},
                           Arch{"phi3_f32.gguf", 16}, Arch{"llama3_freqs_f32.gguf", 16},
                           Arch{"phi3_swa_f32.gguf", 16}}) {
    SCOPED_TRACE(arch.gguf);
    const std::string model_path = testing::TestDataPath(arch.gguf);
    SUBSPACE_REQUIRE_FILE(model_path);
    const std::vector<int32_t> prompt = {1, 40, 41, 42, 43, 44, 45, 50, 51};
    server::ServerAppConfig full = FullConfig();
    full.model_path = model_path;
    std::vector<int32_t> expected;
    {
      Server s(full);
      ASSERT_TRUE(s.ok());
      expected = Ids(s.Generate(TokensRequest(prompt, 100)));
    }
    server::ServerAppConfig config =
        CompressedConfig(arch.head_dim, CoeffDtype::kFp32, CoeffDtype::kFp32);
    config.model_path = model_path;
    {
      Server s(config);
      ASSERT_TRUE(s.ok());
      const std::string session = s.CreateSession();
      EXPECT_EQ(Ids(s.Generate(TokensRequest(prompt, 100), session)), expected);
      EXPECT_GT(s.CacheStats().bytes_used_compressed(), 0u);
    }

    // Calibrate a basis on the model and serve with it, refreshing online.
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(model_path);
    ASSERT_TRUE(file.ok()) << file.status();
    const std::shared_ptr<const GgufFile> gguf(*std::move(file));
    absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(gguf);
    ASSERT_TRUE(model.ok()) << model.status();
    std::vector<int32_t> tokens;
    for (int i = 0; i < 200; ++i) tokens.push_back(3 + (i * 37) % 90);
    absl::StatusOr<CalibrationStats> stats = CollectCalibrationStats(
        **model, tokens, {.window = 64, .max_tokens = 0, .bos = 1, .progress = {}});
    ASSERT_TRUE(stats.ok()) << stats.status();
    absl::StatusOr<CalibratedBasis> basis = ComputeCalibratedBasis(*stats, {.energy = 0.9});
    ASSERT_TRUE(basis.ok()) << basis.status();
    const std::string bases = ::testing::TempDir() + "/bases_" + arch.gguf;
    ASSERT_TRUE(WriteBasisFile(bases,
                               {.method_k = "kqsvd",
                                .method_v = "kqsvd",
                                .energy = 0.9,
                                .calibration_tokens = static_cast<uint64_t>(stats->key_tokens),
                                .model_checksum = ModelChecksum(*gguf)},
                               basis->basis)
                    .ok());
    config = CompressedConfig(/*rank=*/0, CoeffDtype::kInt8);
    config.model_path = model_path;
    config.kv_cache.bases_path = bases;
    {
      Server s(config);
      ASSERT_TRUE(s.ok());
      auto stub = v1::Subspace::NewStub(ChannelTo(s.app().port()));
      v1::Session session;
      grpc::ClientContext context;
      v1::CreateSessionRequest request;
      request.mutable_refresh()->set_method("oja");
      request.mutable_refresh()->set_every_tokens(8);
      ASSERT_TRUE(stub->CreateSession(&context, request, &session).ok());
      const v1::GenerateResponse r = s.Generate(TokensRequest(prompt, 100), session.session_id());
      EXPECT_EQ(r.token_ids_size(), 100);
      // A new epoch is installed at a later commit of the session; give the refresher's thread
      // a few more short turns (as in SessionsChooseTheirOnlineRefresh).
      v1::CacheStats held = s.CacheStats();
      for (int turn = 0; turn < 10 && held.refreshes_total() == 0; ++turn) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        s.Generate(TokensRequest({60}, 4), session.session_id());
        held = s.CacheStats();
      }
      EXPECT_GT(held.bytes_used_compressed(), 0u);
      EXPECT_GT(held.refreshes_total(), 0u);
      EXPECT_EQ(held.refresh_failures_total(), 0u);
    }
    std::remove(bases.c_str());
  }
}

// --kv-cache quantized on the default model (head_dim 64): reported, sized by its format, and
// serving; refused, naming the reason, on a model whose head_dim is not whole q8_0 blocks.
TEST(QuantizedCacheServerTest, ServesTheDefaultModelInItsFormat) {
  for (KvDtype dtype : {KvDtype::kQ8_0, KvDtype::kQ4_0}) {
    SCOPED_TRACE(KvDtypeName(dtype));
    server::ServerAppConfig config = TestServerConfig();
    config.model_path = testing::SourcePath("models/subspace-tiny.gguf");
    config.block_size = 16;
    config.kv_cache.kind = runtime::KvCacheKind::kQuantized;
    config.kv_cache.kv_dtype = dtype;
    Server s(config);
    ASSERT_TRUE(s.ok());
    const v1::CacheConfig cache = s.ModelInfo().cache();
    EXPECT_EQ(cache.kind(), "quantized");
    EXPECT_EQ(cache.kv_dtype(), KvDtypeName(dtype));
    EXPECT_EQ(cache.rank_k(), 0u);
    // A page: [2][2 kv heads][16 slots] rows of 64 values, 68 B (q8_0) or 36 B (q4_0).
    EXPECT_EQ(cache.pool_bytes() / cache.blocks_total(),
              2u * 2 * 16 * (dtype == KvDtype::kQ8_0 ? 68 : 36));
    const std::string session = s.CreateSession();
    const v1::GenerateResponse r = s.Generate(TokensRequest({1, 450, 3681, 310}, 40), session);
    EXPECT_EQ(r.token_ids_size(), 40);
    const v1::CacheStats stats = s.CacheStats();
    EXPECT_EQ(stats.tokens_cached(), 43u);  // the prompt and all but the last token generated
    EXPECT_EQ(stats.bytes_used_compressed(), 0u);
    s.DeleteSession(session);
  }
  server::ServerAppConfig tiny = TestServerConfig();  // head_dim 8
  tiny.kv_cache.kind = runtime::KvCacheKind::kQuantized;
  const absl::Status st = server::ServerApp::Start(tiny).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("a q8_0 KV cache needs a head_dim that is a multiple of 32, got 8"),
            std::string::npos)
      << st;
}

TEST(KvCacheOptionsTest, BasesDefaultToTheModelsOwnFile) {
  const std::string dir = ::testing::TempDir() + "/bases_sidecar";
  std::filesystem::create_directories(dir);
  const std::string model = dir + "/m.gguf", sidecar = dir + "/m.bases";
  std::remove(sidecar.c_str());
  using runtime::ResolveBasesPath;
  const runtime::KvCacheKind kC = runtime::KvCacheKind::kCompressed;
  EXPECT_EQ(runtime::ResolveBasesPath("", model, kC, 0, 0), "");  // none beside the model
  { std::ofstream(sidecar) << "x"; }
  EXPECT_EQ(runtime::ResolveBasesPath("", model, kC, 0, 0), sidecar);
  EXPECT_EQ(runtime::ResolveBasesPath("", dir + "/m", kC, 0, 0), sidecar);  // no .gguf suffix
  EXPECT_EQ(runtime::ResolveBasesPath("none", model, kC, 0, 0), "");        // self-calibrate
  EXPECT_EQ(runtime::ResolveBasesPath("/x.bases", model, kC, 0, 0), "/x.bases");
  EXPECT_EQ(runtime::ResolveBasesPath("", model, runtime::KvCacheKind::kFull, 0, 0), "");
  EXPECT_EQ(runtime::ResolveBasesPath("", model, runtime::KvCacheKind::kQuantized, 0, 0), "");
  EXPECT_EQ(runtime::ResolveBasesPath("", model, kC, 8, 0), "");  // ranks asked for: self-calibrate
  EXPECT_EQ(runtime::ResolveBasesPath("", model, kC, 0, 8), "");
  std::remove(sidecar.c_str());
}

// --kv-cache auto: the transform cache where a codec is asked for or, on the CPU, where the model
// has its own and nothing asks for the compressed cache; the compressed cache everywhere else.
TEST(KvCacheOptionsTest, AutoPicksTheTransformCacheWhenTheModelHasACodec) {
  const std::string dir = ::testing::TempDir() + "/codec_sidecar";
  std::filesystem::create_directories(dir);
  const std::string model = dir + "/m.gguf", sidecar = dir + "/m.codec";
  std::remove(sidecar.c_str());
  using runtime::KvCacheKind;
  const auto choose = [&](std::string_view kind, std::string_view codec, double budget,
                          std::string_view bases, int rank, bool cpu,
                          RefreshMethod refresh = RefreshMethod::kNone) {
    absl::StatusOr<runtime::KvCacheChoice> c = runtime::ResolveKvCacheChoice({.kind = kind,
                                                                              .codec = codec,
                                                                              .kv_budget = budget,
                                                                              .bases = bases,
                                                                              .rank_k = rank,
                                                                              .refresh = refresh},
                                                                             model, cpu);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *c : runtime::KvCacheChoice{};
  };
  // No codec beside the model: compressed, unless a codec is asked for.
  EXPECT_EQ(choose("auto", "", 0.0, "", 0, true).kind, KvCacheKind::kCompressed);
  EXPECT_EQ(choose("auto", "/c.codec", 0.0, "", 0, true).kind, KvCacheKind::kTransform);
  EXPECT_EQ(choose("auto", "/c.codec", 0.0, "", 0, true).codec_path, "/c.codec");
  EXPECT_EQ(choose("auto", "", 2.5, "", 0, false).kind, KvCacheKind::kTransform);
  EXPECT_EQ(choose("auto", "", 2.5, "", 0, false).codec_path, "");
  EXPECT_EQ(choose("transform", "", 0.0, "", 0, true).codec_path, "");  // validation refuses it

  { std::ofstream(sidecar) << "x"; }
  const runtime::KvCacheChoice own = choose("auto", "", 0.0, "", 0, true);
  EXPECT_EQ(own.kind, KvCacheKind::kTransform);
  EXPECT_EQ(own.codec_path, sidecar);
  EXPECT_TRUE(own.model_codec);
  EXPECT_EQ(choose("transform", "", 0.0, "", 0, false).codec_path, sidecar);  // asked for: taken
  EXPECT_EQ(choose("auto", "", 0.0, "", 0, false).kind, KvCacheKind::kCompressed);  // CUDA: not yet
  EXPECT_EQ(choose("auto", "", 0.0, "", 0, false).codec_path, "");
  EXPECT_EQ(choose("auto", "", 0.0, "/b.bases", 0, true).kind, KvCacheKind::kCompressed);
  EXPECT_EQ(choose("auto", "", 0.0, "none", 0, true).kind, KvCacheKind::kCompressed);
  EXPECT_EQ(choose("auto", "", 0.0, "", 16, true).kind, KvCacheKind::kCompressed);
  EXPECT_EQ(choose("auto", "none", 0.0, "", 0, true).kind, KvCacheKind::kCompressed);
  // A refresh method only the low-rank cache has asks for it; pca both caches run.
  EXPECT_EQ(choose("auto", "", 0.0, "", 0, true, RefreshMethod::kKqsvd).kind,
            KvCacheKind::kCompressed);
  EXPECT_EQ(choose("auto", "", 0.0, "", 0, true, RefreshMethod::kOja).kind,
            KvCacheKind::kCompressed);
  EXPECT_EQ(choose("auto", "", 0.0, "", 0, true, RefreshMethod::kPca).kind,
            KvCacheKind::kTransform);
  EXPECT_EQ(choose("transform", "none", 0.0, "", 0, true).codec_path, "");
  EXPECT_EQ(choose("transform", "", 3.0, "", 0, true).codec_path, "");  // fitted instead
  EXPECT_EQ(choose("transform", "/c.codec", 0.0, "", 0, true).codec_path, "/c.codec");
  EXPECT_EQ(choose("compressed", "", 0.0, "", 0, true).kind, KvCacheKind::kCompressed);
  EXPECT_EQ(choose("compressed", "", 0.0, "", 0, true).codec_path, "");
  EXPECT_EQ(choose("full", "", 0.0, "", 0, true).kind, KvCacheKind::kFull);
  const absl::Status bad = runtime::ResolveKvCacheChoice({.kind = "paged"}, model, true).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(),
            "--kv-cache must be 'auto', 'full', 'compressed', 'quantized' or 'transform', got "
            "'paged'");
  std::remove(sidecar.c_str());
}

TEST(KvCacheOptionsTest, ParsesFlagNames) {
  EXPECT_EQ(runtime::ParseKvCacheKind("full").value(), runtime::KvCacheKind::kFull);
  EXPECT_EQ(runtime::ParseKvCacheKind("compressed").value(), runtime::KvCacheKind::kCompressed);
  EXPECT_EQ(runtime::ParseKvCacheKind("quantized").value(), runtime::KvCacheKind::kQuantized);
  const absl::Status kind = runtime::ParseKvCacheKind("paged").status();
  EXPECT_EQ(kind.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kind.message(),
            "--kv-cache must be 'full', 'compressed', 'quantized' or 'transform', got 'paged'");
  EXPECT_EQ(runtime::ParseQuantizedKvDtype("q8_0").value(), KvDtype::kQ8_0);
  EXPECT_EQ(runtime::ParseQuantizedKvDtype("q4_0").value(), KvDtype::kQ4_0);
  const absl::Status kv = runtime::ParseQuantizedKvDtype("f32").status();
  EXPECT_EQ(kv.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.message(), "--kv-dtype must be 'q8_0' or 'q4_0', got 'f32'");
  EXPECT_EQ(runtime::ParseCoeffDtype("fp16").value(), CoeffDtype::kFp16);
  EXPECT_EQ(runtime::ParseCoeffDtype("int8").value(), CoeffDtype::kInt8);
  EXPECT_EQ(runtime::ParseCoeffDtype("fp32").value(), CoeffDtype::kFp32);
  EXPECT_EQ(runtime::ParseCoeffDtype("int4").value(), CoeffDtype::kInt4);
  const absl::Status dtype = runtime::ParseCoeffDtype("bf16").status();
  EXPECT_EQ(dtype.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dtype.message(),
            "--kv-coeff-dtype must be 'fp16', 'int8', 'int4' or 'fp32', got 'bf16'");
  EXPECT_EQ(runtime::ParseFullDtype("fp16").value(), CoeffDtype::kFp16);
  EXPECT_EQ(runtime::ParseFullDtype("fp32").value(), CoeffDtype::kFp32);
  const absl::Status full = runtime::ParseFullDtype("int8").status();
  EXPECT_EQ(full.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(full.message(), "--kv-full-dtype must be 'fp16' or 'fp32', got 'int8'");
}

}  // namespace
}  // namespace subspace
