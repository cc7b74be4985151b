// What the CUDA backend's step asks of a device KV cache, whatever its kind: where a sequence's
// blocks sit (a full page, or a coded slot of a slab page with its basis-table entry), the
// decode plan's description of a sequence, the bounds a plan is checked against, queued device
// work to issue, and the queries a refreshing sequence wants. The full-rank cache
// (device_paged_kv_cache.h) and the compressed one (device_compressed_kv_cache.h) implement it;
// the step planner (cuda_step_plan.h) and the model runner (cuda_model_step.cc) see only this,
// so a new cache kind adds a class, not a branch in either. Host C++ only: the bytes are the
// backend's (cuda_model_impl.h holds each layer's view of them).
#ifndef SUBSPACE_CUDA_DEVICE_KV_CACHE_H_
#define SUBSPACE_CUDA_DEVICE_KV_CACHE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/compress/refresher.h"
#include "core/kvcache/kv_cache.h"
#include "cuda/decode_plan_builder.h"
#include "kernels/kv_layout.h"

namespace subspace::cuda {

// Where block b of a sequence sits, in every layer's slice of the pool: a full page (slot
// kFullBlock), or slot `slot` of slab page `page` coded with basis-table entry `entry` (every KV
// head alike), whose outlier tokens (mask bit t: token t) are kept full-rank from slot
// `outlier_first_slot` of outlier page `outlier_pages[0]` on, then in `outlier_pages[1]` (the
// addressing of kernels/outlier_tokens.h).
struct DeviceBlockRef {
  int32_t page = -1;
  int32_t slot = kernels::kFullBlock;
  int32_t entry = -1;
  uint64_t outlier_mask = 0;
  int32_t outlier_first_slot = 0;
  int32_t outlier_pages[2] = {-1, -1};

  bool full() const { return slot == kernels::kFullBlock; }
};

// What a decode plan over the cache is checked against (BuildDecodePlan's bounds).
struct DecodePlanBounds {
  kernels::KvPoolLayout layout;  // the layout every slot index fits (the widest layer's)
  int64_t num_pages = 0;         // page ids of one layer's slice
  int num_basis_epochs = 0;      // basis-table entries (0: no coded blocks)
};

class DeviceKvCache : public KvCacheBase {
 public:
  // Issues queued device work (compressions, re-codes) to the backend's stream. The backend
  // calls it before a step's writes and after its commits; the full-rank cache has none.
  virtual absl::Status Flush() { return absl::OkStatus(); }

  // Block b of `seq` (b below the blocks it holds). New tokens always land in a full block.
  virtual DeviceBlockRef BlockOf(SeqId seq, int64_t b) const = 0;
  // The decode plan's description of `seq`'s first `length` tokens (every layer alike).
  virtual void DescribeDecode(SeqId seq, int64_t length, DecodeSeqDesc* desc) const = 0;
  virtual DecodePlanBounds plan_bounds() const = 0;

  // KQ-SVD refresh: whether `seq` wants its queries read back now, and those queries (every
  // layer's rows of one step, fp16). Caches without refresh want none.
  virtual bool WantsQueries(SeqId seq) const {
    (void)seq;
    return false;
  }
  virtual absl::Status ObserveQueries(SeqId seq, HalfQueryObservation queries) {
    (void)seq;
    (void)queries;
    return absl::FailedPreconditionError("this KV cache reads no queries");
  }
};

// A truncation into a coded block that found no page to decode it into leaves the sequence's
// last block coded and cut; the next Reserve decodes it first and counts its page. Shared by the
// device caches whose SequenceManager entries have a `slot` (kFullBlock for full pages).
template <typename Sequence>
bool CutCodedBlockPending(const Sequence& s, int block_size) {
  return s.length % block_size != 0 && s.blocks() > 0 &&
         s.tables[0].back().slot != kernels::kFullBlock;
}
template <typename Sequences>
int64_t BlocksNeededPastACutBlock(const Sequences& seqs, SeqId seq, int64_t n, int block_size) {
  const auto* s = seqs.Find(seq);
  const bool cut = s != nullptr && n > 0 && CutCodedBlockPending(*s, block_size);
  return seqs.BlocksNeeded(seq, n, cut ? 1 : 0);
}
// Reserve: all or nothing; `decode_last(sequence)` decodes the cut block into a page first.
template <typename Sequences, typename DecodeLast>
absl::Status ReservePastACutBlock(Sequences& seqs, SeqId seq, int64_t n, int block_size,
                                  DecodeLast&& decode_last) {
  const auto* found = seqs.Find(seq);
  const bool cut = found != nullptr && n > 0 && CutCodedBlockPending(*found, block_size);
  absl::StatusOr<int64_t> blocks = seqs.CheckReserve(seq, n, cut ? 1 : 0);
  if (!blocks.ok()) return blocks.status();
  auto& s = *seqs.Find(seq);
  if (cut) {
    if (absl::Status st = decode_last(s); !st.ok()) return st;
  }
  seqs.AppendBlocks(s, *blocks);
  return absl::OkStatus();
}

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_DEVICE_KV_CACHE_H_
