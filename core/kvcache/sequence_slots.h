// Per-sequence state slots shared by the KV caches: a SeqId indexes a vector of states, freed
// ids are recycled LIFO (a recycled slot keeps the capacity of its block tables, so creating a
// sequence allocates nothing in steady state), and lookups reject unknown or freed ids.
#ifndef SUBSPACE_CORE_KVCACHE_SEQUENCE_SLOTS_H_
#define SUBSPACE_CORE_KVCACHE_SEQUENCE_SLOTS_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

// `State` has a `bool live` member; its other fields belong to the cache.
template <typename State>
class SequenceSlots {
 public:
  State* Find(SeqId id) {
    if (id < 0 || static_cast<size_t>(id) >= slots_.size() || !slots_[id].live) return nullptr;
    return &slots_[id];
  }
  const State* Find(SeqId id) const {
    if (id < 0 || static_cast<size_t>(id) >= slots_.size() || !slots_[id].live) return nullptr;
    return &slots_[id];
  }

  // A recycled slot, or a new one handed to `init_new(State&)` once (to size its tables).
  // The slot comes back live; the caller resets the rest of its state.
  template <typename InitNew>
  absl::StatusOr<SeqId> Acquire(InitNew&& init_new) {
    SeqId id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      if (slots_.size() >= static_cast<size_t>(std::numeric_limits<SeqId>::max())) {
        return absl::ResourceExhaustedError("too many KV cache sequences");
      }
      id = static_cast<SeqId>(slots_.size());
      slots_.emplace_back();
      init_new(slots_.back());
    }
    slots_[id].live = true;
    ++live_;
    return id;
  }

  // `id` must be live; the caller has already released what the state held.
  void Release(SeqId id) {
    slots_[id].live = false;
    free_.push_back(id);
    --live_;
  }

  // Unchecked access for ids the caller has validated (e.g. inside Attend).
  State& operator[](SeqId id) { return slots_[static_cast<size_t>(id)]; }
  const State& operator[](SeqId id) const { return slots_[static_cast<size_t>(id)]; }

  int32_t live() const { return live_; }
  // Every slot, live or not.
  const std::vector<State>& all() const { return slots_; }

 private:
  std::vector<State> slots_;
  std::vector<SeqId> free_;  // LIFO of dead slots
  int32_t live_ = 0;
};

// What every cache answers alike, full-rank or compressed, in host or device memory.
inline absl::Status UnknownSequence(SeqId seq) {
  return absl::NotFoundError(absl::StrFormat("unknown sequence %d", seq));
}
// Commit of `seq` to `length` with `committed` tokens committed and `reserved` reserved.
inline absl::Status CheckCommit(SeqId seq, int64_t length, int64_t committed, int64_t reserved) {
  if (length < committed || length > reserved) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "commit of sequence %d to length %d outside [%d, %d] (committed, reserved); shrink "
        "with Truncate",
        seq, length, committed, reserved));
  }
  return absl::OkStatus();
}
// Truncate of `seq` to `length` with `committed` tokens committed.
inline absl::Status CheckTruncate(SeqId seq, int64_t length, int64_t committed) {
  if (length < 0 || length > committed) {
    return absl::InvalidArgumentError(
        absl::StrFormat("truncate of sequence %d to %d outside [0, %d]", seq, length, committed));
  }
  return absl::OkStatus();
}
// KvCacheStats::bytes_full_fp16_equivalent: `tokens` full-rank at fp16 in every layer.
inline int64_t Fp16Bytes(const KvCacheGeometry& g, int64_t tokens) {
  return tokens * g.n_layers * 2 * static_cast<int64_t>(g.n_kv_heads) * g.head_dim * 2;
}

}  // namespace subspace

#endif  // SUBSPACE_CORE_KVCACHE_SEQUENCE_SLOTS_H_
