// OnlineStatistics and the Refresher: every method finds a planted subspace, decay follows a
// drifting one, KQ-SVD beats PCA on the logits it was built for, and the refresher's triggers,
// queue bound and stream lifetime behave as documented.
#include "core/compress/online_statistics.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "core/compress/refresher.h"
#include "gtest/gtest.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"

namespace subspace {
namespace {

using cache_test::OrthoBasis;
using cache_test::RandomOrthonormal;

constexpr int kD = 32;
constexpr int kR = 4;
const KvCacheGeometry kGeom{.n_layers = 1, .n_kv_heads = 1, .head_dim = kD};

// Rows x = U a + noise, a ~ N(0, diag(scale)) with decreasing scales. out: [n, d]
std::vector<float> PlantedRows(const std::vector<float>& u, int r, int n, double noise,
                               std::mt19937& rng) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<float> x(static_cast<size_t>(n) * kD);
  for (int t = 0; t < n; ++t) {
    std::vector<double> a(static_cast<size_t>(r));
    for (int j = 0; j < r; ++j) a[j] = nd(rng) * (4.0 - 0.5 * j);
    for (int i = 0; i < kD; ++i) {
      double v = noise * nd(rng);
      for (int j = 0; j < r; ++j) v += u[static_cast<size_t>(i) * r + j] * a[j];
      x[static_cast<size_t>(t) * kD + i] = static_cast<float>(v);
    }
  }
  return x;
}

// tr(A^T B B^T A) / r for column-orthonormal a, b: 1 when the spans agree, ~r/d when random.
double SubspaceOverlap(const float* a, const float* b, int r) {
  std::vector<double> m(static_cast<size_t>(r) * r, 0.0);  // A^T B
  for (int i = 0; i < kD; ++i) {
    for (int x = 0; x < r; ++x) {
      for (int y = 0; y < r; ++y) m[x * r + y] += static_cast<double>(a[i * r + x]) * b[i * r + y];
    }
  }
  double f = 0.0;
  for (double v : m) f += v * v;
  return f / r;
}

double MaxOrthonormalityError(const float* u, int r) {
  double worst = 0.0;
  for (int x = 0; x < r; ++x) {
    for (int y = 0; y < r; ++y) {
      double dot = 0.0;
      for (int i = 0; i < kD; ++i) dot += static_cast<double>(u[i * r + x]) * u[i * r + y];
      worst = std::max(worst, std::abs(dot - (x == y ? 1.0 : 0.0)));
    }
  }
  return worst;
}

RefreshConfig Config(RefreshMethod m) {
  RefreshConfig c;
  c.method = m;
  c.every_tokens = 64;
  return c;
}

OnlineStatistics Make(const RefreshConfig& c, uint32_t seed = 1) {
  return OnlineStatistics(kGeom, /*n_heads=*/2, {kR}, {kR}, c, *OrthoBasis(kGeom, kR, kR, seed));
}

// Feeds keys and values drawn from `u` in blocks of 16.
void Feed(OnlineStatistics& s, const std::vector<float>& u, int tokens, std::mt19937& rng,
          double noise = 0.05) {
  for (int done = 0; done < tokens; done += 16) {
    const std::vector<float> k = PlantedRows(u, kR, 16, noise, rng);
    const std::vector<float> v = PlantedRows(u, kR, 16, noise, rng);
    s.ObserveBlock(0, k.data(), v.data(), 16);
  }
}

class MethodTest : public testing::TestWithParam<RefreshMethod> {};

TEST_P(MethodTest, FindsAPlantedSubspace) {
  std::mt19937 rng(7);
  const std::vector<float> u = RandomOrthonormal(kD, kR, rng);
  OnlineStatistics s = Make(Config(GetParam()));
  double overlap = 0.0;
  // Oja moves a step per refresh (from a random start, ~r/d overlap); the exact methods are
  // there after the first.
  const int rounds = GetParam() == RefreshMethod::kOja ? 40 : 3;
  for (int round = 0; round < rounds; ++round) {
    Feed(s, u, 128, rng);
    absl::StatusOr<Basis> b = s.Refresh();
    ASSERT_TRUE(b.ok()) << b.status();
    const LayerBasis& lb = b->layers[0];
    overlap = SubspaceOverlap(lb.p_k.data(), u.data(), kR);
    EXPECT_LT(MaxOrthonormalityError(lb.p_k.data(), kR), 1e-4);
    EXPECT_EQ(lb.p_q, lb.p_k);  // orthogonal methods
    if (round == rounds - 1) {
      EXPECT_GT(SubspaceOverlap(lb.p_v.data(), u.data(), kR), 0.99);
    }
    for (int i = 0; i < kD; ++i) {
      for (int j = 0; j < kR; ++j) EXPECT_EQ(lb.r_v[j * kD + i], lb.p_v[i * kR + j]);
    }
  }
  EXPECT_GT(overlap, 0.99) << RefreshMethodName(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Methods, MethodTest,
                         testing::Values(RefreshMethod::kPca, RefreshMethod::kOja,
                                         RefreshMethod::kFd),
                         [](const auto& info) { return RefreshMethodName(info.param); });

TEST(OnlineStatisticsTest, OjaMovesGraduallyWithItsLearningRate) {
  std::mt19937 rng(3);
  const std::vector<float> u = RandomOrthonormal(kD, kR, rng);
  RefreshConfig slow = Config(RefreshMethod::kOja), fast = slow;
  slow.oja_learning_rate = 0.05;
  fast.oja_learning_rate = 2.0;
  OnlineStatistics a = Make(slow), b = Make(fast);
  std::mt19937 rng_a(5), rng_b(5);
  Feed(a, u, 128, rng_a);
  Feed(b, u, 128, rng_b);
  const double oa = SubspaceOverlap(a.Refresh()->layers[0].p_k.data(), u.data(), kR);
  const double ob = SubspaceOverlap(b.Refresh()->layers[0].p_k.data(), u.data(), kR);
  EXPECT_LT(oa, ob);
  EXPECT_LT(oa, 0.9);  // one small step from a random start does not get there
}

TEST(OnlineStatisticsTest, DecayFollowsADriftingSubspace) {
  std::mt19937 rng(11);
  const std::vector<float> old_u = RandomOrthonormal(kD, kR, rng);
  const std::vector<float> new_u = RandomOrthonormal(kD, kR, rng);
  for (RefreshMethod m : {RefreshMethod::kPca, RefreshMethod::kFd}) {
    RefreshConfig decayed = Config(m), flat = Config(m);
    decayed.half_life_tokens = 64;
    flat.half_life_tokens = 0;
    OnlineStatistics a = Make(decayed), b = Make(flat);
    std::mt19937 ra(2), rb(2);
    Feed(a, old_u, 2048, ra);
    Feed(b, old_u, 2048, rb);
    Feed(a, new_u, 512, ra);
    Feed(b, new_u, 512, rb);
    const LayerBasis la = a.Refresh()->layers[0], lb = b.Refresh()->layers[0];
    EXPECT_GT(SubspaceOverlap(la.p_k.data(), new_u.data(), kR), 0.95) << RefreshMethodName(m);
    // Without decay four times as much old data wins.
    EXPECT_GT(SubspaceOverlap(lb.p_k.data(), old_u.data(), kR), 0.9) << RefreshMethodName(m);
  }
}

TEST(OnlineStatisticsTest, FrequentDirectionsMatchesExactPca) {
  std::mt19937 rng(13);
  const std::vector<float> u = RandomOrthonormal(kD, kR, rng);
  RefreshConfig pca = Config(RefreshMethod::kPca), fd = Config(RefreshMethod::kFd);
  pca.half_life_tokens = fd.half_life_tokens = 0;
  OnlineStatistics a = Make(pca), b = Make(fd);
  std::mt19937 ra(4), rb(4);
  Feed(a, u, 1024, ra, 0.3);
  Feed(b, u, 1024, rb, 0.3);
  const LayerBasis la = a.Refresh()->layers[0], lb = b.Refresh()->layers[0];
  EXPECT_GT(SubspaceOverlap(la.p_k.data(), lb.p_k.data(), kR), 0.99);
}

TEST(OnlineStatisticsTest, KqsvdHasLowerLogitErrorThanPca) {
  // Keys spread over all directions, queries concentrated on a few: PCA keeps the keys' top
  // directions, KQ-SVD the ones the queries read.
  std::mt19937 rng(17);
  const std::vector<float> uk = RandomOrthonormal(kD, 8, rng);
  const std::vector<float> uq = RandomOrthonormal(kD, 2, rng);
  RefreshConfig kq = Config(RefreshMethod::kKqsvd), pca = Config(RefreshMethod::kPca);
  OnlineStatistics a = Make(kq), b = Make(pca);
  std::vector<float> keys, queries;
  for (int blk = 0; blk < 16; ++blk) {
    const std::vector<float> k = PlantedRows(uk, 8, 16, 0.3, rng);
    const std::vector<float> v = PlantedRows(uk, 8, 16, 0.3, rng);
    a.ObserveBlock(0, k.data(), v.data(), 16);
    b.ObserveBlock(0, k.data(), v.data(), 16);
    keys.insert(keys.end(), k.begin(), k.end());
    // Two query heads share the KV head: [16, 2, d]
    const std::vector<float> q0 = PlantedRows(uq, 2, 16, 0.01, rng);
    const std::vector<float> q1 = PlantedRows(uq, 2, 16, 0.01, rng);
    std::vector<float> q(static_cast<size_t>(16) * 2 * kD);
    for (int t = 0; t < 16; ++t) {
      std::copy(q0.begin() + t * kD, q0.begin() + (t + 1) * kD, q.begin() + (2 * t) * kD);
      std::copy(q1.begin() + t * kD, q1.begin() + (t + 1) * kD, q.begin() + (2 * t + 1) * kD);
    }
    a.ObserveQueries(0, q.data(), 16);
    queries.insert(queries.end(), q.begin(), q.end());
  }
  const LayerBasis la = a.Refresh()->layers[0], lb = b.Refresh()->layers[0];
  EXPECT_NE(la.p_q, la.p_k);  // oblique
  const auto logit_error = [&](const LayerBasis& l) {
    const int nk = static_cast<int>(keys.size() / kD), nq = static_cast<int>(queries.size() / kD);
    double err = 0.0;
    for (int t = 0; t < nk; ++t) {
      std::vector<double> c(kR, 0.0), kh(kD, 0.0);
      for (int i = 0; i < kD; ++i) {
        for (int j = 0; j < kR; ++j) c[j] += l.p_k[i * kR + j] * keys[t * kD + i];
      }
      for (int i = 0; i < kD; ++i) {
        for (int j = 0; j < kR; ++j) kh[i] += l.p_q[i * kR + j] * c[j];
      }
      for (int s = 0; s < nq; s += 7) {
        double e = 0.0;
        for (int i = 0; i < kD; ++i) e += queries[s * kD + i] * (keys[t * kD + i] - kh[i]);
        err += e * e;
      }
    }
    return err;
  };
  EXPECT_LT(logit_error(la), 0.5 * logit_error(lb));
}

TEST(OnlineStatisticsTest, HeadsWithoutDataKeepTheirBasis) {
  const Basis initial = *OrthoBasis(kGeom, kR, kR, 1);
  for (RefreshMethod m :
       {RefreshMethod::kPca, RefreshMethod::kKqsvd, RefreshMethod::kOja, RefreshMethod::kFd}) {
    OnlineStatistics s = Make(Config(m));
    absl::StatusOr<Basis> b = s.Refresh();
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(b->layers[0].p_k, initial.layers[0].p_k) << RefreshMethodName(m);
    EXPECT_EQ(b->layers[0].r_v, initial.layers[0].r_v) << RefreshMethodName(m);
  }
}

TEST(OnlineStatisticsTest, NonFiniteInputFailsTheRefresh) {
  OnlineStatistics s = Make(Config(RefreshMethod::kPca));
  std::vector<float> k(16 * kD, 1.0f), v(16 * kD, 1.0f);
  k[5] = std::nanf("");
  s.ObserveBlock(0, k.data(), v.data(), 16);
  absl::StatusOr<Basis> b = s.Refresh();
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInternal);
}

TEST(OnlineStatisticsTest, KeyResidualEnergy) {
  std::mt19937 rng(19);
  const std::vector<float> u = RandomOrthonormal(kD, kR, rng);
  const std::vector<float> inside = PlantedRows(u, kR, 8, 0.0, rng);
  double res = 0.0, en = 0.0;
  KeyResidualEnergy(inside.data(), 8, kD, kR, u.data(), u.data(), &res, &en);
  EXPECT_LT(res, 1e-8 * en);
  std::vector<float> e0(kD, 0.0f);
  e0[0] = 2.0f;
  const std::vector<float> zero(static_cast<size_t>(kD) * kR, 0.0f);
  res = en = 0.0;
  KeyResidualEnergy(e0.data(), 1, kD, kR, zero.data(), zero.data(), &res, &en);
  EXPECT_DOUBLE_EQ(res, 4.0);
  EXPECT_DOUBLE_EQ(en, 4.0);
}

// --- Refresher ---

BlockObservation Block(const std::vector<float>& u, std::mt19937& rng, int layer = 0,
                       double residual = 0.0, double energy = 1.0) {
  BlockObservation o;
  o.layer = layer;
  o.tokens = 16;
  o.keys = PlantedRows(u, kR, 16, 0.05, rng);
  o.values = PlantedRows(u, kR, 16, 0.05, rng);
  o.residual = residual;
  o.energy = energy;
  return o;
}

TEST(RefresherTest, PublishesEveryTTokens) {
  std::mt19937 rng(23);
  const std::vector<float> u = RandomOrthonormal(kD, kR, rng);
  Refresher r({.inline_mode = true});
  RefreshConfig c = Config(RefreshMethod::kPca);
  c.every_tokens = 48;
  const Refresher::StreamId id = r.Open(std::make_unique<OnlineStatistics>(Make(c)));
  for (int b = 0; b < 10; ++b) ASSERT_TRUE(r.Observe(id, Block(u, rng)));  // 160 tokens
  const std::vector<Refresher::Published> p = r.TakePublished();
  ASSERT_EQ(p.size(), 3u);  // at 48, 96, 144
  EXPECT_EQ(p[0].stream, id);
  EXPECT_FALSE(r.has_published());
  const BasisRefreshStats st = r.Stats();
  EXPECT_EQ(st.refreshes, 3);
  EXPECT_EQ(st.failures, 0);
  int64_t counted = 0;
  for (int64_t n : st.latency_counts) counted += n;
  EXPECT_EQ(counted, 3);
}

TEST(RefresherTest, ResidualTriggerFiresOnlyWhenTheResidualRises) {
  std::mt19937 rng(29);
  const std::vector<float> u = RandomOrthonormal(kD, kR, rng);
  Refresher r({.inline_mode = true});
  RefreshConfig c = Config(RefreshMethod::kPca);
  c.every_tokens = 0;
  c.residual_threshold = 0.2;
  const Refresher::StreamId id = r.Open(std::make_unique<OnlineStatistics>(Make(c)));
  for (int b = 0; b < 8; ++b) r.Observe(id, Block(u, rng, 0, /*residual=*/0.1, 1.0));
  EXPECT_TRUE(r.TakePublished().empty());
  // 64 tokens at least, then the mean of the blocks since the last refresh decides.
  for (int b = 0; b < 2; ++b) r.Observe(id, Block(u, rng, 0, 0.5, 1.0));
  EXPECT_TRUE(r.TakePublished().empty());     // (0.1 * 8 + 0.5 * 2) / 10 = 0.18
  r.Observe(id, Block(u, rng, 0, 0.5, 1.0));  // (0.8 + 1.5) / 11 = 0.21
  EXPECT_EQ(r.Stats().refreshes, 1);
}

TEST(RefresherTest, ClosedStreamsAreForgotten) {
  std::mt19937 rng(31);
  const std::vector<float> u = RandomOrthonormal(kD, kR, rng);
  Refresher r({.inline_mode = false});
  RefreshConfig c = Config(RefreshMethod::kPca);
  c.every_tokens = 16;
  const Refresher::StreamId id = r.Open(std::make_unique<OnlineStatistics>(Make(c)));
  r.Close(id);
  r.Observe(id, Block(u, rng));
  r.Flush();
  EXPECT_TRUE(r.TakePublished().empty());
  EXPECT_EQ(r.Stats().streams, 0);
}

TEST(RefresherTest, AStalledRefresherDropsObservationsInsteadOfBlocking) {
  std::mt19937 rng(37);
  const std::vector<float> u = RandomOrthonormal(kD, kR, rng);
  const int64_t block_bytes = 2 * 16 * kD * static_cast<int64_t>(sizeof(float));
  Refresher r({.inline_mode = false, .max_queued_bytes = 4 * block_bytes});
  std::mutex mu;
  std::condition_variable cv;
  bool entered = false, release = false;
  r.SetBeforeRefreshHookForTest([&] {
    std::unique_lock<std::mutex> lock(mu);
    entered = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
  });
  RefreshConfig c = Config(RefreshMethod::kPca);
  c.every_tokens = 16;
  const Refresher::StreamId id = r.Open(std::make_unique<OnlineStatistics>(Make(c)));
  r.Observe(id, Block(u, rng));  // triggers the refresh that stalls
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return entered; });
  }
  int accepted = 0;
  for (int b = 0; b < 20; ++b) accepted += r.Observe(id, Block(u, rng)) ? 1 : 0;
  EXPECT_EQ(accepted, 4);
  EXPECT_EQ(r.Stats().observations_dropped, 16);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  r.Flush();
  EXPECT_EQ(r.Stats().refreshes, 5);  // the stalled one and one per accepted block
}

}  // namespace
}  // namespace subspace
