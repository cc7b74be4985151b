// CompressedKvCache::Attend: decode and prefill attention over mixed blocks. For each query
// head the query is projected once per live epoch (q~ = P_q[e]^T q); one streaming softmax runs
// over sinks, compressed blocks of every epoch, outliers and the recent window; the value side
// is accumulated per epoch in coefficient space and expanded once with R_v[e]^T at the end.
// Kept apart from the policy and storage code in compressed_kv_cache.cc.
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "core/compress/compressed_kv_cache.h"
#include "core/cpu/attention_kernels.h"

namespace subspace {
namespace {

// Compressed blocks attention prefetches ahead of the one it reads.
constexpr int64_t kPrefetchBlocks = 2;

}  // namespace

void CompressedKvCache::Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) {
  const int hd = config_.geometry.head_dim;
  const int n_kv = config_.geometry.n_kv_heads;
  assert(n_heads > 0 && n_heads % n_kv == 0);
  assert(layer >= 0 && layer < config_.geometry.n_layers);
  const int group = n_heads / n_kv;
  const int bs = config_.block_size;
  const int rk = r_k_[static_cast<size_t>(layer)], rv = r_v_[static_cast<size_t>(layer)];
  const CoeffDtype dt = config_.policy.coeff_dtype;
  const CoeffDtype full_dt = config_.full_dtype;
  const int64_t rows = static_cast<int64_t>(n_kv) * bs;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const cpu::AttentionKernels& kernels = cpu::ActiveAttentionKernels();
  ObserveQueries(layer, requests, n_heads);  // KQ-SVD refresh: before anything reads them

  std::vector<int64_t> first_item(requests.size() + 1, 0);
  for (size_t r = 0; r < requests.size(); ++r)
    first_item[r + 1] = first_item[r] + requests[r].n * n_kv;
  const int64_t total = first_item.back();

#pragma omp parallel for schedule(dynamic, 1) if (total > 1)
  for (int64_t item = 0; item < total; ++item) {
    const size_t r = static_cast<size_t>(
        std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1);
    const AttentionRequest& req = requests[r];
    const int64_t local = item - first_item[r];
    const int64_t i = local / n_kv;
    const int kvh = static_cast<int>(local % n_kv);
    const Sequence& s = seqs_[req.seq];
    const LayerState& ls = s.layers[static_cast<size_t>(layer)];
    const std::vector<BlockEntry>& table = s.tables[static_cast<size_t>(layer)];
    const int64_t n_ctx = req.pos + i + 1;
    const int64_t lo = req.FirstAttended(req.pos + i);  // sliding window: tokens >= lo
    const int n_ep = static_cast<int>(ls.live.size());

    // Per-thread state, grown once to the largest shape seen.
    thread_local std::vector<float> scratch;
    const size_t need =
        static_cast<size_t>(group) * (hd + 2 + bs) + static_cast<size_t>(group) * n_ep * (rk + rv);
    if (scratch.size() < need) scratch.resize(need);
    float* acc = scratch.data();                                     // [group, hd]
    float* run_max = acc + static_cast<size_t>(group) * hd;          // [group]
    float* run_sum = run_max + group;                                // [group]
    float* scores = run_sum + group;                                 // [group, B]
    float* q_coef = scores + static_cast<size_t>(group) * bs;        // [group, n_ep, r_k]
    float* u_acc = q_coef + static_cast<size_t>(group) * n_ep * rk;  // [group, n_ep, r_v]
    std::fill(acc, acc + static_cast<size_t>(group) * hd, 0.0f);
    std::fill(run_max, run_max + group, neg_inf);
    std::fill(run_sum, run_sum + group, 0.0f);
    std::fill(q_coef, q_coef + static_cast<size_t>(group) * n_ep * rk, 0.0f);
    std::fill(u_acc, u_acc + static_cast<size_t>(group) * n_ep * rv, 0.0f);

    const float* q_tok = req.q + (i * n_heads + static_cast<int64_t>(kvh) * group) * hd;
    // Query coefficients once per live epoch: q~_e = P_q[e]^T q = sum_i q[i] P_q[e][i, :].
    for (int e = 0; e < n_ep; ++e) {
      const float* pq =
          ls.live[static_cast<size_t>(e)].basis->p_q.data() + static_cast<size_t>(kvh) * hd * rk;
      kernels.accumulate(q_tok, group, cpu::KvRows{pq}, hd, rk,
                         q_coef + static_cast<size_t>(e) * rk, static_cast<int64_t>(n_ep) * rk);
    }
    // Online softmax over the scores of one block ([group, nb]; -inf = token masked out):
    // rescales what group member g accumulated to the new running max (acc and every epoch's
    // u), turns its scores into weights and adds them to run_sum.
    const auto softmax_block = [&](int nb) {
      for (int g = 0; g < group; ++g) {
        float* p = scores + static_cast<int64_t>(g) * nb;
        const float block_max = *std::max_element(p, p + nb);
        if (block_max == neg_inf) {  // every token masked: nothing to add
          std::fill(p, p + nb, 0.0f);
          continue;
        }
        if (block_max > run_max[g]) {
          const float corr = std::exp(run_max[g] - block_max);  // 0 on the first block
          run_sum[g] *= corr;
          kernels.scale(acc + static_cast<int64_t>(g) * hd, hd, corr);
          kernels.scale(u_acc + static_cast<size_t>(g) * n_ep * rv, n_ep * rv, corr);
          run_max[g] = block_max;
        }
        run_sum[g] += kernels.exp_sum(p, nb, run_max[g]);
      }
    };
    // Masks the first `masked` tokens of a block's scores (before the sliding window).
    const auto mask_first = [&](int nb, int64_t masked) {
      for (int g = 0; g < group && masked > 0; ++g) {
        std::fill_n(scores + static_cast<int64_t>(g) * nb, std::min<int64_t>(masked, nb), neg_inf);
      }
    };
    // A full-rank run of nb tokens, rows read in full_dtype, the first `masked` of them outside
    // the window. k_blk, v_blk: [nb, hd]
    const auto full_run = [&](const uint8_t* k_blk, const uint8_t* v_blk, int nb, int64_t masked) {
      kernels.scores(q_tok, hd, group, cpu::KvRows{k_blk, nullptr, full_dt}, nb, hd, scale, scores);
      mask_first(nb, masked);
      softmax_block(nb);
      kernels.accumulate(scores, group, cpu::KvRows{v_blk, nullptr, full_dt}, nb, hd, acc, hd);
    };

    for (int64_t b0 = lo / bs * bs; b0 < n_ctx; b0 += bs) {
      const int64_t b = b0 / bs;
      const BlockEntry& e = table[static_cast<size_t>(b)];
      const int nb = static_cast<int>(std::min<int64_t>(bs, n_ctx - b0));
      // Slots are scattered over slab pages: fetch this head's codes kPrefetchBlocks ahead.
      if (b0 + kPrefetchBlocks * bs < n_ctx) {
        const BlockEntry& ahead = table[static_cast<size_t>(b + kPrefetchBlocks)];
        if (ahead.slot >= 0) {
          const uint8_t* codes = slabs_.data({ahead.page, ahead.slot});
          cpu::PrefetchBytes(codes + CodeBytes(dt, kvh * bs * rk), CodeBytes(dt, bs * rk));
          cpu::PrefetchBytes(codes + CodeBytes(dt, rows * rk + kvh * bs * rv),
                             CodeBytes(dt, bs * rv));
        }
      }
      if (e.slot < 0) {
        full_run(FullAt(e.page, KOffset(kvh, 0)), FullAt(e.page, VOffset(kvh, 0)), nb, lo - b0);
        continue;
      }
      const EpochId id = ls.block_epochs[static_cast<size_t>(b * n_kv + kvh)];
      int ep = 0;
      while (ls.live[static_cast<size_t>(ep)].id != id) ++ep;
      const uint8_t* base = slabs_.data({e.page, e.slot});
      const uint8_t* k_codes = base;
      const uint8_t* v_codes = k_codes + CodeBytes(dt, rows * rk);
      const auto* k_scales = reinterpret_cast<const uint16_t*>(v_codes + CodeBytes(dt, rows * rv));
      const uint16_t* v_scales = k_scales + rows;
      const int64_t row0 = static_cast<int64_t>(kvh) * bs;
      // Coefficients are read in their stored type; int8 row scales fold into the products.
      const cpu::KvRows k_rows{k_codes + CodeBytes(dt, row0 * rk), k_scales + row0, dt};
      const cpu::KvRows v_rows{v_codes + CodeBytes(dt, row0 * rv), v_scales + row0, dt};
      kernels.scores(q_coef + static_cast<size_t>(ep) * rk, static_cast<int64_t>(n_ep) * rk, group,
                     k_rows, nb, rk, scale, scores);
      for (uint64_t m = e.outliers; m != 0; m &= m - 1) {  // read full-rank from the outlier store
        const int t = std::countr_zero(m);
        if (t >= nb) break;
        for (int g = 0; g < group; ++g) scores[static_cast<int64_t>(g) * nb + t] = neg_inf;
      }
      mask_first(nb, lo - b0);
      softmax_block(nb);
      kernels.accumulate(scores, group, v_rows, nb, rv, u_acc + static_cast<size_t>(ep) * rv,
                         static_cast<int64_t>(n_ep) * rv);
    }
    // Outliers: full-rank tokens in position order, B to a page; those [j_lo, n_out) are in
    // the context (and the window).
    const auto pos_index = [&](int64_t p) {
      return static_cast<int64_t>(
          std::lower_bound(ls.outlier_pos.begin(), ls.outlier_pos.end(), p) -
          ls.outlier_pos.begin());
    };
    const int64_t n_out = pos_index(n_ctx);
    const int64_t j_lo = lo > 0 ? pos_index(lo) : 0;
    for (int64_t j0 = j_lo / bs * bs; j0 < n_out; j0 += bs) {
      const int32_t page = ls.outlier_pages[static_cast<size_t>(j0 / bs)];
      full_run(FullAt(page, KOffset(kvh, 0)), FullAt(page, VOffset(kvh, 0)),
               static_cast<int>(std::min<int64_t>(bs, n_out - j0)), j_lo - j0);
    }

    float* out_tok = req.out + (i * n_heads + static_cast<int64_t>(kvh) * group) * hd;
    for (int g = 0; g < group; ++g) {
      float* o = out_tok + static_cast<int64_t>(g) * hd;
      std::copy(acc + static_cast<int64_t>(g) * hd, acc + static_cast<int64_t>(g + 1) * hd, o);
      // Expand each epoch's value coefficients once: o += R_v[e]^T (sum alpha u).
      for (int e = 0; e < n_ep; ++e) {
        const float* rvm =
            ls.live[static_cast<size_t>(e)].basis->r_v.data() + static_cast<size_t>(kvh) * rv * hd;
        const float* u_g = u_acc + (static_cast<size_t>(g) * n_ep + e) * rv;
        kernels.accumulate(u_g, 1, cpu::KvRows{rvm}, rv, hd, o, hd);
      }
      kernels.scale(o, hd, 1.0f / run_sum[g]);
    }
  }
}

}  // namespace subspace
