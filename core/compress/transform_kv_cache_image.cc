// The transform-coded cache's sequence images (session snapshots, the session tiers). After the
// layout line and the committed length, `next_compress` (where the next Commit's coding starts),
// then per layer and per block of the sequence a kind byte: 0, a full block, its committed rows
// (per KV head keys, then per KV head values, fp16, [valid, head_dim] each); 1, a coded block,
// its CodedBlockBytes(layer) codes as stored. Only whole blocks are coded, so a coded block is
// never the partial last one.
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

constexpr uint8_t kFullBlock = 0;
constexpr uint8_t kCodedBlock = 1;

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

uint64_t TransformKvCache::CodesChecksum() const {
  Fnv1a h;
  for (const auto* codes : {config_.key_codes.get(), config_.value_codes.get()}) {
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
  return h.value();
}

std::string TransformKvCache::ImageLayout() const {
  const KvCacheGeometry& g = config_.geometry;
  return absl::StrFormat(
      "transform layers=%d kv_heads=%d head_dim=%d block=%d sinks=%d window=%d keys=%s "
      "codes=%016x",
      g.n_layers, g.n_kv_heads, g.head_dim, config_.block_size, config_.sink_tokens,
      config_.window_tokens, config_.key_rope.has_value() ? "pre-rope" : "post-rope",
      codes_checksum_);
}

absl::StatusOr<std::string> TransformKvCache::ExportSequence(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
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
  ImageReader r(image, "transform KV cache image");
  if (absl::Status st = r.ExpectLayout(ImageLayout()); !st.ok()) return st;
  const int bs = config_.block_size;
  const int64_t hd = config_.geometry.head_dim;
  const int n_kv = config_.geometry.n_kv_heads;
  // Bounded by the image (every block takes at least its kind byte), not by this pool: a pool
  // too small for it is RESOURCE_EXHAUSTED below, not a corrupt image.
  absl::StatusOr<int64_t> length = r.Int("length", 0, int64_t{1} << 40);
  if (!length.ok()) return length.status();
  const int64_t blocks = CeilDiv(*length, int64_t{bs});
  absl::StatusOr<int64_t> next_compress = r.Int("next_compress", 0, blocks);
  if (!next_compress.ok()) return next_compress.status();
  if (static_cast<uint64_t>(blocks * config_.geometry.n_layers) > r.left()) {
    return r.Corrupt(absl::StrFormat("%d tokens need %d blocks, it holds %d bytes", *length,
                                     blocks * config_.geometry.n_layers, r.left()));
  }

  // Every block read and checked before a page is taken: a corrupt image changes nothing.
  struct Part {
    bool coded = false;
    std::string_view bytes;
  };
  std::vector<Part> parts;
  parts.reserve(static_cast<size_t>(blocks * config_.geometry.n_layers));
  for (int l = 0; l < config_.geometry.n_layers; ++l) {
    for (int64_t b = 0; b < blocks; ++b) {
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
      const int64_t n = *kind == kCodedBlock ? CodedBlockBytes(l) : 2 * n_kv * valid * hd * 2;
      absl::StatusOr<std::string_view> bytes =
          r.Raw(*kind == kCodedBlock ? "coded block" : "full block rows", static_cast<uint64_t>(n));
      if (!bytes.ok()) return bytes.status();
      parts.push_back({*kind == kCodedBlock, *bytes});
    }
  }
  if (absl::Status st = r.ExpectEnd(); !st.ok()) return st;

  absl::StatusOr<SeqId> seq = CreateSequence();
  if (!seq.ok()) return seq.status();
  if (absl::Status st = Reserve(*seq, *length); !st.ok()) {
    (void)FreeSequence(*seq);
    return st;
  }
  Sequence& s = seqs_[*seq];
  for (int l = 0; l < config_.geometry.n_layers; ++l) {
    for (int64_t b = 0; b < blocks; ++b) {
      const Part& part = parts[static_cast<size_t>(l * blocks + b)];
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
        e = {slot.page, slot.index};
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
