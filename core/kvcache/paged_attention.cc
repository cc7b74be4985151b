// AttendPagedBlocks: the plan (work items over requests, queries and runs of blocks), the
// streaming softmax over each item's blocks and the merge of split queries. It needs no score
// buffer sized by the context and allocates nothing per token.
#include "core/kvcache/paged_attention.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <vector>

#include "core/base/int_math.h"
#include "core/cpu/attention_kernels.h"
#include "core/cpu/matmul_internal.h"

namespace subspace {

void AttendPagedBlocks(const KvCacheGeometry& geometry, int block_size,
                       std::span<const AttentionRequest> requests, int n_heads,
                       const BlockRowSource& source) {
  const int hd = geometry.head_dim;
  const int n_kv = geometry.n_kv_heads;
  assert(n_heads > 0 && n_heads % n_kv == 0);
  const int group = n_heads / n_kv;
  const int bs = block_size;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const cpu::AttentionKernels& kernels = cpu::ActiveAttentionKernels();
  const int threads = cpu::internal::NumThreads();

  // Plan. One work item per (request, query, run of blocks), over all KV heads, so an item
  // reads whole pages (a block's K/V for every head fill one page) and can prefetch the next
  // ones; items per KV head read an 8 KiB slice of each 128 KiB page instead (a read-only
  // microbenchmark of that pattern: ~21 GB/s vs ~30-50 contiguous on the dev box). With fewer
  // queries than kItemsPerThread * threads (decode at small batch), a query's context is
  // split into runs of at least kMinSplitBlocks blocks, each with its own softmax state,
  // merged at the end (split-KV, as in flash-decoding).
  constexpr int64_t kItemsPerThread = 4;
  constexpr int64_t kMinSplitBlocks = 16;
  // Whole pages prefetched this many blocks ahead: 16k-token decode 18.5 -> 13 ms on one
  // thread (bench/attention_bench.cc); distances 1 to 4 measured alike.
  constexpr int64_t kPrefetchBlocks = 2;
  int64_t queries = 0;
  for (const AttentionRequest& req : requests) queries += req.n;
  if (queries <= 0) return;
  const int64_t splits_wanted =
      queries >= kItemsPerThread * threads ? 1 : CeilDiv(kItemsPerThread * threads, queries);
  struct Item {
    int32_t req;
    int64_t i;            // query within the request
    int64_t block_begin;  // blocks [block_begin, block_end) of its causal context
    int64_t block_end;
    int64_t partial = -1;  // slot in `partials`, or -1: the item is the whole query
  };
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(queries));
  int64_t n_partials = 0;
  for (size_t r = 0; r < requests.size(); ++r) {
    for (int64_t i = 0; i < requests[r].n; ++i) {
      // Blocks [first, end) hold the query's context: causal, and inside its sliding window.
      const int64_t end = CeilDiv(requests[r].pos + i + 1, bs);
      const int64_t first = requests[r].FirstAttended(requests[r].pos + i) / bs;
      const int64_t blocks = end - first;
      const int64_t splits = std::clamp<int64_t>(blocks / kMinSplitBlocks, 1, splits_wanted);
      for (int64_t c = 0; c < splits; ++c) {
        items.push_back({static_cast<int32_t>(r), i, first + blocks * c / splits,
                         first + blocks * (c + 1) / splits, splits > 1 ? n_partials++ : -1});
      }
    }
  }
  // Split items' states: [n_partials][n_heads] of (max, sum, acc[hd]).
  const int64_t state_floats = static_cast<int64_t>(n_heads) * (hd + 2);
  thread_local std::vector<float> partials;
  if (partials.size() < static_cast<size_t>(n_partials * state_floats)) {
    partials.resize(static_cast<size_t>(n_partials * state_floats));
  }
  float* partials_data = partials.data();
  const int64_t total = static_cast<int64_t>(items.size());
  // Code-space state per item: KV head kvh's group of projected queries at q_off[kvh], of value
  // accumulators at v_off[kvh] (floats per query head: dims[kvh]).
  std::vector<CodedFloats> dims(static_cast<size_t>(n_kv));
  std::vector<int64_t> q_off(static_cast<size_t>(n_kv) + 1, 0), v_off(q_off);
  for (int kvh = 0; kvh < n_kv; ++kvh) {
    const CodedFloats f = source.CodedStateFloats(kvh);
    dims[static_cast<size_t>(kvh)] = f;
    q_off[static_cast<size_t>(kvh) + 1] =
        q_off[static_cast<size_t>(kvh)] + int64_t{group} * f.query;
    v_off[static_cast<size_t>(kvh) + 1] =
        v_off[static_cast<size_t>(kvh)] + int64_t{group} * f.value;
  }
  const int64_t coded_floats = q_off.back() + v_off.back();

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (total > 1)
  for (int64_t it = 0; it < total; ++it) {
    const Item& item = items[static_cast<size_t>(it)];
    const AttentionRequest& req = requests[static_cast<size_t>(item.req)];
    const int64_t n_ctx = req.pos + item.i + 1;              // causal: tokens [0, pos + i]
    const int64_t lo = req.FirstAttended(req.pos + item.i);  // sliding window: tokens >= lo

    // Per-thread state sized by the largest shape seen; grows once, never per call. A source
    // that is not read in place (quantized or coded rows) writes each block's K (then V) rows,
    // all heads, into `rows`.
    thread_local std::vector<float> scratch;
    const int64_t row_floats = source.NeedsScratch() ? int64_t{n_kv} * bs * hd : 0;
    const size_t need = static_cast<size_t>(state_floats) + static_cast<size_t>(n_heads) * bs +
                        static_cast<size_t>(row_floats) + static_cast<size_t>(coded_floats);
    if (scratch.size() < need) scratch.resize(need);
    float* state = item.partial >= 0 ? partials_data + item.partial * state_floats : scratch.data();
    float* run_max = state;                                     // [n_heads]
    float* run_sum = run_max + n_heads;                         // [n_heads]
    float* acc = run_sum + n_heads;                             // [n_heads, head_dim]
    float* scores = scratch.data() + state_floats;              // [n_heads, B]
    float* rows = scores + static_cast<int64_t>(n_heads) * bs;  // [n_kv_heads, B, head_dim]
    float* coded_q = rows + row_floats;                         // [q_off.back()]
    float* coded_v = coded_q + q_off.back();                    // [v_off.back()]
    std::fill(run_max, run_max + n_heads, -std::numeric_limits<float>::infinity());
    std::fill(run_sum, run_sum + n_heads, 0.0f);
    std::fill(acc, acc + static_cast<size_t>(n_heads) * hd, 0.0f);
    std::fill(coded_v, coded_v + v_off.back(), 0.0f);

    const float* q_tok = req.q + item.i * n_heads * hd;  // [n_heads, head_dim]
    // KV head kvh's rows in a block.
    const auto head_rows = [&](const BlockRows& r, int kvh) {
      return cpu::KvRows{static_cast<const uint8_t*>(r.data) +
                             CodeBytes(r.dtype, static_cast<int64_t>(kvh) * bs * hd),
                         nullptr, r.dtype};
    };
    for (int kvh = 0; kvh < n_kv; ++kvh) {
      if (dims[static_cast<size_t>(kvh)].query == 0) continue;
      source.PrepareQueries(req.seq, kvh, q_tok + static_cast<int64_t>(kvh) * group * hd, group,
                            scale, coded_q + q_off[static_cast<size_t>(kvh)]);
    }
    for (int64_t b = item.block_begin; b < item.block_end; ++b) {
      const int nb = static_cast<int>(std::min<int64_t>(bs, n_ctx - b * bs));
      if (b + kPrefetchBlocks < item.block_end) source.Prefetch(req.seq, b + kPrefetchBlocks);
      // All heads' keys, then all heads' values: two sequential 64 KiB-class streams through
      // the page rather than alternating between its K and V halves head by head. Rows of head
      // h sit at [h * B, h * B + nb); slots past nb are not read.
      const BlockRows k_rows = source.Rows(req.seq, b, /*values=*/false, nb, rows);
      for (int kvh = 0; kvh < n_kv; ++kvh) {
        const int h0 = kvh * group;  // first query head of the group
        if (k_rows.data == nullptr) {
          source.CodedScores(req.seq, b, kvh, group, nb, coded_q + q_off[static_cast<size_t>(kvh)],
                             scores + static_cast<int64_t>(h0) * nb);
          continue;
        }
        kernels.scores(q_tok + static_cast<int64_t>(h0) * hd, hd, group, head_rows(k_rows, kvh), nb,
                       hd, scale, scores + static_cast<int64_t>(h0) * nb);
      }
      // The sliding window's first block: tokens before lo are masked (lo itself is in it).
      const int64_t masked = std::min<int64_t>(nb, lo - b * bs);
      for (int h = 0; h < n_heads && masked > 0; ++h) {
        std::fill_n(scores + static_cast<int64_t>(h) * nb, masked,
                    -std::numeric_limits<float>::infinity());
      }
      for (int h = 0; h < n_heads; ++h) {
        float* p = scores + static_cast<int64_t>(h) * nb;
        const float block_max = *std::max_element(p, p + nb);
        // Online softmax: rescale what was accumulated under the old running max.
        if (block_max > run_max[h]) {
          const float correction = std::exp(run_max[h] - block_max);  // 0 on the first block
          run_sum[h] *= correction;
          kernels.scale(acc + static_cast<int64_t>(h) * hd, hd, correction);
          const size_t kvh = static_cast<size_t>(h / group);
          if (dims[kvh].value > 0) {
            kernels.scale(coded_v + v_off[kvh] + int64_t{h % group} * dims[kvh].value,
                          dims[kvh].value, correction);
          }
          run_max[h] = block_max;
        }
        run_sum[h] += kernels.exp_sum(p, nb, run_max[h]);
      }
      const BlockRows v_rows = source.Rows(req.seq, b, /*values=*/true, nb, rows);
      for (int kvh = 0; kvh < n_kv; ++kvh) {
        const int h0 = kvh * group;
        if (v_rows.data == nullptr) {
          source.CodedAccumulate(req.seq, b, kvh, group, nb, scores + static_cast<int64_t>(h0) * nb,
                                 coded_v + v_off[static_cast<size_t>(kvh)]);
          continue;
        }
        kernels.accumulate(scores + static_cast<int64_t>(h0) * nb, group, head_rows(v_rows, kvh),
                           nb, hd, acc + static_cast<int64_t>(h0) * hd, hd);
      }
    }
    // What code space accumulated joins acc, before acc is merged or written out.
    for (int kvh = 0; kvh < n_kv; ++kvh) {
      if (dims[static_cast<size_t>(kvh)].value == 0) continue;
      source.ExpandValues(req.seq, kvh, group, coded_v + v_off[static_cast<size_t>(kvh)],
                          acc + static_cast<int64_t>(kvh) * group * hd);
    }
    if (item.partial >= 0) continue;
    float* out_tok = req.out + item.i * n_heads * hd;
    for (int h = 0; h < n_heads; ++h) {
      const float inv = 1.0f / run_sum[h];
      const float* acc_h = acc + static_cast<int64_t>(h) * hd;
      float* o = out_tok + static_cast<int64_t>(h) * hd;
      for (int d = 0; d < hd; ++d) o[d] = acc_h[d] * inv;
    }
  }

  // Merge split queries: o = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) sum_c. Every run
  // holds at least one token, so every m_c is finite.
  for (size_t first = 0; first < items.size();) {
    size_t end = first + 1;
    if (items[first].partial < 0) {
      first = end;
      continue;
    }
    while (end < items.size() && items[end].req == items[first].req &&
           items[end].i == items[first].i)
      ++end;
    const AttentionRequest& req = requests[static_cast<size_t>(items[first].req)];
    float* out_tok = req.out + items[first].i * n_heads * hd;
    for (int h = 0; h < n_heads; ++h) {
      float m = -std::numeric_limits<float>::infinity();
      for (size_t c = first; c < end; ++c)
        m = std::max(m, partials_data[items[c].partial * state_floats + h]);
      float sum = 0.0f;
      float* o = out_tok + static_cast<int64_t>(h) * hd;
      std::fill(o, o + hd, 0.0f);
      for (size_t c = first; c < end; ++c) {
        const float* st = partials_data + items[c].partial * state_floats;
        const float w = std::exp(st[h] - m);
        sum += w * st[n_heads + h];
        const float* acc_h = st + 2 * n_heads + static_cast<int64_t>(h) * hd;
        for (int d = 0; d < hd; ++d) o[d] += w * acc_h[d];
      }
      kernels.scale(o, hd, 1.0f / sum);
    }
    first = end;
  }
}

}  // namespace subspace
