// PagedKvCache: block accounting, all-or-nothing reservation, sequence recycling, and
// attention against a plain dense double-precision reference across block sizes, GQA/MQA,
// several sequences and chunked prefill, with the AVX2 kernels and the scalar fallback; fp32
// rows and q8_0 / q4_0 rows (the reference then attends over the rows as stored).
#include "core/kvcache/paged_kv_cache.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cpu/matmul_internal.h"
#include "gtest/gtest.h"

namespace subspace {
namespace {

std::unique_ptr<PagedKvCache> MakeCache(KvCacheGeometry g, int block_size, int64_t blocks,
                                        KvDtype dtype = KvDtype::kF32) {
  PagedKvCache::Config config;
  config.geometry = g;
  config.block_size = block_size;
  config.dtype = dtype;
  config.capacity_bytes = blocks * PagedKvCache::BlockBytes(g, block_size, dtype);
  absl::StatusOr<std::unique_ptr<PagedKvCache>> cache = PagedKvCache::Create(config);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? *std::move(cache) : nullptr;
}

TEST(PagedKvCacheTest, RejectsBadConfig) {
  PagedKvCache::Config config;
  config.geometry = {2, 2, 8};
  config.capacity_bytes = 1 << 20;
  config.block_size = 0;
  EXPECT_EQ(PagedKvCache::Create(config).status().code(), absl::StatusCode::kInvalidArgument);
  config.block_size = 4;
  config.geometry.head_dim = 0;
  EXPECT_EQ(PagedKvCache::Create(config).status().code(), absl::StatusCode::kInvalidArgument);
  config.geometry.head_dim = 8;
  config.capacity_bytes = PagedKvCache::BlockBytes(config.geometry, 4);  // one block, 2 layers
  EXPECT_EQ(PagedKvCache::Create(config).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PagedKvCacheTest, QuantizedNeedsHeadDimOfWholeBlocks) {
  PagedKvCache::Config config;
  config.geometry = {2, 2, 48};
  config.block_size = 4;
  config.capacity_bytes = 1 << 20;
  config.dtype = KvDtype::kQ8_0;
  const absl::Status st = PagedKvCache::Create(config).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "a q8_0 KV cache needs a head_dim that is a multiple of 32, got 48");
  config.geometry.head_dim = 64;
  EXPECT_TRUE(PagedKvCache::Create(config).ok());
}

TEST(PagedKvCacheTest, QuantizedBlocksTakeTheirFormatsBytes) {
  const KvCacheGeometry g{2, 2, 64};
  // [2][2 heads][16 slots] rows of 64 values: 256 B fp32, 68 B q8_0, 36 B q4_0.
  EXPECT_EQ(PagedKvCache::BlockBytes(g, 16), 2 * 2 * 16 * 256);
  EXPECT_EQ(PagedKvCache::BlockBytes(g, 16, KvDtype::kQ8_0), 2 * 2 * 16 * 68);
  EXPECT_EQ(PagedKvCache::BlockBytes(g, 16, KvDtype::kQ4_0), 2 * 2 * 16 * 36);
  EXPECT_EQ(PagedKvCache::BlockBytes({1, 1, 32}, 1, KvDtype::kQ4_0), 36);  // 2 x 18
  auto cache = MakeCache(g, 16, 10, KvDtype::kQ4_0);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(cache->dtype(), KvDtype::kQ4_0);
  EXPECT_EQ(cache->Stats().bytes_total, 10 * 2 * 2 * 16 * 36);
}

TEST(PagedKvCacheTest, BlockAccountingAndStats) {
  const KvCacheGeometry g{2, 2, 8};
  auto cache = MakeCache(g, 4, 10);
  ASSERT_NE(cache, nullptr);
  const int64_t block_bytes = PagedKvCache::BlockBytes(g, 4);
  EXPECT_EQ(block_bytes, 2 * 2 * 4 * 8 * 4);
  KvCacheStats st = cache->Stats();
  EXPECT_EQ(st.bytes_total, 10 * block_bytes);
  EXPECT_EQ(st.blocks_total, 10);
  EXPECT_EQ(st.blocks_free, 10);
  EXPECT_EQ(st.sequences, 0);

  SeqId a = *cache->CreateSequence();
  EXPECT_EQ(cache->BlocksNeeded(a, 5), 4);  // 2 blocks per layer x 2 layers
  ASSERT_TRUE(cache->Reserve(a, 5).ok());
  EXPECT_EQ(cache->ReservedTokens(a), 8);
  EXPECT_EQ(cache->BlocksNeeded(a, 8), 0);
  EXPECT_EQ(cache->BlocksNeeded(a, 9), 2);
  EXPECT_EQ(cache->BlockTable(a, 0).size(), 2u);
  EXPECT_EQ(cache->BlockTable(a, 1).size(), 2u);
  ASSERT_TRUE(cache->Commit(a, 5).ok());
  EXPECT_EQ(cache->Length(a), 5);
  st = cache->Stats();
  EXPECT_EQ(st.blocks_free, 6);
  EXPECT_EQ(st.bytes_used_full, 4 * block_bytes);
  EXPECT_EQ(st.tokens_cached, 5);
  EXPECT_EQ(st.sequences, 1);
  EXPECT_EQ(st.bytes_used_compressed, 0);

  // Reserve is relative to the committed length: 5 + 3 = 8 tokens fit in the held blocks.
  ASSERT_TRUE(cache->Reserve(a, 3).ok());
  EXPECT_EQ(cache->Stats().blocks_free, 6);
}

TEST(PagedKvCacheTest, ReserveIsAllOrNothing) {
  const KvCacheGeometry g{3, 1, 4};
  auto cache = MakeCache(g, 2, 8);
  ASSERT_NE(cache, nullptr);
  SeqId a = *cache->CreateSequence();
  SeqId b = *cache->CreateSequence();
  ASSERT_TRUE(cache->Reserve(a, 4).ok());  // 2 per layer x 3 = 6 blocks
  EXPECT_EQ(cache->Stats().blocks_free, 2);
  // b needs 3 blocks (1 per layer): only 2 free, so nothing may be taken.
  absl::Status st = cache->Reserve(b, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("needs 3 more blocks"), std::string::npos) << st;
  EXPECT_NE(st.message().find("2 of 8 blocks free"), std::string::npos) << st;
  EXPECT_EQ(cache->Stats().blocks_free, 2);
  EXPECT_EQ(cache->ReservedTokens(b), 0);
  for (int l = 0; l < 3; ++l) EXPECT_TRUE(cache->BlockTable(b, l).empty());
  EXPECT_EQ(cache->Reserve(99, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->Reserve(a, -1).code(), absl::StatusCode::kInvalidArgument);
  // A huge request is refused, not overflowed into a small one.
  EXPECT_EQ(cache->Reserve(b, std::numeric_limits<int64_t>::max()).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_GT(cache->BlocksNeeded(b, std::numeric_limits<int64_t>::max()), 8);
  EXPECT_EQ(cache->Stats().blocks_free, 2);
}

TEST(PagedKvCacheTest, FreeReturnsBlocksAndRecyclesIds) {
  const KvCacheGeometry g{2, 2, 8};
  auto cache = MakeCache(g, 4, 8);
  ASSERT_NE(cache, nullptr);
  SeqId a = *cache->CreateSequence();
  ASSERT_TRUE(cache->Reserve(a, 16).ok());  // the whole pool
  ASSERT_TRUE(cache->Commit(a, 10).ok());
  EXPECT_EQ(cache->Stats().blocks_free, 0);
  ASSERT_TRUE(cache->FreeSequence(a).ok());
  KvCacheStats st = cache->Stats();
  EXPECT_EQ(st.blocks_free, 8);
  EXPECT_EQ(st.bytes_used_full, 0);
  EXPECT_EQ(st.tokens_cached, 0);
  EXPECT_EQ(st.sequences, 0);
  EXPECT_EQ(cache->Length(a), 0);
  EXPECT_EQ(cache->FreeSequence(a).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->Commit(a, 0).code(), absl::StatusCode::kNotFound);
  SeqId b = *cache->CreateSequence();
  EXPECT_EQ(b, a);  // slot recycled
  EXPECT_EQ(cache->Length(b), 0);
  ASSERT_TRUE(cache->Reserve(b, 16).ok());
}

TEST(PagedKvCacheTest, TruncateFreesWholeBlocksPastLength) {
  const KvCacheGeometry g{2, 1, 4};
  auto cache = MakeCache(g, 4, 16);
  ASSERT_NE(cache, nullptr);
  SeqId a = *cache->CreateSequence();
  ASSERT_TRUE(cache->Reserve(a, 14).ok());  // 4 blocks per layer
  ASSERT_TRUE(cache->Commit(a, 10).ok());
  EXPECT_EQ(cache->Stats().blocks_free, 8);
  ASSERT_TRUE(cache->Truncate(a, 5).ok());  // keeps blocks 0, 1 in each layer
  EXPECT_EQ(cache->Length(a), 5);
  EXPECT_EQ(cache->ReservedTokens(a), 8);
  KvCacheStats st = cache->Stats();
  EXPECT_EQ(st.blocks_free, 12);
  EXPECT_EQ(st.tokens_cached, 5);
  ASSERT_TRUE(cache->Truncate(a, 4).ok());  // exactly one block
  EXPECT_EQ(cache->Stats().blocks_free, 14);
  EXPECT_EQ(cache->Truncate(a, 5).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->Truncate(a, -1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cache->Truncate(a, 0).ok());
  EXPECT_EQ(cache->Stats().blocks_free, 16);
  // Commit may not go past the reservation nor backwards.
  EXPECT_EQ(cache->Commit(a, 1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cache->Reserve(a, 3).ok());
  ASSERT_TRUE(cache->Commit(a, 3).ok());
  EXPECT_EQ(cache->Commit(a, 2).code(), absl::StatusCode::kInvalidArgument);
}

// ---- Attention against a dense reference --------------------------------------------------

// Dense causal attention in double for one sequence and layer.
// q: [n, n_heads, hd]; keys, values: [ctx, n_kv, hd]; returns [n, n_heads, hd]
std::vector<double> DenseAttention(const std::vector<float>& q, int64_t n, int64_t pos,
                                   const std::vector<float>& keys, const std::vector<float>& values,
                                   int n_heads, int n_kv, int hd) {
  std::vector<double> out(static_cast<size_t>(n * n_heads * hd), 0.0);
  const int group = n_heads / n_kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ctx = pos + i + 1;
    for (int h = 0; h < n_heads; ++h) {
      const int kvh = h / group;
      std::vector<double> s(static_cast<size_t>(ctx));
      double mx = -1e300;
      for (int64_t t = 0; t < ctx; ++t) {
        double dot = 0;
        for (int d = 0; d < hd; ++d) {
          dot +=
              static_cast<double>(q[(i * n_heads + h) * hd + d]) * keys[(t * n_kv + kvh) * hd + d];
        }
        s[t] = dot * scale;
        mx = std::max(mx, s[t]);
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int64_t t = 0; t < ctx; ++t) {
        for (int d = 0; d < hd; ++d) {
          out[(i * n_heads + h) * hd + d] += s[t] / sum * values[(t * n_kv + kvh) * hd + d];
        }
      }
    }
  }
  return out;
}

struct AttendCase {
  int block_size;
  int n_heads;
  int n_kv;
  int head_dim;
  KvDtype dtype = KvDtype::kF32;
};

// Rows of hd values as a `dtype` cache gives them back. x: [rows, hd]
void RoundTripRows(KvDtype dtype, std::vector<float>& x, int hd) {
  std::vector<uint8_t> bytes(static_cast<size_t>(KvRowBytes(dtype, hd)));
  for (size_t r = 0; r < x.size(); r += static_cast<size_t>(hd)) {
    QuantizeKvRow(dtype, x.data() + r, hd, bytes.data());
    DequantizeKvRows(dtype, bytes.data(), 1, hd, x.data() + r);
  }
}

class PagedAttendTest : public ::testing::TestWithParam<AttendCase> {};

// Several sequences of different lengths, filled by chunked prefill (uneven chunks written
// and attended in one batch per step), then a batched decode step; every step's output is
// compared with the dense reference over the sequence's whole history.
void CheckAgainstDenseReference(const AttendCase& c) {
  const int n_layers = 2;
  const KvCacheGeometry g{n_layers, c.n_kv, c.head_dim};
  auto cache = MakeCache(g, c.block_size, 4096, c.dtype);
  ASSERT_NE(cache, nullptr);
  std::mt19937 rng(1234 + c.block_size * 7 + c.n_kv);
  std::normal_distribution<float> dist(0.0f, 1.0f);

  // Chunk schedule per sequence: the last chunk of size 1 is a decode step.
  const std::vector<std::vector<int>> chunks = {{7, 9, 1}, {1, 1, 1}, {20, 13, 1}};
  const int n_seqs = static_cast<int>(chunks.size());
  std::vector<SeqId> ids;
  for (int s = 0; s < n_seqs; ++s) ids.push_back(*cache->CreateSequence());
  const int kv_width = c.n_kv * c.head_dim;
  const int q_width = c.n_heads * c.head_dim;
  // Full history per sequence and layer, for the reference. [seq][layer] -> [ctx, n_kv, hd]
  std::vector<std::vector<std::vector<float>>> keys(n_seqs,
                                                    std::vector<std::vector<float>>(n_layers)),
      values = keys;
  double worst = 0;
  for (size_t step = 0; step < chunks[0].size(); ++step) {
    std::vector<std::vector<float>> q(n_seqs), out(n_seqs);
    for (int s = 0; s < n_seqs; ++s) {
      ASSERT_TRUE(cache->Reserve(ids[s], chunks[s][step]).ok());
    }
    for (int layer = 0; layer < n_layers; ++layer) {
      std::vector<AttentionRequest> requests;
      for (int s = 0; s < n_seqs; ++s) {
        const int n = chunks[s][step];
        const int64_t pos = cache->Length(ids[s]);
        std::vector<float> k(n * kv_width), v(n * kv_width);
        q[s].resize(n * q_width);
        out[s].assign(n * q_width, -1.0f);
        for (float& x : k) x = dist(rng);
        for (float& x : v) x = dist(rng);
        for (float& x : q[s]) x = 2.0f * dist(rng);  // sharper softmax
        cache->Write(layer, ids[s], pos, n, k.data(), v.data());
        RoundTripRows(c.dtype, k, c.head_dim);  // what the cache holds
        RoundTripRows(c.dtype, v, c.head_dim);
        keys[s][layer].insert(keys[s][layer].end(), k.begin(), k.end());
        values[s][layer].insert(values[s][layer].end(), v.begin(), v.end());
        requests.push_back({ids[s], pos, n, q[s].data(), out[s].data()});
      }
      cache->Attend(layer, requests, c.n_heads);
      for (int s = 0; s < n_seqs; ++s) {
        const int64_t n = chunks[s][step];
        std::vector<double> ref = DenseAttention(q[s], n, cache->Length(ids[s]), keys[s][layer],
                                                 values[s][layer], c.n_heads, c.n_kv, c.head_dim);
        for (size_t e = 0; e < ref.size(); ++e) {
          ASSERT_TRUE(std::isfinite(out[s][e]));
          const double err = std::abs(out[s][e] - ref[e]);
          worst = std::max(worst, err);
          ASSERT_LE(err, 2e-5 * (1.0 + std::abs(ref[e])))
              << "seq " << s << " step " << step << " layer " << layer << " elem " << e;
        }
      }
    }
    for (int s = 0; s < n_seqs; ++s) {
      ASSERT_TRUE(cache->Commit(ids[s], cache->Length(ids[s]) + chunks[s][step]).ok());
    }
  }
  ::testing::Test::RecordProperty("max_abs_error", std::to_string(worst));
}

// With the AVX2 attention kernels and with their scalar twins (the fallback).
TEST_P(PagedAttendTest, MatchesDenseReference) {
  std::vector<cpu::internal::Isa> isas = {cpu::internal::Isa::kScalar};
  if (cpu::internal::DetectedIsa() >= cpu::internal::Isa::kAvx2) {
    isas.push_back(cpu::internal::Isa::kAvx2);
  }
  for (cpu::internal::Isa isa : isas) {
    SCOPED_TRACE(isa == cpu::internal::Isa::kScalar ? "scalar" : "avx2");
    cpu::internal::ScopedMaxIsa cap(isa);
    CheckAgainstDenseReference(GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Geometries, PagedAttendTest,
                         ::testing::Values(AttendCase{1, 4, 2, 16}, AttendCase{4, 4, 2, 16},
                                           AttendCase{16, 4, 2, 16}, AttendCase{4, 4, 4, 8},  // MHA
                                           AttendCase{16, 8, 1, 32},
                                           AttendCase{1, 6, 1, 64},  // MQA
                                           AttendCase{4, 8, 2, 128},
                                           AttendCase{16, 8, 1, 32, KvDtype::kQ8_0},
                                           AttendCase{1, 6, 1, 64, KvDtype::kQ4_0},
                                           AttendCase{4, 4, 2, 64, KvDtype::kQ4_0},
                                           AttendCase{4, 8, 2, 128, KvDtype::kQ8_0}),
                         [](const ::testing::TestParamInfo<AttendCase>& info) {
                           const AttendCase& c = info.param;
                           return absl::StrCat("B", c.block_size, "_H", c.n_heads, "_KV", c.n_kv,
                                               "_D", c.head_dim, "_", KvDtypeName(c.dtype));
                         });

// Attention of a sequence is unaffected by other sequences' writes into neighbouring blocks
// and by a truncate-and-rewrite of its own tail.
TEST(PagedKvCacheTest, TruncateThenRewriteAttendsToNewTail) {
  const KvCacheGeometry g{1, 1, 4};
  auto cache = MakeCache(g, 2, 16);
  ASSERT_NE(cache, nullptr);
  SeqId a = *cache->CreateSequence();
  ASSERT_TRUE(cache->Reserve(a, 3).ok());
  std::vector<float> k(12, 0.0f), v = {1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
  cache->Write(0, a, 0, 3, k.data(), v.data());
  ASSERT_TRUE(cache->Commit(a, 3).ok());
  ASSERT_TRUE(cache->Truncate(a, 2).ok());
  ASSERT_TRUE(cache->Reserve(a, 1).ok());
  std::vector<float> k2(4, 0.0f), v2 = {9, 9, 9, 9};
  cache->Write(0, a, 2, 1, k2.data(), v2.data());
  std::vector<float> q(4, 0.0f), out(4);
  AttentionRequest req{a, 2, 1, q.data(), out.data()};
  cache->Attend(0, {&req, 1}, 1);
  // Zero keys: uniform weights over (1, 2, 9).
  for (float x : out) EXPECT_NEAR(x, 4.0f, 1e-6f);
}

}  // namespace
}  // namespace subspace
