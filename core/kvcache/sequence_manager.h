// The sequence manager every KV cache uses, full-rank or compressed, in host or device memory:
// sequence ids, committed lengths, block tables over a BlockPool, reservation (admission
// arithmetic), commit and truncation with their checks, the token count and the pool's stats.
// A cache adds only what its kind needs: what a table entry holds (`Entry`), per-sequence state
// (`Extra`), and what happens when its blocks are coded, expanded or freed.
//
// Tables. A cache keeps one table per layer (host caches: a pool block is one layer's block) or
// one table for every layer (device caches: block id b is page b of each layer's slice of the
// pool, so one table and one decode plan serve all layers). Either way block counts are reported
// per layer (the scheduler's blocks per token = n_layers / B, whichever backend runs).
//
// Called from one thread (the engine's step loop); the Sequence objects stay put while their
// ids are live, so a cache's attention may read them from worker threads.
#ifndef SUBSPACE_CORE_KVCACHE_SEQUENCE_MANAGER_H_
#define SUBSPACE_CORE_KVCACHE_SEQUENCE_MANAGER_H_

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/kvcache/block_pool.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

// KvCacheStats::bytes_full_fp16_equivalent: `tokens` full-rank at fp16 in every layer.
inline int64_t Fp16Bytes(const KvCacheGeometry& g, int64_t tokens) {
  return tokens * g.n_layers * 2 * static_cast<int64_t>(g.n_kv_heads) * g.head_dim * 2;
}

// What every cache's Create checks alike: INVALID_ARGUMENT unless every size is positive.
inline absl::Status CheckKvGeometry(const KvCacheGeometry& g) {
  if (g.n_layers <= 0 || g.n_kv_heads <= 0 || g.head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("KV cache geometry must be positive: n_layers=%d n_kv_heads=%d head_dim=%d",
                        g.n_layers, g.n_kv_heads, g.head_dim));
  }
  return absl::OkStatus();
}

// The blocks of `block_bytes` a host pool of `capacity_bytes` holds; INVALID_ARGUMENT below one
// per layer (a token needs one in every layer).
inline absl::StatusOr<int64_t> BlocksForCapacity(int64_t capacity_bytes, int64_t block_bytes,
                                                 int n_layers) {
  const int64_t blocks = capacity_bytes / block_bytes;
  if (blocks < n_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV cache capacity %d bytes holds %d blocks of %d bytes; one token needs %d (one per "
        "layer)",
        capacity_bytes, std::max<int64_t>(blocks, 0), block_bytes, n_layers));
  }
  return blocks;
}

// No per-sequence state beyond the manager's.
struct NoSequenceExtra {};

// `Entry` is built from a fresh full block's pool id as Entry{id} (an int32_t, or a struct whose
// first member is the page id); `Extra` is default-constructible.
template <typename Entry, typename Extra = NoSequenceExtra>
class SequenceManager {
 public:
  struct Options {
    int n_layers = 0;
    int block_size = 0;         // tokens per block
    bool shared_table = false;  // one table (and one pool id per block) serves every layer
    // Pool blocks Reserve leaves free (the device compressed cache opens a slab page from them
    // before the pages of the blocks it codes are released).
    int64_t headroom = 0;
    // Bytes one pool block stands for (every layer's slice of it with a shared table).
    int64_t block_bytes = 0;
  };

  struct Sequence : Extra {
    bool live = false;
    int64_t length = 0;                      // committed tokens
    std::vector<std::vector<Entry>> tables;  // [tables][blocks held], the same length in each
    int64_t blocks() const { return tables.empty() ? 0 : static_cast<int64_t>(tables[0].size()); }
  };

  // `pool` outlives the manager.
  SequenceManager(const Options& options, BlockPool* pool) : options_(options), pool_(pool) {
    assert(options.n_layers > 0 && options.block_size > 0 && pool != nullptr);
  }
  SequenceManager(const SequenceManager&) = delete;
  SequenceManager& operator=(const SequenceManager&) = delete;

  // --- Sequences ---
  // A live sequence of length 0 with empty tables. A recycled slot keeps its tables' capacity
  // and whatever its Extra held: the cache resets that.
  absl::StatusOr<SeqId> Create() {
    SeqId id;
    if (!free_ids_.empty()) {
      id = free_ids_.back();
      free_ids_.pop_back();
    } else {
      if (slots_.size() >= static_cast<size_t>(std::numeric_limits<SeqId>::max())) {
        return absl::ResourceExhaustedError("too many KV cache sequences");
      }
      id = static_cast<SeqId>(slots_.size());
      slots_.emplace_back();
      // Room for early decode steps, so the first blocks never regrow a table.
      slots_.back().tables.resize(static_cast<size_t>(num_tables()));
      for (std::vector<Entry>& t : slots_.back().tables) t.reserve(kInitialTableCapacity);
    }
    Sequence& s = slots_[static_cast<size_t>(id)];
    s.live = true;
    s.length = 0;
    for (std::vector<Entry>& t : s.tables) t.clear();
    ++live_;
    return id;
  }
  // Removes `seq`, whose blocks the cache has released (ReleaseBlocksPast(s, 0, ...)).
  void Remove(SeqId seq) {
    Sequence& s = slots_[static_cast<size_t>(seq)];
    assert(s.live && s.blocks() == 0);
    tokens_cached_ -= s.length;
    s.length = 0;
    s.live = false;
    free_ids_.push_back(seq);
    --live_;
  }
  // FreeSequence of a cache whose entries are plain pool ids.
  absl::Status Free(SeqId seq) {
    Sequence* s = Find(seq);
    if (s == nullptr) return Unknown(seq);
    ReleaseBlocksPast(*s, 0, [&](int, int64_t, Entry& e) { pool_->Free(EntryPage(e)); });
    Remove(seq);
    return absl::OkStatus();
  }

  Sequence* Find(SeqId id) {
    if (id < 0 || static_cast<size_t>(id) >= slots_.size() || !slots_[id].live) return nullptr;
    return &slots_[static_cast<size_t>(id)];
  }
  const Sequence* Find(SeqId id) const {
    if (id < 0 || static_cast<size_t>(id) >= slots_.size() || !slots_[id].live) return nullptr;
    return &slots_[static_cast<size_t>(id)];
  }
  // Unchecked access for ids the caller has validated (e.g. inside Attend).
  Sequence& operator[](SeqId id) { return slots_[static_cast<size_t>(id)]; }
  const Sequence& operator[](SeqId id) const { return slots_[static_cast<size_t>(id)]; }
  // Every slot, live or not.
  const std::vector<Sequence>& all() const { return slots_; }
  std::vector<Sequence>& all() { return slots_; }

  int64_t Length(SeqId seq) const {
    const Sequence* s = Find(seq);
    return s == nullptr ? 0 : s->length;
  }
  // The block table of one sequence and layer; empty for an unknown id or layer.
  const std::vector<Entry>* Table(SeqId seq, int layer) const {
    const Sequence* s = Find(seq);
    if (s == nullptr || layer < 0 || layer >= options_.n_layers) return nullptr;
    return &s->tables[static_cast<size_t>(options_.shared_table ? 0 : layer)];
  }

  // --- Admission and reservation ---
  // Blocks (per layer, as every cache counts them) needed beyond those held for `n` more tokens
  // of `seq` (an unknown id: a new sequence), plus `extra` blocks the cache needs besides.
  int64_t BlocksNeeded(SeqId seq, int64_t n, int64_t extra = 0) const {
    return NewBlocks(Find(seq), n, extra) * options_.n_layers;
  }
  // Whether the pool can give `seq` blocks for `n` more tokens plus `extra`: the number of new
  // table entries per table, or RESOURCE_EXHAUSTED (NOT_FOUND for an unknown id, INVALID_ARGUMENT
  // for n < 0). Changes nothing.
  absl::StatusOr<int64_t> CheckReserve(SeqId seq, int64_t n, int64_t extra = 0) const {
    const Sequence* s = Find(seq);
    if (s == nullptr) return Unknown(seq);
    if (n < 0) return absl::InvalidArgumentError(absl::StrFormat("cannot reserve %d tokens", n));
    const int64_t blocks = NewBlocks(s, n, extra);
    const int64_t ids = blocks * num_tables();
    const int64_t usable = std::max<int64_t>(pool_->num_free() - options_.headroom, 0);
    if (ids > usable) {
      const int64_t per_id = options_.shared_table ? options_.n_layers : 1;
      return absl::ResourceExhaustedError(absl::StrFormat(
          "KV cache full: sequence %d needs %d more blocks (%d per layer x %d layers) for %d "
          "tokens, %d of %d blocks free",
          seq, blocks * options_.n_layers, blocks, options_.n_layers,
          s->length + std::min(n, kMaxTokens), usable * per_id, pool_->num_blocks() * per_id));
    }
    return blocks - extra;
  }
  // Appends `blocks` fresh full blocks to every table of `seq` (CheckReserve said they fit).
  void AppendBlocks(Sequence& s, int64_t blocks) {
    for (std::vector<Entry>& table : s.tables) {
      for (int64_t i = 0; i < blocks; ++i) {
        const int32_t id = pool_->Allocate(BlockKind::kFull);
        assert(id >= 0);
        table.push_back(Entry{id});
      }
    }
  }
  // Ensures blocks for tokens [0, Length(seq) + n) in every table; RESOURCE_EXHAUSTED (and
  // nothing changed) when the pool has too few free blocks.
  absl::Status Reserve(SeqId seq, int64_t n) {
    absl::StatusOr<int64_t> blocks = CheckReserve(seq, n);
    if (!blocks.ok()) return blocks.status();
    AppendBlocks(*Find(seq), *blocks);
    return absl::OkStatus();
  }
  // Tokens the blocks held by `seq` can store (per layer); 0 for an unknown id.
  int64_t ReservedTokens(SeqId seq) const {
    const Sequence* s = Find(seq);
    return s == nullptr ? 0 : s->blocks() * options_.block_size;
  }

  // --- Commit and truncation ---
  // Marks tokens [0, length) of `seq` complete; INVALID_ARGUMENT outside [committed, reserved].
  absl::Status Commit(SeqId seq, int64_t length) {
    Sequence* s = Find(seq);
    if (s == nullptr) return Unknown(seq);
    const int64_t reserved = s->blocks() * options_.block_size;
    if (length < s->length || length > reserved) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "commit of sequence %d to length %d outside [%d, %d] (committed, reserved); shrink "
          "with Truncate",
          seq, length, s->length, reserved));
    }
    tokens_cached_ += length - s->length;
    s->length = length;
    return absl::OkStatus();
  }
  // Whether `seq` can be truncated to `length` (NOT_FOUND, INVALID_ARGUMENT outside
  // [0, committed]).
  absl::Status CheckTruncate(SeqId seq, int64_t length) const {
    const Sequence* s = Find(seq);
    if (s == nullptr) return Unknown(seq);
    if (length < 0 || length > s->length) {
      return absl::InvalidArgumentError(
          absl::StrFormat("truncate of sequence %d to %d outside [0, %d]", seq, length, s->length));
    }
    return absl::OkStatus();
  }
  // Drops tokens at and past `length`: every block past the ones holding them goes to
  // `release(table, b, entry)` (the reserved ones past the committed length too: Truncate undoes
  // a failed step), then the tables shrink. A block cut in the middle is the cache's business.
  template <typename Release>
  absl::Status Truncate(SeqId seq, int64_t length, Release&& release) {
    if (absl::Status st = CheckTruncate(seq, length); !st.ok()) return st;
    Sequence& s = *Find(seq);
    ReleaseBlocksPast(s, CeilDiv(length, int64_t{options_.block_size}), release);
    tokens_cached_ -= s.length - length;
    s.length = length;
    return absl::OkStatus();
  }
  // Truncate of a cache whose entries are plain pool ids.
  absl::Status Truncate(SeqId seq, int64_t length) {
    return Truncate(seq, length, [&](int, int64_t, Entry& e) { pool_->Free(EntryPage(e)); });
  }
  // Hands every block of `s` past the first `keep` to `release(table, b, entry)` and shrinks
  // the tables to `keep`.
  template <typename Release>
  void ReleaseBlocksPast(Sequence& s, int64_t keep, Release&& release) {
    for (size_t t = 0; t < s.tables.size(); ++t) {
      std::vector<Entry>& table = s.tables[t];
      for (int64_t b = keep; b < static_cast<int64_t>(table.size()); ++b) {
        release(static_cast<int>(t), b, table[static_cast<size_t>(b)]);
      }
      if (static_cast<int64_t>(table.size()) > keep) table.resize(static_cast<size_t>(keep));
    }
  }

  // --- Accounting ---
  // The pool's and the sequences' share of KvCacheStats: sizes, blocks by kind, tokens.
  KvCacheStats Stats(const KvCacheGeometry& geometry) const {
    const int64_t per_id = options_.shared_table ? options_.n_layers : 1;
    const int64_t bytes = options_.block_bytes;
    KvCacheStats st;
    st.bytes_total = pool_->num_blocks() * bytes;
    st.bytes_used_full = pool_->num_used(BlockKind::kFull) * bytes;
    // Whole slab pages: what the pool cannot give to anyone else (includes slab waste).
    st.bytes_used_compressed = pool_->num_used(BlockKind::kCompressed) * bytes;
    st.bytes_used_outlier = pool_->num_used(BlockKind::kOutlier) * bytes;
    st.blocks_total = pool_->num_blocks() * per_id;
    st.blocks_free = std::max<int64_t>(pool_->num_free() - options_.headroom, 0) * per_id;
    st.tokens_cached = tokens_cached_;
    st.bytes_full_fp16_equivalent = Fp16Bytes(geometry, tokens_cached_);
    st.sequences = live_;
    return st;
  }
  int32_t live() const { return live_; }
  int64_t tokens_cached() const { return tokens_cached_; }
  const Options& options() const { return options_; }

  static absl::Status Unknown(SeqId seq) {
    return absl::NotFoundError(absl::StrFormat("unknown sequence %d", seq));
  }

 private:
  // Token counts are capped here before any arithmetic so a hostile `n` cannot overflow; no
  // pool holds this many tokens, so the cap never changes an answer.
  static constexpr int64_t kMaxTokens = int64_t{1} << 48;
  static constexpr size_t kInitialTableCapacity = 64;

  static int32_t EntryPage(const Entry& e) {
    if constexpr (std::is_integral_v<Entry>) {
      return e;
    } else {
      return e.page;
    }
  }
  int num_tables() const { return options_.shared_table ? 1 : options_.n_layers; }
  // Table entries (per table) beyond those held for `n` more tokens, plus `extra`.
  int64_t NewBlocks(const Sequence* s, int64_t n, int64_t extra) const {
    const int64_t length = s == nullptr ? 0 : s->length;
    const int64_t held = s == nullptr ? 0 : s->blocks();
    const int64_t wanted = length + std::clamp<int64_t>(n, 0, kMaxTokens);
    return std::max<int64_t>(CeilDiv(wanted, int64_t{options_.block_size}) - held, 0) + extra;
  }

  Options options_;
  BlockPool* pool_;
  std::vector<Sequence> slots_;
  std::vector<SeqId> free_ids_;  // LIFO of dead slots
  int32_t live_ = 0;
  int64_t tokens_cached_ = 0;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_KVCACHE_SEQUENCE_MANAGER_H_
