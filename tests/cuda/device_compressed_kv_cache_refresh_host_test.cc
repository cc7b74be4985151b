// DeviceCompressedKvCache with online refresh, on the twin store: the blocks it reads back feed
// the same Refresher as the CPU cache's, so with the same tokens both caches install the same
// epochs at the same steps and attend alike (the CPU cache is the reference); the compactor
// keeps max_epochs live per sequence; a late readback or a full basis table costs observations
// or a refresh, never a step.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"
#include "core/compress/compressed_kv_cache.h"
#include "cuda/device_compressed_kv_cache.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/cuda/device_compressed_kv_cache_test_util.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::cuda {
namespace {

using namespace device_cache_test;  // NOLINT(build/namespaces): this test family's helpers

// Enough entries for every epoch of these short sequences: nothing is refused for room.
constexpr int kRoomyCapacity = 16;

CompressedKvCacheConfig RefreshingConfig(int hd, CoeffDtype dt, RefreshMethod m, int max_epochs) {
  CompressedKvCacheConfig c = CpuConfig(hd, dt);
  c.refresh.method = m;
  c.refresh.every_tokens = 32;  // two blocks
  c.refresh.max_epochs = max_epochs;
  c.refresh_inline = true;  // both caches refresh at the same step, deterministically
  return c;
}

// A static default epoch (a random orthonormal basis per layer) in both caches.
void InstallDefault(Pair& p, const CompressedKvCacheConfig& c, uint32_t seed) {
  std::shared_ptr<Basis> basis = cache_test::OrthoBasis(c.geometry, 1, 1, 0);
  for (int l = 0; l < c.geometry.n_layers; ++l) {
    basis->layers[static_cast<size_t>(l)] =
        cache_test::OrthoBasis(
            {1, c.geometry.n_kv_heads, c.geometry.head_dim}, c.policy.r_k[static_cast<size_t>(l)],
            c.policy.r_v[static_cast<size_t>(l)], seed + static_cast<uint32_t>(l))
            ->layers[0];
  }
  absl::StatusOr<EpochId> cpu_id = p.cpu->InstallBasis(basis);
  absl::StatusOr<EpochId> dev_id = p.dev->InstallBasis(basis);
  ASSERT_TRUE(cpu_id.ok() && dev_id.ok());
  ASSERT_TRUE(p.cpu->SetDefaultEpoch(*cpu_id).ok());
  ASSERT_TRUE(p.dev->SetDefaultEpoch(*dev_id).ok());
  ASSERT_TRUE(p.cpu->ReleaseEpoch(*cpu_id).ok());
  ASSERT_TRUE(p.dev->ReleaseEpoch(*dev_id).ok());
}

// Keys with a few strong directions that drift over the sequence, so refreshed bases differ
// from the default and from each other.
cache_test::Data DriftingKv(const KvCacheGeometry& g, int64_t tokens, uint32_t seed) {
  cache_test::Data d = cache_test::RandomKv(g, tokens, seed);
  const int hd = g.head_dim;
  for (auto& layer : d.k) {
    for (size_t i = 0; i < layer.size(); ++i) {
      const int64_t t = static_cast<int64_t>(i) / (int64_t{g.n_kv_heads} * hd);
      const int x = static_cast<int>(i % static_cast<size_t>(hd));
      const int strong = static_cast<int>((t / 48) * 3 % hd);  // moves every 48 tokens
      layer[i] *= (x >= strong && x < strong + 6) ? 4.0f : 0.3f;
    }
  }
  return d;
}

// Appends the same tokens to both caches in uneven steps and compares attention after each.
void RunBoth(Pair& p, const cache_test::Data& d, int64_t tokens, double tol, std::mt19937_64& rng) {
  absl::StatusOr<SeqId> cs = p.cpu->CreateSequence(), ds = p.dev->CreateSequence();
  ASSERT_TRUE(cs.ok() && ds.ok());
  int64_t at = 0;
  while (at < tokens) {
    const int64_t to = std::min<int64_t>(tokens, at + 1 + static_cast<int64_t>(rng() % 23));
    cache_test::Append(*p.cpu, *cs, d, at, to);
    AppendDevice(*p.dev, *p.store, *ds, d, at, to);
    if (::testing::Test::HasFatalFailure()) return;
    at = to;
    ExpectSameAttention(p, *cs, *ds, static_cast<uint32_t>(rng()), tol);
  }
}

using Shape = std::tuple<int, CoeffDtype, RefreshMethod>;
class DeviceRefreshVsCpuTest : public ::testing::TestWithParam<Shape> {};

// max_epochs large: no compaction, so every block keeps the epoch that coded it in both caches.
TEST_P(DeviceRefreshVsCpuTest, SameEpochsAtTheSameStepsAsTheCpuCache) {
  const auto [hd, dt, method] = GetParam();
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const CompressedKvCacheConfig c = RefreshingConfig(hd, dt, method, /*max_epochs=*/16);
  Pair p = MakePair(c, 256, kRoomyCapacity);
  ASSERT_NE(p.dev, nullptr);
  InstallDefault(p, c, static_cast<uint32_t>(rng()));
  const int64_t T = 260;
  RunBoth(p, DriftingKv(c.geometry, T, static_cast<uint32_t>(rng())), T, Tolerance(dt), rng);
  const KvCacheStats cpu = p.cpu->Stats(), dev = p.dev->Stats();
  // (260 - 32) / 16 = 14 blocks past the sinks' first: 13 coded, a refresh every two.
  EXPECT_GE(dev.refresh.installed, 5);
  EXPECT_EQ(dev.refresh.installed, cpu.refresh.installed);
  EXPECT_EQ(dev.refresh.refreshes, cpu.refresh.refreshes);
  EXPECT_EQ(dev.epochs_live, cpu.epochs_live);
  EXPECT_EQ(p.dev->Detail().blocks_unobserved, 0);
  EXPECT_EQ(p.dev->Detail().blocks_recoded, 0);
  EXPECT_EQ(p.store->pages_read_back(), p.dev->Detail().blocks_compressed);
}

// max_epochs 1: after each refresh the compactor moves every older block to the new epoch (the
// CPU cache with its r x r map in float, the device through the float row k^ = P_q[old] c: the
// same map, summed in another order, so codes agree to a rounding as at compression. A wrong
// epoch or slot shows up as O(0.1)).
TEST_P(DeviceRefreshVsCpuTest, CompactorKeepsOneEpochLikeTheCpuCache) {
  const auto [hd, dt, method] = GetParam();
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const CompressedKvCacheConfig c = RefreshingConfig(hd, dt, method, /*max_epochs=*/1);
  Pair p = MakePair(c, 256, kRoomyCapacity);
  ASSERT_NE(p.dev, nullptr);
  InstallDefault(p, c, static_cast<uint32_t>(rng()));
  const int64_t T = 260;
  RunBoth(p, DriftingKv(c.geometry, T, static_cast<uint32_t>(rng())), T, Tolerance(dt), rng);
  const KvCacheStats cpu = p.cpu->Stats(), dev = p.dev->Stats();
  EXPECT_GE(dev.refresh.installed, 5);
  EXPECT_EQ(dev.refresh.installed, cpu.refresh.installed);
  EXPECT_EQ(dev.refresh.blocks_reprojected, cpu.refresh.blocks_reprojected);
  // In place: every move is one re-coded slot, no page expanded.
  EXPECT_EQ(p.store->blocks_recoded(), p.dev->Detail().blocks_recoded);
  EXPECT_EQ(p.store->blocks_expanded(), 0);
  // Every coded block has one epoch; entries in use: that one, the default's, and the
  // sequence's current epoch if a refresh landed since its last block was coded.
  const SeqId seq = 0;
  std::set<int32_t> coded;
  for (const DeviceCompressedKvCache::Block& b : p.dev->BlockTable(seq)) {
    if (b.slot != kernels::kFullBlock) coded.insert(b.entry);
  }
  ASSERT_EQ(coded.size(), 1u);
  const bool current_unused = *coded.begin() != p.dev->EpochEntry(p.dev->SequenceEpoch(seq));
  EXPECT_EQ(p.dev->Detail().basis_entries_used, current_unused ? 3 : 2);
}

// A refreshing sequence's image carries every epoch its blocks use: it restores into a fresh
// device cache (without the source's default: every epoch installed) attending bitwise as the
// source, and into a CPU cache, whose image of it is the same bytes; freed, its epochs go.
TEST_P(DeviceRefreshVsCpuTest, RefreshedEpochsGoWithTheImage) {
  const auto [hd, dt, method] = GetParam();
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const CompressedKvCacheConfig c = RefreshingConfig(hd, dt, method, /*max_epochs=*/16);
  Pair p = MakePair(c, 256, kRoomyCapacity);
  ASSERT_NE(p.dev, nullptr);
  InstallDefault(p, c, static_cast<uint32_t>(rng()));
  const int64_t T = 200;
  RunBoth(p, DriftingKv(c.geometry, T, static_cast<uint32_t>(rng())), T, Tolerance(dt), rng);
  const SeqId seq = 0;
  std::set<EpochId> epochs;
  for (const DeviceCompressedKvCache::Block& b : p.dev->BlockTable(seq)) {
    if (b.slot != kernels::kFullBlock) epochs.insert(b.entry);
  }
  ASSERT_GE(epochs.size(), 3u);
  absl::StatusOr<std::string> image = p.dev->ExportSequence(seq);
  ASSERT_TRUE(image.ok()) << image.status();

  Pair q = MakePair(c, 256, kRoomyCapacity);
  ASSERT_NE(q.dev, nullptr);
  const int64_t free_before = q.dev->Stats().blocks_free;
  absl::StatusOr<SeqId> copy = q.dev->ImportSequence(*image);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(*q.dev->ExportSequence(*copy), *image);
  EXPECT_GE(q.dev->Detail().basis_entries_used, static_cast<int64_t>(epochs.size()));
  const int n_heads = 2 * c.geometry.n_kv_heads;
  const std::vector<float> query = cache_test::RandomQ(1, n_heads, hd, 11);
  for (int l = 0; l < c.geometry.n_layers; ++l) {
    EXPECT_EQ(AttendDevice(*q.dev, *q.store, l, *copy, query, n_heads),
              AttendDevice(*p.dev, *p.store, l, seq, query, n_heads))
        << "layer " << l;
  }
  absl::StatusOr<SeqId> on_cpu = q.cpu->ImportSequence(*image);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  EXPECT_EQ(*q.cpu->ExportSequence(*on_cpu), *image);
  ASSERT_TRUE(q.dev->FreeSequence(*copy).ok());
  EXPECT_EQ(q.dev->Detail().basis_entries_used, 0);
  EXPECT_EQ(q.dev->Stats().blocks_free, free_before);
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeviceRefreshVsCpuTest,
                         ::testing::Values(Shape{64, CoeffDtype::kFp16, RefreshMethod::kPca},
                                           Shape{128, CoeffDtype::kInt8, RefreshMethod::kPca},
                                           Shape{64, CoeffDtype::kInt8, RefreshMethod::kOja},
                                           Shape{128, CoeffDtype::kFp16, RefreshMethod::kFd}),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return "d" + std::to_string(std::get<0>(info.param)) + "_" +
                                  CoeffDtypeName(std::get<1>(info.param)) + "_" +
                                  RefreshMethodName(std::get<2>(info.param));
                         });

// KQ-SVD: the CPU cache observes the queries it attends with; the device cache gets the same
// rows as the CUDA backend hands them over after a step (fp16, every layer at once). With
// fp16-exact queries both build the same statistics, so they install the same epochs at the
// same steps and attend alike. Each step attends its last `n` tokens' queries in every layer.
void AttendBothSharingQueries(Pair& p, SeqId cs, SeqId ds, int64_t n, uint32_t seed, double tol) {
  const KvCacheGeometry& g = p.cpu->geometry();
  const int n_heads = 3 * g.n_kv_heads;
  const int64_t width = int64_t{n_heads} * g.head_dim;
  const int64_t len = p.cpu->Length(cs);
  std::vector<uint16_t> half;
  for (int l = 0; l < g.n_layers; ++l) {
    std::vector<float> q =
        cache_test::RandomQ(n, n_heads, g.head_dim, seed + static_cast<uint32_t>(l));
    for (float& x : q) {
      half.push_back(Fp32ToFp16(x));
      x = HalfToFloat(half.back());
    }
    const std::vector<float> want = cache_test::RunAttend(*p.cpu, l, cs, len - n, n, q, n_heads);
    const std::vector<float> last_q(q.end() - width, q.end());
    const std::vector<float> got = AttendDevice(*p.dev, *p.store, l, ds, last_q, n_heads);
    const std::vector<float> last_want(want.end() - width, want.end());
    EXPECT_LT(cache_test::RelErr(got, last_want), tol) << "layer " << l << " length " << len;
  }
  if (!p.dev->WantsQueries(ds)) return;  // no epoch yet: the CPU cache had no stream either
  ASSERT_TRUE(p.dev
                  ->ObserveQueries(
                      ds, {.n_layers = g.n_layers, .n = n, .width = width, .q = std::move(half)})
                  .ok());
}

CompressedKvCacheConfig KqsvdConfig(int hd, CoeffDtype dt, int max_epochs) {
  CompressedKvCacheConfig c = RefreshingConfig(hd, dt, RefreshMethod::kKqsvd, max_epochs);
  c.n_query_heads = 3 * c.geometry.n_kv_heads;
  return c;
}

using KqsvdShape = std::tuple<int, CoeffDtype, int>;  // head_dim, codes, max_epochs
class DeviceKqsvdRefreshTest : public ::testing::TestWithParam<KqsvdShape> {};

TEST_P(DeviceKqsvdRefreshTest, TheSameQueriesGiveTheCpuCachesEpochs) {
  const auto [hd, dt, max_epochs] = GetParam();
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const CompressedKvCacheConfig c = KqsvdConfig(hd, dt, max_epochs);
  Pair p = MakePair(c, 256, kRoomyCapacity);
  ASSERT_NE(p.dev, nullptr);
  InstallDefault(p, c, static_cast<uint32_t>(rng()));
  const int64_t T = 260;
  const cache_test::Data d = DriftingKv(c.geometry, T, static_cast<uint32_t>(rng()));
  absl::StatusOr<SeqId> cs = p.cpu->CreateSequence(), ds = p.dev->CreateSequence();
  ASSERT_TRUE(cs.ok() && ds.ok());
  const double tol = Tolerance(dt);
  int64_t at = 0;
  while (at < T) {
    const int64_t to = std::min<int64_t>(T, at + 1 + static_cast<int64_t>(rng() % 23));
    cache_test::Append(*p.cpu, *cs, d, at, to);
    AppendDevice(*p.dev, *p.store, *ds, d, at, to);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    AttendBothSharingQueries(p, *cs, *ds, to - at, static_cast<uint32_t>(rng()), tol);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    at = to;
  }
  const KvCacheStats cpu = p.cpu->Stats(), dev = p.dev->Stats();
  EXPECT_GE(dev.refresh.installed, 5);
  EXPECT_EQ(dev.refresh.installed, cpu.refresh.installed);
  EXPECT_EQ(dev.refresh.refreshes, cpu.refresh.refreshes);
  EXPECT_EQ(dev.refresh.blocks_reprojected, cpu.refresh.blocks_reprojected);
  EXPECT_EQ(dev.epochs_live, cpu.epochs_live);
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeviceKqsvdRefreshTest,
                         ::testing::Values(KqsvdShape{64, CoeffDtype::kFp16, 16},
                                           KqsvdShape{128, CoeffDtype::kInt8, 16},
                                           KqsvdShape{64, CoeffDtype::kInt8, 1},
                                           KqsvdShape{128, CoeffDtype::kFp16, 1}),
                         [](const ::testing::TestParamInfo<KqsvdShape>& info) {
                           return "d" + std::to_string(std::get<0>(info.param)) + "_" +
                                  CoeffDtypeName(std::get<1>(info.param)) + "_epochs" +
                                  std::to_string(std::get<2>(info.param));
                         });

// Who may refresh by kqsvd: only a cache that knows the model's query heads (the backend reads
// queries back); queries are taken only for a sequence refreshing by kqsvd, in its shapes.
TEST(DeviceKqsvdRefreshTest, QueriesAreTakenOnlyWhereTheyAreWanted) {
  CompressedKvCacheConfig c = RefreshingConfig(64, CoeffDtype::kFp16, RefreshMethod::kPca, 4);
  DeviceCompressedKvCacheConfig without = DeviceConfig(c, 64);
  without.refresh.method = RefreshMethod::kKqsvd;
  EXPECT_TRUE(absl::IsInvalidArgument(
      DeviceCompressedKvCache::Create(without, MakeStore(without)).status()));
  without.n_query_heads = 5;  // not a multiple of the KV heads
  EXPECT_TRUE(absl::IsInvalidArgument(
      DeviceCompressedKvCache::Create(without, MakeStore(without)).status()));

  Pair blind = MakePair(c, 64);  // no query heads: pca and friends only
  ASSERT_NE(blind.dev, nullptr);
  const SeqId b = *blind.dev->CreateSequence();
  RefreshConfig kqsvd = c.refresh;
  kqsvd.method = RefreshMethod::kKqsvd;
  EXPECT_TRUE(absl::IsFailedPrecondition(blind.dev->SetSequenceRefresh(b, kqsvd)));

  c.n_query_heads = 3 * c.geometry.n_kv_heads;
  Pair p = MakePair(c, 256, kRoomyCapacity);
  ASSERT_NE(p.dev, nullptr);
  InstallDefault(p, c, 41);
  const SeqId pca = *p.dev->CreateSequence(), kq = *p.dev->CreateSequence();
  ASSERT_TRUE(p.dev->SetSequenceRefresh(kq, kqsvd).ok());
  const cache_test::Data d = DriftingKv(c.geometry, 64, 42);
  for (SeqId s : {pca, kq}) AppendDevice(*p.dev, *p.store, s, d, 0, 64);
  EXPECT_FALSE(p.dev->WantsQueries(pca));
  EXPECT_TRUE(p.dev->WantsQueries(kq));
  EXPECT_FALSE(p.dev->WantsQueries(99));
  const int64_t width = int64_t{c.n_query_heads} * 64;
  const auto observe = [&](SeqId s, int n_layers, int64_t w) {
    return p.dev->ObserveQueries(
        s, {.n_layers = n_layers,
            .n = 2,
            .width = w,
            .q = std::vector<uint16_t>(static_cast<size_t>(n_layers * 2 * w))});
  };
  EXPECT_TRUE(observe(kq, 2, width).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(observe(pca, 2, width)));
  EXPECT_TRUE(absl::IsNotFound(observe(99, 2, width)));
  EXPECT_TRUE(absl::IsInvalidArgument(observe(kq, 1, width)));
  EXPECT_TRUE(absl::IsInvalidArgument(observe(kq, 2, width - 64)));
  // The refresher itself refuses data that does not match the declared shapes.
  EXPECT_TRUE(absl::IsInvalidArgument(
      p.dev->ObserveQueries(kq, {.n_layers = 2, .n = 2, .width = width, .q = {1, 2, 3}})));
}

// A readback still in flight at the next Flush: that Flush's blocks go unobserved (counted),
// the refresher sees fewer blocks, and refreshes still land.
TEST(DeviceRefreshTest, ASlowReadbackSkipsBlocksAndNeverWaits) {
  CompressedKvCacheConfig c = RefreshingConfig(64, CoeffDtype::kFp16, RefreshMethod::kPca, 2);
  c.refresh.every_tokens = 16;
  Pair p = MakePair(c, 256, kRoomyCapacity, /*readback_delay=*/3);
  ASSERT_NE(p.dev, nullptr);
  InstallDefault(p, c, 11);
  const cache_test::Data d = DriftingKv(c.geometry, 400, 12);
  absl::StatusOr<SeqId> seq = p.dev->CreateSequence();
  ASSERT_TRUE(seq.ok());
  // A block a step: each readback is still in flight at the next one's Flush.
  for (int64_t t = 0; t < 400; t += 16) AppendDevice(*p.dev, *p.store, *seq, d, t, t + 16);
  const DeviceCompressedKvCacheDetail detail = p.dev->Detail();
  EXPECT_GT(detail.blocks_unobserved, 0);
  EXPECT_EQ(detail.blocks_unobserved + p.store->pages_read_back(), detail.blocks_compressed);
  EXPECT_GT(p.dev->Stats().refresh.installed, 0);
  // The metrics count them as dropped observations, one per layer.
  EXPECT_EQ(p.dev->Stats().refresh.observations_dropped,
            detail.blocks_unobserved * c.geometry.n_layers);
}

// Basis tables of two entries: the default and one refreshed epoch. The next refresh finds no
// free entry (the default keeps its own), so it is counted and dropped; Commit never fails.
TEST(DeviceRefreshTest, AFullBasisTableDropsARefreshNotAStep) {
  const CompressedKvCacheConfig c = RefreshingConfig(64, CoeffDtype::kFp16, RefreshMethod::kPca, 1);
  Pair p = MakePair(c, 256, /*basis_capacity=*/2);
  ASSERT_NE(p.dev, nullptr);
  InstallDefault(p, c, 21);
  const cache_test::Data d = DriftingKv(c.geometry, 300, 22);
  absl::StatusOr<SeqId> seq = p.dev->CreateSequence();
  ASSERT_TRUE(seq.ok());
  for (int64_t t = 0; t < 300; t += 7) {
    AppendDevice(*p.dev, *p.store, *seq, d, t, std::min<int64_t>(300, t + 7));
  }
  EXPECT_EQ(p.dev->Stats().refresh.installed, 1);
  EXPECT_GT(p.dev->Detail().refreshes_unplaced, 0);
  EXPECT_EQ(p.dev->Stats().refresh.failures, p.dev->Detail().refreshes_unplaced);
  EXPECT_EQ(p.dev->Detail().basis_entries_used, 2);
  // Freeing the sequence frees its epoch's entry.
  ASSERT_TRUE(p.dev->FreeSequence(*seq).ok());
  EXPECT_EQ(p.dev->Detail().basis_entries_used, 1);
  EXPECT_EQ(p.dev->Stats().refresh.streams, 0);
}

// The refresher on its own thread (as served): observations queue, epochs land at a Commit after
// the thread has published them, and freeing the sequences closes every stream.
TEST(DeviceRefreshTest, WithTheRefresherOnItsThreadEpochsLandAtALaterCommit) {
  CompressedKvCacheConfig c = RefreshingConfig(64, CoeffDtype::kInt8, RefreshMethod::kOja, 1);
  c.refresh_inline = false;
  Pair p = MakePair(c, 256, kRoomyCapacity);
  ASSERT_NE(p.dev, nullptr);
  InstallDefault(p, c, 31);
  const cache_test::Data d = DriftingKv(c.geometry, 300, 32);
  std::vector<SeqId> seqs;
  for (int i = 0; i < 3; ++i) seqs.push_back(*p.dev->CreateSequence());
  int64_t at = 0;
  for (; at < 200; at += 10) {
    for (SeqId s : seqs) AppendDevice(*p.dev, *p.store, s, d, at, at + 10);
  }
  ASSERT_NE(p.dev->refresher(), nullptr);
  p.dev->refresher()->Flush();  // everything observed so far is processed and published
  for (SeqId s : seqs) AppendDevice(*p.dev, *p.store, s, d, at, at + 10);
  const KvCacheStats st = p.dev->Stats();
  EXPECT_GT(st.refresh.refreshes, 0);
  EXPECT_GT(st.refresh.installed, 0);
  EXPECT_EQ(st.refresh.streams, 3);
  for (SeqId s : seqs) ASSERT_TRUE(p.dev->FreeSequence(s).ok());
  EXPECT_EQ(p.dev->Stats().refresh.streams, 0);
  EXPECT_EQ(p.dev->Detail().basis_entries_used, 1);  // the default's
}

}  // namespace
}  // namespace subspace::cuda
