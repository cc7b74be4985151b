// The compressed caches' image format (compressed_image.h).
#include "core/compress/compressed_image.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
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

void WriteFloats(ImageWriter& w, const std::vector<float>& v) {
  if (!v.empty()) w.Raw(v.data(), v.size() * sizeof(float));
}

absl::Status ReadFloats(ImageReader& r, std::string_view field, size_t n, std::vector<float>* v) {
  absl::StatusOr<std::string_view> bytes = r.Raw(field, n * sizeof(float));
  if (!bytes.ok()) return bytes.status();
  v->resize(n);
  if (n > 0) std::memcpy(v->data(), bytes->data(), bytes->size());
  return absl::OkStatus();
}

}  // namespace

std::string_view CompressedImage::Own(std::string bytes) {
  owned_.push_back(std::make_unique<std::string>(std::move(bytes)));
  return *owned_.back();
}

CompressedImageFormat::CompressedImageFormat(const KvCacheGeometry& g, int block_size,
                                             CoeffDtype full_dtype, const CompressionPolicy& policy)
    : geometry_(g),
      block_size_(block_size),
      policy_(policy),
      row_bytes_(static_cast<int64_t>(g.head_dim) * (full_dtype == CoeffDtype::kFp32 ? 4 : 2)) {
  layout_ = absl::StrFormat(
      "compressed layers=%d kv_heads=%d head_dim=%d block=%d full=%s coeff=%s sinks=%d "
      "window=%d outlier_threshold=%.9g r_k=%s r_v=%s",
      g.n_layers, g.n_kv_heads, g.head_dim, block_size, CoeffDtypeName(full_dtype),
      CoeffDtypeName(policy.coeff_dtype), policy.sink_tokens, policy.window_tokens,
      policy.outlier_threshold, absl::StrJoin(policy.r_k, ","), absl::StrJoin(policy.r_v, ","));
  for (int l = 0; l < g.n_layers; ++l) {
    slot_bytes_.push_back(CompressedKvCache::CompressedBlockBytes(
        g, block_size, policy.r_k[static_cast<size_t>(l)], policy.r_v[static_cast<size_t>(l)],
        policy.coeff_dtype));
  }
}

std::string CompressedImageFormat::Write(const CompressedImage& image) const {
  const int n_kv = geometry_.n_kv_heads;
  ImageWriter w;
  w.Bytes(layout_);
  w.I64(image.length);
  w.I64(image.next_compress);
  w.I64(static_cast<int64_t>(image.epochs.size()));
  for (const std::shared_ptr<const Basis>& basis : image.epochs) {
    for (const LayerBasis& lb : basis->layers) {
      WriteFloats(w, lb.p_q);
      WriteFloats(w, lb.p_k);
      WriteFloats(w, lb.p_v);
      WriteFloats(w, lb.r_v);
    }
  }
  w.I32(image.current_epoch);
  for (const CompressedImage::Layer& layer : image.layers) {
    for (const CompressedImage::Block& b : layer.blocks) {
      w.U8(b.compressed ? 1 : 0);
      if (b.compressed) {
        w.U64(b.outliers);
        for (int h = 0; h < n_kv; ++h) w.I32(b.epochs[static_cast<size_t>(h)]);
      }
      w.Raw(b.bytes.data(), b.bytes.size());
    }
    w.I64(static_cast<int64_t>(layer.outlier_pos.size()));
    for (int64_t pos : layer.outlier_pos) w.I64(pos);
    w.Raw(layer.outlier_rows.data(), layer.outlier_rows.size());
  }
  return w.Take();
}

absl::StatusOr<CompressedImage> CompressedImageFormat::Read(std::string_view image,
                                                            int64_t max_tokens) const {
  const KvCacheGeometry& g = geometry_;
  const int hd = g.head_dim, n_kv = g.n_kv_heads, bs = block_size_;
  ImageReader r(image, "KV cache image");
  if (absl::Status st = r.ExpectLayout(layout_); !st.ok()) return st;
  CompressedImage out;
  absl::StatusOr<int64_t> length = r.Int("length", 0, max_tokens);
  if (!length.ok()) return length.status();
  out.length = *length;
  out.blocks = CeilDiv(*length, int64_t{bs});
  absl::StatusOr<int64_t> next_compress = r.Int("next_compress", 0, out.blocks);
  absl::StatusOr<int64_t> n_epochs = r.Int("epochs", 0, kMaxImageEpochs);
  if (!next_compress.ok()) return next_compress.status();
  if (!n_epochs.ok()) return n_epochs.status();
  out.next_compress = *next_compress;

  for (int64_t i = 0; i < *n_epochs; ++i) {
    auto basis = std::make_shared<Basis>(Basis::Zeros(g, policy_.r_k, policy_.r_v));
    for (size_t l = 0; l < basis->layers.size(); ++l) {
      LayerBasis& lb = basis->layers[l];
      const size_t nk = static_cast<size_t>(n_kv) * hd * lb.rank_k;
      const size_t nv = static_cast<size_t>(n_kv) * hd * lb.rank_v;
      for (auto [field, n, v] : {std::tuple{"p_q", nk, &lb.p_q}, std::tuple{"p_k", nk, &lb.p_k},
                                 std::tuple{"p_v", nv, &lb.p_v}, std::tuple{"r_v", nv, &lb.r_v}}) {
        if (absl::Status st = ReadFloats(r, field, n, v); !st.ok()) return st;
      }
    }
    out.epochs.push_back(std::move(basis));
  }
  absl::StatusOr<int32_t> current = r.I32("current epoch");
  if (!current.ok()) return current.status();
  if (*current < -1 || *current >= *n_epochs) return r.Corrupt("current epoch out of range");
  out.current_epoch = *current;

  out.layers.resize(static_cast<size_t>(g.n_layers));
  const auto row_bytes = static_cast<uint64_t>(row_bytes_);
  const int64_t first_compressible = CeilDiv(policy_.sink_tokens, bs);
  std::vector<bool> epoch_used(static_cast<size_t>(*n_epochs));
  for (int l = 0; l < g.n_layers; ++l) {
    CompressedImage::Layer& li = out.layers[static_cast<size_t>(l)];
    int64_t masked = 0;
    for (int64_t b = 0; b < out.blocks; ++b) {
      CompressedImage::Block bi;
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
        bytes = r.Raw("compressed block", static_cast<uint64_t>(slot_bytes(l)));
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
      const CompressedImage::Block& bi = li.blocks[static_cast<size_t>(*pos / bs)];
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
  // The views point into `image`, which the caller keeps while it builds.
  return out;
}

}  // namespace subspace
