// PagedKvCache: bookkeeping of sequences and block tables over a BlockPool, and the CPU
// attention that walks a block table with an online (streaming) softmax, so it needs no
// score buffer sized by the context and allocates nothing per token.
#include "core/kvcache/paged_kv_cache.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/cpu/attention_kernels.h"
#include "core/kvcache/paged_attention.h"
#include "core/kvcache/sequence_image.h"

namespace subspace {

int64_t PagedKvCache::BlockBytes(const KvCacheGeometry& geometry, int block_size, KvDtype dtype) {
  const int64_t bytes = 2 * static_cast<int64_t>(geometry.n_kv_heads) * block_size *
                        KvRowBytes(dtype, geometry.head_dim);
  return CeilDiv(bytes, int64_t{4}) * 4;
}

absl::StatusOr<std::unique_ptr<PagedKvCache>> PagedKvCache::Create(const Config& config) {
  const KvCacheGeometry& g = config.geometry;
  if (absl::Status st = CheckKvGeometry(g); !st.ok()) return st;
  if (config.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("block_size must be positive, got %d", config.block_size));
  }
  if (KvRowBytes(config.dtype, g.head_dim) == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("a %s KV cache needs a head_dim that is a multiple of %d, got %d",
                        KvDtypeName(config.dtype), kKvQuantBlock, g.head_dim));
  }
  const int64_t block_bytes = BlockBytes(g, config.block_size, config.dtype);
  absl::StatusOr<int64_t> num_blocks =
      BlocksForCapacity(config.capacity_bytes, block_bytes, g.n_layers);
  if (!num_blocks.ok()) return num_blocks.status();
  absl::StatusOr<std::unique_ptr<BlockPool>> pool =
      BlockPool::Create(block_bytes / static_cast<int64_t>(sizeof(float)), *num_blocks);
  if (!pool.ok()) return pool.status();
  return std::unique_ptr<PagedKvCache>(new PagedKvCache(config, *std::move(pool)));
}

PagedKvCache::PagedKvCache(const Config& config, std::unique_ptr<BlockPool> pool)
    : geometry_(config.geometry),
      block_size_(config.block_size),
      dtype_(config.dtype),
      row_bytes_(KvRowBytes(config.dtype, config.geometry.head_dim)),
      v_half_(static_cast<int64_t>(config.geometry.n_kv_heads) * config.block_size * row_bytes_),
      pool_(std::move(pool)),
      seqs_({.n_layers = config.geometry.n_layers,
             .block_size = config.block_size,
             .block_bytes = pool_->block_bytes()},
            pool_.get()) {}

absl::StatusOr<SeqId> PagedKvCache::CreateSequence() { return seqs_.Create(); }

absl::Status PagedKvCache::FreeSequence(SeqId seq) { return seqs_.Free(seq); }

int64_t PagedKvCache::Length(SeqId seq) const { return seqs_.Length(seq); }

int64_t PagedKvCache::ReservedTokens(SeqId seq) const { return seqs_.ReservedTokens(seq); }

std::span<const int32_t> PagedKvCache::BlockTable(SeqId seq, int layer) const {
  const std::vector<int32_t>* table = seqs_.Table(seq, layer);
  if (table == nullptr) return {};
  return *table;
}

int64_t PagedKvCache::BlocksNeeded(SeqId seq, int64_t n) const {
  return seqs_.BlocksNeeded(seq, n);
}

absl::Status PagedKvCache::Reserve(SeqId seq, int64_t n) { return seqs_.Reserve(seq, n); }

void PagedKvCache::Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k,
                         const float* v) {
  auto* s = seqs_.Find(seq);
  assert(s != nullptr && layer >= 0 && layer < geometry_.n_layers);
  assert(pos >= 0 && pos + n <= s->blocks() * block_size_ && "write past the reservation");
  const std::vector<int32_t>& table = s->tables[static_cast<size_t>(layer)];
  const int hd = geometry_.head_dim;
  const int n_kv = geometry_.n_kv_heads;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = pos + i;
    uint8_t* block = BlockData(table[static_cast<size_t>(t / block_size_)]);
    const int64_t slot = t % block_size_;
    const float* k_row = k + i * n_kv * hd;  // [n_kv_heads, head_dim]
    const float* v_row = v + i * n_kv * hd;
    for (int h = 0; h < n_kv; ++h) {
      QuantizeKvRow(dtype_, k_row + static_cast<int64_t>(h) * hd, hd, block + KOffset(h, slot));
      QuantizeKvRow(dtype_, v_row + static_cast<int64_t>(h) * hd, hd, block + VOffset(h, slot));
    }
  }
}

namespace {

// A layer's blocks for AttendPagedBlocks: fp32 rows in place; q8_0 / q4_0 rows dequantized.
class PagedRows final : public BlockRowSource {
 public:
  PagedRows(const PagedKvCache& cache, int layer) : cache_(cache), layer_(layer) {}

  BlockRows Rows(SeqId seq, int64_t block, bool values, int valid, float* scratch) const override {
    const uint8_t* half = cache_.BlockBytesOf(seq, layer_, block) + (values ? cache_.v_half() : 0);
    if (cache_.dtype() == KvDtype::kF32) return {half, CoeffDtype::kFp32};
    const KvCacheGeometry& g = cache_.geometry();
    const int bs = cache_.block_size();
    for (int kvh = 0; kvh < g.n_kv_heads; ++kvh) {
      DequantizeKvRows(cache_.dtype(), half + static_cast<int64_t>(kvh) * bs * cache_.row_bytes(),
                       valid, g.head_dim, scratch + static_cast<int64_t>(kvh) * bs * g.head_dim);
    }
    return {scratch, CoeffDtype::kFp32};
  }
  bool NeedsScratch() const override { return cache_.dtype() != KvDtype::kF32; }
  void Prefetch(SeqId seq, int64_t block) const override {
    cpu::PrefetchBytes(cache_.BlockBytesOf(seq, layer_, block), cache_.pool().block_bytes());
  }

 private:
  const PagedKvCache& cache_;
  int layer_;
};

}  // namespace

void PagedKvCache::Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) {
  assert(layer >= 0 && layer < geometry_.n_layers);
  AttendPagedBlocks(geometry_, block_size_, requests, n_heads, PagedRows(*this, layer));
}

absl::Status PagedKvCache::Commit(SeqId seq, int64_t length) { return seqs_.Commit(seq, length); }

absl::Status PagedKvCache::Truncate(SeqId seq, int64_t length) {
  return seqs_.Truncate(seq, length);
}

KvCacheStats PagedKvCache::Stats() const { return seqs_.Stats(geometry_); }

// Image: the layout line, the length, then per layer and block the K rows of every head, then
// the V rows, of the block's committed tokens only (a block's other slots may hold another
// sequence's stale rows, which must not leave in an image).
std::string PagedKvCache::ImageLayout() const {
  return absl::StrFormat("paged layers=%d kv_heads=%d head_dim=%d block=%d dtype=%s",
                         geometry_.n_layers, geometry_.n_kv_heads, geometry_.head_dim, block_size_,
                         KvDtypeName(dtype_));
}

absl::StatusOr<std::string> PagedKvCache::ExportSequence(SeqId seq) const {
  const auto* s = seqs_.Find(seq);
  if (s == nullptr) return decltype(seqs_)::Unknown(seq);
  ImageWriter w;
  w.Bytes(ImageLayout());
  w.I64(s->length);
  ForEachCommittedRow(s->length, [&](int layer, int64_t block, int64_t offset) {
    w.Raw(BlockData(s->tables[static_cast<size_t>(layer)][static_cast<size_t>(block)]) + offset,
          static_cast<size_t>(row_bytes_));
  });
  return w.Take();
}

absl::StatusOr<SeqId> PagedKvCache::ImportSequence(std::string_view image) {
  ImageReader r(image, "KV cache image");
  if (absl::Status st = r.ExpectLayout(ImageLayout()); !st.ok()) return st;
  const int64_t max_tokens = pool_->num_blocks() * block_size_;
  absl::StatusOr<int64_t> length = r.Int("length", 0, max_tokens);
  if (!length.ok()) return length.status();
  const int64_t rows = *length * geometry_.n_layers * 2 * geometry_.n_kv_heads;
  if (static_cast<uint64_t>(rows) * static_cast<uint64_t>(row_bytes_) != r.left()) {
    return r.Corrupt(absl::StrFormat("%d tokens need %d bytes of rows, it holds %d", *length,
                                     rows * row_bytes_, r.left()));
  }
  absl::StatusOr<SeqId> seq = CreateSequence();
  if (!seq.ok()) return seq.status();
  if (absl::Status st = Reserve(*seq, *length); !st.ok()) {
    (void)FreeSequence(*seq);
    return st;
  }
  auto& s = seqs_[*seq];
  ForEachCommittedRow(*length, [&](int layer, int64_t block, int64_t offset) {
    const std::string_view row = *r.Raw("row", static_cast<uint64_t>(row_bytes_));  // sized above
    std::memcpy(
        BlockData(s.tables[static_cast<size_t>(layer)][static_cast<size_t>(block)]) + offset,
        row.data(), row.size());
  });
  if (absl::Status st = Commit(*seq, *length); !st.ok()) {
    (void)FreeSequence(*seq);
    return st;
  }
  return *seq;
}

}  // namespace subspace
