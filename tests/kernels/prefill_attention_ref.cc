// Plain loops in double over the block table and the fp16 rows of the pool (or scratch) pages:
// the reference prefill_attention.cu is tested against. Logit q.k * sm_scale for every key at
// or before the query's position (and inside its window, when there is one), one softmax over
// them, values summed in the same pass's weights.
#include "tests/kernels/prefill_attention_ref.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/base/coeff_codec.h"

namespace subspace::kernels {
namespace {

double LoadHalf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return HalfToFloat(h);
}

// K and V rows of KV head h ([B, d] fp16) in the block a table entry names: e >= 0 is page e
// of the pool, e < 0 page -1 - e of scratch.
const uint8_t* BlockK(const PrefillAttentionParams& p, int32_t e, int h) {
  assert(e >= 0 || p.scratch != nullptr);
  return (e < 0 ? p.scratch : p.pool) + p.layout.FullK(e < 0 ? -1 - e : e, h);
}
const uint8_t* BlockV(const PrefillAttentionParams& p, int32_t e, int h) {
  assert(e >= 0 || p.scratch != nullptr);
  return (e < 0 ? p.scratch : p.pool) + p.layout.FullV(e < 0 ? -1 - e : e, h);
}

}  // namespace

void PrefillAttentionRef(const PrefillAttentionParams& p) {
  const KvPoolLayout& l = p.layout;
  const int hd = l.head_dim, bs = l.block_size, n_kv = l.n_kv_heads;
  assert(n_kv > 0 && p.n_heads > 0 && p.n_heads % n_kv == 0 && bs > 0);
  const int group = p.n_heads / n_kv;
  std::vector<double> logits, acc;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int32_t* table = p.block_table + static_cast<int64_t>(s) * p.max_blocks;  // [max_blocks]
    const int32_t q0 = p.seq_q_indptr[s], q1 = p.seq_q_indptr[s + 1];
    assert(q0 <= q1 && p.seq_q_start[s] >= 0);
    for (int32_t row = q0; row < q1; ++row) {
      const int64_t pos = static_cast<int64_t>(p.seq_q_start[s]) + (row - q0);
      assert((pos + bs) / bs <= p.max_blocks);
      for (int hq = 0; hq < p.n_heads; ++hq) {
        const int h = hq / group;
        const float* q = p.q + (static_cast<int64_t>(row) * p.n_heads + hq) * hd;  // [d]
        const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
        logits.assign(static_cast<size_t>(pos + 1), -std::numeric_limits<double>::infinity());
        for (int64_t t = lo; t <= pos; ++t) {
          const uint8_t* k = BlockK(p, table[t / bs], h) + (t % bs) * hd * 2;  // [d]
          double dot = 0.0;
          for (int i = 0; i < hd; ++i) dot += q[i] * LoadHalf(k + 2 * i);
          logits[static_cast<size_t>(t)] = dot * p.sm_scale;
        }
        const double max = *std::max_element(logits.begin(), logits.end());
        acc.assign(static_cast<size_t>(hd), 0.0);
        double sum = 0.0;
        for (int64_t t = lo; t <= pos; ++t) {
          const double w = std::exp(logits[static_cast<size_t>(t)] - max);
          sum += w;
          const uint8_t* v = BlockV(p, table[t / bs], h) + (t % bs) * hd * 2;  // [d]
          for (int i = 0; i < hd; ++i) acc[i] += w * LoadHalf(v + 2 * i);
        }
        float* out = p.out + (static_cast<int64_t>(row) * p.n_heads + hq) * hd;  // [d]
        for (int i = 0; i < hd; ++i) out[i] = static_cast<float>(acc[i] / sum);
      }
    }
  }
}

}  // namespace subspace::kernels
