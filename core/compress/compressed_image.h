// Images of the low-rank compressed caches (CompressedKvCache on the CPU, the CUDA backend's
// DeviceCompressedKvCache): one format and one layout line for both, so a session moves between
// a CPU and a GPU server (the device pool holds the bytes the CPU cache would:
// kernels/kv_layout.h).
//
// After the layout line: the committed length; next_compress; the epochs E, then each epoch's
// matrices per layer (p_q, p_k, p_v [n_kv, d, r], r_v [n_kv, r_v, d] as fp32); the sequence's
// current epoch (an index into them, -1 for none); then per layer: per block its kind (0 full,
// 1 compressed); a full block's committed rows (K of every head, then V, [valid, head_dim] each)
// at the full dtype; a compressed block's outlier mask, the epoch index of each KV head and its
// slot bytes as stored; then the layer's outlier count, positions and rows (K then V of every
// head per outlier).
// Read checks everything a cache then follows (every index in range, only whole blocks between
// the sinks and next_compress compressed, masks and outlier positions agreeing, every epoch
// used), so an import that builds from a read image cannot go out of bounds.
#ifndef SUBSPACE_CORE_COMPRESS_COMPRESSED_IMAGE_H_
#define SUBSPACE_CORE_COMPRESS_COMPRESSED_IMAGE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/base/coeff_codec.h"
#include "core/compress/basis.h"
#include "core/compress/compression_policy.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

// A sequence's image: what a compressed cache exports from and imports into.
struct CompressedImage {
  int64_t length = 0;
  int64_t next_compress = 0;
  int64_t blocks = 0;  // per layer
  std::vector<std::shared_ptr<const Basis>> epochs;
  int32_t current_epoch = -1;  // index into epochs; -1: none yet
  struct Block {
    bool compressed = false;
    uint64_t outliers = 0;        // compressed: bit t, token t is read from the outlier rows
    std::vector<int32_t> epochs;  // compressed: [n_kv] indices into `epochs`
    // Full: the committed rows [2][n_kv][valid, head_dim] at the full dtype; compressed: the
    // slot's bytes.
    std::string_view bytes;
  };
  struct Layer {
    std::vector<Block> blocks;
    std::vector<int64_t> outlier_pos;  // ascending
    std::string_view outlier_rows;     // [outliers][n_kv][2][head_dim] at the full dtype
  };
  std::vector<Layer> layers;
  // Keeps a view's bytes alive (the caller's, or, read from an image, the image's).
  std::string_view Own(std::string bytes);

 private:
  std::vector<std::unique_ptr<std::string>> owned_;
};

class CompressedImageFormat {
 public:
  // `policy` resolved (its ranks per layer), full blocks at `full_dtype` (fp16 or fp32).
  CompressedImageFormat(const KvCacheGeometry& geometry, int block_size, CoeffDtype full_dtype,
                        const CompressionPolicy& policy);

  const std::string& layout() const { return layout_; }
  // Bytes of a compressed block of `layer` as the caches store it (before the slab's rounding).
  int64_t slot_bytes(int layer) const { return slot_bytes_[static_cast<size_t>(layer)]; }
  int64_t row_bytes() const { return row_bytes_; }  // one token's row of one head, one side

  std::string Write(const CompressedImage& image) const;
  // DATA_LOSS for a corrupt image (naming what), FAILED_PRECONDITION for another layout line;
  // `max_tokens`: the longest sequence the importing pool could hold.
  absl::StatusOr<CompressedImage> Read(std::string_view image, int64_t max_tokens) const;

 private:
  KvCacheGeometry geometry_;
  int block_size_;
  CompressionPolicy policy_;
  std::string layout_;
  int64_t row_bytes_;
  std::vector<int64_t> slot_bytes_;  // [n_layers]
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_COMPRESSED_IMAGE_H_
