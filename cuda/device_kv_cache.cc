// DevicePagedKvCache: the host bookkeeping of the device pool (free list, block tables, lengths),
// the same admission arithmetic as core/kvcache/paged_kv_cache.cc but one table for all layers.
#include "cuda/device_kv_cache.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/base/int_math.h"

namespace subspace::cuda {
namespace {

// Caps hostile token counts before any arithmetic (no pool holds this many tokens).
constexpr int64_t kMaxTokens = int64_t{1} << 48;

}  // namespace

int64_t DevicePagedKvCache::BlockBytes(const KvCacheGeometry& g, int block_size) {
  return static_cast<int64_t>(g.n_layers) * 2 * g.n_kv_heads * block_size * g.head_dim * 2;
}

absl::StatusOr<std::unique_ptr<DevicePagedKvCache>> DevicePagedKvCache::Create(
    const Config& config, uint8_t* pool, int64_t pool_bytes, std::shared_ptr<const void> owner) {
  const KvCacheGeometry& g = config.geometry;
  if (g.n_layers <= 0 || g.n_kv_heads <= 0 || g.head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("KV cache geometry must be positive: n_layers=%d n_kv_heads=%d head_dim=%d",
                        g.n_layers, g.n_kv_heads, g.head_dim));
  }
  if (config.block_size < 1 || config.block_size > kernels::kMaxBlockSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("block_size must be in [1, %d] on the CUDA backend, got %d",
                        kernels::kMaxBlockSize, config.block_size));
  }
  const int64_t block_bytes = BlockBytes(g, config.block_size);
  const int64_t num_blocks = pool_bytes / block_bytes;
  if (pool == nullptr || num_blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("device KV pool of %d bytes holds no block of %d bytes (%d layers)",
                        pool_bytes, block_bytes, g.n_layers));
  }
  if (num_blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("device KV pool has more blocks than int32 ids");
  }
  return std::unique_ptr<DevicePagedKvCache>(
      new DevicePagedKvCache(config, pool, num_blocks, std::move(owner)));
}

DevicePagedKvCache::DevicePagedKvCache(const Config& config, uint8_t* pool, int64_t num_blocks,
                                       std::shared_ptr<const void> owner)
    : geometry_(config.geometry),
      block_size_(config.block_size),
      layout_(kernels::MakeKvPoolLayout(config.geometry.n_kv_heads, config.geometry.head_dim,
                                        config.block_size, 1, 1, CoeffDtype::kFp16)),
      pool_(pool),
      num_blocks_(num_blocks),
      owner_(std::move(owner)) {
  free_.reserve(static_cast<size_t>(num_blocks));
  // Popped from the back: low ids first, so a lightly used pool stays in one corner.
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

absl::StatusOr<SeqId> DevicePagedKvCache::CreateSequence() {
  absl::StatusOr<SeqId> id = seqs_.Acquire([](Sequence& s) { s.table.reserve(64); });
  if (id.ok()) {
    seqs_[*id].length = 0;
    seqs_[*id].table.clear();
  }
  return id;
}

void DevicePagedKvCache::ReleaseBlocksPast(Sequence& s, int64_t keep) {
  for (size_t b = static_cast<size_t>(keep); b < s.table.size(); ++b) free_.push_back(s.table[b]);
  if (s.table.size() > static_cast<size_t>(keep)) s.table.resize(static_cast<size_t>(keep));
}

absl::Status DevicePagedKvCache::FreeSequence(SeqId seq) {
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return UnknownSequence(seq);
  ReleaseBlocksPast(*s, 0);
  tokens_cached_ -= s->length;
  s->length = 0;
  seqs_.Release(seq);
  return absl::OkStatus();
}

int64_t DevicePagedKvCache::Length(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  return s == nullptr ? 0 : s->length;
}

std::span<const int32_t> DevicePagedKvCache::BlockTable(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return {};
  return s->table;
}

// Counted per layer, as the host caches count them, so the scheduler's arithmetic (blocks per
// token = n_layers / B) is the same whichever backend runs.
int64_t DevicePagedKvCache::BlocksNeeded(SeqId seq, int64_t n) const {
  const Sequence* s = seqs_.Find(seq);
  const int64_t length = s == nullptr ? 0 : s->length;
  const int64_t held = s == nullptr ? 0 : static_cast<int64_t>(s->table.size());
  const int64_t wanted = length + std::clamp<int64_t>(n, 0, kMaxTokens);
  return std::max<int64_t>(CeilDiv(wanted, block_size_) - held, 0) * geometry_.n_layers;
}

absl::Status DevicePagedKvCache::Reserve(SeqId seq, int64_t n) {
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return UnknownSequence(seq);
  if (n < 0) return absl::InvalidArgumentError(absl::StrFormat("cannot reserve %d tokens", n));
  const int64_t ids = BlocksNeeded(seq, n) / geometry_.n_layers;
  if (ids == 0) return absl::OkStatus();
  if (ids > static_cast<int64_t>(free_.size())) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "KV cache full: sequence %d needs %d more blocks (%d per layer x %d layers) for %d "
        "tokens, %d of %d blocks free",
        seq, ids * geometry_.n_layers, ids, geometry_.n_layers, s->length + std::min(n, kMaxTokens),
        static_cast<int64_t>(free_.size()) * geometry_.n_layers, num_blocks_ * geometry_.n_layers));
  }
  for (int64_t i = 0; i < ids; ++i) {
    s->table.push_back(free_.back());
    free_.pop_back();
  }
  return absl::OkStatus();
}

absl::Status DevicePagedKvCache::Commit(SeqId seq, int64_t length) {
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return UnknownSequence(seq);
  const int64_t reserved = static_cast<int64_t>(s->table.size()) * block_size_;
  if (absl::Status st = CheckCommit(seq, length, s->length, reserved); !st.ok()) return st;
  tokens_cached_ += length - s->length;
  s->length = length;
  return absl::OkStatus();
}

absl::Status DevicePagedKvCache::Truncate(SeqId seq, int64_t length) {
  Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return UnknownSequence(seq);
  if (absl::Status st = CheckTruncate(seq, length, s->length); !st.ok()) return st;
  // Blocks reserved past the committed length go too: Truncate undoes a failed step.
  ReleaseBlocksPast(*s, CeilDiv(length, block_size_));
  tokens_cached_ -= s->length - length;
  s->length = length;
  return absl::OkStatus();
}

KvCacheStats DevicePagedKvCache::Stats() const {
  KvCacheStats st;
  const int64_t used = num_blocks_ - static_cast<int64_t>(free_.size());
  const int64_t block_bytes = BlockBytes(geometry_, block_size_);
  st.bytes_total = num_blocks_ * block_bytes;
  st.bytes_used_full = used * block_bytes;
  st.bytes_full_fp16_equivalent = Fp16Bytes(geometry_, tokens_cached_);
  st.blocks_total = num_blocks_ * geometry_.n_layers;
  st.blocks_free = static_cast<int64_t>(free_.size()) * geometry_.n_layers;
  st.tokens_cached = tokens_cached_;
  st.sequences = seqs_.live();
  return st;
}

}  // namespace subspace::cuda
