// BuildDecodePlan: validation, local epochs and the split-K partition (decode_plan.h layout).
#include "cuda/decode_plan_builder.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/int_math.h"

namespace subspace::cuda {
namespace {

// Automatic splits never go below this many blocks per work item: a split costs a query
// projection per epoch and a partial row, worth it only over a few blocks.
constexpr int64_t kMinBlocksPerSplit = 4;

absl::Status CheckSequence(const kernels::KvPoolLayout& kv, int64_t num_pages, int num_basis_epochs,
                           const DecodeSeqDesc& d, size_t s) {
  const int bs = kv.block_size, n_kv = kv.n_kv_heads;
  const auto fail = [s](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrFormat("decode plan, sequence %d: %s", s, what));
  };
  if (d.length < 1) return fail(absl::StrFormat("length %d, need at least 1", d.length));
  if (d.window_start < 0 || d.window_start >= d.length) {
    return fail(absl::StrFormat("window start %d outside [0, %d)", d.window_start, d.length));
  }
  const int64_t nb = CeilDiv(d.length, bs);
  if (static_cast<int64_t>(d.pages.size()) != nb || static_cast<int64_t>(d.slots.size()) != nb ||
      static_cast<int64_t>(d.epochs.size()) != nb * n_kv ||
      (!d.outlier_masks.empty() && static_cast<int64_t>(d.outlier_masks.size()) != nb)) {
    return fail(absl::StrFormat("%d tokens need %d pages, slots and masks and %d epochs", d.length,
                                nb, nb * n_kv));
  }
  if (d.n_outliers < 0 ||
      static_cast<int64_t>(d.outlier_pages.size()) != CeilDiv(d.n_outliers, bs)) {
    return fail(absl::StrFormat("%d outliers need %d outlier pages, got %d", d.n_outliers,
                                CeilDiv(std::max<int64_t>(d.n_outliers, 0), bs),
                                d.outlier_pages.size()));
  }
  const auto page_ok = [&](int32_t p) { return p >= 0 && p < num_pages; };
  int64_t masked = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const size_t i = static_cast<size_t>(b);
    const int tokens = static_cast<int>(std::min<int64_t>(bs, d.length - b * bs));
    const uint64_t mask = d.outlier_masks.empty() ? 0 : d.outlier_masks[i];
    if (!page_ok(d.pages[i])) return fail(absl::StrFormat("block %d: page %d", b, d.pages[i]));
    const int32_t slot = d.slots[i];
    const int32_t* ep = d.epochs.data() + b * n_kv;
    if (slot == kernels::kFullBlock) {
      if (mask != 0) return fail(absl::StrFormat("block %d: outlier mask on a full block", b));
      for (int h = 0; h < n_kv; ++h) {
        if (ep[h] != -1) return fail(absl::StrFormat("block %d: epoch on a full block", b));
      }
      continue;
    }
    if (slot < 0 || slot >= kv.SlotsPerPage()) {
      return fail(absl::StrFormat("block %d: slot %d outside [0, %d)", b, slot, kv.SlotsPerPage()));
    }
    for (int h = 0; h < n_kv; ++h) {
      if (ep[h] < 0 || ep[h] >= num_basis_epochs) {
        return fail(absl::StrFormat("block %d head %d: epoch %d outside [0, %d)", b, h, ep[h],
                                    num_basis_epochs));
      }
    }
    if (tokens < 64 && (mask >> tokens) != 0) {
      return fail(absl::StrFormat("block %d: outlier mask past its %d tokens", b, tokens));
    }
    masked += std::popcount(mask);
  }
  if (masked != d.n_outliers) {
    return fail(absl::StrFormat("%d masked tokens but %d outliers", masked, d.n_outliers));
  }
  for (int32_t p : d.outlier_pages) {
    if (!page_ok(p)) return fail(absl::StrFormat("outlier page %d", p));
  }
  return absl::OkStatus();
}

}  // namespace

kernels::DecodePlanLayout LayoutDecodePlan(int64_t num_seqs, int64_t num_blocks, int64_t num_epochs,
                                           int64_t num_work, int n_kv) {
  kernels::DecodePlanLayout l;
  l.num_seqs = static_cast<int32_t>(num_seqs);
  l.num_blocks = static_cast<int32_t>(num_blocks);
  l.num_epochs = static_cast<int32_t>(num_epochs);
  l.num_work = static_cast<int32_t>(num_work);
  l.n_kv_heads = n_kv;
  int64_t off = 0;
  const auto take = [&off](int64_t bytes) {
    const int64_t at = off;
    off += (bytes + 15) / 16 * 16;  // 16-byte aligned arrays: room for vector loads later
    return at;
  };
  l.block_masked = take(num_blocks * 8);
  l.seq_len = take(num_seqs * 4);
  l.seq_block_indptr = take((num_seqs + 1) * 4);
  l.seq_epoch_indptr = take((num_seqs + 1) * 4);
  l.seq_epochs = take(num_epochs * 4);
  l.seq_work_indptr = take((num_seqs + 1) * 4);
  l.block_page = take(num_blocks * 4);
  l.block_slot = take(num_blocks * 4);
  l.block_tokens = take(num_blocks * 4);
  l.block_epoch = take(num_blocks * n_kv * 4);
  l.work_seq = take(num_work * 4);
  l.work_block_begin = take(num_work * 4);
  l.work_block_end = take(num_work * 4);
  l.total_bytes = off;
  return l;
}

int64_t MaxDecodeWork(int64_t num_seqs, const DecodePlanOptions& options) {
  if (options.blocks_per_split > 0) return -1;
  return num_seqs + options.target_ctas;
}

absl::StatusOr<DecodePlan> BuildDecodePlan(const kernels::KvPoolLayout& kv, int64_t num_pages,
                                           int num_basis_epochs,
                                           std::span<const DecodeSeqDesc> seqs,
                                           const DecodePlanOptions& options) {
  if (const char* err = kernels::KvPoolLayoutError(kv)) {
    return absl::InvalidArgumentError(absl::StrCat("decode plan: ", err));
  }
  if (num_pages < 0 || num_pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("decode plan: num_pages outside int32");
  }
  if (options.blocks_per_split < 0 || options.target_ctas < 0) {
    return absl::InvalidArgumentError("decode plan: negative split options");
  }
  const int bs = kv.block_size, n_kv = kv.n_kv_heads;
  const int64_t num_seqs = static_cast<int64_t>(seqs.size());
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (num_seqs >= kInt32Max) return absl::InvalidArgumentError("decode plan: too many sequences");

  // Per sequence: local epochs (first-appearance order) and block count with outlier pages.
  std::vector<std::vector<int32_t>> local(seqs.size());
  int64_t num_blocks = 0, num_epochs = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const DecodeSeqDesc& d = seqs[s];
    if (absl::Status st = CheckSequence(kv, num_pages, num_basis_epochs, d, s); !st.ok()) {
      return st;
    }
    for (size_t i = 0; i < d.slots.size(); ++i) {
      if (d.slots[i] == kernels::kFullBlock) continue;
      for (int h = 0; h < n_kv; ++h) {
        const int32_t e = d.epochs[i * n_kv + h];
        if (std::find(local[s].begin(), local[s].end(), e) == local[s].end()) local[s].push_back(e);
      }
    }
    if (local[s].size() > static_cast<size_t>(kernels::kMaxSeqEpochs)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("decode plan, sequence %d: %d live epochs, at most %d", s,
                          local[s].size(), kernels::kMaxSeqEpochs));
    }
    num_blocks += static_cast<int64_t>(d.pages.size() + d.outlier_pages.size());
    num_epochs += static_cast<int64_t>(local[s].size());
  }
  if (num_blocks * n_kv >= kInt32Max) {
    return absl::InvalidArgumentError("decode plan: more block-heads than int32 indexes");
  }

  // Split-K: one block count per work item for the whole batch, then each sequence's blocks
  // cut into that many nearly equal ranges (no lone short tail).
  int64_t per_split = std::numeric_limits<int64_t>::max();
  if (options.blocks_per_split > 0) {
    per_split = options.blocks_per_split;
  } else if (options.target_ctas > num_seqs * n_kv && num_blocks > 0) {
    per_split = std::max(kMinBlocksPerSplit, CeilDiv(num_blocks * n_kv, options.target_ctas));
  }
  std::vector<int64_t> seq_works(seqs.size());
  int64_t num_work = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int64_t nb = static_cast<int64_t>(seqs[s].pages.size() + seqs[s].outlier_pages.size());
    seq_works[s] = CeilDiv(nb, std::min(per_split, nb));
    num_work += seq_works[s];
  }

  DecodePlan plan;
  kernels::DecodePlanLayout& l = plan.layout;
  l = LayoutDecodePlan(num_seqs, num_blocks, num_epochs, num_work, n_kv);
  const int64_t off = l.total_bytes;
  plan.buffer.assign(static_cast<size_t>(CeilDiv(off, 8)), 0);

  auto* base = reinterpret_cast<uint8_t*>(plan.buffer.data());
  const auto i32 = [base](int64_t at) { return reinterpret_cast<int32_t*>(base + at); };
  auto* masked = reinterpret_cast<uint64_t*>(base + l.block_masked);
  int32_t *seq_len = i32(l.seq_len), *blk_ptr = i32(l.seq_block_indptr),
          *ep_ptr = i32(l.seq_epoch_indptr), *eps = i32(l.seq_epochs),
          *work_ptr = i32(l.seq_work_indptr), *page = i32(l.block_page), *slot = i32(l.block_slot),
          *tokens = i32(l.block_tokens), *epoch = i32(l.block_epoch), *wseq = i32(l.work_seq),
          *wbegin = i32(l.work_block_begin), *wend = i32(l.work_block_end);
  int32_t b = 0, e = 0, w = 0;
  blk_ptr[0] = ep_ptr[0] = work_ptr[0] = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const DecodeSeqDesc& d = seqs[s];
    if (d.length > kInt32Max) return absl::InvalidArgumentError("decode plan: sequence too long");
    seq_len[s] = static_cast<int32_t>(d.length - d.window_start);
    const int32_t first = b;
    // Rows [0, n) masked: the first n of a block (or of the outlier rows) fall before the window.
    const auto leading = [](int64_t n) {
      return n <= 0 ? uint64_t{0} : n >= 64 ? ~uint64_t{0} : (uint64_t{1} << n) - 1;
    };
    int64_t outliers_before = 0;  // outlier tokens before the window: the first outlier rows
    for (size_t i = 0; i < d.pages.size(); ++i, ++b) {
      page[b] = d.pages[i];
      slot[b] = d.slots[i];
      tokens[b] =
          static_cast<int32_t>(std::min<int64_t>(bs, d.length - static_cast<int64_t>(i) * bs));
      const uint64_t outlier = d.outlier_masks.empty() ? 0 : d.outlier_masks[i];
      const uint64_t before =
          leading(std::min<int64_t>(tokens[b], d.window_start - static_cast<int64_t>(i) * bs));
      outliers_before += std::popcount(outlier & before);
      masked[b] = outlier | before;
      for (int h = 0; h < n_kv; ++h) {
        const int32_t g = d.epochs[i * n_kv + h];
        epoch[static_cast<int64_t>(b) * n_kv + h] =
            g < 0 ? -1
                  : static_cast<int32_t>(std::find(local[s].begin(), local[s].end(), g) -
                                         local[s].begin());
      }
    }
    for (size_t j = 0; j < d.outlier_pages.size(); ++j, ++b) {
      page[b] = d.outlier_pages[j];
      slot[b] = kernels::kFullBlock;
      tokens[b] =
          static_cast<int32_t>(std::min<int64_t>(bs, d.n_outliers - static_cast<int64_t>(j) * bs));
      // Outliers are in position order, B to a page.
      masked[b] =
          leading(std::min<int64_t>(tokens[b], outliers_before - static_cast<int64_t>(j) * bs));
      for (int h = 0; h < n_kv; ++h) epoch[static_cast<int64_t>(b) * n_kv + h] = -1;
    }
    blk_ptr[s + 1] = b;
    for (int32_t g : local[s]) eps[e++] = g;
    ep_ptr[s + 1] = e;
    l.max_seq_epochs = std::max<int32_t>(l.max_seq_epochs, static_cast<int32_t>(local[s].size()));
    const int64_t nb = b - first;
    for (int64_t k = 0; k < seq_works[s]; ++k, ++w) {
      wseq[w] = static_cast<int32_t>(s);
      wbegin[w] = first + static_cast<int32_t>(nb * k / seq_works[s]);
      wend[w] = first + static_cast<int32_t>(nb * (k + 1) / seq_works[s]);
      l.max_work_blocks = std::max(l.max_work_blocks, wend[w] - wbegin[w]);
    }
    work_ptr[s + 1] = w;
  }
  return plan;
}

}  // namespace subspace::cuda
