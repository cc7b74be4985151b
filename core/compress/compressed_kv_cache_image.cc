// CompressedKvCache images (session snapshots). Layout, in order:
//   layout line; length; next_compress; epochs E, then each epoch's matrices per layer
//   (p_q, p_k, p_v [n_kv, d, r], r_v [n_kv, r_v, d] as fp32); the sequence's current epoch
//   (an index into them, -1 for none);
//   per layer: per block, kind (0 full, 1 compressed); a full block's committed rows (K of
//   every head, then V) at full_dtype; a compressed block's outlier mask, the epoch index of
//   each KV head and its slot bytes as stored; then the layer's outlier count, positions and
//   rows (K then V of every head per outlier).
// Import parses and checks everything before it takes a page, so a corrupt image changes
// nothing; the checks keep every index the attention and Truncate follow in range. A refreshing
// sequence's image is the same: the refreshed bases are epochs like any other; its refresher's
// statistics stay behind (the importer's SetSequenceRefresh starts them empty).
#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/base/int_math.h"
#include "core/compress/compressed_kv_cache.h"
#include "core/kvcache/sequence_image.h"

namespace subspace {

namespace {

constexpr int64_t kMaxImageEpochs = 4096;

// Bitwise equality of two bases' matrices (the same epoch read back from an image).
bool SameMatrices(const Basis& a, const Basis& b) {
  if (a.layers.size() != b.layers.size()) return false;
  auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerBasis &x = a.layers[l], &y = b.layers[l];
    if (x.rank_k != y.rank_k || x.rank_v != y.rank_v || !same(x.p_q, y.p_q) ||
        !same(x.p_k, y.p_k) || !same(x.p_v, y.p_v) || !same(x.r_v, y.r_v)) {
      return false;
    }
  }
  return true;
}

void WriteFloats(ImageWriter& w, const std::vector<float>& v) {
  w.Raw(v.data(), v.size() * sizeof(float));
}

absl::Status ReadFloats(ImageReader& r, std::string_view field, size_t n, std::vector<float>* v) {
  absl::StatusOr<std::string_view> bytes = r.Raw(field, n * sizeof(float));
  if (!bytes.ok()) return bytes.status();
  v->resize(n);
  std::memcpy(v->data(), bytes->data(), bytes->size());
  return absl::OkStatus();
}

}  // namespace

std::string CompressedKvCache::ImageLayout() const {
  const CompressionPolicy& p = config_.policy;
  return absl::StrFormat(
      "compressed layers=%d kv_heads=%d head_dim=%d block=%d full=%s coeff=%s sinks=%d "
      "window=%d outlier_threshold=%.9g r_k=%s r_v=%s",
      config_.geometry.n_layers, config_.geometry.n_kv_heads, config_.geometry.head_dim,
      config_.block_size, CoeffDtypeName(config_.full_dtype), CoeffDtypeName(p.coeff_dtype),
      p.sink_tokens, p.window_tokens, p.outlier_threshold, absl::StrJoin(r_k_, ","),
      absl::StrJoin(r_v_, ","));
}

absl::StatusOr<std::string> CompressedKvCache::ExportSequence(SeqId seq) const {
  const Sequence* s = seqs_.Find(seq);
  if (s == nullptr) return Sequences::Unknown(seq);
  const KvCacheGeometry& g = config_.geometry;
  const int hd = g.head_dim, n_kv = g.n_kv_heads, bs = config_.block_size;
  // The epochs the sequence uses, each once, as image indices.
  std::vector<EpochId> epochs;
  auto index_of = [&](EpochId id) -> int32_t {
    if (id == kNoEpoch) return -1;
    auto it = std::find(epochs.begin(), epochs.end(), id);
    if (it != epochs.end()) return static_cast<int32_t>(it - epochs.begin());
    epochs.push_back(id);
    return static_cast<int32_t>(epochs.size() - 1);
  };
  const int32_t current = index_of(s->epoch);
  for (const LayerState& ls : s->layers) {
    for (EpochId id : ls.block_epochs) (void)index_of(id);
  }

  ImageWriter w;
  w.Bytes(ImageLayout());
  w.I64(s->length);
  w.I64(s->next_compress);
  w.I64(static_cast<int64_t>(epochs.size()));
  for (EpochId id : epochs) {
    for (const LayerBasis& lb : epochs_.Get(id)->layers) {
      WriteFloats(w, lb.p_q);
      WriteFloats(w, lb.p_k);
      WriteFloats(w, lb.p_v);
      WriteFloats(w, lb.r_v);
    }
  }
  w.I32(current);
  const size_t row_bytes = static_cast<size_t>(hd * full_bytes_);
  const int64_t blocks = CeilDiv(s->length, int64_t{bs});
  for (int l = 0; l < g.n_layers; ++l) {
    const std::vector<BlockEntry>& table = s->tables[static_cast<size_t>(l)];
    const LayerState& ls = s->layers[static_cast<size_t>(l)];
    const int64_t slot_bytes =
        CompressedBlockBytes(g, bs, r_k_[static_cast<size_t>(l)], r_v_[static_cast<size_t>(l)],
                             config_.policy.coeff_dtype);
    for (int64_t b = 0; b < blocks; ++b) {
      const BlockEntry& e = table[static_cast<size_t>(b)];
      if (e.slot < 0) {
        w.U8(0);
        const int64_t valid = std::min<int64_t>(bs, s->length - b * bs);
        for (int half = 0; half < 2; ++half) {
          for (int h = 0; h < n_kv; ++h) {
            for (int64_t t = 0; t < valid; ++t) {
              w.Raw(FullAt(e.page, half == 0 ? KOffset(h, t) : VOffset(h, t)), row_bytes);
            }
          }
        }
      } else {
        w.U8(1);
        w.U64(e.outliers);
        for (int h = 0; h < n_kv; ++h) {
          w.I32(index_of(ls.block_epochs[static_cast<size_t>(b * n_kv + h)]));
        }
        w.Raw(slabs_.data({e.page, e.slot}), static_cast<size_t>(slot_bytes));
      }
    }
    w.I64(static_cast<int64_t>(ls.outlier_pos.size()));
    for (int64_t pos : ls.outlier_pos) w.I64(pos);
    for (size_t j = 0; j < ls.outlier_pos.size(); ++j) {
      const int32_t page = ls.outlier_pages[j / static_cast<size_t>(bs)];
      const int64_t slot = static_cast<int64_t>(j) % bs;
      for (int h = 0; h < n_kv; ++h) {
        w.Raw(FullAt(page, KOffset(h, slot)), row_bytes);
        w.Raw(FullAt(page, VOffset(h, slot)), row_bytes);
      }
    }
  }
  return w.Take();
}

absl::StatusOr<SeqId> CompressedKvCache::ImportSequence(std::string_view image) {
  const KvCacheGeometry& g = config_.geometry;
  const int hd = g.head_dim, n_kv = g.n_kv_heads, bs = config_.block_size;
  ImageReader r(image, "KV cache image");
  if (absl::Status st = r.ExpectLayout(ImageLayout()); !st.ok()) return st;
  const int64_t max_tokens = pool_->num_blocks() * bs;
  absl::StatusOr<int64_t> length = r.Int("length", 0, max_tokens);
  if (!length.ok()) return length.status();
  const int64_t blocks = CeilDiv(*length, int64_t{bs});
  absl::StatusOr<int64_t> next_compress = r.Int("next_compress", 0, blocks);
  absl::StatusOr<int64_t> n_epochs = r.Int("epochs", 0, kMaxImageEpochs);
  if (!next_compress.ok()) return next_compress.status();
  if (!n_epochs.ok()) return n_epochs.status();

  // --- Parse and check everything first ---
  std::vector<std::shared_ptr<Basis>> bases;
  for (int64_t i = 0; i < *n_epochs; ++i) {
    auto basis = std::make_shared<Basis>(Basis::Zeros(g, r_k_, r_v_));
    for (size_t l = 0; l < basis->layers.size(); ++l) {
      LayerBasis& lb = basis->layers[l];
      const size_t nk = static_cast<size_t>(n_kv) * hd * lb.rank_k;
      const size_t nv = static_cast<size_t>(n_kv) * hd * lb.rank_v;
      for (auto [field, n, v] : {std::tuple{"p_q", nk, &lb.p_q}, std::tuple{"p_k", nk, &lb.p_k},
                                 std::tuple{"p_v", nv, &lb.p_v}, std::tuple{"r_v", nv, &lb.r_v}}) {
        if (absl::Status st = ReadFloats(r, field, n, v); !st.ok()) return st;
      }
    }
    bases.push_back(std::move(basis));
  }
  absl::StatusOr<int32_t> current = r.I32("current epoch");
  if (!current.ok()) return current.status();
  if (*current < -1 || *current >= *n_epochs) return r.Corrupt("current epoch out of range");

  struct BlockImage {
    bool compressed = false;
    uint64_t outliers = 0;
    std::vector<int32_t> epochs;  // [n_kv] image indices
    std::string_view bytes;       // full: committed rows; compressed: the slot
  };
  struct LayerImage {
    std::vector<BlockImage> blocks;
    std::vector<int64_t> outlier_pos;
    std::string_view outlier_rows;  // [outliers][n_kv][2][hd] at full_dtype
  };
  std::vector<LayerImage> layers(static_cast<size_t>(g.n_layers));
  const uint64_t row_bytes = static_cast<uint64_t>(hd * full_bytes_);
  const int64_t first_compressible = CeilDiv(config_.policy.sink_tokens, bs);
  std::vector<bool> epoch_used(static_cast<size_t>(*n_epochs));
  for (int l = 0; l < g.n_layers; ++l) {
    LayerImage& li = layers[static_cast<size_t>(l)];
    const int64_t slot_bytes =
        CompressedBlockBytes(g, bs, r_k_[static_cast<size_t>(l)], r_v_[static_cast<size_t>(l)],
                             config_.policy.coeff_dtype);
    int64_t masked = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      BlockImage bi;
      absl::StatusOr<uint8_t> kind = r.U8("block kind");
      if (!kind.ok()) return kind.status();
      if (*kind > 1) return r.Corrupt(absl::StrFormat("block kind %d", *kind));
      absl::StatusOr<std::string_view> bytes;
      if (*kind == 0) {
        const int64_t valid = std::min<int64_t>(bs, *length - b * bs);
        bytes = r.Raw("full block", 2 * static_cast<uint64_t>(n_kv) * valid * row_bytes);
      } else {
        // Only whole blocks past the sinks and before next_compress are ever compressed.
        if (b < first_compressible || b >= *next_compress || (b + 1) * bs > *length) {
          return r.Corrupt(absl::StrFormat("layer %d block %d cannot be compressed", l, b));
        }
        bi.compressed = true;
        absl::StatusOr<uint64_t> mask = r.U64("outlier mask");
        if (!mask.ok()) return mask.status();
        if (bs < 64 && (*mask >> bs) != 0) return r.Corrupt("outlier mask past the block");
        bi.outliers = *mask;
        masked += std::popcount(*mask);
        for (int h = 0; h < n_kv; ++h) {
          absl::StatusOr<int32_t> e = r.I32("block epoch");
          if (!e.ok()) return e.status();
          if (*e < 0 || *e >= *n_epochs) return r.Corrupt("block epoch out of range");
          epoch_used[static_cast<size_t>(*e)] = true;
          bi.epochs.push_back(*e);
        }
        bytes = r.Raw("compressed block", static_cast<uint64_t>(slot_bytes));
      }
      if (!bytes.ok()) return bytes.status();
      bi.bytes = *bytes;
      li.blocks.push_back(std::move(bi));
    }
    absl::StatusOr<int64_t> outliers = r.Int("outliers", 0, *length);
    if (!outliers.ok()) return outliers.status();
    if (*outliers != masked) return r.Corrupt("outlier count differs from the blocks' masks");
    int64_t prev = -1;
    for (int64_t j = 0; j < *outliers; ++j) {
      absl::StatusOr<int64_t> pos = r.Int("outlier position", prev + 1, *length - 1);
      if (!pos.ok()) return pos.status();
      const BlockImage& bi = li.blocks[static_cast<size_t>(*pos / bs)];
      if (!bi.compressed || !((bi.outliers >> (*pos % bs)) & 1u)) {
        return r.Corrupt(absl::StrFormat("outlier at %d outside its block's mask", *pos));
      }
      li.outlier_pos.push_back(*pos);
      prev = *pos;
    }
    absl::StatusOr<std::string_view> rows =
        r.Raw("outlier rows", static_cast<uint64_t>(*outliers) * n_kv * 2 * row_bytes);
    if (!rows.ok()) return rows.status();
    li.outlier_rows = *rows;
  }
  if (absl::Status st = r.ExpectEnd(); !st.ok()) return st;
  for (int64_t i = 0; i < *n_epochs; ++i) {
    if (!epoch_used[static_cast<size_t>(i)] && i != *current) return r.Corrupt("unused epoch");
  }

  // --- Build: epochs (the default where bitwise equal), then pages ---
  std::vector<EpochId> ids;
  auto release_ids = [&] {
    for (EpochId id : ids) epochs_.Release(id);
  };
  const Basis* default_basis =
      epochs_.default_epoch() == kNoEpoch ? nullptr : epochs_.Get(epochs_.default_epoch());
  for (const std::shared_ptr<Basis>& basis : bases) {
    if (default_basis != nullptr && SameMatrices(*basis, *default_basis)) {
      (void)epochs_.Acquire(epochs_.default_epoch());
      ids.push_back(epochs_.default_epoch());
      continue;
    }
    absl::StatusOr<EpochId> id = InstallBasis(basis);
    if (!id.ok()) {
      release_ids();
      return id.status();
    }
    ids.push_back(*id);
  }
  absl::StatusOr<SeqId> seq = CreateSequence();
  if (!seq.ok()) {
    release_ids();
    return seq.status();
  }
  auto fail = [&](absl::Status st) {
    (void)FreeSequence(*seq);
    release_ids();
    return st;
  };
  if (absl::Status st = Reserve(*seq, *length); !st.ok()) return fail(st);
  Sequence& s = seqs_[*seq];
  if (*current >= 0) {
    if (absl::Status st = epochs_.SetSequenceEpoch(s, ids[static_cast<size_t>(*current)]);
        !st.ok()) {
      return fail(st);
    }
  }
  for (int l = 0; l < g.n_layers; ++l) {
    const LayerImage& li = layers[static_cast<size_t>(l)];
    LayerState& ls = s.layers[static_cast<size_t>(l)];
    std::vector<BlockEntry>& table = s.tables[static_cast<size_t>(l)];
    for (int64_t b = 0; b < blocks; ++b) {
      const BlockImage& bi = li.blocks[static_cast<size_t>(b)];
      BlockEntry& e = table[static_cast<size_t>(b)];
      if (!bi.compressed) {
        const int64_t valid = std::min<int64_t>(bs, *length - b * bs);
        const char* src = bi.bytes.data();
        for (int half = 0; half < 2; ++half) {
          for (int h = 0; h < n_kv; ++h) {
            for (int64_t t = 0; t < valid; ++t, src += row_bytes) {
              std::memcpy(FullAt(e.page, half == 0 ? KOffset(h, t) : VOffset(h, t)), src,
                          row_bytes);
            }
          }
        }
        continue;
      }
      // As CompressBlock: the page goes back before the slot is taken.
      pool_->Free(e.page);
      const SlabAllocator::Slot slot = slabs_.Allocate(slab_class_[static_cast<size_t>(l)]);
      if (slot.page < 0) {  // cannot happen (the freed page is there); keep the table whole
        e = BlockEntry{pool_->Allocate(BlockKind::kFull), -1, 0};
        return fail(absl::InternalError("no slot for a compressed block after freeing a page"));
      }
      std::memcpy(slabs_.data(slot), bi.bytes.data(), bi.bytes.size());
      e = BlockEntry{slot.page, slot.index, bi.outliers};
      for (int h = 0; h < n_kv; ++h) {
        const EpochId id = ids[static_cast<size_t>(bi.epochs[static_cast<size_t>(h)])];
        ls.block_epochs[static_cast<size_t>(b * n_kv + h)] = id;
        (void)epochs_.Acquire(id);
        AddEpochUse(ls, l, id);
      }
    }
    const char* src = li.outlier_rows.data();
    for (size_t j = 0; j < li.outlier_pos.size(); ++j) {
      if (j % static_cast<size_t>(bs) == 0) {
        const int32_t page = pool_->Allocate(BlockKind::kOutlier);
        if (page < 0) {
          return fail(absl::ResourceExhaustedError("KV cache full: no page for outlier tokens"));
        }
        ls.outlier_pages.push_back(page);
      }
      const int32_t page = ls.outlier_pages.back();
      const int64_t slot = static_cast<int64_t>(j) % bs;
      for (int h = 0; h < n_kv; ++h) {
        std::memcpy(FullAt(page, KOffset(h, slot)), src, row_bytes);
        src += row_bytes;
        std::memcpy(FullAt(page, VOffset(h, slot)), src, row_bytes);
        src += row_bytes;
      }
      ls.outlier_pos.push_back(li.outlier_pos[j]);
    }
  }
  s.next_compress = *next_compress;
  if (absl::Status st = seqs_.Commit(*seq, *length); !st.ok()) return fail(st);
  release_ids();  // the blocks and the sequence hold their own references now
  return *seq;
}

}  // namespace subspace
