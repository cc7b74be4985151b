// Session snapshots: the file format (round trip; every truncation and corrupted byte refused
// with DATA_LOSS or FAILED_PRECONDITION, another model and a newer version named), the snapshot
// directory (atomic writes, leftovers, odd ids), the caches' images (refused when corrupt,
// leaking nothing) and the engine's export and import: a session moved to a fresh engine
// continues bitwise as the uninterrupted one, for the full-rank, quantized and compressed
// caches.
#include "core/engine/session_snapshot.h"

#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/compress/compressed_kv_cache.h"
#include "core/compress/transform_codec.h"
#include "core/compress/transform_kv_cache.h"
#include "core/engine/engine.h"
#include "core/kvcache/paged_kv_cache.h"
#include "gtest/gtest.h"
#include "tests/core/engine/engine_test_util.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using namespace ::subspace::engine_test;  // NOLINT: the shared helpers
using ::subspace::testing::TempDir;

const SnapshotIdentity kModel{.model_checksum = 0x1234abcd5678ef00ull, .model_name = "tiny"};
constexpr uint64_t kMaxSection = uint64_t{1} << 26;

SessionImage SampleImage() {
  SessionImage s;
  s.id = "0123456789abcdef0123456789abcdef";
  s.owner = "alice";
  s.tokens = {1, 5, 9, 300, 7, 42};
  s.cached = 5;
  s.idle_ttl = absl::Seconds(90);
  s.created = absl::FromUnixSeconds(1'700'000'000);
  s.last_used = absl::FromUnixSeconds(1'700'000'100);
  s.refresh = RefreshConfig{.method = RefreshMethod::kPca, .every_tokens = 128};
  s.cache = std::string(1000, 'k');
  s.cache_layout = "paged test";
  return s;
}

TEST(SessionSnapshotTest, RoundTrip) {
  const SessionImage in = SampleImage();
  const std::string bytes = EncodeSessionSnapshot(in, kModel);
  absl::StatusOr<SessionImage> out = DecodeSessionSnapshot(bytes, kModel, kMaxSection);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->id, in.id);
  EXPECT_EQ(out->owner, in.owner);
  EXPECT_EQ(out->tokens, in.tokens);
  EXPECT_EQ(out->cached, in.cached);
  EXPECT_EQ(out->idle_ttl, in.idle_ttl);
  EXPECT_EQ(out->created, in.created);
  EXPECT_EQ(out->last_used, in.last_used);
  ASSERT_TRUE(out->refresh.has_value());
  EXPECT_EQ(out->refresh->method, RefreshMethod::kPca);
  EXPECT_EQ(out->refresh->every_tokens, 128);
  EXPECT_EQ(out->cache, in.cache);
  EXPECT_EQ(out->cache_layout, in.cache_layout);
  // zstd on the repetitive cache bytes.
  EXPECT_LT(bytes.size(), 400u);

  SessionImage bare = in;
  bare.refresh.reset();
  bare.cached = 0;
  bare.cache.clear();
  bare.cache_layout.clear();
  out = DecodeSessionSnapshot(EncodeSessionSnapshot(bare, kModel), kModel, kMaxSection);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(out->refresh.has_value());
  EXPECT_TRUE(out->cache.empty());

  // A session made but never used (no tokens yet) moves too: the sanitizer build checks that
  // no null pointer reaches memcpy on the way.
  SessionImage empty = bare;
  empty.tokens.clear();
  out = DecodeSessionSnapshot(EncodeSessionSnapshot(empty, kModel), kModel, kMaxSection);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->tokens.empty());
  EXPECT_EQ(out->id, empty.id);
}

TEST(SessionSnapshotTest, EveryTruncationAndCorruptByteIsRefused) {
  const std::string bytes = EncodeSessionSnapshot(SampleImage(), kModel);
  for (size_t n = 0; n < bytes.size(); ++n) {
    absl::Status st = DecodeSessionSnapshot(bytes.substr(0, n), kModel, kMaxSection).status();
    ASSERT_EQ(st.code(), absl::StatusCode::kDataLoss) << "length " << n << ": " << st;
  }
  absl::Status st = DecodeSessionSnapshot(bytes + "x", kModel, kMaxSection).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (uint8_t flip : {0x01, 0x80}) {
      std::string bad = bytes;
      bad[i] = static_cast<char>(bad[i] ^ flip);
      st = DecodeSessionSnapshot(bad, kModel, kMaxSection).status();
      // The version field (bytes 16-19) says FAILED_PRECONDITION; everything else is caught
      // by the magic, the sizes or a section's checksum.
      const bool version = i >= 16 && i < 20;
      ASSERT_EQ(st.code(),
                version ? absl::StatusCode::kFailedPrecondition : absl::StatusCode::kDataLoss)
          << "byte " << i << " ^ " << int{flip} << ": " << st;
    }
  }
}

TEST(SessionSnapshotTest, AnotherModelOrANewerVersionIsNamed) {
  const std::string bytes = EncodeSessionSnapshot(SampleImage(), kModel);
  SnapshotIdentity other = kModel;
  other.model_checksum ^= 1;
  other.model_name = "big";
  absl::Status st = DecodeSessionSnapshot(bytes, other, kMaxSection).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "another model: tiny")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "runs big")) << st;

  std::string future = bytes;
  future[16] = 2;
  st = DecodeSessionSnapshot(future, kModel, kMaxSection).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "v2; this server reads v1")) << st;

  st = DecodeSessionSnapshot(std::string(64, 'x'), kModel, kMaxSection).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(st.message(), "not a session snapshot")) << st;

  // A section larger than the reader allows is never expanded.
  st = DecodeSessionSnapshot(bytes, kModel, 100).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(st.message(), "more than the limit")) << st;
}

TEST(SnapshotDirectoryTest, WritesListsReadsRemovesAndRejects) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/sessions";
  absl::StatusOr<SnapshotDirectory> d = SnapshotDirectory::Open(dir);  // created
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->Write("abc", "one").ok());
  ASSERT_TRUE(d->Write("abc", "two").ok());  // replaced whole
  ASSERT_TRUE(d->Write("../../etc/x y", "odd").ok());
  // A temporary a crash left behind is removed, never listed.
  std::system(absl::StrCat("echo torn > '", dir, "/def.session.tmp'").c_str());
  absl::StatusOr<std::vector<std::string>> files = d->List();
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(files->size(), 2u);
  EXPECT_EQ(access((dir + "/def.session.tmp").c_str(), F_OK), -1);
  for (const std::string& f : *files) {
    EXPECT_EQ(f.rfind(dir + "/", 0), 0u) << f;
    EXPECT_EQ(f.find('/', dir.size() + 1), std::string::npos) << "an id left the directory: " << f;
  }
  absl::StatusOr<std::string> read = d->Read(d->PathOf("abc"), 100);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(*read, "two");
  EXPECT_EQ(d->Read(d->PathOf("abc"), 2).status().code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE(d->Reject(d->PathOf("abc")).ok());
  EXPECT_EQ(access((d->PathOf("abc") + ".rejected").c_str(), F_OK), 0);
  ASSERT_TRUE(d->Remove("../../etc/x y").ok());
  ASSERT_TRUE(d->Remove("never-written").ok());
  files = d->List();
  ASSERT_TRUE(files.ok());
  EXPECT_TRUE(files->empty());

  EXPECT_FALSE(SnapshotDirectory::Open(d->PathOf("abc") + ".rejected").ok());  // a file
  EXPECT_EQ(SnapshotDirectory::Open("").status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- The caches' images and the engine ---------------------------------------------------------

using CacheFactory = std::function<std::unique_ptr<KvCacheBase>(const ModelConfig&)>;

struct CacheCase {
  std::string name;
  CacheFactory make;
  TinyModelOptions model;  // q8_0 rows need a head_dim that is a multiple of 32
};

std::unique_ptr<KvCacheBase> Paged(const ModelConfig& mc, KvDtype dtype) {
  PagedKvCache::Config c;
  c.geometry = mc.cache_geometry();
  c.block_size = kBlockSize;
  c.dtype = dtype;
  c.capacity_bytes = 256 * PagedKvCache::BlockBytes(c.geometry, kBlockSize, dtype);
  return *PagedKvCache::Create(c);
}

// Small sinks and window so that a short conversation compresses blocks; outliers on.
std::unique_ptr<KvCacheBase> Compressed(const ModelConfig& mc, bool with_default_basis,
                                        bool refresh_inline = false) {
  CompressedKvCacheConfig c;
  c.refresh_inline = refresh_inline;
  c.geometry = mc.cache_geometry();
  c.block_size = kBlockSize;
  c.policy.sink_tokens = 4;
  c.policy.window_tokens = 16;
  c.policy.coeff_dtype = CoeffDtype::kInt8;
  c.policy.outlier_threshold = 0.6f;
  c.n_query_heads = mc.n_heads;
  c.capacity_bytes = 256 * CompressedKvCache::PageBytes(c.geometry, kBlockSize, CoeffDtype::kFp16);
  auto cache = *CompressedKvCache::Create(c);
  if (with_default_basis) {
    // A fixed basis as a basis file would give (the same in every process).
    Basis b = Basis::Zeros(c.geometry, cache->r_k(), cache->r_v());
    for (LayerBasis& lb : b.layers) {
      for (size_t i = 0; i < lb.p_k.size(); ++i) lb.p_k[i] = (i % 7 == 0) ? 1.0f : 0.1f;
      for (size_t i = 0; i < lb.p_v.size(); ++i) lb.p_v[i] = (i % 5 == 0) ? 1.0f : -0.1f;
    }
    b.MakeOrthogonalFromPkPv();
    const EpochId id = *cache->InstallBasis(std::make_shared<const Basis>(std::move(b)));
    EXPECT_TRUE(cache->SetDefaultEpoch(id).ok());
    EXPECT_TRUE(cache->ReleaseEpoch(id).ok());
  }
  return cache;
}

// The transform-coded cache, keys coded before RoPE, with codes fitted on random rows of the
// model's head_dim (a fixed seed: the same codes, so the same layout, in every engine).
std::unique_ptr<KvCacheBase> Transform(const ModelConfig& mc, bool refresh_inline = false) {
  const KvCacheGeometry g = mc.cache_geometry();
  std::mt19937 rng(3);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  const auto fit = [&](double bits) {
    std::vector<TransformStream> streams;
    const int rows = 400;
    for (int i = 0; i < g.n_layers * g.n_kv_heads; ++i) {
      std::vector<float> x(static_cast<size_t>(rows) * g.head_dim);
      for (float& v : x) v = n01(rng) * 2.0f;
      absl::StatusOr<TransformStream> st = AnalyzeStream(x.data(), rows, g.head_dim, {}, {});
      EXPECT_TRUE(st.ok()) << st.status();
      streams.push_back(*std::move(st));
    }
    const std::vector<int> widths = {0, 2, 3, 4, 8};
    absl::StatusOr<std::vector<TransformCode>> codes =
        AllocateTransformCodes(streams, widths, bits, /*joint=*/false);
    EXPECT_TRUE(codes.ok()) << codes.status();
    return std::make_shared<const std::vector<TransformCode>>(*std::move(codes));
  };
  TransformKvCacheConfig c;
  c.geometry = g;
  c.block_size = kBlockSize;
  c.sink_tokens = 4;
  c.window_tokens = 16;
  c.key_codes = fit(3.0);
  c.value_codes = fit(2.0);
  c.key_rope = *mc.rope();
  c.capacity_bytes = 256 * TransformKvCache::PageBytes(g, kBlockSize);
  c.refresh_inline = refresh_inline;
  return *TransformKvCache::Create(c);
}

std::vector<CacheCase> Cases() {
  return {
      {"paged_f32", [](const ModelConfig& mc) { return Paged(mc, KvDtype::kF32); }},
      {"paged_q8_0",
       [](const ModelConfig& mc) { return Paged(mc, KvDtype::kQ8_0); },
       {.dim = 64, .heads = 2, .kv_heads = 1}},
      {"compressed_self_calibrated",
       [](const ModelConfig& mc) { return Compressed(mc, /*with_default_basis=*/false); }},
      {"compressed_basis",
       [](const ModelConfig& mc) { return Compressed(mc, /*with_default_basis=*/true); }},
      {"transform", [](const ModelConfig& mc) { return Transform(mc); }},
  };
}

std::unique_ptr<Engine> EngineWith(const CacheFactory& make, const TinyModelOptions& o = {}) {
  absl::StatusOr<TinyModel> tm = LoadTinyModel(o);
  EXPECT_TRUE(tm.ok()) << tm.status();
  if (!tm.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create({}, tm->model, tm->tokenizer, make(tm->model->config()));
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

// Waits until the engine's loop has freed every block no session holds.
void WaitForFreeBlocks(Engine& engine, int64_t want_free) {
  for (absl::Time end = absl::Now() + kWait; absl::Now() < end;) {
    if (engine.Stats().cache.blocks_free == want_free) return;
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(engine.Stats().cache.blocks_free, want_free);
}

class SessionMoveTest : public ::testing::TestWithParam<CacheCase> {};

// A session written out after its first turns and read into a fresh engine continues exactly
// as the uninterrupted one: same tokens, the cached prefix reused, not recomputed.
TEST_P(SessionMoveTest, ContinuesBitwiseInAFreshEngine) {
  auto a = EngineWith(GetParam().make, GetParam().model);
  ASSERT_NE(a, nullptr);
  absl::StatusOr<SessionInfo> session = a->CreateSession(absl::Seconds(300), {}, "alice");
  ASSERT_TRUE(session.ok()) << session.status();
  const int32_t vocab = a->model_config().n_vocab;
  GenerateRequest first = Greedy(RandomPrompt(7, 30, vocab), 25, session->id);
  first.session_owner = "alice";
  Output turn1 = Generate(*a, first);
  ASSERT_TRUE(turn1.result.status.ok()) << turn1.result.status;

  absl::StatusOr<std::vector<Engine::ExportedSession>> exported = a->ExportSessions();
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_EQ(exported->size(), 1u);
  ASSERT_TRUE((*exported)[0].cache.ok()) << (*exported)[0].cache;
  const SessionImage& image = (*exported)[0].image;
  EXPECT_EQ(image.cached, 30 + 25 - 1);
  if (absl::StartsWith(GetParam().name, "compressed")) {
    // The image holds compressed blocks and outlier tokens, not only full ones.
    EXPECT_GT(a->Stats().cache.bytes_used_compressed, 0);
    EXPECT_GT(a->Stats().cache.bytes_used_outlier, 0);
  }
  const std::string file = EncodeSessionSnapshot(image, kModel);
  absl::StatusOr<SessionImage> read = DecodeSessionSnapshot(file, kModel, kMaxSection);
  ASSERT_TRUE(read.ok()) << read.status();

  auto b = EngineWith(GetParam().make, GetParam().model);
  ASSERT_NE(b, nullptr);
  absl::StatusOr<Engine::ImportedSession> imported = b->ImportSession(*read);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_TRUE(imported->cache.ok()) << imported->cache;
  EXPECT_EQ(imported->info.id, session->id);
  EXPECT_EQ(imported->info.tokens, 55);
  EXPECT_EQ(imported->info.cached_tokens, 54);
  // Only its owner sees it.
  EXPECT_EQ(b->GetSession(session->id, "bob").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b->ImportSession(*read).status().code(), absl::StatusCode::kAlreadyExists);

  for (int turn = 0; turn < 2; ++turn) {
    GenerateRequest next = Greedy(RandomPrompt(20 + turn, 6, vocab), 12, session->id);
    next.prompt.erase(next.prompt.begin());  // no BOS mid-conversation
    next.session_owner = "alice";
    Output want = Generate(*a, next);
    Output got = Generate(*b, next);
    ASSERT_TRUE(got.result.status.ok()) << got.result.status;
    EXPECT_EQ(got.tokens, want.tokens) << "turn " << turn;
    EXPECT_EQ(got.result.usage.reused_tokens, want.result.usage.reused_tokens);
  }
  // Deleting it gives every block back (the import leaked none).
  const EngineStats before = b->Stats();
  ASSERT_TRUE(b->DeleteSession(session->id, "alice").ok());
  WaitForFreeBlocks(*b, before.cache.blocks_total);
}

// Every truncation of an image is refused by ImportSequence, and takes nothing from the pool.
TEST_P(SessionMoveTest, CorruptImagesAreRefusedAndLeakNothing) {
  auto a = EngineWith(GetParam().make, GetParam().model);
  ASSERT_NE(a, nullptr);
  absl::StatusOr<SessionInfo> session = a->CreateSession();
  ASSERT_TRUE(session.ok());
  Output turn1 =
      Generate(*a, Greedy(RandomPrompt(3, 40, a->model_config().n_vocab), 8, session->id));
  ASSERT_TRUE(turn1.result.status.ok());
  absl::StatusOr<std::vector<Engine::ExportedSession>> exported = a->ExportSessions();
  ASSERT_TRUE(exported.ok());
  const std::string& kv = (*exported)[0].image.cache;
  ASSERT_FALSE(kv.empty());

  absl::StatusOr<TinyModel> tm = LoadTinyModel(GetParam().model);
  ASSERT_TRUE(tm.ok());
  std::unique_ptr<KvCacheBase> cache = GetParam().make(tm->model->config());
  const int64_t free = cache->Stats().blocks_free;
  // Prefixes at a stride (and the last few bytes): each field boundary is crossed.
  for (size_t n = 0; n < kv.size(); n += (n < 256 || n + 64 > kv.size()) ? 1 : 97) {
    absl::StatusOr<SeqId> seq = cache->ImportSequence(kv.substr(0, n));
    ASSERT_FALSE(seq.ok()) << "length " << n;
    ASSERT_EQ(seq.status().code(), absl::StatusCode::kDataLoss) << seq.status();
    ASSERT_EQ(cache->Stats().blocks_free, free);
    ASSERT_EQ(cache->Stats().sequences, 0);
  }
  EXPECT_EQ(cache->ImportSequence(kv + "x").status().code(), absl::StatusCode::kDataLoss);
  absl::StatusOr<SeqId> whole = cache->ImportSequence(kv);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(cache->Length(*whole), 47);
  ASSERT_TRUE(cache->FreeSequence(*whole).ok());
  EXPECT_EQ(cache->Stats().blocks_free, free);
}

INSTANTIATE_TEST_SUITE_P(Caches, SessionMoveTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

// An image of another cache configuration keeps the session's conversation: its next call
// prefills the history and continues as a one-shot request over it would.
TEST(SessionMoveTest, AnotherCacheKeepsTheTokensAndRecomputes) {
  auto a = EngineWith([](const ModelConfig& mc) { return Paged(mc, KvDtype::kF32); });
  // Another configuration of the same model: a block size of 16.
  auto b = EngineWith([](const ModelConfig& mc) {
    PagedKvCache::Config c;
    c.geometry = mc.cache_geometry();
    c.block_size = 16;
    c.capacity_bytes = 128 * PagedKvCache::BlockBytes(c.geometry, 16);
    return std::unique_ptr<KvCacheBase>(*PagedKvCache::Create(c));
  });
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  absl::StatusOr<SessionInfo> session = a->CreateSession();
  ASSERT_TRUE(session.ok());
  const std::vector<int32_t> prompt = RandomPrompt(5, 20, a->model_config().n_vocab);
  Output turn1 = Generate(*a, Greedy(prompt, 6, session->id));
  absl::StatusOr<std::vector<Engine::ExportedSession>> exported = a->ExportSessions();
  ASSERT_TRUE(exported.ok());
  absl::StatusOr<Engine::ImportedSession> imported = b->ImportSession((*exported)[0].image);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->cache.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(imported->cache.message(), "another cache configuration"));
  EXPECT_EQ(imported->info.tokens, 26);
  EXPECT_EQ(imported->info.cached_tokens, 0);

  const std::vector<int32_t> more = {40, 41, 42};
  Output got = Generate(*b, Greedy(more, 5, session->id));
  EXPECT_EQ(got.result.usage.reused_tokens, 0);
  Output want = Generate(*b, Greedy(Concat(Concat(prompt, turn1.tokens), more), 5));
  EXPECT_EQ(got.tokens, want.tokens);
}

// A live engine exports and imports between its steps while other requests run: the copy,
// under another id, continues exactly as the original.
TEST(SessionMoveTest, ExportAndImportWhileRequestsRun) {
  auto engine = EngineWith([](const ModelConfig& mc) { return Compressed(mc, false); });
  ASSERT_NE(engine, nullptr);
  const int32_t vocab = engine->model_config().n_vocab;
  absl::StatusOr<SessionInfo> session = engine->CreateSession(absl::ZeroDuration(), {}, "alice");
  ASSERT_TRUE(session.ok());
  GenerateRequest first = Greedy(RandomPrompt(11, 40, vocab), 10, session->id);
  first.session_owner = "alice";
  ASSERT_TRUE(Generate(*engine, first).result.status.ok());

  // Requests that keep the loop busy meanwhile.
  std::vector<std::shared_ptr<TestObserver>> busy;
  for (int i = 0; i < 3; ++i) {
    busy.push_back(std::make_shared<TestObserver>());
    ASSERT_TRUE(engine->Submit(Greedy(RandomPrompt(30 + i, 20, vocab), 90), busy.back()).ok());
  }
  EXPECT_EQ(engine->ExportSession(session->id, "bob").status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<Engine::ExportedSession> exported = engine->ExportSession(session->id, "alice");
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_TRUE(exported->cache.ok());
  SessionImage copy = exported->image;
  copy.id = "copy-of-the-session-0123456789abcdef";
  absl::StatusOr<Engine::ImportedSession> imported = engine->ImportSession(copy);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_TRUE(imported->cache.ok()) << imported->cache;
  for (auto& obs : busy) {
    ASSERT_TRUE(obs->WaitDone());
    EXPECT_TRUE(obs->result().status.ok());
  }
  GenerateRequest next = Greedy({40, 41, 42, 43}, 12, session->id);
  next.session_owner = "alice";
  Output want = Generate(*engine, next);
  next.session_id = copy.id;
  Output got = Generate(*engine, next);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.result.usage.reused_tokens, want.result.usage.reused_tokens);
  EXPECT_EQ(got.result.usage.reused_tokens, 49);
}

// A refreshing session moves with its codes and every epoch its blocks use, the refreshed
// bases (or transform codes) among them: the target reuses its whole cached prefix (no
// re-prefill), holds the same state (its export is the source's, byte for byte), and goes on
// refreshing with statistics that start over. Bad token lists are refused.
void ExpectRefreshingSessionMoves(const CacheFactory& make) {
  auto a = EngineWith(make);
  ASSERT_NE(a, nullptr);
  const RefreshConfig refresh{.method = RefreshMethod::kPca, .every_tokens = 16};
  absl::StatusOr<SessionInfo> session = a->CreateSession({}, {}, {}, refresh);
  ASSERT_TRUE(session.ok()) << session.status();
  const int vocab = a->model_config().n_vocab;
  Output turn1 = Generate(*a, Greedy(RandomPrompt(9, 60, vocab), 4, session->id));
  ASSERT_TRUE(turn1.result.status.ok());
  // The session has moved to a basis of its own before it is exported.
  ASSERT_GE(a->Stats().cache.refresh.installed, 1);
  absl::StatusOr<std::vector<Engine::ExportedSession>> exported = a->ExportSessions();
  ASSERT_TRUE(exported.ok());
  ASSERT_EQ(exported->size(), 1u);
  const SessionImage& image = (*exported)[0].image;
  ASSERT_TRUE((*exported)[0].cache.ok()) << (*exported)[0].cache;
  EXPECT_EQ(image.tokens.size(), 64u);
  EXPECT_GT(image.cached, 0);
  EXPECT_FALSE(image.cache.empty());
  ASSERT_TRUE(image.refresh.has_value());

  auto b = EngineWith(make);
  ASSERT_NE(b, nullptr);
  SessionImage bad = image;
  bad.tokens.push_back(vocab);
  EXPECT_EQ(b->ImportSession(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = image;
  bad.tokens.assign(static_cast<size_t>(a->model_config().context_length), 5);
  EXPECT_EQ(b->ImportSession(bad).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Engine::ImportedSession> moved = b->ImportSession(image);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->info.refresh_method, RefreshMethod::kPca);
  absl::StatusOr<std::vector<Engine::ExportedSession>> again = b->ExportSessions();
  ASSERT_TRUE(again.ok());
  ASSERT_EQ(again->size(), 1u);
  EXPECT_EQ((*again)[0].image.cached, image.cached);
  EXPECT_TRUE((*again)[0].image.cache == image.cache) << "the imported state differs";

  // The next turn reuses the whole cached prefix, and the target refreshes on its own.
  const int64_t installed_before = b->Stats().cache.refresh.installed;
  GenerateRequest next = Greedy(RandomPrompt(10, 8, vocab), 40, session->id);
  Output turn2 = Generate(*b, next);
  ASSERT_TRUE(turn2.result.status.ok()) << turn2.result.status;
  EXPECT_EQ(turn2.result.usage.reused_tokens, image.cached);
  EXPECT_GT(b->Stats().cache.refresh.installed, installed_before);
}

TEST(SessionMoveTest, RefreshingSessionsMoveWithTheirRefreshedBases) {
  ExpectRefreshingSessionMoves([](const ModelConfig& mc) {
    return Compressed(mc, /*with_default_basis=*/true, /*refresh_inline=*/true);
  });
}

TEST(SessionMoveTest, RefreshingTransformSessionsMoveWithTheirRefreshedCodes) {
  ExpectRefreshingSessionMoves(
      [](const ModelConfig& mc) { return Transform(mc, /*refresh_inline=*/true); });
}

}  // namespace
}  // namespace subspace
