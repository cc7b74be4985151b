// Full-rank paged KV cache (CPU): blocks of B tokens of one sequence and one layer from a
// BlockPool allocated once, per-sequence per-layer block tables, and a streaming-softmax
// attention over them. Rows are fp32 (the exact baseline the compressed cache must match) or
// quantized per 32 values as llama.cpp's q8_0 / q4_0 cache types (kv_quant.h): the server's
// `--kv-cache quantized`, the baseline a user would pick instead of low-rank compression.
#ifndef SUBSPACE_CORE_KVCACHE_PAGED_KV_CACHE_H_
#define SUBSPACE_CORE_KVCACHE_PAGED_KV_CACHE_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/kvcache/block_pool.h"
#include "core/kvcache/kv_cache.h"
#include "core/kvcache/kv_quant.h"
#include "core/kvcache/sequence_manager.h"

namespace subspace {

class PagedKvCache final : public KvCache {
 public:
  struct Config {
    KvCacheGeometry geometry;
    int block_size = 16;            // tokens per block (B)
    int64_t capacity_bytes = 0;     // pool size; blocks = capacity_bytes / block_bytes
    KvDtype dtype = KvDtype::kF32;  // of every K and V row
  };
  // INVALID_ARGUMENT for a bad geometry, a capacity below one block per layer, or a quantized
  // dtype with a head_dim that is not a multiple of 32.
  static absl::StatusOr<std::unique_ptr<PagedKvCache>> Create(const Config& config);

  // Bytes of one block: [2 (k, v)][n_kv_heads][B] rows of head_dim values in `dtype`, rounded
  // up to a multiple of 4.
  static int64_t BlockBytes(const KvCacheGeometry& geometry, int block_size,
                            KvDtype dtype = KvDtype::kF32);

  KvDtype dtype() const { return dtype_; }

  const KvCacheGeometry& geometry() const override { return geometry_; }
  int block_size() const override { return block_size_; }

  absl::StatusOr<SeqId> CreateSequence() override;
  absl::Status FreeSequence(SeqId seq) override;
  int64_t Length(SeqId seq) const override;
  absl::Status Reserve(SeqId seq, int64_t n) override;
  int64_t BlocksNeeded(SeqId seq, int64_t n) const override;

  // k, v: [n, n_kv_heads, head_dim]
  void Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k, const float* v) override;
  void Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) override;
  absl::Status Commit(SeqId seq, int64_t length) override;
  absl::Status Truncate(SeqId seq, int64_t length) override;

  KvCacheStats Stats() const override;
  std::string ImageLayout() const override;
  absl::StatusOr<std::string> ExportSequence(SeqId seq) const override;
  absl::StatusOr<SeqId> ImportSequence(std::string_view image) override;

  // Tokens the blocks held by `seq` can store (per layer); 0 for an unknown id.
  int64_t ReservedTokens(SeqId seq) const;
  // The block table of one sequence and layer (tests, debugging); empty for an unknown id.
  std::span<const int32_t> BlockTable(SeqId seq, int layer) const;
  const BlockPool& pool() const { return *pool_; }

  // --- Attention's view (paged_attention.h) ---
  // The bytes of block `block` of `seq` in `layer` (ids the caller has validated): the K half,
  // then the V half at v_half(); rows of row_bytes() each, [n_kv_heads][B].
  const uint8_t* BlockBytesOf(SeqId seq, int layer, int64_t block) const {
    return BlockData(seqs_[seq].tables[static_cast<size_t>(layer)][static_cast<size_t>(block)]);
  }
  int64_t v_half() const { return v_half_; }
  int64_t row_bytes() const { return row_bytes_; }

 private:
  PagedKvCache(const Config& config, std::unique_ptr<BlockPool> pool);

  // Byte offsets inside a block: the row of K head h, slot t at KOffset(h, t); V after all K.
  int64_t KOffset(int h, int64_t t) const {
    return (static_cast<int64_t>(h) * block_size_ + t) * row_bytes_;
  }
  int64_t VOffset(int h, int64_t t) const { return v_half_ + KOffset(h, t); }
  // Calls f(layer, block, byte offset) for every stored row of tokens [0, length): per layer and
  // block, the K rows of each head, then the V rows (the image's order).
  template <typename F>
  void ForEachCommittedRow(int64_t length, F&& f) const {
    for (int l = 0; l < geometry_.n_layers; ++l) {
      for (int64_t b = 0; b * block_size_ < length; ++b) {
        const int64_t valid = std::min<int64_t>(block_size_, length - b * block_size_);
        for (int half = 0; half < 2; ++half) {
          for (int h = 0; h < geometry_.n_kv_heads; ++h) {
            for (int64_t t = 0; t < valid; ++t) f(l, b, half == 0 ? KOffset(h, t) : VOffset(h, t));
          }
        }
      }
    }
  }
  const uint8_t* BlockData(int32_t block) const {
    return reinterpret_cast<const uint8_t*>(pool_->data(block));
  }
  uint8_t* BlockData(int32_t block) { return reinterpret_cast<uint8_t*>(pool_->data(block)); }

  KvCacheGeometry geometry_;
  int block_size_;
  KvDtype dtype_;
  int64_t row_bytes_;  // KvRowBytes(dtype_, head_dim)
  int64_t v_half_;     // bytes of the K half of a block: n_kv_heads * B * row_bytes_
  std::unique_ptr<BlockPool> pool_;
  SequenceManager<int32_t> seqs_;  // one table per layer
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_KVCACHE_PAGED_KV_CACHE_H_
