// DeviceCompressedKvCache images (session snapshots, tiers, Export): CompressedKvCache's format
// and layout line (core/compress/compressed_image.h, full blocks at fp16), so a session moves
// between this cache and a CPU compressed cache with fp16 full blocks, either way. The device
// pool holds the bytes the CPU cache would (kernels/kv_layout.h): a compressed block's slot and
// a full page's rows go out and in as they are.
//
// This cache makes one decision for every layer (a block is compressed, with one epoch for every
// KV head, and its outliers flagged, in all layers at once); the CPU cache decides per layer and
// head. An image whose decisions differ between layers or heads is refused with
// FAILED_PRECONDITION naming the block: the session keeps its tokens and prefills again.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/compress/compressed_image.h"
#include "cuda/device_compressed_kv_cache.h"

namespace subspace::cuda {

CompressedImageFormat DeviceCompressedKvCache::ImageFormat() const {
  return CompressedImageFormat(config_.geometry, config_.block_size, CoeffDtype::kFp16,
                               config_.policy);
}

std::string DeviceCompressedKvCache::ImageLayout() const { return ImageFormat().layout(); }

absl::StatusOr<std::string> DeviceCompressedKvCache::ExportSequence(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  // Queued compressions land first (their slots are in the table already) and their outliers
  // move to the outlier pages.
  if (absl::Status st = const_cast<DeviceCompressedKvCache*>(this)->Flush(); !st.ok()) return st;
  const KvCacheGeometry& g = config_.geometry;
  const int n_kv = g.n_kv_heads, hd = g.head_dim, bs = config_.block_size;
  const CompressedImageFormat format = ImageFormat();
  std::vector<EpochId> epochs;  // image index -> epoch
  auto index_of = [&](EpochId id) -> int32_t {
    if (id == kNoEpoch) return -1;
    auto it = std::find(epochs.begin(), epochs.end(), id);
    if (it == epochs.end()) it = epochs.insert(epochs.end(), id);
    return static_cast<int32_t>(it - epochs.begin());
  };
  CompressedImage image;
  image.length = s->length;
  image.next_compress = s->next_compress;
  image.blocks = CeilDiv(s->length, int64_t{bs});
  image.current_epoch = index_of(s->epoch);
  const std::vector<Block>& table = s->tables[0];
  std::vector<uint8_t> page(static_cast<size_t>(layouts_[0].page_bytes));
  const auto row_bytes = static_cast<size_t>(hd) * 2;
  for (int l = 0; l < g.n_layers; ++l) {
    const kernels::KvPoolLayout& lay = layouts_[static_cast<size_t>(l)];
    CompressedImage::Layer& li = image.layers.emplace_back();
    for (int64_t b = 0; b < image.blocks; ++b) {
      const Block& e = table[static_cast<size_t>(b)];
      CompressedImage::Block& bi = li.blocks.emplace_back();
      std::string bytes;
      if (e.slot != kernels::kFullBlock) {
        bi.compressed = true;
        bi.outliers = e.outliers;
        bi.epochs.assign(static_cast<size_t>(n_kv),
                         index_of(s->block_epochs[static_cast<size_t>(b)]));
        bytes.resize(static_cast<size_t>(format.slot_bytes(l)));
        if (absl::Status st =
                store_->Read(l, lay.Slot(e.page, e.slot),
                             {reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()});
            !st.ok()) {
          return st;
        }
      } else {
        if (absl::Status st = store_->Read(l, lay.Page(e.page), page); !st.ok()) return st;
        const int64_t valid = std::min<int64_t>(bs, s->length - b * bs);
        for (int side = 0; side < 2; ++side) {
          for (int h = 0; h < n_kv; ++h) {
            bytes.append(reinterpret_cast<const char*>(page.data()) +
                             (side == 0 ? lay.FullK(0, h) : lay.FullV(0, h)),
                         static_cast<size_t>(valid) * row_bytes);
          }
        }
      }
      bi.bytes = image.Own(std::move(bytes));
    }
    // The outliers, B to a page in position order: the same tokens in every layer.
    li.outlier_pos = s->outlier_pos;
    std::string rows;
    for (size_t j = 0; j < s->outlier_pos.size(); ++j) {
      const auto slot = static_cast<int64_t>(j % static_cast<size_t>(bs));
      if (slot == 0) {
        const int32_t p = s->outlier_pages[j / static_cast<size_t>(bs)];
        if (absl::Status st = store_->Read(l, lay.Page(p), page); !st.ok()) return st;
      }
      for (int h = 0; h < n_kv; ++h) {
        for (int side = 0; side < 2; ++side) {
          rows.append(reinterpret_cast<const char*>(page.data()) +
                          (side == 0 ? lay.FullK(0, h) : lay.FullV(0, h)) +
                          slot * static_cast<int64_t>(row_bytes),
                      row_bytes);
        }
      }
    }
    li.outlier_rows = image.Own(std::move(rows));
  }
  for (EpochId id : epochs) image.epochs.push_back(epochs_.registry().GetShared(id));
  return format.Write(image);
}

absl::StatusOr<SeqId> DeviceCompressedKvCache::ImportSequence(std::string_view image) {
  const KvCacheGeometry& g = config_.geometry;
  const int n_kv = g.n_kv_heads, hd = g.head_dim, bs = config_.block_size;
  const CompressedImageFormat format = ImageFormat();
  absl::StatusOr<CompressedImage> read = format.Read(image, config_.num_pages * bs);
  if (!read.ok()) return read.status();
  const int64_t blocks = read->blocks;
  const std::vector<CompressedImage::Layer>& layers = read->layers;
  // One decision for every layer and head (see the top of the file).
  for (int64_t b = 0; b < blocks; ++b) {
    const CompressedImage::Block& first = layers[0].blocks[static_cast<size_t>(b)];
    for (int l = 0; l < g.n_layers; ++l) {
      const CompressedImage::Block& bi =
          layers[static_cast<size_t>(l)].blocks[static_cast<size_t>(b)];
      const bool alike = bi.compressed == first.compressed && bi.outliers == first.outliers &&
                         bi.epochs == first.epochs &&
                         std::all_of(bi.epochs.begin(), bi.epochs.end(),
                                     [&](int32_t e) { return e == bi.epochs[0]; });
      if (!alike) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "block %d is compressed, or flags outliers, or uses epochs, differently across layers "
            "or KV heads; this cache decides for every layer and head alike",
            b));
      }
    }
  }
  if (absl::Status st = Flush(); !st.ok()) return st;

  // --- Epochs: the default where bitwise equal, else installed (a basis-table entry each) ---
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
  if (absl::Status st = Reserve(*seq, read->length); !st.ok()) return fail(st);
  Sequence& s = seqs_[*seq];
  if (read->current_epoch >= 0) {
    if (absl::Status st =
            epochs_.SetSequenceEpoch(s, ids[static_cast<size_t>(read->current_epoch)]);
        !st.ok()) {
      return fail(st);
    }
  }

  // --- Blocks: full pages written, compressed ones swapped for a slot (as Commit does) ---
  const auto row_bytes = static_cast<size_t>(hd) * 2;
  std::vector<uint8_t> page(static_cast<size_t>(layouts_[0].page_bytes), 0);
  for (int64_t b = 0; b < blocks; ++b) {
    Block& e = s.tables[0][static_cast<size_t>(b)];
    const CompressedImage::Block& first = layers[0].blocks[static_cast<size_t>(b)];
    if (first.compressed) {
      pool_->Free(e.page);  // before the slot: never more than a page short
      const SlabAllocator::Slot slot = slabs_.Allocate(slab_class_);
      if (slot.page < 0) {
        e.page = pool_->Allocate(BlockKind::kFull);  // the page just freed: FreeSequence frees it
        return fail(absl::ResourceExhaustedError("KV cache full: no slot for a compressed block"));
      }
      const EpochId id = ids[static_cast<size_t>(first.epochs[0])];
      (void)epochs_.Acquire(id);
      e = {slot.page, slot.index, entries_.at(id), first.outliers};
      s.block_epochs[static_cast<size_t>(b)] = id;
      ++s.coded_blocks[id];
      ++blocks_compressed_;
    }
    for (int l = 0; l < g.n_layers; ++l) {
      const kernels::KvPoolLayout& lay = layouts_[static_cast<size_t>(l)];
      const std::string_view bytes =
          layers[static_cast<size_t>(l)].blocks[static_cast<size_t>(b)].bytes;
      absl::Status st;
      if (first.compressed) {
        st = store_->Write(l, lay.Slot(e.page, e.slot),
                           {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()});
      } else {
        const size_t run = std::min<int64_t>(bs, read->length - b * bs) * row_bytes;
        for (int side = 0; side < 2; ++side) {
          for (int h = 0; h < n_kv; ++h) {
            std::memcpy(page.data() + (side == 0 ? lay.FullK(0, h) : lay.FullV(0, h)),
                        bytes.data() + (side * n_kv + h) * run, run);
          }
        }
        st = store_->Write(l, lay.Page(e.page), page);
      }
      if (!st.ok()) return fail(st);
    }
  }

  // --- Outliers: B to a page in position order, every layer's rows ---
  const std::vector<int64_t>& positions = layers[0].outlier_pos;
  for (size_t j = 0; j < positions.size(); j += static_cast<size_t>(bs)) {
    const int32_t p = pool_->Allocate(BlockKind::kOutlier);
    if (p < 0) return fail(absl::ResourceExhaustedError("KV cache full: no page for outliers"));
    s.outlier_pages.push_back(p);
    const size_t n = std::min(positions.size() - j, static_cast<size_t>(bs));
    s.outlier_pos.insert(s.outlier_pos.end(), positions.begin() + static_cast<std::ptrdiff_t>(j),
                         positions.begin() + static_cast<std::ptrdiff_t>(j + n));
    outlier_tokens_ += static_cast<int64_t>(n);
    for (int l = 0; l < g.n_layers; ++l) {
      const kernels::KvPoolLayout& lay = layouts_[static_cast<size_t>(l)];
      const char* src = layers[static_cast<size_t>(l)].outlier_rows.data() +
                        j * static_cast<size_t>(n_kv) * 2 * row_bytes;
      std::fill(page.begin(), page.end(), 0);
      for (size_t slot = 0; slot < n; ++slot) {
        for (int h = 0; h < n_kv; ++h) {
          for (int side = 0; side < 2; ++side, src += row_bytes) {
            std::memcpy(
                page.data() + (side == 0 ? lay.FullK(0, h) : lay.FullV(0, h)) + slot * row_bytes,
                src, row_bytes);
          }
        }
      }
      if (absl::Status st = store_->Write(l, lay.Page(p), page); !st.ok()) return fail(st);
    }
  }
  // The bookkeeping's commit only: the blocks are as the exporting cache had compressed them.
  if (absl::Status st = seqs_.Commit(*seq, read->length); !st.ok()) return fail(st);
  s.next_compress = read->next_compress;
  QueueCompaction(s, *seq);  // more epochs than its refresh keeps: the compactor runs
  release_ids();             // the blocks and the sequence hold their own references now
  return *seq;
}

}  // namespace subspace::cuda
