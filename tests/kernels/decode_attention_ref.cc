// Plain loops in double over the plan and the pool bytes: the reference decode_attention.cu is
// tested against. Same math as CompressedKvCache::Attend: logits q.k / sqrt(d) on full rows and
// q~_e . c (times the int8 row scale) on coefficients, one softmax over all of a sequence's
// tokens, value coefficients summed per epoch and expanded once with R_v[e]^T. Transform-coded
// blocks are read as rows their own twin decodes (TransformDecodeRowRef): the kernel reads them
// in code space, so the twin is the row-space form of the same attention.
#include "tests/kernels/decode_attention_ref.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"
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

// The transform cache: every coded row decoded in double (TransformDecodeRowRef), keys coded
// before RoPE rounded to fp16 as the kernel decodes them; the kernel reads the other rows in code
// space, the same sums in another order. Then one softmax over the sequence's rows.
void TransformAttentionRef(const DecodeAttentionParams& p) {
  const KvPoolLayout& l = p.layout;
  const DecodePlanView& plan = p.plan;
  const int hd = l.head_dim, group = p.n_heads / l.n_kv_heads;
  const bool round_keys = p.key_rope.cos_sin != nullptr;
  std::vector<double> keys, values, row(static_cast<size_t>(hd)), logits, o;
  for (int s = 0; s < plan.num_seqs; ++s) {
    const int b0 = plan.seq_block_indptr[s], b1 = plan.seq_block_indptr[s + 1];
    for (int hq = 0; hq < p.n_heads; ++hq) {
      const int h = hq / group;
      const float* q = p.q + (static_cast<int64_t>(s) * p.n_heads + hq) * hd;
      keys.clear();
      values.clear();
      logits.clear();
      int64_t tokens = 0;
      for (int b = b0; b < b1; ++b) {
        const int32_t page = plan.block_page[b];
        const bool full = plan.IsFull(b);
        const uint8_t* slot = full ? nullptr : p.pool + l.Slot(page, plan.block_slot[b]);
        for (int t = 0; t < plan.block_tokens[b]; ++t) {
          for (int side = 0; side < 2; ++side) {
            std::vector<double>& rows = side == 0 ? keys : values;
            if (full) {
              const uint8_t* r = p.pool + (side == 0 ? l.FullK(page, h) : l.FullV(page, h)) +
                                 2 * static_cast<int64_t>(t) * hd;
              for (int i = 0; i < hd; ++i) rows.push_back(LoadHalf(r + 2 * i));
              continue;
            }
            TransformDecodeRowRef(l, p.transform, p.key_rope, slot, h, side, t,
                                  static_cast<int64_t>(b - b0) * l.block_size + t, row.data());
            for (double x : row) {
              rows.push_back(
                  side == 0 && round_keys ? HalfToFloat(Fp32ToFp16(static_cast<float>(x))) : x);
            }
          }
          if ((plan.block_masked[b] >> t) & 1u) {  // an outlier's row, or before a window
            logits.push_back(-std::numeric_limits<double>::infinity());
            continue;
          }
          ++tokens;
          const double* k = keys.data() + keys.size() - static_cast<size_t>(hd);
          double dot = 0.0;
          for (int i = 0; i < hd; ++i) dot += q[i] * k[i];
          logits.push_back(dot * p.sm_scale);
        }
      }
      assert(tokens == plan.seq_len[s]);
      (void)tokens;
      const double max = *std::max_element(logits.begin(), logits.end());
      o.assign(static_cast<size_t>(hd), 0.0);
      double sum = 0.0;
      for (size_t t = 0; t < logits.size(); ++t) {
        const double w = std::exp(logits[t] - max);  // 0 for masked rows
        sum += w;
        for (int i = 0; i < hd; ++i) o[static_cast<size_t>(i)] += w * values[t * hd + i];
      }
      float* out = p.out + (static_cast<int64_t>(s) * p.n_heads + hq) * hd;
      for (int i = 0; i < hd; ++i) out[i] = static_cast<float>(o[static_cast<size_t>(i)] / sum);
    }
  }
}

}  // namespace

void DecodeAttentionRef(const DecodeAttentionParams& p) {
  const KvPoolLayout& l = p.layout;
  const DecodePlanView& plan = p.plan;
  if (p.transform.floats != nullptr) {
    TransformAttentionRef(p);
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
