// Codec file writer (GgufWriter) and reader (GgufFile, which bounds-checks every read); see
// codec_file.h.
#include "core/compress/codec_file.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/compress/basis_file.h"
#include "core/gguf/gguf_writer.h"

namespace subspace {
namespace {

constexpr char kPrefix[] = "subspace.basis.";

std::string Key(const std::string& name) { return absl::StrCat(kPrefix, name); }
std::string TensorName(int layer, int head, const char* side, const char* what) {
  return absl::StrFormat("blk.%d.head.%d.%s.%s", layer, head, side, what);
}

absl::Status Invalid(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("codec file: ", what));
}

// The code's tensors as named in the file: checks one code against head_dim and its budget.
absl::Status ValidateCode(const TransformCode& c, int d, const std::string& name) {
  if (c.dim != d || c.mean.size() != static_cast<size_t>(d) ||
      c.basis.size() != static_cast<size_t>(d) * d ||
      c.components.size() != static_cast<size_t>(d) ||
      (!c.scale.empty() && c.scale.size() != static_cast<size_t>(d))) {
    return Invalid(absl::StrCat(name, ": sizes do not match head_dim ", d));
  }
  for (int i = 0; i < d; ++i) {
    if (!std::isfinite(c.mean[static_cast<size_t>(i)])) {
      return Invalid(absl::StrCat(name, ".mean[", i, "] is not finite"));
    }
    if (!c.scale.empty() && !(c.scale[static_cast<size_t>(i)] > 0.0f &&
                              std::isfinite(c.scale[static_cast<size_t>(i)]))) {
      return Invalid(absl::StrCat(name, ".scale[", i, "] is not positive and finite"));
    }
  }
  for (int j = 0; j < d; ++j) {
    const ComponentQuantizer& q = c.components[static_cast<size_t>(j)];
    if (q.bits < 0 || q.bits > ComponentQuantizer::kMaxBits) {
      return Invalid(absl::StrCat(name, ".quant[", j, "]: ", q.bits, " bits, outside [0, 8]"));
    }
    if (!std::isfinite(q.offset)) {
      return Invalid(absl::StrCat(name, ".quant[", j, "]: the offset is not finite"));
    }
    if (q.bits > 0 && !(q.step > 0.0f && std::isfinite(q.step))) {
      return Invalid(absl::StrCat(name, ".quant[", j, "]: the step is not positive and finite"));
    }
  }
  // Orthonormal rows: what the encoder's projection and the decoder's sum both assume.
  for (int a = 0; a < d; ++a) {
    for (int b = a; b < d; ++b) {
      double dot = 0.0;
      for (int i = 0; i < d; ++i) {
        dot += static_cast<double>(c.basis[static_cast<size_t>(a) * d + i]) *
               c.basis[static_cast<size_t>(b) * d + i];
      }
      if (!(std::fabs(dot - (a == b ? 1.0 : 0.0)) <= 1e-3)) {
        return Invalid(absl::StrFormat("%s.basis: rows %d and %d have dot product %g, not %d", name,
                                       a, b, dot, a == b ? 1 : 0));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ReadMatrix(const GgufFile& file, const std::string& name, int64_t rows, int64_t cols,
                        float* dst) {
  return ReadF32Matrix(file, name, rows, cols, dst, "codec file");
}

}  // namespace

absl::Status ValidateCodecFile(const CodecFile& c) {
  const KvCacheGeometry& g = c.geometry;
  if (g.n_layers < 1 || g.n_kv_heads < 1 || g.head_dim < 1) {
    return Invalid("the geometry needs at least one layer, KV head and dim");
  }
  const size_t heads = static_cast<size_t>(g.n_layers) * g.n_kv_heads;
  if (c.keys.size() != heads || c.values.size() != heads) {
    return Invalid(absl::StrFormat("%d key and %d value codes for %d layer-heads", c.keys.size(),
                                   c.values.size(), heads));
  }
  for (auto [bits, name] :
       {std::pair{c.info.key_bits, "key_bits"}, std::pair{c.info.value_bits, "value_bits"}}) {
    if (!(bits >= 0.0 && bits <= 8.0)) {
      return Invalid(absl::StrCat(Key(name), " = ", bits, ", outside [0, 8]"));
    }
  }
  int64_t total = 0;
  for (int side = 0; side < 2; ++side) {
    for (size_t at = 0; at < heads; ++at) {
      const TransformCode& code = (side == 0 ? c.keys : c.values)[at];
      const std::string base =
          absl::StrFormat("blk.%d.head.%d.%s", static_cast<int>(at) / g.n_kv_heads,
                          static_cast<int>(at) % g.n_kv_heads, side == 0 ? "k" : "v");
      if (absl::Status s = ValidateCode(code, g.head_dim, base); !s.ok()) return s;
      total += code.BitsPerRow();
      const double bits = side == 0 ? c.info.key_bits : c.info.value_bits;
      if (!c.info.joint && code.BitsPerRow() > std::lround(bits * g.head_dim)) {
        return Invalid(absl::StrFormat("%s.quant: %d bits per row exceed the budget of %g x %d",
                                       base, code.BitsPerRow(), bits, g.head_dim));
      }
    }
  }
  const double mean_bits = 0.5 * (c.info.key_bits + c.info.value_bits);
  if (c.info.joint &&
      total > std::lround(mean_bits * g.head_dim * static_cast<double>(2 * heads))) {
    return Invalid(absl::StrFormat("%d bits over all rows exceed the joint budget of %g x %d x %d",
                                   total, mean_bits, g.head_dim, 2 * heads));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SerializeCodecFile(const CodecFile& c) {
  if (absl::Status s = ValidateCodecFile(c); !s.ok()) return s;
  const KvCacheGeometry& g = c.geometry;
  GgufWriter w;
  w.AddString("general.architecture", "subspace-basis");
  w.AddUint32(Key("version"), kBasisFileTransformCodec);
  w.AddFloat64(Key("key_bits"), c.info.key_bits);
  w.AddFloat64(Key("value_bits"), c.info.value_bits);
  w.AddUint32(Key("pre_rope_keys"), c.info.pre_rope_keys ? 1 : 0);
  w.AddUint32(Key("attention_weighted"), c.info.attention_weighted ? 1 : 0);
  w.AddUint32(Key("joint"), c.info.joint ? 1 : 0);
  w.AddUint64(Key("calibration_tokens"), c.info.calibration_tokens);
  w.AddUint64(Key("model_fnv1a64"), c.info.model_checksum);
  w.AddUint32(Key("n_layers"), static_cast<uint32_t>(g.n_layers));
  w.AddUint32(Key("n_kv_heads"), static_cast<uint32_t>(g.n_kv_heads));
  w.AddUint32(Key("head_dim"), static_cast<uint32_t>(g.head_dim));
  const int64_t d = g.head_dim;
  std::vector<float> ones(static_cast<size_t>(d), 1.0f), quant(static_cast<size_t>(d) * 3);
  for (int l = 0; l < g.n_layers; ++l) {
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const size_t at = static_cast<size_t>(l) * g.n_kv_heads + static_cast<size_t>(h);
      for (const char* side : {"k", "v"}) {
        const TransformCode& code = side[0] == 'k' ? c.keys[at] : c.values[at];
        for (int64_t j = 0; j < d; ++j) {
          const ComponentQuantizer& q = code.components[static_cast<size_t>(j)];
          quant[static_cast<size_t>(3 * j)] = static_cast<float>(q.bits);
          quant[static_cast<size_t>(3 * j + 1)] = q.offset;
          quant[static_cast<size_t>(3 * j + 2)] = q.step;
        }
        w.AddF32Matrix(TensorName(l, h, side, "mean"), 1, d, code.mean.data());
        w.AddF32Matrix(TensorName(l, h, side, "scale"), 1, d,
                       code.scale.empty() ? ones.data() : code.scale.data());
        w.AddF32Matrix(TensorName(l, h, side, "basis"), d, d, code.basis.data());
        w.AddF32Matrix(TensorName(l, h, side, "quant"), d, 3, quant.data());
      }
    }
  }
  return w.Build();
}

absl::Status WriteCodecFile(const std::string& path, const CodecFile& codec) {
  absl::StatusOr<std::string> bytes = SerializeCodecFile(codec);
  if (!bytes.ok()) return bytes.status();
  return WriteFileBytes(path, *bytes, "codec file");
}

absl::StatusOr<CodecFile> ParseCodecFile(const GgufFile& file) {
  if (absl::Status s = RequireBasisFileVersion(file, kBasisFileTransformCodec, "codec file");
      !s.ok()) {
    return s;
  }
  CodecFile c;
  for (auto [field, name] :
       {std::pair{&c.info.key_bits, "key_bits"}, std::pair{&c.info.value_bits, "value_bits"}}) {
    absl::StatusOr<double> bits = file.GetFloat(Key(name));
    if (!bits.ok()) return Invalid(std::string(bits.status().message()));
    *field = *bits;
  }
  for (auto [field, name] : {std::pair{&c.info.pre_rope_keys, "pre_rope_keys"},
                             std::pair{&c.info.attention_weighted, "attention_weighted"},
                             std::pair{&c.info.joint, "joint"}}) {
    absl::StatusOr<uint64_t> v = file.GetUint(Key(name));
    if (!v.ok()) return Invalid(std::string(v.status().message()));
    if (*v > 1) return Invalid(absl::StrCat(Key(name), " = ", *v, ", not 0 or 1"));
    *field = *v == 1;
  }
  for (auto [field, name] : {std::pair{&c.info.calibration_tokens, "calibration_tokens"},
                             std::pair{&c.info.model_checksum, "model_fnv1a64"}}) {
    absl::StatusOr<uint64_t> v = file.GetUint(Key(name));
    if (!v.ok()) return Invalid(std::string(v.status().message()));
    *field = *v;
  }
  KvCacheGeometry& g = c.geometry;
  for (auto [field, name] :
       {std::pair{&g.n_layers, "n_layers"}, std::pair{&g.n_kv_heads, "n_kv_heads"},
        std::pair{&g.head_dim, "head_dim"}}) {
    absl::StatusOr<uint64_t> v = file.GetUint(Key(name));
    if (!v.ok()) return Invalid(std::string(v.status().message()));
    if (*v < 1 || *v > 65536)
      return Invalid(absl::StrCat(Key(name), " = ", *v, " is out of range"));
    *field = static_cast<int>(*v);
  }
  // Every tensor must lie in the file, so a geometry claiming more bytes than the file has is
  // refused before anything is allocated for it.
  const unsigned __int128 d = static_cast<unsigned>(g.head_dim);
  const unsigned __int128 needed = static_cast<unsigned __int128>(g.n_layers) *
                                   static_cast<unsigned>(g.n_kv_heads) * 2 * (d * d + 5 * d) * 4;
  if (needed > file.bytes().size()) {
    return Invalid(absl::StrFormat(
        "%d layers x %d KV heads x head_dim %d need more tensor bytes than the file's %d",
        g.n_layers, g.n_kv_heads, g.head_dim, file.bytes().size()));
  }
  const size_t heads = static_cast<size_t>(g.n_layers) * g.n_kv_heads;
  c.keys.resize(heads);
  c.values.resize(heads);
  const int64_t dim = g.head_dim;
  std::vector<float> quant(static_cast<size_t>(dim) * 3);
  for (int l = 0; l < g.n_layers; ++l) {
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const size_t at = static_cast<size_t>(l) * g.n_kv_heads + static_cast<size_t>(h);
      for (const char* side : {"k", "v"}) {
        TransformCode& code = side[0] == 'k' ? c.keys[at] : c.values[at];
        code.dim = g.head_dim;
        code.mean.resize(static_cast<size_t>(dim));
        code.scale.resize(static_cast<size_t>(dim));
        code.basis.resize(static_cast<size_t>(dim * dim));
        for (absl::Status s :
             {ReadMatrix(file, TensorName(l, h, side, "mean"), 1, dim, code.mean.data()),
              ReadMatrix(file, TensorName(l, h, side, "scale"), 1, dim, code.scale.data()),
              ReadMatrix(file, TensorName(l, h, side, "basis"), dim, dim, code.basis.data()),
              ReadMatrix(file, TensorName(l, h, side, "quant"), dim, 3, quant.data())}) {
          if (!s.ok()) return s;
        }
        bool unit = true;
        for (float s : code.scale) unit = unit && s == 1.0f;
        if (unit) code.scale.clear();
        for (int64_t j = 0; j < dim; ++j) {
          const float bits = quant[static_cast<size_t>(3 * j)];
          if (!(bits >= 0.0f && bits <= 8.0f) || bits != std::floor(bits)) {
            return Invalid(absl::StrCat(TensorName(l, h, side, "quant"), "[", j, "]: ", bits,
                                        " bits, not a whole number in [0, 8]"));
          }
          code.components.push_back({.bits = static_cast<int>(bits),
                                     .offset = quant[static_cast<size_t>(3 * j + 1)],
                                     .step = quant[static_cast<size_t>(3 * j + 2)]});
        }
      }
    }
  }
  if (absl::Status s = ValidateCodecFile(c); !s.ok()) return s;
  return c;
}

absl::StatusOr<CodecFile> ReadCodecFile(const std::string& path) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) {
    return absl::Status(file.status().code(),
                        absl::StrCat("codec file ", path, ": ", file.status().message()));
  }
  return ParseCodecFile(**file);
}

absl::StatusOr<CodecFile> LoadCodecForModel(const std::string& path, const GgufFile& model,
                                            const KvCacheGeometry& g, const std::string& label) {
  absl::StatusOr<CodecFile> c = ReadCodecFile(path);
  if (!c.ok()) return c.status();
  const KvCacheGeometry& b = c->geometry;
  if (b.n_layers != g.n_layers || b.n_kv_heads != g.n_kv_heads || b.head_dim != g.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: codec geometry %d layers x %d KV heads x head_dim %d does not match the model's "
        "%d x %d x %d",
        label, b.n_layers, b.n_kv_heads, b.head_dim, g.n_layers, g.n_kv_heads, g.head_dim));
  }
  if (c->info.model_checksum != ModelChecksum(model)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: codec fitted on a different model file (checksum %016x, this model %016x)", label,
        c->info.model_checksum, ModelChecksum(model)));
  }
  return c;
}

}  // namespace subspace
