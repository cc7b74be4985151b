// PagedKvCache: bookkeeping of sequences and block tables over a BlockPool, and the CPU
// attention that walks a block table with an online (streaming) softmax, so it needs no
// score buffer sized by the context and allocates nothing per token.
#include "core/paged_kv_cache.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_format.h"

namespace subspace {

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks every sequence table starts with room for, so early decode steps never regrow it.
constexpr size_t kInitialTableCapacity = 64;
// Token counts are capped here before any arithmetic so a hostile `n` cannot overflow; no
// pool holds this many tokens, so the cap never changes an answer.
constexpr int64_t kMaxTokens = int64_t{1} << 48;

// q · k over head_dim floats. q: [head_dim]; k: [head_dim]
inline float Dot(const float* __restrict q, const float* __restrict k, int head_dim) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int d = 0; d < head_dim; ++d) sum += q[d] * k[d];
  return sum;
}

// acc += p * v over head_dim floats. acc, v: [head_dim]
inline void Axpy(float p, const float* __restrict v, float* __restrict acc, int head_dim) {
#pragma omp simd
  for (int d = 0; d < head_dim; ++d) acc[d] += p * v[d];
}

}  // namespace

int64_t PagedKvCache::BlockBytes(const KvCacheGeometry& geometry, int block_size) {
  return 2 * static_cast<int64_t>(geometry.n_kv_heads) * block_size * geometry.head_dim *
         static_cast<int64_t>(sizeof(float));
}

absl::StatusOr<std::unique_ptr<PagedKvCache>> PagedKvCache::Create(const Config& config) {
  const KvCacheGeometry& g = config.geometry;
  if (g.n_layers <= 0 || g.n_kv_heads <= 0 || g.head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("KV cache geometry must be positive: n_layers=%d n_kv_heads=%d head_dim=%d",
                        g.n_layers, g.n_kv_heads, g.head_dim));
  }
  if (config.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("block_size must be positive, got %d", config.block_size));
  }
  const int64_t block_bytes = BlockBytes(g, config.block_size);
  const int64_t num_blocks = config.capacity_bytes / block_bytes;
  if (num_blocks < g.n_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV cache capacity %d bytes holds %d blocks of %d bytes; one token needs %d (one per "
        "layer)",
        config.capacity_bytes, std::max<int64_t>(num_blocks, 0), block_bytes, g.n_layers));
  }
  absl::StatusOr<std::unique_ptr<BlockPool>> pool =
      BlockPool::Create(block_bytes / static_cast<int64_t>(sizeof(float)), num_blocks);
  if (!pool.ok()) return pool.status();
  return std::unique_ptr<PagedKvCache>(new PagedKvCache(config, *std::move(pool)));
}

PagedKvCache::PagedKvCache(const Config& config, std::unique_ptr<BlockPool> pool)
    : geometry_(config.geometry),
      block_size_(config.block_size),
      v_half_(static_cast<int64_t>(config.geometry.n_kv_heads) * config.block_size *
              config.geometry.head_dim),
      pool_(std::move(pool)) {}

PagedKvCache::Sequence* PagedKvCache::Find(SeqId seq) {
  if (seq < 0 || static_cast<size_t>(seq) >= seqs_.size() || !seqs_[seq].live) return nullptr;
  return &seqs_[seq];
}

const PagedKvCache::Sequence* PagedKvCache::Find(SeqId seq) const {
  if (seq < 0 || static_cast<size_t>(seq) >= seqs_.size() || !seqs_[seq].live) return nullptr;
  return &seqs_[seq];
}

absl::StatusOr<SeqId> PagedKvCache::CreateSequence() {
  SeqId id;
  if (!free_seq_ids_.empty()) {
    // A recycled slot keeps its tables' capacity: no allocation for the new sequence.
    id = free_seq_ids_.back();
    free_seq_ids_.pop_back();
  } else {
    if (seqs_.size() >= static_cast<size_t>(std::numeric_limits<SeqId>::max())) {
      return absl::ResourceExhaustedError("too many KV cache sequences");
    }
    id = static_cast<SeqId>(seqs_.size());
    seqs_.emplace_back();
    Sequence& s = seqs_.back();
    s.tables.resize(static_cast<size_t>(geometry_.n_layers));
    for (std::vector<int32_t>& t : s.tables) t.reserve(kInitialTableCapacity);
  }
  Sequence& s = seqs_[id];
  s.live = true;
  s.length = 0;
  ++live_sequences_;
  return id;
}

void PagedKvCache::ReleaseBlocksPast(Sequence& s, int64_t keep) {
  for (std::vector<int32_t>& table : s.tables) {
    for (size_t b = static_cast<size_t>(keep); b < table.size(); ++b) pool_->Free(table[b]);
    if (table.size() > static_cast<size_t>(keep)) table.resize(static_cast<size_t>(keep));
  }
}

absl::Status PagedKvCache::FreeSequence(SeqId seq) {
  Sequence* s = Find(seq);
  if (s == nullptr) return absl::NotFoundError(absl::StrFormat("unknown sequence %d", seq));
  ReleaseBlocksPast(*s, 0);
  tokens_cached_ -= s->length;
  s->length = 0;
  s->live = false;
  free_seq_ids_.push_back(seq);
  --live_sequences_;
  return absl::OkStatus();
}

int64_t PagedKvCache::Length(SeqId seq) const {
  const Sequence* s = Find(seq);
  return s == nullptr ? 0 : s->length;
}

int64_t PagedKvCache::ReservedTokens(SeqId seq) const {
  const Sequence* s = Find(seq);
  return s == nullptr ? 0 : BlocksHeld(*s) * block_size_;
}

std::span<const int32_t> PagedKvCache::BlockTable(SeqId seq, int layer) const {
  const Sequence* s = Find(seq);
  if (s == nullptr || layer < 0 || layer >= geometry_.n_layers) return {};
  return s->tables[static_cast<size_t>(layer)];
}

int64_t PagedKvCache::BlocksNeeded(SeqId seq, int64_t n) const {
  const Sequence* s = Find(seq);
  const int64_t length = s == nullptr ? 0 : s->length;
  const int64_t held = s == nullptr ? 0 : BlocksHeld(*s);
  const int64_t wanted = length + std::clamp<int64_t>(n, 0, kMaxTokens);
  const int64_t per_layer = std::max<int64_t>(CeilDiv(wanted, block_size_) - held, 0);
  return per_layer * geometry_.n_layers;
}

absl::Status PagedKvCache::Reserve(SeqId seq, int64_t n) {
  Sequence* s = Find(seq);
  if (s == nullptr) return absl::NotFoundError(absl::StrFormat("unknown sequence %d", seq));
  if (n < 0) return absl::InvalidArgumentError(absl::StrFormat("cannot reserve %d tokens", n));
  const int64_t needed = BlocksNeeded(seq, n);
  if (needed == 0) return absl::OkStatus();
  if (needed > pool_->num_free()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "KV cache full: sequence %d needs %d more blocks (%d per layer x %d layers) for %d "
        "tokens, %d of %d blocks free",
        seq, needed, needed / geometry_.n_layers, geometry_.n_layers,
        s->length + std::min(n, kMaxTokens), pool_->num_free(), pool_->num_blocks()));
  }
  // Checked above, so every layer gets its blocks: all or nothing.
  const int64_t per_layer = needed / geometry_.n_layers;
  for (std::vector<int32_t>& table : s->tables) {
    const bool ok = pool_->AllocateMany(per_layer, BlockKind::kFull, &table);
    assert(ok);
    (void)ok;
  }
  return absl::OkStatus();
}

void PagedKvCache::Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k,
                         const float* v) {
  Sequence* s = Find(seq);
  assert(s != nullptr && layer >= 0 && layer < geometry_.n_layers);
  assert(pos >= 0 && pos + n <= BlocksHeld(*s) * block_size_ && "write past the reservation");
  const std::vector<int32_t>& table = s->tables[static_cast<size_t>(layer)];
  const int hd = geometry_.head_dim;
  const int n_kv = geometry_.n_kv_heads;
  const size_t head_bytes = static_cast<size_t>(hd) * sizeof(float);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = pos + i;
    float* block = pool_->data(table[static_cast<size_t>(t / block_size_)]);
    const int64_t slot = t % block_size_;
    const float* k_row = k + i * n_kv * hd;  // [n_kv_heads, head_dim]
    const float* v_row = v + i * n_kv * hd;
    for (int h = 0; h < n_kv; ++h) {
      std::memcpy(block + KOffset(h, slot), k_row + static_cast<int64_t>(h) * hd, head_bytes);
      std::memcpy(block + VOffset(h, slot), v_row + static_cast<int64_t>(h) * hd, head_bytes);
    }
  }
}

void PagedKvCache::Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) {
  const int hd = geometry_.head_dim;
  const int n_kv = geometry_.n_kv_heads;
  assert(n_heads > 0 && n_heads % n_kv == 0);
  assert(layer >= 0 && layer < geometry_.n_layers);
  const int group = n_heads / n_kv;
  const int bs = block_size_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  // One work item per (request, kv head, query): the query heads of a GQA group share the
  // K/V block reads, which is what decode is bound by. Items are flattened so OpenMP sees a
  // single loop; dynamic scheduling because causal queries late in a chunk cost more.
  std::vector<int64_t> first_item(requests.size() + 1, 0);
  for (size_t r = 0; r < requests.size(); ++r) {
    first_item[r + 1] = first_item[r] + requests[r].n * n_kv;
  }
  const int64_t total = first_item.back();

#pragma omp parallel for schedule(dynamic, 1) if (total > 1)
  for (int64_t item = 0; item < total; ++item) {
    const size_t r = static_cast<size_t>(
        std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1);
    const AttentionRequest& req = requests[r];
    const int64_t local = item - first_item[r];
    const int64_t i = local / n_kv;
    const int kvh = static_cast<int>(local % n_kv);
    const Sequence& s = seqs_[static_cast<size_t>(req.seq)];
    const std::vector<int32_t>& table = s.tables[static_cast<size_t>(layer)];
    const int64_t n_ctx = req.pos + i + 1;  // causal: tokens [0, pos + i]

    // Per-thread state sized by the largest group/block seen; grows once, never per call.
    thread_local std::vector<float> scratch;
    const size_t need = static_cast<size_t>(group) * (hd + 2) + static_cast<size_t>(bs);
    if (scratch.size() < need) scratch.resize(need);
    float* acc = scratch.data();                             // [group, head_dim]
    float* run_max = acc + static_cast<size_t>(group) * hd;  // [group]
    float* run_sum = run_max + group;                        // [group]
    float* scores = run_sum + group;                         // [B]
    std::fill(acc, acc + static_cast<size_t>(group) * hd, 0.0f);
    std::fill(run_max, run_max + group, -std::numeric_limits<float>::infinity());
    std::fill(run_sum, run_sum + group, 0.0f);

    const float* q_tok = req.q + (i * n_heads + static_cast<int64_t>(kvh) * group) * hd;
    for (int64_t b0 = 0; b0 < n_ctx; b0 += bs) {
      const float* block = pool_->data(table[static_cast<size_t>(b0 / bs)]);
      const float* k_blk = block + KOffset(kvh, 0);  // [B, head_dim]
      const float* v_blk = block + VOffset(kvh, 0);  // [B, head_dim]
      const int nb = static_cast<int>(std::min<int64_t>(bs, n_ctx - b0));
      for (int g = 0; g < group; ++g) {
        const float* q = q_tok + static_cast<int64_t>(g) * hd;
        float block_max = -std::numeric_limits<float>::infinity();
        for (int t = 0; t < nb; ++t) {
          scores[t] = Dot(q, k_blk + static_cast<int64_t>(t) * hd, hd) * scale;
          block_max = std::max(block_max, scores[t]);
        }
        // Online softmax: rescale what was accumulated under the old running max.
        const float new_max = std::max(run_max[g], block_max);
        float* acc_g = acc + static_cast<int64_t>(g) * hd;
        if (new_max > run_max[g]) {
          const float correction = std::exp(run_max[g] - new_max);  // 0 on the first block
          run_sum[g] *= correction;
#pragma omp simd
          for (int d = 0; d < hd; ++d) acc_g[d] *= correction;
          run_max[g] = new_max;
        }
        for (int t = 0; t < nb; ++t) {
          const float p = std::exp(scores[t] - new_max);
          run_sum[g] += p;
          Axpy(p, v_blk + static_cast<int64_t>(t) * hd, acc_g, hd);
        }
      }
    }
    float* out_tok = req.out + (i * n_heads + static_cast<int64_t>(kvh) * group) * hd;
    for (int g = 0; g < group; ++g) {
      const float inv = 1.0f / run_sum[g];
      const float* acc_g = acc + static_cast<int64_t>(g) * hd;
      float* o = out_tok + static_cast<int64_t>(g) * hd;
#pragma omp simd
      for (int d = 0; d < hd; ++d) o[d] = acc_g[d] * inv;
    }
  }
}

absl::Status PagedKvCache::Commit(SeqId seq, int64_t length) {
  Sequence* s = Find(seq);
  if (s == nullptr) return absl::NotFoundError(absl::StrFormat("unknown sequence %d", seq));
  const int64_t reserved = BlocksHeld(*s) * block_size_;
  if (length < s->length || length > reserved) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "commit of sequence %d to length %d outside [%d, %d] (committed, reserved); shrink "
        "with Truncate",
        seq, length, s->length, reserved));
  }
  tokens_cached_ += length - s->length;
  s->length = length;
  return absl::OkStatus();
}

absl::Status PagedKvCache::Truncate(SeqId seq, int64_t length) {
  Sequence* s = Find(seq);
  if (s == nullptr) return absl::NotFoundError(absl::StrFormat("unknown sequence %d", seq));
  if (length < 0 || length > s->length) {
    return absl::InvalidArgumentError(
        absl::StrFormat("truncate of sequence %d to %d outside [0, %d]", seq, length, s->length));
  }
  // Blocks reserved past the committed length go too: Truncate undoes a failed step.
  ReleaseBlocksPast(*s, CeilDiv(length, block_size_));
  tokens_cached_ -= s->length - length;
  s->length = length;
  return absl::OkStatus();
}

KvCacheStats PagedKvCache::Stats() const {
  KvCacheStats st;
  st.bytes_total = pool_->num_blocks() * pool_->block_bytes();
  st.bytes_used_full = pool_->num_used(BlockKind::kFull) * pool_->block_bytes();
  st.blocks_total = pool_->num_blocks();
  st.blocks_free = pool_->num_free();
  st.tokens_cached = tokens_cached_;
  st.bytes_full_fp16_equivalent = tokens_cached_ * geometry_.n_layers * 2 *
                                  geometry_.n_kv_heads * geometry_.head_dim * 2;
  st.sequences = live_sequences_;
  return st;
}

}  // namespace subspace
