// DevicePagedKvCache: the host bookkeeping of the device pool: a bookkeeping BlockPool (ids only)
// and the sequence manager every cache uses, with one table for all layers.
#include "cuda/device_paged_kv_cache.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace subspace::cuda {

int64_t DevicePagedKvCache::BlockBytes(const KvCacheGeometry& g, int block_size) {
  return static_cast<int64_t>(g.n_layers) * 2 * g.n_kv_heads * block_size * g.head_dim * 2;
}

absl::StatusOr<std::unique_ptr<DevicePagedKvCache>> DevicePagedKvCache::Create(
    const Config& config, uint8_t* pool, int64_t pool_bytes, std::shared_ptr<const void> owner) {
  const KvCacheGeometry& g = config.geometry;
  if (absl::Status st = CheckKvGeometry(g); !st.ok()) return st;
  if (config.block_size < 1 || config.block_size > kernels::kMaxBlockSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("block_size must be in [1, %d] on the CUDA backend, got %d",
                        kernels::kMaxBlockSize, config.block_size));
  }
  const int64_t block_bytes = BlockBytes(g, config.block_size);
  const int64_t num_blocks = pool_bytes / block_bytes;
  if (pool == nullptr || num_blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("device KV pool of %d bytes holds no block of %d bytes (%d layers)",
                        pool_bytes, block_bytes, g.n_layers));
  }
  absl::StatusOr<std::unique_ptr<BlockPool>> ids =
      BlockPool::CreateBookkeeping(block_bytes / static_cast<int64_t>(sizeof(float)), num_blocks);
  if (!ids.ok()) return ids.status();
  return std::unique_ptr<DevicePagedKvCache>(
      new DevicePagedKvCache(config, pool, *std::move(ids), std::move(owner)));
}

DevicePagedKvCache::DevicePagedKvCache(const Config& config, uint8_t* pool,
                                       std::unique_ptr<BlockPool> ids,
                                       std::shared_ptr<const void> owner)
    : geometry_(config.geometry),
      block_size_(config.block_size),
      layout_(kernels::MakeKvPoolLayout(config.geometry.n_kv_heads, config.geometry.head_dim,
                                        config.block_size, 1, 1, CoeffDtype::kFp16)),
      pool_(pool),
      ids_(std::move(ids)),
      owner_(std::move(owner)),
      seqs_({.n_layers = config.geometry.n_layers,
             .block_size = config.block_size,
             .shared_table = true,
             .block_bytes = BlockBytes(config.geometry, config.block_size)},
            ids_.get()) {}

absl::StatusOr<SeqId> DevicePagedKvCache::CreateSequence() { return seqs_.Create(); }

absl::Status DevicePagedKvCache::FreeSequence(SeqId seq) { return seqs_.Free(seq); }

int64_t DevicePagedKvCache::Length(SeqId seq) const { return seqs_.Length(seq); }

std::span<const int32_t> DevicePagedKvCache::BlockTable(SeqId seq) const {
  const std::vector<int32_t>* table = seqs_.Table(seq, 0);
  if (table == nullptr) return {};
  return *table;
}

int64_t DevicePagedKvCache::BlocksNeeded(SeqId seq, int64_t n) const {
  return seqs_.BlocksNeeded(seq, n);
}

absl::Status DevicePagedKvCache::Reserve(SeqId seq, int64_t n) { return seqs_.Reserve(seq, n); }

absl::Status DevicePagedKvCache::Commit(SeqId seq, int64_t length) {
  return seqs_.Commit(seq, length);
}

absl::Status DevicePagedKvCache::Truncate(SeqId seq, int64_t length) {
  return seqs_.Truncate(seq, length);
}

KvCacheStats DevicePagedKvCache::Stats() const { return seqs_.Stats(geometry_); }

}  // namespace subspace::cuda
