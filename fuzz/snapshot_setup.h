// The session snapshot fuzzer's caches and model identity, shared with the seed writer
// (make_seeds.cc) so that the committed seeds are images these very caches import.
#ifndef SUBSPACE_FUZZ_SNAPSHOT_SETUP_H_
#define SUBSPACE_FUZZ_SNAPSHOT_SETUP_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "core/compress/compressed_kv_cache.h"
#include "core/compress/transform_codec.h"
#include "core/compress/transform_kv_cache.h"
#include "core/engine/session_snapshot.h"
#include "core/kvcache/paged_kv_cache.h"

namespace subspace::fuzz {

inline const KvCacheGeometry kSnapshotGeometry{.n_layers = 2, .n_kv_heads = 2, .head_dim = 8};
inline constexpr int kSnapshotBlock = 4;
inline const SnapshotIdentity kSnapshotIdentity{.model_checksum = 0x5ea55e55, .model_name = "fuzz"};

inline std::unique_ptr<PagedKvCache> SnapshotPagedCache() {
  PagedKvCache::Config c;
  c.geometry = kSnapshotGeometry;
  c.block_size = kSnapshotBlock;
  c.capacity_bytes = 64 * PagedKvCache::BlockBytes(c.geometry, kSnapshotBlock);
  return *PagedKvCache::Create(c);
}

// Int8 codes, rank 2, sinks and window of one block, outliers on, a fixed default basis.
inline std::unique_ptr<CompressedKvCache> SnapshotCompressedCache() {
  CompressedKvCacheConfig c;
  c.geometry = kSnapshotGeometry;
  c.block_size = kSnapshotBlock;
  c.policy.sink_tokens = kSnapshotBlock;
  c.policy.window_tokens = kSnapshotBlock;
  c.policy.r_k = {2, 2};
  c.policy.r_v = {2, 2};
  c.policy.coeff_dtype = CoeffDtype::kInt8;
  c.policy.outlier_threshold = 0.8f;
  c.capacity_bytes =
      64 * CompressedKvCache::PageBytes(c.geometry, kSnapshotBlock, CoeffDtype::kFp16);
  auto cache = *CompressedKvCache::Create(c);
  Basis b = Basis::Zeros(c.geometry, c.policy.r_k, c.policy.r_v);
  for (LayerBasis& lb : b.layers) {
    // Unit vectors e_0, e_1 per head: orthonormal columns.
    for (int h = 0; h < kSnapshotGeometry.n_kv_heads; ++h) {
      for (int j = 0; j < 2; ++j) {
        lb.p_k[static_cast<size_t>((h * 8 + j) * 2 + j)] = 1.0f;
        lb.p_v[static_cast<size_t>((h * 8 + j) * 2 + j)] = 1.0f;
      }
    }
  }
  b.MakeOrthogonalFromPkPv();
  const EpochId id = *cache->InstallBasis(std::make_shared<const Basis>(std::move(b)));
  (void)cache->SetDefaultEpoch(id);
  (void)cache->ReleaseEpoch(id);
  return cache;
}

// The transform-coded cache with fixed codes (what a fitted codec could give): the identity
// basis, widths 8, 4, 4, 3, 2, 2, 0, 0 on a range of [-1, 1], keys coded as written; sinks and
// window of one block. With `refresh`, sequences refresh their codes (inline) every so many
// coded tokens: their images carry epochs.
inline std::unique_ptr<TransformKvCache> SnapshotTransformCache(const RefreshConfig& refresh = {}) {
  const int d = kSnapshotGeometry.head_dim;
  TransformCode code;
  code.dim = d;
  code.mean.assign(static_cast<size_t>(d), 0.0f);
  code.basis.assign(static_cast<size_t>(d * d), 0.0f);
  const int bits[] = {8, 4, 4, 3, 2, 2, 0, 0};
  for (int i = 0; i < d; ++i) {
    code.basis[static_cast<size_t>(i * d + i)] = 1.0f;
    const int b = bits[i % 8];
    code.components.push_back({.bits = b,
                               .offset = b > 0 ? -1.0f : 0.0f,
                               .step = b > 0 ? 2.0f / static_cast<float>((1 << b) - 1) : 0.0f});
  }
  auto codes = std::make_shared<const std::vector<TransformCode>>(
      static_cast<size_t>(kSnapshotGeometry.n_layers * kSnapshotGeometry.n_kv_heads), code);
  TransformKvCacheConfig c;
  c.geometry = kSnapshotGeometry;
  c.block_size = kSnapshotBlock;
  c.sink_tokens = kSnapshotBlock;
  c.window_tokens = kSnapshotBlock;
  c.key_codes = codes;
  c.value_codes = codes;
  c.capacity_bytes = 64 * TransformKvCache::PageBytes(c.geometry, kSnapshotBlock);
  c.refresh = refresh;
  c.refresh_inline = true;
  return *TransformKvCache::Create(c);
}

// Appends `n` tokens of deterministic K/V to `seq`, one token per step as decoding does.
inline void FillSequence(KvCache& cache, SeqId seq, int n) {
  const int row = kSnapshotGeometry.n_kv_heads * kSnapshotGeometry.head_dim;
  std::vector<float> k(static_cast<size_t>(row)), v(k.size());
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < row; ++i) {
      k[static_cast<size_t>(i)] = std::sin(0.7f * static_cast<float>(t * row + i));
      v[static_cast<size_t>(i)] = std::cos(0.3f * static_cast<float>(t + i));
    }
    (void)cache.Reserve(seq, 1);
    for (int l = 0; l < kSnapshotGeometry.n_layers; ++l)
      cache.Write(l, seq, t, 1, k.data(), v.data());
    (void)cache.Commit(seq, t + 1);
  }
}

}  // namespace subspace::fuzz

#endif  // SUBSPACE_FUZZ_SNAPSHOT_SETUP_H_
