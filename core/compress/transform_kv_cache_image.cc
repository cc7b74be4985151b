// The transform-coded cache's sequence images (session snapshots, the session tiers; the format
// is transform_image.h's, shared with the CUDA backend's cache). Only whole blocks are coded, so
// a coded block is never the partial last one.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/int_math.h"
#include "core/compress/transform_kv_cache.h"

namespace subspace {

std::string TransformKvCache::ImageLayout() const { return image_format_.layout(); }

int64_t TransformKvCache::MaxImageBlocks() const {
  int64_t per_page = 1;
  for (int l = 0; l < config_.geometry.n_layers; ++l) {
    per_page = std::max(per_page, pool_->block_bytes() / std::max<int64_t>(CodedBlockBytes(l), 1));
  }
  return pool_->num_blocks() * per_page;
}

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
  TransformImage image;
  image.length = s->length;
  image.next_compress = s->next_compress;
  image.blocks = CeilDiv(s->length, int64_t{bs});
  for (int l = 0; l < config_.geometry.n_layers; ++l) {
    for (int64_t b = 0; b < image.blocks; ++b) {
      const Block& e = s->tables[static_cast<size_t>(l)][static_cast<size_t>(b)];
      if (e.slot >= 0) {
        image.parts.push_back(
            {true, std::string_view(reinterpret_cast<const char*>(slabs_.data({e.page, e.slot})),
                                    static_cast<size_t>(CodedBlockBytes(l)))});
        continue;
      }
      const int64_t valid = std::min<int64_t>(bs, s->length - b * bs);
      std::string rows;
      for (int side = 0; side < 2; ++side) {
        for (int h = 0; h < config_.geometry.n_kv_heads; ++h) {
          rows.append(reinterpret_cast<const char*>(
                          FullAt(e.page, side == 0 ? KOffset(h, 0) : VOffset(h, 0))),
                      static_cast<size_t>(valid * hd * 2));
        }
      }
      image.parts.push_back({false, image.Own(std::move(rows))});
    }
  }
  return image_format_.Write(image, /*entropy_coded=*/false);
}

absl::StatusOr<SeqId> TransformKvCache::ImportSequence(std::string_view image) {
  const int bs = config_.block_size;
  const int64_t hd = config_.geometry.head_dim;
  const int n_kv = config_.geometry.n_kv_heads;
  // Every block read and checked before a page is taken: a corrupt image changes nothing.
  absl::StatusOr<TransformImage> read = image_format_.Read(image, MaxImageBlocks());
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
