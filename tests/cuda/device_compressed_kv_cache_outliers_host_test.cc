// Outlier tokens in DeviceCompressedKvCache over the twin store: with one layer the device
// cache keeps exactly the CPU cache's outliers and attends as it does; with several layers it
// keeps the union of the CPU cache's per-layer outliers (one decision for every layer) and
// attends as the reference built from those exact tokens; truncation into a block puts its
// outliers back; a pool without a page for an outlier drops the outlier, never the step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/base/tensor_types.h"
#include "tests/cuda/device_compressed_kv_cache_test_util.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::cuda {
namespace {

using namespace device_cache_test;  // NOLINT(build/namespaces): this test family's helpers

// With a random orthonormal basis of rank d / 4 a random key keeps ~3/4 of its energy in the
// residual; a relative residual above 0.9 (energy above 0.81) flags roughly one token in five
// per head: enough to fill outlier pages, with blocks whose outliers straddle two of them.
constexpr float kThreshold = 0.9f;

CompressedKvCacheConfig OutlierConfig(int n_layers, int hd, CoeffDtype dt) {
  CompressedKvCacheConfig c = CpuConfig(hd, dt);
  c.geometry.n_layers = n_layers;
  c.policy.r_k.resize(static_cast<size_t>(n_layers));
  c.policy.r_v.resize(static_cast<size_t>(n_layers));
  c.policy.outlier_threshold = kThreshold;
  return c;
}

// The device cache with `device_threshold` (by default the CPU cache's).
Pair MakeOutlierPair(const CompressedKvCacheConfig& c, int64_t num_pages = 256,
                     float device_threshold = kThreshold) {
  Pair p;
  p.cpu = cache_test::Make(c);
  DeviceCompressedKvCacheConfig d = DeviceConfig(c, num_pages);
  d.policy.outlier_threshold = device_threshold;
  p.store = MakeStore(d);
  absl::StatusOr<std::unique_ptr<DeviceCompressedKvCache>> dev =
      DeviceCompressedKvCache::Create(d, p.store);
  EXPECT_TRUE(dev.ok()) << dev.status();
  if (dev.ok()) p.dev = *std::move(dev);
  return p;
}

// One orthonormal basis (each layer its own ranks) installed as both caches' default.
void InstallBasis(Pair& p, const CompressedKvCacheConfig& c, std::mt19937_64& rng) {
  std::shared_ptr<Basis> basis = cache_test::OrthoBasis(c.geometry, 1, 1, 0);
  for (int l = 0; l < c.geometry.n_layers; ++l) {
    basis->layers[static_cast<size_t>(l)] =
        cache_test::OrthoBasis({1, c.geometry.n_kv_heads, c.geometry.head_dim},
                               c.policy.r_k[static_cast<size_t>(l)],
                               c.policy.r_v[static_cast<size_t>(l)], static_cast<uint32_t>(rng()))
            ->layers[0];
  }
  absl::StatusOr<EpochId> cpu_id = p.cpu->InstallBasis(basis);
  absl::StatusOr<EpochId> dev_id = p.dev->InstallBasis(basis);
  ASSERT_TRUE(cpu_id.ok() && dev_id.ok()) << dev_id.status();
  ASSERT_TRUE(p.cpu->SetDefaultEpoch(*cpu_id).ok());
  ASSERT_TRUE(p.dev->SetDefaultEpoch(*dev_id).ok());
}

// The CPU cache's outliers of every layer, merged.
std::vector<int64_t> UnionOfCpuOutliers(const CompressedKvCache& cpu, SeqId seq) {
  std::set<int64_t> all;
  for (int l = 0; l < cpu.geometry().n_layers; ++l) {
    for (int64_t pos : cpu.OutlierPositions(seq, l)) all.insert(pos);
  }
  return {all.begin(), all.end()};
}

// Every outlier's slot holds its token's stored fp16 bits, K and V of every head and layer.
void ExpectOutlierPagesHoldTheTokens(const DeviceCompressedKvCache& dev, TwinKvStore& store,
                                     SeqId seq, const cache_test::Data& d) {
  const KvCacheGeometry& g = dev.geometry();
  const int hd = g.head_dim, bs = dev.block_size();
  const std::span<const int64_t> pos = dev.OutlierPositions(seq);
  const std::span<const int32_t> pages = dev.OutlierPages(seq);
  ASSERT_EQ(pages.size(), (pos.size() + bs - 1) / bs);
  std::vector<uint16_t> page(static_cast<size_t>(dev.layout(0).page_bytes / 2));
  for (int l = 0; l < g.n_layers; ++l) {
    const kernels::KvPoolLayout& layout = dev.layout(l);
    for (size_t j = 0; j < pos.size(); ++j) {
      if (j % bs == 0) {
        ASSERT_TRUE(store.ReadPage(l, pages[j / bs], page).ok());
      }
      for (int h = 0; h < g.n_kv_heads; ++h) {
        for (int i = 0; i < hd; i += 7) {
          const size_t src = static_cast<size_t>((pos[j] * g.n_kv_heads + h) * hd + i);
          const int64_t slot = static_cast<int64_t>(j % bs) * hd + i;
          ASSERT_EQ(page[static_cast<size_t>(layout.FullK(0, h) / 2 + slot)],
                    Fp32ToFp16(d.k[static_cast<size_t>(l)][src]))
              << "layer " << l << " outlier " << j << " (position " << pos[j] << ") head " << h;
          ASSERT_EQ(page[static_cast<size_t>(layout.FullV(0, h) / 2 + slot)],
                    Fp32ToFp16(d.v[static_cast<size_t>(l)][src]));
        }
      }
    }
  }
}

// The reference the device cache is held to: the stored tokens, but those of the device's
// compressed blocks that are not its outliers as the CPU cache reconstructs them (the CPU cache
// must have compressed them too, and not kept them as its own outliers).
void ExpectAttentionWithDeviceOutliers(Pair& p, SeqId cs, SeqId ds, const cache_test::Data& d,
                                       CoeffDtype dt, uint32_t seed) {
  const KvCacheGeometry& g = p.dev->geometry();
  const int bs = p.dev->block_size();
  const int64_t n = p.dev->Length(ds);
  const cache_test::Data stored = cache_test::RoundTo(d, CoeffDtype::kFp16);
  const cache_test::Data coded = cache_test::EffectiveKv(*p.cpu, cs, stored, n, dt);
  cache_test::Data want = stored;
  const int64_t row = int64_t{g.n_kv_heads} * g.head_dim;
  const std::span<const int64_t> outliers = p.dev->OutlierPositions(ds);
  const std::span<const DeviceCompressedKvCache::Block> table = p.dev->BlockTable(ds);
  for (int64_t t = 0; t < n; ++t) {
    if (table[static_cast<size_t>(t / bs)].slot == kernels::kFullBlock ||
        std::binary_search(outliers.begin(), outliers.end(), t)) {
      continue;
    }
    for (int l = 0; l < g.n_layers; ++l) {
      const std::span<const int64_t> cpu_outliers = p.cpu->OutlierPositions(cs, l);
      ASSERT_TRUE(p.cpu->IsCompressed(cs, l, t / bs)) << "token " << t;
      ASSERT_FALSE(std::binary_search(cpu_outliers.begin(), cpu_outliers.end(), t)) << t;
      std::copy_n(coded.k[l].begin() + t * row, row, want.k[l].begin() + t * row);
      std::copy_n(coded.v[l].begin() + t * row, row, want.v[l].begin() + t * row);
    }
  }
  const int n_heads = 3 * g.n_kv_heads;
  const std::vector<float> q = cache_test::RandomQ(1, n_heads, g.head_dim, seed);
  for (int l = 0; l < g.n_layers; ++l) {
    const std::vector<float> ref = cache_test::DenseAttend(g, want, l, n - 1, 1, q, n_heads);
    const std::vector<float> got = AttendDevice(*p.dev, *p.store, l, ds, q, n_heads);
    EXPECT_LT(cache_test::RelErr(got, ref), Tolerance(dt)) << "layer " << l << " length " << n;
  }
}

// Both caches over one installed basis, a sequence on each, the data both are fed.
class OutlierCachesTest : public ::testing::Test {
 protected:
  // num_pages and device_threshold: the device cache's; the CPU cache keeps `c`'s.
  void Open(const CompressedKvCacheConfig& c, int64_t tokens, int64_t num_pages = 256,
            float device_threshold = kThreshold) {
    const uint64_t seed = kernels::testing::FreshSeed();
    seed_trace_.emplace(__FILE__, __LINE__,
                        ::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
    rng.seed(seed);
    p = MakeOutlierPair(c, num_pages, device_threshold);
    ASSERT_NE(p.dev, nullptr);
    InstallBasis(p, c, rng);
    d = cache_test::RandomKv(c.geometry, tokens, static_cast<uint32_t>(rng()));
    absl::StatusOr<SeqId> cpu_seq = p.cpu->CreateSequence(), dev_seq = p.dev->CreateSequence();
    ASSERT_TRUE(cpu_seq.ok() && dev_seq.ok());
    cs = *cpu_seq;
    ds = *dev_seq;
  }
  // Tokens [from, to) of `data` into both caches, one step.
  void Append(const cache_test::Data& data, int64_t from, int64_t to) {
    cache_test::Append(*p.cpu, cs, data, from, to);
    AppendDevice(*p.dev, *p.store, ds, data, from, to);
  }
  std::vector<int64_t> DeviceOutliers() const {
    const std::span<const int64_t> pos = p.dev->OutlierPositions(ds);
    return {pos.begin(), pos.end()};
  }

  std::mt19937_64 rng;
  Pair p;
  cache_test::Data d;
  SeqId cs = -1, ds = -1;

 private:
  std::optional<::testing::ScopedTrace> seed_trace_;
};

class DeviceCacheOutliersTest : public OutlierCachesTest,
                                public ::testing::WithParamInterface<Shape> {};

TEST_P(DeviceCacheOutliersTest, OneLayerKeepsTheCpuCachesOutliersAndAttendsAsItDoes) {
  const auto [hd, dt] = GetParam();
  const CompressedKvCacheConfig c = OutlierConfig(1, hd, dt);
  ASSERT_NO_FATAL_FAILURE(Open(c, 300));
  int64_t at = 0;
  for (int64_t to : {37, 90, 91, 92, 120, 121, 150, 151, 152, 153, 200, 300}) {
    ASSERT_NO_FATAL_FAILURE(Append(d, at, to));
    at = to;
    const std::span<const int64_t> want = p.cpu->OutlierPositions(cs, 0);
    ASSERT_EQ(DeviceOutliers(), std::vector<int64_t>(want.begin(), want.end())) << "length " << to;
    ExpectSameAttention(p, cs, ds, static_cast<uint32_t>(rng()), Tolerance(dt));
  }
  const std::span<const int64_t> pos = p.dev->OutlierPositions(ds);
  ASSERT_GT(pos.size(), 2u * c.block_size) << "the threshold flags too few tokens to test";
  ExpectOutlierPagesHoldTheTokens(*p.dev, *p.store, ds, d);
  // Each block's mask names exactly its outliers.
  const std::span<const DeviceCompressedKvCache::Block> table = p.dev->BlockTable(ds);
  size_t j = 0;
  for (size_t b = 0; b < table.size(); ++b) {
    uint64_t mask = 0;
    for (; j < pos.size() && pos[j] < static_cast<int64_t>(b + 1) * c.block_size; ++j) {
      mask |= uint64_t{1} << (pos[j] % c.block_size);
    }
    EXPECT_EQ(table[b].outliers, mask) << "block " << b;
  }
  const DeviceCompressedKvCacheDetail detail = p.dev->Detail();
  EXPECT_EQ(detail.outlier_tokens, static_cast<int64_t>(pos.size()));
  EXPECT_EQ(detail.pages_outlier, static_cast<int64_t>(p.dev->OutlierPages(ds).size()));
  EXPECT_EQ(detail.outliers_dropped, 0);
  EXPECT_EQ(p.dev->Stats().bytes_used_outlier, p.cpu->Stats().bytes_used_outlier);
  ASSERT_TRUE(p.dev->FreeSequence(ds).ok());
  EXPECT_EQ(p.dev->Stats().bytes_used_outlier, 0);
  EXPECT_EQ(p.dev->Detail().outlier_tokens, 0);
}

TEST_P(DeviceCacheOutliersTest, SeveralLayersKeepTheUnionOfTheCpuCachesOutliers) {
  const auto [hd, dt] = GetParam();
  ASSERT_NO_FATAL_FAILURE(Open(OutlierConfig(2, hd, dt), 240));
  int64_t at = 0;
  for (int64_t to : {100, 101, 150, 151, 240}) {
    ASSERT_NO_FATAL_FAILURE(Append(d, at, to));
    at = to;
    ASSERT_EQ(DeviceOutliers(), UnionOfCpuOutliers(*p.cpu, cs)) << "length " << to;
    ExpectAttentionWithDeviceOutliers(p, cs, ds, d, dt, static_cast<uint32_t>(rng()));
  }
  ASSERT_GT(DeviceOutliers().size(), p.cpu->OutlierPositions(cs, 0).size());
  ExpectOutlierPagesHoldTheTokens(*p.dev, *p.store, ds, d);
}

TEST_P(DeviceCacheOutliersTest, TruncationIntoABlockPutsItsOutliersBack) {
  const auto [hd, dt] = GetParam();
  const CompressedKvCacheConfig c = OutlierConfig(2, hd, dt);
  ASSERT_NO_FATAL_FAILURE(Open(c, 240));
  const cache_test::Data d2 = cache_test::RandomKv(c.geometry, 240, static_cast<uint32_t>(rng()));
  ASSERT_NO_FATAL_FAILURE(Append(d, 0, 200));
  // The last compressed block with outliers; cut it after its first outlier.
  const int bs = c.block_size;
  const std::span<const DeviceCompressedKvCache::Block> table = p.dev->BlockTable(ds);
  int64_t b = static_cast<int64_t>(table.size()) - 1;
  while (b > 0 && (table[static_cast<size_t>(b)].slot == kernels::kFullBlock ||
                   table[static_cast<size_t>(b)].outliers == 0)) {
    --b;
  }
  ASSERT_GT(b, 0);
  const uint64_t mask = table[static_cast<size_t>(b)].outliers;
  const int64_t cut = b * bs + __builtin_ctzll(mask) + 1;
  const int64_t pages_before = p.dev->Detail().pages_outlier;
  ASSERT_TRUE(p.cpu->Truncate(cs, cut).ok());
  ASSERT_TRUE(p.dev->Truncate(ds, cut).ok());
  ASSERT_EQ(p.dev->BlockTable(ds)[static_cast<size_t>(b)].slot, kernels::kFullBlock);
  // Its page holds the exact outliers again (K of head 0, layer 0, first element).
  std::vector<uint16_t> page(static_cast<size_t>(p.dev->layout(0).page_bytes / 2));
  ASSERT_TRUE(p.store->ReadPage(0, p.dev->BlockTable(ds)[static_cast<size_t>(b)].page, page).ok());
  const int64_t row = int64_t{c.geometry.n_kv_heads} * hd;
  for (uint64_t m = mask; m != 0; m &= m - 1) {
    const int t = __builtin_ctzll(m);
    EXPECT_EQ(page[static_cast<size_t>(t * hd)],
              Fp32ToFp16(d.k[0][static_cast<size_t>((b * bs + t) * row)]))
        << "token " << t;
  }
  // The sequence keeps only the outliers of the blocks still compressed.
  for (int64_t pos : DeviceOutliers()) EXPECT_LT(pos, b * bs);
  EXPECT_LE(p.dev->Detail().pages_outlier, pages_before);
  EXPECT_EQ(p.dev->Detail().outlier_tokens, static_cast<int64_t>(DeviceOutliers().size()));
  // New tokens after the cut, compressed again: the CPU cache's outliers, merged, again.
  ASSERT_NO_FATAL_FAILURE(Append(d2, cut, 240));
  EXPECT_EQ(DeviceOutliers(), UnionOfCpuOutliers(*p.cpu, cs));
  ASSERT_TRUE(p.dev->FreeSequence(ds).ok());
  EXPECT_EQ(p.dev->Stats().bytes_used_outlier, 0);
  EXPECT_EQ(p.dev->Stats().bytes_used_full + p.dev->Stats().bytes_used_compressed, 0);
}

// Images: one format for both caches. The device cache's image (its outliers, the union of the
// layers', in every layer) restores into a CPU cache, whose own image of it is the same bytes,
// and back into the device, bitwise. A CPU image whose layers flag different outliers cannot be
// held by the device cache (refused by name, nothing taken); with one layer it can.
TEST_P(DeviceCacheOutliersTest, ImagesMoveBetweenTheDeviceAndTheCpuCache) {
  const auto [hd, dt] = GetParam();
  const CompressedKvCacheConfig c = OutlierConfig(2, hd, dt);
  ASSERT_NO_FATAL_FAILURE(Open(c, 200));
  ASSERT_NO_FATAL_FAILURE(Append(d, 0, 150));
  ASSERT_NO_FATAL_FAILURE(Append(d, 150, 200));
  ASSERT_EQ(p.dev->ImageLayout(), p.cpu->ImageLayout());
  ASSERT_FALSE(DeviceOutliers().empty());
  absl::StatusOr<std::string> image = p.dev->ExportSequence(ds);
  ASSERT_TRUE(image.ok()) << image.status();

  // Into the CPU cache: the same state (its image is the device's), attending as the device.
  absl::StatusOr<SeqId> on_cpu = p.cpu->ImportSequence(*image);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  EXPECT_EQ(p.cpu->Length(*on_cpu), 200);
  EXPECT_EQ(*p.cpu->ExportSequence(*on_cpu), *image);
  ExpectSameAttention(p, *on_cpu, ds, static_cast<uint32_t>(rng()), Tolerance(dt));

  // Into the device cache again: bitwise the same attention, the same image.
  const int64_t free_before = p.dev->Stats().blocks_free;
  absl::StatusOr<SeqId> copy = p.dev->ImportSequence(*image);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(*p.dev->ExportSequence(*copy), *image);
  const std::vector<float> q = cache_test::RandomQ(1, 3 * c.geometry.n_kv_heads, hd, 7);
  for (int l = 0; l < c.geometry.n_layers; ++l) {
    EXPECT_EQ(AttendDevice(*p.dev, *p.store, l, *copy, q, 3 * c.geometry.n_kv_heads),
              AttendDevice(*p.dev, *p.store, l, ds, q, 3 * c.geometry.n_kv_heads))
        << "layer " << l;
  }
  EXPECT_EQ(p.dev->OutlierPositions(*copy).size(), DeviceOutliers().size());
  ASSERT_TRUE(p.dev->FreeSequence(*copy).ok());
  EXPECT_EQ(p.dev->Stats().blocks_free, free_before);

  // The CPU cache's own sequence flags different outliers per layer: the device cannot hold it.
  ASSERT_NE(p.cpu->OutlierPositions(cs, 0).size(), DeviceOutliers().size());
  const std::string cpu_image = *p.cpu->ExportSequence(cs);
  const absl::Status refused = p.dev->ImportSequence(cpu_image).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("differently across layers"), std::string::npos) << refused;
  // Damaged: refused, nothing taken.
  for (size_t cut : {size_t{40}, image->size() / 2, image->size() - 1}) {
    EXPECT_EQ(p.dev->ImportSequence(image->substr(0, cut)).status().code(),
              absl::StatusCode::kDataLoss)
        << cut;
  }
  EXPECT_EQ(p.dev->Stats().blocks_free, free_before);
  EXPECT_EQ(p.dev->Stats().sequences, 1);

  // One layer: the CPU cache's decisions are the device's to hold.
  Pair one = MakeOutlierPair(OutlierConfig(1, hd, dt));
  ASSERT_NE(one.dev, nullptr);
  InstallBasis(one, OutlierConfig(1, hd, dt), rng);
  const SeqId s1 = *one.cpu->CreateSequence();
  cache_test::Append(*one.cpu, s1, d, 0, 200);
  absl::StatusOr<SeqId> on_dev = one.dev->ImportSequence(*one.cpu->ExportSequence(s1));
  ASSERT_TRUE(on_dev.ok()) << on_dev.status();
  const std::span<const int64_t> want = one.cpu->OutlierPositions(s1, 0);
  const std::span<const int64_t> got = one.dev->OutlierPositions(*on_dev);
  EXPECT_EQ(std::vector<int64_t>(got.begin(), got.end()),
            std::vector<int64_t>(want.begin(), want.end()));
  ExpectSameAttention(one, s1, *on_dev, static_cast<uint32_t>(rng()), Tolerance(dt));
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeviceCacheOutliersTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(CoeffDtype::kFp16,
                                                              CoeffDtype::kInt8)),
                         ShapeName);

// A pool with no page left for an outlier: the token stays compressed (counted), the step goes
// on, and attention follows what was kept. Every token is an outlier here (a residual above
// 0.1 of the key), so each coded block needs a page of its own; one prefill chunk reserves all
// but the headroom page and codes seven blocks in one Commit, whose slab (four slots a page)
// fills after four: that Flush has one free page for four blocks' outliers.
TEST_F(OutlierCachesTest, NoPageForAnOutlierDropsTheOutlierNotTheStep) {
  // The CPU cache (a roomy pool) keeps no outliers: it is the reference for the coded tokens.
  CompressedKvCacheConfig c = OutlierConfig(1, 64, CoeffDtype::kFp16);
  c.policy.outlier_threshold = 1.0f;
  ASSERT_NO_FATAL_FAILURE(Open(c, 160, /*num_pages=*/12, /*device_threshold=*/0.1f));
  ASSERT_EQ(p.dev->plan_layout().SlotsPerPage(), 4);
  ASSERT_NO_FATAL_FAILURE(Append(d, 0, 160));
  const DeviceCompressedKvCacheDetail detail = p.dev->Detail();
  EXPECT_EQ(detail.blocks_compressed, 7);  // blocks 1..7: before 160 - 32, after the sinks
  EXPECT_GT(detail.outliers_dropped, 0);
  EXPECT_EQ(detail.outlier_tokens + detail.outliers_dropped, 7 * 16);
  EXPECT_EQ(detail.outlier_tokens, static_cast<int64_t>(DeviceOutliers().size()));
  ExpectOutlierPagesHoldTheTokens(*p.dev, *p.store, ds, d);
  ExpectAttentionWithDeviceOutliers(p, cs, ds, d, CoeffDtype::kFp16, static_cast<uint32_t>(rng()));
}

TEST(DeviceCacheOutlierPolicyTest, CreateRejectsANonPositiveThreshold) {
  DeviceCompressedKvCacheConfig d = DeviceConfig(OutlierConfig(1, 64, CoeffDtype::kFp16), 16);
  for (float bad : {0.0f, -1.0f, std::nanf("")}) {
    d.policy.outlier_threshold = bad;
    EXPECT_EQ(DeviceCompressedKvCache::Create(d, MakeStore(d)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

}  // namespace
}  // namespace subspace::cuda
