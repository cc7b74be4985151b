// The CUDA backend's step planning, the host half of "plan on the host, run on the device": from
// a batch of chunks and the device KV cache's block tables, one step's metadata (tokens,
// positions, slot mapping, logit rows, the decode plan, prefill block tables and the expansions
// of compressed history into scratch pages) written into the pinned buffer that cuda_model.cc
// copies to the device in one go. Internal to the backend (and its host tests): host C++ only.
#ifndef SUBSPACE_CUDA_CUDA_STEP_PLAN_H_
#define SUBSPACE_CUDA_CUDA_STEP_PLAN_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "core/model/model_runner.h"
#include "cuda/decode_plan_builder.h"
#include "cuda/device_kv_cache.h"

namespace subspace::cuda {

// Byte offsets of one step's metadata, identical in the pinned host buffer and its device mirror.
struct StepMetaLayout {
  int64_t tokens = 0;         // [T] int32
  int64_t positions = 0;      // [T] int32
  int64_t slot_mapping = 0;   // [T] int64
  int64_t logit_rows = 0;     // [T] int32
  int64_t block_table = 0;    // [S, max_blocks_per_seq] int32 (prefill chunks)
  int64_t q_indptr = 0;       // [S + 1] int32
  int64_t q_start = 0;        // [S] int32
  int64_t plan = 0;           // decode plan buffer
  int64_t plan_capacity = 0;  // its bound (LayoutDecodePlan of the largest step)
  // Coded blocks: the blocks prefill chunks read decoded into scratch pages, per group of
  // chunks whose expansions fit the scratch (src page, src slot, scratch page, first position:
  // [E] each; epochs [E, n_kv]).
  int64_t exp_src_page = 0;
  int64_t exp_src_slot = 0;
  int64_t exp_dst = 0;
  int64_t exp_epoch = 0;
  int64_t exp_first_pos = 0;  // [E] position of each expanded block's first token
  // With outliers, each expansion's outlier tokens (an OutlierBatch over the scratch pages:
  // mask [E] uint64, first slot [E], outlier pages [E, 2]; mask 0 for blocks without any).
  int64_t exp_outlier_mask = 0;
  int64_t exp_outlier_first = 0;
  int64_t exp_outlier_pages = 0;
  int64_t exp_capacity = 0;          // E at most
  int64_t exp_outlier_capacity = 0;  // E with outliers, else 0
  // Device sampling (ForwardAndSample): per chunk, arrays of S each: temperature, top_k, top_p,
  // min_p, uniform in; token, logprob out.
  int64_t sample_params = 0;  // [5, S] 4-byte values
  int64_t sample_out = 0;     // [2, S]
  // KQ-SVD refresh: the activation rows whose queries the step reads back ([Q] int32).
  int64_t query_rows = 0;
  int64_t query_capacity = 0;  // Q
  int64_t total = 0;
};

// What bounds every step's metadata; fixed at start-up.
struct StepMetaLimits {
  int64_t max_tokens = 0;          // T: rows per step
  int64_t max_sequences = 0;       // S: chunks per step
  int64_t max_blocks_per_seq = 0;  // blocks of a whole context
  int64_t pool_blocks = 0;         // page ids of the KV pool
  int n_kv_heads = 0;
  int target_ctas = 0;      // decode split-K
  bool compressed = false;  // coded blocks: slab pages, epochs and expansions
  bool outliers = false;    // ... and outlier pages (up to one per compressed block)
  int64_t query_rows = 0;   // query rows one step reads back (0: none; see PlanQueryRows)
};

// Offsets (each array aligned as Carver aligns) that hold any step within `limits`; the decode
// plan's capacity bounds the plan of the largest such step.
StepMetaLayout LayoutStepMeta(const StepMetaLimits& limits);

// What a step is planned against: everything but the batch, fixed once the backend exists.
struct StepPlanInputs {
  const StepMetaLayout* meta = nullptr;
  uint8_t* meta_host = nullptr;  // [meta->total] the pinned buffer the plan is written into
  int block_size = 0;
  int n_kv_heads = 0;
  int target_ctas = 0;                   // decode split-K
  int64_t sliding_window = 0;            // ModelConfig::sliding_window (0: none)
  const DeviceKvCache* cache = nullptr;  // the cache the step runs on
  // The scratch pages one group of prefill chunks may expand its coded history into (0 for a
  // cache without coded blocks).
  int64_t scratch_pages = 0;
};

// A sequence's queries in one step's readback: rows [first, first + n) of it, each standing for
// `weight` of the chunk's queries (an even subset when the readback is short).
struct QuerySpan {
  SeqId seq = -1;
  int64_t first = 0;
  int64_t n = 0;
  double weight = 1.0;
};

// A chunk whose queries are wanted: activation rows [first_row, first_row + n).
struct QueryChunk {
  SeqId seq = -1;
  int64_t first_row = 0;
  int64_t n = 0;
};

// Shares `capacity` readback rows among `chunks` max-min fairly (every chunk gets its rows or an
// equal share of what is left, so with capacity >= chunks each gets at least one); a chunk given
// k < n rows keeps rows first_row + floor((i + 1/2) n / k), i < k, weighted n / k. Writes the
// activation row of each readback row to `rows` (room for `capacity`), one span per chunk given
// any, in chunk order; returns the rows used.
int64_t PlanQueryRows(std::span<const QueryChunk> chunks, int64_t capacity, int32_t* rows,
                      std::vector<QuerySpan>* spans);

// What the forward pass reads of a plan besides the metadata bytes. Reused step after step: the
// vectors grow only to the largest step.
struct StepPlan {
  // Decodes (one-token chunks) come first: rows [0, n_decode) are the decode kernel's sequences.
  // The prefill chunks follow in the caller's order; logit rows stay in the caller's order.
  int64_t n_decode = 0;
  int64_t n_prefill = 0;
  DecodePlan decode;         // empty without decodes; its bytes are at meta.plan
  int64_t meta_bytes = 0;    // the metadata's prefix this step fills, up to the decode plan's end
  int32_t table_stride = 1;  // blocks per prefill block table row
  int32_t max_q = 1;         // rows of the longest prefill chunk
  // Groups of consecutive prefill chunks whose expanded history fits the scratch together; the
  // full-rank cache has one group and no expansions.
  std::vector<int> group_end;      // [groups] one past each group's last prefill chunk
  std::vector<int64_t> group_exp;  // [groups + 1] first expansion of each group
  int64_t n_exp = 0;               // expansions of all groups: the used prefix of the exp_ lists
  bool exp_outliers = false;       // some expansion has outlier tokens to put back
  // KQ-SVD refresh: query rows to read back (meta.query_rows' used prefix), and whose they are.
  int64_t n_query_rows = 0;
  std::vector<QuerySpan> query_spans;
};

// Fills StepPlans; holds the host scratch it reuses from step to step.
class StepPlanner {
 public:
  // Writes the metadata of `batch` (validated by the caller against the limits) into
  // in.meta_host and the rest into `plan`. INVALID_ARGUMENT from BuildDecodePlan for block
  // tables it rejects; INTERNAL for a decode plan over its buffer.
  absl::Status Plan(const StepPlanInputs& in, std::span<const SequenceChunk> batch, StepPlan* plan);

 private:
  // Reused per step.
  std::vector<int> order_;            // chunk indices: decodes first, then prefills
  std::vector<int64_t> first_row_;    // [chunks] the chunk's first activation row
  std::vector<DecodeSeqDesc> descs_;  // decode chunks
  std::vector<QueryChunk> query_chunks_;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_CUDA_STEP_PLAN_H_
