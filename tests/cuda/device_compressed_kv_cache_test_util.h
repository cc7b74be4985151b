// Helpers of the DeviceCompressedKvCache host tests: the device cache over a TwinKvStore beside
// the CPU reference cache with the same policy, tokens appended to both as the CUDA backend
// appends them, and attention through the decode plan the backend builds (decode-attention twin)
// compared with the CPU cache's Attend.
#ifndef SUBSPACE_TESTS_CUDA_DEVICE_COMPRESSED_KV_CACHE_TEST_UTIL_H_
#define SUBSPACE_TESTS_CUDA_DEVICE_COMPRESSED_KV_CACHE_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/compress/compressed_kv_cache.h"
#include "cuda/decode_plan_builder.h"
#include "cuda/device_compressed_kv_cache.h"
#include "kernels/decode_attention.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/cuda/twin_kv_store_ref.h"
#include "tests/kernels/decode_attention_ref.h"

namespace subspace::cuda::device_cache_test {

inline constexpr int kDefaultBasisCapacity = 4;

struct Pair {
  std::unique_ptr<CompressedKvCache> cpu;
  std::shared_ptr<TwinKvStore> store;
  std::unique_ptr<DeviceCompressedKvCache> dev;
};

// The device twin of a CPU cache configuration (its policy, ranks, dtype and refresh).
inline DeviceCompressedKvCacheConfig DeviceConfig(const CompressedKvCacheConfig& c,
                                                  int64_t num_pages) {
  DeviceCompressedKvCacheConfig d;
  d.geometry = c.geometry;
  d.block_size = c.block_size;
  d.policy = c.policy;
  d.num_pages = num_pages;
  d.refresh = c.refresh;
  d.refresh_inline = c.refresh_inline;
  d.n_query_heads = c.n_query_heads;
  return d;
}

inline std::shared_ptr<TwinKvStore> MakeStore(const DeviceCompressedKvCacheConfig& d,
                                              int basis_capacity = kDefaultBasisCapacity,
                                              int readback_delay = 0) {
  std::vector<kernels::KvPoolLayout> layouts;
  for (int l = 0; l < d.geometry.n_layers; ++l) {
    layouts.push_back(kernels::MakeKvPoolLayout(d.geometry.n_kv_heads, d.geometry.head_dim,
                                                d.block_size, d.policy.r_k[static_cast<size_t>(l)],
                                                d.policy.r_v[static_cast<size_t>(l)],
                                                d.policy.coeff_dtype));
  }
  return std::make_shared<TwinKvStore>(std::move(layouts), d.num_pages, basis_capacity,
                                       /*readback_capacity=*/16, readback_delay);
}

inline Pair MakePair(const CompressedKvCacheConfig& c, int64_t num_pages = 256,
                     int basis_capacity = kDefaultBasisCapacity, int readback_delay = 0) {
  Pair p;
  p.cpu = cache_test::Make(c);
  const DeviceCompressedKvCacheConfig d = DeviceConfig(c, num_pages);
  p.store = MakeStore(d, basis_capacity, readback_delay);
  absl::StatusOr<std::unique_ptr<DeviceCompressedKvCache>> dev =
      DeviceCompressedKvCache::Create(d, p.store);
  EXPECT_TRUE(dev.ok()) << dev.status();
  if (dev.ok()) p.dev = *std::move(dev);
  return p;
}

// Tokens [from, to) in one step, as the CUDA backend runs it: reserve, the append kernel's
// writes into each token's full page, commit, flush.
inline void AppendDevice(DeviceCompressedKvCache& cache, TwinKvStore& store, SeqId seq,
                         const cache_test::Data& d, int64_t from, int64_t to) {
  const KvCacheGeometry& g = cache.geometry();
  const int64_t row = static_cast<int64_t>(g.n_kv_heads) * g.head_dim;
  const int bs = cache.block_size();
  ASSERT_TRUE(cache.Reserve(seq, to - from).ok());
  const std::span<const DeviceCompressedKvCache::Block> table = cache.BlockTable(seq);
  for (int64_t t = from; t < to; ++t) {
    const DeviceCompressedKvCache::Block& b = table[static_cast<size_t>(t / bs)];
    ASSERT_EQ(b.slot, kernels::kFullBlock) << "token " << t << " would land in a compressed block";
    for (int l = 0; l < g.n_layers; ++l) {
      store.WriteToken(l, b.page, static_cast<int>(t % bs), d.k[l].data() + t * row,
                       d.v[l].data() + t * row);
    }
  }
  ASSERT_TRUE(cache.Commit(seq, to).ok());
  ASSERT_TRUE(cache.Flush().ok());
}

// The last token's attention in `layer` through the plan the backend builds.
inline std::vector<float> AttendDevice(DeviceCompressedKvCache& cache, TwinKvStore& store,
                                       int layer, SeqId seq, const std::vector<float>& q,
                                       int n_heads) {
  DecodeSeqDesc desc;
  cache.DescribeDecode(seq, cache.Length(seq), &desc);
  absl::StatusOr<DecodePlan> plan =
      BuildDecodePlan(cache.plan_layout(), cache.num_pages(), store.basis_capacity(), {&desc, 1});
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::vector<float> out(q.size(), std::nanf(""));
  if (!plan.ok()) return out;
  kernels::DecodeAttentionParams p;
  p.layout = cache.layout(layer);
  p.plan = plan->HostView();
  p.pool = store.pool(layer);
  p.basis_pq = store.basis_pq(layer);
  p.basis_rv = store.basis_rv(layer);
  p.q = q.data();
  p.out = out.data();
  p.n_heads = n_heads;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(cache.geometry().head_dim));
  kernels::DecodeAttentionRef(p);
  return out;
}

// Both caches against each other for every layer's last token. The CPU cache projects in float,
// the twins in double, so a few codes round apart (fp16: one ulp; int8: one step of the scale).
inline void ExpectSameAttention(Pair& p, SeqId cpu_seq, SeqId dev_seq, uint32_t seed, double tol) {
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
inline double Tolerance(CoeffDtype dt) { return dt == CoeffDtype::kInt8 ? 5e-3 : 1e-3; }

// The host tests' shapes: head_dim and coefficient codes, named "d64_fp16" and so on.
using Shape = std::tuple<int, CoeffDtype>;
inline std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  return "d" + std::to_string(std::get<0>(info.param)) + "_" +
         CoeffDtypeName(std::get<1>(info.param));
}

// Two layers of different ranks (so their slots differ in size), sinks, a window of two blocks.
inline CompressedKvCacheConfig CpuConfig(int hd, CoeffDtype dt) {
  CompressedKvCacheConfig c;
  c.geometry = {2, 2, hd};
  c.block_size = 16;
  c.policy.sink_tokens = 4;
  c.policy.window_tokens = 32;
  c.policy.r_k = {hd / 4, hd / 8};
  c.policy.r_v = {hd / 4 - 4, hd / 8};
  c.policy.coeff_dtype = dt;
  c.full_dtype = CoeffDtype::kFp16;
  c.capacity_bytes = 256 * CompressedKvCache::PageBytes(c.geometry, c.block_size, c.full_dtype);
  return c;
}

}  // namespace subspace::cuda::device_cache_test

#endif  // SUBSPACE_TESTS_CUDA_DEVICE_COMPRESSED_KV_CACHE_TEST_UTIL_H_
