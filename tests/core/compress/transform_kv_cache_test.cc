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

namespace subspace {
namespace {

constexpr int kLayers = 2, kKv = 2, kHeads = 4, kDim = 32, kBlock = 4, kSinks = 4, kWindow = 8;

struct Variant {
  bool pre_rope = true;   // keys coded before RoPE
  bool weighted = false;  // codes fitted under a per-dim error metric (TransformCode::scale)
  int block = kBlock, sinks = kSinks, window = kWindow;
};

KvCacheGeometry Geometry() { return {.n_layers = kLayers, .n_kv_heads = kKv, .head_dim = kDim}; }

float Fp16(float x) { return HalfToFloat(Fp32ToFp16(x)); }

// Codes fitted on correlated random rows (a few strong directions, as real keys have), under a
// budget of `bits` per component, for every (layer, KV head).
std::shared_ptr<const std::vector<TransformCode>> FitCodes(double bits, uint32_t seed,
                                                           bool weighted = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<TransformStream> streams;
  for (int s = 0; s < kLayers * kKv; ++s) {
    const int rows = 400;
    std::vector<float> mix(kDim * kDim), x(static_cast<size_t>(rows) * kDim);
    for (float& m : mix) m = n01(rng) * 0.3f;
    for (int r = 0; r < rows; ++r) {
      std::vector<float> z(kDim);
      for (int i = 0; i < kDim; ++i) z[i] = n01(rng) * (i < 6 ? 3.0f : 0.3f);
      for (int j = 0; j < kDim; ++j) {
        float acc = 0.5f;
        for (int i = 0; i < kDim; ++i) acc += mix[i * kDim + j] * z[i];
        x[static_cast<size_t>(r) * kDim + j] = acc + z[j];
      }
    }
    std::vector<float> metric;
    for (int i = 0; weighted && i < kDim; ++i) metric.push_back(0.25f + (i % 5) * 0.5f);
    absl::StatusOr<TransformStream> st = AnalyzeStream(x.data(), rows, kDim, {}, metric);
    EXPECT_TRUE(st.ok()) << st.status();
    streams.push_back(*std::move(st));
  }
  const std::vector<int> widths = {0, 2, 3, 4, 8};
  absl::StatusOr<std::vector<TransformCode>> codes =
      AllocateTransformCodes(streams, widths, bits, /*joint=*/false);
  EXPECT_TRUE(codes.ok()) << codes.status();
  return std::make_shared<const std::vector<TransformCode>>(*std::move(codes));
}

struct Fixture {
  Variant variant;
  RopeSchedule rope;
  std::shared_ptr<const std::vector<TransformCode>> kc, vc;
  std::unique_ptr<TransformKvCache> cache;
  // What the cache must hold: [layer][pos][kv head][dim], post-RoPE keys.
  std::vector<std::vector<float>> k_ref, v_ref;
};

Fixture Make(int64_t tokens, uint32_t seed, const Variant& variant = {}, int64_t pages = 200,
             const RefreshConfig& refresh = {}, bool refresh_inline = true) {
  Fixture f;
  f.variant = variant;
  f.rope = *RopeSchedule::Make({.dim = kDim, .theta = 10000.0});
  f.kc = FitCodes(3.0, seed, variant.weighted);
  f.vc = FitCodes(2.0, seed + 1, variant.weighted);
  std::optional<RopeSchedule> key_rope;
  if (variant.pre_rope) key_rope = f.rope;
  absl::StatusOr<std::unique_ptr<TransformKvCache>> cache = TransformKvCache::Create(
      {.geometry = Geometry(),
       .block_size = variant.block,
       .sink_tokens = variant.sinks,
       .window_tokens = variant.window,
       .key_codes = f.kc,
       .value_codes = f.vc,
       .key_rope = key_rope,
       .capacity_bytes = pages * TransformKvCache::PageBytes(Geometry(), variant.block),
       .refresh = refresh,
       .refresh_inline = refresh_inline});
  EXPECT_TRUE(cache.ok()) << cache.status();
  f.cache = *std::move(cache);
  f.k_ref.assign(kLayers, std::vector<float>(static_cast<size_t>(tokens) * kKv * kDim));
  f.v_ref = f.k_ref;
  return f;
}

// Random K/V for positions [pos, pos + n) of every layer, written to the cache and, as stored
// full-rank (fp16), to the reference.
void WriteTokens(Fixture& f, SeqId seq, int64_t pos, int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> k(static_cast<size_t>(n) * kKv * kDim), v(k.size());
    for (float& x : k) x = n01(rng) * 2.0f + 0.5f;
    for (float& x : v) x = n01(rng);
    f.cache->Write(l, seq, pos, n, k.data(), v.data());
    for (size_t i = 0; i < k.size(); ++i) {
      f.k_ref[l][static_cast<size_t>(pos) * kKv * kDim + i] = Fp16(k[i]);
      f.v_ref[l][static_cast<size_t>(pos) * kKv * kDim + i] = Fp16(v[i]);
    }
  }
}

// Layer l's reference rows of block b after one more coding with `kc` / `vc`: the value's
// round trip; the key's, rotated back to before RoPE and forward again when coded before RoPE.
void RecodeReference(Fixture& f, int l, int64_t b, const std::vector<TransformCode>& kc,
                     const std::vector<TransformCode>& vc) {
  RopeSchedule unrope = f.rope;
  unrope.mscale = 1.0 / unrope.mscale;
  const int bs = f.variant.block;
  for (int64_t p = b * bs; p < (b + 1) * bs; ++p) {
    const int64_t neg = -p;
    float* k = f.k_ref[l].data() + p * kKv * kDim;
    float* v = f.v_ref[l].data() + p * kKv * kDim;
    if (f.variant.pre_rope) cpu::Rope(k, 1, kKv, kDim, unrope, &neg);
    for (int h = 0; h < kKv; ++h) {
      kc[static_cast<size_t>(l * kKv + h)].RoundTrip(k + h * kDim);
      vc[static_cast<size_t>(l * kKv + h)].RoundTrip(v + h * kDim);
    }
    if (f.variant.pre_rope) cpu::Rope(k, 1, kKv, kDim, f.rope, &p);
  }
}

// The reference's rows of block b as the codec file's codes code them, in every layer.
void CodeReferenceBlock(Fixture& f, int64_t b) {
  for (int l = 0; l < kLayers; ++l) RecodeReference(f, l, b, *f.kc, *f.vc);
}

// Attention in double of queries at [pos, pos + n) over the reference's rows [0, p].
std::vector<float> ReferenceAttend(const Fixture& f, int layer, int64_t pos, int64_t n,
                                   const std::vector<float>& q) {
  std::vector<float> out(q.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(kDim));
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < kHeads; ++h) {
      const int kvh = h / (kHeads / kKv);
      const float* qh = q.data() + (i * kHeads + h) * kDim;
      std::vector<double> w;
      double m = -1e300;
      for (int64_t p = 0; p <= pos + i; ++p) {
        const float* k = f.k_ref[layer].data() + (p * kKv + kvh) * kDim;
        double s = 0.0;
        for (int d = 0; d < kDim; ++d) s += static_cast<double>(qh[d]) * k[d];
        w.push_back(s * scale);
        m = std::max(m, w.back());
      }
      double sum = 0.0;
      for (double& x : w) sum += (x = std::exp(x - m));
      for (int d = 0; d < kDim; ++d) {
        double acc = 0.0;
        for (int64_t p = 0; p <= pos + i; ++p) {
          acc += w[static_cast<size_t>(p)] * f.v_ref[layer][(p * kKv + kvh) * kDim + d];
        }
        out[(i * kHeads + h) * kDim + d] = static_cast<float>(acc / sum);
      }
    }
  }
  return out;
}

void ExpectAttentionMatches(Fixture& f, SeqId seq, int64_t pos, int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> q(static_cast<size_t>(n) * kHeads * kDim), out(q.size());
    for (float& x : q) x = n01(rng);
    const AttentionRequest req{.seq = seq, .pos = pos, .n = n, .q = q.data(), .out = out.data()};
    f.cache->Attend(l, {&req, 1}, kHeads);
    const std::vector<float> want = ReferenceAttend(f, l, pos, n, q);
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_NEAR(out[i], want[i], 2e-4 * (1.0 + std::abs(want[i])))
          << "layer " << l << " element " << i << " (queries at " << pos << ")";
    }
  }
}

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

// Attention of the same random queries in every layer, on two caches: bitwise equal.
void ExpectSameAttention(Fixture& a, SeqId sa, Fixture& b, SeqId sb, int64_t pos, int64_t n,
                         uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> q(static_cast<size_t>(n) * kHeads * kDim), oa(q.size()), ob(q.size());
    for (float& x : q) x = n01(rng);
    const AttentionRequest ra{.seq = sa, .pos = pos, .n = n, .q = q.data(), .out = oa.data()};
    const AttentionRequest rb{.seq = sb, .pos = pos, .n = n, .q = q.data(), .out = ob.data()};
    a.cache->Attend(l, {&ra, 1}, kHeads);
    b.cache->Attend(l, {&rb, 1}, kHeads);
    ASSERT_EQ(oa, ob) << "layer " << l;
  }
}

// An exported sequence imported into another cache with the same codes: the same blocks coded,
// bitwise the same attention, and after more tokens on both, the same image again.
TEST_P(TransformKvCacheVariantTest, ImageRestoresTheSequenceBitwise) {
  Fixture f = Make(60, 11, GetParam());
  const SeqId seq = *f.cache->CreateSequence();
  std::mt19937 rng(5);
  ASSERT_TRUE(f.cache->Reserve(seq, 37).ok());
  WriteTokens(f, seq, 0, 20, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 20).ok());
  WriteTokens(f, seq, 20, 17, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 37).ok());  // sinks, coded blocks, the window, a partial block
  absl::StatusOr<std::string> image = f.cache->ExportSequence(seq);
  ASSERT_TRUE(image.ok()) << image.status();

  Fixture g = Make(60, 11, GetParam());
  const int64_t free_before = g.cache->pool().num_free();
  absl::StatusOr<SeqId> copy = g.cache->ImportSequence(*image);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(g.cache->Length(*copy), 37);
  for (int l = 0; l < kLayers; ++l) {
    for (int64_t b = 0; b < 10; ++b) {
      EXPECT_EQ(g.cache->IsCoded(*copy, l, b), f.cache->IsCoded(seq, l, b)) << l << " " << b;
    }
  }
  EXPECT_EQ(g.cache->Stats().bytes_used_compressed, f.cache->Stats().bytes_used_compressed);
  ExpectSameAttention(f, seq, g, *copy, 36, 1, 21);
  // The storage form (codes range-coded) restores the same sequence: its image is the stored
  // form's, byte for byte.
  absl::StatusOr<std::string> compact = f.cache->CompactImage(*image);
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_NE(*compact, *image);
  EXPECT_EQ(*g.cache->CompactImage(*compact), *compact);  // already compact: as it is
  absl::StatusOr<SeqId> from_compact = g.cache->ImportSequence(*compact);
  ASSERT_TRUE(from_compact.ok()) << from_compact.status();
  EXPECT_EQ(*g.cache->ExportSequence(*from_compact), *image);
  ASSERT_TRUE(g.cache->FreeSequence(*from_compact).ok());

  // The same tokens on both: coding continues where it was.
  std::mt19937 rng_f(9), rng_g(9);
  for (auto [fx, s, r] : {std::tuple{&f, seq, &rng_f}, std::tuple{&g, *copy, &rng_g}}) {
    ASSERT_TRUE(fx->cache->Reserve(s, 12).ok());
    WriteTokens(*fx, s, 37, 12, *r);
    ASSERT_TRUE(fx->cache->Commit(s, 49).ok());
  }
  ExpectSameAttention(f, seq, g, *copy, 40, 9, 22);
  EXPECT_EQ(*g.cache->ExportSequence(*copy), *f.cache->ExportSequence(seq));
  ASSERT_TRUE(g.cache->FreeSequence(*copy).ok());
  EXPECT_EQ(g.cache->pool().num_free(), free_before);
}

TEST(TransformKvCacheTest, ImportRefusesDamagedOrForeignImagesAndLeaksNothing) {
  Fixture f = Make(40, 11);
  const SeqId seq = *f.cache->CreateSequence();
  std::mt19937 rng(5);
  ASSERT_TRUE(f.cache->Reserve(seq, 30).ok());
  WriteTokens(f, seq, 0, 30, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 30).ok());
  const std::string image = *f.cache->ExportSequence(seq);

  Fixture g = Make(40, 11);
  const int64_t free_before = g.cache->pool().num_free();
  for (size_t cut : {size_t{0}, size_t{10}, image.size() / 2, image.size() - 1}) {
    EXPECT_EQ(g.cache->ImportSequence(image.substr(0, cut)).status().code(),
              absl::StatusCode::kDataLoss)
        << cut;
  }
  EXPECT_EQ(g.cache->ImportSequence(image + "x").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(g.cache->CompactImage(image.substr(0, image.size() / 2)).status().code(),
            absl::StatusCode::kDataLoss);
  const std::string compact = *f.cache->CompactImage(image);
  for (size_t cut : {size_t{50}, compact.size() / 2, compact.size() - 1}) {
    EXPECT_EQ(g.cache->ImportSequence(compact.substr(0, cut)).status().code(),
              absl::StatusCode::kDataLoss)
        << cut;
  }
  EXPECT_EQ(g.cache->ImportSequence(compact + "x").status().code(), absl::StatusCode::kDataLoss);
  // Another codec (fitted on other rows): its codes mean other numbers here.
  Fixture other = Make(40, 12);
  EXPECT_EQ(other.cache->ImportSequence(image).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.cache->ImageLayout(), f.cache->ImageLayout());
  // A pool too small for the sequence's pages.
  Fixture small = Make(40, 11, {}, /*pages=*/kLayers * 3);
  EXPECT_EQ(small.cache->ImportSequence(image).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small.cache->ImportSequence(compact).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small.cache->pool().num_free(), small.cache->pool().num_blocks());
  EXPECT_EQ(g.cache->pool().num_free(), free_before);
}

INSTANTIATE_TEST_SUITE_P(KeysAndMetric, TransformKvCacheVariantTest,
                         ::testing::Values(Variant{}, Variant{.pre_rope = false},
                                           Variant{.weighted = true},
                                           Variant{.pre_rope = false, .weighted = true}),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return std::string(info.param.pre_rope ? "PreRope" : "PostRope") +
                                  (info.param.weighted ? "Weighted" : "");
                         });

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

RefreshConfig Refresh(int max_epochs) {
  return {.method = RefreshMethod::kPca,
          .every_tokens = 16,
          .half_life_tokens = 64,
          .max_epochs = max_epochs};
}

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

// Two sets of codes hold the same numbers.
void ExpectSameCodes(const TransformCodes& a, const TransformCodes& b) {
  for (auto [x, y] : {std::pair{a.keys, b.keys}, std::pair{a.values, b.values}}) {
    ASSERT_EQ(x->size(), y->size());
    for (size_t i = 0; i < x->size(); ++i) {
      const TransformCode &p = (*x)[i], &q = (*y)[i];
      EXPECT_EQ(p.mean, q.mean);
      EXPECT_EQ(p.scale, q.scale);
      EXPECT_EQ(p.basis, q.basis);
      ASSERT_EQ(p.components.size(), q.components.size());
      for (size_t j = 0; j < p.components.size(); ++j) {
        EXPECT_EQ(p.components[j].bits, q.components[j].bits);
        EXPECT_EQ(p.components[j].offset, q.components[j].offset);
        EXPECT_EQ(p.components[j].step, q.components[j].step);
      }
    }
  }
}

// A sequence with online refresh moves with its epochs: every block is read with the codes that
// coded it, bitwise as on the source, in both forms of the image; the epoch it codes new blocks
// with comes too, so the same tokens on both code the same blocks.
TEST_P(TransformKvCacheVariantTest, RefreshedEpochsGoWithTheImage) {
  std::mt19937 rng(29);
  Fixture f = Make(140, 11, GetParam(), 200, Refresh(/*max_epochs=*/16));
  const SeqId seq = *f.cache->CreateSequence();
  ASSERT_TRUE(f.cache->Reserve(seq, 140).ok());
  for (int64_t pos = 0; pos < 100; pos += 8) {
    WriteTokens(f, seq, pos, 8, rng);
    ASSERT_TRUE(f.cache->Commit(seq, pos + 8).ok());
  }
  std::set<int32_t> epochs;
  for (int l = 0; l < kLayers; ++l) {
    for (int64_t b = 0; b < 25; ++b) epochs.insert(f.cache->BlockEpoch(seq, l, b));
  }
  ASSERT_GE(epochs.size(), 4u);  // -1 (full blocks), the codec file's and refreshed ones
  absl::StatusOr<std::string> image = f.cache->ExportSequence(seq);
  ASSERT_TRUE(image.ok()) << image.status();

  Fixture g = Make(140, 11, GetParam());  // no refresh of its own
  const int64_t free_before = g.cache->pool().num_free();
  absl::StatusOr<SeqId> copy = g.cache->ImportSequence(*image);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(g.cache->Length(*copy), 104);
  for (int l = 0; l < kLayers; ++l) {
    for (int64_t b = 0; b < 26; ++b) {
      const int32_t fe = f.cache->BlockEpoch(seq, l, b), ge = g.cache->BlockEpoch(*copy, l, b);
      ASSERT_EQ(fe < 0, ge < 0) << l << " " << b;
      if (fe < 0) continue;
      EXPECT_EQ(fe == 0, ge == 0) << l << " " << b;
      ExpectSameCodes(*f.cache->EpochCodes(fe), *g.cache->EpochCodes(ge));
    }
  }
  EXPECT_EQ(g.cache->Stats().bytes_used_compressed, f.cache->Stats().bytes_used_compressed);
  ExpectSameAttention(f, seq, g, *copy, 103, 1, 31);
  ExpectSameAttention(f, seq, g, *copy, 90, 14, 32);
  EXPECT_EQ(*g.cache->ExportSequence(*copy), *image);
  // The storage form: the same sequence, its image byte for byte.
  absl::StatusOr<std::string> compact = f.cache->CompactImage(*image);
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_NE(*compact, *image);
  absl::StatusOr<SeqId> from_compact = g.cache->ImportSequence(*compact);
  ASSERT_TRUE(from_compact.ok()) << from_compact.status();
  EXPECT_EQ(*g.cache->ExportSequence(*from_compact), *image);
  ASSERT_TRUE(g.cache->FreeSequence(*from_compact).ok());

  // The same tokens on both, the source no longer refreshing: coded with the same epoch.
  ASSERT_TRUE(f.cache->SetSequenceRefresh(seq, {}).ok());
  std::mt19937 rng_f(9), rng_g(9);
  for (auto [fx, s, r] : {std::tuple{&f, seq, &rng_f}, std::tuple{&g, *copy, &rng_g}}) {
    ASSERT_TRUE(fx->cache->Reserve(s, 36).ok());
    WriteTokens(*fx, s, 104, 36, *r);
    ASSERT_TRUE(fx->cache->Commit(s, 140).ok());
  }
  EXPECT_GT(g.cache->BlockEpoch(*copy, 0, 26), 0);
  ExpectSameAttention(f, seq, g, *copy, 139, 1, 33);
  EXPECT_EQ(*g.cache->ExportSequence(*copy), *f.cache->ExportSequence(seq));
  // Freed, its epochs go with it.
  ASSERT_TRUE(g.cache->FreeSequence(*copy).ok());
  EXPECT_EQ(g.cache->Stats().epochs_live, 1);
  EXPECT_EQ(g.cache->pool().num_free(), free_before);
}

// Images with epochs, damaged or short of room: refused, and nothing taken (pages or epochs).
TEST(TransformKvCacheTest, ImportOfRefreshedEpochsRefusesDamageAndLeaksNothing) {
  std::mt19937 rng(37);
  Fixture f = Make(100, 11, {}, 200, Refresh(/*max_epochs=*/16));
  const SeqId seq = *f.cache->CreateSequence();
  ASSERT_TRUE(f.cache->Reserve(seq, 100).ok());
  WriteTokens(f, seq, 0, 100, rng);
  for (int64_t pos = 8; pos <= 100; pos += 8) ASSERT_TRUE(f.cache->Commit(seq, pos).ok());
  ASSERT_GE(f.cache->Stats().refresh.installed, 2);
  const std::string image = *f.cache->ExportSequence(seq);
  const std::string compact = *f.cache->CompactImage(image);

  Fixture g = Make(100, 11);
  for (const std::string* im : {&image, &compact}) {
    for (size_t cut : {size_t{60}, im->size() / 3, im->size() / 2, im->size() - 1}) {
      EXPECT_EQ(g.cache->ImportSequence(im->substr(0, cut)).status().code(),
                absl::StatusCode::kDataLoss)
          << cut;
    }
  }
  // Where the first epoch's first code starts: after the layout line, length, next_compress,
  // the form byte, the epoch count and the code's scale flag.
  const size_t mean_at = 8 + f.cache->ImageLayout().size() + 8 + 8 + 1 + 8 + 1;
  std::string nan = image;
  const float q = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan.data() + mean_at, &q, sizeof(q));
  absl::Status st = g.cache->ImportSequence(nan).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("non-finite"), std::string::npos) << st.message();
  std::string form = image;
  form[mean_at - 10] = 6;  // an unknown bit of the codes' form
  EXPECT_EQ(g.cache->ImportSequence(form).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(g.cache->Stats().epochs_live, 1);
  EXPECT_EQ(g.cache->pool().num_free(), g.cache->pool().num_blocks());
  // Room for the full pages but not every slot: the installed epochs are retired again.
  for (int64_t pages = kLayers * 2; pages <= kLayers * 12; pages += 2) {
    Fixture small = Make(100, 11, {}, pages);
    absl::StatusOr<SeqId> got = small.cache->ImportSequence(image);
    if (got.ok()) {
      ASSERT_TRUE(small.cache->FreeSequence(*got).ok());
    } else {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << pages;
    }
    EXPECT_EQ(small.cache->Stats().epochs_live, 1) << pages;
    EXPECT_EQ(small.cache->pool().num_free(), small.cache->pool().num_blocks()) << pages;
  }
}

// The format itself refuses epochs it could not place: blocks an epoch's codes make larger than
// the cache's slot, block epochs out of range, epochs nothing uses.
TEST(TransformImageTest, RefusesEpochsThatDoNotFit) {
  Fixture f = Make(40, 11);
  const TransformImageFormat format(Geometry(), kBlock, kSinks, kWindow, /*pre_rope_keys=*/true,
                                    *f.kc, *f.vc);
  auto wide_codes = std::make_shared<std::vector<TransformCode>>(*f.kc);
  for (TransformCode& c : *wide_codes) {
    for (ComponentQuantizer& cq : c.components) cq.bits = 8;
  }
  const std::shared_ptr<const std::vector<TransformCode>> wide = wide_codes;
  const std::string rows(static_cast<size_t>(2 * kKv * kBlock * kDim * 2), '\0');
  const std::string codes0(static_cast<size_t>(format.coded_bytes(0)), '\1');
  const std::string codes1(static_cast<size_t>(format.coded_bytes(1)), '\2');
  const auto image = [&](std::shared_ptr<const std::vector<TransformCode>> keys, int64_t epoch,
                         int64_t current) {
    TransformImage im;
    im.length = 2 * kBlock;
    im.next_compress = 2;
    im.blocks = 2;
    im.epochs = {{.keys = std::move(keys), .values = f.vc}};
    im.current_epoch = current;
    const TransformImage::Part full{.coded = false, .bytes = rows};
    im.parts = {{.coded = true, .epoch = epoch, .bytes = codes0},
                full,
                {.coded = true, .epoch = epoch, .bytes = codes1},
                full};
    return im;
  };
  for (bool entropy_coded : {false, true}) {
    // The file's own codes as epoch 1: read back.
    // A read image's stored-form parts are views of the image: it outlives them.
    const std::string written = format.Write(image(f.kc, 1, 1), entropy_coded);
    absl::StatusOr<TransformImage> ok = format.Read(written, 100);
    ASSERT_TRUE(ok.ok()) << ok.status() << " " << entropy_coded;
    EXPECT_EQ(ok->epochs.size(), 1u);
    EXPECT_EQ(ok->parts[0].epoch, 1);
    EXPECT_EQ(ok->parts[0].bytes, codes0);
    EXPECT_EQ(ok->parts[2].bytes, codes1);
    for (auto [keys, epoch, current, why] :
         {std::tuple{wide, 0, 1, "more than the cache's"}, std::tuple{f.kc, 2, 1, "epoch 2 of 1"},
          std::tuple{f.kc, 0, 0, "used by no block"}}) {
      absl::StatusOr<TransformImage> read =
          format.Read(format.Write(image(keys, epoch, current), entropy_coded), 100);
      EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << why;
      EXPECT_NE(read.status().message().find(why), std::string::npos) << read.status();
    }
  }
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
