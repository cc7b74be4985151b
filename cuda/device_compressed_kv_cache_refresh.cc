// DeviceCompressedKvCache: online refresh and the compactor (see the header). The refresher and
// its statistics are the CPU cache's (core/compress/refresher.h); what differs is where the blocks
// come from (a readback of the pages a Flush compresses, never waited for: a copy still in flight
// at the next Flush just means that Flush's blocks go unobserved, which the refresher's statistics
// tolerate as they tolerate its own dropped blocks) and how old blocks are re-coded (in place, by
// recode_blocks: k^ = P_q[old] c in float, then c' = P_k[new]^T k^ -- the CPU compactor's r x r
// map, applied through the row).
#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "cuda/device_compressed_kv_cache.h"

namespace subspace::cuda {
namespace {

// Blocks (every layer and KV head) the compactor re-codes per Flush: a refresh's worth of
// catching up is spread over steps. At B = 16 a block is one small launch's worth of work.
constexpr int64_t kCompactBlocksPerFlush = 16;

}  // namespace

absl::Status DeviceCompressedKvCache::SetSequenceRefresh(SeqId seq, const RefreshConfig& config) {
  if (absl::Status st = ValidateRefreshConfig(config); !st.ok()) return st;
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  if (config.method == RefreshMethod::kKqsvd && config_.n_query_heads == 0) {
    return absl::FailedPreconditionError(
        "kqsvd refresh needs the queries, which this backend does not read back (no room for "
        "them): use pca, oja or fd (or the CPU backend)");
  }
  epochs_.CloseStream(*s);
  s->refresh = config;
  epochs_.OpenStream(*s, seq);  // now if it has an epoch, else at its first compression
  QueueCompaction(*s, seq);     // a smaller max_epochs
  return absl::OkStatus();
}

bool DeviceCompressedKvCache::WantsQueries(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  return s != nullptr && s->stream != 0 && s->refresh.method == RefreshMethod::kKqsvd;
}

absl::Status DeviceCompressedKvCache::ObserveQueries(SeqId seq, HalfQueryObservation queries) {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  if (!WantsQueries(seq)) {
    return absl::FailedPreconditionError(
        absl::StrFormat("sequence %d does not refresh by kqsvd (or has no epoch yet)", seq));
  }
  const int64_t width = int64_t{config_.n_query_heads} * config_.geometry.head_dim;
  if (queries.n_layers != config_.geometry.n_layers || queries.width != width) {
    return absl::InvalidArgumentError(
        absl::StrFormat("queries of %d layers x %d values per row; the cache has %d layers x %d",
                        queries.n_layers, queries.width, config_.geometry.n_layers, width));
  }
  // False: the refresher is behind and dropped them (counted there).
  return epochs_.refresher()->Observe(s->stream, std::move(queries)).status();
}

// Live epochs are those of coded blocks, as in the CPU cache: a new epoch counts once a block is
// coded with it (so the compactor moves blocks in the same Commit's Flush as the CPU cache).
bool DeviceCompressedKvCache::NeedsCompaction(const Sequence& s) const {
  return s.refresh.method != RefreshMethod::kNone &&
         s.coded_blocks.size() > static_cast<size_t>(s.refresh.max_epochs);
}

void DeviceCompressedKvCache::InstallPublishedEpochs() {
  for (Refresher::Published& p : epochs_.refresher()->TakePublished()) {
    const SeqId seq = epochs_.StreamSequence(p.stream);
    if (seq < 0) continue;  // the sequence went away or restarted its refresh
    // Its shapes are the cache's own; the one failure is a full basis table. The refresher
    // publishes again after its next T tokens.
    absl::StatusOr<EpochId> id = epochs_.Register(std::move(p.epoch.basis));
    if (!id.ok()) {
      ++refreshes_unplaced_;
      continue;
    }
    Sequence& s = seqs_[seq];
    epochs_.Release(s.epoch);
    s.epoch = *id;  // Register's reference is the sequence's now
    ++refreshes_installed_;
  }
}

void DeviceCompressedKvCache::QueueCompaction(const Sequence& s, SeqId seq) {
  if (NeedsCompaction(s) && std::find(compact_.begin(), compact_.end(), seq) == compact_.end()) {
    compact_.push_back(seq);
  }
}

absl::Status DeviceCompressedKvCache::StartObservations() {
  std::vector<int32_t> pages;
  std::vector<HalfBlockBatch::Block> blocks;
  const bool busy = !readback_blocks_.empty();
  for (size_t i = 0; i < pending_src_.size(); ++i) {
    if (pending_stream_[i] == 0) continue;
    if (busy || static_cast<int64_t>(pages.size()) >= store_->readback_capacity()) {
      ++blocks_unobserved_;
      continue;
    }
    pages.push_back(pending_src_[i]);
    blocks.push_back({pending_stream_[i], epochs_.registry().GetShared(pending_epoch_id_[i])});
  }
  if (pages.empty()) return absl::OkStatus();
  if (absl::Status st = store_->StartReadback(pages); !st.ok()) return st;
  readback_blocks_ = std::move(blocks);
  return absl::OkStatus();
}

absl::Status DeviceCompressedKvCache::PollObservations() {
  if (readback_blocks_.empty()) return absl::OkStatus();
  HalfBlockBatch batch;
  absl::StatusOr<bool> landed = store_->TakeReadback(&batch.data);
  if (!landed.ok()) return landed.status();
  if (!*landed) return absl::OkStatus();
  batch.block_size = config_.block_size;
  batch.blocks = std::move(readback_blocks_);
  readback_blocks_.clear();
  // False: the refresher is behind and dropped it (counted there).
  absl::StatusOr<bool> observed = epochs_.refresher()->Observe(std::move(batch));
  return observed.status();
}

absl::Status DeviceCompressedKvCache::Compact() {
  const int n_kv = config_.geometry.n_kv_heads;
  int64_t budget = kCompactBlocksPerFlush;
  std::vector<int32_t> pages, slots, old_entries, new_entries;
  std::vector<int64_t> moved;  // block indices
  size_t kept = 0;
  for (size_t i = 0; i < compact_.size(); ++i) {
    const SeqId seq = compact_[i];
    Sequence* s = seqs_.Find(seq);
    while (s != nullptr && budget > 0 && NeedsCompaction(*s)) {
      EpochId oldest = kNoEpoch;  // ids grow with time
      for (const auto& [epoch, count] : s->coded_blocks) {
        if (epoch != s->epoch && (oldest == kNoEpoch || epoch < oldest)) oldest = epoch;
      }
      const int64_t n = std::min(budget, s->coded_blocks[oldest]);
      pages.clear();
      slots.clear();
      moved.clear();
      for (int64_t b = 0;
           b < static_cast<int64_t>(s->tables[0].size()) && static_cast<int64_t>(moved.size()) < n;
           ++b) {
        if (s->block_epochs[static_cast<size_t>(b)] != oldest) continue;
        const Block& e = s->tables[0][static_cast<size_t>(b)];
        pages.push_back(e.page);
        slots.push_back(e.slot);
        moved.push_back(b);
      }
      old_entries.assign(moved.size() * n_kv, entries_.at(oldest));
      new_entries.assign(moved.size() * n_kv, entries_.at(s->epoch));
      if (absl::Status st = store_->Recode(
              {.page = pages, .slot = slots, .from = old_entries, .to = new_entries});
          !st.ok()) {
        return st;
      }
      for (const int64_t b : moved) {
        if (absl::Status acquired = epochs_.Acquire(s->epoch); !acquired.ok()) return acquired;
        s->tables[0][static_cast<size_t>(b)].entry = entries_.at(s->epoch);
        s->block_epochs[static_cast<size_t>(b)] = s->epoch;
        ++s->coded_blocks[s->epoch];
        if (--s->coded_blocks[oldest] == 0) s->coded_blocks.erase(oldest);
        epochs_.Release(oldest);  // may free its table entry: the store reads it first, in order
      }
      budget -= static_cast<int64_t>(moved.size());
      blocks_recoded_ += static_cast<int64_t>(moved.size());
    }
    if (s != nullptr && NeedsCompaction(*s)) compact_[kept++] = seq;
  }
  compact_.resize(kept);
  return absl::OkStatus();
}

}  // namespace subspace::cuda
