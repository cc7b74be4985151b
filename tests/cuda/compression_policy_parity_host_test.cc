// One CompressionPolicy, two caches: the same sequence fed to the CPU cache and to the device
// cache (over the test store) in the same steps must lead to the same decisions -- which blocks
// are coded, with which epoch, which basis self-calibration builds (the same sampled blocks, so
// the same basis, also past kPcaMaxTokens), and which tokens stay full-rank as outliers (the
// device keeps the union over layers of the CPU cache's per-layer choice; DESIGN in
// cuda/device_compressed_kv_cache.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "core/compress/compression_policy.h"
#include "tests/cuda/device_compressed_kv_cache_test_util.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::cuda {
namespace {

using namespace device_cache_test;  // NOLINT(build/namespaces): this test family's helpers

struct Case {
  const char* name;
  int64_t tokens;              // > kPcaMaxTokens samples blocks with a stride
  std::vector<int64_t> steps;  // commit points (prefill chunks, then decodes)
  float outlier_threshold;
  bool per_sequence_pca;
};

class PolicyParityTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const uint64_t seed = kernels::testing::FreshSeed();
    trace_.emplace(__FILE__, __LINE__,
                   ::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
    rng_.seed(seed);
  }
  std::mt19937_64 rng_;

 private:
  std::optional<::testing::ScopedTrace> trace_;
};

std::vector<int64_t> UnionOfOutliers(const CompressedKvCache& cpu, SeqId seq, int n_layers) {
  std::vector<int64_t> all;
  for (int l = 0; l < n_layers; ++l) {
    const std::span<const int64_t> pos = cpu.OutlierPositions(seq, l);
    all.insert(all.end(), pos.begin(), pos.end());
  }
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  return all;
}

void ExpectSameBasis(const Basis& a, const Basis& b) {
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerBasis& x = a.layers[l];
    const LayerBasis& y = b.layers[l];
    ASSERT_EQ(x.p_q.size(), y.p_q.size());
    ASSERT_EQ(x.r_v.size(), y.r_v.size());
    // The same fp16 rows in the same order, the same double-precision Grams and eigensolver.
    for (size_t i = 0; i < x.p_q.size(); ++i)
      ASSERT_NEAR(x.p_q[i], y.p_q[i], 1e-5) << l << " " << i;
    for (size_t i = 0; i < x.r_v.size(); ++i)
      ASSERT_NEAR(x.r_v[i], y.r_v[i], 1e-5) << l << " " << i;
  }
}

TEST_P(PolicyParityTest, SameBlocksEpochsBasesAndOutliers) {
  const Case& k = GetParam();
  CompressedKvCacheConfig c = CpuConfig(64, CoeffDtype::kFp16);
  c.policy.outlier_threshold = k.outlier_threshold;
  c.policy.per_sequence_pca = k.per_sequence_pca;
  c.capacity_bytes = 1024 * CompressedKvCache::PageBytes(c.geometry, c.block_size, c.full_dtype);
  // No installed basis: both caches self-calibrate.
  Pair p = MakePair(c, /*num_pages=*/512, /*basis_capacity=*/4);
  ASSERT_NE(p.dev, nullptr);
  const int n_layers = c.geometry.n_layers;
  const int bs = c.block_size;

  for (int run = 0; run < 2; ++run) {  // a second sequence: shared default or its own epoch
    const cache_test::Data d =
        cache_test::RandomKv(c.geometry, k.tokens, static_cast<uint32_t>(rng_()));
    const SeqId cs = *p.cpu->CreateSequence();
    const SeqId ds = *p.dev->CreateSequence();
    int64_t at = 0;
    for (int64_t to : k.steps) {
      ASSERT_NO_FATAL_FAILURE(cache_test::Append(*p.cpu, cs, d, at, to));
      ASSERT_NO_FATAL_FAILURE(AppendDevice(*p.dev, *p.store, ds, d, at, to));
      at = to;
      // Blocks: the sink/window rule, in every layer alike.
      const std::span<const DeviceCompressedKvCache::Block> table = p.dev->BlockTable(ds);
      const BlockRange want = c.policy.CompressibleBlocks(0, to, bs);
      for (int64_t b = 0; b < static_cast<int64_t>(table.size()); ++b) {
        const bool dev_coded = table[static_cast<size_t>(b)].slot != kernels::kFullBlock;
        EXPECT_EQ(dev_coded, b >= want.begin && b < want.end) << "block " << b << " at " << to;
        for (int l = 0; l < n_layers; ++l) {
          EXPECT_EQ(p.cpu->IsCompressed(cs, l, b), dev_coded)
              << "layer " << l << " block " << b << " at " << to;
        }
      }
      // Outliers: the device keeps a token full-rank when the CPU cache does in any layer.
      const std::span<const int64_t> dev_out = p.dev->OutlierPositions(ds);
      EXPECT_EQ(std::vector<int64_t>(dev_out.begin(), dev_out.end()),
                UnionOfOutliers(*p.cpu, cs, n_layers))
          << "at " << to;
    }
    // Epochs: the same one codes every block, built by the same rule.
    ASSERT_NE(p.cpu->SequenceEpoch(cs), kNoEpoch);
    ASSERT_NE(p.dev->SequenceEpoch(ds), kNoEpoch);
    const Basis* cpu_basis = p.cpu->registry().Get(p.cpu->SequenceEpoch(cs));
    const Basis* dev_basis = p.dev->registry().Get(p.dev->SequenceEpoch(ds));
    ASSERT_NE(cpu_basis, nullptr);
    ASSERT_NE(dev_basis, nullptr);
    ASSERT_NO_FATAL_FAILURE(ExpectSameBasis(*cpu_basis, *dev_basis));
    const CompressedKvCacheDetail cd = p.cpu->Detail();
    const DeviceCompressedKvCacheDetail dd = p.dev->Detail();
    EXPECT_EQ(cd.pca_epochs_built, dd.pca_epochs_built);
    EXPECT_EQ(cd.pca_epochs_built, k.per_sequence_pca ? run + 1 : 1);
    EXPECT_EQ(cd.default_self_calibrated, dd.default_self_calibrated);
    EXPECT_EQ(cd.default_self_calibrated, !k.per_sequence_pca);
    EXPECT_EQ(p.cpu->default_epoch() == kNoEpoch, p.dev->default_epoch() == kNoEpoch);
    EXPECT_EQ(p.cpu->Stats().tokens_cached, p.dev->Stats().tokens_cached);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PolicyParityTest,
    ::testing::Values(
        Case{"short_prefill_then_decodes", 200, {37, 90, 91, 92, 120, 121, 150, 200}, 1.0f, false},
        // 1,600 tokens: more blocks than kPcaMaxTokens / B, so calibration samples every 2nd.
        Case{"long_prefill_strided_calibration", 1600, {1200, 1500, 1501, 1600}, 1.0f, false},
        Case{"outliers", 300, {120, 121, 200, 201, 300}, 0.9f, false},
        Case{"per_sequence_pca", 300, {150, 151, 300}, 1.0f, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace subspace::cuda
