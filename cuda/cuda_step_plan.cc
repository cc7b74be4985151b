// Step planning for the CUDA backend: the layout of a step's metadata, and the pass over a batch
// that fills it from the KV cache's block tables. Kept apart from cuda_model.cc (weights, the
// one device allocation, the kernel launches) because it is host bookkeeping only: it reads the
// caches' tables and touches no device memory.
#include "cuda/cuda_step_plan.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/kvcache/block_pool.h"
#include "cuda/device_memory.h"
#include "kernels/decode_plan.h"

namespace subspace::cuda {
namespace {

template <typename T>
T* MetaHost(const StepPlanInputs& in, int64_t offset) {
  return reinterpret_cast<T*>(in.meta_host + offset);
}

// The page holding position `pos` of `seq` (a full block: new tokens always land in one).
int32_t FullPage(const StepPlanInputs& in, SeqId seq, int64_t pos) {
  return in.cache->BlockOf(seq, pos / in.block_size).page;
}

// Coded blocks among the first `blocks` of `seq`.
int64_t CodedBlocks(const StepPlanInputs& in, SeqId seq, int64_t blocks) {
  int64_t coded = 0;
  for (int64_t b = 0; b < blocks; ++b) coded += !in.cache->BlockOf(seq, b).full();
  return coded;
}

// Prefill block table row of one chunk; coded blocks go to scratch pages (-1 - j, j counted
// from the group's first expansion) with their expansions (and, with outliers, where each
// block's outliers sit) appended to the meta lists. True when some block has outliers.
bool PrefillTableRow(const StepPlanInputs& in, SeqId seq, int64_t blocks, int32_t* row,
                     int64_t* n_exp, int64_t group_first_exp) {
  auto* src_page = MetaHost<int32_t>(in, in.meta->exp_src_page);
  auto* src_slot = MetaHost<int32_t>(in, in.meta->exp_src_slot);
  auto* dst = MetaHost<int32_t>(in, in.meta->exp_dst);
  auto* epoch = MetaHost<int32_t>(in, in.meta->exp_epoch);
  auto* first_pos = MetaHost<int32_t>(in, in.meta->exp_first_pos);
  const bool with_outliers = in.meta->exp_outlier_capacity > 0;
  auto* outlier_mask = MetaHost<uint64_t>(in, in.meta->exp_outlier_mask);
  auto* outlier_first = MetaHost<int32_t>(in, in.meta->exp_outlier_first);
  auto* outlier_pages = MetaHost<int32_t>(in, in.meta->exp_outlier_pages);
  bool any = false;
  const int n_kv = in.n_kv_heads;
  for (int64_t b = 0; b < blocks; ++b) {
    const DeviceBlockRef e = in.cache->BlockOf(seq, b);
    if (e.full()) {
      row[b] = e.page;
      continue;
    }
    const int64_t j = *n_exp - group_first_exp;  // scratch page within the group
    src_page[*n_exp] = e.page;
    src_slot[*n_exp] = e.slot;
    dst[*n_exp] = static_cast<int32_t>(j);
    std::fill_n(epoch + *n_exp * n_kv, n_kv, e.entry);
    first_pos[*n_exp] = static_cast<int32_t>(b * in.block_size);
    if (with_outliers) {
      outlier_mask[*n_exp] = e.outlier_mask;
      outlier_first[*n_exp] = e.outlier_first_slot;
      outlier_pages[2 * *n_exp] = e.outlier_pages[0];
      outlier_pages[2 * *n_exp + 1] = e.outlier_pages[1];
      any = any || e.outlier_mask != 0;
    }
    row[b] = static_cast<int32_t>(-1 - j);
    ++*n_exp;
  }
  return any;
}

}  // namespace

int64_t PlanQueryRows(std::span<const QueryChunk> chunks, int64_t capacity, int32_t* rows,
                      std::vector<QuerySpan>* spans) {
  spans->clear();
  // Max-min fair shares: smallest chunks first, each taking its rows or an equal share (rounded
  // up, so nothing is left over) of what remains.
  std::vector<int64_t> order(chunks.size()), kept(chunks.size(), 0);
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return chunks[static_cast<size_t>(a)].n < chunks[static_cast<size_t>(b)].n;
  });
  int64_t left = std::max<int64_t>(capacity, 0);
  for (size_t k = 0; k < order.size(); ++k) {
    const int64_t waiting = static_cast<int64_t>(order.size() - k);
    const int64_t share = CeilDiv(left, waiting);
    const int64_t take =
        std::min(std::max<int64_t>(chunks[static_cast<size_t>(order[k])].n, 0), share);
    kept[static_cast<size_t>(order[k])] = take;
    left -= take;
  }
  int64_t used = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const QueryChunk& ch = chunks[i];
    const int64_t k = kept[i];
    if (k == 0) continue;
    for (int64_t j = 0; j < k; ++j) {
      // The middle of the j-th of k equal slices of the chunk's n rows.
      rows[used + j] = static_cast<int32_t>(ch.first_row + (2 * j + 1) * ch.n / (2 * k));
    }
    spans->push_back({.seq = ch.seq,
                      .first = used,
                      .n = k,
                      .weight = static_cast<double>(ch.n) / static_cast<double>(k)});
    used += k;
  }
  return used;
}

StepMetaLayout LayoutStepMeta(const StepMetaLimits& limits) {
  const int64_t t = limits.max_tokens, s = limits.max_sequences;
  StepMetaLayout meta;
  Carver c(nullptr, 0);
  const auto at = [&c](int64_t bytes) {
    const int64_t offset = c.used();
    c.Take(bytes);
    return offset;
  };
  meta.tokens = at(t * 4);
  meta.positions = at(t * 4);
  meta.slot_mapping = at(t * 8);
  meta.logit_rows = at(t * 4);
  meta.block_table = at(s * limits.max_blocks_per_seq * 4);
  meta.q_indptr = at((s + 1) * 4);
  meta.q_start = at(s * 4);
  // Blocks of one step: each sequence holds its own, so at most the pool's (a compressed
  // cache packs up to 64 slots to a page), and at most max_blocks_per_seq per sequence (twice
  // that with outlier pages: at most B outliers per compressed block, B to a page).
  const int64_t per_page = limits.compressed ? SlabAllocator::kMaxSlotsPerPage : 1;
  const int64_t per_seq = limits.max_blocks_per_seq * (limits.outliers ? 2 : 1);
  const int64_t blocks = std::min(s * per_seq, limits.pool_blocks * per_page + s);
  const int64_t work = MaxDecodeWork(s, {.target_ctas = limits.target_ctas});
  const int64_t epochs = limits.compressed ? s : 0;  // one per sequence
  meta.plan_capacity = LayoutDecodePlan(s, blocks, epochs, work, limits.n_kv_heads).total_bytes;
  meta.plan = at(meta.plan_capacity);
  meta.exp_capacity = limits.compressed ? blocks : 0;
  meta.exp_src_page = at(meta.exp_capacity * 4);
  meta.exp_src_slot = at(meta.exp_capacity * 4);
  meta.exp_dst = at(meta.exp_capacity * 4);
  meta.exp_epoch = at(meta.exp_capacity * limits.n_kv_heads * 4);
  meta.exp_first_pos = at(meta.exp_capacity * 4);
  meta.exp_outlier_capacity = limits.outliers ? meta.exp_capacity : 0;
  meta.exp_outlier_mask = at(meta.exp_outlier_capacity * 8);
  meta.exp_outlier_first = at(meta.exp_outlier_capacity * 4);
  meta.exp_outlier_pages = at(meta.exp_outlier_capacity * 2 * 4);
  meta.sample_params = at(5 * s * 4);
  meta.sample_out = at(2 * s * 4);
  meta.query_capacity = limits.query_rows;
  meta.query_rows = at(meta.query_capacity * 4);
  meta.total = c.used();
  return meta;
}

absl::Status StepPlanner::Plan(const StepPlanInputs& in, std::span<const SequenceChunk> batch,
                               StepPlan* plan) {
  const StepMetaLayout& meta = *in.meta;
  const int bs = in.block_size;
  plan->decode = DecodePlan();

  // Decodes first (their rows are the decode kernel's sequences), then prefill chunks; logit
  // rows in the caller's chunk order.
  const auto is_decode = [](const SequenceChunk& ch) { return ch.tokens.size() == 1; };
  order_.clear();
  for (size_t ci = 0; ci < batch.size(); ++ci) {
    if (is_decode(batch[ci])) order_.push_back(static_cast<int>(ci));
  }
  const int64_t n_decode = static_cast<int64_t>(order_.size());
  plan->n_decode = n_decode;
  for (size_t ci = 0; ci < batch.size(); ++ci) {
    if (!is_decode(batch[ci])) order_.push_back(static_cast<int>(ci));
  }
  auto* tokens = MetaHost<int32_t>(in, meta.tokens);
  auto* positions = MetaHost<int32_t>(in, meta.positions);
  auto* slots = MetaHost<int64_t>(in, meta.slot_mapping);
  first_row_.assign(batch.size(), 0);
  int64_t row = 0;
  for (int ci : order_) {
    const SequenceChunk& ch = batch[static_cast<size_t>(ci)];
    first_row_[static_cast<size_t>(ci)] = row;
    for (size_t i = 0; i < ch.tokens.size(); ++i, ++row) {
      const int64_t pos = ch.pos + static_cast<int64_t>(i);
      tokens[row] = ch.tokens[i];
      positions[row] = static_cast<int32_t>(pos);
      slots[row] = static_cast<int64_t>(FullPage(in, ch.seq, pos)) * bs + pos % bs;
    }
  }
  auto* logit_row = MetaHost<int32_t>(in, meta.logit_rows);
  int64_t r = 0;
  for (size_t ci = 0; ci < batch.size(); ++ci) {
    const int64_t first = first_row_[ci], n = static_cast<int64_t>(batch[ci].tokens.size());
    if (batch[ci].all_logits) {
      for (int64_t i = 0; i < n; ++i) logit_row[r++] = static_cast<int32_t>(first + i);
    } else {
      logit_row[r++] = static_cast<int32_t>(first + n - 1);
    }
  }

  // Decode plan: each decode attends to its whole sequence, its own new token included (or,
  // with a sliding window, to the window that ends at it).
  descs_.resize(static_cast<size_t>(n_decode));
  for (int64_t d = 0; d < n_decode; ++d) {
    const SequenceChunk& ch = batch[static_cast<size_t>(order_[static_cast<size_t>(d)])];
    DecodeSeqDesc& desc = descs_[static_cast<size_t>(d)];
    in.cache->DescribeDecode(ch.seq, ch.pos + 1, &desc);
    desc.window_start =
        in.sliding_window > 0 ? std::max<int64_t>(0, ch.pos + 1 - in.sliding_window) : 0;
  }
  if (n_decode > 0) {
    const DecodePlanBounds bounds = in.cache->plan_bounds();
    absl::StatusOr<DecodePlan> built =
        BuildDecodePlan(bounds.layout, bounds.num_pages, bounds.num_basis_epochs, descs_,
                        {.target_ctas = in.target_ctas});
    if (!built.ok()) return built.status();
    plan->decode = *std::move(built);
    if (plan->decode.bytes() > meta.plan_capacity) {
      return absl::InternalError(
          absl::StrFormat("decode plan of %d bytes exceeds its %d-byte buffer",
                          plan->decode.bytes(), meta.plan_capacity));
    }
    std::memcpy(in.meta_host + meta.plan, plan->decode.data(),
                static_cast<size_t>(plan->decode.bytes()));
  }
  plan->meta_bytes = n_decode > 0 ? meta.plan + plan->decode.bytes() : meta.plan;

  // Prefill chunks: block tables [n_prefill, stride], query row ranges and start positions.
  const int64_t n_prefill = static_cast<int64_t>(batch.size()) - n_decode;
  plan->n_prefill = n_prefill;
  int32_t stride = 1, max_q = 1;
  for (int64_t p = 0; p < n_prefill; ++p) {
    const SequenceChunk& ch = batch[static_cast<size_t>(order_[static_cast<size_t>(n_decode + p)])];
    const int64_t end = ch.pos + static_cast<int64_t>(ch.tokens.size());
    stride = std::max<int32_t>(stride, static_cast<int32_t>(CeilDiv(end, bs)));
    max_q = std::max<int32_t>(max_q, static_cast<int32_t>(ch.tokens.size()));
  }
  plan->table_stride = stride;
  plan->max_q = max_q;
  auto* block_table = MetaHost<int32_t>(in, meta.block_table);
  auto* q_indptr = MetaHost<int32_t>(in, meta.q_indptr);
  auto* q_start = MetaHost<int32_t>(in, meta.q_start);
  q_indptr[0] = 0;
  // Groups of consecutive prefill chunks whose expanded history fits the scratch together.
  // A chunk's own history always fits (the scratch holds a whole context).
  std::vector<int>& group_end = plan->group_end;
  std::vector<int64_t>& group_exp = plan->group_exp;
  group_end.clear();
  group_exp.assign(1, 0);
  plan->exp_outliers = false;
  int64_t n_exp = 0;
  for (int64_t p = 0; p < n_prefill; ++p) {
    const SequenceChunk& ch = batch[static_cast<size_t>(order_[static_cast<size_t>(n_decode + p)])];
    const int64_t nb = CeilDiv(ch.pos + static_cast<int64_t>(ch.tokens.size()), bs);
    const int64_t group_first = group_exp.back();
    if (p > 0 && n_exp - group_first + CodedBlocks(in, ch.seq, nb) > in.scratch_pages) {
      group_end.push_back(static_cast<int>(p));
      group_exp.push_back(n_exp);
    }
    int32_t* dst = block_table + p * stride;
    if (PrefillTableRow(in, ch.seq, nb, dst, &n_exp, group_exp.back())) plan->exp_outliers = true;
    std::fill(dst + nb, dst + stride, 0);
    q_indptr[p + 1] = q_indptr[p] + static_cast<int32_t>(ch.tokens.size());
    q_start[p] = static_cast<int32_t>(ch.pos);
  }
  group_end.push_back(static_cast<int>(n_prefill));
  group_exp.push_back(n_exp);
  plan->n_exp = n_exp;

  // KQ-SVD refresh: the queries of the sequences that want them, as many as the readback holds.
  query_chunks_.clear();
  if (meta.query_capacity > 0) {
    for (size_t ci = 0; ci < batch.size(); ++ci) {
      if (!in.cache->WantsQueries(batch[ci].seq)) continue;
      query_chunks_.push_back({.seq = batch[ci].seq,
                               .first_row = first_row_[ci],
                               .n = static_cast<int64_t>(batch[ci].tokens.size())});
    }
  }
  plan->n_query_rows = PlanQueryRows(query_chunks_, meta.query_capacity,
                                     MetaHost<int32_t>(in, meta.query_rows), &plan->query_spans);
  return absl::OkStatus();
}

}  // namespace subspace::cuda
