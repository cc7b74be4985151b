// The transform-coded caches' image format (transform_image.h).
#include "core/compress/transform_image.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/base/int_math.h"
#include "core/base/range_coder.h"
#include "core/kvcache/sequence_image.h"

namespace subspace {

namespace {

constexpr auto kFullBlock = static_cast<uint8_t>(TransformImageBlock::kFull);
constexpr auto kCodedBlock = static_cast<uint8_t>(TransformImageBlock::kCoded);
// The codes' form: bit 0 set, one range-coded stream per layer, else the codes as the cache
// stores them; bit 1, the image carries epochs.
constexpr uint8_t kRangeCoded = 1;
constexpr uint8_t kWithEpochs = 2;
// Epochs an image may carry: a sequence keeps at most max_epochs a layer live (a refresh
// setting, far below this), each of them tens of KiB at least.
constexpr int64_t kMaxImageEpochs = 1024;

class Fnv1a {
 public:
  void Add(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) h_ = (h_ ^ b[i]) * 0x100000001b3ull;
  }
  template <typename T>
  void AddVector(const std::vector<T>& v) {
    const uint64_t n = v.size();
    Add(&n, sizeof(n));
    Add(v.data(), v.size() * sizeof(T));
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

// Per component, the model of its codes: a bit tree per context, the context the previous
// token's code's top 3 bits (all of them below 4 bits).
class CodeModel {
 public:
  explicit CodeModel(int bits)
      : bits_(bits), shift_(std::max(bits - 3, 0)), tree_(size_t{8} << bits) {}
  AdaptiveBit* Tree() { return tree_.data() + (static_cast<size_t>(prev_ >> shift_) << bits_); }
  void Saw(uint32_t code) { prev_ = code; }

 private:
  int bits_;
  int shift_;
  uint32_t prev_ = 0;
  std::vector<AdaptiveBit> tree_;  // [8 contexts][2^bits nodes]
};

void WriteFloats(ImageWriter& w, const std::vector<float>& v) {
  if (!v.empty()) w.Raw(v.data(), v.size() * sizeof(float));
}

// One side's codes of an epoch ([n_layers * n_kv] codes of dim d): the numbers only.
void WriteCodes(ImageWriter& w, const std::vector<TransformCode>& codes) {
  for (const TransformCode& c : codes) {
    w.U8(c.scale.empty() ? 0 : 1);
    WriteFloats(w, c.mean);
    WriteFloats(w, c.scale);
    WriteFloats(w, c.basis);
    for (const ComponentQuantizer& q : c.components) {
      w.U8(static_cast<uint8_t>(q.bits));
      w.Raw(&q.offset, sizeof(q.offset));
      w.Raw(&q.step, sizeof(q.step));
    }
  }
}

// The least bytes WriteCodes writes for one code of dim d (no scale).
int64_t MinCodeBytes(int64_t d) { return 1 + 4 * (d + d * d) + 9 * d; }

absl::StatusOr<std::vector<float>> ReadFloats(ImageReader& r, std::string_view field, int64_t n) {
  absl::StatusOr<std::string_view> bytes = r.Raw(field, static_cast<uint64_t>(n) * sizeof(float));
  if (!bytes.ok()) return bytes.status();
  std::vector<float> v(static_cast<size_t>(n));
  if (n > 0) std::memcpy(v.data(), bytes->data(), bytes->size());
  for (float x : v) {
    if (!std::isfinite(x))
      return r.Corrupt(absl::StrFormat("a non-finite number in its %s", field));
  }
  return v;
}

absl::StatusOr<std::shared_ptr<const std::vector<TransformCode>>> ReadCodes(ImageReader& r,
                                                                            int64_t n, int d) {
  auto codes = std::make_shared<std::vector<TransformCode>>(static_cast<size_t>(n));
  for (TransformCode& c : *codes) {
    c.dim = d;
    absl::StatusOr<uint8_t> scaled = r.U8("epoch code's scale flag");
    if (!scaled.ok()) return scaled.status();
    if (*scaled > 1) return r.Corrupt(absl::StrFormat("epoch code's scale flag %d", *scaled));
    for (auto [field, v, count] :
         {std::tuple{"epoch code's mean", &c.mean, int64_t{d}},
          std::tuple{"epoch code's scale", &c.scale, *scaled != 0 ? int64_t{d} : 0},
          std::tuple{"epoch code's basis", &c.basis, int64_t{d} * d}}) {
      absl::StatusOr<std::vector<float>> read = ReadFloats(r, field, count);
      if (!read.ok()) return read.status();
      *v = *std::move(read);
    }
    c.components.resize(static_cast<size_t>(d));
    for (ComponentQuantizer& q : c.components) {
      absl::StatusOr<uint8_t> bits = r.U8("component bits");
      if (!bits.ok()) return bits.status();
      if (*bits > ComponentQuantizer::kMaxBits) {
        return r.Corrupt(absl::StrFormat("an epoch code's component has %d bits", *bits));
      }
      absl::StatusOr<std::vector<float>> numbers = ReadFloats(r, "component quantizer", 2);
      if (!numbers.ok()) return numbers.status();
      q = {.bits = static_cast<int>(*bits), .offset = (*numbers)[0], .step = (*numbers)[1]};
    }
  }
  return codes;
}

}  // namespace

int64_t TransformCodedBlockBytes(const std::vector<TransformCode>& key_codes,
                                 const std::vector<TransformCode>& value_codes, int layer,
                                 int n_kv_heads, int block_size) {
  int64_t bytes = 0;
  for (const auto* codes : {&key_codes, &value_codes}) {
    for (int h = 0; h < n_kv_heads; ++h) {
      bytes += LayOutCodedRun((*codes)[static_cast<size_t>(layer * n_kv_heads + h)], block_size)
                   .run_bytes;
    }
  }
  return bytes;
}

std::string_view TransformImage::Own(std::string bytes) {
  owned_.push_back(std::make_unique<std::string>(std::move(bytes)));
  return *owned_.back();
}

TransformImageFormat::TransformImageFormat(const KvCacheGeometry& g, int block_size,
                                           int sink_tokens, int window_tokens, bool pre_rope_keys,
                                           const std::vector<TransformCode>& key_codes,
                                           const std::vector<TransformCode>& value_codes)
    : geometry_(g), block_size_(block_size) {
  Fnv1a h;
  for (const auto* codes : {&key_codes, &value_codes}) {
    for (const TransformCode& c : *codes) {
      h.Add(&c.dim, sizeof(c.dim));
      h.AddVector(c.mean);
      h.AddVector(c.scale);
      h.AddVector(c.basis);
      for (const ComponentQuantizer& q : c.components) {
        h.Add(&q.bits, sizeof(q.bits));
        h.Add(&q.offset, sizeof(q.offset));
        h.Add(&q.step, sizeof(q.step));
      }
    }
  }
  // "image=2": the entropy-coded format; the first one (raw codes) is refused by its line.
  layout_ = absl::StrFormat(
      "transform image=2 layers=%d kv_heads=%d head_dim=%d block=%d sinks=%d window=%d keys=%s "
      "codes=%016x",
      g.n_layers, g.n_kv_heads, g.head_dim, block_size, sink_tokens, window_tokens,
      pre_rope_keys ? "pre-rope" : "post-rope", h.value());
  layers_ = LayersOf(key_codes, value_codes);
}

std::vector<TransformImageFormat::Layer> TransformImageFormat::LayersOf(
    const std::vector<TransformCode>& key_codes,
    const std::vector<TransformCode>& value_codes) const {
  const KvCacheGeometry& g = geometry_;
  std::vector<Layer> layers;
  for (int l = 0; l < g.n_layers; ++l) {
    Layer layer;
    for (const auto* codes : {&key_codes, &value_codes}) {
      for (int kvh = 0; kvh < g.n_kv_heads; ++kvh) {
        const TransformCode& code = (*codes)[static_cast<size_t>(l * g.n_kv_heads + kvh)];
        const CodedRunLayout laid = LayOutCodedRun(code, block_size_);
        Run run;
        run.at = layer.bytes;
        for (int a = 0; a < laid.active(); ++a) {
          run.bits.push_back(code.components[static_cast<size_t>(laid.components[a])].bits);
          run.byte_at.push_back(laid.byte_at[static_cast<size_t>(a)]);
        }
        layer.bytes += laid.run_bytes;
        layer.runs.push_back(std::move(run));
      }
    }
    layers.push_back(std::move(layer));
  }
  return layers;
}

std::string TransformImageFormat::Write(const TransformImage& image, bool entropy_coded) const {
  const int n_layers = geometry_.n_layers;
  const auto part = [&](int l, int64_t b) -> const TransformImage::Part& {
    return image.parts[static_cast<size_t>(l * image.blocks + b)];
  };
  const bool with_epochs = !image.epochs.empty();
  // Each epoch's runs: epoch 0's are this format's.
  std::vector<std::vector<Layer>> epoch_layers;
  for (const TransformCodes& e : image.epochs) epoch_layers.push_back(LayersOf(*e.keys, *e.values));
  const auto layer_of = [&](int64_t epoch, int l) -> const Layer& {
    return (epoch == 0 ? layers_
                       : epoch_layers[static_cast<size_t>(epoch - 1)])[static_cast<size_t>(l)];
  };
  ImageWriter w;
  w.Bytes(layout_);
  w.I64(image.length);
  w.I64(image.next_compress);
  w.U8(static_cast<uint8_t>((entropy_coded ? kRangeCoded : 0) | (with_epochs ? kWithEpochs : 0)));
  if (with_epochs) {
    w.I64(static_cast<int64_t>(image.epochs.size()));
    for (const TransformCodes& e : image.epochs) {
      WriteCodes(w, *e.keys);
      WriteCodes(w, *e.values);
    }
    w.I64(image.current_epoch);
  }
  for (int l = 0; l < n_layers; ++l) {
    for (int64_t b = 0; b < image.blocks; ++b) {
      w.U8(part(l, b).coded ? kCodedBlock : kFullBlock);
      if (with_epochs && part(l, b).coded) w.I32(static_cast<int32_t>(part(l, b).epoch));
    }
  }
  for (int plane = 1; plane >= 0; --plane) {  // high bytes, then low bytes
    for (int l = 0; l < n_layers; ++l) {
      for (int64_t b = 0; b < image.blocks; ++b) {
        if (part(l, b).coded) continue;
        const std::string_view rows = part(l, b).bytes;
        for (size_t i = static_cast<size_t>(plane); i < rows.size(); i += 2) w.Raw(&rows[i], 1);
      }
    }
  }
  std::string stream;
  for (int l = 0; l < n_layers; ++l) {
    if (!entropy_coded) {  // the blocks' bytes as stored
      for (int64_t b = 0; b < image.blocks; ++b) {
        if (part(l, b).coded) w.Raw(part(l, b).bytes.data(), part(l, b).bytes.size());
      }
      continue;
    }
    RangeEncoder enc;
    for (int64_t e = 0; e <= static_cast<int64_t>(image.epochs.size()); ++e) {
      for (const Run& run : layer_of(e, l).runs) {
        for (size_t a = 0; a < run.bits.size(); ++a) {
          CodeModel model(run.bits[a]);
          for (int64_t b = 0; b < image.blocks; ++b) {
            if (!part(l, b).coded || part(l, b).epoch != e) continue;
            const auto* block = reinterpret_cast<const uint8_t*>(part(l, b).bytes.data()) + run.at;
            for (int t = 0; t < block_size_; ++t) {
              const uint32_t code = RunCode(block + run.byte_at[a], run.bits[a], t);
              enc.EncodeSymbol(model.Tree(), run.bits[a], code);
              model.Saw(code);
            }
          }
        }
      }
    }
    stream.clear();
    enc.Finish(&stream);
    w.Bytes(stream);
  }
  return w.Take();
}

absl::StatusOr<TransformImage> TransformImageFormat::Read(std::string_view image,
                                                          int64_t max_blocks) const {
  const KvCacheGeometry& g = geometry_;
  const int bs = block_size_;
  ImageReader r(image, "transform KV cache image");
  if (absl::Status st = r.ExpectLayout(layout_); !st.ok()) return st;
  const int64_t hd = g.head_dim;
  const int n_kv = g.n_kv_heads;
  TransformImage out;
  // Bounded by the image (every block takes at least its kind byte).
  absl::StatusOr<int64_t> length = r.Int("length", 0, int64_t{1} << 40);
  if (!length.ok()) return length.status();
  out.length = *length;
  out.blocks = CeilDiv(*length, int64_t{bs});
  absl::StatusOr<int64_t> next_compress = r.Int("next_compress", 0, out.blocks);
  if (!next_compress.ok()) return next_compress.status();
  out.next_compress = *next_compress;
  absl::StatusOr<uint8_t> form = r.U8("codes' form");
  if (!form.ok()) return form.status();
  if ((*form & ~(kRangeCoded | kWithEpochs)) != 0) {
    return r.Corrupt(absl::StrFormat("codes' form %d", *form));
  }
  const bool range_coded = (*form & kRangeCoded) != 0;
  // Each epoch's runs; epoch 0's are this format's.
  std::vector<std::vector<Layer>> epoch_layers;
  if ((*form & kWithEpochs) != 0) {
    const int64_t codes_per_side = int64_t{g.n_layers} * n_kv;
    const int64_t min_epoch_bytes = 2 * codes_per_side * MinCodeBytes(hd);
    absl::StatusOr<int64_t> n_epochs =
        r.Int("epochs", 1,
              std::min<int64_t>(kMaxImageEpochs, static_cast<int64_t>(r.left()) / min_epoch_bytes));
    if (!n_epochs.ok()) return n_epochs.status();
    for (int64_t e = 1; e <= *n_epochs; ++e) {
      TransformCodes codes;
      for (auto* side : {&codes.keys, &codes.values}) {
        absl::StatusOr<std::shared_ptr<const std::vector<TransformCode>>> read =
            ReadCodes(r, codes_per_side, g.head_dim);
        if (!read.ok()) return read.status();
        *side = *std::move(read);
      }
      epoch_layers.push_back(LayersOf(*codes.keys, *codes.values));
      for (int l = 0; l < g.n_layers; ++l) {
        const int64_t bytes = epoch_layers.back()[static_cast<size_t>(l)].bytes;
        if (bytes > layers_[static_cast<size_t>(l)].bytes) {
          return r.Corrupt(absl::StrFormat(
              "epoch %d codes a block of layer %d in %d bytes, more than the cache's %d", e, l,
              bytes, layers_[static_cast<size_t>(l)].bytes));
        }
      }
      out.epochs.push_back(std::move(codes));
    }
    absl::StatusOr<int64_t> current = r.Int("current epoch", 0, *n_epochs);
    if (!current.ok()) return current.status();
    out.current_epoch = *current;
  }
  const int64_t n_epochs = static_cast<int64_t>(out.epochs.size());
  const auto layer_of = [&](int64_t epoch, int l) -> const Layer& {
    return (epoch == 0 ? layers_
                       : epoch_layers[static_cast<size_t>(epoch - 1)])[static_cast<size_t>(l)];
  };
  if (static_cast<uint64_t>(out.blocks * g.n_layers) > r.left()) {
    return r.Corrupt(absl::StrFormat("%d tokens need %d blocks, it holds %d bytes", *length,
                                     out.blocks * g.n_layers, r.left()));
  }
  // Before a byte is decoded: range-coded codes expand, so their bound is the pool.
  if (range_coded && out.blocks * g.n_layers > max_blocks) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("KV cache full: the image holds %d block-layers, the pool %d",
                        out.blocks * g.n_layers, max_blocks));
  }
  out.parts.resize(static_cast<size_t>(out.blocks * g.n_layers));
  const auto rows_of = [&](int64_t b) {
    return 2 * n_kv * std::min<int64_t>(bs, *length - b * bs) * hd * 2;
  };
  int64_t full_bytes = 0;
  std::vector<int64_t> coded_bytes(static_cast<size_t>(g.n_layers), 0);  // per layer
  std::vector<bool> epoch_used(static_cast<size_t>(n_epochs + 1), false);
  epoch_used[static_cast<size_t>(out.current_epoch)] = true;
  for (int l = 0; l < g.n_layers; ++l) {
    for (int64_t b = 0; b < out.blocks; ++b) {
      absl::StatusOr<uint8_t> kind = r.U8("block kind");
      if (!kind.ok()) return kind.status();
      if (*kind != kFullBlock && *kind != kCodedBlock) {
        return r.Corrupt(absl::StrFormat("layer %d block %d has kind %d", l, b, *kind));
      }
      if (*kind == kCodedBlock && b * bs + bs > *length) {
        return r.Corrupt(absl::StrFormat("layer %d block %d is coded but holds %d of %d tokens", l,
                                         b, *length - b * bs, bs));
      }
      TransformImage::Part& part = out.parts[static_cast<size_t>(l * out.blocks + b)];
      part.coded = *kind == kCodedBlock;
      if (!part.coded) {
        full_bytes += rows_of(b);
        continue;
      }
      if (n_epochs > 0) {
        absl::StatusOr<int32_t> epoch = r.I32("block epoch");
        if (!epoch.ok()) return epoch.status();
        if (*epoch < 0 || *epoch > n_epochs) {
          return r.Corrupt(
              absl::StrFormat("layer %d block %d has epoch %d of %d", l, b, *epoch, n_epochs));
        }
        part.epoch = *epoch;
        epoch_used[static_cast<size_t>(*epoch)] = true;
      }
      coded_bytes[static_cast<size_t>(l)] += layer_of(part.epoch, l).bytes;
    }
  }
  for (int64_t e = 1; e <= n_epochs; ++e) {
    if (!epoch_used[static_cast<size_t>(e)]) {
      return r.Corrupt(absl::StrFormat("epoch %d is used by no block", e));
    }
  }
  absl::StatusOr<std::string_view> high = r.Raw("full rows' high bytes", full_bytes / 2);
  if (!high.ok()) return high.status();
  absl::StatusOr<std::string_view> low = r.Raw("full rows' low bytes", full_bytes / 2);
  if (!low.ok()) return low.status();
  std::string interleaved(static_cast<size_t>(full_bytes), '\0');
  for (size_t i = 0; i < high->size(); ++i) {
    interleaved[2 * i] = (*low)[i];
    interleaved[2 * i + 1] = (*high)[i];
  }
  const std::string_view rows = out.Own(std::move(interleaved));
  int64_t row_at = 0;
  for (int l = 0; l < g.n_layers; ++l) {
    for (int64_t b = 0; b < out.blocks; ++b) {
      TransformImage::Part& part = out.parts[static_cast<size_t>(l * out.blocks + b)];
      if (part.coded) continue;
      part.bytes = rows.substr(static_cast<size_t>(row_at), static_cast<size_t>(rows_of(b)));
      row_at += rows_of(b);
    }
  }
  // A layer's coded blocks' bytes, one after the other in block order, each its epoch's size.
  const auto assign = [&](int l, std::string_view codes) {
    int64_t at = 0;
    for (int64_t b = 0; b < out.blocks; ++b) {
      TransformImage::Part& part = out.parts[static_cast<size_t>(l * out.blocks + b)];
      if (!part.coded) continue;
      const int64_t bytes = layer_of(part.epoch, l).bytes;
      part.bytes = codes.substr(static_cast<size_t>(at), static_cast<size_t>(bytes));
      at += bytes;
    }
  };
  if (!range_coded) {
    for (int l = 0; l < g.n_layers; ++l) {
      absl::StatusOr<std::string_view> codes =
          r.Raw("coded blocks", static_cast<uint64_t>(coded_bytes[static_cast<size_t>(l)]));
      if (!codes.ok()) return codes.status();
      assign(l, *codes);
    }
    if (absl::Status st = r.ExpectEnd(); !st.ok()) return st;
    return out;
  }
  std::vector<std::string_view> streams;
  for (int l = 0; l < g.n_layers; ++l) {
    absl::StatusOr<std::string_view> stream = r.Bytes("coded blocks' stream", r.left());
    if (!stream.ok()) return stream.status();
    streams.push_back(*stream);
  }
  if (absl::Status st = r.ExpectEnd(); !st.ok()) return st;
  // The layers' streams are independent: decoded side by side (a restore waits for them). The
  // decoded codes are at most max_blocks blocks' worth of epoch 0's (checked above).
  std::vector<std::string> codes(static_cast<size_t>(g.n_layers));
  std::vector<char> overran(static_cast<size_t>(g.n_layers), 0);
#pragma omp parallel for schedule(dynamic, 1) if (g.n_layers > 1)
  for (int l = 0; l < g.n_layers; ++l) {
    const auto li = static_cast<size_t>(l);
    codes[li].assign(static_cast<size_t>(coded_bytes[li]), '\0');
    auto* blocks = reinterpret_cast<uint8_t*>(codes[li].data());
    std::vector<int64_t> block_at(static_cast<size_t>(out.blocks), 0);  // in `blocks`
    int64_t at = 0;
    for (int64_t b = 0; b < out.blocks; ++b) {
      const TransformImage::Part& part = out.parts[static_cast<size_t>(l * out.blocks + b)];
      if (!part.coded) continue;
      block_at[static_cast<size_t>(b)] = at;
      at += layer_of(part.epoch, l).bytes;
    }
    RangeDecoder dec({reinterpret_cast<const uint8_t*>(streams[li].data()), streams[li].size()});
    for (int64_t e = 0; e <= n_epochs && !dec.overran(); ++e) {
      for (const Run& run : layer_of(e, l).runs) {
        for (size_t a = 0; a < run.bits.size() && !dec.overran(); ++a) {
          CodeModel model(run.bits[a]);
          for (int64_t b = 0; b < out.blocks; ++b) {
            const TransformImage::Part& part = out.parts[static_cast<size_t>(l * out.blocks + b)];
            if (!part.coded || part.epoch != e) continue;
            uint8_t* block = blocks + block_at[static_cast<size_t>(b)] + run.at;
            for (int t = 0; t < bs; ++t) {
              const uint32_t code = dec.DecodeSymbol(model.Tree(), run.bits[a]);
              PutRunCode(block + run.byte_at[a], run.bits[a], t, code);
              model.Saw(code);
            }
          }
        }
      }
    }
    overran[li] = dec.overran() ? 1 : 0;
  }
  for (int l = 0; l < g.n_layers; ++l) {
    if (overran[static_cast<size_t>(l)] != 0) {
      return r.Corrupt(absl::StrFormat("layer %d: its coded blocks' stream ends early", l));
    }
    assign(l, out.Own(std::move(codes[static_cast<size_t>(l)])));
  }
  return out;
}

absl::StatusOr<std::string> TransformImageFormat::Compact(std::string_view image) const {
  // A stored-form image holds its codes: reading it expands nothing. A compact one is returned
  // as it is (its form byte says so: after the layout line, length and next_compress).
  ImageReader r(image, "transform KV cache image");
  if (absl::Status st = r.ExpectLayout(layout_); !st.ok()) return st;
  for (const char* field : {"length", "next_compress"}) {
    if (absl::StatusOr<int64_t> v = r.I64(field); !v.ok()) return v.status();
  }
  absl::StatusOr<uint8_t> form = r.U8("codes' form");
  if (!form.ok()) return form.status();
  if ((*form & kRangeCoded) != 0) return std::string(image);
  absl::StatusOr<TransformImage> read = Read(image, /*max_blocks=*/0);
  if (!read.ok()) return read.status();
  return Write(*read, /*entropy_coded=*/true);
}

}  // namespace subspace
