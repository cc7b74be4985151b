// CompressedKvCache images (session snapshots): the format is compressed_image.h's, shared with
// the CUDA backend's DeviceCompressedKvCache. Import builds only from an image Read has checked,
// so a corrupt image changes nothing. A refreshing sequence's image is the same: the refreshed
// bases are epochs like any other; its refresher's statistics stay behind (the importer's
// SetSequenceRefresh starts them empty).
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/base/int_math.h"
#include "core/compress/compressed_image.h"
#include "core/compress/compressed_kv_cache.h"

namespace subspace {

CompressedImageFormat CompressedKvCache::ImageFormat() const {
  return CompressedImageFormat(config_.geometry, config_.block_size, config_.full_dtype,
                               config_.policy);
}

std::string CompressedKvCache::ImageLayout() const { return ImageFormat().layout(); }

absl::StatusOr<std::string> CompressedKvCache::ExportSequence(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  const KvCacheGeometry& g = config_.geometry;
  const int n_kv = g.n_kv_heads, bs = config_.block_size;
  const CompressedImageFormat format = ImageFormat();
  // The epochs the sequence uses, each once, as image indices.
  std::vector<EpochId> epochs;
  auto index_of = [&](EpochId id) -> int32_t {
    if (id == kNoEpoch) return -1;
    auto it = std::find(epochs.begin(), epochs.end(), id);
    if (it != epochs.end()) return static_cast<int32_t>(it - epochs.begin());
    epochs.push_back(id);
    return static_cast<int32_t>(epochs.size() - 1);
  };
  CompressedImage image;
  image.length = s->length;
  image.next_compress = s->next_compress;
  image.blocks = CeilDiv(s->length, int64_t{bs});
  image.current_epoch = index_of(s->epoch);
  const auto row_bytes = static_cast<size_t>(format.row_bytes());
  for (int l = 0; l < g.n_layers; ++l) {
    const std::vector<BlockEntry>& table = s->tables[static_cast<size_t>(l)];
    const LayerState& ls = s->layers[static_cast<size_t>(l)];
    CompressedImage::Layer& li = image.layers.emplace_back();
    for (int64_t b = 0; b < image.blocks; ++b) {
      const BlockEntry& e = table[static_cast<size_t>(b)];
      CompressedImage::Block& bi = li.blocks.emplace_back();
      if (e.slot < 0) {
        const int64_t valid = std::min<int64_t>(bs, s->length - b * bs);
        std::string rows;
        for (int half = 0; half < 2; ++half) {
          for (int h = 0; h < n_kv; ++h) {
            rows.append(reinterpret_cast<const char*>(
                            FullAt(e.page, half == 0 ? KOffset(h, 0) : VOffset(h, 0))),
                        static_cast<size_t>(valid) * row_bytes);
          }
        }
        bi.bytes = image.Own(std::move(rows));
        continue;
      }
      bi.compressed = true;
      bi.outliers = e.outliers;
      for (int h = 0; h < n_kv; ++h) {
        bi.epochs.push_back(index_of(ls.block_epochs[static_cast<size_t>(b * n_kv + h)]));
      }
      bi.bytes = std::string_view(reinterpret_cast<const char*>(slabs_.data({e.page, e.slot})),
                                  static_cast<size_t>(format.slot_bytes(l)));
    }
    li.outlier_pos = ls.outlier_pos;
    std::string rows;
    for (size_t j = 0; j < ls.outlier_pos.size(); ++j) {
      const int32_t page = ls.outlier_pages[j / static_cast<size_t>(bs)];
      const int64_t slot = static_cast<int64_t>(j) % bs;
      for (int h = 0; h < n_kv; ++h) {
        rows.append(reinterpret_cast<const char*>(FullAt(page, KOffset(h, slot))), row_bytes);
        rows.append(reinterpret_cast<const char*>(FullAt(page, VOffset(h, slot))), row_bytes);
      }
    }
    li.outlier_rows = image.Own(std::move(rows));
  }
  for (EpochId id : epochs) image.epochs.push_back(epochs_.registry().GetShared(id));
  return format.Write(image);
}

absl::StatusOr<SeqId> CompressedKvCache::ImportSequence(std::string_view image) {
  const KvCacheGeometry& g = config_.geometry;
  const int n_kv = g.n_kv_heads, bs = config_.block_size;
  const CompressedImageFormat format = ImageFormat();
  absl::StatusOr<CompressedImage> read = format.Read(image, pool_->num_blocks() * bs);
  if (!read.ok()) return read.status();
  const int64_t* length = &read->length;
  const int64_t blocks = read->blocks;
  const uint64_t row_bytes = static_cast<uint64_t>(format.row_bytes());

  // --- Build: epochs (the default where bitwise equal), then pages ---
  absl::StatusOr<std::vector<EpochId>> adopted = epochs_.Adopt(read->epochs);
  if (!adopted.ok()) return adopted.status();
  const std::vector<EpochId>& ids = *adopted;
  auto release_ids = [&] {
    for (EpochId id : ids) epochs_.Release(id);
  };
  absl::StatusOr<SeqId> seq = CreateSequence();
  if (!seq.ok()) {
    release_ids();
    return seq.status();
  }
  auto fail = [&](absl::Status st) {
    (void)FreeSequence(*seq);
    release_ids();
    return st;
  };
  if (absl::Status st = Reserve(*seq, *length); !st.ok()) return fail(st);
  Sequence& s = seqs_[*seq];
  if (read->current_epoch >= 0) {
    if (absl::Status st =
            epochs_.SetSequenceEpoch(s, ids[static_cast<size_t>(read->current_epoch)]);
        !st.ok()) {
      return fail(st);
    }
  }
  for (int l = 0; l < g.n_layers; ++l) {
    const CompressedImage::Layer& li = read->layers[static_cast<size_t>(l)];
    LayerState& ls = s.layers[static_cast<size_t>(l)];
    std::vector<BlockEntry>& table = s.tables[static_cast<size_t>(l)];
    for (int64_t b = 0; b < blocks; ++b) {
      const CompressedImage::Block& bi = li.blocks[static_cast<size_t>(b)];
      BlockEntry& e = table[static_cast<size_t>(b)];
      if (!bi.compressed) {
        const int64_t valid = std::min<int64_t>(bs, *length - b * bs);
        const char* src = bi.bytes.data();
        for (int half = 0; half < 2; ++half) {
          for (int h = 0; h < n_kv; ++h) {
            for (int64_t t = 0; t < valid; ++t, src += row_bytes) {
              std::memcpy(FullAt(e.page, half == 0 ? KOffset(h, t) : VOffset(h, t)), src,
                          row_bytes);
            }
          }
        }
        continue;
      }
      // As CompressBlock: the page goes back before the slot is taken.
      pool_->Free(e.page);
      const SlabAllocator::Slot slot = slabs_.Allocate(slab_class_[static_cast<size_t>(l)]);
      if (slot.page < 0) {  // cannot happen (the freed page is there); keep the table whole
        e = BlockEntry{pool_->Allocate(BlockKind::kFull), -1, 0};
        return fail(absl::InternalError("no slot for a compressed block after freeing a page"));
      }
      std::memcpy(slabs_.data(slot), bi.bytes.data(), bi.bytes.size());
      e = BlockEntry{slot.page, slot.index, bi.outliers};
      for (int h = 0; h < n_kv; ++h) {
        const EpochId id = ids[static_cast<size_t>(bi.epochs[static_cast<size_t>(h)])];
        ls.block_epochs[static_cast<size_t>(b * n_kv + h)] = id;
        (void)epochs_.Acquire(id);
        AddEpochUse(ls, l, id);
      }
    }
    const char* src = li.outlier_rows.data();
    for (size_t j = 0; j < li.outlier_pos.size(); ++j) {
      if (j % static_cast<size_t>(bs) == 0) {
        const int32_t page = pool_->Allocate(BlockKind::kOutlier);
        if (page < 0) {
          return fail(absl::ResourceExhaustedError("KV cache full: no page for outlier tokens"));
        }
        ls.outlier_pages.push_back(page);
      }
      const int32_t page = ls.outlier_pages.back();
      const int64_t slot = static_cast<int64_t>(j) % bs;
      for (int h = 0; h < n_kv; ++h) {
        std::memcpy(FullAt(page, KOffset(h, slot)), src, row_bytes);
        src += row_bytes;
        std::memcpy(FullAt(page, VOffset(h, slot)), src, row_bytes);
        src += row_bytes;
      }
      ls.outlier_pos.push_back(li.outlier_pos[j]);
    }
  }
  s.next_compress = read->next_compress;
  if (absl::Status st = seqs_.Commit(*seq, *length); !st.ok()) return fail(st);
  release_ids();  // the blocks and the sequence hold their own references now
  return *seq;
}

}  // namespace subspace
