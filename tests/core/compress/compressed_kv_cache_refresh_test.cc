// CompressedKvCache with online refresh: new epochs are installed as the refresher publishes
// them and attention stays exactly the reconstruction reference across epochs; the compactor
// caps live epochs with the documented re-projection; a freed sequence's late refresh is
// dropped without leaking an epoch; and a stalled refresher does not stall the engine.
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/compress/compressed_kv_cache.h"
#include "core/engine/engine.h"
#include "gtest/gtest.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace {
namespace {

using namespace cache_test;  // NOLINT(build/namespaces): the helpers of this test family

constexpr int kHeads = 4;
const KvCacheGeometry kGeom{.n_layers = 2, .n_kv_heads = 2, .head_dim = 16};

CompressedKvCacheConfig RefreshingConfig(RefreshMethod m, int max_epochs) {
  CompressedKvCacheConfig c = SmallConfig(kGeom, 4, CoeffDtype::kFp32, CoeffDtype::kFp32);
  c.n_query_heads = kHeads;
  c.refresh.method = m;
  c.refresh.every_tokens = 8;
  c.refresh.max_epochs = max_epochs;
  c.refresh_inline = true;
  return c;
}

// The K/V each query sees, tracked through compaction: a block compressed with epoch e shows
// P_q[e] P_k[e]^T k (and R_v[e]^T P_v[e]^T v); re-projected from e to f it shows
// P_q[f] P_k[f]^T k^ (R_v[f]^T P_v[f]^T v^). Epochs are copied when first seen, because the
// cache deletes them once unused.
class SeenKv {
 public:
  SeenKv(const CompressedKvCache& cache, Data data) : cache_(cache), seen_(std::move(data)) {}

  // Call after every Commit: applies what changed since the last call.
  void Update(SeqId seq, int64_t tokens) {
    const int hd = kGeom.head_dim, n_kv = kGeom.n_kv_heads, bs = cache_.block_size();
    for (int l = 0; l < kGeom.n_layers; ++l) {
      std::vector<bool> outlier(static_cast<size_t>(tokens), false);
      for (int64_t p : cache_.OutlierPositions(seq, l)) outlier[p] = true;
      for (int64_t b = 0; b * bs < tokens; ++b) {
        for (int h = 0; h < n_kv; ++h) {
          const EpochId e = cache_.BlockEpoch(seq, l, b, h);
          EpochId& was = epoch_.try_emplace({l, b, h}, kNoEpoch).first->second;
          if (e == kNoEpoch || e == was) continue;
          if (!bases_.contains(e)) bases_.emplace(e, *cache_.registry().Get(e));
          const LayerBasis& lb = bases_.at(e).layers[l];
          for (int64_t t = b * bs; t < (b + 1) * bs && t < tokens; ++t) {
            if (outlier[t]) continue;
            Project(lb, h, seen_.k[l].data() + (t * n_kv + h) * hd, /*keys=*/true);
            Project(lb, h, seen_.v[l].data() + (t * n_kv + h) * hd, /*keys=*/false);
          }
          was = e;
        }
      }
    }
  }
  const Data& seen() const { return seen_; }

 private:
  static void Project(const LayerBasis& lb, int h, float* x, bool keys) {
    const int hd = kGeom.head_dim;
    const int r = keys ? lb.rank_k : lb.rank_v;
    const float* p = (keys ? lb.p_k : lb.p_v).data() + static_cast<size_t>(h) * hd * r;
    std::vector<double> c(static_cast<size_t>(r), 0.0);
    for (int i = 0; i < hd; ++i) {
      for (int j = 0; j < r; ++j) c[j] += static_cast<double>(p[i * r + j]) * x[i];
    }
    for (int i = 0; i < hd; ++i) {
      double y = 0.0;
      for (int j = 0; j < r; ++j) {
        y += keys ? lb.p_q[(static_cast<size_t>(h) * hd + i) * r + j] * c[j]
                  : lb.r_v[(static_cast<size_t>(h) * r + j) * hd + i] * c[j];
      }
      x[i] = static_cast<float>(y);
    }
  }

  const CompressedKvCache& cache_;
  Data seen_;
  std::map<std::tuple<int, int64_t, int>, EpochId> epoch_;
  std::map<EpochId, Basis> bases_;
};

// Grows a sequence 4 tokens a step; after each step the last query of every layer must attend
// exactly as dense attention over the K/V it sees. Returns the sequence.
SeqId RunAndCheck(CompressedKvCache& cache, int64_t tokens, double* worst) {
  const SeqId seq = *cache.CreateSequence();
  const Data data = RandomKv(kGeom, tokens, 5);
  SeenKv seen(cache, data);
  for (int64_t t = 0; t < tokens; t += 4) {
    Append(cache, seq, data, t, t + 4);
    seen.Update(seq, t + 4);
    for (int l = 0; l < kGeom.n_layers; ++l) {
      const std::vector<float> q = RandomQ(1, kHeads, kGeom.head_dim, static_cast<uint32_t>(t + l));
      const std::vector<float> got = RunAttend(cache, l, seq, t + 3, 1, q, kHeads);
      const std::vector<float> want = DenseAttend(kGeom, seen.seen(), l, t + 3, 1, q, kHeads);
      *worst = std::max(*worst, RelErr(got, want));
    }
  }
  return seq;
}

TEST(CompressedKvCacheRefreshTest, EpochsFollowTheRefresherAndAttentionStaysExact) {
  for (RefreshMethod m :
       {RefreshMethod::kPca, RefreshMethod::kKqsvd, RefreshMethod::kOja, RefreshMethod::kFd}) {
    auto cache = Make(RefreshingConfig(m, /*max_epochs=*/64));
    ASSERT_NE(cache, nullptr);
    ASSERT_TRUE(cache->SetDefaultEpoch(*cache->InstallBasis(OrthoBasis(kGeom, 4, 4, 3))).ok());
    double worst = 0.0;
    RunAndCheck(*cache, 96, &worst);
    EXPECT_LT(worst, 1e-5) << RefreshMethodName(m);
    const KvCacheStats st = cache->Stats();
    EXPECT_GE(st.refresh.installed, 5) << RefreshMethodName(m);
    EXPECT_EQ(st.refresh.blocks_reprojected, 0);
    EXPECT_GT(cache->Detail().max_sequence_epochs, 2) << RefreshMethodName(m);
  }
}

TEST(CompressedKvCacheRefreshTest, CompactorCapsLiveEpochsWithExactReprojection) {
  for (int max_epochs : {1, 2}) {
    auto cache = Make(RefreshingConfig(RefreshMethod::kPca, max_epochs));
    ASSERT_NE(cache, nullptr);
    ASSERT_TRUE(cache->SetDefaultEpoch(*cache->InstallBasis(ObliqueBasis(kGeom, 4, 4, 3))).ok());
    double worst = 0.0;
    const SeqId seq = RunAndCheck(*cache, 96, &worst);
    EXPECT_LT(worst, 1e-4) << "max_epochs " << max_epochs;
    // A refresh every 8 tokens outruns 64 block-heads of compaction per Commit at J = 1 (96
    // block-heads to move); with no new blocks it catches up.
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(cache->Commit(seq, 96).ok());
    const KvCacheStats st = cache->Stats();
    EXPECT_GT(st.refresh.blocks_reprojected, 0);
    EXPECT_LE(cache->Detail().max_sequence_epochs, max_epochs);
    // The registry holds the default, the sequence's epoch and those its blocks use.
    EXPECT_LE(st.epochs_live, max_epochs + 2);
  }
}

TEST(CompressedKvCacheRefreshTest, PerSequenceConfigAndValidation) {
  CompressedKvCacheConfig c = RefreshingConfig(RefreshMethod::kNone, 2);
  c.n_query_heads = 0;
  auto cache = Make(c);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(cache->refresher(), nullptr);  // no thread for a cache that never refreshes
  const SeqId a = *cache->CreateSequence(), b = *cache->CreateSequence();
  RefreshConfig on;
  on.method = RefreshMethod::kPca;
  on.every_tokens = 8;
  ASSERT_TRUE(cache->SetSequenceRefresh(a, on).ok());
  on.method = RefreshMethod::kKqsvd;
  EXPECT_EQ(cache->SetSequenceRefresh(b, on).code(), absl::StatusCode::kInvalidArgument);
  on.method = RefreshMethod::kPca;
  on.max_epochs = 0;
  EXPECT_EQ(cache->SetSequenceRefresh(b, on).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->SetSequenceRefresh(99, RefreshConfig{}).code(), absl::StatusCode::kNotFound);
  const Data data = RandomKv(kGeom, 64, 9);
  for (int64_t t = 0; t < 64; t += 4) {
    Append(*cache, a, data, t, t + 4);
    Append(*cache, b, data, t, t + 4);
  }
  EXPECT_GT(cache->Stats().refresh.installed, 0);
  EXPECT_NE(cache->SequenceEpoch(a), cache->SequenceEpoch(b));  // b kept the shared default
  EXPECT_EQ(cache->SequenceEpoch(b), cache->default_epoch());
  CompressedKvCacheConfig bad = RefreshingConfig(RefreshMethod::kKqsvd, 2);
  bad.n_query_heads = 3;
  EXPECT_FALSE(CompressedKvCache::Create(bad).ok());
  bad.n_query_heads = 0;
  EXPECT_FALSE(CompressedKvCache::Create(bad).ok());
}

// A latch the refresher thread waits on.
struct Stall {
  std::mutex mu;
  std::condition_variable cv;
  bool entered = false, released = false;
  void Hold() {
    std::unique_lock<std::mutex> lock(mu);
    entered = true;
    cv.notify_all();
    cv.wait(lock, [&] { return released; });
  }
  void WaitEntered() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return entered; });
  }
  bool Entered() {
    std::lock_guard<std::mutex> lock(mu);
    return entered;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu);
      released = true;
    }
    cv.notify_all();
  }
};

TEST(CompressedKvCacheRefreshTest, AFreedSequencesLateRefreshIsDropped) {
  CompressedKvCacheConfig c = RefreshingConfig(RefreshMethod::kPca, 2);
  c.refresh_inline = false;
  auto cache = Make(c);
  ASSERT_NE(cache, nullptr);
  ASSERT_TRUE(cache->SetDefaultEpoch(*cache->InstallBasis(OrthoBasis(kGeom, 4, 4, 3))).ok());
  Stall stall;
  cache->refresher()->SetBeforeRefreshHookForTest([&] { stall.Hold(); });
  const int64_t epochs_before = cache->Stats().epochs_live;
  const SeqId seq = *cache->CreateSequence();
  const Data data = RandomKv(kGeom, 32, 9);
  for (int64_t t = 0; t < 32; t += 4) Append(*cache, seq, data, t, t + 4);
  stall.WaitEntered();
  ASSERT_TRUE(cache->FreeSequence(seq).ok());
  stall.Release();
  cache->refresher()->Flush();
  EXPECT_TRUE(cache->refresher()->has_published());
  cache->InstallPublishedEpochs();
  EXPECT_EQ(cache->Stats().refresh.installed, 0);
  EXPECT_EQ(cache->Stats().epochs_live, epochs_before);
  EXPECT_EQ(cache->Stats().blocks_free, cache->Stats().blocks_total);
}

class Collect : public GenerateObserver {
 public:
  void OnTokens(std::span<const GeneratedTokenEvent> tokens) override {
    std::lock_guard<std::mutex> lock(mu_);
    n_ += static_cast<int>(tokens.size());
  }
  void OnFinish(const GenerateResult& result) override {
    std::lock_guard<std::mutex> lock(mu_);
    ok_ = result.status.ok();
    done_ = true;
    cv_.notify_all();
  }
  // Tokens generated, or -1 when not finished within `timeout`.
  int Wait(std::chrono::seconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return done_; })) return -1;
    return ok_ ? n_ : -2;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false, ok_ = false;
  int n_ = 0;
};

// The refresher is first held inside its first refresh (a session that compressed enough blocks
// to trigger it), then a second session generates to the end while it stays held: decoding
// never waits for it, and what it cannot take is dropped and counted.
TEST(CompressedKvCacheRefreshTest, AStalledRefresherDoesNotStallDecoding) {
  auto tm = testing::LoadTinyModel();
  ASSERT_TRUE(tm.ok());
  const KvCacheGeometry g = tm->model->config().cache_geometry();
  CompressedKvCacheConfig c;
  c.geometry = g;
  c.block_size = 4;
  c.policy.sink_tokens = 1;
  c.policy.window_tokens = 8;
  c.n_query_heads = tm->model->config().n_heads;
  c.refresh.method = RefreshMethod::kKqsvd;
  c.refresh.every_tokens = 8;
  c.refresh_queue_bytes = 16 << 10;  // a few blocks: the second session must overflow it
  c.capacity_bytes = 256 * CompressedKvCache::PageBytes(g, 4, c.full_dtype);
  std::unique_ptr<CompressedKvCache> cache = Make(c);
  ASSERT_NE(cache, nullptr);
  Refresher* refresher = cache->refresher();
  ASSERT_NE(refresher, nullptr);
  Stall stall;
  refresher->SetBeforeRefreshHookForTest([&] { stall.Hold(); });
  auto engine = *Engine::Create({}, tm->model, tm->tokenizer, std::move(cache));

  const auto generate = [&](int tokens) {
    GenerateRequest r;
    r.prompt = tm->tokenizer->Encode("hello world and the");
    r.max_new_tokens = tokens;
    r.ignore_eos = true;
    auto obs = std::make_shared<Collect>();
    EXPECT_TRUE(engine->Submit(std::move(r), obs).ok());
    return obs->Wait(std::chrono::seconds(120));
  };
  ASSERT_EQ(generate(40), 40);
  stall.WaitEntered();  // the refresher got to the first session's blocks, and is held
  // The whole generation completes while the refresher sits in its first refresh.
  EXPECT_EQ(generate(100), 100);
  EXPECT_GT(engine->Stats().cache.refresh.observations_dropped, 0);
  EXPECT_EQ(engine->Stats().cache.refresh.refreshes, 0);
  stall.Release();
  refresher->Flush();
  EXPECT_GT(refresher->Stats().refreshes, 0);
}

}  // namespace
}  // namespace subspace
