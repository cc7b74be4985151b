// The transform-coded KV cache in device memory (the CUDA backend's --kv-cache transform): the
// CPU cache's policy (core/compress/transform_kv_cache.h: fp16 sinks and window, every older
// block coded by the transform codec, keys before RoPE when the codec says so) over the
// kernels' layout (kernels/transform_blocks.h; a coded block is the CPU cache's byte for byte).
// The bytes live in a TransformKvStore; this class holds the host bookkeeping.
//
// As DeviceCompressedKvCache: one block table per sequence serves every layer (the policy is
// the same in every layer), a slab slot is sized for the layer with the largest coded block and
// a smaller layer addresses slot s at s times its own slot size; coding is queued at Commit and
// issued by Flush as one batch, the queued blocks' full pages freed once it is issued (one page
// of headroom kept for a slab page). Truncation into a coded block decodes it back into a full
// page. The decode kernel reads coded blocks by decoding each into fp16 rows in shared memory
// (kernels/decode_attention.h, DecodeAttentionParams::transform); a prefill chunk's coded
// history is decoded into scratch pages for the prefill kernel. Reading the codes in code space
// (values always, keys coded after RoPE) is the bandwidth work of issue 32.
#ifndef SUBSPACE_CUDA_DEVICE_TRANSFORM_KV_CACHE_H_
#define SUBSPACE_CUDA_DEVICE_TRANSFORM_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/compress/compression_policy.h"
#include "core/compress/transform_codec.h"
#include "core/compress/transform_image.h"
#include "core/kvcache/block_pool.h"
#include "core/kvcache/kv_cache.h"
#include "core/kvcache/sequence_manager.h"
#include "cuda/device_kv_cache.h"
#include "cuda/transform_kv_store.h"
#include "kernels/kv_layout.h"

namespace subspace::cuda {

struct DeviceTransformKvCacheConfig {
  KvCacheGeometry geometry;
  int block_size = 16;  // B, 1..64
  int sink_tokens = CompressionPolicy::kDefaultSinkTokens;
  int window_tokens = CompressionPolicy::kDefaultWindowTokens;
  // Layer l, KV head h at [l * n_kv_heads + h] (TransformKvCacheConfig's).
  std::shared_ptr<const std::vector<TransformCode>> key_codes, value_codes;
  int64_t num_pages = 0;       // pages in each layer's slice of the store's pool
  bool pre_rope_keys = false;  // the codec codes keys before RoPE (the image layout says so)
};

// Beyond KvCacheStats (tests, benchmarks).
struct DeviceTransformKvCacheDetail {
  int64_t pages_full = 0;        // per layer
  int64_t pages_coded = 0;       // slab pages, per layer
  int64_t blocks_coded = 0;      // per layer
  int64_t codings_deferred = 0;  // blocks left full for a while: no page for a slab
};

class DeviceTransformKvCache final : public DeviceKvCache {
 public:
  struct Block {
    int32_t page = -1;
    int32_t slot = kernels::kFullBlock;
  };

  // The layouts the kernels read: per layer, full pages and that layer's coded slot.
  static std::vector<kernels::KvPoolLayout> Layouts(const DeviceTransformKvCacheConfig& config);

  // INVALID_ARGUMENT for a bad geometry or block size, codes missing or of the wrong count or
  // dimension, or a coded block larger than a page: all of Create's checks but the pool's.
  static absl::Status Validate(const DeviceTransformKvCacheConfig& config);
  // Validate's INVALID_ARGUMENT, and for fewer than two pages or no store.
  static absl::StatusOr<std::unique_ptr<DeviceTransformKvCache>> Create(
      const DeviceTransformKvCacheConfig& config, std::shared_ptr<TransformKvStore> store);

  const KvCacheGeometry& geometry() const override { return config_.geometry; }
  int block_size() const override { return config_.block_size; }
  absl::StatusOr<SeqId> CreateSequence() override;
  absl::Status FreeSequence(SeqId seq) override;
  int64_t Length(SeqId seq) const override { return seqs_.Length(seq); }
  absl::Status Reserve(SeqId seq, int64_t n) override;
  int64_t BlocksNeeded(SeqId seq, int64_t n) const override;
  // Commits, then queues every full block that has left the window (and the sinks) for coding.
  absl::Status Commit(SeqId seq, int64_t length) override;
  // A coded block cut in the middle is decoded back into a full page so new tokens can follow
  // it; without a free page now, the next Reserve does it (and counts the page).
  absl::Status Truncate(SeqId seq, int64_t length) override;
  KvCacheStats Stats() const override { return seqs_.Stats(config_.geometry); }
  DeviceTransformKvCacheDetail Detail() const;

  // Images (session snapshots, tiers) in the transform caches' one format and layout line
  // (core/compress/transform_image.h): a session moves between this cache and the CPU's when
  // model, codec and policy agree. Export issues queued codings first and reads through the
  // store. Import refuses (FAILED_PRECONDITION) an image whose block is coded in some layers
  // only: one table serves every layer here.
  std::string ImageLayout() const override { return image_format_.layout(); }
  absl::StatusOr<std::string> CompactImage(std::string_view image) const override {
    return image_format_.Compact(image);
  }
  absl::StatusOr<std::string> ExportSequence(SeqId seq) const override;
  absl::StatusOr<SeqId> ImportSequence(std::string_view image) override;

  // --- DeviceKvCache ---
  absl::Status Flush() override;
  DeviceBlockRef BlockOf(SeqId seq, int64_t b) const override;
  void DescribeDecode(SeqId seq, int64_t length, DecodeSeqDesc* desc) const override;
  DecodePlanBounds plan_bounds() const override {
    return {.layout = layouts_[static_cast<size_t>(widest_layer_)],
            .num_pages = config_.num_pages,
            .num_basis_epochs = 1};
  }

  const kernels::KvPoolLayout& layout(int layer) const {
    return layouts_[static_cast<size_t>(layer)];
  }
  // Blocks of `seq` in position order; empty for an unknown id.
  std::span<const Block> BlockTable(SeqId seq) const;

 private:
  struct SequenceState {
    int64_t next_compress = 0;  // first block not yet considered for coding
  };
  using Sequences = SequenceManager<Block, SequenceState>;
  using Sequence = Sequences::Sequence;

  static constexpr int64_t kCodingHeadroom = 1;

  DeviceTransformKvCache(const DeviceTransformKvCacheConfig& config,
                         std::vector<kernels::KvPoolLayout> layouts,
                         std::unique_ptr<BlockPool> pool, std::shared_ptr<TransformKvStore> store);

  // false: no slab slot to be had (the block stays full for now).
  absl::StatusOr<bool> QueueCoding(Sequence& s, int64_t b);
  void FreeBlock(Block& e);
  absl::Status ExpandBlock(Sequence& s, int64_t b);

  DeviceTransformKvCacheConfig config_;
  CompressionPolicy policy_;                    // sinks and window
  std::vector<kernels::KvPoolLayout> layouts_;  // [n_layers]
  int widest_layer_ = 0;
  std::unique_ptr<BlockPool> pool_;  // page ids only: the bytes are the store's
  SlabAllocator slabs_;
  int slab_class_ = 0;
  std::shared_ptr<TransformKvStore> store_;
  Sequences seqs_;
  int64_t blocks_coded_ = 0;
  int64_t codings_deferred_ = 0;
  TransformImageFormat image_format_;  // of this cache's images
  // Queued codings; their full pages are freed once the batch is issued.
  std::vector<int32_t> pending_src_, pending_dst_page_, pending_dst_slot_, pending_first_;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_DEVICE_TRANSFORM_KV_CACHE_H_
