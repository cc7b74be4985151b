// TransformKvCache: pool layout, coding at Commit, decoding for attention and truncation.
#include "core/compress/transform_kv_cache.h"

#include <algorithm>
#include <cassert>
#include <memory>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/base/coeff_codec.h"
#include "core/base/int_math.h"
#include "core/compress/transform_refresh.h"
#include "core/cpu/attention_kernels.h"
#include "core/cpu/ops.h"

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

absl::Status CheckTransformRefreshConfig(const RefreshConfig& c) {
  if (absl::Status st = ValidateRefreshConfig(c); !st.ok()) return st;
  if (c.method != RefreshMethod::kNone && c.method != RefreshMethod::kPca) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the transform-coded KV cache refreshes its codes by pca, not %s",
                        RefreshMethodName(c.method)));
  }
  if (c.method == RefreshMethod::kPca && c.residual_threshold > 0.0) {
    return absl::InvalidArgumentError(
        "the transform-coded KV cache refreshes by token count (refresh every_tokens); refresh "
        "residual_threshold must be 0");
  }
  if (c.method == RefreshMethod::kPca && c.every_tokens <= 0) {
    return absl::InvalidArgumentError(
        "refresh every_tokens must be positive for the transform-coded KV cache");
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
  if (absl::Status st = CheckTransformRefreshConfig(config.refresh); !st.ok()) return st;
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
            pool_.get()),
      image_format_(config.geometry, config.block_size, config.sink_tokens, config.window_tokens,
                    config.key_rope.has_value(), *config.key_codes, *config.value_codes) {
  policy_.sink_tokens = config.sink_tokens;
  policy_.window_tokens = config.window_tokens;
  if (config_.key_rope.has_value()) {
    // Rotating by -p with the scale divided out undoes the rotation by p.
    key_unrope_ = *config_.key_rope;
    key_unrope_->mscale = 1.0 / key_unrope_->mscale;
  }
  const KvCacheGeometry& g = config_.geometry;
  epochs_.push_back(std::make_unique<CodeEpoch>(
      MakeEpoch({.keys = config_.key_codes, .values = config_.value_codes})));
  epochs_[0]->refs = 1;  // the cache's own: epoch 0 is never retired
  coded_bytes_ = epochs_[0]->bytes;
  std::vector<std::pair<int64_t, int>> classes;  // slot bytes -> class
  for (int l = 0; l < g.n_layers; ++l) {
    const int64_t at = coded_bytes_[static_cast<size_t>(l)];
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

TransformKvCache::CodeEpoch TransformKvCache::MakeEpoch(const TransformCodes& codes) const {
  const KvCacheGeometry& g = config_.geometry;
  CodeEpoch e;
  e.codes = codes;
  for (int l = 0; l < g.n_layers; ++l) {
    int64_t at = 0;
    for (int side = 0; side < 2; ++side) {
      for (int h = 0; h < g.n_kv_heads; ++h) {
        e.offsets.push_back(at);
        const TransformCode& c =
            (side == 0 ? *codes.keys : *codes.values)[static_cast<size_t>(l * g.n_kv_heads + h)];
        e.decode.push_back(DecodeTable::Of(c, config_.block_size));
        at += e.decode.back().run_bytes;
      }
    }
    e.bytes.push_back(at);
  }
  return e;
}

int32_t TransformKvCache::AddEpoch(CodeEpoch epoch) {
  int32_t id = -1;
  for (size_t i = 1; i < epochs_.size() && id < 0; ++i) {
    if (epochs_[i] == nullptr) id = static_cast<int32_t>(i);
  }
  if (id < 0) {
    id = static_cast<int32_t>(epochs_.size());
    epochs_.emplace_back();
  }
  epoch.refs = 1;
  epochs_[static_cast<size_t>(id)] = std::make_unique<CodeEpoch>(std::move(epoch));
  return id;
}

void TransformKvCache::ReleaseEpoch(int32_t id) {
  std::unique_ptr<CodeEpoch>& e = epochs_[static_cast<size_t>(id)];
  assert(e != nullptr && e->refs > 0);
  if (--e->refs == 0) {
    assert(id != 0);
    e.reset();
  }
}

void TransformKvCache::AddBlockUse(SequenceState& s, int layer, int32_t id) {
  AcquireEpoch(id);
  std::vector<EpochUse>& live = s.epoch_uses[static_cast<size_t>(layer)];
  for (EpochUse& u : live) {
    if (u.epoch == id) {
      ++u.blocks;
      return;
    }
  }
  live.push_back({id, 1});
}

void TransformKvCache::DropBlockUse(SequenceState& s, int layer, int32_t id) {
  std::vector<EpochUse>& live = s.epoch_uses[static_cast<size_t>(layer)];
  for (size_t i = 0; i < live.size(); ++i) {
    if (live[i].epoch != id) continue;
    if (--live[i].blocks == 0) live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    break;
  }
  ReleaseEpoch(id);
}

absl::StatusOr<SeqId> TransformKvCache::CreateSequence() {
  absl::StatusOr<SeqId> id = seqs_.Create();
  if (!id.ok()) return id;
  SequenceState& s = seqs_[*id];
  s.next_compress = 0;
  s.epoch_uses.assign(static_cast<size_t>(config_.geometry.n_layers), {});
  s.epoch = 0;
  AcquireEpoch(0);
  StartSequence(s, *id, config_.refresh);
  return id;
}

void TransformKvCache::StartSequence(SequenceState& s, SeqId seq, const RefreshConfig& refresh) {
  s.refresh = refresh;
  s.stream = 0;
  if (refresh.method == RefreshMethod::kNone) return;
  if (refresher_ == nullptr) {
    refresher_ = std::make_unique<Refresher>(Refresher::Options{
        .inline_mode = config_.refresh_inline, .max_queued_bytes = config_.refresh_queue_bytes});
  }
  // The statistics (tens of KiB a stream) are made on the refresher's thread. Budgets and
  // metrics come from the codec file's codes, whichever epoch the sequence is in.
  const KvCacheGeometry g = config_.geometry;
  const int block_size = config_.block_size;
  const TransformCodes initial{.keys = config_.key_codes, .values = config_.value_codes};
  s.stream =
      refresher_->Open([g, block_size, refresh, initial]() -> std::unique_ptr<RefreshStatistics> {
        return std::make_unique<TransformStatistics>(g, block_size, refresh, initial);
      });
  streams_[s.stream] = seq;
}

void TransformKvCache::CloseStream(SequenceState& s) {
  if (s.stream == 0) return;
  refresher_->Close(s.stream);
  streams_.erase(s.stream);
  s.stream = 0;
}

absl::Status TransformKvCache::SetSequenceRefresh(SeqId seq, const RefreshConfig& config) {
  if (absl::Status st = CheckTransformRefreshConfig(config); !st.ok()) return st;
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  CloseStream(*s);
  StartSequence(*s, seq, config);
  return absl::OkStatus();
}

void TransformKvCache::FreeBlock(SequenceState& s, int layer, Block& e) {
  if (e.slot < 0) {
    pool_->Free(e.page);
  } else {
    slabs_.Free({e.page, e.slot});
    DropBlockUse(s, layer, e.epoch);
  }
  e = Block{};
}

absl::Status TransformKvCache::FreeSequence(SeqId seq) {
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  seqs_.ReleaseBlocksPast(*s, 0, [&](int l, int64_t, Block& e) { FreeBlock(*s, l, e); });
  CloseStream(*s);
  ReleaseEpoch(s->epoch);
  s->epoch = 0;
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

void TransformKvCache::DecodeRows(int32_t epoch, int layer, const uint8_t* codes, int64_t block,
                                  bool values, int valid, float* out, bool as_coded) const {
  const int hd = config_.geometry.head_dim;
  const int bs = config_.block_size;
  const cpu::AttentionKernels& kernels = cpu::ActiveAttentionKernels();
  thread_local std::vector<float> unpacked, coeffs;  // [active][valid], then [valid][active]
  for (int h = 0; h < config_.geometry.n_kv_heads; ++h) {
    const DecodeTable& table = Table(epoch, layer, values, h);
    const int active = table.active();
    float* dst = out + static_cast<int64_t>(h) * bs * hd;
    // The components of every row, then all rows at once: [valid, active] x [active, d].
    unpacked.resize(static_cast<size_t>(valid) * static_cast<size_t>(active));
    coeffs.resize(unpacked.size());
    Unpack(table, codes + CodedOffset(epoch, layer, h, values), valid, unpacked.data());
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
    if (!values && !as_coded && key_unrope_.has_value()) RotateKeys(dst, valid, block * bs);
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
      PutRunCode(dst, q.bits, t, q.Encode(coeffs[static_cast<size_t>(t * active + a)]));
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

void TransformKvCache::CodeBlock(const Block& e, int32_t epoch, int layer, int64_t b, uint8_t* out,
                                 BlockObservation* coded) const {
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
  if (coded != nullptr) {  // before centring
    coded->keys.assign(full.begin(), full.begin() + v_half_);
    coded->values.assign(full.begin() + v_half_, full.end());
  }
  for (int h = 0; h < n_kv; ++h) {
    EncodeRows(Table(epoch, layer, false, h), full.data() + KOffset(h, 0),
               out + CodedOffset(epoch, layer, h, false));
    EncodeRows(Table(epoch, layer, true, h), full.data() + VOffset(h, 0),
               out + CodedOffset(epoch, layer, h, true));
  }
}

void TransformKvCache::InstallPublished() {
  const KvCacheGeometry& g = config_.geometry;
  for (Refresher::Published& p : refresher_->TakePublished()) {
    const auto it = streams_.find(p.stream);
    if (it == streams_.end() || p.epoch.codes.keys == nullptr) continue;  // closed since
    // The refresher keeps each stream's bits, so its blocks fit epoch 0's slots; block sizes
    // whose rounding to bytes differs could not: such codes are refused, and counted.
    if (!CheckTransformCacheCodes(p.epoch.codes.keys, g, "key").ok() ||
        !CheckTransformCacheCodes(p.epoch.codes.values, g, "value").ok()) {
      ++refreshes_unplaced_;
      continue;
    }
    CodeEpoch epoch = MakeEpoch(p.epoch.codes);
    bool fits = true;
    for (int l = 0; l < g.n_layers; ++l) {
      fits = fits && epoch.bytes[static_cast<size_t>(l)] <= coded_bytes_[static_cast<size_t>(l)];
    }
    if (!fits) {
      ++refreshes_unplaced_;
      continue;
    }
    const int32_t id = AddEpoch(std::move(epoch));
    Sequence& s = seqs_[it->second];
    ReleaseEpoch(s.epoch);
    s.epoch = id;
    ++refreshes_installed_;
  }
}

absl::Status TransformKvCache::Commit(SeqId seq, int64_t length) {
  if (absl::Status st = seqs_.Commit(seq, length); !st.ok()) return st;
  if (refresher_ != nullptr && refresher_->has_published()) InstallPublished();
  Sequence& s = *seqs_.Find(seq);
  const BlockRange range = policy_.CompressibleBlocks(s.next_compress, length, config_.block_size);
  if (range.empty()) {
    Compact(s, kCompactBlocksPerCommit);
    return absl::OkStatus();
  }
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
  // With a refresh stream, the rows as coded go to the refresher too, one observation a job
  // (moved into its queue, which drops what exceeds its bound).
  std::vector<BlockObservation> observed(s.stream != 0 ? jobs.size() : 0);
  BlockObservation* coded = observed.empty() ? nullptr : observed.data();
  const int32_t epoch = s.epoch;
  const int64_t n = static_cast<int64_t>(jobs.size());
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
  for (int64_t j = 0; j < n; ++j) {
    const Job& job = jobs[static_cast<size_t>(j)];
    CodeBlock(s.tables[static_cast<size_t>(job.layer)][static_cast<size_t>(job.block)], epoch,
              job.layer, job.block, out + job.at, coded == nullptr ? nullptr : coded + j);
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    Block& e = s.tables[static_cast<size_t>(job.layer)][static_cast<size_t>(job.block)];
    pool_->Free(e.page);  // before the slot: coding never needs a free page
    const SlabAllocator::Slot slot = slabs_.Allocate(slab_class_[static_cast<size_t>(job.layer)]);
    assert(slot.page >= 0);
    std::copy_n(out + job.at, CodedBlockBytes(job.layer), slabs_.data(slot));
    e = {slot.page, slot.index, epoch};
    AddBlockUse(s, job.layer, epoch);
    if (coded != nullptr) {
      // In block order, layers in order within a block: the refresher counts tokens at layer
      // 0 and checks its trigger once the last layer is in.
      BlockObservation& o = observed[j];
      o.layer = job.layer;
      o.tokens = config_.block_size;
      refresher_->Observe(s.stream, std::move(o));  // dropped (and counted) when it is behind
    }
  }
  s.next_compress = range.end;
  // After coding, so blocks just coded with a newly installed epoch count.
  Compact(s, kCompactBlocksPerCommit);
  return absl::OkStatus();
}

int64_t TransformKvCache::Compact(Sequence& s, int64_t budget) {
  const size_t max_live = static_cast<size_t>(std::max(s.refresh.max_epochs, 1));
  int64_t moved = 0;
  thread_local std::vector<float> rows;  // [2][n_kv][B][d] as coded
  rows.resize(static_cast<size_t>(2 * v_half_));
  for (int l = 0; l < config_.geometry.n_layers && moved < budget; ++l) {
    std::vector<EpochUse>& live = s.epoch_uses[static_cast<size_t>(l)];
    while (live.size() > max_live && moved < budget) {
      // Ids are reused; `live` lists epochs in the order the sequence first used them.
      int32_t oldest = -1;
      for (const EpochUse& u : live) {
        if (u.epoch != s.epoch) {
          oldest = u.epoch;
          break;
        }
      }
      if (oldest < 0) break;
      std::vector<Block>& table = s.tables[static_cast<size_t>(l)];
      for (int64_t b = 0; b < static_cast<int64_t>(table.size()) && moved < budget; ++b) {
        Block& e = table[static_cast<size_t>(b)];
        if (e.slot < 0 || e.epoch != oldest) continue;
        uint8_t* codes = slabs_.data({e.page, e.slot});
        for (int side = 0; side < 2; ++side) {
          DecodeRows(oldest, l, codes, b, side == 1, config_.block_size,
                     rows.data() + side * v_half_, /*as_coded=*/true);
        }
        for (int h = 0; h < config_.geometry.n_kv_heads; ++h) {
          EncodeRows(Table(s.epoch, l, false, h), rows.data() + KOffset(h, 0),
                     codes + CodedOffset(s.epoch, l, h, false));
          EncodeRows(Table(s.epoch, l, true, h), rows.data() + VOffset(h, 0),
                     codes + CodedOffset(s.epoch, l, h, true));
        }
        e.epoch = s.epoch;
        AddBlockUse(s, l, s.epoch);
        DropBlockUse(s, l, oldest);  // last: it may retire the old epoch
        ++moved;
      }
    }
  }
  blocks_recoded_ += moved;
  return moved;
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
    DecodeRows(e.epoch, layer, codes, b, side == 1, config_.block_size, rows.data());
    kernels.to_fp16(rows.data(), static_cast<int>(v_half_), FullAt(page, side == 0 ? 0 : v_half_));
  }
  FreeBlock(s, layer, e);
  e = {page, -1};
  return absl::OkStatus();
}

absl::Status TransformKvCache::Truncate(SeqId seq, int64_t length) {
  Sequence* found = seqs_.Find(seq);
  if (found == nullptr) return Sequences::Unknown(seq);
  if (absl::Status st =
          seqs_.Truncate(seq, length, [&](int l, int64_t, Block& e) { FreeBlock(*found, l, e); });
      !st.ok()) {
    return st;
  }
  Sequence& s = *found;
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

KvCacheStats TransformKvCache::Stats() const {
  KvCacheStats st = seqs_.Stats(config_.geometry);
  for (const std::unique_ptr<CodeEpoch>& e : epochs_) st.epochs_live += e != nullptr ? 1 : 0;
  if (refresher_ != nullptr) st.refresh = refresher_->Stats();
  st.refresh.installed = refreshes_installed_;
  st.refresh.blocks_reprojected = blocks_recoded_;
  return st;
}

int32_t TransformKvCache::BlockEpoch(SeqId seq, int layer, int64_t block) const {
  const std::vector<Block>* table = seqs_.Table(seq, layer);
  if (table == nullptr || block < 0 || block >= static_cast<int64_t>(table->size())) return -1;
  const Block& e = (*table)[static_cast<size_t>(block)];
  return e.slot >= 0 ? e.epoch : -1;
}

const TransformCodes* TransformKvCache::EpochCodes(int32_t epoch) const {
  if (epoch < 0 || static_cast<size_t>(epoch) >= epochs_.size() ||
      epochs_[static_cast<size_t>(epoch)] == nullptr) {
    return nullptr;
  }
  return &epochs_[static_cast<size_t>(epoch)]->codes;
}

void TransformKvCache::FlushRefresher() {
  if (refresher_ != nullptr) refresher_->Flush();
}

TransformKvCacheDetail TransformKvCache::Detail() const {
  TransformKvCacheDetail d;
  d.pages_full = pool_->num_used(BlockKind::kFull);
  d.pages_coded = pool_->num_used(BlockKind::kCompressed);
  d.coded_slot_bytes = slabs_.slot_bytes_used();
  for (const std::unique_ptr<CodeEpoch>& e : epochs_) d.epochs_live += e != nullptr ? 1 : 0;
  d.refreshes_unplaced = refreshes_unplaced_;
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
