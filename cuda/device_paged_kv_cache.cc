// DevicePagedKvCache: the host bookkeeping of the device pool: a bookkeeping BlockPool (ids only)
// and the sequence manager every cache uses, with one table for all layers.
#include "cuda/device_paged_kv_cache.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/kvcache/sequence_image.h"

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
      copy_(config.copy),
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

void DevicePagedKvCache::DescribeDecode(SeqId seq, int64_t length, DecodeSeqDesc* desc) const {
  const std::span<const int32_t> table = BlockTable(seq);
  const int64_t nb =
      std::min<int64_t>(CeilDiv(length, block_size_), static_cast<int64_t>(table.size()));
  desc->length = length;
  desc->pages.assign(table.begin(), table.begin() + nb);
  desc->slots.assign(static_cast<size_t>(nb), kernels::kFullBlock);
  desc->epochs.assign(static_cast<size_t>(nb * geometry_.n_kv_heads), -1);
  desc->outlier_masks.clear();
  desc->outlier_pages.clear();
  desc->n_outliers = 0;
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

std::string DevicePagedKvCache::ImageLayout() const {
  return absl::StrFormat("device-paged layers=%d kv_heads=%d head_dim=%d block=%d fp16",
                         geometry_.n_layers, geometry_.n_kv_heads, geometry_.head_dim, block_size_);
}

absl::StatusOr<std::string> DevicePagedKvCache::ExportSequence(SeqId seq) const {
  if (!copy_) return absl::UnimplementedError("this device cache has no sequence images");
  const std::vector<int32_t>* table = seqs_.Table(seq, 0);
  if (table == nullptr) return decltype(seqs_)::Unknown(seq);
  const int64_t length = seqs_.Length(seq);
  const int64_t row = static_cast<int64_t>(geometry_.head_dim) * 2;
  ImageWriter w;
  w.Bytes(ImageLayout());
  w.I64(length);
  std::vector<uint8_t> page(static_cast<size_t>(layout_.page_bytes));
  for (int l = 0; l < geometry_.n_layers; ++l) {
    for (int64_t b = 0; b * block_size_ < length; ++b) {
      const int32_t id = (*table)[static_cast<size_t>(b)];
      if (absl::Status st = copy_(page.data(), LayerPool(l) + layout_.Page(id), page.size());
          !st.ok()) {
        return st;
      }
      const int64_t valid = std::min<int64_t>(block_size_, length - b * block_size_);
      for (int side = 0; side < 2; ++side) {
        for (int h = 0; h < geometry_.n_kv_heads; ++h) {
          w.Raw(page.data() + (side == 0 ? layout_.FullK(0, h) : layout_.FullV(0, h)),
                static_cast<size_t>(valid * row));
        }
      }
    }
  }
  return w.Take();
}

absl::StatusOr<SeqId> DevicePagedKvCache::ImportSequence(std::string_view image) {
  if (!copy_) return absl::UnimplementedError("this device cache has no sequence images");
  ImageReader r(image, "device KV cache image");
  if (absl::Status st = r.ExpectLayout(ImageLayout()); !st.ok()) return st;
  absl::StatusOr<int64_t> length = r.Int("length", 0, int64_t{1} << 40);
  if (!length.ok()) return length.status();
  const int64_t row = static_cast<int64_t>(geometry_.head_dim) * 2;
  const uint64_t want = static_cast<uint64_t>(*length) * geometry_.n_layers * 2 *
                        geometry_.n_kv_heads * static_cast<uint64_t>(row);
  if (want / static_cast<uint64_t>(geometry_.n_layers * 2 * geometry_.n_kv_heads * row) !=
          static_cast<uint64_t>(*length) ||
      want != r.left()) {
    return r.Corrupt(
        absl::StrFormat("%d tokens need %d bytes of rows, it holds %d", *length, want, r.left()));
  }
  absl::StatusOr<SeqId> seq = CreateSequence();
  if (!seq.ok()) return seq.status();
  if (absl::Status st = Reserve(*seq, *length); !st.ok()) {
    (void)FreeSequence(*seq);
    return st;
  }
  const std::vector<int32_t>& table = *seqs_.Table(*seq, 0);
  std::vector<uint8_t> page(static_cast<size_t>(layout_.page_bytes));
  for (int l = 0; l < geometry_.n_layers; ++l) {
    for (int64_t b = 0; b * block_size_ < *length; ++b) {
      const int64_t valid = std::min<int64_t>(block_size_, *length - b * block_size_);
      std::fill(page.begin(), page.end(), uint8_t{0});  // rows past the length: zeros
      for (int side = 0; side < 2; ++side) {
        for (int h = 0; h < geometry_.n_kv_heads; ++h) {
          const std::string_view rows = *r.Raw("rows", static_cast<uint64_t>(valid * row));
          std::memcpy(page.data() + (side == 0 ? layout_.FullK(0, h) : layout_.FullV(0, h)),
                      rows.data(), rows.size());
        }
      }
      const int32_t id = table[static_cast<size_t>(b)];
      if (absl::Status st = copy_(LayerPool(l) + layout_.Page(id), page.data(), page.size());
          !st.ok()) {
        (void)FreeSequence(*seq);
        return st;
      }
    }
  }
  if (absl::Status st = Commit(*seq, *length); !st.ok()) {
    (void)FreeSequence(*seq);
    return st;
  }
  return *seq;
}

}  // namespace subspace::cuda
