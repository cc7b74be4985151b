// Refresher: a batch of fp16 blocks read back from a device (HalfBlockBatch) is the same
// evidence as the per-layer fp32 observations the CPU cache hands over -- the same statistics,
// the same key residual, the same published bases -- and malformed batches are refused.
#include "core/compress/refresher.h"

#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"

namespace subspace {
namespace {

const KvCacheGeometry kGeom{.n_layers = 2, .n_kv_heads = 2, .head_dim = 16};
constexpr int kBlock = 8;
constexpr int kRank = 4;

constexpr int kQueryHeads = 4;  // two per KV head
constexpr int64_t kQueryWidth = int64_t{kQueryHeads} * 16;

RefreshConfig Config(RefreshMethod method = RefreshMethod::kPca) {
  RefreshConfig c;
  c.method = method;
  c.every_tokens = 2 * kBlock;  // a refresh every two blocks
  return c;
}

Refresher::StreamId OpenStream(Refresher& r, const Basis& initial) {
  return r.Open(std::make_unique<OnlineStatistics>(kGeom, kGeom.n_kv_heads,
                                                   std::vector<int>(2, kRank),
                                                   std::vector<int>(2, kRank), Config(), initial));
}

Refresher::StreamId OpenKqsvdStream(Refresher& r, const Basis& initial) {
  return r.Open(std::make_unique<OnlineStatistics>(kGeom, kQueryHeads, std::vector<int>(2, kRank),
                                                   std::vector<int>(2, kRank),
                                                   Config(RefreshMethod::kKqsvd), initial));
}

// One block of every layer, the same fp32 observations for each refresher given.
void ObserveBlocks(std::initializer_list<std::pair<Refresher*, Refresher::StreamId>> to,
                   std::mt19937& rng) {
  std::normal_distribution<float> normal;
  const size_t per_half = static_cast<size_t>(kGeom.n_kv_heads) * kBlock * kGeom.head_dim;
  for (int l = 0; l < kGeom.n_layers; ++l) {
    BlockObservation o;
    o.layer = l;
    o.tokens = kBlock;
    for (size_t j = 0; j < per_half; ++j) o.keys.push_back(normal(rng) * (j % 16 < 3 ? 3 : 1));
    for (size_t j = 0; j < per_half; ++j) o.values.push_back(normal(rng));
    for (const auto& [r, s] : to) EXPECT_TRUE(r->Observe(s, o));
  }
}

// Query rows [n, kQueryWidth] of small multiples of 1/8: fp16-exact, and their products and
// sums exact in double, so statistics built in any order or weighting agree to the bit.
std::vector<uint16_t> ExactQueries(int64_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> eighths(-24, 24);
  std::vector<uint16_t> q(static_cast<size_t>(n * kQueryWidth));
  for (uint16_t& x : q) x = Fp32ToFp16(static_cast<float>(eighths(rng)) / 8.0f);
  return q;
}

std::vector<float> Widen(const uint16_t* q, size_t n) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = HalfToFloat(q[i]);
  return out;
}

void ExpectSameBases(const std::vector<Refresher::Published>& got,
                     const std::vector<Refresher::Published>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t e = 0; e < want.size(); ++e) {
    for (int l = 0; l < kGeom.n_layers; ++l) {
      const LayerBasis& w = want[e].epoch.basis->layers[static_cast<size_t>(l)];
      const LayerBasis& g = got[e].epoch.basis->layers[static_cast<size_t>(l)];
      EXPECT_EQ(g.p_k, w.p_k) << "epoch " << e << " layer " << l;
      EXPECT_EQ(g.p_q, w.p_q) << "epoch " << e << " layer " << l;
      EXPECT_EQ(g.p_v, w.p_v) << "epoch " << e << " layer " << l;
    }
  }
}

// sum ||k - P_q P_k^T k||^2 over the rows of keys ([n_kv, n, d]), in double.
double Residual(const LayerBasis& b, const std::vector<float>& keys, double* energy) {
  const int d = kGeom.head_dim, r = b.rank_k;
  double residual = 0.0;
  for (int h = 0; h < kGeom.n_kv_heads; ++h) {
    for (int t = 0; t < kBlock; ++t) {
      const float* k = keys.data() + (static_cast<size_t>(h) * kBlock + t) * d;
      std::vector<double> c(static_cast<size_t>(r), 0.0);
      for (int x = 0; x < d; ++x) {
        for (int j = 0; j < r; ++j) c[j] += double{k[x]} * b.p_k[(h * d + x) * r + j];
      }
      for (int x = 0; x < d; ++x) {
        double kr = 0.0;
        for (int j = 0; j < r; ++j) kr += b.p_q[(h * d + x) * r + j] * c[j];
        residual += (k[x] - kr) * (k[x] - kr);
        *energy += double{k[x]} * k[x];
      }
    }
  }
  return residual;
}

TEST(RefresherTest, HalfBlockBatchesPublishWhatFp32ObservationsPublish) {
  std::shared_ptr<Basis> initial = cache_test::OrthoBasis(kGeom, kRank, kRank, 3);
  Refresher fp32({.inline_mode = true}), half({.inline_mode = true});
  const Refresher::StreamId a = OpenStream(fp32, *initial);
  const Refresher::StreamId b = OpenStream(half, *initial);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  const size_t per_half = static_cast<size_t>(kGeom.n_kv_heads) * kBlock * kGeom.head_dim;
  // Four blocks in two batches of two; fp16-exact values, so both see identical numbers.
  for (int batch = 0; batch < 2; ++batch) {
    HalfBlockBatch hb;
    hb.block_size = kBlock;
    hb.blocks = {{b, initial}, {b, initial}};
    hb.data.resize(2 * per_half * 2 * kGeom.n_layers);  // [layers][2 blocks][K, V]
    std::vector<BlockObservation> obs;
    for (int i = 0; i < 2; ++i) {
      for (int l = 0; l < kGeom.n_layers; ++l) {
        BlockObservation o;
        o.layer = l;
        o.tokens = kBlock;
        uint16_t* dst = hb.data.data() + (static_cast<size_t>(l) * 2 + i) * 2 * per_half;
        for (size_t j = 0; j < 2 * per_half; ++j) {
          dst[j] = Fp32ToFp16(normal(rng) * (j % kGeom.head_dim < 3 ? 3.0f : 0.5f));
          (j < per_half ? o.keys : o.values).push_back(HalfToFloat(dst[j]));
        }
        o.residual = Residual(initial->layers[static_cast<size_t>(l)], o.keys, &o.energy);
        obs.push_back(std::move(o));
      }
    }
    for (BlockObservation& o : obs) EXPECT_TRUE(fp32.Observe(a, std::move(o)));
    absl::StatusOr<bool> taken = half.Observe(std::move(hb));
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_TRUE(*taken);
  }
  const std::vector<Refresher::Published> want = fp32.TakePublished();
  const std::vector<Refresher::Published> got = half.TakePublished();
  ASSERT_EQ(want.size(), 2u);
  ASSERT_EQ(got.size(), want.size());
  for (size_t e = 0; e < want.size(); ++e) {
    EXPECT_EQ(got[e].stream, b);
    for (int l = 0; l < kGeom.n_layers; ++l) {
      const LayerBasis& w = want[e].epoch.basis->layers[static_cast<size_t>(l)];
      const LayerBasis& g = got[e].epoch.basis->layers[static_cast<size_t>(l)];
      EXPECT_EQ(g.p_k, w.p_k) << "epoch " << e << " layer " << l;
      EXPECT_EQ(g.p_v, w.p_v) << "epoch " << e << " layer " << l;
    }
  }
  EXPECT_EQ(half.Stats().refreshes, 2);
}

// The residual trigger sees the residual the refresher computes itself: a basis that misses
// the keys' energy entirely (keys orthogonal to it) refreshes at the first chance.
TEST(RefresherTest, HalfBlockResidualDrivesTheResidualTrigger) {
  std::shared_ptr<Basis> initial = std::make_shared<Basis>(
      Basis::Zeros(kGeom, std::vector<int>(2, kRank), std::vector<int>(2, kRank)));
  for (LayerBasis& lb : initial->layers) {  // span e_{d-4}..e_{d-1} of every head
    for (int h = 0; h < kGeom.n_kv_heads; ++h) {
      for (int j = 0; j < kRank; ++j) {
        const size_t at =
            (static_cast<size_t>(h) * kGeom.head_dim + kGeom.head_dim - kRank + j) * kRank + j;
        lb.p_k[at] = lb.p_q[at] = lb.p_v[at] = 1.0f;
        lb.r_v[(static_cast<size_t>(h) * kRank + j) * kGeom.head_dim + kGeom.head_dim - kRank + j] =
            1.0f;
      }
    }
  }
  RefreshConfig c = Config();
  c.every_tokens = 0;
  c.residual_threshold = 0.5;
  Refresher r({.inline_mode = true});
  const Refresher::StreamId s =
      r.Open(std::make_unique<OnlineStatistics>(kGeom, kGeom.n_kv_heads, std::vector<int>(2, kRank),
                                                std::vector<int>(2, kRank), c, *initial));
  const size_t per_half = static_cast<size_t>(kGeom.n_kv_heads) * kBlock * kGeom.head_dim;
  HalfBlockBatch hb;
  hb.block_size = kBlock;
  for (int i = 0; i < 8; ++i) hb.blocks.push_back({s, initial});  // 64 tokens: the minimum
  hb.data.resize(8 * 2 * per_half * kGeom.n_layers);
  for (size_t j = 0; j < hb.data.size(); ++j) {
    const int x = static_cast<int>(j % kGeom.head_dim);
    hb.data[j] = Fp32ToFp16(x < 4 ? 1.0f + 0.1f * static_cast<float>(j % 7) : 0.0f);
  }
  ASSERT_TRUE(r.Observe(std::move(hb)).ok());
  EXPECT_EQ(r.Stats().refreshes, 1);
}

TEST(RefresherTest, MalformedHalfBlockBatchesAreRefused) {
  std::shared_ptr<Basis> basis = cache_test::OrthoBasis(kGeom, kRank, kRank, 3);
  Refresher r({.inline_mode = true});
  const Refresher::StreamId s = OpenStream(r, *basis);
  HalfBlockBatch empty;
  EXPECT_TRUE(r.Observe(std::move(empty)).ok());  // nothing to see
  HalfBlockBatch short_data;
  short_data.block_size = kBlock;
  short_data.blocks = {{s, basis}};
  short_data.data.resize(10);
  EXPECT_TRUE(absl::IsInvalidArgument(r.Observe(std::move(short_data)).status()));
  HalfBlockBatch no_basis;
  no_basis.block_size = kBlock;
  no_basis.blocks = {{s, nullptr}};
  EXPECT_TRUE(absl::IsInvalidArgument(r.Observe(std::move(no_basis)).status()));
  HalfBlockBatch mixed;
  mixed.block_size = kBlock;
  mixed.blocks = {{s, basis}, {s, cache_test::OrthoBasis({1, 2, 16}, kRank, kRank, 4)}};
  EXPECT_TRUE(absl::IsInvalidArgument(r.Observe(std::move(mixed)).status()));
  EXPECT_EQ(r.Stats().refreshes, 0);
}

// Behind: a batch that would pass the queue bound is dropped whole and counted per block-layer.
TEST(RefresherTest, AQueueFullDropsTheBatchAndCountsItsBlockLayers) {
  std::shared_ptr<Basis> basis = cache_test::OrthoBasis(kGeom, kRank, kRank, 3);
  Refresher r({.max_queued_bytes = 16});
  const Refresher::StreamId s = OpenStream(r, *basis);
  HalfBlockBatch hb;
  hb.block_size = kBlock;
  hb.blocks = {{s, basis}, {s, basis}, {s, basis}};
  hb.data.resize(3 * 2 * static_cast<size_t>(kGeom.n_kv_heads) * kBlock * kGeom.head_dim *
                 kGeom.n_layers);
  absl::StatusOr<bool> taken = r.Observe(std::move(hb));
  ASSERT_TRUE(taken.ok());
  EXPECT_FALSE(*taken);
  r.Flush();
  EXPECT_EQ(r.Stats().observations_dropped, 3 * kGeom.n_layers);
}

// KQ-SVD from a device: every layer's queries of a step in one fp16 observation are the same
// evidence as the CPU cache's per-layer fp32 ones, and the bases it publishes are the same.
TEST(RefresherTest, HalfQueryObservationsPublishWhatFp32QueriesPublish) {
  std::shared_ptr<Basis> initial = cache_test::OrthoBasis(kGeom, kRank, kRank, 3);
  Refresher fp32({.inline_mode = true}), half({.inline_mode = true});
  const Refresher::StreamId a = OpenKqsvdStream(fp32, *initial);
  const Refresher::StreamId b = OpenKqsvdStream(half, *initial);
  std::mt19937 rng(11);
  for (int step = 0; step < 4; ++step) {  // two refreshes
    const int64_t n = 1 + step * 3;
    const std::vector<uint16_t> q = ExactQueries(kGeom.n_layers * n, rng);
    for (int l = 0; l < kGeom.n_layers; ++l) {
      QueryObservation o{.layer = l, .n = n};
      o.q = Widen(q.data() + l * n * kQueryWidth, static_cast<size_t>(n * kQueryWidth));
      EXPECT_TRUE(fp32.Observe(a, std::move(o)));
    }
    absl::StatusOr<bool> taken = half.Observe(
        b, HalfQueryObservation{.n_layers = kGeom.n_layers, .n = n, .width = kQueryWidth, .q = q});
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_TRUE(*taken);
    ObserveBlocks({{&fp32, a}, {&half, b}}, rng);
  }
  const std::vector<Refresher::Published> want = fp32.TakePublished();
  ASSERT_EQ(want.size(), 2u);
  ExpectSameBases(half.TakePublished(), want);
  // The queries matter: without them the same blocks give other bases.
  Refresher blind({.inline_mode = true});
  const Refresher::StreamId c = OpenKqsvdStream(blind, *initial);
  std::mt19937 same(11);
  for (int step = 0; step < 4; ++step) {
    (void)ExactQueries(kGeom.n_layers * (1 + step * 3), same);  // the same draws, not observed
    ObserveBlocks({{&blind, c}}, same);
  }
  const std::vector<Refresher::Published> without = blind.TakePublished();
  ASSERT_EQ(without.size(), 2u);
  EXPECT_NE(without[1].epoch.basis->layers[0].p_k, want[1].epoch.basis->layers[0].p_k);
}

// A kept half of the rows, each weighted 2, is every row of a chunk that repeats each kept one.
// (The second step's rows are plain in both: a weight ignored throughout would only scale G_Q,
// which leaves KQ-SVD's directions alone.)
TEST(RefresherTest, WeightedQueryRowsCountAsRepeatedRows) {
  std::shared_ptr<Basis> initial = cache_test::OrthoBasis(kGeom, kRank, kRank, 5);
  Refresher repeated({.inline_mode = true}), weighted({.inline_mode = true});
  const Refresher::StreamId a = OpenKqsvdStream(repeated, *initial);
  const Refresher::StreamId b = OpenKqsvdStream(weighted, *initial);
  std::mt19937 rng(13);
  for (int step = 0; step < 2; ++step) {
    const int64_t kept = 5;
    const std::vector<uint16_t> q = ExactQueries(kGeom.n_layers * kept, rng);
    const int copies = step == 0 ? 2 : 1;
    std::vector<uint16_t> repeats;
    for (int l = 0; l < kGeom.n_layers; ++l) {
      for (int64_t i = 0; i < kept; ++i) {
        const uint16_t* row = q.data() + (l * kept + i) * kQueryWidth;
        for (int c = 0; c < copies; ++c) repeats.insert(repeats.end(), row, row + kQueryWidth);
      }
    }
    ASSERT_TRUE(repeated
                    .Observe(a, HalfQueryObservation{.n_layers = kGeom.n_layers,
                                                     .n = copies * kept,
                                                     .width = kQueryWidth,
                                                     .q = repeats})
                    .ok());
    ASSERT_TRUE(weighted
                    .Observe(b, HalfQueryObservation{.n_layers = kGeom.n_layers,
                                                     .n = kept,
                                                     .width = kQueryWidth,
                                                     .weight = static_cast<double>(copies),
                                                     .q = q})
                    .ok());
    ObserveBlocks({{&repeated, a}, {&weighted, b}}, rng);
  }
  const std::vector<Refresher::Published> want = repeated.TakePublished();
  ASSERT_EQ(want.size(), 1u);
  ExpectSameBases(weighted.TakePublished(), want);
}

TEST(RefresherTest, MalformedHalfQueryObservationsAreRefused) {
  std::shared_ptr<Basis> basis = cache_test::OrthoBasis(kGeom, kRank, kRank, 3);
  Refresher r({.inline_mode = true});
  const Refresher::StreamId s = OpenKqsvdStream(r, *basis);
  const auto observe = [&](int n_layers, int64_t n, int64_t width, double weight, size_t values) {
    return r
        .Observe(s, HalfQueryObservation{.n_layers = n_layers,
                                         .n = n,
                                         .width = width,
                                         .weight = weight,
                                         .q = std::vector<uint16_t>(values)})
        .status();
  };
  const size_t full = 2 * 3 * kQueryWidth;
  EXPECT_TRUE(observe(2, 3, kQueryWidth, 1.0, full).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(observe(2, 3, kQueryWidth, 1.0, full - 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(observe(0, 3, kQueryWidth, 1.0, 0)));
  EXPECT_TRUE(absl::IsInvalidArgument(observe(2, 0, kQueryWidth, 1.0, 0)));
  EXPECT_TRUE(absl::IsInvalidArgument(observe(2, 3, 0, 1.0, 0)));
  EXPECT_TRUE(absl::IsInvalidArgument(observe(2, 3, kQueryWidth, 0.0, full)));
  EXPECT_TRUE(absl::IsInvalidArgument(observe(2, 3, kQueryWidth, -1.0, full)));
  EXPECT_TRUE(absl::IsInvalidArgument(observe(2, 3, kQueryWidth, std::nan(""), full)));
  EXPECT_TRUE(absl::IsInvalidArgument(observe(2, 3, kQueryWidth, HUGE_VAL, full)));
}

}  // namespace
}  // namespace subspace
