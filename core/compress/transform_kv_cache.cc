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

namespace {

absl::Status CheckCodes(const std::shared_ptr<const std::vector<TransformCode>>& codes,
                        const KvCacheGeometry& g, const char* side) {
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
  }
  return absl::OkStatus();
}

}  // namespace

TransformKvCache::DecodeTable TransformKvCache::DecodeTable::Of(const TransformCode& code) {
  DecodeTable t;
  const int d = code.dim;
  t.base.assign(static_cast<size_t>(d), 0.0f);
  int bit = 0;
  for (int j = 0; j < d; ++j) {
    const ComponentQuantizer& q = code.components[static_cast<size_t>(j)];
    const float* row = code.basis.data() + static_cast<int64_t>(j) * d;
    if (q.bits == 0) {
      for (int i = 0; i < d; ++i) t.base[static_cast<size_t>(i)] += q.offset * row[i];
      continue;
    }
    t.bit_at.push_back(bit);
    t.bits.push_back(q.bits);
    t.offset.push_back(q.offset);
    t.step.push_back(q.step);
    t.basis.insert(t.basis.end(), row, row + d);
    bit += q.bits;
  }
  if (!code.scale.empty()) {
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
  if (absl::Status st = CheckCodes(config.key_codes, g, "key"); !st.ok()) return st;
  if (absl::Status st = CheckCodes(config.value_codes, g, "value"); !st.ok()) return st;
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
        at += config_.block_size * c.BytesPerRow();
        decode_.push_back(DecodeTable::Of(c));
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

void TransformKvCache::DecodeRows(int layer, const uint8_t* codes, int64_t block, bool values,
                                  int valid, float* out) const {
  const int hd = config_.geometry.head_dim;
  const int bs = config_.block_size;
  const cpu::AttentionKernels& kernels = cpu::ActiveAttentionKernels();
  thread_local std::vector<float> coeffs;  // [valid, active] the block's decoded components
  for (int h = 0; h < config_.geometry.n_kv_heads; ++h) {
    const TransformCode& c = values ? ValueCode(layer, h) : KeyCode(layer, h);
    const DecodeTable& table = decode_[static_cast<size_t>(
        (layer * 2 + (values ? 1 : 0)) * config_.geometry.n_kv_heads + h)];
    const int active = static_cast<int>(table.bits.size());
    const uint8_t* rows = codes + CodedOffset(layer, h, values);
    float* dst = out + static_cast<int64_t>(h) * bs * hd;
    // The components of every row, then all rows at once: [valid, active] x [active, d].
    coeffs.resize(static_cast<size_t>(valid) * static_cast<size_t>(active));
    const int64_t row_bytes = c.BytesPerRow();
    for (int t = 0; t < valid; ++t) {
      const uint8_t* row = rows + t * row_bytes;
      float* ct = coeffs.data() + static_cast<size_t>(t) * static_cast<size_t>(active);
      for (int a = 0; a < active; ++a) {
        // A code of at most 8 bits spans at most two bytes, least significant bit first; the
        // second is read only when it is still in the row.
        const int at = table.bit_at[static_cast<size_t>(a)];
        const int64_t byte = at >> 3;
        uint32_t window = row[byte];
        if (byte + 1 < row_bytes) window |= static_cast<uint32_t>(row[byte + 1]) << 8;
        const uint32_t code =
            (window >> (at & 7)) & ((1u << table.bits[static_cast<size_t>(a)]) - 1u);
        ct[a] = table.offset[static_cast<size_t>(a)] +
                static_cast<float>(code) * table.step[static_cast<size_t>(a)];
      }
      std::copy(table.base.begin(), table.base.end(), dst + static_cast<int64_t>(t) * hd);
    }
    if (active > 0) {
      kernels.accumulate(coeffs.data(), valid, cpu::KvRows{table.basis.data()}, active, hd, dst,
                         hd);
    }
    for (int t = 0; t < valid; ++t) {
      float* x = dst + static_cast<int64_t>(t) * hd;
      if (table.inv_scale.empty()) {
        for (int i = 0; i < hd; ++i) x[i] += table.mean[i];
      } else {
        for (int i = 0; i < hd; ++i)
          x[i] = x[i] * table.inv_scale[static_cast<size_t>(i)] + table.mean[i];
      }
    }
    if (!values && key_unrope_.has_value()) RotateKeys(dst, valid, block * bs);
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

// A layer's blocks for AttendPagedBlocks: full pages widened from fp16 (O(d) a row, done where
// they are read), coded blocks decoded beforehand, once per call: decoding a row costs O(d^2)
// (the basis), and a prefill chunk's every query reads every block.
class TransformKvCache::RowSource final : public BlockRowSource {
 public:
  // The coded blocks of one sequence this call reads, decoded: block b's K rows at
  // decoded[offset + (b - first) * 2 * v_half], its V rows v_half after them.
  struct Decoded {
    SeqId seq = -1;
    int64_t first = 0, end = 0;
    size_t offset = 0;
  };

  RowSource(const TransformKvCache& cache, int layer, std::span<const AttentionRequest> requests)
      : cache_(cache), layer_(layer) {
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
      floats += static_cast<size_t>((seqs_[i].end - seqs_[i].first) * 2 * cache_.v_half_);
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
      const uint8_t* codes = cache_.slabs_.data({e.page, e.slot});
      float* dst = BlockRows(seqs_[i], b);
      cache_.DecodeRows(layer_, codes, b, /*values=*/false, bs, dst);
      cache_.DecodeRows(layer_, codes, b, /*values=*/true, bs, dst + cache_.v_half_);
    }
  }

  const float* Rows(SeqId seq, int64_t block, bool values, int valid,
                    float* scratch) const override {
    const Block& e = Table(seq)[static_cast<size_t>(block)];
    if (e.slot >= 0) {
      return BlockRows(*Find(seq), block) + (values ? cache_.v_half_ : 0);
    }
    const KvCacheGeometry& g = cache_.config_.geometry;
    const int bs = cache_.config_.block_size;
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const int64_t at = values ? cache_.VOffset(h, 0) : cache_.KOffset(h, 0);
      const uint16_t* src = cache_.FullAt(e.page, at);
      float* dst = scratch + static_cast<int64_t>(h) * bs * g.head_dim;
      for (int64_t i = 0; i < static_cast<int64_t>(valid) * g.head_dim; ++i) {
        dst[i] = HalfToFloat(src[i]);
      }
    }
    return scratch;
  }
  bool NeedsScratch() const override { return true; }

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
  float* BlockRows(const Decoded& d, int64_t b) const {
    return decoded_ + d.offset + static_cast<size_t>((b - d.first) * 2 * cache_.v_half_);
  }

  const TransformKvCache& cache_;
  int layer_;
  std::vector<Decoded> seqs_;
  float* decoded_ = nullptr;  // the constructing thread's buffer, valid for this call
};

void TransformKvCache::Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) {
  assert(layer >= 0 && layer < config_.geometry.n_layers);
  const RowSource rows(*this, layer, requests);
  AttendPagedBlocks(config_.geometry, config_.block_size, requests, n_heads, rows);
}

void TransformKvCache::CodeBlock(Sequence& s, int layer, int64_t b) {
  const int hd = config_.geometry.head_dim;
  const int n_kv = config_.geometry.n_kv_heads;
  const int bs = config_.block_size;
  Block& e = s.tables[static_cast<size_t>(layer)][static_cast<size_t>(b)];
  assert(e.slot < 0);
  thread_local std::vector<float> full;  // [2, n_kv, B, hd] widened to fp32
  full.resize(static_cast<size_t>(2 * v_half_));
  const uint16_t* page = FullAt(e.page, 0);
  for (int64_t i = 0; i < 2 * v_half_; ++i) full[static_cast<size_t>(i)] = HalfToFloat(page[i]);
  if (key_unrope_.has_value()) {
    EnsureRopeTable((b + 1) * bs);  // the positions decoding will rotate forward
    thread_local std::vector<int64_t> negated;
    negated.resize(static_cast<size_t>(bs));
    for (int t = 0; t < bs; ++t) negated[static_cast<size_t>(t)] = -(b * bs + t);
    for (int h = 0; h < n_kv; ++h) {
      cpu::Rope(full.data() + KOffset(h, 0), bs, 1, hd, *key_unrope_, negated.data());
    }
  }
  pool_->Free(e.page);  // before the slot: coding never needs a free page
  const SlabAllocator::Slot slot = slabs_.Allocate(slab_class_[static_cast<size_t>(layer)]);
  assert(slot.page >= 0);
  uint8_t* base = slabs_.data(slot);
  for (int h = 0; h < n_kv; ++h) {
    const TransformCode& kc = KeyCode(layer, h);
    const TransformCode& vc = ValueCode(layer, h);
    uint8_t* k_rows = base + CodedOffset(layer, h, false);
    uint8_t* v_rows = base + CodedOffset(layer, h, true);
    for (int t = 0; t < bs; ++t) {
      kc.Encode(full.data() + KOffset(h, t), k_rows + t * kc.BytesPerRow());
      vc.Encode(full.data() + VOffset(h, t), v_rows + t * vc.BytesPerRow());
    }
  }
  e = {slot.page, slot.index};
}

absl::Status TransformKvCache::Commit(SeqId seq, int64_t length) {
  if (absl::Status st = seqs_.Commit(seq, length); !st.ok()) return st;
  Sequence& s = *seqs_.Find(seq);
  const BlockRange range = policy_.CompressibleBlocks(s.next_compress, length, config_.block_size);
  if (range.empty()) return absl::OkStatus();
  const int n_layers = config_.geometry.n_layers;
  for (int64_t b = range.begin; b < range.end; ++b) {
    for (int l = 0; l < n_layers; ++l) {
      if (s.tables[static_cast<size_t>(l)][static_cast<size_t>(b)].slot < 0) CodeBlock(s, l, b);
    }
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
