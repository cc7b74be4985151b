// Full-rank paged KV cache in device memory (the CUDA backend's --kv-cache=full): fp16 pages in
// the layout of kernels/kv_layout.h, one block table per sequence shared by every layer (vLLM's
// habit: block id b of layer l is page b of layer l's slice of the pool, so one table and one
// plan serve all layers), bookkeeping on the host. The bytes are written and read only by the
// CUDA backend's kernels (cuda/cuda_model.h), so this is a DeviceKvCache, not a host KvCache.
#ifndef SUBSPACE_CUDA_DEVICE_PAGED_KV_CACHE_H_
#define SUBSPACE_CUDA_DEVICE_PAGED_KV_CACHE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/kvcache/block_pool.h"
#include "core/kvcache/kv_cache.h"
#include "core/kvcache/sequence_manager.h"
#include "cuda/device_kv_cache.h"
#include "kernels/kv_layout.h"

namespace subspace::cuda {

class DevicePagedKvCache final : public DeviceKvCache {
 public:
  // Copies `bytes` between the pool and host memory, synchronously and after the backend's
  // queued work (the CUDA backend's waits for its stream).
  using Copy = std::function<absl::Status(void* dst, const void* src, size_t bytes)>;
  struct Config {
    KvCacheGeometry geometry;
    int block_size = 16;  // tokens per block, 1..64 (the attention kernels' limit)
    Copy copy;            // unset: no sequence images (UNIMPLEMENTED)
  };
  // Bytes one block id takes across all layers: n_layers pages of [2][n_kv][B][head_dim] fp16.
  static int64_t BlockBytes(const KvCacheGeometry& geometry, int block_size);

  // `pool` is device memory of `pool_bytes` (a slice of the backend's one allocation, which
  // `owner` keeps alive). INVALID_ARGUMENT for a bad geometry or block size, or a pool below one
  // block.
  static absl::StatusOr<std::unique_ptr<DevicePagedKvCache>> Create(
      const Config& config, uint8_t* pool, int64_t pool_bytes, std::shared_ptr<const void> owner);

  const KvCacheGeometry& geometry() const override { return geometry_; }
  int block_size() const override { return block_size_; }
  absl::StatusOr<SeqId> CreateSequence() override;
  absl::Status FreeSequence(SeqId seq) override;
  int64_t Length(SeqId seq) const override;
  absl::Status Reserve(SeqId seq, int64_t n) override;
  int64_t BlocksNeeded(SeqId seq, int64_t n) const override;
  absl::Status Commit(SeqId seq, int64_t length) override;
  absl::Status Truncate(SeqId seq, int64_t length) override;
  KvCacheStats Stats() const override;

  // Images (session snapshots, tiers): per layer and block, the committed fp16 rows of each KV
  // head's keys, then of its values (never a page's stale rows), read through Config::copy one
  // page at a time.
  std::string ImageLayout() const override;
  absl::StatusOr<std::string> ExportSequence(SeqId seq) const override;
  absl::StatusOr<SeqId> ImportSequence(std::string_view image) override;

  // --- The CUDA backend's view (DeviceKvCache) ---
  DeviceBlockRef BlockOf(SeqId seq, int64_t b) const override {
    return {.page = BlockTable(seq)[static_cast<size_t>(b)]};
  }
  void DescribeDecode(SeqId seq, int64_t length, DecodeSeqDesc* desc) const override;
  DecodePlanBounds plan_bounds() const override {
    return {.layout = layout_, .num_pages = num_blocks(), .num_basis_epochs = 0};
  }
  // One layer's page geometry (full pages; the ranks are placeholders: no compressed slots).
  const kernels::KvPoolLayout& layout() const { return layout_; }
  // Layer `layer`'s pages: [num_blocks, page_bytes] on the device.
  uint8_t* LayerPool(int layer) const {
    return pool_ + static_cast<int64_t>(layer) * num_blocks() * layout_.page_bytes;
  }
  // Block ids of `seq` in position order (every layer); empty for an unknown id.
  std::span<const int32_t> BlockTable(SeqId seq) const;
  int64_t num_blocks() const { return ids_->num_blocks(); }

 private:
  DevicePagedKvCache(const Config& config, uint8_t* pool, std::unique_ptr<BlockPool> ids,
                     std::shared_ptr<const void> owner);

  KvCacheGeometry geometry_;
  int block_size_;
  kernels::KvPoolLayout layout_;
  uint8_t* pool_;                   // [n_layers, num_blocks, page_bytes]
  std::unique_ptr<BlockPool> ids_;  // the pool's block ids: the bytes are at pool_
  std::shared_ptr<const void> owner_;
  Copy copy_;
  SequenceManager<int32_t> seqs_;  // one table for every layer
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_DEVICE_PAGED_KV_CACHE_H_
