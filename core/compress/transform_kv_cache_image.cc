// The transform-coded cache's sequence images (session snapshots, the session tiers; the format
// is transform_image.h's, shared with the CUDA backend's cache). Only whole blocks are coded, so
// a coded block is never the partial last one. A sequence with online refresh goes with its
// epochs (the codes its blocks were coded with and the one it codes new blocks with); its
// refresher's statistics stay behind (the importer's SetSequenceRefresh starts them empty).
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
  const int bs = config_.block_size;
  const int64_t hd = config_.geometry.head_dim;
  TransformImage image;
  image.length = s->length;
  image.next_compress = s->next_compress;
  image.blocks = CeilDiv(s->length, int64_t{bs});
  // The epochs beside the codec file's, each once, as image indices (1, 2, ...).
  std::vector<int32_t> ids;
  const auto index_of = [&](int32_t id) -> int64_t {
    if (id == 0) return 0;
    auto it = std::find(ids.begin(), ids.end(), id);
    if (it == ids.end()) it = ids.insert(ids.end(), id);
    return (it - ids.begin()) + 1;
  };
  image.current_epoch = index_of(s->epoch);
  for (int l = 0; l < config_.geometry.n_layers; ++l) {
    for (int64_t b = 0; b < image.blocks; ++b) {
      const Block& e = s->tables[static_cast<size_t>(l)][static_cast<size_t>(b)];
      if (e.slot >= 0) {
        image.parts.push_back(
            {.coded = true,
             .epoch = index_of(e.epoch),
             .bytes = std::string_view(
                 reinterpret_cast<const char*>(slabs_.data({e.page, e.slot})),
                 static_cast<size_t>(Epoch(e.epoch).bytes[static_cast<size_t>(l)]))});
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
      image.parts.push_back({.coded = false, .bytes = image.Own(std::move(rows))});
    }
  }
  for (int32_t id : ids) image.epochs.push_back(Epoch(id).codes);
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
  // The image's epochs, installed (each held here until the end: the blocks and the sequence
  // take their own references), as cache epoch ids by image index.
  std::vector<int32_t> ids = {0};
  for (const TransformCodes& codes : read->epochs) ids.push_back(AddEpoch(MakeEpoch(codes)));
  const auto release_held = [&] {
    for (size_t i = 1; i < ids.size(); ++i) ReleaseEpoch(ids[i]);
  };
  AcquireEpoch(ids[static_cast<size_t>(read->current_epoch)]);
  ReleaseEpoch(s.epoch);
  s.epoch = ids[static_cast<size_t>(read->current_epoch)];
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
          release_held();
          return absl::ResourceExhaustedError("KV cache full: no slot for a coded block");
        }
        std::memcpy(slabs_.data(slot), part.bytes.data(), part.bytes.size());
        const int32_t epoch = ids[static_cast<size_t>(part.epoch)];
        e = {slot.page, slot.index, epoch};
        AddBlockUse(s, l, epoch);
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
  release_held();
  if (absl::Status st = seqs_.Commit(*seq, *length); !st.ok()) {
    (void)FreeSequence(*seq);
    return st;
  }
  s.next_compress = *next_compress;
  if (key_unrope_.has_value()) EnsureRopeTable(blocks * bs);
  return *seq;
}

}  // namespace subspace
