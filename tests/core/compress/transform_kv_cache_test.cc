// The transform-coded KV cache against an independent reference: attention in double over rows
// as the cache must hold them (fp16 for the sinks and the window, the codec's round trip of the
// key -- rotated back and forth when coded before RoPE -- and of the value for every coded
// block), after chunked commits, a truncation into a coded block and new tokens after it; keys
// coded before and after RoPE (decoded, or scored in code space), codes with and without an
// error metric, blocks narrower and wider than the kernels' eight codes; and its accounting.
// With online refresh: blocks coded by several epochs, each read with its own codes, the
// compactor's second rounding, and epochs retired with their last block.
#include "core/compress/transform_kv_cache.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"
#include "core/cpu/ops.h"
#include "gtest/gtest.h"
#include "tests/core/compress/transform_kv_cache_test_util.h"

namespace subspace {
namespace {

using namespace transform_cache_test;  // NOLINT(build/namespaces): this test family's helpers

class TransformKvCacheVariantTest : public ::testing::TestWithParam<Variant> {};

TEST_P(TransformKvCacheVariantTest, AttentionMatchesTheCodedReferenceOverChunkedCommits) {
  std::mt19937 rng(7);
  Fixture f = Make(40, 11, GetParam());
  const SeqId seq = *f.cache->CreateSequence();
  ASSERT_TRUE(f.cache->Reserve(seq, 40).ok());
  WriteTokens(f, seq, 0, 20, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 20).ok());
  // Blocks past the sinks that end at or before 20 - W = 12: 1 and 2.
  for (int64_t b = 0; b < 5; ++b) EXPECT_EQ(f.cache->IsCoded(seq, 1, b), b == 1 || b == 2) << b;
  for (int64_t b : {1, 2}) CodeReferenceBlock(f, b);
  ExpectAttentionMatches(f, seq, 17, 3, rng);  // a prefill-like chunk over coded blocks

  WriteTokens(f, seq, 20, 20, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 40).ok());
  for (int64_t b = 3; b < 8; ++b) CodeReferenceBlock(f, b);
  EXPECT_EQ(f.cache->Detail().blocks_coded, 7 * kLayers);
  ExpectAttentionMatches(f, seq, 39, 1, rng);  // decode

  const KvCacheStats st = f.cache->Stats();
  EXPECT_EQ(st.tokens_cached, 40);
  EXPECT_GT(st.bytes_used_compressed, 0);
  EXPECT_EQ(st.bytes_used_full, 3 * kLayers * TransformKvCache::PageBytes(Geometry(), kBlock));
  int64_t coded = 0;
  for (int l = 0; l < kLayers; ++l) coded += 7 * ((f.cache->CodedBlockBytes(l) + 15) / 16 * 16);
  EXPECT_EQ(f.cache->Detail().coded_slot_bytes, coded);
  // A coded block is far smaller than its fp16 page: ~2.5 bits a value against 16.
  EXPECT_LT(f.cache->CodedBlockBytes(0), TransformKvCache::PageBytes(Geometry(), kBlock) / 4);
  ASSERT_TRUE(f.cache->FreeSequence(seq).ok());
  EXPECT_EQ(f.cache->pool().num_free(), f.cache->pool().num_blocks());
}

TEST_P(TransformKvCacheVariantTest, TruncationIntoACodedBlockDecodesItAndTokensFollow) {
  std::mt19937 rng(3);
  Fixture f = Make(40, 5, GetParam());
  const SeqId seq = *f.cache->CreateSequence();
  ASSERT_TRUE(f.cache->Reserve(seq, 40).ok());
  WriteTokens(f, seq, 0, 40, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 40).ok());
  for (int64_t b = 1; b < 8; ++b) CodeReferenceBlock(f, b);
  // Block 5 holds 20..23: cut at 22, decoded back into a full page at fp16.
  ASSERT_TRUE(f.cache->Truncate(seq, 22).ok());
  EXPECT_FALSE(f.cache->IsCoded(seq, 0, 5));
  EXPECT_TRUE(f.cache->IsCoded(seq, 0, 4));
  for (int l = 0; l < kLayers; ++l) {
    for (size_t i = 20 * kKv * kDim; i < 22 * kKv * kDim; ++i) {
      f.k_ref[l][i] = Fp16(f.k_ref[l][i]);
      f.v_ref[l][i] = Fp16(f.v_ref[l][i]);
    }
  }
  ASSERT_TRUE(f.cache->Reserve(seq, 6).ok());
  WriteTokens(f, seq, 22, 6, rng);
  ExpectAttentionMatches(f, seq, 22, 6, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 28).ok());
  EXPECT_EQ(f.cache->Length(seq), 28);
}

INSTANTIATE_TEST_SUITE_P(KeysAndMetric, TransformKvCacheVariantTest, Variants(), VariantName);

// Blocks of 16 tokens: whole groups of eight codes (the kernels' vector path), several blocks
// coded per commit, split-KV decode and a prefill chunk, keys both ways.
TEST(TransformKvCacheTest, WideBlocksMatchTheReferenceBothWays) {
  for (const bool pre_rope : {true, false}) {
    SCOPED_TRACE(pre_rope ? "pre-RoPE keys" : "post-RoPE keys");
    std::mt19937 rng(13);
    const Variant v{.pre_rope = pre_rope, .weighted = true, .block = 16, .sinks = 16, .window = 32};
    const int64_t tokens = 16 * 40;
    Fixture f = Make(tokens, 21, v, 400);
    const SeqId seq = *f.cache->CreateSequence();
    ASSERT_TRUE(f.cache->Reserve(seq, tokens).ok());
    WriteTokens(f, seq, 0, tokens - 5, rng);
    ASSERT_TRUE(f.cache->Commit(seq, tokens - 5).ok());
    // Blocks past the sink that end at or before (tokens - 5) - 32.
    int64_t coded = 0;
    for (int64_t b = 1; (b + 1) * 16 <= tokens - 5 - 32; ++b, ++coded) {
      ASSERT_TRUE(f.cache->IsCoded(seq, 0, b)) << b;
      CodeReferenceBlock(f, b);
    }
    EXPECT_EQ(f.cache->Detail().blocks_coded, coded * kLayers);
    ExpectAttentionMatches(f, seq, tokens - 6, 1, rng);  // decode
    WriteTokens(f, seq, tokens - 5, 5, rng);
    ExpectAttentionMatches(f, seq, tokens - 5, 5, rng);  // a chunk of five
  }
}

// Follows the codes each coded block holds and applies every new one to the reference once:
// a block coded by an epoch, or re-coded into another by the compactor.
class EpochTracker {
 public:
  // Returns the distinct epochs the sequence's coded blocks hold.
  std::set<int32_t> Update(Fixture& f, SeqId seq) {
    std::set<int32_t> epochs;
    const int64_t blocks = (f.cache->Length(seq) + f.variant.block - 1) / f.variant.block;
    for (int l = 0; l < kLayers; ++l) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int32_t epoch = f.cache->BlockEpoch(seq, l, b);
        if (epoch < 0) continue;
        epochs.insert(epoch);
        const TransformCodes* codes = f.cache->EpochCodes(epoch);
        EXPECT_NE(codes, nullptr) << epoch;
        // Held here, so a retired epoch's vectors cannot be reused at the same address.
        TransformCodes& seen = seen_[{l, b}];
        if (seen.keys == codes->keys) continue;
        seen = *codes;
        RecodeReference(f, l, b, *codes->keys, *codes->values);
      }
    }
    return epochs;
  }
  // Blocks from `block` on are written anew.
  void Forget(int64_t block) {
    for (auto it = seen_.begin(); it != seen_.end();) {
      it = it->first.second >= block ? seen_.erase(it) : std::next(it);
    }
  }

 private:
  std::map<std::pair<int, int64_t>, TransformCodes> seen_;
};

// Rows unlike the calibration's (independent dims, another mean) make the refresher fit new
// codes every 16 coded tokens; each block is read with the codes that coded it, through decode,
// a prefill chunk, a truncation into a block of a refreshed epoch and tokens after it.
TEST_P(TransformKvCacheVariantTest, RefreshedEpochsCodeNewBlocksAndEachIsReadWithItsOwn) {
  std::mt19937 rng(17);
  Fixture f = Make(120, 11, GetParam(), 200, Refresh(/*max_epochs=*/16));
  const SeqId seq = *f.cache->CreateSequence();
  ASSERT_TRUE(f.cache->Reserve(seq, 120).ok());
  EpochTracker tracker;
  std::set<int32_t> epochs;
  for (int64_t pos = 0; pos < 100; pos += 8) {
    WriteTokens(f, seq, pos, 8, rng);
    ASSERT_TRUE(f.cache->Commit(seq, pos + 8).ok());
    epochs = tracker.Update(f, seq);
  }
  const KvCacheStats st = f.cache->Stats();
  EXPECT_GE(st.refresh.installed, 3);
  EXPECT_EQ(st.refresh.failures, 0);
  EXPECT_EQ(st.refresh.blocks_reprojected, 0);  // 16 epochs allowed: nothing re-coded
  EXPECT_GE(epochs.size(), 3u);
  EXPECT_TRUE(epochs.contains(0));  // the first blocks, coded before any refresh
  EXPECT_EQ(st.epochs_live, static_cast<int64_t>(epochs.size()) +
                                (epochs.contains(f.cache->BlockEpoch(seq, 0, 20)) ? 0 : 1));
  // Every refreshed code's run of a block is no longer than the codec file's: blocks fit its
  // slots (at B = 4 a 3-bit component costs what a 4-bit one does, so bits may grow).
  const auto run = [&](const TransformCode& c) {
    return LayOutCodedRun(c, GetParam().block).run_bytes;
  };
  for (int32_t e : epochs) {
    const TransformCodes* codes = f.cache->EpochCodes(e);
    for (size_t i = 0; i < codes->keys->size(); ++i) {
      EXPECT_LE(run((*codes->keys)[i]), run((*f.kc)[i]));
      EXPECT_LE(run((*codes->values)[i]), run((*f.vc)[i]));
    }
  }
  EXPECT_EQ(f.cache->Detail().refreshes_unplaced, 0);
  ExpectAttentionMatches(f, seq, 99, 1, rng);  // decode
  ExpectAttentionMatches(f, seq, 93, 7, rng);  // a chunk

  // Cut inside a block of a refreshed epoch: decoded with its codes, then new tokens follow.
  const int bs = GetParam().block;
  int64_t cut_block = -1;
  for (int64_t b = 1; b * bs < 90; ++b) {
    if (f.cache->BlockEpoch(seq, 0, b) > 0 && f.cache->BlockEpoch(seq, 1, b) > 0) cut_block = b;
  }
  ASSERT_GE(cut_block, 0);
  const int64_t cut = cut_block * bs + bs / 2;
  ASSERT_TRUE(f.cache->Truncate(seq, cut).ok());
  EXPECT_FALSE(f.cache->IsCoded(seq, 0, cut_block));
  for (int l = 0; l < kLayers; ++l) {
    for (size_t i = cut_block * bs * kKv * kDim; i < static_cast<size_t>(cut) * kKv * kDim; ++i) {
      f.k_ref[l][i] = Fp16(f.k_ref[l][i]);
      f.v_ref[l][i] = Fp16(f.v_ref[l][i]);
    }
  }
  tracker.Forget(cut_block);
  ASSERT_TRUE(f.cache->Reserve(seq, 120 - cut).ok());
  WriteTokens(f, seq, cut, 120 - cut, rng);
  ExpectAttentionMatches(f, seq, cut, 6, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 120).ok());
  tracker.Update(f, seq);
  ExpectAttentionMatches(f, seq, 119, 1, rng);

  // Freed, every refreshed epoch goes with it.
  ASSERT_TRUE(f.cache->FreeSequence(seq).ok());
  EXPECT_EQ(f.cache->Stats().epochs_live, 1);
  EXPECT_EQ(f.cache->pool().num_free(), f.cache->pool().num_blocks());
}

// max_epochs 2: the compactor re-codes blocks of older epochs into the current one (a second
// rounding the reference follows), so once it has caught up no layer holds more than two.
TEST_P(TransformKvCacheVariantTest, CompactorKeepsAtMostMaxEpochsPerLayer) {
  std::mt19937 rng(23);
  Fixture f = Make(160, 11, GetParam(), 200, Refresh(/*max_epochs=*/2));
  const SeqId seq = *f.cache->CreateSequence();
  ASSERT_TRUE(f.cache->Reserve(seq, 160).ok());
  EpochTracker tracker;
  for (int64_t pos = 0; pos < 160; pos += 8) {
    WriteTokens(f, seq, pos, 8, rng);
    ASSERT_TRUE(f.cache->Commit(seq, pos + 8).ok());
    tracker.Update(f, seq);
    // The compactor re-codes 32 block-layers a Commit: commits of nothing new let it catch up.
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(f.cache->Commit(seq, pos + 8).ok());
      tracker.Update(f, seq);
    }
    for (int l = 0; l < kLayers; ++l) {
      std::set<int32_t> layer_epochs;
      for (int64_t b = 0; b * GetParam().block < pos + 8; ++b) {
        if (const int32_t e = f.cache->BlockEpoch(seq, l, b); e >= 0) layer_epochs.insert(e);
      }
      ASSERT_LE(layer_epochs.size(), 2u) << "layer " << l << " at " << pos + 8;
    }
  }
  const KvCacheStats st = f.cache->Stats();
  EXPECT_GE(st.refresh.installed, 4);
  EXPECT_GT(st.refresh.blocks_reprojected, 0);
  // Retired as the compactor empties them: the codec file's, at most two per layer.
  EXPECT_LE(st.epochs_live, 1 + 2 * kLayers);
  EXPECT_LT(st.epochs_live, 1 + st.refresh.installed);
  ExpectAttentionMatches(f, seq, 159, 1, rng);
  ExpectAttentionMatches(f, seq, 150, 10, rng);
  ASSERT_TRUE(f.cache->FreeSequence(seq).ok());
  EXPECT_EQ(f.cache->Stats().epochs_live, 1);
}

TEST(TransformKvCacheTest, RefreshIsValidatedPerSequenceAndRunsOnTheRefreshersThread) {
  Fixture f = Make(80, 11);
  const SeqId seq = *f.cache->CreateSequence();
  for (RefreshMethod m : {RefreshMethod::kKqsvd, RefreshMethod::kOja, RefreshMethod::kFd}) {
    const absl::Status st = f.cache->SetSequenceRefresh(seq, {.method = m});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << RefreshMethodName(m);
    EXPECT_NE(st.message().find("by pca"), std::string::npos) << st.message();
  }
  RefreshConfig residual = Refresh(2);
  residual.residual_threshold = 0.1;
  EXPECT_EQ(f.cache->SetSequenceRefresh(seq, residual).code(), absl::StatusCode::kInvalidArgument);
  RefreshConfig never = Refresh(2);
  never.every_tokens = 0;
  EXPECT_EQ(f.cache->SetSequenceRefresh(seq, never).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.cache->SetSequenceRefresh(seq + 1, Refresh(2)).code(), absl::StatusCode::kNotFound);
  RefreshConfig bad_epochs = Refresh(0);
  EXPECT_EQ(TransformKvCache::Create(
                {.geometry = Geometry(),
                 .block_size = kBlock,
                 .key_codes = f.kc,
                 .value_codes = f.vc,
                 .capacity_bytes = 100 * TransformKvCache::PageBytes(Geometry(), kBlock),
                 .refresh = bad_epochs})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);

  // On the refresher's own thread this time: codes published while the engine goes on are
  // installed at a later Commit.
  Fixture g = Make(80, 11, {}, 200, Refresh(4), /*refresh_inline=*/false);
  const SeqId a = *g.cache->CreateSequence();
  const SeqId plain = *g.cache->CreateSequence();
  ASSERT_TRUE(g.cache->SetSequenceRefresh(plain, {}).ok());
  std::mt19937 rng(3);
  ASSERT_TRUE(g.cache->Reserve(a, 80).ok());
  ASSERT_TRUE(g.cache->Reserve(plain, 40).ok());
  WriteTokens(g, a, 0, 60, rng);
  ASSERT_TRUE(g.cache->Commit(a, 60).ok());
  WriteTokens(g, plain, 0, 40, rng);
  ASSERT_TRUE(g.cache->Commit(plain, 40).ok());
  g.cache->FlushRefresher();
  WriteTokens(g, a, 60, 8, rng);
  ASSERT_TRUE(g.cache->Commit(a, 68).ok());
  EXPECT_GE(g.cache->Stats().refresh.installed, 1);
  EXPECT_GT(g.cache->BlockEpoch(a, 0, 13), 0);  // 52..55, coded at 68 with a refreshed epoch
  EXPECT_EQ(g.cache->BlockEpoch(plain, 0, 3), 0);

  ASSERT_TRUE(g.cache->FreeSequence(a).ok());
  ASSERT_TRUE(g.cache->FreeSequence(plain).ok());
  EXPECT_EQ(g.cache->Stats().epochs_live, 1);
}

TEST(TransformKvCacheTest, RefusesCodesThatDoNotFitTheModel) {
  auto codes = FitCodes(3.0, 1);
  TransformKvCacheConfig c{.geometry = Geometry(),
                           .block_size = kBlock,
                           .key_codes = codes,
                           .value_codes = codes,
                           .capacity_bytes = 100 * TransformKvCache::PageBytes(Geometry(), kBlock)};
  EXPECT_TRUE(TransformKvCache::Create(c).ok());
  TransformKvCacheConfig few = c;
  few.value_codes =
      std::make_shared<const std::vector<TransformCode>>(codes->begin(), codes->end() - 1);
  const absl::Status st = TransformKvCache::Create(few).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("value codes"), std::string::npos) << st.message();
  TransformKvCacheConfig wide = c;
  wide.geometry.head_dim = 64;
  EXPECT_EQ(TransformKvCache::Create(wide).status().code(), absl::StatusCode::kInvalidArgument);
  TransformKvCacheConfig odd = c;
  odd.key_rope = *RopeSchedule::Make({.dim = kDim});
  odd.key_rope->dim = 3;
  EXPECT_EQ(TransformKvCache::Create(odd).status().code(), absl::StatusCode::kInvalidArgument);
  TransformKvCacheConfig small = c;
  small.capacity_bytes = TransformKvCache::PageBytes(Geometry(), kBlock);
  EXPECT_EQ(TransformKvCache::Create(small).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace subspace
