// DeviceCompressedKvCache's bookkeeping and policy, on a store of host memory that runs the
// kernels' CPU twins (twin_kv_store_ref.h): the same tokens go into the CPU reference cache
// (core/compress/compressed_kv_cache.h) and into the device cache, and attention through the
// decode-plan the backend would build (decode-attention twin) must match the CPU cache's Attend,
// across compression, a self-calibrated epoch, per-layer ranks and truncation into a compressed
// block.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/compress/compressed_kv_cache.h"
#include "cuda/decode_plan_builder.h"
#include "cuda/device_compressed_kv_cache.h"
#include "kernels/decode_attention.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/cuda/device_compressed_kv_cache_test_util.h"
#include "tests/cuda/twin_kv_store_ref.h"
#include "tests/kernels/decode_attention_ref.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::cuda {
namespace {

using namespace device_cache_test;  // NOLINT(build/namespaces): this test family's helpers

constexpr int kBasisCapacity = kDefaultBasisCapacity;

class DeviceCompressedKvCacheVsCpuTest : public ::testing::TestWithParam<Shape> {};

TEST_P(DeviceCompressedKvCacheVsCpuTest, InstalledBasisMatchesCpuCacheStepByStep) {
  const auto [hd, dt] = GetParam();
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const CompressedKvCacheConfig c = CpuConfig(hd, dt);
  Pair p = MakePair(c);
  ASSERT_NE(p.dev, nullptr);
  std::shared_ptr<Basis> basis = cache_test::OrthoBasis(c.geometry, 1, 1, 0);
  // Per-layer ranks: build the basis layer by layer.
  for (int l = 0; l < 2; ++l) {
    basis->layers[static_cast<size_t>(l)] =
        cache_test::OrthoBasis({1, 2, hd}, c.policy.r_k[static_cast<size_t>(l)],
                               c.policy.r_v[static_cast<size_t>(l)], static_cast<uint32_t>(rng()))
            ->layers[0];
  }
  absl::StatusOr<EpochId> cpu_id = p.cpu->InstallBasis(basis);
  absl::StatusOr<EpochId> dev_id = p.dev->InstallBasis(basis);
  ASSERT_TRUE(cpu_id.ok() && dev_id.ok()) << dev_id.status();
  ASSERT_TRUE(p.cpu->SetDefaultEpoch(*cpu_id).ok());
  ASSERT_TRUE(p.dev->SetDefaultEpoch(*dev_id).ok());

  const int64_t T = 200;
  const cache_test::Data d = cache_test::RandomKv(c.geometry, T, static_cast<uint32_t>(rng()));
  absl::StatusOr<SeqId> cs = p.cpu->CreateSequence(), ds = p.dev->CreateSequence();
  ASSERT_TRUE(cs.ok() && ds.ok());
  // A chunked prefill, then single-token decodes across block and window boundaries.
  int64_t at = 0;
  for (int64_t to : {37, 90, 91, 92, 120, 121, 150, 151, 152, 153, 200}) {
    cache_test::Append(*p.cpu, *cs, d, at, to);
    AppendDevice(*p.dev, *p.store, *ds, d, at, to);
    at = to;
    ExpectSameAttention(p, *cs, *ds, static_cast<uint32_t>(rng()), Tolerance(dt));
  }
  // Blocks wholly before 200 - 32 = 168, past the sinks' first block: 1..9.
  const DeviceCompressedKvCacheDetail detail = p.dev->Detail();
  EXPECT_EQ(detail.blocks_compressed, 9);
  EXPECT_EQ(p.store->blocks_compressed(), 9);
  for (int64_t b = 0; b < 13; ++b) {
    EXPECT_EQ(p.dev->BlockTable(*ds)[static_cast<size_t>(b)].slot != kernels::kFullBlock,
              p.cpu->IsCompressed(*cs, 0, b))
        << "block " << b;
  }
  const KvCacheStats cpu_stats = p.cpu->Stats(), dev_stats = p.dev->Stats();
  EXPECT_EQ(dev_stats.tokens_cached, T);
  EXPECT_EQ(dev_stats.bytes_full_fp16_equivalent, cpu_stats.bytes_full_fp16_equivalent);
  EXPECT_LT(dev_stats.bytes_used_full + dev_stats.bytes_used_compressed,
            dev_stats.bytes_full_fp16_equivalent);
  EXPECT_EQ(p.dev->EpochEntry(*dev_id), p.dev->BlockTable(*ds)[1].entry);
}

TEST_P(DeviceCompressedKvCacheVsCpuTest, SelfCalibratedEpochMatchesCpuCache) {
  const auto [hd, dt] = GetParam();
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const CompressedKvCacheConfig c = CpuConfig(hd, dt);
  Pair p = MakePair(c);
  ASSERT_NE(p.dev, nullptr);
  // Keys with structure (a few strong directions), so PCA has something to find.
  cache_test::Data d = cache_test::RandomKv(c.geometry, 160, static_cast<uint32_t>(rng()));
  for (auto& layer : d.k) {
    for (size_t i = 0; i < layer.size(); ++i) layer[i] *= (i % hd) < 8 ? 4.0f : 0.25f;
  }
  absl::StatusOr<SeqId> cs = p.cpu->CreateSequence(), ds = p.dev->CreateSequence();
  ASSERT_TRUE(cs.ok() && ds.ok());
  cache_test::Append(*p.cpu, *cs, d, 0, 120);
  AppendDevice(*p.dev, *p.store, *ds, d, 0, 120);
  EXPECT_EQ(p.dev->Detail().pca_epochs_built, 1);
  EXPECT_TRUE(p.dev->Detail().default_self_calibrated);
  EXPECT_NE(p.dev->default_epoch(), kNoEpoch);
  ExpectSameAttention(p, *cs, *ds, static_cast<uint32_t>(rng()), Tolerance(dt));
  // A second sequence picks the default up: no second PCA.
  absl::StatusOr<SeqId> cs2 = p.cpu->CreateSequence(), ds2 = p.dev->CreateSequence();
  ASSERT_TRUE(cs2.ok() && ds2.ok());
  cache_test::Append(*p.cpu, *cs2, d, 0, 160);
  AppendDevice(*p.dev, *p.store, *ds2, d, 0, 160);
  EXPECT_EQ(p.dev->Detail().pca_epochs_built, 1);
  ExpectSameAttention(p, *cs2, *ds2, static_cast<uint32_t>(rng()), Tolerance(dt));
}

TEST_P(DeviceCompressedKvCacheVsCpuTest, TruncateIntoCompressedBlockExpandsItLikeTheCpuCache) {
  const auto [hd, dt] = GetParam();
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const CompressedKvCacheConfig c = CpuConfig(hd, dt);
  Pair p = MakePair(c);
  ASSERT_NE(p.dev, nullptr);
  const cache_test::Data d = cache_test::RandomKv(c.geometry, 200, static_cast<uint32_t>(rng()));
  const cache_test::Data d2 = cache_test::RandomKv(c.geometry, 200, static_cast<uint32_t>(rng()));
  absl::StatusOr<SeqId> cs = p.cpu->CreateSequence(), ds = p.dev->CreateSequence();
  ASSERT_TRUE(cs.ok() && ds.ok());
  cache_test::Append(*p.cpu, *cs, d, 0, 150);
  AppendDevice(*p.dev, *p.store, *ds, d, 0, 150);
  ASSERT_NE(p.dev->BlockTable(*ds)[3].slot, kernels::kFullBlock);
  ExpectSameAttention(p, *cs, *ds, static_cast<uint32_t>(rng()), Tolerance(dt));
  // Into block 3 (tokens 48..63), compressed: it comes back full, holding k^ and v^.
  ASSERT_TRUE(p.cpu->Truncate(*cs, 55).ok());
  ASSERT_TRUE(p.dev->Truncate(*ds, 55).ok());
  EXPECT_EQ(p.store->blocks_expanded(), 1);
  EXPECT_EQ(p.dev->BlockTable(*ds).size(), 4u);
  EXPECT_EQ(p.dev->BlockTable(*ds)[3].slot, kernels::kFullBlock);
  EXPECT_EQ(p.dev->Detail().blocks_compressed, 2);  // blocks 1 and 2
  ExpectSameAttention(p, *cs, *ds, static_cast<uint32_t>(rng()), Tolerance(dt));
  // New tokens after the cut, then compression again of the expanded block.
  cache_test::Append(*p.cpu, *cs, d2, 55, 120);
  AppendDevice(*p.dev, *p.store, *ds, d2, 55, 120);
  ExpectSameAttention(p, *cs, *ds, static_cast<uint32_t>(rng()), Tolerance(dt));
  EXPECT_NE(p.dev->BlockTable(*ds)[3].slot, kernels::kFullBlock);
  // Everything back to the pool.
  ASSERT_TRUE(p.dev->FreeSequence(*ds).ok());
  const KvCacheStats st = p.dev->Stats();
  EXPECT_EQ(st.bytes_used_full + st.bytes_used_compressed, 0);
  EXPECT_EQ(st.tokens_cached, 0);
  EXPECT_EQ(p.dev->Detail().blocks_compressed, 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeviceCompressedKvCacheVsCpuTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(CoeffDtype::kFp16,
                                                              CoeffDtype::kInt8)),
                         ShapeName);

// --- Bookkeeping alone ---------------------------------------------------------------------

TEST(DeviceCompressedKvCacheTest, CreateRejectsWhatTheKernelsCannotRun) {
  const CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kFp16);
  DeviceCompressedKvCacheConfig d = DeviceConfig(c, 16);
  std::shared_ptr<TwinKvStore> store = MakeStore(d);
  EXPECT_TRUE(DeviceCompressedKvCache::Create(d, store).ok());
  DeviceCompressedKvCacheConfig bad = d;
  bad.policy.coeff_dtype = CoeffDtype::kFp32;
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  bad.policy.coeff_dtype = CoeffDtype::kInt4;  // no int4 kernels
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  bad = d;
  bad.num_pages = 1;  // nothing left beside the compression headroom
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  bad = d;
  bad.block_size = 65;
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  bad = d;
  bad.policy.r_k = {65, 16};
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  bad = d;
  bad.policy.r_k = {16};
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(d, nullptr).status()));
}

TEST(DeviceCompressedKvCacheTest, BasisTableEntriesAreRecycled) {
  const CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kFp16);
  const DeviceCompressedKvCacheConfig d = DeviceConfig(c, 16);
  auto cache = DeviceCompressedKvCache::Create(d, MakeStore(d));
  ASSERT_TRUE(cache.ok());
  std::shared_ptr<Basis> basis =
      std::make_shared<Basis>(Basis::Zeros(c.geometry, c.policy.r_k, c.policy.r_v));
  std::vector<EpochId> ids;
  for (int i = 0; i < kBasisCapacity; ++i) {
    absl::StatusOr<EpochId> id = (*cache)->InstallBasis(basis);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  EXPECT_TRUE(absl::IsResourceExhausted((*cache)->InstallBasis(basis).status()));
  const int32_t entry = (*cache)->EpochEntry(ids[1]);
  ASSERT_TRUE((*cache)->ReleaseEpoch(ids[1]).ok());
  EXPECT_EQ((*cache)->EpochEntry(ids[1]), -1);
  absl::StatusOr<EpochId> again = (*cache)->InstallBasis(basis);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*cache)->EpochEntry(*again), entry);
  EXPECT_TRUE(absl::IsNotFound((*cache)->ReleaseEpoch(ids[1])));
  // A basis of other ranks does not fit the tables.
  std::shared_ptr<Basis> wrong = std::make_shared<Basis>(Basis::Zeros(c.geometry, {8, 8}, {8, 8}));
  ASSERT_TRUE((*cache)->ReleaseEpoch(ids[0]).ok());
  EXPECT_TRUE(absl::IsInvalidArgument((*cache)->InstallBasis(wrong).status()));
}

TEST(DeviceCompressedKvCacheTest, RefreshMethodsTheDeviceCanRunAreAccepted) {
  const CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kFp16);
  DeviceCompressedKvCacheConfig d = DeviceConfig(c, 16);
  auto cache = DeviceCompressedKvCache::Create(d, MakeStore(d));
  ASSERT_TRUE(cache.ok());
  absl::StatusOr<SeqId> seq = (*cache)->CreateSequence();
  ASSERT_TRUE(seq.ok());
  RefreshConfig r;
  EXPECT_TRUE((*cache)->SetSequenceRefresh(*seq, r).ok());
  for (RefreshMethod m : {RefreshMethod::kPca, RefreshMethod::kOja, RefreshMethod::kFd}) {
    r.method = m;
    EXPECT_TRUE((*cache)->SetSequenceRefresh(*seq, r).ok()) << RefreshMethodName(m);
  }
  // KQ-SVD needs the queries, which stay on the device.
  r.method = RefreshMethod::kKqsvd;
  EXPECT_TRUE(absl::IsFailedPrecondition((*cache)->SetSequenceRefresh(*seq, r)));
  r.method = RefreshMethod::kPca;
  r.max_epochs = 0;
  EXPECT_TRUE(absl::IsInvalidArgument((*cache)->SetSequenceRefresh(*seq, r)));
  EXPECT_TRUE(absl::IsNotFound((*cache)->SetSequenceRefresh(*seq + 1, RefreshConfig{})));
  d.refresh.method = RefreshMethod::kKqsvd;
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(d, MakeStore(d)).status()));
  d.refresh.method = RefreshMethod::kFd;
  EXPECT_TRUE(DeviceCompressedKvCache::Create(d, MakeStore(d)).ok());
}

TEST(DeviceCompressedKvCacheTest, ReserveKeepsOnePageForCompression) {
  CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kFp16);
  c.policy.window_tokens = 16;
  c.policy.sink_tokens = 0;
  const int64_t pages = 10;
  const DeviceCompressedKvCacheConfig d = DeviceConfig(c, pages);
  std::shared_ptr<TwinKvStore> store = MakeStore(d);
  auto made = DeviceCompressedKvCache::Create(d, store);
  ASSERT_TRUE(made.ok());
  DeviceCompressedKvCache& cache = **made;
  absl::StatusOr<EpochId> id = cache.InstallBasis(
      std::make_shared<Basis>(Basis::Zeros(c.geometry, c.policy.r_k, c.policy.r_v)));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(cache.SetDefaultEpoch(*id).ok());
  absl::StatusOr<SeqId> a = cache.CreateSequence();
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(cache.Stats().blocks_free, (pages - 1) * 2);
  EXPECT_EQ(cache.BlocksNeeded(*a, 16 * 9 + 1), 10 * 2);
  EXPECT_TRUE(absl::IsResourceExhausted(cache.Reserve(*a, 16 * 9 + 1)));
  const cache_test::Data data = cache_test::RandomKv(c.geometry, 16 * 9, 7);
  AppendDevice(cache, *store, *a, data, 0, 16 * 9);
  // The window is one block: blocks 0..7 coded, four to a slab page, in two batches (the
  // headroom page took the first four; issuing them freed their pages for the rest).
  EXPECT_EQ(cache.Detail().blocks_compressed, 8);
  EXPECT_EQ(cache.Detail().pages_compressed, 2);
  EXPECT_EQ(cache.Detail().pages_full, 1);
  EXPECT_EQ(store->compress_calls(), 2);
  EXPECT_EQ(cache.Stats().blocks_free, (pages - 3 - 1) * 2);
}

// Random appends, truncations and frees of several sequences on a pool that is always nearly
// full: every batch the store gets passes the twins' checks, no page or slot is ever held twice,
// the accounting adds up, and every full page still holds the tokens its sequence wrote.
// With online refresh (a new epoch every two blocks, at most one live per sequence) the
// compactor's re-coded slots (CheckRecodeBatch: in range, none twice) go through the same
// checks, and a readback lands only every other Flush. With outliers their pages too, and every
// outlier slot holds its token.
class RandomTrafficTest : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(RandomTrafficTest, OnATightPoolEveryPageIsAccountedFor) {
  const auto [refresh, outliers] = GetParam();
  const uint64_t seed = kernels::testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kInt8);
  c.block_size = 8;
  c.policy.window_tokens = 8;
  c.policy.sink_tokens = 3;
  if (refresh) {
    c.refresh.method = RefreshMethod::kPca;
    c.refresh.every_tokens = 16;
    c.refresh.max_epochs = 1;
    c.refresh_inline = true;
  }
  const int64_t pages = 24;
  DeviceCompressedKvCacheConfig d = DeviceConfig(c, pages);
  if (outliers) d.policy.outlier_threshold = 0.85f;
  std::shared_ptr<TwinKvStore> store =
      MakeStore(d, /*basis_capacity=*/8, /*readback_delay=*/refresh ? 1 : 0);
  auto made = DeviceCompressedKvCache::Create(d, store);
  ASSERT_TRUE(made.ok());
  DeviceCompressedKvCache& cache = **made;
  const KvCacheGeometry& g = c.geometry;
  const int bs = c.block_size;
  const int64_t row = int64_t{g.n_kv_heads} * g.head_dim;
  constexpr int kSeqs = 3;
  constexpr int64_t kMaxLen = 400;
  std::vector<cache_test::Data> data;
  for (int i = 0; i < kSeqs; ++i) {
    data.push_back(cache_test::RandomKv(g, kMaxLen, static_cast<uint32_t>(rng())));
  }
  std::vector<SeqId> ids(kSeqs, -1);
  std::vector<std::set<int64_t>> coded(kSeqs);  // blocks of each sequence ever compressed
  // ... and since expanded by a truncation: their pages hold k^, which a newer epoch may flag
  // as outliers when they are compressed again.
  std::vector<std::set<int64_t>> expanded(kSeqs);
  const int64_t page_bytes = cache.layout(0).page_bytes;
  std::vector<uint16_t> page(static_cast<size_t>(page_bytes / 2));
  std::uniform_int_distribution<int> pick(0, kSeqs - 1), op(0, 9), len(1, 40);
  for (int step = 0; step < 400; ++step) {
    const int i = pick(rng);
    const int what = op(rng);
    if (ids[i] < 0) {
      absl::StatusOr<SeqId> s = cache.CreateSequence();
      ASSERT_TRUE(s.ok());
      ids[i] = *s;
    }
    const int64_t length = cache.Length(ids[i]);
    if (what < 7) {  // append
      const int64_t n = std::min<int64_t>(len(rng), kMaxLen - length);
      if (n <= 0 || cache.BlocksNeeded(ids[i], n) > cache.Stats().blocks_free) continue;
      AppendDevice(cache, *store, ids[i], data[static_cast<size_t>(i)], length, length + n);
      if (::testing::Test::HasFatalFailure()) return;
    } else if (what < 9) {  // truncate
      const int64_t to = std::uniform_int_distribution<int64_t>(0, length)(rng);
      ASSERT_TRUE(cache.Truncate(ids[i], to).ok());
      // Blocks past the cut go back to the pool; new ones there start clean.
      coded[i].erase(coded[i].lower_bound((to + bs - 1) / bs), coded[i].end());
      expanded[i].erase(expanded[i].lower_bound((to + bs - 1) / bs), expanded[i].end());
    } else {
      ASSERT_TRUE(cache.FreeSequence(ids[i]).ok());
      ids[i] = -1;
      coded[i].clear();
      expanded[i].clear();
    }

    // Invariants over every live sequence.
    std::set<int32_t> full_pages, slab_pages, outlier_pages;
    std::set<std::pair<int32_t, int32_t>> slots;
    int64_t tokens = 0, compressed = 0, outlier_tokens = 0;
    for (int k = 0; k < kSeqs; ++k) {
      if (ids[k] < 0) continue;
      const int64_t n = cache.Length(ids[k]);
      tokens += n;
      const std::span<const DeviceCompressedKvCache::Block> table = cache.BlockTable(ids[k]);
      ASSERT_GE(static_cast<int64_t>(table.size()), (n + bs - 1) / bs);
      for (size_t b = 0; b < table.size(); ++b) {
        const DeviceCompressedKvCache::Block& e = table[b];
        ASSERT_GE(e.page, 0);
        ASSERT_LT(e.page, pages);
        if (e.slot == kernels::kFullBlock) {
          ASSERT_TRUE(full_pages.insert(e.page).second) << "page " << e.page << " held twice";
          if (coded[k].count(static_cast<int64_t>(b)) > 0)
            expanded[k].insert(static_cast<int64_t>(b));
          // Its last committed token is still the one this sequence wrote (layer 1), unless
          // the block was coded once (then a truncation expanded k^ into it).
          const int64_t first = static_cast<int64_t>(b) * bs;
          if (first >= n || coded[k].count(static_cast<int64_t>(b)) > 0) continue;
          ASSERT_TRUE(store->ReadPage(1, e.page, page).ok());
          const int64_t t = std::min<int64_t>(n, first + bs) - 1;
          const float want = data[static_cast<size_t>(k)].k[1][static_cast<size_t>(t * row)];
          const uint16_t got =
              page[static_cast<size_t>(cache.layout(1).FullK(0, 0) / 2 + (t - first) * g.head_dim)];
          ASSERT_EQ(got, Fp32ToFp16(want)) << "sequence " << k << " token " << t;
        } else {
          ++compressed;
          coded[k].insert(static_cast<int64_t>(b));
          slab_pages.insert(e.page);
          ASSERT_TRUE(slots.insert({e.page, e.slot}).second) << "slot held twice";
          ASSERT_GE(e.entry, 0);
        }
      }
      // Outliers: ascending, each the bit of a compressed block, B to a page, holding its
      // token (layer 1, K of head 0, first element).
      const std::span<const int64_t> pos = cache.OutlierPositions(ids[k]);
      const std::span<const int32_t> opages = cache.OutlierPages(ids[k]);
      ASSERT_EQ(opages.size(), (pos.size() + bs - 1) / bs);
      outlier_tokens += static_cast<int64_t>(pos.size());
      for (int32_t p : opages) ASSERT_TRUE(outlier_pages.insert(p).second) << "page " << p;
      uint64_t masked = 0;
      for (const DeviceCompressedKvCache::Block& e : table)
        masked += __builtin_popcountll(e.outliers);
      ASSERT_EQ(masked, pos.size());
      for (size_t j = 0; j < pos.size(); ++j) {
        ASSERT_TRUE(j == 0 || pos[j - 1] < pos[j]);
        const DeviceCompressedKvCache::Block& e = table[static_cast<size_t>(pos[j] / bs)];
        ASSERT_NE(e.slot, kernels::kFullBlock) << "outlier " << pos[j] << " of a full block";
        ASSERT_TRUE((e.outliers >> (pos[j] % bs)) & 1u);
        if (expanded[k].count(pos[j] / bs) > 0) continue;
        ASSERT_TRUE(store->ReadPage(1, opages[j / bs], page).ok());
        const float want = data[static_cast<size_t>(k)].k[1][static_cast<size_t>(pos[j] * row)];
        ASSERT_EQ(page[static_cast<size_t>(cache.layout(1).FullK(0, 0) / 2 +
                                           static_cast<int64_t>(j % bs) * g.head_dim)],
                  Fp32ToFp16(want))
            << "sequence " << k << " outlier at " << pos[j];
      }
    }
    for (int32_t p : slab_pages) ASSERT_EQ(full_pages.count(p), 0u) << "page " << p;
    for (int32_t p : outlier_pages) {
      ASSERT_EQ(full_pages.count(p) + slab_pages.count(p), 0u) << "page " << p;
    }
    const DeviceCompressedKvCacheDetail detail = cache.Detail();
    ASSERT_EQ(detail.blocks_compressed, compressed);
    ASSERT_EQ(detail.pages_full, static_cast<int64_t>(full_pages.size()));
    ASSERT_EQ(detail.pages_compressed, static_cast<int64_t>(slab_pages.size()));
    ASSERT_EQ(detail.pages_outlier, static_cast<int64_t>(outlier_pages.size()));
    ASSERT_EQ(detail.outlier_tokens, outlier_tokens);
    ASSERT_EQ(cache.Stats().tokens_cached, tokens);
    ASSERT_LE(detail.pages_full + detail.pages_compressed + detail.pages_outlier, pages);
  }
  for (SeqId id : ids) {
    if (id >= 0) {
      ASSERT_TRUE(cache.FreeSequence(id).ok());
    }
  }
  EXPECT_EQ(cache.Stats().blocks_free, (pages - 1) * 2);
  EXPECT_GT(store->blocks_compressed(), 0);
  if (refresh) {
    EXPECT_GT(store->pages_read_back(), 0);
    EXPECT_GT(cache.Stats().refresh.installed, 0);
    EXPECT_GT(cache.Detail().blocks_recoded, 0);
  }
  if (outliers) {
    EXPECT_GT(store->outlier_moves(), 0);
    EXPECT_EQ(cache.Detail().pages_outlier, 0);
  }
  // Only the default epoch is left (every sequence and its epochs are gone).
  EXPECT_EQ(cache.Detail().basis_entries_used, 1);
}

INSTANTIATE_TEST_SUITE_P(Policies, RandomTrafficTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<bool, bool>>& info) {
                           return std::string(std::get<0>(info.param) ? "OnlineRefresh"
                                                                      : "StaticBasis") +
                                  (std::get<1>(info.param) ? "WithOutliers" : "");
                         });

}  // namespace
}  // namespace subspace::cuda
