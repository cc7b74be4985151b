// Builds the decode-attention plan (decode_plan.h) from each sequence's block table, as the
// scheduler will once per step: validates every page, slot, epoch and outlier mask, maps the
// sequence's epochs to local indices, and partitions the blocks into split-K work items.
// Host-only C++; builds without nvcc.
#ifndef SUBSPACE_CUDA_DECODE_PLAN_BUILDER_H_
#define SUBSPACE_CUDA_DECODE_PLAN_BUILDER_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/decode_plan.h"
#include "kernels/kv_layout.h"

namespace subspace::cuda {

// One sequence's blocks of one layer, as CompressedKvCache keeps them (BlockEntry,
// block_epochs, outlier_pos / outlier_pages). The query attends tokens [window_start, length).
struct DecodeSeqDesc {
  int64_t length = 0;  // >= 1
  // A sliding window's first position, in [0, length): the plan masks every row before it
  // (block rows and outlier rows alike) and drops nothing, so block b still starts at b * B.
  int64_t window_start = 0;
  std::vector<int32_t> pages;   // [ceil(length / B)] page, or slab page if compressed
  std::vector<int32_t> slots;   // [ceil(length / B)] kernels::kFullBlock, else the slab slot
  std::vector<int32_t> epochs;  // [ceil(length / B), n_kv] basis-table epoch of each
                                //   compressed block-head; -1 for full blocks
  std::vector<uint64_t> outlier_masks;  // [ceil(length / B)] or empty (none); bit t: token t
                                        //   of a compressed block is in the outlier pages
  std::vector<int32_t> outlier_pages;   // [ceil(n_outliers / B)] full fp16 pages, B tokens each
  int64_t n_outliers = 0;               // outlier tokens, = set mask bits
};

struct DecodePlanOptions {
  // > 0: work items of at most this many blocks (tests force many splits this way).
  int blocks_per_split = 0;
  // With blocks_per_split 0: CTAs (work items x KV heads) to aim for, e.g. 2 x multiprocessors;
  // 0 or no more than one CTA per sequence and head: one work item per sequence.
  int target_ctas = 0;
};

struct DecodePlan {
  kernels::DecodePlanLayout layout;
  std::vector<uint64_t> buffer;  // [ceil(layout.total_bytes / 8)] copied to the device as is

  const void* data() const { return buffer.data(); }
  int64_t bytes() const { return layout.total_bytes; }
  kernels::DecodePlanView HostView() const {
    return kernels::MakeDecodePlanView(layout, buffer.data());
  }
  // The view of a copy of `buffer` at `device_base` (8-byte aligned; cudaMalloc gives 256).
  kernels::DecodePlanView DeviceView(const void* device_base) const {
    return kernels::MakeDecodePlanView(layout, device_base);
  }
};

// The array offsets of a plan with these counts (BuildDecodePlan uses it too); total_bytes grows
// with every count, so the layout of the largest counts a step can have bounds every plan's
// bytes (the CUDA backend sizes its plan buffers once with it).
kernels::DecodePlanLayout LayoutDecodePlan(int64_t num_seqs, int64_t num_blocks, int64_t num_epochs,
                                           int64_t num_work, int n_kv);
// Most work items a plan of `num_seqs` sequences can have under `options` (each sequence gets
// ceil(blocks / per_split) <= blocks / per_split + 1, and per_split >= blocks * n_kv /
// target_ctas); -1 when blocks_per_split fixes the split (no bound without the block count).
int64_t MaxDecodeWork(int64_t num_seqs, const DecodePlanOptions& options);

// INVALID_ARGUMENT for a bad layout, a sequence whose arrays do not match its length, a page
// outside [0, num_pages), a slot outside the page, an epoch outside [0, num_basis_epochs), a
// mask on a full block or past a block's tokens, outliers that do not match the masks, a
// window_start outside [0, length), more
// than kMaxSeqEpochs epochs in a sequence, or more blocks than int32 counts.
absl::StatusOr<DecodePlan> BuildDecodePlan(const kernels::KvPoolLayout& layout, int64_t num_pages,
                                           int num_basis_epochs,
                                           std::span<const DecodeSeqDesc> seqs,
                                           const DecodePlanOptions& options = {});

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_DECODE_PLAN_BUILDER_H_
