// TransformKvCache: pool layout, coding at Commit, decoding for attention and truncation.
#include "core/compress/transform_kv_cache.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/base/coeff_codec.h"
#include "core/base/int_math.h"
#include "core/cpu/attention_kernels.h"
#include "core/cpu/ops.h"
#include "core/kvcache/paged_attention.h"

namespace subspace {

absl::Status CheckTransformCacheCodes(
    const std::shared_ptr<const std::vector<TransformCode>>& codes, const KvCacheGeometry& g,
    const char* side) {
  const size_t want = static_cast<size_t>(g.n_layers) * static_cast<size_t>(g.n_kv_heads);
  if (codes == nullptr || codes->size() != want) {
    return absl::InvalidArgumentError(
        absl::StrFormat("transform KV cache: %d %s codes needed (n_layers x n_kv_heads), got %d",
                        want, side, codes == nullptr ? 0 : codes->size()));
  }
  for (size_t i = 0; i < codes->size(); ++i) {
    const TransformCode& c = (*codes)[i];
    const size_t d = static_cast<size_t>(g.head_dim);
    if (c.dim != g.head_dim || c.mean.size() != d || c.basis.size() != d * d ||
        c.components.size() != d || (!c.scale.empty() && c.scale.size() != d)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("transform KV cache: %s code %d (layer %d, KV head %d) is not of dim %d",
                          side, i, i / static_cast<size_t>(g.n_kv_heads),
                          i % static_cast<size_t>(g.n_kv_heads), g.head_dim));
    }
    for (const ComponentQuantizer& q : c.components) {
      if (q.bits < 0 || q.bits > ComponentQuantizer::kMaxBits) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "transform KV cache: %s code %d has a %d-bit component", side, i, q.bits));
      }
    }
  }
  return absl::OkStatus();
}

TransformKvCache::DecodeTable TransformKvCache::DecodeTable::Of(const TransformCode& code,
                                                                int block_size) {
  DecodeTable t;
  const int d = code.dim;
  std::vector<double> ext(static_cast<size_t>(d), 0.0);
  // The components with bits, widest first: the kernels widen each width's components with
  // compile-time shifts.
  const CodedRunLayout run = LayOutCodedRun(code, block_size);
  for (int a = 0; a < run.active(); ++a) {
    const int j = run.components[static_cast<size_t>(a)];
    const ComponentQuantizer& q = code.components[static_cast<size_t>(j)];
    const float* row = code.basis.data() + static_cast<int64_t>(j) * d;
    t.bits.push_back(q.bits);
    t.byte_at.push_back(run.byte_at[static_cast<size_t>(a)]);
    t.offset.push_back(q.offset);
    t.step.push_back(q.step);
    t.basis.insert(t.basis.end(), row, row + d);
  }
  t.run_bytes = run.run_bytes;
  // What the components without bits add: their offsets along their basis rows, in the order
  // the components come (as before the layout was shared).
  for (int j = 0; j < d; ++j) {
    const ComponentQuantizer& q = code.components[static_cast<size_t>(j)];
    if (q.bits != 0) continue;
    const float* row = code.basis.data() + static_cast<int64_t>(j) * d;
    for (int i = 0; i < d; ++i) ext[static_cast<size_t>(i)] += double{q.offset} * row[i];
  }
  for (int i = 0; i < d; ++i) {
    const double s = code.scale.empty() ? 1.0 : code.scale[static_cast<size_t>(i)];
    ext[static_cast<size_t>(i)] += code.mean[static_cast<size_t>(i)] * s;
  }
  t.ext.assign(ext.begin(), ext.end());
  if (!code.scale.empty()) {
    t.scale = code.scale;
    for (float s : code.scale) t.inv_scale.push_back(1.0f / s);
  }
  t.mean = code.mean.data();
  return t;
}

int64_t TransformKvCache::PageBytes(const KvCacheGeometry& g, int block_size) {
  return 2 * static_cast<int64_t>(g.n_kv_heads) * block_size * g.head_dim * 2;
}

int64_t TransformKvCache::CodedBlockBytes(int layer) const {
  return coded_bytes_[static_cast<size_t>(layer)];
}

absl::StatusOr<std::unique_ptr<TransformKvCache>> TransformKvCache::Create(
    const TransformKvCacheConfig& config) {
  const KvCacheGeometry& g = config.geometry;
  if (absl::Status st = CheckKvGeometry(g); !st.ok()) return st;
  if (config.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("block_size must be positive, got %d", config.block_size));
  }
  if (config.sink_tokens < 0 || config.window_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sink and window tokens must be >= 0, got %d and %d", config.sink_tokens,
                        config.window_tokens));
  }
  if (absl::Status st = CheckTransformCacheCodes(config.key_codes, g, "key"); !st.ok()) return st;
  if (absl::Status st = CheckTransformCacheCodes(config.value_codes, g, "value"); !st.ok())
    return st;
  if (config.key_rope.has_value() &&
      (config.key_rope->dim < 2 || config.key_rope->dim % 2 != 0 ||
       config.key_rope->dim > g.head_dim ||
       config.key_rope->inv_freq.size() != static_cast<size_t>(config.key_rope->dim / 2))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "transform KV cache: the keys' RoPE must rotate an even number of dims, at most the "
        "head's %d, with a frequency per pair; got %d dims and %d frequencies",
        g.head_dim, config.key_rope->dim, config.key_rope->inv_freq.size()));
  }
  const int64_t page_bytes = PageBytes(g, config.block_size);
  absl::StatusOr<int64_t> num_pages =
      BlocksForCapacity(config.capacity_bytes, page_bytes, g.n_layers);
  if (!num_pages.ok()) return num_pages.status();
  absl::StatusOr<std::unique_ptr<BlockPool>> pool =
      BlockPool::Create(page_bytes / static_cast<int64_t>(sizeof(float)), *num_pages);
  if (!pool.ok()) return pool.status();
  return std::unique_ptr<TransformKvCache>(new TransformKvCache(config, *std::move(pool)));
}

TransformKvCache::TransformKvCache(const TransformKvCacheConfig& config,
                                   std::unique_ptr<BlockPool> pool)
    : config_(config),
      v_half_(static_cast<int64_t>(config.geometry.n_kv_heads) * config.block_size *
              config.geometry.head_dim),
      pool_(std::move(pool)),
      slabs_(pool_.get(), BlockKind::kCompressed),
      seqs_({.n_layers = config.geometry.n_layers,
             .block_size = config.block_size,
             .block_bytes = pool_->block_bytes()},
            pool_.get()) {
  policy_.sink_tokens = config.sink_tokens;
  policy_.window_tokens = config.window_tokens;
  image_layout_ = TransformImageLayout(config_.geometry, config_.block_size, config_.sink_tokens,
                                       config_.window_tokens, config_.key_rope.has_value(),
                                       *config_.key_codes, *config_.value_codes);
  if (config_.key_rope.has_value()) {
    // Rotating by -p with the scale divided out undoes the rotation by p.
    key_unrope_ = *config_.key_rope;
    key_unrope_->mscale = 1.0 / key_unrope_->mscale;
  }
  const KvCacheGeometry& g = config_.geometry;
  std::vector<std::pair<int64_t, int>> classes;  // slot bytes -> class
  for (int l = 0; l < g.n_layers; ++l) {
    int64_t at = 0;
    for (int side = 0; side < 2; ++side) {
      for (int h = 0; h < g.n_kv_heads; ++h) {
        coded_offsets_.push_back(at);
        const TransformCode& c = side == 0 ? KeyCode(l, h) : ValueCode(l, h);
        decode_.push_back(DecodeTable::Of(c, config_.block_size));
        at += decode_.back().run_bytes;
        max_active_ = std::max(max_active_, decode_.back().active());
      }
    }
    coded_bytes_.push_back(at);
    int cls = -1;
    for (const auto& [bytes, c] : classes) {
      if (bytes == at) cls = c;
    }
    if (cls < 0) {
      // At most 8 bits a component: a coded row never exceeds half an fp16 one.
      cls = slabs_.AddClass(std::max<int64_t>(at, 1));
      assert(cls >= 0);
      classes.emplace_back(at, cls);
    }
    slab_class_.push_back(cls);
  }
}

absl::StatusOr<SeqId> TransformKvCache::CreateSequence() {
  absl::StatusOr<SeqId> id = seqs_.Create();
  if (id.ok()) seqs_[*id].next_compress = 0;
  return id;
}

void TransformKvCache::FreeBlock(Block& e) {
  if (e.slot < 0) {
    pool_->Free(e.page);
  } else {
    slabs_.Free({e.page, e.slot});
  }
  e = Block{};
}

absl::Status TransformKvCache::FreeSequence(SeqId seq) {
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  seqs_.ReleaseBlocksPast(*s, 0, [&](int, int64_t, Block& e) { FreeBlock(e); });
  seqs_.Remove(seq);
  return absl::OkStatus();
}

int64_t TransformKvCache::BlocksNeeded(SeqId seq, int64_t n) const {
  return seqs_.BlocksNeeded(seq, n);
}

absl::Status TransformKvCache::Reserve(SeqId seq, int64_t n) { return seqs_.Reserve(seq, n); }

void TransformKvCache::Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k,
                             const float* v) {
  Sequence* s = seqs_.Find(seq);
  assert(s != nullptr && layer >= 0 && layer < config_.geometry.n_layers);
  assert(pos >= 0 && pos + n <= s->blocks() * config_.block_size && "write past the reservation");
  const std::vector<Block>& table = s->tables[static_cast<size_t>(layer)];
  const int hd = config_.geometry.head_dim;
  const int n_kv = config_.geometry.n_kv_heads;
  const int bs = config_.block_size;
  const cpu::AttentionKernels& kernels = cpu::ActiveAttentionKernels();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = pos + i;
    const Block& e = table[static_cast<size_t>(t / bs)];
    assert(e.slot < 0 && "write into a coded block");
    const int64_t slot = t % bs;
    for (int h = 0; h < n_kv; ++h) {
      const int64_t src = (i * n_kv + h) * hd;  // k, v: [n, n_kv_heads, head_dim]
      kernels.to_fp16(k + src, hd, FullAt(e.page, KOffset(h, slot)));
      kernels.to_fp16(v + src, hd, FullAt(e.page, VOffset(h, slot)));
    }
  }
}

void TransformKvCache::Unpack(const DecodeTable& table, const uint8_t* run, int n, float* out) {
  const cpu::AttentionKernels& kernels = cpu::ActiveAttentionKernels();
  for (int a = 0; a < table.active(); ++a) {
    const auto i = static_cast<size_t>(a);
    kernels.dequantize_codes(run + table.byte_at[i], table.bits[i], n, table.offset[i],
                             table.step[i], out + static_cast<int64_t>(a) * n);
  }
}

void TransformKvCache::DecodeRows(int layer, const uint8_t* codes, int64_t block, bool values,
                                  int valid, float* out) const {
  const int hd = config_.geometry.head_dim;
  const int bs = config_.block_size;
  const cpu::AttentionKernels& kernels = cpu::ActiveAttentionKernels();
  thread_local std::vector<float> unpacked, coeffs;  // [active][valid], then [valid][active]
  for (int h = 0; h < config_.geometry.n_kv_heads; ++h) {
    const DecodeTable& table = Table(layer, values, h);
    const int active = table.active();
    float* dst = out + static_cast<int64_t>(h) * bs * hd;
    // The components of every row, then all rows at once: [valid, active] x [active, d].
    unpacked.resize(static_cast<size_t>(valid) * static_cast<size_t>(active));
    coeffs.resize(unpacked.size());
    Unpack(table, codes + CodedOffset(layer, h, values), valid, unpacked.data());
    for (int a = 0; a < active; ++a) {
      for (int t = 0; t < valid; ++t) {
        coeffs[static_cast<size_t>(t * active + a)] = unpacked[static_cast<size_t>(a * valid + t)];
      }
    }
    for (int t = 0; t < valid; ++t) {
      std::copy(table.ext.begin(), table.ext.end(), dst + static_cast<int64_t>(t) * hd);
    }
    if (active > 0) {
      kernels.accumulate(coeffs.data(), valid, cpu::KvRows{table.basis.data()}, active, hd, dst,
                         hd);
    }
    if (!table.inv_scale.empty()) {
      for (int t = 0; t < valid; ++t) {
        float* x = dst + static_cast<int64_t>(t) * hd;
        for (int i = 0; i < hd; ++i) x[i] *= table.inv_scale[static_cast<size_t>(i)];
      }
    }
    if (!values && key_unrope_.has_value()) RotateKeys(dst, valid, block * bs);
  }
}

void TransformKvCache::EncodeRows(const DecodeTable& table, float* rows, uint8_t* run) const {
  const int hd = config_.geometry.head_dim;
  const int bs = config_.block_size;
  const int active = table.active();
  if (active == 0) return;
  // Centred and weighted in place, projected on the components with bits at once (fp32: the
  // codes of a value on a rounding boundary may differ from TransformCode::Encode's float64).
  for (int t = 0; t < bs; ++t) {
    float* x = rows + static_cast<int64_t>(t) * hd;
    for (int i = 0; i < hd; ++i) {
      x[i] -= table.mean[i];
      if (!table.scale.empty()) x[i] *= table.scale[static_cast<size_t>(i)];
    }
  }
  thread_local std::vector<float> coeffs;  // [B, active]
  coeffs.resize(static_cast<size_t>(bs) * static_cast<size_t>(active));
  cpu::ActiveAttentionKernels().scores(rows, hd, bs, cpu::KvRows{table.basis.data()}, active, hd,
                                       1.0f, coeffs.data());
  std::fill(run, run + table.run_bytes, uint8_t{0});
  for (int a = 0; a < active; ++a) {
    const auto i = static_cast<size_t>(a);
    const ComponentQuantizer q{
        .bits = table.bits[i], .offset = table.offset[i], .step = table.step[i]};
    uint8_t* dst = run + table.byte_at[i];
    for (int t = 0; t < bs; ++t) {
      const uint32_t code = q.Encode(coeffs[static_cast<size_t>(t * active + a)]);
      const int at = t * q.bits;
      const uint32_t shifted = code << (at & 7);  // at most 15 bits: two bytes
      dst[at >> 3] |= static_cast<uint8_t>(shifted);
      if ((at & 7) + q.bits > 8) dst[(at >> 3) + 1] |= static_cast<uint8_t>(shifted >> 8);
    }
  }
}

void TransformKvCache::EnsureRopeTable(int64_t end) {
  const RopeSchedule& rope = *config_.key_rope;
  const int pairs = std::min(rope.dim, config_.geometry.head_dim) / 2;
  const int64_t have = static_cast<int64_t>(rope_cos_sin_.size()) / (2 * pairs);
  if (end <= have) return;
  const int64_t grow = std::max(end, 2 * have);
  rope_cos_sin_.resize(static_cast<size_t>(grow * 2 * pairs));
  for (int64_t p = have; p < grow; ++p) {
    cpu::RopeCosSin(rope, p, pairs, rope_cos_sin_.data() + p * 2 * pairs);
  }
}

void TransformKvCache::RotateKeys(float* rows, int valid, int64_t first) const {
  const RopeSchedule& rope = *config_.key_rope;
  const int hd = config_.geometry.head_dim;
  const int pairs = std::min(rope.dim, hd) / 2;
  for (int t = 0; t < valid; ++t) {
    cpu::RotatePairs(rows + static_cast<int64_t>(t) * hd, 1, hd, rope,
                     rope_cos_sin_.data() + (first + t) * 2 * pairs);
  }
}

// A layer's blocks for AttendPagedBlocks: full pages read in place at fp16; coded blocks read in
// code space, except keys coded before RoPE, which are
// decoded beforehand, once per call (a row costs O(d x active), and a prefill chunk's every
// query reads every block).
class TransformKvCache::RowSource final : public BlockRowSource {
 public:
  // The coded blocks of one sequence whose keys this call decodes: block b's K rows at
  // decoded[offset + (b - first) * v_half].
  struct Decoded {
    SeqId seq = -1;
    int64_t first = 0, end = 0;
    size_t offset = 0;
  };

  RowSource(const TransformKvCache& cache, int layer, std::span<const AttentionRequest> requests)
      : cache_(cache), layer_(layer), pre_rope_(cache.key_unrope_.has_value()) {
    if (!pre_rope_) return;
    const int bs = cache_.config_.block_size;
    size_t floats = 0;
    for (const AttentionRequest& r : requests) {
      if (r.n <= 0) continue;
      const int64_t first = r.FirstAttended(r.pos) / bs;
      const int64_t end = CeilDiv(r.pos + r.n, int64_t{bs});
      Decoded* d = Find(r.seq);
      if (d == nullptr) {
        seqs_.push_back({r.seq, first, end, 0});
      } else {
        d->first = std::min(d->first, first);
        d->end = std::max(d->end, end);
      }
    }
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
      cache_.DecodeRows(layer_, cache_.slabs_.data({e.page, e.slot}), b, /*values=*/false, bs,
                        KeyRows(seqs_[i], b));
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

  // Keys coded after RoPE, per query head: w_a = scale step_a u_a . q s^-1 [active], then
  // after the group's, its constant scale (e . q s^-1 + sum_a offset_a u_a . q s^-1): a score
  // is w . code + constant. Values, per query head: eight partial sums of p_t code_a(t) per
  // component [active][8], then sum_t p_t.
  CodedFloats CodedStateFloats(int kvh) const override {
    return {.query = pre_rope_ ? 0 : cache_.Table(layer_, false, kvh).active() + 1,
            .value = 8 * cache_.Table(layer_, true, kvh).active() + 1};
  }

  void PrepareQueries(int kvh, const float* q, int group, float scale,
                      float* query) const override {
    const DecodeTable& t = cache_.Table(layer_, false, kvh);
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

  void CodedScores(SeqId seq, int64_t block, int kvh, int group, int nb, const float* query,
                   float* scores) const override {
    const DecodeTable& t = cache_.Table(layer_, false, kvh);
    const int active = t.active();
    for (int g = 0; g < group; ++g) {
      std::fill_n(scores + static_cast<int64_t>(g) * nb, nb,
                  query[static_cast<int64_t>(group) * active + g]);
    }
    if (active == 0) return;
    cpu::ActiveAttentionKernels().code_scores(Run(seq, block, kvh, false), t.bits.data(),
                                              t.byte_at.data(), active, nb, query, group, scores);
  }

  void CodedAccumulate(SeqId seq, int64_t block, int kvh, int group, int nb, const float* p,
                       float* value) const override {
    const DecodeTable& t = cache_.Table(layer_, true, kvh);
    const int active = t.active();
    const int64_t stride = 8 * active + 1;  // one query head's floats
    if (active > 0) {
      cpu::ActiveAttentionKernels().code_sums(Run(seq, block, kvh, true), t.bits.data(),
                                              t.byte_at.data(), active, nb, p, group, value,
                                              stride);
    }
    for (int g = 0; g < group; ++g) {
      const float* pg = p + static_cast<int64_t>(g) * nb;
      for (int i = 0; i < nb; ++i) value[g * stride + 8 * active] += pg[i];
    }
  }

  void ExpandValues(int kvh, int group, const float* value, float* acc) const override {
    const DecodeTable& t = cache_.Table(layer_, true, kvh);
    const int hd = cache_.config_.geometry.head_dim;
    const int active = t.active();
    thread_local std::vector<float> row, u;  // [hd], [active]
    row.resize(static_cast<size_t>(hd));
    u.resize(static_cast<size_t>(active));
    for (int g = 0; g < group; ++g) {
      const float* v = value + static_cast<int64_t>(g) * (8 * active + 1);
      const float weight = v[8 * active];  // the coded tokens' share of the softmax
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

 private:
  const std::vector<Block>& Table(SeqId seq) const {
    return cache_.seqs_[seq].tables[static_cast<size_t>(layer_)];
  }
  Decoded* Find(SeqId seq) {
    for (Decoded& d : seqs_) {
      if (d.seq == seq) return &d;
    }
    return nullptr;
  }
  const Decoded* Find(SeqId seq) const {
    for (const Decoded& d : seqs_) {
      if (d.seq == seq) return &d;
    }
    return nullptr;
  }
  float* KeyRows(const Decoded& d, int64_t b) const {
    return decoded_ + d.offset + static_cast<size_t>((b - d.first) * cache_.v_half_);
  }
  // Head kvh's run of key or value codes in a coded block.
  const uint8_t* Run(SeqId seq, int64_t block, int kvh, bool values) const {
    const Block& e = Table(seq)[static_cast<size_t>(block)];
    return cache_.slabs_.data({e.page, e.slot}) + cache_.CodedOffset(layer_, kvh, values);
  }

  const TransformKvCache& cache_;
  int layer_;
  bool pre_rope_;
  std::vector<Decoded> seqs_;
  float* decoded_ = nullptr;  // the constructing thread's buffer, valid for this call
};

void TransformKvCache::Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) {
  assert(layer >= 0 && layer < config_.geometry.n_layers);
  const RowSource rows(*this, layer, requests);
  AttendPagedBlocks(config_.geometry, config_.block_size, requests, n_heads, rows);
}

void TransformKvCache::CodeBlock(const Block& e, int layer, int64_t b, uint8_t* out) const {
  const int hd = config_.geometry.head_dim;
  const int n_kv = config_.geometry.n_kv_heads;
  const int bs = config_.block_size;
  assert(e.slot < 0);
  thread_local std::vector<float> full;  // [2, n_kv, B, hd] widened to fp32
  full.resize(static_cast<size_t>(2 * v_half_));
  const uint16_t* page = FullAt(e.page, 0);
  for (int64_t i = 0; i < 2 * v_half_; ++i) full[static_cast<size_t>(i)] = HalfToFloat(page[i]);
  if (key_unrope_.has_value()) {
    thread_local std::vector<int64_t> negated;
    negated.resize(static_cast<size_t>(bs));
    for (int t = 0; t < bs; ++t) negated[static_cast<size_t>(t)] = -(b * bs + t);
    for (int h = 0; h < n_kv; ++h) {
      cpu::Rope(full.data() + KOffset(h, 0), bs, 1, hd, *key_unrope_, negated.data());
    }
  }
  for (int h = 0; h < n_kv; ++h) {
    EncodeRows(Table(layer, false, h), full.data() + KOffset(h, 0),
               out + CodedOffset(layer, h, false));
    EncodeRows(Table(layer, true, h), full.data() + VOffset(h, 0),
               out + CodedOffset(layer, h, true));
  }
}

absl::Status TransformKvCache::Commit(SeqId seq, int64_t length) {
  if (absl::Status st = seqs_.Commit(seq, length); !st.ok()) return st;
  Sequence& s = *seqs_.Find(seq);
  const BlockRange range = policy_.CompressibleBlocks(s.next_compress, length, config_.block_size);
  if (range.empty()) return absl::OkStatus();
  if (key_unrope_.has_value()) EnsureRopeTable(range.end * config_.block_size);
  // Code every (layer, block) on worker threads into a staging buffer (reading the pages only),
  // then swap pages for slots on this thread: each page is freed before its slot is taken.
  struct Job {
    int layer;
    int64_t block;
    size_t at;  // in staging
  };
  std::vector<Job> jobs;
  size_t bytes = 0;
  for (int64_t b = range.begin; b < range.end; ++b) {
    for (int l = 0; l < config_.geometry.n_layers; ++l) {
      if (s.tables[static_cast<size_t>(l)][static_cast<size_t>(b)].slot >= 0) continue;
      jobs.push_back({l, b, bytes});
      bytes += static_cast<size_t>(CodedBlockBytes(l));
    }
  }
  thread_local std::vector<uint8_t> staging;  // this thread's: workers see it through `out`
  staging.resize(bytes);
  uint8_t* out = staging.data();
  const int64_t n = static_cast<int64_t>(jobs.size());
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
  for (int64_t j = 0; j < n; ++j) {
    const Job& job = jobs[static_cast<size_t>(j)];
    CodeBlock(s.tables[static_cast<size_t>(job.layer)][static_cast<size_t>(job.block)], job.layer,
              job.block, out + job.at);
  }
  for (const Job& job : jobs) {
    Block& e = s.tables[static_cast<size_t>(job.layer)][static_cast<size_t>(job.block)];
    pool_->Free(e.page);  // before the slot: coding never needs a free page
    const SlabAllocator::Slot slot = slabs_.Allocate(slab_class_[static_cast<size_t>(job.layer)]);
    assert(slot.page >= 0);
    std::copy_n(out + job.at, CodedBlockBytes(job.layer), slabs_.data(slot));
    e = {slot.page, slot.index};
  }
  s.next_compress = range.end;
  return absl::OkStatus();
}

absl::Status TransformKvCache::ExpandBlock(Sequence& s, int layer, int64_t b) {
  Block& e = s.tables[static_cast<size_t>(layer)][static_cast<size_t>(b)];
  assert(e.slot >= 0);
  const int32_t page = pool_->Allocate(BlockKind::kFull);
  if (page < 0) {
    return absl::ResourceExhaustedError(
        "KV cache full: no page to decode a coded block cut by a truncation into");
  }
  thread_local std::vector<float> rows;  // one side: [n_kv, B, hd]
  rows.resize(static_cast<size_t>(v_half_));
  const cpu::AttentionKernels& kernels = cpu::ActiveAttentionKernels();
  const uint8_t* codes = slabs_.data({e.page, e.slot});
  for (int side = 0; side < 2; ++side) {
    DecodeRows(layer, codes, b, side == 1, config_.block_size, rows.data());
    kernels.to_fp16(rows.data(), static_cast<int>(v_half_), FullAt(page, side == 0 ? 0 : v_half_));
  }
  FreeBlock(e);
  e = {page, -1};
  return absl::OkStatus();
}

absl::Status TransformKvCache::Truncate(SeqId seq, int64_t length) {
  if (absl::Status st = seqs_.Truncate(seq, length, [&](int, int64_t, Block& e) { FreeBlock(e); });
      !st.ok()) {
    return st;
  }
  Sequence& s = *seqs_.Find(seq);
  const int bs = config_.block_size;
  const int64_t keep = CeilDiv(length, int64_t{bs});
  if (length % bs != 0 && keep > 0) {
    for (int l = 0; l < config_.geometry.n_layers; ++l) {
      if (s.tables[static_cast<size_t>(l)][static_cast<size_t>(keep - 1)].slot < 0) continue;
      if (absl::Status st = ExpandBlock(s, l, keep - 1); !st.ok()) return st;
    }
    s.next_compress = std::min(s.next_compress, keep - 1);
  } else {
    s.next_compress = std::min(s.next_compress, keep);
  }
  return absl::OkStatus();
}

TransformKvCacheDetail TransformKvCache::Detail() const {
  TransformKvCacheDetail d;
  d.pages_full = pool_->num_used(BlockKind::kFull);
  d.pages_coded = pool_->num_used(BlockKind::kCompressed);
  d.coded_slot_bytes = slabs_.slot_bytes_used();
  for (const Sequence& s : seqs_.all()) {
    if (!s.live) continue;
    for (const std::vector<Block>& table : s.tables) {
      for (const Block& e : table) d.blocks_coded += e.slot >= 0 ? 1 : 0;
    }
  }
  return d;
}

bool TransformKvCache::IsCoded(SeqId seq, int layer, int64_t block) const {
  const std::vector<Block>* table = seqs_.Table(seq, layer);
  return table != nullptr && block >= 0 && block < static_cast<int64_t>(table->size()) &&
         (*table)[static_cast<size_t>(block)].slot >= 0;
}

}  // namespace subspace
