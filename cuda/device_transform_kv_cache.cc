// DeviceTransformKvCache: the host bookkeeping of the transform-coded cache on the device.
#include "cuda/device_transform_kv_cache.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/compress/transform_kv_cache.h"
#include "core/kvcache/sequence_image.h"
#include "kernels/transform_blocks.h"

namespace subspace::cuda {

std::vector<kernels::KvPoolLayout> DeviceTransformKvCache::Layouts(
    const DeviceTransformKvCacheConfig& config) {
  const KvCacheGeometry& g = config.geometry;
  std::vector<kernels::KvPoolLayout> layouts;
  for (int l = 0; l < g.n_layers; ++l) {
    kernels::KvPoolLayout layout = kernels::MakeKvPoolLayout(
        g.n_kv_heads, g.head_dim, config.block_size, 1, 1, CoeffDtype::kFp16);
    const int64_t bytes = TransformCodedBlockBytes(*config.key_codes, *config.value_codes, l,
                                                   g.n_kv_heads, config.block_size);
    layout.slot_bytes = std::max<int64_t>((bytes + 15) / 16 * 16, 16);
    layouts.push_back(layout);
  }
  return layouts;
}

absl::Status DeviceTransformKvCache::Validate(const DeviceTransformKvCacheConfig& config) {
  const KvCacheGeometry& g = config.geometry;
  if (absl::Status st = CheckKvGeometry(g); !st.ok()) return st;
  if (config.block_size < 1 || config.block_size > kernels::kMaxBlockSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("device transform KV cache: block size %d outside [1, %d]",
                        config.block_size, kernels::kMaxBlockSize));
  }
  if (config.sink_tokens < 0 || config.window_tokens < 0) {
    return absl::InvalidArgumentError("device transform KV cache: sinks and window must be >= 0");
  }
  if (absl::Status st = CheckTransformCacheCodes(config.key_codes, g, "key"); !st.ok()) return st;
  if (absl::Status st = CheckTransformCacheCodes(config.value_codes, g, "value"); !st.ok())
    return st;
  const std::vector<kernels::KvPoolLayout> layouts = Layouts(config);
  for (int l = 0; l < g.n_layers; ++l) {
    if (const char* e = kernels::TransformLayoutError(layouts[static_cast<size_t>(l)]);
        e != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("device transform KV cache, layer %d: %s", l, e));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceTransformKvCache>> DeviceTransformKvCache::Create(
    const DeviceTransformKvCacheConfig& config, std::shared_ptr<TransformKvStore> store) {
  if (absl::Status st = Validate(config); !st.ok()) return st;
  if (store == nullptr) {
    return absl::InvalidArgumentError("device transform KV cache needs a store");
  }
  std::vector<kernels::KvPoolLayout> layouts = Layouts(config);
  if (config.num_pages < 1 + kCodingHeadroom) {
    return absl::InvalidArgumentError(
        absl::StrFormat("device KV pool of %d pages per layer: it needs at least %d",
                        config.num_pages, 1 + kCodingHeadroom));
  }
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::CreateBookkeeping(
      layouts[0].page_bytes / static_cast<int64_t>(sizeof(float)), config.num_pages);
  if (!pool.ok()) return pool.status();
  return std::unique_ptr<DeviceTransformKvCache>(
      new DeviceTransformKvCache(config, std::move(layouts), *std::move(pool), std::move(store)));
}

DeviceTransformKvCache::DeviceTransformKvCache(const DeviceTransformKvCacheConfig& config,
                                               std::vector<kernels::KvPoolLayout> layouts,
                                               std::unique_ptr<BlockPool> pool,
                                               std::shared_ptr<TransformKvStore> store)
    : config_(config),
      layouts_(std::move(layouts)),
      pool_(std::move(pool)),
      slabs_(pool_.get(), BlockKind::kCompressed),
      store_(std::move(store)),
      seqs_({.n_layers = config.geometry.n_layers,
             .block_size = config.block_size,
             .shared_table = true,
             .headroom = kCodingHeadroom,
             .block_bytes = pool_->block_bytes() * config.geometry.n_layers},
            pool_.get()),
      image_format_(config.geometry, config.block_size, config.sink_tokens, config.window_tokens,
                    config.pre_rope_keys, *config.key_codes, *config.value_codes) {
  policy_.sink_tokens = config.sink_tokens;
  policy_.window_tokens = config.window_tokens;
  for (size_t l = 0; l < layouts_.size(); ++l) {
    if (layouts_[l].slot_bytes > layouts_[static_cast<size_t>(widest_layer_)].slot_bytes) {
      widest_layer_ = static_cast<int>(l);
    }
  }
  slab_class_ = slabs_.AddClass(layouts_[static_cast<size_t>(widest_layer_)].slot_bytes);
  assert(slab_class_ >= 0);
}

// --- Sequences -----------------------------------------------------------------------------

absl::StatusOr<SeqId> DeviceTransformKvCache::CreateSequence() {
  absl::StatusOr<SeqId> id = seqs_.Create();
  if (id.ok()) seqs_[*id].next_compress = 0;
  return id;
}

void DeviceTransformKvCache::FreeBlock(Block& e) {
  if (e.slot == kernels::kFullBlock) {
    pool_->Free(e.page);
  } else {
    slabs_.Free({e.page, e.slot});
    --blocks_coded_;
  }
  e = Block{};
}

absl::Status DeviceTransformKvCache::FreeSequence(SeqId seq) {
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  // Queued codings first: a slot freed here could otherwise be queued again in the same batch.
  if (absl::Status st = Flush(); !st.ok()) return st;
  seqs_.ReleaseBlocksPast(*s, 0, [&](int, int64_t, Block& e) { FreeBlock(e); });
  seqs_.Remove(seq);
  return absl::OkStatus();
}

std::span<const DeviceTransformKvCache::Block> DeviceTransformKvCache::BlockTable(SeqId seq) const {
  const std::vector<Block>* table = seqs_.Table(seq, 0);
  if (table == nullptr) return {};
  return *table;
}

int64_t DeviceTransformKvCache::BlocksNeeded(SeqId seq, int64_t n) const {
  return BlocksNeededPastACutBlock(seqs_, seq, n, config_.block_size);
}

absl::Status DeviceTransformKvCache::Reserve(SeqId seq, int64_t n) {
  return ReservePastACutBlock(seqs_, seq, n, config_.block_size,
                              [&](Sequence& s) { return ExpandBlock(s, s.blocks() - 1); });
}

// --- Coding --------------------------------------------------------------------------------

absl::Status DeviceTransformKvCache::Commit(SeqId seq, int64_t length) {
  if (absl::Status st = seqs_.Commit(seq, length); !st.ok()) return st;
  Sequence& s = *seqs_.Find(seq);
  const BlockRange range = policy_.CompressibleBlocks(s.next_compress, length, config_.block_size);
  int64_t b = range.begin;
  for (; b < range.end; ++b) {
    if (s.tables[0][static_cast<size_t>(b)].slot != kernels::kFullBlock) continue;
    absl::StatusOr<bool> queued = QueueCoding(s, b);
    if (!queued.ok()) return queued.status();
    if (!*queued) break;  // no page for a slab: the block stays full until one frees up
  }
  if (!range.empty()) s.next_compress = b;
  return absl::OkStatus();
}

absl::StatusOr<bool> DeviceTransformKvCache::QueueCoding(Sequence& s, int64_t b) {
  SlabAllocator::Slot slot = slabs_.Allocate(slab_class_);
  if (slot.page < 0 && !pending_src_.empty()) {
    if (absl::Status st = Flush(); !st.ok()) return st;  // issuing frees the queue's pages
    slot = slabs_.Allocate(slab_class_);
  }
  if (slot.page < 0) {
    ++codings_deferred_;
    return false;
  }
  Block& e = s.tables[0][static_cast<size_t>(b)];
  pending_src_.push_back(e.page);
  pending_dst_page_.push_back(slot.page);
  pending_dst_slot_.push_back(slot.index);
  pending_first_.push_back(static_cast<int32_t>(b * config_.block_size));
  e = {slot.page, slot.index};
  ++blocks_coded_;
  return true;
}

absl::Status DeviceTransformKvCache::Flush() {
  if (pending_src_.empty()) return absl::OkStatus();
  absl::Status st = store_->Code({.src_page = pending_src_,
                                  .dst_page = pending_dst_page_,
                                  .dst_slot = pending_dst_slot_,
                                  .first_pos = pending_first_});
  // The pages go back even after a failure: the blocks' table entries already name their slots.
  for (int32_t page : pending_src_) pool_->Free(page);
  pending_src_.clear();
  pending_dst_page_.clear();
  pending_dst_slot_.clear();
  pending_first_.clear();
  return st;
}

absl::Status DeviceTransformKvCache::ExpandBlock(Sequence& s, int64_t b) {
  Block& e = s.tables[0][static_cast<size_t>(b)];
  assert(e.slot != kernels::kFullBlock);
  const int32_t page = pool_->Allocate(BlockKind::kFull);
  if (page < 0) {
    return absl::ResourceExhaustedError(
        "KV cache full: no page to decode a coded block cut by a truncation into");
  }
  const int32_t src_page = e.page, src_slot = e.slot;
  const auto first = static_cast<int32_t>(b * config_.block_size);
  if (absl::Status st = store_->Expand({.src_page = {&src_page, 1},
                                        .src_slot = {&src_slot, 1},
                                        .dst_page = {&page, 1},
                                        .first_pos = {&first, 1}});
      !st.ok()) {
    pool_->Free(page);
    return st;
  }
  FreeBlock(e);  // freed now, read by the store first: its operations run in order
  e = {page, kernels::kFullBlock};
  return absl::OkStatus();
}

absl::Status DeviceTransformKvCache::Truncate(SeqId seq, int64_t length) {
  if (absl::Status st = seqs_.CheckTruncate(seq, length); !st.ok()) return st;
  if (absl::Status st = Flush(); !st.ok()) return st;
  const int bs = config_.block_size;
  const int64_t keep = CeilDiv(length, int64_t{bs});
  if (absl::Status st = seqs_.Truncate(seq, length, [&](int, int64_t, Block& e) { FreeBlock(e); });
      !st.ok()) {
    return st;
  }
  Sequence& s = *seqs_.Find(seq);
  const bool cut = length % bs != 0 && keep > 0;
  s.next_compress = std::min(s.next_compress, cut ? keep - 1 : keep);
  if (cut && s.tables[0].back().slot != kernels::kFullBlock) {
    if (absl::Status st = ExpandBlock(s, keep - 1); !st.ok() && !absl::IsResourceExhausted(st)) {
      return st;
    }
  }
  return absl::OkStatus();
}

// --- Views ---------------------------------------------------------------------------------

DeviceBlockRef DeviceTransformKvCache::BlockOf(SeqId seq, int64_t b) const {
  const Block& e = BlockTable(seq)[static_cast<size_t>(b)];
  return {.page = e.page, .slot = e.slot, .entry = e.slot == kernels::kFullBlock ? -1 : 0};
}

void DeviceTransformKvCache::DescribeDecode(SeqId seq, int64_t length, DecodeSeqDesc* desc) const {
  const std::span<const Block> table = BlockTable(seq);
  const int64_t nb =
      std::min<int64_t>(CeilDiv(length, config_.block_size), static_cast<int64_t>(table.size()));
  desc->length = length;
  desc->pages.clear();
  desc->slots.clear();
  desc->epochs.clear();
  for (int64_t b = 0; b < nb; ++b) {
    const Block& e = table[static_cast<size_t>(b)];
    desc->pages.push_back(e.page);
    desc->slots.push_back(e.slot);
    desc->epochs.insert(desc->epochs.end(), static_cast<size_t>(config_.geometry.n_kv_heads),
                        e.slot == kernels::kFullBlock ? -1 : 0);
  }
  desc->outlier_masks.clear();
  desc->outlier_pages.clear();
  desc->n_outliers = 0;
}

// --- Images --------------------------------------------------------------------------------

absl::StatusOr<std::string> DeviceTransformKvCache::ExportSequence(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  // Queued codings land first: their slots are named by the table already. Issuing them changes
  // no state a caller sees but when the bytes are written.
  if (absl::Status st = const_cast<DeviceTransformKvCache*>(this)->Flush(); !st.ok()) return st;
  const KvCacheGeometry& g = config_.geometry;
  const int bs = config_.block_size;
  const int64_t hd = g.head_dim;
  TransformImage image;
  image.length = s->length;
  image.next_compress = s->next_compress;
  image.blocks = CeilDiv(s->length, int64_t{bs});
  std::vector<uint8_t> page(static_cast<size_t>(layouts_[0].page_bytes));
  for (int l = 0; l < g.n_layers; ++l) {
    const kernels::KvPoolLayout& lay = layouts_[static_cast<size_t>(l)];
    for (int64_t b = 0; b < image.blocks; ++b) {
      const Block& e = s->tables[0][static_cast<size_t>(b)];
      std::string bytes;
      if (e.slot != kernels::kFullBlock) {
        bytes.resize(static_cast<size_t>(image_format_.coded_bytes(l)));
        if (absl::Status st =
                store_->Read(l, lay.Slot(e.page, e.slot),
                             {reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()});
            !st.ok()) {
          return st;
        }
        image.parts.push_back({.coded = true, .bytes = image.Own(std::move(bytes))});
        continue;
      }
      if (absl::Status st = store_->Read(l, lay.Page(e.page), page); !st.ok()) return st;
      const int64_t valid = std::min<int64_t>(bs, s->length - b * bs);
      for (int side = 0; side < 2; ++side) {
        for (int h = 0; h < g.n_kv_heads; ++h) {
          bytes.append(reinterpret_cast<const char*>(page.data()) +
                           (side == 0 ? lay.FullK(0, h) : lay.FullV(0, h)),
                       static_cast<size_t>(valid * hd * 2));
        }
      }
      image.parts.push_back({.coded = false, .bytes = image.Own(std::move(bytes))});
    }
  }
  return image_format_.Write(image, /*entropy_coded=*/false);
}

absl::StatusOr<SeqId> DeviceTransformKvCache::ImportSequence(std::string_view image) {
  const KvCacheGeometry& g = config_.geometry;
  const int bs = config_.block_size;
  const int64_t hd = g.head_dim;
  // Every block read and checked before a page is taken: a corrupt image changes nothing.
  // At most every page's slots, in every layer: what the pool could hold.
  const int64_t max_blocks =
      pool_->num_blocks() *
      std::max<int64_t>(
          layouts_[0].page_bytes / layouts_[static_cast<size_t>(widest_layer_)].slot_bytes, 1) *
      g.n_layers;
  absl::StatusOr<TransformImage> read = image_format_.Read(image, max_blocks);
  if (!read.ok()) return read.status();
  if (!read->epochs.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the image holds %d refreshed epochs of codes (online refresh), which this device's "
        "transform cache does not run",
        read->epochs.size()));
  }
  const int64_t blocks = read->blocks;
  const auto part = [&](int l, int64_t b) -> const TransformImage::Part& {
    return read->parts[static_cast<size_t>(l * blocks + b)];
  };
  for (int64_t b = 0; b < blocks; ++b) {
    for (int l = 1; l < g.n_layers; ++l) {
      if (part(l, b).coded != part(0, b).coded) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "block %d is coded in some layers only; this cache codes every layer alike", b));
      }
    }
  }
  if (absl::Status st = Flush(); !st.ok()) return st;
  absl::StatusOr<SeqId> seq = CreateSequence();
  if (!seq.ok()) return seq.status();
  if (absl::Status st = Reserve(*seq, read->length); !st.ok()) {
    (void)FreeSequence(*seq);
    return st;
  }
  Sequence& s = seqs_[*seq];
  std::vector<uint8_t> page(static_cast<size_t>(layouts_[0].page_bytes), 0);
  for (int64_t b = 0; b < blocks; ++b) {
    Block& e = s.tables[0][static_cast<size_t>(b)];
    if (part(0, b).coded) {
      pool_->Free(e.page);  // before the slot, as Commit does: never more than a page short
      const SlabAllocator::Slot slot = slabs_.Allocate(slab_class_);
      if (slot.page < 0) {
        e.page = pool_->Allocate(BlockKind::kFull);  // the page just freed: FreeSequence frees it
        (void)FreeSequence(*seq);
        return absl::ResourceExhaustedError("KV cache full: no slot for a coded block");
      }
      e = {slot.page, slot.index};
      ++blocks_coded_;
    }
    for (int l = 0; l < g.n_layers; ++l) {
      const kernels::KvPoolLayout& lay = layouts_[static_cast<size_t>(l)];
      const std::string_view bytes = part(l, b).bytes;
      absl::Status st;
      if (part(l, b).coded) {
        st = store_->Write(l, lay.Slot(e.page, e.slot),
                           {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()});
      } else {
        const int64_t row_bytes = std::min<int64_t>(bs, read->length - b * bs) * hd * 2;
        for (int side = 0; side < 2; ++side) {
          for (int h = 0; h < g.n_kv_heads; ++h) {
            std::memcpy(page.data() + (side == 0 ? lay.FullK(0, h) : lay.FullV(0, h)),
                        bytes.data() + (side * g.n_kv_heads + h) * row_bytes,
                        static_cast<size_t>(row_bytes));
          }
        }
        st = store_->Write(l, lay.Page(e.page), page);
      }
      if (!st.ok()) {
        (void)FreeSequence(*seq);
        return st;
      }
    }
  }
  // The bookkeeping's commit only: the blocks are as the exporting cache had coded them.
  if (absl::Status st = seqs_.Commit(*seq, read->length); !st.ok()) {
    (void)FreeSequence(*seq);
    return st;
  }
  s.next_compress = read->next_compress;
  return *seq;
}

DeviceTransformKvCacheDetail DeviceTransformKvCache::Detail() const {
  return {.pages_full = pool_->num_used(BlockKind::kFull),
          .pages_coded = pool_->num_used(BlockKind::kCompressed),
          .blocks_coded = blocks_coded_,
          .codings_deferred = codings_deferred_};
}

}  // namespace subspace::cuda
