// Decode-attention plan: the metadata one decode step needs, built once on the host
// (decode_plan_builder.h) into one buffer that is copied to the device as is (plan, then run,
// as FlashInfer splits them). It lists each sequence's blocks of one layer with their kind,
// page, slot, per-head epoch and outlier mask, the sequence's live basis epochs, and the
// split-K partition into work items. Kernels and the CPU twin read it through DecodePlanView.
// C++17 and free of CUDA headers.
#ifndef SUBSPACE_KERNELS_DECODE_PLAN_H_
#define SUBSPACE_KERNELS_DECODE_PLAN_H_

#include <cstdint>

#include "kernels/kv_layout.h"

namespace subspace::kernels {

// Live epochs one sequence may have in one layer: bounds the per-epoch query coefficients and
// value accumulators a CTA keeps in shared memory. The compactor keeps sequences far below it.
inline constexpr int kMaxSeqEpochs = 8;
// block_slot value of a full-rank fp16 block (sinks, window, outlier pages).
inline constexpr int32_t kFullBlock = -1;

// Byte offsets of the plan's arrays inside its buffer; the counts size them. The uint64 array
// comes first so that every array is naturally aligned when the buffer base is 8-aligned.
struct DecodePlanLayout {
  int32_t num_seqs = 0;
  int32_t num_blocks = 0;  // blocks of all sequences, outlier pages included
  int32_t num_epochs = 0;  // live epochs summed over sequences
  int32_t num_work = 0;    // split-K work items; one CTA per work item and KV head
  int32_t n_kv_heads = 0;
  int32_t max_seq_epochs = 0;   // most live epochs of one sequence (sizes the partials)
  int32_t max_work_blocks = 0;  // most blocks in one work item
  int64_t block_masked = 0;
  int64_t seq_len = 0;
  int64_t seq_block_indptr = 0;
  int64_t seq_epoch_indptr = 0;
  int64_t seq_epochs = 0;
  int64_t seq_work_indptr = 0;
  int64_t block_page = 0;
  int64_t block_slot = 0;
  int64_t block_tokens = 0;
  int64_t block_epoch = 0;
  int64_t work_seq = 0;
  int64_t work_block_begin = 0;
  int64_t work_block_end = 0;
  int64_t total_bytes = 0;
};

// Typed pointers into one copy of the plan buffer (host for the twin, device for the kernels).
// Blocks of a sequence: its block table in position order, then its outlier pages; softmax is
// order-free, so the outliers' place in the list does not matter.
struct DecodePlanView {
  int32_t num_seqs = 0;
  int32_t num_blocks = 0;
  int32_t num_work = 0;
  int32_t n_kv_heads = 0;
  int32_t max_seq_epochs = 0;
  const uint64_t* block_masked = nullptr;     // [num_blocks] bit t: row t is not attended
                                              //   here: a compressed block's token read from
                                              //   an outlier page instead, or (any block,
                                              //   outlier pages too) a token before the
                                              //   sequence's sliding window
  const int32_t* seq_len = nullptr;           // [num_seqs] tokens the query attends (>= 1)
  const int32_t* seq_block_indptr = nullptr;  // [num_seqs + 1] first element 0, last num_blocks
  const int32_t* seq_epoch_indptr = nullptr;  // [num_seqs + 1] first element 0, last num_epochs
  const int32_t* seq_epochs = nullptr;  // [num_epochs] basis-table epoch of the sequence's local
                                        //   epoch e at seq_epoch_indptr[s] + e
  const int32_t* seq_work_indptr = nullptr;  // [num_seqs + 1] first element 0, last num_work;
                                             //   a sequence's work items are consecutive
  const int32_t* block_page = nullptr;       // [num_blocks] pool page (the slab page if compressed)
  const int32_t* block_slot = nullptr;       // [num_blocks] kFullBlock, else the slab slot
  const int32_t* block_tokens = nullptr;     // [num_blocks] valid tokens, 1..B
  const int32_t* block_epoch = nullptr;      // [num_blocks, n_kv] local epoch of each head's
                                             //   coefficients; -1 for full blocks
  const int32_t* work_seq = nullptr;         // [num_work] the sequence a work item belongs to
  const int32_t* work_block_begin = nullptr;  // [num_work] first block (absolute index)
  const int32_t* work_block_end = nullptr;    // [num_work] one past the last block

  SUBSPACE_HOST_DEVICE int32_t SeqEpochs(int s) const {
    return seq_epoch_indptr[s + 1] - seq_epoch_indptr[s];
  }
  SUBSPACE_HOST_DEVICE bool IsFull(int b) const { return block_slot[b] == kFullBlock; }
};

inline DecodePlanView MakeDecodePlanView(const DecodePlanLayout& l, const void* base) {
  const auto* p = static_cast<const uint8_t*>(base);
  const auto i32 = [p](int64_t off) { return reinterpret_cast<const int32_t*>(p + off); };
  DecodePlanView v;
  v.num_seqs = l.num_seqs;
  v.num_blocks = l.num_blocks;
  v.num_work = l.num_work;
  v.n_kv_heads = l.n_kv_heads;
  v.max_seq_epochs = l.max_seq_epochs;
  v.block_masked = reinterpret_cast<const uint64_t*>(p + l.block_masked);
  v.seq_len = i32(l.seq_len);
  v.seq_block_indptr = i32(l.seq_block_indptr);
  v.seq_epoch_indptr = i32(l.seq_epoch_indptr);
  v.seq_epochs = i32(l.seq_epochs);
  v.seq_work_indptr = i32(l.seq_work_indptr);
  v.block_page = i32(l.block_page);
  v.block_slot = i32(l.block_slot);
  v.block_tokens = i32(l.block_tokens);
  v.block_epoch = i32(l.block_epoch);
  v.work_seq = i32(l.work_seq);
  v.work_block_begin = i32(l.work_block_begin);
  v.work_block_end = i32(l.work_block_end);
  return v;
}

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_DECODE_PLAN_H_
