// Plain loops in double over the plan and the pool bytes: the reference decode_attention.cu is
// tested against. Same math as CompressedKvCache::Attend: logits q.k / sqrt(d) on full rows and
// q~_e . c (times the int8 row scale) on coefficients, one softmax over all of a sequence's
// tokens, value coefficients summed per epoch and expanded once with R_v[e]^T. Transform-coded
// blocks are decoded by their own twin (TransformExpandRef) into pages of a copy of the pool
// first, and read as full blocks.
#include "tests/kernels/decode_attention_ref.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/base/coeff_codec.h"
#include "tests/kernels/transform_blocks_ref.h"

namespace subspace::kernels {
namespace {

double LoadHalf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return HalfToFloat(h);
}

// Code j of a row of codes; times the row scale for int8.
double LoadCode(const KvPoolLayout& l, const uint8_t* codes, int j) {
  if (l.coeff_dtype == CoeffDtype::kInt8) return static_cast<int8_t>(codes[j]);
  return LoadHalf(codes + 2 * j);
}

}  // namespace

void DecodeAttentionRef(const DecodeAttentionParams& p) {
  const KvPoolLayout& l = p.layout;
  const DecodePlanView& plan = p.plan;
  if (p.transform.floats != nullptr) {
    // Every coded block decoded into a page of its own past the pool's pages (a copy of the
    // bytes the plan names: the highest page it reads bounds them), then full blocks only.
    int32_t pages = 0;
    for (int b = 0; b < plan.num_blocks; ++b) pages = std::max(pages, plan.block_page[b] + 1);
    std::vector<uint8_t> pool(p.pool, p.pool + static_cast<int64_t>(pages) * l.page_bytes);
    std::vector<int32_t> block_page(plan.block_page, plan.block_page + plan.num_blocks);
    std::vector<int32_t> block_slot(plan.block_slot, plan.block_slot + plan.num_blocks);
    std::vector<int32_t> src_page, src_slot, dst_page, first_pos;
    for (int s = 0; s < plan.num_seqs; ++s) {
      for (int b = plan.seq_block_indptr[s]; b < plan.seq_block_indptr[s + 1]; ++b) {
        if (plan.IsFull(b)) continue;
        src_page.push_back(plan.block_page[b]);
        src_slot.push_back(plan.block_slot[b]);
        dst_page.push_back(pages + static_cast<int32_t>(dst_page.size()));
        first_pos.push_back((b - plan.seq_block_indptr[s]) * l.block_size);
        block_page[static_cast<size_t>(b)] = dst_page.back();
        block_slot[static_cast<size_t>(b)] = kFullBlock;
      }
    }
    pool.resize(pool.size() + dst_page.size() * static_cast<size_t>(l.page_bytes));
    TransformExpandRef({.layout = l,
                        .tables = p.transform,
                        .key_rope = p.key_rope,
                        .src_pool = pool.data(),
                        .dst_pool = pool.data(),
                        .src_page = src_page.data(),
                        .src_slot = src_slot.data(),
                        .dst_page = dst_page.data(),
                        .first_pos = first_pos.data(),
                        .n_blocks = static_cast<int32_t>(dst_page.size())});
    DecodeAttentionParams full = p;
    full.transform = {};
    full.key_rope = {};
    full.pool = pool.data();
    full.plan.block_page = block_page.data();
    full.plan.block_slot = block_slot.data();
    const std::vector<int32_t> no_epochs(static_cast<size_t>(plan.num_seqs) + 1, 0);
    full.plan.seq_epoch_indptr = no_epochs.data();  // the epochs of the plan mean nothing here
    DecodeAttentionRef(full);
    return;
  }
  const int hd = l.head_dim, rk = l.rank_k, rv = l.rank_v, n_kv = l.n_kv_heads;
  const int group = p.n_heads / n_kv;
  const bool int8 = l.coeff_dtype == CoeffDtype::kInt8;
  std::vector<double> logits, qt, u, acc, o;
  for (int s = 0; s < plan.num_seqs; ++s) {
    const int n_ep = plan.SeqEpochs(s);
    const int32_t* epochs = plan.seq_epochs + plan.seq_epoch_indptr[s];
    const int b0 = plan.seq_block_indptr[s], b1 = plan.seq_block_indptr[s + 1];
    for (int hq = 0; hq < p.n_heads; ++hq) {
      const int h = hq / group;
      const float* q = p.q + (static_cast<int64_t>(s) * p.n_heads + hq) * hd;
      // q~_e = P_q[e]^T q for every live epoch of the sequence.
      qt.assign(static_cast<size_t>(n_ep) * rk, 0.0);
      for (int e = 0; e < n_ep; ++e) {
        const float* pq = p.basis_pq + (static_cast<int64_t>(epochs[e]) * n_kv + h) * hd * rk;
        for (int i = 0; i < hd; ++i) {
          for (int j = 0; j < rk; ++j) qt[e * rk + j] += static_cast<double>(q[i]) * pq[i * rk + j];
        }
      }
      // Pass 1: every token's logit, in block order (-inf: masked, read from an outlier page or
      // before a sliding window).
      logits.clear();
      int64_t tokens = 0;
      for (int b = b0; b < b1; ++b) {
        const int nb = plan.block_tokens[b];
        tokens += nb;
        if (plan.IsFull(b)) {
          const uint8_t* k = p.pool + l.FullK(plan.block_page[b], h);
          for (int t = 0; t < nb; ++t) {
            if ((plan.block_masked[b] >> t) & 1u) {  // before a sliding window
              --tokens;
              logits.push_back(-std::numeric_limits<double>::infinity());
              continue;
            }
            double dot = 0.0;
            for (int i = 0; i < hd; ++i) dot += q[i] * LoadHalf(k + 2 * (t * hd + i));
            logits.push_back(dot * p.sm_scale);
          }
          continue;
        }
        const int e = plan.block_epoch[static_cast<int64_t>(b) * n_kv + h];
        assert(e >= 0 && e < n_ep);
        const uint8_t* slot = p.pool + l.Slot(plan.block_page[b], plan.block_slot[b]);
        const uint8_t* codes = slot + l.KCodes(h);
        for (int t = 0; t < nb; ++t) {
          tokens -= (plan.block_masked[b] >> t) & 1u;
          if ((plan.block_masked[b] >> t) & 1u) {
            logits.push_back(-std::numeric_limits<double>::infinity());
            continue;
          }
          double dot = 0.0;
          for (int j = 0; j < rk; ++j) {
            dot += qt[e * rk + j] *
                   LoadCode(l, codes + static_cast<int64_t>(t) * rk * l.code_bytes, j);
          }
          if (int8) dot *= LoadHalf(slot + l.KScales(h) + 2 * t);
          logits.push_back(dot * p.sm_scale);
        }
      }
      assert(tokens == plan.seq_len[s]);
      (void)tokens;
      const double max = *std::max_element(logits.begin(), logits.end());
      // Pass 2: weights; full rows into acc, coefficients into their epoch's u.
      acc.assign(static_cast<size_t>(hd), 0.0);
      u.assign(static_cast<size_t>(n_ep) * rv, 0.0);
      double sum = 0.0;
      size_t next = 0;
      for (int b = b0; b < b1; ++b) {
        const int nb = plan.block_tokens[b];
        const bool full = plan.IsFull(b);
        const int e = full ? -1 : plan.block_epoch[static_cast<int64_t>(b) * n_kv + h];
        const uint8_t* slot =
            full ? nullptr : p.pool + l.Slot(plan.block_page[b], plan.block_slot[b]);
        for (int t = 0; t < nb; ++t) {
          const double w = std::exp(logits[next++] - max);  // 0 for masked tokens
          if (w == 0.0) continue;
          sum += w;
          if (full) {
            const uint8_t* v = p.pool + l.FullV(plan.block_page[b], h) + 2 * t * hd;
            for (int i = 0; i < hd; ++i) acc[i] += w * LoadHalf(v + 2 * i);
          } else {
            const uint8_t* codes = slot + l.VCodes(h) + static_cast<int64_t>(t) * rv * l.code_bytes;
            const double ws = int8 ? w * LoadHalf(slot + l.VScales(h) + 2 * t) : w;
            for (int j = 0; j < rv; ++j) u[e * rv + j] += ws * LoadCode(l, codes, j);
          }
        }
      }
      // o = (acc + sum_e R_v[e]^T u_e) / sum
      o = acc;
      for (int e = 0; e < n_ep; ++e) {
        const float* rvm = p.basis_rv + (static_cast<int64_t>(epochs[e]) * n_kv + h) * rv * hd;
        for (int j = 0; j < rv; ++j) {
          for (int i = 0; i < hd; ++i) o[i] += u[e * rv + j] * rvm[j * hd + i];
        }
      }
      float* out = p.out + (static_cast<int64_t>(s) * p.n_heads + hq) * hd;
      for (int i = 0; i < hd; ++i) out[i] = static_cast<float>(o[i] / sum);
    }
  }
}

}  // namespace subspace::kernels
