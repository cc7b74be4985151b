// CompressedKvCache: online refresh and the compactor (docs/design.md, "Online refresh" and
// "Exactness across basis changes"). The cache hands each block it compresses to the
// Refresher and installs what the refresher publishes as the sequence's new epoch at a later
// Commit; blocks keep the epoch that made them. The compactor bounds the epochs a sequence
// keeps live by re-projecting blocks of its oldest epoch into its current one: the key a query
// sees is k^ = P_q[old] c, so c' = P_k[new]^T P_q[old] c, and u' = P_v[new]^T R_v[old]^T u --
// r x r maps, O(B r^2) per block-head. It runs on the engine thread, a bounded number of
// block-heads per Commit, because on the CPU a block rewritten while Attend reads it would
// race, and the work is small next to a step (64 block-heads at B = 16, r = 16: ~0.3 Mflop).
#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/compress/compressed_kv_cache.h"

namespace subspace {
namespace {

// m: [rows_out, rows_in] = a^T b for a: [d, rows_out], b: [d, rows_in] (row-major).
void TransposeTimes(const float* a, const float* b, int d, int rows_out, int rows_in, float* m) {
  std::fill(m, m + static_cast<size_t>(rows_out) * rows_in, 0.0f);
  for (int x = 0; x < d; ++x) {
    for (int i = 0; i < rows_out; ++i) {
      const float ai = a[static_cast<size_t>(x) * rows_out + i];
      for (int j = 0; j < rows_in; ++j) {
        m[static_cast<size_t>(i) * rows_in + j] += ai * b[static_cast<size_t>(x) * rows_in + j];
      }
    }
  }
}

// out = m c.  m: [r, r]; c, out: [r]
void Apply(const float* m, const float* c, int r, float* out) {
  for (int i = 0; i < r; ++i) {
    float acc = 0.0f;
    for (int j = 0; j < r; ++j) acc += m[static_cast<size_t>(i) * r + j] * c[j];
    out[i] = acc;
  }
}

}  // namespace

absl::Status CompressedKvCache::SetSequenceRefresh(SeqId seq, const RefreshConfig& config) {
  if (absl::Status st = ValidateRefreshConfig(config); !st.ok()) return st;
  if (config.method == RefreshMethod::kKqsvd && config_.n_query_heads == 0) {
    return absl::InvalidArgumentError("kqsvd refresh needs the cache's n_query_heads");
  }
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  epochs_.CloseStream(*s);
  s->refresh = config;
  epochs_.OpenStream(*s, seq);  // now if it has an epoch, else at its first compression
  return absl::OkStatus();
}

void CompressedKvCache::ObserveBlock(const Sequence& s, int layer, const float* full,
                                     double residual, double energy) {
  BlockObservation o;
  o.layer = layer;
  o.tokens = config_.block_size;
  o.keys.assign(full, full + v_half_);  // the K half of [2, n_kv, B, hd]: [n_kv, B, hd]
  o.values.assign(full + v_half_, full + 2 * v_half_);
  o.residual = residual;
  o.energy = energy;
  epochs_.refresher()->Observe(s.stream, std::move(o));  // dropped (and counted) when it is behind
}

void CompressedKvCache::ObserveQueries(int layer, std::span<const AttentionRequest> requests,
                                       int n_heads) {
  if (!epochs_.has_streams()) return;
  const size_t row = static_cast<size_t>(n_heads) * config_.geometry.head_dim;
  for (const AttentionRequest& req : requests) {
    const Sequence* s = seqs_.Find(req.seq);
    if (s == nullptr || s->stream == 0 || s->refresh.method != RefreshMethod::kKqsvd) continue;
    // kqsvd streams exist only with n_query_heads set (Create / SetSequenceRefresh check it).
    assert(n_heads == config_.n_query_heads);
    QueryObservation o;
    o.layer = layer;
    o.n = req.n;
    o.q.assign(req.q, req.q + static_cast<size_t>(req.n) * row);
    epochs_.refresher()->Observe(s->stream, std::move(o));
  }
}

void CompressedKvCache::InstallPublishedEpochs() {
  if (epochs_.refresher() == nullptr) return;
  for (Refresher::Published& p : epochs_.refresher()->TakePublished()) {
    const SeqId seq = epochs_.StreamSequence(p.stream);
    if (seq < 0) continue;  // the sequence went away or restarted its refresh
    absl::StatusOr<EpochId> id = InstallBasis(std::move(p.epoch.basis));
    if (!id.ok()) continue;  // shapes are the cache's own; cannot fail
    (void)SetSequenceEpoch(seq, *id);
    epochs_.Release(*id);  // the sequence holds it now
    ++refreshes_installed_;
  }
}

int64_t CompressedKvCache::Compact(Sequence& s, int64_t budget) {
  const int n_kv = config_.geometry.n_kv_heads;
  const size_t max_live = static_cast<size_t>(s.refresh.max_epochs);
  int64_t moved = 0;
  for (int l = 0; l < config_.geometry.n_layers && moved < budget; ++l) {
    LayerState& ls = s.layers[static_cast<size_t>(l)];
    const std::vector<BlockEntry>& table = s.tables[static_cast<size_t>(l)];
    while (ls.live.size() > max_live && moved < budget) {
      EpochId oldest = kNoEpoch;  // ids grow with time
      for (const LiveEpoch& e : ls.live) {
        if (e.id != s.epoch && (oldest == kNoEpoch || e.id < oldest)) oldest = e.id;
      }
      if (oldest == kNoEpoch) break;
      for (int64_t b = 0; b < static_cast<int64_t>(table.size()) && moved < budget; ++b) {
        if (table[static_cast<size_t>(b)].slot < 0) continue;
        for (int h = 0; h < n_kv && moved < budget; ++h) {
          if (ls.block_epochs[static_cast<size_t>(b * n_kv + h)] != oldest) continue;
          ReprojectBlockHead(s, l, b, h, s.epoch);
          ++moved;
        }
      }
    }
  }
  blocks_reprojected_ += moved;
  return moved;
}

void CompressedKvCache::ReprojectBlockHead(Sequence& s, int layer, int64_t b, int h, EpochId to) {
  const int hd = config_.geometry.head_dim, n_kv = config_.geometry.n_kv_heads;
  const int bs = config_.block_size;
  const int rk = r_k_[static_cast<size_t>(layer)], rv = r_v_[static_cast<size_t>(layer)];
  const CoeffDtype dt = config_.policy.coeff_dtype;
  LayerState& ls = s.layers[static_cast<size_t>(layer)];
  EpochId& epoch = ls.block_epochs[static_cast<size_t>(b * n_kv + h)];
  const EpochId from = epoch;
  const LayerBasis& old_b = epochs_.Get(from)->layers[static_cast<size_t>(layer)];
  const LayerBasis& new_b = epochs_.Get(to)->layers[static_cast<size_t>(layer)];

  thread_local std::vector<float> work;
  work.resize(static_cast<size_t>(rk) * rk + static_cast<size_t>(rv) * rv + 2 * std::max(rk, rv) +
              static_cast<size_t>(rv) * hd);
  float* m_k = work.data();                         // [r_k, r_k] P_k[new]^T P_q[old]
  float* m_v = m_k + static_cast<size_t>(rk) * rk;  // [r_v, r_v] P_v[new]^T R_v[old]^T
  float* c = m_v + static_cast<size_t>(rv) * rv;    // [max r]
  float* c2 = c + std::max(rk, rv);                 // [max r]
  float* rv_old_t = c2 + std::max(rk, rv);          // [d, r_v] R_v[old]^T
  const size_t off_k = static_cast<size_t>(h) * hd * rk, off_v = static_cast<size_t>(h) * hd * rv;
  TransposeTimes(new_b.p_k.data() + off_k, old_b.p_q.data() + off_k, hd, rk, rk, m_k);
  const float* rv_old = old_b.r_v.data() + off_v;  // [r_v, d]
  for (int i = 0; i < hd; ++i) {
    for (int j = 0; j < rv; ++j)
      rv_old_t[static_cast<size_t>(i) * rv + j] = rv_old[static_cast<size_t>(j) * hd + i];
  }
  TransposeTimes(new_b.p_v.data() + off_v, rv_old_t, hd, rv, rv, m_v);

  const BlockEntry& e = s.tables[static_cast<size_t>(layer)][static_cast<size_t>(b)];
  uint8_t* base = slabs_.data({e.page, e.slot});
  const int64_t rows = static_cast<int64_t>(n_kv) * bs;
  uint8_t* k_codes = base;
  uint8_t* v_codes = k_codes + CodeBytes(dt, rows * rk);
  auto* k_scales = reinterpret_cast<uint16_t*>(v_codes + CodeBytes(dt, rows * rv));
  uint16_t* v_scales = k_scales + rows;
  for (int t = 0; t < bs; ++t) {
    const int64_t row = static_cast<int64_t>(h) * bs + t;
    DecodeCoeffs(dt, k_codes + CodeBytes(dt, row * rk), k_scales + row, rk, c);
    Apply(m_k, c, rk, c2);
    EncodeCoeffs(dt, c2, rk, k_codes + CodeBytes(dt, row * rk), k_scales + row);
    DecodeCoeffs(dt, v_codes + CodeBytes(dt, row * rv), v_scales + row, rv, c);
    Apply(m_v, c, rv, c2);
    EncodeCoeffs(dt, c2, rv, v_codes + CodeBytes(dt, row * rv), v_scales + row);
  }
  epoch = to;
  (void)epochs_.Acquire(to);
  AddEpochUse(ls, layer, to);
  DropEpochUse(ls, from);
  epochs_.Release(from);  // last: it may delete the old epoch
}

}  // namespace subspace
