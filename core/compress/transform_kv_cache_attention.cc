// TransformKvCache's attention: the paged attention every paged cache shares, with the coded
// blocks read in code space, one slot per code epoch a sequence holds (transform_kv_cache.h).
#include <algorithm>
#include <cassert>
#include <utility>
#include <vector>

#include "core/base/int_math.h"
#include "core/compress/transform_kv_cache.h"
#include "core/cpu/attention_kernels.h"
#include "core/cpu/ops.h"
#include "core/kvcache/paged_attention.h"

namespace subspace {

// A layer's blocks for AttendPagedBlocks: full pages read in place at fp16; coded blocks read in
// code space, except keys coded before RoPE, which are decoded beforehand, once per call (a row
// costs O(d x active), and a prefill chunk's every query reads every block).
//
// Code space holds one slot per epoch a sequence's coded blocks of this layer use: a query
// projected per slot, a value accumulator per slot, each read with its epoch's tables. Per KV
// head kvh, a query head's floats are the slots' one after the other; CodedStateFloats is the
// most any sequence of the call needs.
class TransformKvCache::RowSource final : public BlockRowSource {
 public:
  RowSource(const TransformKvCache& cache, int layer, std::span<const AttentionRequest> requests)
      : cache_(cache),
        layer_(layer),
        n_kv_(cache.config_.geometry.n_kv_heads),
        pre_rope_(cache.key_unrope_.has_value()),
        floats_(static_cast<size_t>(n_kv_)) {
    const int bs = cache_.config_.block_size;
    for (const AttentionRequest& r : requests) {
      if (r.n <= 0) continue;
      const int64_t first = r.FirstAttended(r.pos) / bs;
      const int64_t end = CeilDiv(r.pos + r.n, int64_t{bs});
      Seq* d = Find(r.seq);
      if (d == nullptr) {
        seqs_.push_back(MakeSeq(r.seq));
        d = &seqs_.back();
        d->first = first;
        d->end = end;
      } else {
        d->first = std::min(d->first, first);
        d->end = std::max(d->end, end);
      }
    }
    for (const Seq& d : seqs_) {
      for (int kvh = 0; kvh < n_kv_; ++kvh) {
        CodedFloats& f = floats_[static_cast<size_t>(kvh)];
        f.query = std::max(f.query, d.q_total[static_cast<size_t>(kvh)]);
        f.value = std::max(f.value, d.v_total[static_cast<size_t>(kvh)]);
      }
    }
    if (!pre_rope_) return;
    size_t floats = 0;
    std::vector<std::pair<size_t, int64_t>> work;  // (sequence, block) to decode
    for (size_t i = 0; i < seqs_.size(); ++i) {
      seqs_[i].offset = floats;
      floats += static_cast<size_t>((seqs_[i].end - seqs_[i].first) * cache_.v_half_);
      const std::vector<Block>& table = Table(seqs_[i].seq);
      for (int64_t b = seqs_[i].first; b < seqs_[i].end; ++b) {
        if (table[static_cast<size_t>(b)].slot >= 0) work.emplace_back(i, b);
      }
    }
    // Reused by the calling thread from call to call: no allocation, no clearing per step
    // (every block read is written first).
    thread_local std::vector<float> buffer;
    if (buffer.size() < floats) buffer.resize(floats);
    decoded_ = buffer.data();
    const int64_t n = static_cast<int64_t>(work.size());
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
    for (int64_t w = 0; w < n; ++w) {
      const auto [i, b] = work[static_cast<size_t>(w)];
      const Block& e = Table(seqs_[i].seq)[static_cast<size_t>(b)];
      cache_.DecodeRows(e.epoch, layer_, cache_.slabs_.data({e.page, e.slot}), b,
                        /*values=*/false, bs, KeyRows(seqs_[i], b));
    }
  }

  // Full blocks are read in place at fp16; coded ones in code space, or (keys coded before
  // RoPE) from this call's decoded rows.
  BlockRows Rows(SeqId seq, int64_t block, bool values, int valid, float* scratch) const override {
    (void)valid, (void)scratch;
    const Block& e = Table(seq)[static_cast<size_t>(block)];
    if (e.slot >= 0) {
      if (values || !pre_rope_) return {};
      return {KeyRows(*Find(seq), block), CoeffDtype::kFp32};
    }
    return {cache_.FullAt(e.page, values ? cache_.VOffset(0, 0) : cache_.KOffset(0, 0)),
            CoeffDtype::kFp16};
  }
  bool NeedsScratch() const override { return false; }

  void Prefetch(SeqId seq, int64_t block) const override {
    const Block& e = Table(seq)[static_cast<size_t>(block)];
    if (e.slot >= 0) {
      cpu::PrefetchBytes(cache_.slabs_.data({e.page, e.slot}), cache_.CodedBlockBytes(layer_));
    } else {
      cpu::PrefetchBytes(cache_.pool_->data(e.page), cache_.pool_->block_bytes());
    }
  }

  // Keys coded after RoPE, per slot and query head: w_a = scale step_a u_a . q s^-1 [active],
  // then after the group's, its constant scale (e . q s^-1 + sum_a offset_a u_a . q s^-1): a
  // score is w . code + constant. Values, per query head and slot: eight partial sums of
  // p_t code_a(t) per component [active][8], then sum_t p_t.
  CodedFloats CodedStateFloats(int kvh) const override { return floats_[static_cast<size_t>(kvh)]; }

  void PrepareQueries(SeqId seq, int kvh, const float* q, int group, float scale,
                      float* query) const override {
    const Seq& d = *Find(seq);
    for (size_t slot = 0; slot < d.epochs.size(); ++slot) {
      PrepareSlot(
          cache_.Table(d.epochs[slot], layer_, false, kvh), q, group, scale,
          query + static_cast<int64_t>(group) * d.q_at[slot * n_kv_ + static_cast<size_t>(kvh)]);
    }
  }

  void CodedScores(SeqId seq, int64_t block, int kvh, int group, int nb, const float* query,
                   float* scores) const override {
    const Located c = Locate(seq, block, kvh);
    const Block& e = c.block;
    const DecodeTable& t = cache_.Table(e.epoch, layer_, false, kvh);
    const float* qs = query + static_cast<int64_t>(group) * c.seq.q_at[c.at];
    const int active = t.active();
    for (int g = 0; g < group; ++g) {
      std::fill_n(scores + static_cast<int64_t>(g) * nb, nb,
                  qs[static_cast<int64_t>(group) * active + g]);
    }
    if (active == 0) return;
    cpu::ActiveAttentionKernels().code_scores(Run(e, kvh, false), t.bits.data(), t.byte_at.data(),
                                              active, nb, qs, group, scores);
  }

  void CodedAccumulate(SeqId seq, int64_t block, int kvh, int group, int nb, const float* p,
                       float* value) const override {
    const Located c = Locate(seq, block, kvh);
    const Block& e = c.block;
    const DecodeTable& t = cache_.Table(e.epoch, layer_, true, kvh);
    const int active = t.active();
    const int64_t stride = floats_[static_cast<size_t>(kvh)].value;  // one query head's floats
    float* v = value + c.seq.v_at[c.at];
    if (active > 0) {
      cpu::ActiveAttentionKernels().code_sums(Run(e, kvh, true), t.bits.data(), t.byte_at.data(),
                                              active, nb, p, group, v, stride);
    }
    for (int g = 0; g < group; ++g) {
      const float* pg = p + static_cast<int64_t>(g) * nb;
      for (int i = 0; i < nb; ++i) v[g * stride + 8 * active] += pg[i];
    }
  }

  void ExpandValues(SeqId seq, int kvh, int group, const float* value, float* acc) const override {
    const Seq& d = *Find(seq);
    const int64_t stride = floats_[static_cast<size_t>(kvh)].value;
    for (size_t slot = 0; slot < d.epochs.size(); ++slot) {
      ExpandSlot(cache_.Table(d.epochs[slot], layer_, true, kvh), group, stride,
                 value + d.v_at[slot * n_kv_ + static_cast<size_t>(kvh)], acc);
    }
  }

 private:
  // A sequence of the call: the epochs of its coded blocks in this layer (its slots) with their
  // floats' offsets, and where its decoded keys (pre-RoPE) sit.
  struct Seq {
    SeqId seq = -1;
    int64_t first = 0, end = 0;  // blocks attended
    size_t offset = 0;           // block `first`'s decoded keys in decoded_
    std::vector<int32_t> epochs;
    // [slot][n_kv] floats per query head before the slot's: its queries sit at group * q_at
    // in the KV head's projected queries, its value sums at v_at in each query head's.
    std::vector<int> q_at, v_at;
    std::vector<int> q_total, v_total;  // [n_kv]
    size_t Slot(int32_t epoch) const {
      for (size_t i = 0; i < epochs.size(); ++i) {
        if (epochs[i] == epoch) return i;
      }
      assert(false && "a coded block's epoch is not among its sequence's");
      return 0;
    }
  };

  // A coded block of `seq` read for KV head kvh: its entry, and where its epoch's slot sits
  // in the sequence's q_at / v_at.
  struct Located {
    const Seq& seq;
    const Block& block;
    size_t at;
  };
  Located Locate(SeqId seq, int64_t block, int kvh) const {
    const Seq& d = *Find(seq);
    const Block& e = Table(seq)[static_cast<size_t>(block)];
    return {d, e, d.Slot(e.epoch) * n_kv_ + static_cast<size_t>(kvh)};
  }

  Seq MakeSeq(SeqId seq) const {
    Seq d;
    d.seq = seq;
    d.q_total.assign(static_cast<size_t>(n_kv_), 0);
    d.v_total.assign(static_cast<size_t>(n_kv_), 0);
    const SequenceState& s = cache_.seqs_[seq];
    for (const EpochUse& u : s.epoch_uses[static_cast<size_t>(layer_)]) {
      d.epochs.push_back(u.epoch);
      for (int kvh = 0; kvh < n_kv_; ++kvh) {
        const int qa = cache_.Table(u.epoch, layer_, false, kvh).active();
        const int va = cache_.Table(u.epoch, layer_, true, kvh).active();
        d.q_at.push_back(d.q_total[static_cast<size_t>(kvh)]);
        d.v_at.push_back(d.v_total[static_cast<size_t>(kvh)]);
        d.q_total[static_cast<size_t>(kvh)] += pre_rope_ ? 0 : qa + 1;
        d.v_total[static_cast<size_t>(kvh)] += 8 * va + 1;
      }
    }
    return d;
  }

  // One slot's projected queries: [group][active], then [group] constants.
  void PrepareSlot(const DecodeTable& t, const float* q, int group, float scale,
                   float* query) const {
    const int hd = cache_.config_.geometry.head_dim;
    const int active = t.active();
    thread_local std::vector<float> weighted;  // [group, hd] q s^-1
    const float* qs = q;
    if (!t.inv_scale.empty()) {
      weighted.resize(static_cast<size_t>(group) * static_cast<size_t>(hd));
      for (int g = 0; g < group; ++g) {
        for (int i = 0; i < hd; ++i) {
          weighted[static_cast<size_t>(g * hd + i)] =
              q[static_cast<int64_t>(g) * hd + i] * t.inv_scale[static_cast<size_t>(i)];
        }
      }
      qs = weighted.data();
    }
    const cpu::AttentionKernels& kernels = cpu::ActiveAttentionKernels();
    float* constant = query + static_cast<int64_t>(group) * active;
    kernels.scores(qs, hd, group, cpu::KvRows{t.ext.data()}, 1, hd, scale, constant);
    if (active == 0) return;
    kernels.scores(qs, hd, group, cpu::KvRows{t.basis.data()}, active, hd, scale, query);
    for (int g = 0; g < group; ++g) {
      float* w = query + static_cast<int64_t>(g) * active;
      for (int a = 0; a < active; ++a) {
        constant[g] += w[a] * t.offset[static_cast<size_t>(a)];
        w[a] *= t.step[static_cast<size_t>(a)];
      }
    }
  }

  // acc[g] += one slot's value accumulator (at value + g * stride) expanded to head_dim.
  void ExpandSlot(const DecodeTable& t, int group, int64_t stride, const float* value,
                  float* acc) const {
    const int hd = cache_.config_.geometry.head_dim;
    const int active = t.active();
    thread_local std::vector<float> row, u;  // [hd], [active]
    row.resize(static_cast<size_t>(hd));
    u.resize(static_cast<size_t>(active));
    for (int g = 0; g < group; ++g) {
      const float* v = value + static_cast<int64_t>(g) * stride;
      const float weight = v[8 * active];  // the slot's tokens' share of the softmax
      if (weight == 0.0f) continue;        // none read
      // u_a = sum_t p_t c_a(t) = step_a sum_t p_t code_a(t) + offset_a sum_t p_t.
      for (int a = 0; a < active; ++a) {
        float lanes = 0.0f;
        for (int l = 0; l < 8; ++l) lanes += v[8 * a + l];
        u[static_cast<size_t>(a)] =
            t.step[static_cast<size_t>(a)] * lanes + t.offset[static_cast<size_t>(a)] * weight;
      }
      for (int i = 0; i < hd; ++i) {
        row[static_cast<size_t>(i)] = weight * t.ext[static_cast<size_t>(i)];
      }
      if (active > 0) {
        cpu::ActiveAttentionKernels().accumulate(u.data(), 1, cpu::KvRows{t.basis.data()}, active,
                                                 hd, row.data(), hd);
      }
      float* o = acc + static_cast<int64_t>(g) * hd;
      if (t.inv_scale.empty()) {
        for (int i = 0; i < hd; ++i) o[i] += row[static_cast<size_t>(i)];
      } else {
        for (int i = 0; i < hd; ++i) {
          o[i] += row[static_cast<size_t>(i)] * t.inv_scale[static_cast<size_t>(i)];
        }
      }
    }
  }

  const std::vector<Block>& Table(SeqId seq) const {
    return cache_.seqs_[seq].tables[static_cast<size_t>(layer_)];
  }
  Seq* Find(SeqId seq) {
    for (Seq& d : seqs_) {
      if (d.seq == seq) return &d;
    }
    return nullptr;
  }
  const Seq* Find(SeqId seq) const {
    for (const Seq& d : seqs_) {
      if (d.seq == seq) return &d;
    }
    return nullptr;
  }
  float* KeyRows(const Seq& d, int64_t b) const {
    return decoded_ + d.offset + static_cast<size_t>((b - d.first) * cache_.v_half_);
  }
  // Head kvh's run of key or value codes in a coded block.
  const uint8_t* Run(const Block& e, int kvh, bool values) const {
    return cache_.slabs_.data({e.page, e.slot}) + cache_.CodedOffset(e.epoch, layer_, kvh, values);
  }

  const TransformKvCache& cache_;
  int layer_;
  int n_kv_;
  bool pre_rope_;
  std::vector<Seq> seqs_;
  std::vector<CodedFloats> floats_;  // [n_kv] the most any sequence's slots take
  float* decoded_ = nullptr;         // the constructing thread's buffer, valid for this call
};

void TransformKvCache::Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) {
  assert(layer >= 0 && layer < config_.geometry.n_layers);
  const RowSource rows(*this, layer, requests);
  AttendPagedBlocks(config_.geometry, config_.block_size, requests, n_heads, rows);
}

}  // namespace subspace
