// Images of the transform-coded caches (TransformKvCache, the CUDA backend's
// DeviceTransformKvCache): one format for both, so a session moves between them.
//
// After the layout line, the committed length, `next_compress` (where the next Commit's coding
// starts) and the codes' form (u8: bit 0, range-coded, else as stored; bit 1, with epochs):
//   - with epochs only (a sequence with online refresh: codes beside the cache's own): their
//     count E (i64), each epoch's codes (every layer's and KV head's key codes, then value
//     codes: a scale flag u8, the mean, the scale if flagged, the basis as f32, then per
//     component its bits u8, offset and step f32), then the epoch new blocks are coded with
//     (i64, 0..E). Epoch 0 is the cache's own codes (the layout line's), epoch i the image's
//     i-th; each one's coded blocks fit epoch 0's (a cache's slot), and each is used;
//   - per layer, a kind byte per block: 0, a full block; 1, a coded block (always a whole one),
//     followed, with epochs, by the epoch that coded it (i32);
//   - the full blocks' committed rows (per KV head keys, then per KV head values, fp16,
//     [valid, head_dim] each), layer by layer, as two byte planes: every full block's high
//     bytes, then every one's low bytes (the high bytes -- sign, exponent -- then compress well
//     in a snapshot, whose zstd sees them together);
//   - per layer, its coded blocks' codes: as stored (each block's bytes in order, as many as its
//     epoch's codes take; what the host tier keeps, a copy), or range-coded
//     (core/base/range_coder.h: what goes to disk and over the network): u64 bytes, then one
//     stream holding, per epoch in order, per run of a coded block of it (every head's keys,
//     then every head's values, CodedRunLayout order) and per component with bits, that
//     component's code of every token of every coded block of that epoch in order. Each
//     component's codes are modelled adaptively, conditioned on the previous token's code (its
//     top 3 bits).
// Decoded, a coded block's bytes are exactly what the cache stores. An image without epochs is
// written as before online refresh existed, so older images still load.
#ifndef SUBSPACE_CORE_COMPRESS_TRANSFORM_IMAGE_H_
#define SUBSPACE_CORE_COMPRESS_TRANSFORM_IMAGE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/compress/transform_codec.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

// A coded block's bytes of one layer as the cache stores them (before any slab rounding).
int64_t TransformCodedBlockBytes(const std::vector<TransformCode>& key_codes,
                                 const std::vector<TransformCode>& value_codes, int layer,
                                 int n_kv_heads, int block_size);

enum class TransformImageBlock : uint8_t { kFull = 0, kCoded = 1 };
// An image's blocks, [layer * blocks + b]: what a cache exports from and imports into.
struct TransformImage {
  int64_t length = 0;
  int64_t next_compress = 0;
  int64_t blocks = 0;  // per layer
  // Codes beside the cache's own (a sequence's refreshed epochs): image epoch i + 1 is
  // epochs[i]; epoch 0 is the cache's. Each holds n_layers x n_kv_heads codes a side.
  std::vector<TransformCodes> epochs;
  int64_t current_epoch = 0;  // the epoch the sequence codes new blocks with
  struct Part {
    bool coded = false;
    int64_t epoch = 0;       // coded: the image epoch of its codes
    std::string_view bytes;  // full rows [2][n_kv][valid, head_dim] fp16, or a block's codes
  };
  std::vector<Part> parts;
  // Keeps `bytes` alive (a part's bytes are the caller's or, read from an image, here).
  std::string_view Own(std::string bytes);

 private:
  std::vector<std::unique_ptr<std::string>> owned_;
};

class TransformImageFormat {
 public:
  // The layout line (geometry, block size, sinks and window, where keys are coded, a checksum
  // of every code's numbers) and each layer's runs, from the cache's (epoch 0) codes.
  TransformImageFormat(const KvCacheGeometry& geometry, int block_size, int sink_tokens,
                       int window_tokens, bool pre_rope_keys,
                       const std::vector<TransformCode>& key_codes,
                       const std::vector<TransformCode>& value_codes);

  const std::string& layout() const { return layout_; }
  int64_t coded_bytes(int layer) const { return layers_[static_cast<size_t>(layer)].bytes; }

  // An image of `image` (its parts in order, coded ones of coded_bytes each): `entropy_coded`,
  // its codes range-coded (~0.8 of their bytes, ~10 ns a bit: for disk and the network), else
  // as stored (a copy: for the host tier).
  std::string Write(const TransformImage& image, bool entropy_coded) const;
  // Every block read and checked (an epoch's codes too: finite numbers, widths of 0..8 bits,
  // blocks no larger than epoch 0's): DATA_LOSS for a corrupt image, FAILED_PRECONDITION for
  // another layout line, RESOURCE_EXHAUSTED (before decoding) for a range-coded image of more than
  // `max_blocks` block-layers (what the importing pool could hold at most: decoded codes are
  // bounded by it; a stored-form image holds its codes, so its bound is its own size).
  // A stored-form image's coded parts are views of `image`, which must outlive the result.
  absl::StatusOr<TransformImage> Read(std::string_view image, int64_t max_blocks) const;
  // An image in the entropy-coded form; one already in it comes back as it is, unchecked
  // (ImportSequence checks it). Thread-safe: it reads nothing but this format. DATA_LOSS /
  // FAILED_PRECONDITION as Read for a stored-form image.
  absl::StatusOr<std::string> Compact(std::string_view image) const;

 private:
  struct Run {
    int64_t at = 0;                // in a coded block
    std::vector<int> bits;         // [active], CodedRunLayout order
    std::vector<int64_t> byte_at;  // [active] in the run
  };
  struct Layer {
    std::vector<Run> runs;  // every head's keys, then every head's values
    int64_t bytes = 0;
  };
  // Each layer's runs of a block coded with `keys` and `values`.
  std::vector<Layer> LayersOf(const std::vector<TransformCode>& keys,
                              const std::vector<TransformCode>& values) const;
  KvCacheGeometry geometry_;
  int block_size_;
  std::string layout_;
  std::vector<Layer> layers_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_TRANSFORM_IMAGE_H_
