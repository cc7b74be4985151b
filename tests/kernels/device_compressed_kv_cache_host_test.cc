// DeviceCompressedKvCache's bookkeeping and policy, on a store of host memory that runs the
// kernels' CPU twins (twin_kv_store_ref.h): the same tokens go into the CPU reference cache
// (core/compressed_kv_cache.h) and into the device cache, and attention through the decode-plan
// the backend would build (decode-attention twin) must match the CPU cache's Attend, across
// compression, a self-calibrated epoch, per-layer ranks and truncation into a compressed block.
#include "kernels/device_compressed_kv_cache.h"

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

#include "core/compressed_kv_cache.h"
#include "core/ggml_types.h"
#include "kernels/decode_attention.h"
#include "kernels/decode_plan_builder.h"
#include "tests/core/compressed_kv_cache_test_util.h"
#include "tests/kernels/decode_attention_ref.h"
#include "tests/kernels/kv_test_data.h"
#include "tests/kernels/twin_kv_store_ref.h"

namespace subspace::kernels {
namespace {

constexpr int kBasisCapacity = 4;

struct Pair {
  std::unique_ptr<CompressedKvCache> cpu;
  std::shared_ptr<TwinKvStore> store;
  std::unique_ptr<DeviceCompressedKvCache> dev;
};

DeviceCompressedKvCacheConfig DeviceConfig(const CompressedKvCacheConfig& c, int64_t num_pages) {
  DeviceCompressedKvCacheConfig d;
  d.geometry = c.geometry;
  d.block_size = c.block_size;
  d.sink_tokens = c.sink_tokens;
  d.window_tokens = c.window_tokens;
  d.r_k = c.r_k;
  d.r_v = c.r_v;
  d.coeff_dtype = c.coeff_dtype;
  d.num_pages = num_pages;
  return d;
}

std::shared_ptr<TwinKvStore> MakeStore(const DeviceCompressedKvCacheConfig& d) {
  std::vector<KvPoolLayout> layouts;
  for (int l = 0; l < d.geometry.n_layers; ++l) {
    layouts.push_back(MakeKvPoolLayout(d.geometry.n_kv_heads, d.geometry.head_dim, d.block_size,
                                       d.r_k[static_cast<size_t>(l)], d.r_v[static_cast<size_t>(l)],
                                       d.coeff_dtype));
  }
  return std::make_shared<TwinKvStore>(std::move(layouts), d.num_pages, kBasisCapacity);
}

// Two layers of different ranks (so their slots differ in size), sinks, a window of two blocks.
CompressedKvCacheConfig CpuConfig(int hd, CoeffDtype dt) {
  CompressedKvCacheConfig c;
  c.geometry = {2, 2, hd};
  c.block_size = 16;
  c.sink_tokens = 4;
  c.window_tokens = 32;
  c.r_k = {hd / 4, hd / 8};
  c.r_v = {hd / 4 - 4, hd / 8};
  c.coeff_dtype = dt;
  c.full_dtype = CoeffDtype::kFp16;
  c.capacity_bytes = 256 * CompressedKvCache::PageBytes(c.geometry, c.block_size, c.full_dtype);
  return c;
}

Pair MakePair(const CompressedKvCacheConfig& c, int64_t num_pages = 256) {
  Pair p;
  p.cpu = cache_test::Make(c);
  const DeviceCompressedKvCacheConfig d = DeviceConfig(c, num_pages);
  p.store = MakeStore(d);
  absl::StatusOr<std::unique_ptr<DeviceCompressedKvCache>> dev =
      DeviceCompressedKvCache::Create(d, p.store);
  EXPECT_TRUE(dev.ok()) << dev.status();
  if (dev.ok()) p.dev = *std::move(dev);
  return p;
}

// Tokens [from, to) in one step, as the CUDA backend runs it: reserve, the append kernel's
// writes into each token's full page, commit, flush.
void AppendDevice(DeviceCompressedKvCache& cache, TwinKvStore& store, SeqId seq,
                  const cache_test::Data& d, int64_t from, int64_t to) {
  const KvCacheGeometry& g = cache.geometry();
  const int64_t row = static_cast<int64_t>(g.n_kv_heads) * g.head_dim;
  const int bs = cache.block_size();
  ASSERT_TRUE(cache.Reserve(seq, to - from).ok());
  const std::span<const DeviceCompressedKvCache::Block> table = cache.BlockTable(seq);
  for (int64_t t = from; t < to; ++t) {
    const DeviceCompressedKvCache::Block& b = table[static_cast<size_t>(t / bs)];
    ASSERT_EQ(b.slot, kFullBlock) << "token " << t << " would land in a compressed block";
    for (int l = 0; l < g.n_layers; ++l) {
      store.WriteToken(l, b.page, static_cast<int>(t % bs), d.k[l].data() + t * row,
                       d.v[l].data() + t * row);
    }
  }
  ASSERT_TRUE(cache.Commit(seq, to).ok());
  ASSERT_TRUE(cache.Flush().ok());
}

// The last token's attention in `layer` through the plan the backend builds.
std::vector<float> AttendDevice(DeviceCompressedKvCache& cache, TwinKvStore& store, int layer,
                                SeqId seq, const std::vector<float>& q, int n_heads) {
  DecodeSeqDesc desc;
  cache.DescribeDecode(seq, cache.Length(seq), &desc);
  absl::StatusOr<DecodePlan> plan = BuildDecodePlan(cache.plan_layout(), cache.num_pages(),
                                                    kBasisCapacity, {&desc, 1});
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::vector<float> out(q.size(), std::nanf(""));
  if (!plan.ok()) return out;
  DecodeAttentionParams p;
  p.layout = cache.layout(layer);
  p.plan = plan->HostView();
  p.pool = store.pool(layer);
  p.basis_pq = store.basis_pq(layer);
  p.basis_rv = store.basis_rv(layer);
  p.q = q.data();
  p.out = out.data();
  p.n_heads = n_heads;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(cache.geometry().head_dim));
  DecodeAttentionRef(p);
  return out;
}

// Both caches against each other for every layer's last token. The CPU cache projects in float,
// the twins in double, so a few codes round apart (fp16: one ulp; int8: one step of the scale).
void ExpectSameAttention(Pair& p, SeqId cpu_seq, SeqId dev_seq, uint32_t seed, double tol) {
  const KvCacheGeometry& g = p.cpu->geometry();
  const int n_heads = 3 * g.n_kv_heads;
  const std::vector<float> q = cache_test::RandomQ(1, n_heads, g.head_dim, seed);
  const int64_t pos = p.cpu->Length(cpu_seq) - 1;
  ASSERT_EQ(pos + 1, p.dev->Length(dev_seq));
  for (int l = 0; l < g.n_layers; ++l) {
    const std::vector<float> want = cache_test::RunAttend(*p.cpu, l, cpu_seq, pos, 1, q, n_heads);
    const std::vector<float> got = AttendDevice(*p.dev, *p.store, l, dev_seq, q, n_heads);
    EXPECT_LT(cache_test::RelErr(got, want), tol) << "layer " << l << " length " << pos + 1;
  }
}

// An fp16 code one ulp apart (2^-11 relative) moves the output by up to ~1e-4 relative on keys
// with strong directions (seen: 1.02e-4, self-calibrated, d 128), ~5e-6 on isotropic ones; an
// int8 code one step apart (1/127 of the row's scale) moves it more. Bugs (a wrong page, epoch,
// layer or rank) show up as O(1) errors.
double Tolerance(CoeffDtype dt) { return dt == CoeffDtype::kInt8 ? 5e-3 : 1e-3; }

using Shape = std::tuple<int, CoeffDtype>;
class DeviceCompressedKvCacheVsCpuTest : public ::testing::TestWithParam<Shape> {};

TEST_P(DeviceCompressedKvCacheVsCpuTest, InstalledBasisMatchesCpuCacheStepByStep) {
  const auto [hd, dt] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const CompressedKvCacheConfig c = CpuConfig(hd, dt);
  Pair p = MakePair(c);
  ASSERT_NE(p.dev, nullptr);
  std::shared_ptr<Basis> basis = cache_test::OrthoBasis(c.geometry, 1, 1, 0);
  // Per-layer ranks: build the basis layer by layer.
  for (int l = 0; l < 2; ++l) {
    basis->layers[static_cast<size_t>(l)] =
        cache_test::OrthoBasis({1, 2, hd}, c.r_k[static_cast<size_t>(l)],
                               c.r_v[static_cast<size_t>(l)], static_cast<uint32_t>(rng()))
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
    EXPECT_EQ(p.dev->BlockTable(*ds)[static_cast<size_t>(b)].slot != kFullBlock,
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
  const uint64_t seed = testing::FreshSeed();
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
  const uint64_t seed = testing::FreshSeed();
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
  ASSERT_NE(p.dev->BlockTable(*ds)[3].slot, kFullBlock);
  ExpectSameAttention(p, *cs, *ds, static_cast<uint32_t>(rng()), Tolerance(dt));
  // Into block 3 (tokens 48..63), compressed: it comes back full, holding k^ and v^.
  ASSERT_TRUE(p.cpu->Truncate(*cs, 55).ok());
  ASSERT_TRUE(p.dev->Truncate(*ds, 55).ok());
  EXPECT_EQ(p.store->blocks_expanded(), 1);
  EXPECT_EQ(p.dev->BlockTable(*ds).size(), 4u);
  EXPECT_EQ(p.dev->BlockTable(*ds)[3].slot, kFullBlock);
  EXPECT_EQ(p.dev->Detail().blocks_compressed, 2);  // blocks 1 and 2
  ExpectSameAttention(p, *cs, *ds, static_cast<uint32_t>(rng()), Tolerance(dt));
  // New tokens after the cut, then compression again of the expanded block.
  cache_test::Append(*p.cpu, *cs, d2, 55, 120);
  AppendDevice(*p.dev, *p.store, *ds, d2, 55, 120);
  ExpectSameAttention(p, *cs, *ds, static_cast<uint32_t>(rng()), Tolerance(dt));
  EXPECT_NE(p.dev->BlockTable(*ds)[3].slot, kFullBlock);
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
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return "d" + std::to_string(std::get<0>(info.param)) + "_" +
                                  CoeffDtypeName(std::get<1>(info.param));
                         });

// --- Bookkeeping alone ---------------------------------------------------------------------

TEST(DeviceCompressedKvCacheTest, CreateRejectsWhatTheKernelsCannotRun) {
  const CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kFp16);
  DeviceCompressedKvCacheConfig d = DeviceConfig(c, 16);
  std::shared_ptr<TwinKvStore> store = MakeStore(d);
  EXPECT_TRUE(DeviceCompressedKvCache::Create(d, store).ok());
  DeviceCompressedKvCacheConfig bad = d;
  bad.coeff_dtype = CoeffDtype::kFp32;
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  bad = d;
  bad.num_pages = 1;  // nothing left beside the compression headroom
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  bad = d;
  bad.block_size = 65;
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  bad = d;
  bad.r_k = {65, 16};
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  bad = d;
  bad.r_k = {16};
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(bad, store).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceCompressedKvCache::Create(d, nullptr).status()));
}

TEST(DeviceCompressedKvCacheTest, BasisTableEntriesAreRecycled) {
  const CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kFp16);
  const DeviceCompressedKvCacheConfig d = DeviceConfig(c, 16);
  auto cache = DeviceCompressedKvCache::Create(d, MakeStore(d));
  ASSERT_TRUE(cache.ok());
  std::shared_ptr<Basis> basis = std::make_shared<Basis>(Basis::Zeros(c.geometry, c.r_k, c.r_v));
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
  std::shared_ptr<Basis> wrong = std::make_shared<Basis>(
      Basis::Zeros(c.geometry, {8, 8}, {8, 8}));
  ASSERT_TRUE((*cache)->ReleaseEpoch(ids[0]).ok());
  EXPECT_TRUE(absl::IsInvalidArgument((*cache)->InstallBasis(wrong).status()));
}

TEST(DeviceCompressedKvCacheTest, RefreshIsRefusedAndStaticBasesAccepted) {
  const CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kFp16);
  const DeviceCompressedKvCacheConfig d = DeviceConfig(c, 16);
  auto cache = DeviceCompressedKvCache::Create(d, MakeStore(d));
  ASSERT_TRUE(cache.ok());
  absl::StatusOr<SeqId> seq = (*cache)->CreateSequence();
  ASSERT_TRUE(seq.ok());
  RefreshConfig none;
  EXPECT_TRUE((*cache)->SetSequenceRefresh(*seq, none).ok());
  RefreshConfig pca;
  pca.method = RefreshMethod::kPca;
  EXPECT_TRUE(absl::IsFailedPrecondition((*cache)->SetSequenceRefresh(*seq, pca)));
  EXPECT_TRUE(absl::IsNotFound((*cache)->SetSequenceRefresh(*seq + 1, none)));
}

TEST(DeviceCompressedKvCacheTest, ReserveKeepsOnePageForCompression) {
  CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kFp16);
  c.window_tokens = 16;
  c.sink_tokens = 0;
  const int64_t pages = 10;
  const DeviceCompressedKvCacheConfig d = DeviceConfig(c, pages);
  std::shared_ptr<TwinKvStore> store = MakeStore(d);
  auto made = DeviceCompressedKvCache::Create(d, store);
  ASSERT_TRUE(made.ok());
  DeviceCompressedKvCache& cache = **made;
  absl::StatusOr<EpochId> id = cache.InstallBasis(
      std::make_shared<Basis>(Basis::Zeros(c.geometry, c.r_k, c.r_v)));
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
TEST(DeviceCompressedKvCacheTest, RandomTrafficOnATightPoolKeepsEveryPageAccountedFor) {
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kInt8);
  c.block_size = 8;
  c.window_tokens = 8;
  c.sink_tokens = 3;
  const int64_t pages = 24;
  const DeviceCompressedKvCacheConfig d = DeviceConfig(c, pages);
  std::shared_ptr<TwinKvStore> store = MakeStore(d);
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
    } else {
      ASSERT_TRUE(cache.FreeSequence(ids[i]).ok());
      ids[i] = -1;
      coded[i].clear();
    }

    // Invariants over every live sequence.
    std::set<int32_t> full_pages, slab_pages;
    std::set<std::pair<int32_t, int32_t>> slots;
    int64_t tokens = 0, compressed = 0;
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
        if (e.slot == kFullBlock) {
          ASSERT_TRUE(full_pages.insert(e.page).second) << "page " << e.page << " held twice";
          // Its last committed token is still the one this sequence wrote (layer 1), unless
          // the block was coded once (then a truncation expanded k^ into it).
          const int64_t first = static_cast<int64_t>(b) * bs;
          if (first >= n || coded[k].count(static_cast<int64_t>(b)) > 0) continue;
          ASSERT_TRUE(store->ReadPage(1, e.page, page).ok());
          const int64_t t = std::min<int64_t>(n, first + bs) - 1;
          const float want = data[static_cast<size_t>(k)].k[1][static_cast<size_t>(t * row)];
          const uint16_t got = page[static_cast<size_t>(cache.layout(1).FullK(0, 0) / 2 +
                                                        (t - first) * g.head_dim)];
          ASSERT_EQ(got, Fp32ToFp16(want)) << "sequence " << k << " token " << t;
        } else {
          ++compressed;
          coded[k].insert(static_cast<int64_t>(b));
          slab_pages.insert(e.page);
          ASSERT_TRUE(slots.insert({e.page, e.slot}).second) << "slot held twice";
          ASSERT_GE(e.entry, 0);
        }
      }
    }
    for (int32_t p : slab_pages) ASSERT_EQ(full_pages.count(p), 0u) << "page " << p;
    const DeviceCompressedKvCacheDetail detail = cache.Detail();
    ASSERT_EQ(detail.blocks_compressed, compressed);
    ASSERT_EQ(detail.pages_full, static_cast<int64_t>(full_pages.size()));
    ASSERT_EQ(detail.pages_compressed, static_cast<int64_t>(slab_pages.size()));
    ASSERT_EQ(cache.Stats().tokens_cached, tokens);
    ASSERT_LE(detail.pages_full + detail.pages_compressed, pages);
  }
  for (SeqId id : ids) {
    if (id >= 0) {
      ASSERT_TRUE(cache.FreeSequence(id).ok());
    }
  }
  EXPECT_EQ(cache.Stats().blocks_free, (pages - 1) * 2);
  EXPECT_GT(store->blocks_compressed(), 0);
}

}  // namespace
}  // namespace subspace::kernels
