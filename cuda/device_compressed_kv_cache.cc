// DeviceCompressedKvCache: bookkeeping and policy on the host; the store moves the bytes.
#include "cuda/device_compressed_kv_cache.h"

#include <algorithm>
#include <cassert>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/base/pca.h"
#include "cuda/cuda_capabilities.h"

namespace subspace::cuda {
absl::StatusOr<std::unique_ptr<DeviceCompressedKvCache>> DeviceCompressedKvCache::Create(
    const DeviceCompressedKvCacheConfig& config, std::shared_ptr<CompressedKvStore> store) {
  const KvCacheGeometry& g = config.geometry;
  static_assert(kernels::kMaxBlockSize == 64,
                "ValidateCompressedCacheSetup allows blocks of up to 64");
  if (absl::Status st = ValidateCompressedCacheSetup(
          g, config.block_size, config.refresh, config.n_query_heads,
          "kqsvd refresh needs the queries, which this backend does not read back (no room for "
          "them): use pca, oja or fd");
      !st.ok()) {
    return st;
  }
  if (!kCudaCacheCapabilities.HoldsCoeffDtype(config.policy.coeff_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the CUDA backend codes coefficients in fp16 or int8, got %s",
                        CoeffDtypeName(config.policy.coeff_dtype)));
  }
  absl::StatusOr<CompressionPolicy> policy = ResolvePolicy(config.policy, g);
  if (!policy.ok()) return policy.status();
  const std::vector<int>* r_k = &policy->r_k;
  const std::vector<int>* r_v = &policy->r_v;
  if (store == nullptr || store->basis_capacity() < 1) {
    return absl::InvalidArgumentError("device compressed KV cache needs a store with basis tables");
  }
  for (int l = 0; l < g.n_layers; ++l) {
    const kernels::KvPoolLayout layout = kernels::MakeKvPoolLayout(
        g.n_kv_heads, g.head_dim, config.block_size, (*r_k)[static_cast<size_t>(l)],
        (*r_v)[static_cast<size_t>(l)], config.policy.coeff_dtype);
    if (const char* error = kernels::KvPoolLayoutError(layout); error != nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d at ranks (%d, %d): %s", l,
                                                        layout.rank_k, layout.rank_v, error));
    }
  }
  if (config.num_pages < 1 + kCompressionHeadroom) {
    return absl::InvalidArgumentError(
        absl::StrFormat("device KV pool of %d pages per layer: it needs at least %d",
                        config.num_pages, 1 + kCompressionHeadroom));
  }
  const int64_t page_bytes = 2 * int64_t{g.n_kv_heads} * config.block_size * g.head_dim * 2;
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::CreateBookkeeping(
      page_bytes / static_cast<int64_t>(sizeof(float)), config.num_pages);
  if (!pool.ok()) return pool.status();
  DeviceCompressedKvCacheConfig resolved = config;
  resolved.policy = *std::move(policy);
  return std::unique_ptr<DeviceCompressedKvCache>(
      new DeviceCompressedKvCache(resolved, *std::move(pool), std::move(store)));
}

DeviceCompressedKvCache::DeviceCompressedKvCache(const DeviceCompressedKvCacheConfig& config,
                                                 std::unique_ptr<BlockPool> pool,
                                                 std::shared_ptr<CompressedKvStore> store)
    : config_(config),
      r_k_(config.policy.r_k),
      r_v_(config.policy.r_v),
      pool_(std::move(pool)),
      slabs_(pool_.get(), BlockKind::kCompressed),
      store_(std::move(store)),
      epochs_({.geometry = config.geometry,
               .policy = config.policy,
               .n_query_heads = config.n_query_heads,
               .refresher = {.inline_mode = config.refresh_inline,
                             .max_queued_bytes = config.refresh_queue_bytes},
               .on_register = [this](EpochId id, const Basis& b) { return LoadEpoch(id, b); },
               .on_retire = [this](EpochId id) { RetireEpoch(id); }}),
      // One page id stands for a page in every layer's slice.
      seqs_({.n_layers = config.geometry.n_layers,
             .block_size = config.block_size,
             .shared_table = true,
             .headroom = kCompressionHeadroom,
             .block_bytes = pool_->block_bytes() * config.geometry.n_layers},
            pool_.get()) {
  const KvCacheGeometry& g = config_.geometry;
  for (int l = 0; l < g.n_layers; ++l) {
    layouts_.push_back(kernels::MakeKvPoolLayout(
        g.n_kv_heads, g.head_dim, config_.block_size, r_k_[static_cast<size_t>(l)],
        r_v_[static_cast<size_t>(l)], config_.policy.coeff_dtype));
    if (layouts_.back().slot_bytes > layouts_[static_cast<size_t>(widest_layer_)].slot_bytes) {
      widest_layer_ = l;
    }
  }
  slab_class_ = slabs_.AddClass(plan_layout().slot_bytes);
  assert(slab_class_ >= 0 && slabs_.slots_per_page(slab_class_) == plan_layout().SlotsPerPage());
  for (int e = store_->basis_capacity() - 1; e >= 0; --e) free_entries_.push_back(e);
}

// --- Sequences -----------------------------------------------------------------------------

absl::StatusOr<SeqId> DeviceCompressedKvCache::CreateSequence() {
  absl::StatusOr<SeqId> id = seqs_.Create();
  if (!id.ok()) return id;
  Sequence& s = seqs_[*id];
  s.block_epochs.clear();
  s.coded_blocks.clear();
  s.outlier_pos.clear();
  s.outlier_pages.clear();
  epochs_.StartSequence(s, config_.refresh);
  return id;
}

void DeviceCompressedKvCache::FreeBlock(Sequence& s, int64_t b) {
  Block& e = s.tables[0][static_cast<size_t>(b)];
  if (e.slot == kernels::kFullBlock) {
    pool_->Free(e.page);
  } else {
    slabs_.Free({e.page, e.slot});
    const EpochId epoch = s.block_epochs[static_cast<size_t>(b)];
    if (--s.coded_blocks[epoch] == 0) s.coded_blocks.erase(epoch);
    epochs_.Release(epoch);
    --blocks_compressed_;
  }
  e = Block{};
  s.block_epochs[static_cast<size_t>(b)] = kNoEpoch;
}

absl::Status DeviceCompressedKvCache::FreeSequence(SeqId seq) {
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  // Queued compressions first: a slot freed here could otherwise be queued again, for another
  // block, in the same batch.
  if (absl::Status st = Flush(); !st.ok()) return st;
  seqs_.ReleaseBlocksPast(*s, 0, [&](int, int64_t b, Block&) { FreeBlock(*s, b); });
  s->block_epochs.clear();
  DropOutliers(*s, 0);
  epochs_.EndSequence(*s);
  seqs_.Remove(seq);
  return absl::OkStatus();
}

int64_t DeviceCompressedKvCache::Length(SeqId seq) const { return seqs_.Length(seq); }

std::span<const DeviceCompressedKvCache::Block> DeviceCompressedKvCache::BlockTable(
    SeqId seq) const {
  const std::vector<Block>* table = seqs_.Table(seq, 0);
  if (table == nullptr) return {};
  return *table;
}

int64_t DeviceCompressedKvCache::BlocksNeeded(SeqId seq, int64_t n) const {
  return BlocksNeededPastACutBlock(seqs_, seq, n, config_.block_size);
}

// New tokens land in full pages, as in the CPU cache; the manager leaves kCompressionHeadroom.
absl::Status DeviceCompressedKvCache::Reserve(SeqId seq, int64_t n) {
  if (absl::Status st =
          ReservePastACutBlock(seqs_, seq, n, config_.block_size,
                               [&](Sequence& s) { return ExpandBlock(s, s.blocks() - 1); });
      !st.ok()) {
    return st;
  }
  Sequence& s = *seqs_.Find(seq);
  s.block_epochs.resize(static_cast<size_t>(s.blocks()), kNoEpoch);
  return absl::OkStatus();
}

// --- Compression ---------------------------------------------------------------------------

absl::Status DeviceCompressedKvCache::Commit(SeqId seq, int64_t length) {
  if (absl::Status st = seqs_.Commit(seq, length); !st.ok()) return st;
  Sequence* s = seqs_.Find(seq);
  const int bs = config_.block_size;
  const Refresher* refresher = epochs_.refresher();
  if (refresher != nullptr && refresher->has_published()) InstallPublishedEpochs();
  const BlockRange range = config_.policy.CompressibleBlocks(s->next_compress, length, bs);
  if (range.empty()) return absl::OkStatus();
  if (absl::Status st = epochs_.EnsureEpoch(*s, [&] { return PcaOfSequence(*s); }); !st.ok()) {
    return st;
  }
  epochs_.OpenStream(*s, seq);
  int64_t b = range.begin;
  for (; b < range.end; ++b) {
    if (s->tables[0][static_cast<size_t>(b)].slot != kernels::kFullBlock) continue;
    absl::StatusOr<bool> queued = QueueCompression(*s, seq, b);
    if (!queued.ok()) return queued.status();
    if (!*queued) break;  // no page for a slab: the block stays full until one frees up
  }
  s->next_compress = b;
  return absl::OkStatus();
}

absl::StatusOr<bool> DeviceCompressedKvCache::QueueCompression(Sequence& s, SeqId seq, int64_t b) {
  SlabAllocator::Slot slot = slabs_.Allocate(slab_class_);
  if (slot.page < 0 && !pending_src_.empty()) {
    // Issuing the queue frees its full pages.
    if (absl::Status st = Flush(); !st.ok()) return st;
    slot = slabs_.Allocate(slab_class_);
  }
  if (slot.page < 0) {
    ++compressions_deferred_;
    return false;
  }
  if (absl::Status st = epochs_.Acquire(s.epoch); !st.ok()) return st;
  Block& e = s.tables[0][static_cast<size_t>(b)];
  const int32_t entry = entries_.at(s.epoch);
  pending_src_.push_back(e.page);
  pending_dst_page_.push_back(slot.page);
  pending_dst_slot_.push_back(slot.index);
  pending_epoch_.insert(pending_epoch_.end(), static_cast<size_t>(config_.geometry.n_kv_heads),
                        entry);
  pending_stream_.push_back(s.stream);
  pending_epoch_id_.push_back(s.epoch);
  pending_seq_.push_back(seq);
  pending_block_.push_back(b);
  e = {slot.page, slot.index, entry, 0};
  s.block_epochs[static_cast<size_t>(b)] = s.epoch;
  if (++s.coded_blocks[s.epoch] == 1) QueueCompaction(s, seq);  // a new epoch among its blocks
  ++blocks_compressed_;
  return true;
}

absl::Status DeviceCompressedKvCache::Flush() {
  if (epochs_.refresher() == nullptr && pending_src_.empty()) return absl::OkStatus();
  // A readback that landed since the last Flush frees the way for this one's.
  if (absl::Status st = PollObservations(); !st.ok()) return st;
  if (!pending_src_.empty()) {
    const bool detect = config_.policy.outliers_enabled();
    pending_outliers_.assign(detect ? pending_src_.size() : 0, 0);
    absl::Status st = StartObservations();
    if (st.ok()) {
      st = store_->Compress({.src_page = pending_src_,
                             .dst_page = pending_dst_page_,
                             .dst_slot = pending_dst_slot_,
                             .epoch = pending_epoch_,
                             .outlier_masks = pending_outliers_,
                             .outlier_threshold = config_.policy.outlier_threshold});
    }
    if (st.ok() && detect) st = PlaceOutliers();
    // The pages go back even after a failure: the blocks' table entries already name their
    // slots.
    for (int32_t page : pending_src_) pool_->Free(page);
    pending_src_.clear();
    pending_dst_page_.clear();
    pending_dst_slot_.clear();
    pending_epoch_.clear();
    pending_stream_.clear();
    pending_epoch_id_.clear();
    pending_seq_.clear();
    pending_block_.clear();
    if (!st.ok()) return st;
  }
  if (absl::Status st = PollObservations(); !st.ok()) return st;  // lands at once off the GPU
  return Compact();
}

absl::Status DeviceCompressedKvCache::PlaceOutliers() {
  const int bs = config_.block_size;
  std::vector<int32_t> block_page, first_slot, outlier_page;
  std::vector<uint64_t> masks;
  for (size_t i = 0; i < pending_src_.size(); ++i) {
    uint64_t mask = pending_outliers_[i];
    if (mask == 0) continue;
    Sequence& s = seqs_[pending_seq_[i]];  // live: freeing a sequence flushes first
    const int64_t b = pending_block_[i];
    const size_t first = s.outlier_pos.size();
    // In position order: a sequence's blocks are queued in order, and its earlier outliers
    // belong to earlier blocks.
    assert(first == 0 || s.outlier_pos.back() < b * bs);
    for (uint64_t m = mask; m != 0; m &= m - 1) {
      const int t = __builtin_ctzll(m);
      if (s.outlier_pos.size() % static_cast<size_t>(bs) == 0) {
        const int32_t page = pool_->Allocate(BlockKind::kOutlier);
        if (page < 0) {  // no page: the token stays compressed
          mask &= ~(uint64_t{1} << t);
          ++outliers_dropped_;
          continue;
        }
        s.outlier_pages.push_back(page);
      }
      s.outlier_pos.push_back(b * bs + t);
    }
    if (mask == 0) continue;
    outlier_tokens_ += static_cast<int64_t>(s.outlier_pos.size() - first);
    s.tables[0][static_cast<size_t>(b)].outliers = mask;
    const BlockOutliers o = OutliersOf(s, b);
    block_page.push_back(pending_src_[i]);
    masks.push_back(mask);
    first_slot.push_back(o.first_slot);
    outlier_page.insert(outlier_page.end(), {o.pages[0], o.pages[1]});
  }
  if (block_page.empty()) return absl::OkStatus();
  return store_->MoveOutliers({.block_page = block_page,
                               .mask = masks,
                               .first_slot = first_slot,
                               .outlier_page = outlier_page,
                               .direction = kernels::OutlierMove::kToOutlierPages});
}

void DeviceCompressedKvCache::DropOutliers(Sequence& s, int64_t from) {
  const auto cut = std::lower_bound(s.outlier_pos.begin(), s.outlier_pos.end(), from);
  outlier_tokens_ -= s.outlier_pos.end() - cut;
  s.outlier_pos.erase(cut, s.outlier_pos.end());
  const size_t pages =
      static_cast<size_t>(CeilDiv(static_cast<int64_t>(s.outlier_pos.size()), config_.block_size));
  while (s.outlier_pages.size() > pages) {
    pool_->Free(s.outlier_pages.back());
    s.outlier_pages.pop_back();
  }
}

DeviceCompressedKvCache::BlockOutliers DeviceCompressedKvCache::OutliersOf(const Sequence& s,
                                                                           int64_t b) const {
  BlockOutliers o;
  if (b < 0 || b >= static_cast<int64_t>(s.tables[0].size())) return o;
  o.mask = s.tables[0][static_cast<size_t>(b)].outliers;
  if (o.mask == 0) return o;
  const int bs = config_.block_size;
  const int64_t j =
      std::lower_bound(s.outlier_pos.begin(), s.outlier_pos.end(), b * bs) - s.outlier_pos.begin();
  o.first_slot = static_cast<int32_t>(j % bs);
  const size_t page = static_cast<size_t>(j / bs);
  o.pages[0] = s.outlier_pages[page];
  // The second page, when the block's outliers run past the first one's end.
  if (j % bs + __builtin_popcountll(o.mask) > bs) o.pages[1] = s.outlier_pages[page + 1];
  return o;
}

DeviceCompressedKvCache::BlockOutliers DeviceCompressedKvCache::OutliersOf(SeqId seq,
                                                                           int64_t b) const {
  const Sequence* s = seqs_.Find(seq);
  return s == nullptr ? BlockOutliers{} : OutliersOf(*s, b);
}

std::span<const int64_t> DeviceCompressedKvCache::OutlierPositions(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return {};
  return s->outlier_pos;
}

std::span<const int32_t> DeviceCompressedKvCache::OutlierPages(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return {};
  return s->outlier_pages;
}

absl::Status DeviceCompressedKvCache::ExpandBlock(Sequence& s, int64_t b) {
  Block& e = s.tables[0][static_cast<size_t>(b)];
  assert(e.slot != kernels::kFullBlock);
  const int32_t page = pool_->Allocate(BlockKind::kFull);
  if (page < 0) {
    return absl::ResourceExhaustedError(
        "KV cache full: no page to expand a compressed block cut by a truncation into");
  }
  const std::vector<int32_t> epochs(static_cast<size_t>(config_.geometry.n_kv_heads), e.entry);
  const int32_t src_page = e.page, src_slot = e.slot;
  absl::Status st = store_->Expand({.src_page = {&src_page, 1},
                                    .src_slot = {&src_slot, 1},
                                    .dst_page = {&page, 1},
                                    .epoch = epochs});
  // Its outliers back in place, exact; they are the sequence's last (only the last block is
  // ever expanded in place).
  const BlockOutliers o = OutliersOf(s, b);
  if (st.ok() && o.mask != 0) {
    st = store_->MoveOutliers({.block_page = {&page, 1},
                               .mask = {&o.mask, 1},
                               .first_slot = {&o.first_slot, 1},
                               .outlier_page = o.pages,
                               .direction = kernels::OutlierMove::kToBlockPages});
  }
  if (!st.ok()) {
    pool_->Free(page);
    return st;
  }
  const int bs = config_.block_size;
  assert(s.outlier_pos.empty() || s.outlier_pos.back() < (b + 1) * bs);
  // Freed now, read by the store first: its operations run in order.
  DropOutliers(s, b * bs);
  FreeBlock(s, b);
  s.tables[0][static_cast<size_t>(b)] = {page, kernels::kFullBlock, -1};
  return absl::OkStatus();
}

absl::Status DeviceCompressedKvCache::Truncate(SeqId seq, int64_t length) {
  if (absl::Status st = seqs_.CheckTruncate(seq, length); !st.ok()) return st;
  if (absl::Status st = Flush(); !st.ok()) return st;
  const int bs = config_.block_size;
  const int64_t keep = CeilDiv(length, int64_t{bs});
  Sequence* s = seqs_.Find(seq);
  if (absl::Status st =
          seqs_.Truncate(seq, length, [&](int, int64_t b, Block&) { FreeBlock(*s, b); });
      !st.ok()) {
    return st;
  }
  DropOutliers(*s, keep * bs);
  s->block_epochs.resize(static_cast<size_t>(keep));
  const bool cut = length % bs != 0 && keep > 0;
  s->next_compress = std::min(s->next_compress, cut ? keep - 1 : keep);
  if (cut && s->tables[0].back().slot != kernels::kFullBlock) {
    // Without a free page now, the next Reserve expands it (and counts the page).
    if (absl::Status st = ExpandBlock(*s, keep - 1); !st.ok() && !absl::IsResourceExhausted(st)) {
      return st;
    }
  }
  return absl::OkStatus();
}

// --- Epochs --------------------------------------------------------------------------------

absl::Status DeviceCompressedKvCache::LoadEpoch(EpochId id, const Basis& basis) {
  if (free_entries_.empty()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the device basis tables hold %d epochs, all in use", store_->basis_capacity()));
  }
  const int32_t entry = free_entries_.back();
  if (absl::Status st = store_->LoadBasis(entry, basis); !st.ok()) return st;
  free_entries_.pop_back();
  entries_[id] = entry;
  return absl::OkStatus();
}

void DeviceCompressedKvCache::RetireEpoch(EpochId id) {
  // No block, sequence or default refers to it: no queued compression either (a queued block
  // holds a reference until it is freed, and freeing flushes first).
  const auto it = entries_.find(id);
  assert(it != entries_.end());
  free_entries_.push_back(it->second);
  entries_.erase(it);
}

absl::StatusOr<EpochId> DeviceCompressedKvCache::InstallBasis(std::shared_ptr<const Basis> basis) {
  return epochs_.Install(std::move(basis));
}

absl::Status DeviceCompressedKvCache::ReleaseEpoch(EpochId id) {
  return epochs_.ReleaseChecked(id);
}

absl::Status DeviceCompressedKvCache::SetDefaultEpoch(EpochId id) { return epochs_.SetDefault(id); }

EpochId DeviceCompressedKvCache::SequenceEpoch(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  return s == nullptr ? kNoEpoch : s->epoch;
}

int32_t DeviceCompressedKvCache::EpochEntry(EpochId id) const {
  const auto it = entries_.find(id);
  return it == entries_.end() ? -1 : it->second;
}

// Grams of the committed keys and values of the blocks CompressionPolicy samples (the CPU cache's
// blocks), read back from the store (once per server: the epoch becomes the default, unless
// per_sequence_pca).
absl::StatusOr<std::shared_ptr<const Basis>> DeviceCompressedKvCache::PcaOfSequence(
    const Sequence& s) {
  const KvCacheGeometry& g = config_.geometry;
  const int hd = g.head_dim, n_kv = g.n_kv_heads, bs = config_.block_size;
  const size_t dd = static_cast<size_t>(hd) * hd;
  const int64_t blocks = CeilDiv(s.length, bs);
  const int64_t stride = CompressionPolicy::PcaBlockStride(s.length, bs);
  const kernels::KvPoolLayout& layout = layouts_[0];
  std::vector<uint16_t> page(static_cast<size_t>(layout.page_bytes / 2));
  std::vector<std::vector<double>> gk(static_cast<size_t>(g.n_layers)), gv(gk.size());
  std::vector<double> rows;  // [tokens, hd] of one head
  UseSingleThreadedBlas();
  for (int l = 0; l < g.n_layers; ++l) {
    // [n_kv][2][tokens * hd]: the sampled rows of each head's keys and values.
    std::vector<std::vector<double>> head_rows(static_cast<size_t>(2 * n_kv));
    for (int64_t b = 0; b < blocks; b += stride) {
      const Block& e = s.tables[0][static_cast<size_t>(b)];
      if (e.slot != kernels::kFullBlock) continue;
      if (absl::Status st = store_->ReadPage(l, e.page, page); !st.ok()) return st;
      const int64_t valid = std::min<int64_t>(bs, s.length - b * bs);
      for (int h = 0; h < n_kv; ++h) {
        for (int kv = 0; kv < 2; ++kv) {
          const int64_t first = (kv == 0 ? layout.FullK(0, h) : layout.FullV(0, h)) / 2;
          std::vector<double>& dst = head_rows[static_cast<size_t>(2 * h + kv)];
          for (int64_t i = 0; i < valid * hd; ++i) {
            dst.push_back(HalfToFloat(page[static_cast<size_t>(first + i)]));
          }
        }
      }
    }
    gk[static_cast<size_t>(l)].assign(static_cast<size_t>(n_kv) * dd, 0.0);
    gv[static_cast<size_t>(l)].assign(static_cast<size_t>(n_kv) * dd, 0.0);
    for (int h = 0; h < n_kv; ++h) {
      for (int kv = 0; kv < 2; ++kv) {
        const std::vector<double>& src = head_rows[static_cast<size_t>(2 * h + kv)];
        double* gram = (kv == 0 ? gk : gv)[static_cast<size_t>(l)].data() + h * dd;
        GramOfRows(src.data(), static_cast<int64_t>(src.size()) / hd, hd, gram);
      }
    }
  }
  return std::make_shared<const Basis>(PcaBasis(g, r_k_, r_v_, gk, gv));
}

// --- Views ---------------------------------------------------------------------------------

DeviceBlockRef DeviceCompressedKvCache::BlockOf(SeqId seq, int64_t b) const {
  const Block& e = BlockTable(seq)[static_cast<size_t>(b)];
  DeviceBlockRef ref{.page = e.page, .slot = e.slot, .entry = e.entry};
  if (e.slot == kernels::kFullBlock || e.outliers == 0) return ref;
  const BlockOutliers o = OutliersOf(seq, b);
  ref.outlier_mask = o.mask;
  ref.outlier_first_slot = o.first_slot;
  ref.outlier_pages[0] = o.pages[0];
  ref.outlier_pages[1] = o.pages[1];
  return ref;
}

void DeviceCompressedKvCache::DescribeDecode(SeqId seq, int64_t length, DecodeSeqDesc* desc) const {
  const std::span<const Block> table = BlockTable(seq);
  const int n_kv = config_.geometry.n_kv_heads;
  const int64_t nb =
      std::min<int64_t>(CeilDiv(length, config_.block_size), static_cast<int64_t>(table.size()));
  desc->length = length;
  desc->pages.resize(static_cast<size_t>(nb));
  desc->slots.resize(static_cast<size_t>(nb));
  desc->epochs.resize(static_cast<size_t>(nb * n_kv));
  desc->outlier_masks.clear();
  desc->outlier_pages.clear();
  desc->n_outliers = 0;
  const Sequence* s = seqs_.Find(seq);
  const bool outliers = s != nullptr && !s->outlier_pos.empty();
  if (outliers) desc->outlier_masks.assign(static_cast<size_t>(nb), 0);
  for (int64_t b = 0; b < nb; ++b) {
    const Block& e = table[static_cast<size_t>(b)];
    desc->pages[static_cast<size_t>(b)] = e.page;
    desc->slots[static_cast<size_t>(b)] = e.slot;
    std::fill_n(desc->epochs.begin() + b * n_kv, n_kv, e.entry);
    if (outliers) desc->outlier_masks[static_cast<size_t>(b)] = e.outliers;
  }
  if (!outliers) return;
  // Only the tokens before `length`: outliers are in position order, B to a page.
  const int bs = config_.block_size;
  desc->n_outliers = std::lower_bound(s->outlier_pos.begin(), s->outlier_pos.end(), length) -
                     s->outlier_pos.begin();
  desc->outlier_pages.assign(s->outlier_pages.begin(),
                             s->outlier_pages.begin() + CeilDiv(desc->n_outliers, bs));
  if (nb > 0 && length % bs != 0) {
    desc->outlier_masks[static_cast<size_t>(nb - 1)] &= (uint64_t{1} << (length % bs)) - 1;
  }
}

KvCacheStats DeviceCompressedKvCache::Stats() const {
  const KvCacheGeometry& g = config_.geometry;
  KvCacheStats st = seqs_.Stats(g);
  st.epochs_live = epochs_.registry().live();
  if (epochs_.refresher() != nullptr) st.refresh = epochs_.refresher()->Stats();
  // What the metrics count alike: blocks never read back are observations the refresher never
  // saw (per layer, as it counts them); an epoch with no basis-table entry is a refresh lost.
  st.refresh.observations_dropped += blocks_unobserved_ * g.n_layers;
  st.refresh.failures += refreshes_unplaced_;
  st.refresh.installed = refreshes_installed_;
  // Block-heads of every layer, as the CPU cache counts them.
  st.refresh.blocks_reprojected = blocks_recoded_ * g.n_kv_heads * g.n_layers;
  return st;
}

DeviceCompressedKvCacheDetail DeviceCompressedKvCache::Detail() const {
  DeviceCompressedKvCacheDetail d;
  d.pages_full = pool_->num_used(BlockKind::kFull);
  d.pages_compressed = pool_->num_used(BlockKind::kCompressed);
  d.blocks_compressed = blocks_compressed_;
  d.compressions_deferred = compressions_deferred_;
  d.pca_epochs_built = epochs_.pca_epochs_built();
  d.basis_entries_used = static_cast<int64_t>(entries_.size());
  d.default_self_calibrated = epochs_.default_self_calibrated();
  d.refreshes_unplaced = refreshes_unplaced_;
  d.blocks_unobserved = blocks_unobserved_;
  d.blocks_recoded = blocks_recoded_;
  d.pages_outlier = pool_->num_used(BlockKind::kOutlier);
  d.outlier_tokens = outlier_tokens_;
  d.outliers_dropped = outliers_dropped_;
  return d;
}

}  // namespace subspace::cuda
