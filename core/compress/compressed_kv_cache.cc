// CompressedKvCache: storage, policy and epochs (attention: compressed_kv_cache_attention.cc).
//
// Pool layout. One BlockPool of equal pages, sized once from capacity_bytes; a page is exactly
// one full block [2][n_kv][B][hd] at full_dtype (fp16 by default, as the GPU layout; fp32 for
// exactness tests). Full blocks (sinks, window) and outlier blocks take a page each.
// Compressed blocks are smaller and are packed several per page by a SlabAllocator
// (one slot class per distinct compressed-block size, shared by layers of equal ranks): a page
// holds floor(page / slot) of them (<= 64), goes back to the pool when its last slot is freed,
// and so both kinds draw from the one budget. Fragmentation: the page tail (page mod slot,
// e.g. 0 for fp16 coefficients at r = d/4, 4 slots to an fp16 page; int8 at d/4 packs 7 to an
// fp16 page, leaving 4/256 of it at d = 64 and 36/512 at d = 128) and partly used pages left by
// frees in the middle (freeing a sequence frees all its slots; at most one partial page per
// class accumulates from allocation alone). The per-block epoch ids ([n_kv] int32) and the
// outlier mask live in the host-side block table beside the page id, as the page id does.
//
// Policy, at Commit: blocks overlapping the first S tokens stay full; a block is compressed
// when it lies entirely before length - W, with the sequence's current epoch; its page is
// freed before the slot is taken, so compression never needs a free page. Tokens whose key
// residual exceeds the threshold are copied (all KV heads) into the sequence's outlier pages
// and masked out of the compressed block. Within one step, attention runs before Commit, so
// a prefill chunk longer than W sees its own early tokens full-rank; they are compressed only
// for later steps. That is causal and deterministic, but a prompt split into different chunks
// attends differently at rank < d.
//
// Epoch 0 (self-calibration). Until the calibration tool's basis file exists, the first
// sequence that compresses with no default epoch set builds one by PCA of its own keys and
// values (Gram matrices by dsyrk over at most ~kPcaMaxTokens tokens, then LAPACK per layer x
// KV head, in parallel) and installs it as the default: every later sequence, and any created
// earlier that has not compressed yet, uses it without an eigendecomposition. That one build
// runs on the engine thread (~7 ms for 6 layers x 2 heads x d=64, ~0.4 s for 32 x 8 x 128;
// bench/attention_bench.cc); per-sequence PCA made every sequence pay it. A default set
// explicitly (SetDefaultEpoch) replaces the self-calibrated one for new sequences.
#include "core/compress/compressed_kv_cache.h"

#include <algorithm>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/base/pca.h"
#include "core/cpu/attention_kernels.h"

namespace subspace {

namespace {

// Compactor work per Commit of a sequence, in block-heads (O(B r^2) each: ~4k flops at B = 16,
// r = 16), so that catching up after a refresh is spread over steps.
constexpr int64_t kCompactBlockHeadsPerCommit = 64;

inline float Dot(const float* __restrict a, const float* __restrict b, int n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void Axpy(float p, const float* __restrict x, float* __restrict acc, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) acc[i] += p * x[i];
}

// out[j] = sum_i m[i, j] x[i].  m: [rows, cols]; x: [rows]; out: [cols]
inline void MatTVec(const float* m, const float* x, int rows, int cols, float* out) {
  std::fill(out, out + cols, 0.0f);
  for (int i = 0; i < rows; ++i) Axpy(x[i], m + static_cast<int64_t>(i) * cols, out, cols);
}

}  // namespace

int64_t CompressedKvCache::PageBytes(const KvCacheGeometry& g, int block_size,
                                     CoeffDtype full_dtype) {
  return 2 * static_cast<int64_t>(g.n_kv_heads) * CodeBytes(full_dtype, block_size * g.head_dim);
}

int64_t CompressedKvCache::CompressedBlockBytes(const KvCacheGeometry& g, int block_size, int r_k,
                                                int r_v, CoeffDtype dtype) {
  const int64_t rows = static_cast<int64_t>(g.n_kv_heads) * block_size;
  return rows * CodeBytes(dtype, r_k + r_v) + 2 * rows * ScaleBytes(dtype);
}

absl::StatusOr<std::unique_ptr<CompressedKvCache>> CompressedKvCache::Create(
    const CompressedKvCacheConfig& config) {
  const KvCacheGeometry& g = config.geometry;
  if (absl::Status st =
          ValidateCompressedCacheSetup(g, config.block_size, config.refresh, config.n_query_heads,
                                       "kqsvd refresh needs n_query_heads");
      !st.ok()) {
    return st;
  }
  absl::StatusOr<CompressionPolicy> policy = ResolvePolicy(config.policy, g);
  if (!policy.ok()) return policy.status();
  const std::vector<int>* r_k = &policy->r_k;
  const std::vector<int>* r_v = &policy->r_v;
  if (config.full_dtype != CoeffDtype::kFp32 && config.full_dtype != CoeffDtype::kFp16) {
    return absl::InvalidArgumentError(absl::StrFormat("full_dtype must be fp32 or fp16, got %s",
                                                      CoeffDtypeName(config.full_dtype)));
  }
  const int64_t page_bytes = PageBytes(g, config.block_size, config.full_dtype);
  for (int l = 0; l < g.n_layers; ++l) {
    // The fp16 scales follow the codes: int4 codes must end on a 2-byte boundary.
    const int64_t rows = static_cast<int64_t>(g.n_kv_heads) * config.block_size;
    if (config.policy.coeff_dtype == CoeffDtype::kInt4 && rows * ((*r_k)[l] + (*r_v)[l]) % 4 != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer %d: int4 coefficients need n_kv_heads x block_size x (r_k + r_v) divisible by "
          "4, got %d x %d x %d",
          l, g.n_kv_heads, config.block_size, (*r_k)[l] + (*r_v)[l]));
    }
    // The slab allocator rounds slots up to 16 bytes and needs one to fit in a page.
    const int64_t slot = CeilDiv(CompressedBlockBytes(g, config.block_size, (*r_k)[l], (*r_v)[l],
                                                      config.policy.coeff_dtype),
                                 16) *
                         16;
    if (slot > page_bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer %d: a %s compressed block at ranks (%d, %d) takes %d bytes, more than a %s full "
          "block (%d); lower the ranks or use fp32 full blocks",
          l, CoeffDtypeName(config.policy.coeff_dtype), (*r_k)[l], (*r_v)[l], slot,
          CoeffDtypeName(config.full_dtype), page_bytes));
    }
  }
  absl::StatusOr<int64_t> num_pages =
      BlocksForCapacity(config.capacity_bytes, page_bytes, g.n_layers);
  if (!num_pages.ok()) return num_pages.status();
  absl::StatusOr<std::unique_ptr<BlockPool>> pool =
      BlockPool::Create(page_bytes / static_cast<int64_t>(sizeof(float)), *num_pages);
  if (!pool.ok()) return pool.status();
  CompressedKvCacheConfig resolved = config;
  resolved.policy = *std::move(policy);
  return std::unique_ptr<CompressedKvCache>(new CompressedKvCache(resolved, *std::move(pool)));
}

CompressedKvCache::CompressedKvCache(const CompressedKvCacheConfig& config,
                                     std::unique_ptr<BlockPool> pool)
    : config_(config),
      r_k_(config.policy.r_k),
      r_v_(config.policy.r_v),
      v_half_(static_cast<int64_t>(config.geometry.n_kv_heads) * config.block_size *
              config.geometry.head_dim),
      full_bytes_(CodeBytes(config.full_dtype, 1)),
      pool_(std::move(pool)),
      slabs_(pool_.get(), BlockKind::kCompressed),
      epochs_({.geometry = config.geometry,
               .policy = config.policy,
               .n_query_heads = config.n_query_heads,
               .refresher = {.inline_mode = config.refresh_inline,
                             .max_queued_bytes = config.refresh_queue_bytes}}),
      seqs_({.n_layers = config.geometry.n_layers,
             .block_size = config.block_size,
             .block_bytes = pool_->block_bytes()},
            pool_.get()),
      page_scratch_(static_cast<size_t>(2 * v_half_)) {
  std::vector<std::pair<int64_t, int>> classes;  // slot bytes -> class
  for (int l = 0; l < config_.geometry.n_layers; ++l) {
    const int64_t bytes = CompressedBlockBytes(config_.geometry, config_.block_size, r_k_[l],
                                               r_v_[l], config_.policy.coeff_dtype);
    int cls = -1;
    for (const auto& [b, c] : classes) {
      if (b == bytes) cls = c;
    }
    if (cls < 0) {
      cls = slabs_.AddClass(bytes);
      assert(cls >= 0);  // Create checked that a slot fits in a page
      classes.emplace_back(bytes, cls);
    }
    slab_class_.push_back(cls);
  }
  if (config_.refresh.method != RefreshMethod::kNone) epochs_.EnsureRefresher();
}

absl::StatusOr<SeqId> CompressedKvCache::CreateSequence() {
  absl::StatusOr<SeqId> id = seqs_.Create();
  if (!id.ok()) return id;
  Sequence& s = seqs_[*id];
  if (s.layers.empty()) {  // a new slot; a recycled one was cleared by FreeSequence
    s.layers.resize(static_cast<size_t>(config_.geometry.n_layers));
    for (LayerState& ls : s.layers) {
      ls.block_epochs.reserve(64 * static_cast<size_t>(config_.geometry.n_kv_heads));
    }
  }
  epochs_.StartSequence(s, config_.refresh);
  return id;
}

void CompressedKvCache::AddEpochUse(LayerState& ls, int layer, EpochId id) {
  for (LiveEpoch& e : ls.live) {
    if (e.id == id) {
      ++e.uses;
      return;
    }
  }
  ls.live.push_back({id, &epochs_.Get(id)->layers[static_cast<size_t>(layer)], 1});
}

void CompressedKvCache::DropEpochUse(LayerState& ls, EpochId id) {
  for (size_t i = 0; i < ls.live.size(); ++i) {
    if (ls.live[i].id == id && --ls.live[i].uses == 0) {
      ls.live.erase(ls.live.begin() + static_cast<int64_t>(i));
      return;
    }
  }
}

void CompressedKvCache::FreeEntry(LayerState& ls, int64_t b, BlockEntry& e) {
  if (e.slot < 0) {
    pool_->Free(e.page);
  } else {
    slabs_.Free({e.page, e.slot});
    const int n_kv = config_.geometry.n_kv_heads;
    for (int h = 0; h < n_kv; ++h) {
      EpochId& id = ls.block_epochs[static_cast<size_t>(b * n_kv + h)];
      DropEpochUse(ls, id);
      epochs_.Release(id);
      id = kNoEpoch;
    }
  }
  e = BlockEntry{};
}

absl::Status CompressedKvCache::FreeSequence(SeqId seq) {
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  seqs_.ReleaseBlocksPast(*s, 0, [&](int l, int64_t b, BlockEntry& e) {
    FreeEntry(s->layers[static_cast<size_t>(l)], b, e);
  });
  for (LayerState& ls : s->layers) {
    for (int32_t p : ls.outlier_pages) pool_->Free(p);
    ls.block_epochs.clear();
    ls.live.clear();
    ls.outlier_pos.clear();
    ls.outlier_pages.clear();
  }
  epochs_.EndSequence(*s);
  seqs_.Remove(seq);
  return absl::OkStatus();
}

int64_t CompressedKvCache::Length(SeqId seq) const { return seqs_.Length(seq); }

int64_t CompressedKvCache::BlocksNeeded(SeqId seq, int64_t n) const {
  return seqs_.BlocksNeeded(seq, n);
}

absl::Status CompressedKvCache::Reserve(SeqId seq, int64_t n) {
  if (absl::Status st = seqs_.Reserve(seq, n); !st.ok()) return st;
  Sequence& s = *seqs_.Find(seq);
  const size_t n_kv = static_cast<size_t>(config_.geometry.n_kv_heads);
  for (LayerState& ls : s.layers)
    ls.block_epochs.resize(static_cast<size_t>(s.blocks()) * n_kv, kNoEpoch);
  return absl::OkStatus();
}

void CompressedKvCache::Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k,
                              const float* v) {
  Sequence* s = seqs_.Find(seq);
  assert(s != nullptr && layer >= 0 && layer < config_.geometry.n_layers);
  assert(pos >= 0 && pos + n <= s->blocks() * config_.block_size && "write past the reservation");
  const std::vector<BlockEntry>& table = s->tables[static_cast<size_t>(layer)];
  const int hd = config_.geometry.head_dim;
  const int n_kv = config_.geometry.n_kv_heads;
  const int bs = config_.block_size;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = pos + i;
    const BlockEntry& e = table[static_cast<size_t>(t / bs)];
    assert(e.slot < 0 && "write into a compressed block");
    const int64_t slot = t % bs;
    const float* k_row = k + i * n_kv * hd;  // [n_kv_heads, head_dim]
    const float* v_row = v + i * n_kv * hd;
    for (int h = 0; h < n_kv; ++h) {
      StoreFull(k_row + static_cast<int64_t>(h) * hd, hd, FullAt(e.page, KOffset(h, slot)));
      StoreFull(v_row + static_cast<int64_t>(h) * hd, hd, FullAt(e.page, VOffset(h, slot)));
    }
  }
}

void CompressedKvCache::StoreFull(const float* src, int64_t n, uint8_t* dst) const {
  if (config_.full_dtype == CoeffDtype::kFp32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else {
    cpu::ActiveAttentionKernels().to_fp16(src, static_cast<int>(n),
                                          reinterpret_cast<uint16_t*>(dst));
  }
}

void CompressedKvCache::LoadFull(const uint8_t* src, int64_t n, float* dst) const {
  if (config_.full_dtype == CoeffDtype::kFp32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else {
    const auto* h = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(h[i]);
  }
}

std::shared_ptr<const Basis> CompressedKvCache::PcaOfSequence(const Sequence& s) const {
  // Grams of the committed full-rank keys and values of the blocks CompressionPolicy samples
  // (every block up to ~kPcaMaxTokens tokens, then evenly spaced ones: well above d, and it
  // bounds the dsyrk work of a long first prompt); the device cache samples the same blocks.
  const KvCacheGeometry& g = config_.geometry;
  const int hd = g.head_dim, n_kv = g.n_kv_heads, bs = config_.block_size;
  const size_t dd = static_cast<size_t>(hd) * hd;
  const int64_t stride = CompressionPolicy::PcaBlockStride(s.length, bs);
  const int64_t blocks = CeilDiv(s.length, bs);
  std::vector<std::vector<double>> gk(static_cast<size_t>(g.n_layers)), gv(gk.size());
  for (int l = 0; l < g.n_layers; ++l) {
    gk[static_cast<size_t>(l)].assign(static_cast<size_t>(n_kv) * dd, 0.0);
    gv[static_cast<size_t>(l)].assign(static_cast<size_t>(n_kv) * dd, 0.0);
  }
  UseSingleThreadedBlas();
  const int64_t items = static_cast<int64_t>(g.n_layers) * n_kv * 2;  // (layer, head, K or V)
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int l = static_cast<int>(item / (2 * n_kv));
    const int h = static_cast<int>(item / 2 % n_kv);
    const bool keys = item % 2 == 0;
    const std::vector<BlockEntry>& table = s.tables[static_cast<size_t>(l)];
    thread_local std::vector<double> rows;  // [sampled tokens, hd]
    thread_local std::vector<float> x;      // [hd] one row widened from full_dtype
    rows.clear();
    x.resize(static_cast<size_t>(hd));
    for (int64_t b = 0; b < blocks; b += stride) {
      const BlockEntry& e = table[static_cast<size_t>(b)];
      if (e.slot >= 0) continue;
      for (int64_t t = 0; t < std::min<int64_t>(bs, s.length - b * bs); ++t) {
        LoadFull(FullAt(e.page, keys ? KOffset(h, t) : VOffset(h, t)), hd, x.data());
        rows.insert(rows.end(), x.begin(), x.end());
      }
    }
    double* gram = (keys ? gk : gv)[static_cast<size_t>(l)].data() + static_cast<size_t>(h) * dd;
    GramOfRows(rows.data(), static_cast<int64_t>(rows.size()) / hd, hd, gram);
  }
  return std::make_shared<Basis>(PcaBasis(g, r_k_, r_v_, gk, gv));
}

void CompressedKvCache::CompressBlock(Sequence& s, int layer, int64_t b) {
  const KvCacheGeometry& g = config_.geometry;
  const int hd = g.head_dim, n_kv = g.n_kv_heads, bs = config_.block_size;
  const int rk = r_k_[static_cast<size_t>(layer)], rv = r_v_[static_cast<size_t>(layer)];
  const CoeffDtype dt = config_.policy.coeff_dtype;
  LayerState& ls = s.layers[static_cast<size_t>(layer)];
  BlockEntry& e = s.tables[static_cast<size_t>(layer)][static_cast<size_t>(b)];
  assert(e.slot < 0);
  const LayerBasis& basis = epochs_.Get(s.epoch)->layers[static_cast<size_t>(layer)];

  float* full = page_scratch_.data();  // [2, n_kv, B, hd] widened to fp32
  LoadFull(FullAt(e.page, 0), 2 * v_half_, full);
  pool_->Free(e.page);  // before the slot: compression never needs a free page
  const SlabAllocator::Slot slot = slabs_.Allocate(slab_class_[static_cast<size_t>(layer)]);
  assert(slot.page >= 0);
  uint8_t* base = slabs_.data(slot);
  const int64_t rows = static_cast<int64_t>(n_kv) * bs;
  uint8_t* k_codes = base;                                // [n_kv, B, r_k]
  uint8_t* v_codes = k_codes + CodeBytes(dt, rows * rk);  // [n_kv, B, r_v]
  auto* k_scales = reinterpret_cast<uint16_t*>(v_codes + CodeBytes(dt, rows * rv));  // [n_kv, B]
  uint16_t* v_scales = k_scales + rows;                                              // [n_kv, B]

  // The key residual (B r d flops per head, as much as the coding itself) feeds outlier
  // detection, the refresher's residual trigger and the residual-energy ratio in Detail.
  double residual = 0.0, energy = 0.0;
  uint64_t outliers = 0;
  const cpu::AttentionKernels& kernels = cpu::ActiveAttentionKernels();
  thread_local std::vector<float> coeff;
  coeff.resize(static_cast<size_t>(bs) * (rk + rv + hd));
  float* ck = coeff.data();                          // [B, r_k]
  float* cv = ck + static_cast<size_t>(bs) * rk;     // [B, r_v]
  float* recon = cv + static_cast<size_t>(bs) * rv;  // [B, d]
  for (int h = 0; h < n_kv; ++h) {
    const float* pq = basis.p_q.data() + static_cast<size_t>(h) * hd * rk;  // [d, r_k]
    const float* pk = basis.p_k.data() + static_cast<size_t>(h) * hd * rk;  // [d, r_k]
    const float* pv = basis.p_v.data() + static_cast<size_t>(h) * hd * rv;  // [d, r_v]
    // The whole block at once: C = K P_k is the accumulation kernel with the B key rows as
    // weights over the d rows of P_k.
    std::fill(ck, ck + static_cast<size_t>(bs) * (rk + rv), 0.0f);
    kernels.accumulate(full + KOffset(h, 0), bs, cpu::KvRows{pk}, hd, rk, ck, rk);
    kernels.accumulate(full + VOffset(h, 0), bs, cpu::KvRows{pv}, hd, rv, cv, rv);
    // The keys as queries will see them: k^ = P_q c (= P P^T k for orthogonal bases).
    kernels.scores(ck, rk, bs, cpu::KvRows{pq}, hd, rk, 1.0f, recon);
    for (int t = 0; t < bs; ++t) {
      const int64_t row = static_cast<int64_t>(h) * bs + t;
      const float* k = full + KOffset(h, t);
      const float* kr = recon + static_cast<size_t>(t) * hd;
      double err = 0.0, norm = 0.0;
      for (int i = 0; i < hd; ++i) {
        err += static_cast<double>(k[i] - kr[i]) * (k[i] - kr[i]);
        norm += static_cast<double>(k[i]) * k[i];
      }
      residual += err;
      energy += norm;
      if (config_.policy.IsOutlier(err, norm)) {
        outliers |= uint64_t{1} << t;
      }
      EncodeCoeffs(dt, ck + static_cast<size_t>(t) * rk, rk, k_codes + CodeBytes(dt, row * rk),
                   k_scales + row);
      EncodeCoeffs(dt, cv + static_cast<size_t>(t) * rv, rv, v_codes + CodeBytes(dt, row * rv),
                   v_scales + row);
    }
  }
  // Outlier tokens (all heads) move to the outlier pages, in position order.
  for (int t = 0; t < bs; ++t) {
    if (!((outliers >> t) & 1u)) continue;
    const int64_t j = static_cast<int64_t>(ls.outlier_pos.size());
    if (j % bs == 0) {
      const int32_t page = pool_->Allocate(BlockKind::kOutlier);
      if (page < 0) {  // no page: the token stays compressed
        outliers &= ~(uint64_t{1} << t);
        ++outliers_dropped_;
        continue;
      }
      ls.outlier_pages.push_back(page);
    }
    // Widened from full_dtype and narrowed back: the stored bits, unchanged.
    const int32_t dst = ls.outlier_pages[static_cast<size_t>(j / bs)];
    for (int h = 0; h < n_kv; ++h) {
      StoreFull(full + KOffset(h, t), hd, FullAt(dst, KOffset(h, j % bs)));
      StoreFull(full + VOffset(h, t), hd, FullAt(dst, VOffset(h, j % bs)));
    }
    ls.outlier_pos.push_back(b * bs + t);
  }
  e = BlockEntry{slot.page, slot.index, outliers};
  for (int h = 0; h < n_kv; ++h) {
    ls.block_epochs[static_cast<size_t>(b * n_kv + h)] = s.epoch;
    (void)epochs_.Acquire(s.epoch);
    AddEpochUse(ls, layer, s.epoch);
  }
  key_residual_sum_ += residual;
  key_energy_sum_ += energy;
  if (s.stream != 0) ObserveBlock(s, layer, full, residual, energy);
}

absl::Status CompressedKvCache::Commit(SeqId seq, int64_t length) {
  if (absl::Status st = seqs_.Commit(seq, length); !st.ok()) return st;
  Sequence* s = seqs_.Find(seq);
  const int bs = config_.block_size;
  const Refresher* refresher = epochs_.refresher();
  if (refresher != nullptr && refresher->has_published()) InstallPublishedEpochs();
  const BlockRange range = config_.policy.CompressibleBlocks(s->next_compress, length, bs);
  if (!range.empty()) {
    if (absl::Status st = epochs_.EnsureEpoch(*s, [&] { return PcaOfSequence(*s); }); !st.ok()) {
      return st;
    }
    epochs_.OpenStream(*s, seq);
    for (int64_t b = range.begin; b < range.end; ++b) {
      for (int l = 0; l < config_.geometry.n_layers; ++l) {
        if (s->tables[static_cast<size_t>(l)][static_cast<size_t>(b)].slot < 0)
          CompressBlock(*s, l, b);
      }
    }
    s->next_compress = range.end;
  }
  // After compressing, so that blocks just coded with a newly installed epoch count.
  if (s->refresh.method != RefreshMethod::kNone) Compact(*s, kCompactBlockHeadsPerCommit);
  return absl::OkStatus();
}

absl::Status CompressedKvCache::Decompress(Sequence& s, int layer, int64_t b) {
  const KvCacheGeometry& g = config_.geometry;
  const int hd = g.head_dim, n_kv = g.n_kv_heads, bs = config_.block_size;
  const int rk = r_k_[static_cast<size_t>(layer)], rv = r_v_[static_cast<size_t>(layer)];
  const CoeffDtype dt = config_.policy.coeff_dtype;
  LayerState& ls = s.layers[static_cast<size_t>(layer)];
  BlockEntry& e = s.tables[static_cast<size_t>(layer)][static_cast<size_t>(b)];
  float* full = page_scratch_.data();
  const uint8_t* base = slabs_.data({e.page, e.slot});
  const int64_t rows = static_cast<int64_t>(n_kv) * bs;
  const uint8_t* k_codes = base;
  const uint8_t* v_codes = k_codes + CodeBytes(dt, rows * rk);
  const auto* k_scales = reinterpret_cast<const uint16_t*>(v_codes + CodeBytes(dt, rows * rv));
  const uint16_t* v_scales = k_scales + rows;
  std::vector<float> c(static_cast<size_t>(std::max(rk, rv)));
  for (int h = 0; h < n_kv; ++h) {
    const LayerBasis& basis = epochs_.Get(ls.block_epochs[static_cast<size_t>(b * n_kv + h)])
                                  ->layers[static_cast<size_t>(layer)];
    const float* pq = basis.p_q.data() + static_cast<size_t>(h) * hd * rk;   // [d, r_k]
    const float* rvm = basis.r_v.data() + static_cast<size_t>(h) * rv * hd;  // [r_v, d]
    for (int t = 0; t < bs; ++t) {
      const int64_t row = static_cast<int64_t>(h) * bs + t;
      DecodeCoeffs(dt, k_codes + CodeBytes(dt, row * rk), k_scales + row, rk, c.data());
      float* k = full + KOffset(h, t);
      for (int i = 0; i < hd; ++i) k[i] = Dot(pq + static_cast<int64_t>(i) * rk, c.data(), rk);
      DecodeCoeffs(dt, v_codes + CodeBytes(dt, row * rv), v_scales + row, rv, c.data());
      MatTVec(rvm, c.data(), rv, hd, full + VOffset(h, t));
    }
  }
  // Outliers of this block (the last ones in the store) go back in place.
  while (!ls.outlier_pos.empty() && ls.outlier_pos.back() >= b * bs) {
    const int64_t j = static_cast<int64_t>(ls.outlier_pos.size()) - 1;
    const int t = static_cast<int>(ls.outlier_pos.back() - b * bs);
    const int32_t src = ls.outlier_pages[static_cast<size_t>(j / bs)];
    for (int h = 0; h < n_kv; ++h) {
      LoadFull(FullAt(src, KOffset(h, j % bs)), hd, full + KOffset(h, t));
      LoadFull(FullAt(src, VOffset(h, j % bs)), hd, full + VOffset(h, t));
    }
    ls.outlier_pos.pop_back();
    if (j % bs == 0) {
      pool_->Free(ls.outlier_pages.back());
      ls.outlier_pages.pop_back();
    }
  }
  FreeEntry(ls, b, e);
  const int32_t page = pool_->Allocate(BlockKind::kFull);
  if (page < 0)
    return absl::ResourceExhaustedError("no page to expand a truncated compressed block");
  StoreFull(full, 2 * v_half_, FullAt(page, 0));  // k^, v^ rounded to full_dtype
  e = {page, -1, 0};
  return absl::OkStatus();
}

absl::Status CompressedKvCache::Truncate(SeqId seq, int64_t length) {
  const int bs = config_.block_size;
  const int n_kv = config_.geometry.n_kv_heads;
  const int64_t keep = CeilDiv(length, int64_t{bs});
  Sequence* s = seqs_.Find(seq);
  if (absl::Status st = seqs_.Truncate(seq, length,
                                       [&](int l, int64_t b, BlockEntry& e) {
                                         FreeEntry(s->layers[static_cast<size_t>(l)], b, e);
                                       });
      !st.ok()) {
    return st;
  }
  for (LayerState& ls : s->layers) {
    ls.block_epochs.resize(static_cast<size_t>(keep * n_kv));
    while (!ls.outlier_pos.empty() && ls.outlier_pos.back() >= length) ls.outlier_pos.pop_back();
    while (static_cast<int64_t>(ls.outlier_pages.size()) >
           CeilDiv(static_cast<int64_t>(ls.outlier_pos.size()), bs)) {
      pool_->Free(ls.outlier_pages.back());
      ls.outlier_pages.pop_back();
    }
  }
  if (length % bs != 0 && keep > 0) {
    for (int l = 0; l < config_.geometry.n_layers; ++l) {
      if (s->tables[static_cast<size_t>(l)][static_cast<size_t>(keep - 1)].slot < 0) continue;
      if (absl::Status st = Decompress(*s, l, keep - 1); !st.ok()) return st;
    }
    s->next_compress = std::min(s->next_compress, keep - 1);
  } else {
    s->next_compress = std::min(s->next_compress, keep);
  }
  return absl::OkStatus();
}

KvCacheStats CompressedKvCache::Stats() const {
  KvCacheStats st = seqs_.Stats(config_.geometry);
  st.epochs_live = epochs_.registry().live();
  if (epochs_.refresher() != nullptr) st.refresh = epochs_.refresher()->Stats();
  st.refresh.installed = refreshes_installed_;
  st.refresh.blocks_reprojected = blocks_reprojected_;
  return st;
}

CompressedKvCacheDetail CompressedKvCache::Detail() const {
  CompressedKvCacheDetail d;
  d.pages_full = pool_->num_used(BlockKind::kFull);
  d.pages_compressed = pool_->num_used(BlockKind::kCompressed);
  d.pages_outlier = pool_->num_used(BlockKind::kOutlier);
  d.compressed_slot_bytes = slabs_.slot_bytes_used();
  for (const Sequence& s : seqs_.all()) {
    if (!s.live) continue;
    for (const std::vector<BlockEntry>& table : s.tables) {
      for (const BlockEntry& e : table) d.blocks_compressed += e.slot >= 0 ? 1 : 0;
    }
    for (const LayerState& ls : s.layers) {
      d.max_sequence_epochs =
          std::max<int64_t>(d.max_sequence_epochs, static_cast<int64_t>(ls.live.size()));
      d.outlier_tokens += static_cast<int64_t>(ls.outlier_pos.size());
    }
  }
  d.outliers_dropped = outliers_dropped_;
  d.key_residual_energy = key_residual_sum_;
  d.key_energy = key_energy_sum_;
  d.epochs_live = epochs_.registry().live();
  d.pca_epochs_built = epochs_.pca_epochs_built();
  d.default_self_calibrated = epochs_.default_self_calibrated();
  return d;
}

absl::StatusOr<EpochId> CompressedKvCache::InstallBasis(std::shared_ptr<const Basis> basis) {
  return epochs_.Install(std::move(basis));
}

absl::Status CompressedKvCache::ReleaseEpoch(EpochId id) { return epochs_.ReleaseChecked(id); }

absl::Status CompressedKvCache::SetSequenceEpoch(SeqId seq, EpochId id) {
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  return epochs_.SetSequenceEpoch(*s, id);
}

absl::Status CompressedKvCache::SetDefaultEpoch(EpochId id) { return epochs_.SetDefault(id); }

EpochId CompressedKvCache::SequenceEpoch(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  return s == nullptr ? kNoEpoch : s->epoch;
}

bool CompressedKvCache::IsCompressed(SeqId seq, int layer, int64_t block) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr || layer < 0 || layer >= config_.geometry.n_layers) return false;
  const std::vector<BlockEntry>& table = s->tables[static_cast<size_t>(layer)];
  return block >= 0 && block < static_cast<int64_t>(table.size()) &&
         table[static_cast<size_t>(block)].slot >= 0;
}

EpochId CompressedKvCache::BlockEpoch(SeqId seq, int layer, int64_t block, int kv_head) const {
  if (!IsCompressed(seq, layer, block)) return kNoEpoch;
  return seqs_.Find(seq)
      ->layers[static_cast<size_t>(layer)]
      .block_epochs[static_cast<size_t>(block * config_.geometry.n_kv_heads + kv_head)];
}

std::span<const int64_t> CompressedKvCache::OutlierPositions(SeqId seq, int layer) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr || layer < 0 || layer >= config_.geometry.n_layers) return {};
  return s->layers[static_cast<size_t>(layer)].outlier_pos;
}

}  // namespace subspace
