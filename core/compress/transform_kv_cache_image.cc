// The transform-coded caches' sequence images (session snapshots, the session tiers; the format
// is in transform_kv_cache.h, shared with the CUDA backend's cache). Only whole blocks are coded,
// so a coded block is never the partial last one.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/compress/transform_kv_cache.h"
#include "core/kvcache/sequence_image.h"

namespace subspace {

namespace {

constexpr auto kFullBlock = static_cast<uint8_t>(TransformImageBlock::kFull);
constexpr auto kCodedBlock = static_cast<uint8_t>(TransformImageBlock::kCoded);

class Fnv1a {
 public:
  void Add(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) h_ = (h_ ^ b[i]) * 0x100000001b3ull;
  }
  template <typename T>
  void AddVector(const std::vector<T>& v) {
    const uint64_t n = v.size();
    Add(&n, sizeof(n));
    Add(v.data(), v.size() * sizeof(T));
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

}  // namespace

std::string TransformImageLayout(const KvCacheGeometry& g, int block_size, int sink_tokens,
                                 int window_tokens, bool pre_rope_keys,
                                 const std::vector<TransformCode>& key_codes,
                                 const std::vector<TransformCode>& value_codes) {
  Fnv1a h;
  for (const auto* codes : {&key_codes, &value_codes}) {
    for (const TransformCode& c : *codes) {
      h.Add(&c.dim, sizeof(c.dim));
      h.AddVector(c.mean);
      h.AddVector(c.scale);
      h.AddVector(c.basis);
      for (const ComponentQuantizer& q : c.components) {
        h.Add(&q.bits, sizeof(q.bits));
        h.Add(&q.offset, sizeof(q.offset));
        h.Add(&q.step, sizeof(q.step));
      }
    }
  }
  return absl::StrFormat(
      "transform layers=%d kv_heads=%d head_dim=%d block=%d sinks=%d window=%d keys=%s "
      "codes=%016x",
      g.n_layers, g.n_kv_heads, g.head_dim, block_size, sink_tokens, window_tokens,
      pre_rope_keys ? "pre-rope" : "post-rope", h.value());
}

int64_t TransformCodedBlockBytes(const std::vector<TransformCode>& key_codes,
                                 const std::vector<TransformCode>& value_codes, int layer,
                                 int n_kv_heads, int block_size) {
  int64_t bytes = 0;
  for (const auto* codes : {&key_codes, &value_codes}) {
    for (int h = 0; h < n_kv_heads; ++h) {
      bytes += LayOutCodedRun((*codes)[static_cast<size_t>(layer * n_kv_heads + h)], block_size)
                   .run_bytes;
    }
  }
  return bytes;
}

absl::StatusOr<TransformImage> ReadTransformImage(std::string_view image, std::string_view layout,
                                                  const KvCacheGeometry& g, int bs,
                                                  std::span<const int64_t> coded_bytes) {
  ImageReader r(image, "transform KV cache image");
  if (absl::Status st = r.ExpectLayout(layout); !st.ok()) return st;
  const int64_t hd = g.head_dim;
  const int n_kv = g.n_kv_heads;
  TransformImage out;
  // Bounded by the image (every block takes at least its kind byte), not by a pool: a pool too
  // small for it is the importer's RESOURCE_EXHAUSTED, not a corrupt image.
  absl::StatusOr<int64_t> length = r.Int("length", 0, int64_t{1} << 40);
  if (!length.ok()) return length.status();
  out.length = *length;
  out.blocks = CeilDiv(*length, int64_t{bs});
  absl::StatusOr<int64_t> next_compress = r.Int("next_compress", 0, out.blocks);
  if (!next_compress.ok()) return next_compress.status();
  out.next_compress = *next_compress;
  if (static_cast<uint64_t>(out.blocks * g.n_layers) > r.left()) {
    return r.Corrupt(absl::StrFormat("%d tokens need %d blocks, it holds %d bytes", *length,
                                     out.blocks * g.n_layers, r.left()));
  }
  out.parts.reserve(static_cast<size_t>(out.blocks * g.n_layers));
  for (int l = 0; l < g.n_layers; ++l) {
    for (int64_t b = 0; b < out.blocks; ++b) {
      absl::StatusOr<uint8_t> kind = r.U8("block kind");
      if (!kind.ok()) return kind.status();
      const int64_t valid = std::min<int64_t>(bs, *length - b * bs);
      if (*kind == kCodedBlock && valid != bs) {
        return r.Corrupt(absl::StrFormat("layer %d block %d is coded but holds %d of %d tokens", l,
                                         b, valid, bs));
      }
      if (*kind != kFullBlock && *kind != kCodedBlock) {
        return r.Corrupt(absl::StrFormat("layer %d block %d has kind %d", l, b, *kind));
      }
      const int64_t n =
          *kind == kCodedBlock ? coded_bytes[static_cast<size_t>(l)] : 2 * n_kv * valid * hd * 2;
      absl::StatusOr<std::string_view> bytes =
          r.Raw(*kind == kCodedBlock ? "coded block" : "full block rows", static_cast<uint64_t>(n));
      if (!bytes.ok()) return bytes.status();
      out.parts.push_back({*kind == kCodedBlock, *bytes});
    }
  }
  if (absl::Status st = r.ExpectEnd(); !st.ok()) return st;
  return out;
}

std::string TransformKvCache::ImageLayout() const { return image_layout_; }

absl::StatusOr<std::string> TransformKvCache::ExportSequence(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  bool refreshed = s->refresh.method != RefreshMethod::kNone;
  for (const std::vector<EpochUse>& live : s->epoch_uses) {
    for (const EpochUse& u : live) refreshed = refreshed || u.epoch != 0;
  }
  if (refreshed) {
    return absl::FailedPreconditionError(
        "a sequence with online refresh of its codes has no image yet: its refresher's "
        "statistics and refreshed epochs are not in the format");
  }
  const int bs = config_.block_size;
  const int64_t hd = config_.geometry.head_dim;
  ImageWriter w;
  w.Bytes(ImageLayout());
  w.I64(s->length);
  w.I64(s->next_compress);
  const int64_t blocks = CeilDiv(s->length, int64_t{bs});
  for (int l = 0; l < config_.geometry.n_layers; ++l) {
    for (int64_t b = 0; b < blocks; ++b) {
      const Block& e = s->tables[static_cast<size_t>(l)][static_cast<size_t>(b)];
      if (e.slot >= 0) {
        w.U8(kCodedBlock);
        w.Raw(slabs_.data({e.page, e.slot}), static_cast<size_t>(CodedBlockBytes(l)));
        continue;
      }
      w.U8(kFullBlock);
      const int64_t valid = std::min<int64_t>(bs, s->length - b * bs);
      for (int side = 0; side < 2; ++side) {
        for (int h = 0; h < config_.geometry.n_kv_heads; ++h) {
          w.Raw(FullAt(e.page, side == 0 ? KOffset(h, 0) : VOffset(h, 0)),
                static_cast<size_t>(valid * hd * 2));
        }
      }
    }
  }
  return w.Take();
}

absl::StatusOr<SeqId> TransformKvCache::ImportSequence(std::string_view image) {
  const int bs = config_.block_size;
  const int64_t hd = config_.geometry.head_dim;
  const int n_kv = config_.geometry.n_kv_heads;
  // Every block read and checked before a page is taken: a corrupt image changes nothing.
  absl::StatusOr<TransformImage> read =
      ReadTransformImage(image, image_layout_, config_.geometry, bs, coded_bytes_);
  if (!read.ok()) return read.status();
  const int64_t* length = &read->length;
  const int64_t* next_compress = &read->next_compress;
  const int64_t blocks = read->blocks;
  const std::vector<TransformImage::Part>& parts = read->parts;

  absl::StatusOr<SeqId> seq = CreateSequence();
  if (!seq.ok()) return seq.status();
  if (absl::Status st = Reserve(*seq, *length); !st.ok()) {
    (void)FreeSequence(*seq);
    return st;
  }
  Sequence& s = seqs_[*seq];
  for (int l = 0; l < config_.geometry.n_layers; ++l) {
    for (int64_t b = 0; b < blocks; ++b) {
      const TransformImage::Part& part = parts[static_cast<size_t>(l * blocks + b)];
      Block& e = s.tables[static_cast<size_t>(l)][static_cast<size_t>(b)];
      if (part.coded) {
        pool_->Free(e.page);  // before the slot, as Commit does: never more than a page short
        const SlabAllocator::Slot slot = slabs_.Allocate(slab_class_[static_cast<size_t>(l)]);
        if (slot.page < 0) {
          e.page = pool_->Allocate(BlockKind::kFull);  // the page just freed: FreeSequence frees it
          (void)FreeSequence(*seq);
          return absl::ResourceExhaustedError("KV cache full: no slot for a coded block");
        }
        std::memcpy(slabs_.data(slot), part.bytes.data(), part.bytes.size());
        e = {slot.page, slot.index, 0};
        AddBlockUse(s, l, 0);
        continue;
      }
      const int64_t row_bytes = std::min<int64_t>(bs, *length - b * bs) * hd * 2;
      for (int side = 0; side < 2; ++side) {
        for (int h = 0; h < n_kv; ++h) {
          std::memcpy(FullAt(e.page, side == 0 ? KOffset(h, 0) : VOffset(h, 0)),
                      part.bytes.data() + (side * n_kv + h) * row_bytes,
                      static_cast<size_t>(row_bytes));
        }
      }
    }
  }
  // The bookkeeping's commit only: the blocks are as the exporting cache had coded them.
  if (absl::Status st = seqs_.Commit(*seq, *length); !st.ok()) {
    (void)FreeSequence(*seq);
    return st;
  }
  s.next_compress = *next_compress;
  if (key_unrope_.has_value()) EnsureRopeTable(blocks * bs);
  return *seq;
}

}  // namespace subspace
