// The CPU twin of decode_attention.cu, checked two ways so that the reference the GPU kernels
// are held to is itself verified on any machine: against dense double-precision attention over
// the keys and values each token presents (k^ = P_q c, v^ = R_v^T u; full rows as stored), and
// against CompressedKvCache::Attend on the same tokens (sinks, window, outliers, two epochs).
#include "tests/kernels/decode_attention_ref.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <span>
#include <tuple>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/compress/compressed_kv_cache.h"
#include "cuda/decode_plan_builder.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/kernels/compress_blocks_ref.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

using testing::DecodeCase;
using testing::DenseAttention;
using testing::RelError;

DecodeAttentionParams HostParams(const DecodeCase& c, const cuda::DecodePlan& plan, float* out) {
  DecodeAttentionParams p;
  p.layout = c.layout;
  p.plan = plan.HostView();
  p.pool = c.pool.data();
  p.basis_pq = c.bases.p_q.data();
  p.basis_rv = c.bases.r_v.data();
  p.q = c.q.data();
  p.out = out;
  p.n_heads = c.n_heads;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(c.layout.head_dim));
  return p;
}

// head_dim, block size, coefficient dtype, rank (r_k = r_v).
using Shape = std::tuple<int, int, CoeffDtype, int>;

class DecodeAttentionRefTest : public ::testing::TestWithParam<Shape> {};

TEST_P(DecodeAttentionRefTest, MatchesDenseAttentionOverReconstructedKeys) {
  const auto [hd, bs, dt, rank] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const KvPoolLayout layout = MakeKvPoolLayout(2, hd, bs, rank, rank, dt);
  ASSERT_EQ(KvPoolLayoutError(layout), nullptr);
  testing::DecodeCaseOptions options;
  options.min_seq_epochs = 2;
  const DecodeCase c = testing::RandomDecodeCase(layout, /*batch=*/7, options, rng);
  absl::StatusOr<cuda::DecodePlan> plan =
      cuda::BuildDecodePlan(layout, c.num_pages, c.bases.n_epochs, c.seqs, {.blocks_per_split = 3});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GT(plan->layout.max_seq_epochs, 1) << "want sequences with several epochs";

  std::vector<float> out(c.q.size(), std::nanf(""));
  DecodeAttentionRef(HostParams(c, *plan, out.data()));
  const std::vector<double> dense = DenseAttention(c);
  // Both in double over the same stored bytes; the twin rounds its output to float once.
  for (size_t row = 0; row < out.size() / hd; ++row) {
    EXPECT_LT(RelError(out.data() + row * hd, dense.data() + row * hd, hd), 1e-6)
        << "sequence " << row / c.n_heads << " head " << row % c.n_heads;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DecodeAttentionRefTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(8, 16, 32),
                                            ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8),
                                            ::testing::Values(8, 32)),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return "d" + std::to_string(std::get<0>(info.param)) + "_b" +
                                  std::to_string(std::get<1>(info.param)) + "_" +
                                  CoeffDtypeName(std::get<2>(info.param)) + "_r" +
                                  std::to_string(std::get<3>(info.param));
                         });

// A sliding window: every row before a sequence's window start (block rows, compressed rows
// and outliers alike) is left out of the softmax, as dense attention over the window does.
TEST_P(DecodeAttentionRefTest, SlidingWindowMatchesDenseAttentionOverTheWindow) {
  const auto [hd, bs, dt, rank] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const KvPoolLayout layout = MakeKvPoolLayout(2, hd, bs, rank, rank, dt);
  testing::DecodeCaseOptions options;
  options.p_outlier = 0.2;  // outliers on both sides of the windows' starts
  DecodeCase c = testing::RandomDecodeCase(layout, /*batch=*/7, options, rng);
  for (cuda::DecodeSeqDesc& d : c.seqs) {
    d.window_start = std::uniform_int_distribution<int64_t>(0, d.length - 1)(rng);
  }
  c.seqs[0].window_start = c.seqs[0].length - 1;  // the newest token alone
  absl::StatusOr<cuda::DecodePlan> plan =
      cuda::BuildDecodePlan(layout, c.num_pages, c.bases.n_epochs, c.seqs, {.blocks_per_split = 2});
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<float> out(c.q.size(), std::nanf(""));
  DecodeAttentionRef(HostParams(c, *plan, out.data()));
  const std::vector<double> dense = DenseAttention(c);
  for (size_t row = 0; row < out.size() / hd; ++row) {
    EXPECT_LT(RelError(out.data() + row * hd, dense.data() + row * hd, hd), 1e-6)
        << "sequence " << row / c.n_heads << " head " << row % c.n_heads;
  }
}

// The twin against the CPU cache itself: the same tokens written to a CompressedKvCache
// (sinks, window, outlier detection, a change of epoch half-way) and to a twin pool whose
// compressed blocks hold the cache's own codes. Differences: float vs double arithmetic.
class DecodeAttentionRefVsCacheTest : public ::testing::TestWithParam<std::tuple<int, CoeffDtype>> {
};

TEST_P(DecodeAttentionRefVsCacheTest, MatchesCompressedKvCacheAttend) {
  // Not a structured binding: the lambdas below capture hd, which clang refuses for bindings.
  const int hd = std::get<0>(GetParam());
  const CoeffDtype dt = std::get<1>(GetParam());
  const int n_kv = 2, group = 3, n_heads = n_kv * group, bs = 16, rk = 16, rv = 12;
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const KvCacheGeometry g{1, n_kv, hd};
  CompressedKvCacheConfig cfg;
  cfg.geometry = g;
  cfg.block_size = bs;
  cfg.policy.sink_tokens = 4;
  cfg.policy.window_tokens = 2 * bs;
  cfg.policy.outlier_threshold = 0.5f;
  cfg.policy.r_k = {rk};
  cfg.policy.r_v = {rv};
  cfg.policy.coeff_dtype = dt;
  cfg.full_dtype = CoeffDtype::kFp16;
  cfg.capacity_bytes = CompressedKvCache::PageBytes(g, bs, CoeffDtype::kFp16) * 256;
  auto cache = CompressedKvCache::Create(cfg);
  ASSERT_TRUE(cache.ok()) << cache.status();
  CompressedKvCache& kv = **cache;
  const uint32_t basis_seed = static_cast<uint32_t>(rng());
  std::shared_ptr<Basis> bases[2] = {cache_test::OrthoBasis(g, rk, rv, basis_seed),
                                     cache_test::OrthoBasis(g, rk, rv, basis_seed + 1)};
  EpochId ids[2];
  for (int e = 0; e < 2; ++e) {
    absl::StatusOr<EpochId> id = kv.InstallBasis(bases[e]);
    ASSERT_TRUE(id.ok());
    ids[e] = *id;
  }
  ASSERT_TRUE(kv.SetDefaultEpoch(ids[0]).ok());
  absl::StatusOr<SeqId> seq = kv.CreateSequence();
  ASSERT_TRUE(seq.ok());

  // Keys mostly inside the key subspace of the epoch current when they are written (small
  // residual), some anywhere (outliers); blocks written under epoch 0 but compressed under
  // epoch 1 become mostly outliers. Values anywhere. [T, n_kv, hd]
  const int64_t T = 12 * bs + 5;
  cache_test::Data d = cache_test::RandomKv(g, T, static_cast<uint32_t>(rng()));
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    if (uni(rng) < 0.1) continue;
    for (int h = 0; h < n_kv; ++h) {
      const Basis& basis = *bases[t < 7 * bs ? 0 : 1];
      const float* u = basis.layers[0].p_k.data() + static_cast<int64_t>(h) * hd * rk;
      std::vector<float> a(rk);
      for (float& x : a) x = normal(rng) * std::sqrt(static_cast<float>(hd) / rk);
      float* k = d.k[0].data() + (t * n_kv + h) * hd;
      for (int i = 0; i < hd; ++i) {
        k[i] = 0.01f * normal(rng);
        for (int j = 0; j < rk; ++j) k[i] += u[i * rk + j] * a[j];
      }
    }
  }
  cache_test::Append(kv, *seq, d, 0, 7 * bs);
  ASSERT_TRUE(kv.SetSequenceEpoch(*seq, ids[1]).ok());
  cache_test::Append(kv, *seq, d, 7 * bs, T);

  // The twin's pool: block b's fp16 rows on page b; compressed blocks coded into slots of the
  // pages after them; outlier rows on the pages after those.
  const KvPoolLayout layout = MakeKvPoolLayout(n_kv, hd, bs, rk, rv, dt);
  const int64_t nb = (T + bs - 1) / bs;
  const std::span<const int64_t> outliers = kv.OutlierPositions(*seq, 0);
  ASSERT_FALSE(outliers.empty()) << "the scenario should produce outliers";
  const int64_t slab_pages = (nb + layout.SlotsPerPage() - 1) / layout.SlotsPerPage();
  const int64_t out_pages = (static_cast<int64_t>(outliers.size()) + bs - 1) / bs;
  const int64_t num_pages = nb + slab_pages + out_pages;
  std::vector<uint8_t> pool(static_cast<size_t>(num_pages * layout.page_bytes), testing::kPoison);
  const auto put_row = [&](int64_t src_t, int32_t page, int t) {
    for (int h = 0; h < n_kv; ++h) {
      auto* k = reinterpret_cast<uint16_t*>(pool.data() + layout.FullK(page, h)) + t * hd;
      auto* v = reinterpret_cast<uint16_t*>(pool.data() + layout.FullV(page, h)) + t * hd;
      for (int i = 0; i < hd; ++i) {
        k[i] = Fp32ToFp16(d.k[0][(src_t * n_kv + h) * hd + i]);
        v[i] = Fp32ToFp16(d.v[0][(src_t * n_kv + h) * hd + i]);
      }
    }
  };
  for (int64_t t = 0; t < T; ++t)
    put_row(t, static_cast<int32_t>(t / bs), static_cast<int>(t % bs));

  cuda::DecodeSeqDesc desc;
  desc.length = T;
  std::vector<int32_t> src, dst_page, dst_slot, epochs;
  int compressed = 0;
  std::set<int> epochs_seen;
  for (int64_t b = 0; b < nb; ++b) {
    if (!kv.IsCompressed(*seq, 0, b)) {
      desc.pages.push_back(static_cast<int32_t>(b));
      desc.slots.push_back(kFullBlock);
      desc.epochs.insert(desc.epochs.end(), n_kv, -1);
      continue;
    }
    const int32_t page = static_cast<int32_t>(nb + compressed / layout.SlotsPerPage());
    const int32_t slot = compressed % layout.SlotsPerPage();
    ++compressed;
    desc.pages.push_back(page);
    desc.slots.push_back(slot);
    src.push_back(static_cast<int32_t>(b));
    dst_page.push_back(page);
    dst_slot.push_back(slot);
    for (int h = 0; h < n_kv; ++h) {
      const int e = kv.BlockEpoch(*seq, 0, b, h) == ids[0] ? 0 : 1;
      epochs_seen.insert(e);
      desc.epochs.push_back(e);
      epochs.push_back(e);
    }
  }
  ASSERT_EQ(epochs_seen.size(), 2u) << "blocks of both epochs expected";
  desc.outlier_masks.assign(static_cast<size_t>(nb), 0);
  for (size_t j = 0; j < outliers.size(); ++j) {
    desc.outlier_masks[static_cast<size_t>(outliers[j] / bs)] |= uint64_t{1} << (outliers[j] % bs);
    if (j % bs == 0) desc.outlier_pages.push_back(static_cast<int32_t>(nb + slab_pages + j / bs));
    put_row(outliers[j], desc.outlier_pages.back(), static_cast<int>(j % bs));
  }
  desc.n_outliers = static_cast<int64_t>(outliers.size());

  // Basis table: epoch e of the twin is ids[e] of the cache.
  std::vector<float> pk, pv, pq, rvm;
  for (const auto& b : bases) {
    const LayerBasis& lb = b->layers[0];
    pk.insert(pk.end(), lb.p_k.begin(), lb.p_k.end());
    pv.insert(pv.end(), lb.p_v.begin(), lb.p_v.end());
    pq.insert(pq.end(), lb.p_q.begin(), lb.p_q.end());
    rvm.insert(rvm.end(), lb.r_v.begin(), lb.r_v.end());
  }
  CompressBlocksParams cp;
  cp.layout = layout;
  cp.pool = pool.data();
  cp.basis_pk = pk.data();
  cp.basis_pv = pv.data();
  cp.src_page = src.data();
  cp.dst_page = dst_page.data();
  cp.dst_slot = dst_slot.data();
  cp.epoch = epochs.data();
  cp.n_blocks = static_cast<int32_t>(src.size());
  ASSERT_TRUE(CheckCompressBatch(cp, num_pages, 2).ok());
  CompressBlocksRef(cp);
  // Then the cache's own codes over the twin's: each block's slot is the one among the cache's
  // slab slots closest to the twin's coding of it (core projects in float, the twin in double,
  // so a few codes round apart). What is left to differ is attention arithmetic alone.
  std::vector<const uint8_t*> candidates;
  for (int32_t page = 0; page < kv.pool().num_blocks(); ++page) {
    if (!kv.pool().in_use(page) || kv.pool().kind(page) != BlockKind::kCompressed) continue;
    const auto* base = reinterpret_cast<const uint8_t*>(kv.pool().data(page));
    for (int i = 0; i < layout.SlotsPerPage(); ++i) {
      candidates.push_back(base + static_cast<int64_t>(i) * layout.slot_bytes);
    }
  }
  std::set<const uint8_t*> taken;
  for (size_t i = 0; i < src.size(); ++i) {
    uint8_t* mine = pool.data() + layout.Slot(dst_page[i], dst_slot[i]);
    const uint8_t* best = nullptr;
    int64_t best_diff = layout.CompressedBytes() + 1;
    for (const uint8_t* c : candidates) {
      int64_t diff = 0;
      for (int64_t k = 0; k < layout.CompressedBytes(); ++k) diff += c[k] != mine[k];
      if (diff < best_diff) {
        best_diff = diff;
        best = c;
      }
    }
    ASSERT_LT(best_diff, layout.CompressedBytes() / 10) << "block " << src[i] << " not found";
    ASSERT_TRUE(taken.insert(best).second) << "two blocks matched one slot";
    std::memcpy(mine, best, static_cast<size_t>(layout.CompressedBytes()));
  }

  absl::StatusOr<cuda::DecodePlan> plan =
      cuda::BuildDecodePlan(layout, num_pages, 2, std::span<const cuda::DecodeSeqDesc>(&desc, 1));
  ASSERT_TRUE(plan.ok()) << plan.status();

  std::vector<float> q(static_cast<size_t>(n_heads) * hd);
  for (float& x : q) x = normal(rng);
  const std::vector<float> expected = cache_test::RunAttend(kv, 0, *seq, T - 1, 1, q, n_heads);
  std::vector<float> out(q.size(), std::nanf(""));
  DecodeAttentionParams p;
  p.layout = layout;
  p.plan = plan->HostView();
  p.pool = pool.data();
  p.basis_pq = pq.data();
  p.basis_rv = rvm.data();
  p.q = q.data();
  p.out = out.data();
  p.n_heads = n_heads;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(hd));
  DecodeAttentionRef(p);
  for (int h = 0; h < n_heads; ++h) {
    EXPECT_LT(RelError(out.data() + h * hd, expected.data() + h * hd, hd), 1e-5) << "head " << h;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DecodeAttentionRefVsCacheTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(CoeffDtype::kFp16,
                                                              CoeffDtype::kInt8)),
                         [](const ::testing::TestParamInfo<std::tuple<int, CoeffDtype>>& info) {
                           return "d" + std::to_string(std::get<0>(info.param)) + "_" +
                                  CoeffDtypeName(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace subspace::kernels
