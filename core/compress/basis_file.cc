// Basis file writer (through GgufWriter) and reader (through GgufFile, which bounds-checks
// every read); see basis_file.h.
#include "core/compress/basis_file.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/gguf/gguf_writer.h"

namespace subspace {
namespace {

constexpr char kPrefix[] = "subspace.basis.";

std::string Key(const std::string& name) { return absl::StrCat(kPrefix, name); }
std::string TensorName(int layer, int head, const char* what) {
  return absl::StrFormat("blk.%d.head.%d.%s", layer, head, what);
}

absl::Status Invalid(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("basis file: ", what));
}

absl::Status ReadMatrix(const GgufFile& file, const std::string& name, int64_t rows, int64_t cols,
                        float* dst) {
  return ReadF32Matrix(file, name, rows, cols, dst, "basis file");
}

absl::StatusOr<int> ReadDim(const GgufFile& file, const std::string& name) {
  absl::StatusOr<uint64_t> v = file.GetUint(Key(name));
  if (!v.ok()) return Invalid(std::string(v.status().message()));
  if (*v < 1 || *v > 65536) return Invalid(absl::StrCat(Key(name), " = ", *v, " is out of range"));
  return static_cast<int>(*v);
}

}  // namespace

absl::StatusOr<uint32_t> BasisFileVersion(const GgufFile& file) {
  absl::StatusOr<std::string> arch = file.GetString("general.architecture");
  if (arch.ok() && *arch != "subspace-basis") {
    return Invalid(absl::StrCat("general.architecture is '", *arch,
                                "', not subspace-basis: a model, not a basis file?"));
  }
  absl::StatusOr<uint64_t> v = file.GetUint(Key("version"));
  if (absl::IsNotFound(v.status())) return kBasisFileLowRank;
  if (!v.ok()) return Invalid(std::string(v.status().message()));
  if (*v < kBasisFileLowRank || *v > kBasisFileTransformCodec) {
    return Invalid(absl::StrCat(Key("version"), " = ", *v, ": this build reads versions ",
                                kBasisFileLowRank, " (low-rank bases) and ",
                                kBasisFileTransformCodec, " (transform codecs)"));
  }
  return static_cast<uint32_t>(*v);
}

absl::Status RequireBasisFileVersion(const GgufFile& file, uint32_t want, std::string_view label) {
  absl::StatusOr<uint32_t> version = BasisFileVersion(file);
  if (!version.ok()) return version.status();
  if (*version == want) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      std::string(label), ": ", Key("version"), " = ", *version, ": the file holds ",
      *version == kBasisFileLowRank ? "a low-rank basis (--bases), not a transform codec"
                                    : "a transform codec, not a low-rank basis"));
}

absl::Status ReadF32Matrix(const GgufFile& file, const std::string& name, int64_t rows,
                           int64_t cols, float* dst, std::string_view label) {
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(label), ": tensor ", name, what));
  };
  const GgufTensorInfo* t = file.FindTensor(name);
  if (t == nullptr) return invalid(" is missing");
  if (t->type != TensorType::kF32) {
    return invalid(absl::StrCat(" is ", TensorTypeName(t->type), ", expected F32"));
  }
  if (t->dims.size() != 2 || t->dims[0] != cols || t->dims[1] != rows) {
    std::string dims;
    for (int64_t d : t->dims) absl::StrAppend(&dims, dims.empty() ? "" : ", ", d);
    return invalid(absl::StrCat(" has dims {", dims, "}, expected {", cols, ", ", rows, "}"));
  }
  if (t->num_bytes != static_cast<uint64_t>(rows * cols) * 4) {
    return invalid(" has the wrong byte size");
  }
  std::memcpy(dst, t->data, t->num_bytes);  // GgufFile checked it lies inside the file
  return absl::OkStatus();
}

uint64_t ModelChecksum(const GgufFile& model) {
  constexpr uint64_t kOffset = 14695981039346656037ull, kPrime = 1099511628211ull;
  const std::string_view bytes = model.bytes();
  uint64_t h = kOffset;
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, bytes.data() + i, 8);
    h = (h ^ w) * kPrime;
  }
  for (; i < bytes.size(); ++i) h = (h ^ static_cast<uint8_t>(bytes[i])) * kPrime;
  return h;
}

absl::StatusOr<std::string> SerializeBasisFile(const BasisFileInfo& info, const Basis& basis) {
  const KvCacheGeometry& g = basis.geometry;
  std::vector<int> r_k, r_v;
  for (const LayerBasis& lb : basis.layers) {
    r_k.push_back(lb.rank_k);
    r_v.push_back(lb.rank_v);
  }
  if (absl::Status s = ValidateBasis(basis, g, r_k, r_v); !s.ok()) return s;
  GgufWriter w;
  w.AddString("general.architecture", "subspace-basis");
  w.AddUint32(Key("version"), kBasisFileLowRank);
  w.AddString(Key("method_k"), info.method_k);
  w.AddString(Key("method_v"), info.method_v);
  w.AddFloat64(Key("energy"), info.energy);
  w.AddUint64(Key("calibration_tokens"), info.calibration_tokens);
  w.AddUint64(Key("model_fnv1a64"), info.model_checksum);
  w.AddUint32(Key("n_layers"), static_cast<uint32_t>(g.n_layers));
  w.AddUint32(Key("n_kv_heads"), static_cast<uint32_t>(g.n_kv_heads));
  w.AddUint32(Key("head_dim"), static_cast<uint32_t>(g.head_dim));
  w.AddInt32Array(Key("rank_k"), r_k);
  w.AddInt32Array(Key("rank_v"), r_v);
  const int64_t d = g.head_dim;
  for (int l = 0; l < g.n_layers; ++l) {
    const LayerBasis& lb = basis.layers[static_cast<size_t>(l)];
    const int64_t rk = lb.rank_k, rv = lb.rank_v;
    for (int h = 0; h < g.n_kv_heads; ++h) {
      w.AddF32Matrix(TensorName(l, h, "p_q"), d, rk, lb.p_q.data() + h * d * rk);
      w.AddF32Matrix(TensorName(l, h, "p_k"), d, rk, lb.p_k.data() + h * d * rk);
      w.AddF32Matrix(TensorName(l, h, "p_v"), d, rv, lb.p_v.data() + h * d * rv);
      w.AddF32Matrix(TensorName(l, h, "r_v"), rv, d, lb.r_v.data() + h * rv * d);
    }
  }
  return w.Build();
}

absl::Status WriteBasisFile(const std::string& path, const BasisFileInfo& info,
                            const Basis& basis) {
  absl::StatusOr<std::string> bytes = SerializeBasisFile(info, basis);
  if (!bytes.ok()) return bytes.status();
  return WriteFileBytes(path, *bytes, "basis file");
}

absl::StatusOr<BasisFile> ParseBasisFile(const GgufFile& file) {
  if (absl::Status s = RequireBasisFileVersion(file, kBasisFileLowRank, "basis file"); !s.ok()) {
    return s;
  }
  BasisFile out;
  BasisFileInfo& info = out.info;
  for (auto [field, name] :
       {std::pair{&info.method_k, "method_k"}, std::pair{&info.method_v, "method_v"}}) {
    absl::StatusOr<std::string> s = file.GetString(Key(name));
    if (!s.ok()) return Invalid(std::string(s.status().message()));
    *field = *s;
  }
  absl::StatusOr<double> energy = file.GetFloat(Key("energy"));
  if (!energy.ok()) return Invalid(std::string(energy.status().message()));
  info.energy = *energy;
  for (auto [field, name] : {std::pair{&info.calibration_tokens, "calibration_tokens"},
                             std::pair{&info.model_checksum, "model_fnv1a64"}}) {
    absl::StatusOr<uint64_t> v = file.GetUint(Key(name));
    if (!v.ok()) return Invalid(std::string(v.status().message()));
    *field = *v;
  }
  KvCacheGeometry g;
  for (auto [field, name] :
       {std::pair{&g.n_layers, "n_layers"}, std::pair{&g.n_kv_heads, "n_kv_heads"},
        std::pair{&g.head_dim, "head_dim"}}) {
    absl::StatusOr<int> v = ReadDim(file, name);
    if (!v.ok()) return v.status();
    *field = *v;
  }
  std::vector<int> ranks[2];
  for (int side = 0; side < 2; ++side) {
    const std::string key = Key(side == 0 ? "rank_k" : "rank_v");
    absl::StatusOr<std::vector<int64_t>> r = file.GetIntArray(key);
    if (!r.ok()) return Invalid(std::string(r.status().message()));
    if (r->size() != static_cast<size_t>(g.n_layers)) {
      return Invalid(absl::StrCat(key, " has ", r->size(), " entries, expected ", g.n_layers));
    }
    for (int64_t x : *r) {
      if (x < 1 || x > g.head_dim) {
        return Invalid(absl::StrCat(key, " holds ", x, ", outside [1, ", g.head_dim, "]"));
      }
      ranks[side].push_back(static_cast<int>(x));
    }
  }
  // Every tensor must lie in the file as F32, so a geometry whose tensors need more bytes than
  // the file has is corrupt -- checked before allocating, or a few hundred bytes claiming huge
  // dimensions would make Basis::Zeros allocate gigabytes (found by basis_file_fuzzer).
  unsigned __int128 needed = 0;  // dims up to 65536 each: 64 bits could overflow
  for (int l = 0; l < g.n_layers; ++l) {
    needed += static_cast<unsigned __int128>(g.n_kv_heads) * static_cast<uint64_t>(g.head_dim) *
              (2 * static_cast<uint64_t>(ranks[0][l]) + 2 * static_cast<uint64_t>(ranks[1][l])) *
              sizeof(float);
  }
  if (needed > file.bytes().size()) {
    return Invalid(absl::StrFormat(
        "%d layers x %d KV heads x head_dim %d need more tensor bytes than the file's %d",
        g.n_layers, g.n_kv_heads, g.head_dim, file.bytes().size()));
  }
  out.basis = Basis::Zeros(g, ranks[0], ranks[1]);
  const int64_t d = g.head_dim;
  for (int l = 0; l < g.n_layers; ++l) {
    LayerBasis& lb = out.basis.layers[static_cast<size_t>(l)];
    const int64_t rk = lb.rank_k, rv = lb.rank_v;
    for (int h = 0; h < g.n_kv_heads; ++h) {
      for (absl::Status s :
           {ReadMatrix(file, TensorName(l, h, "p_q"), d, rk, lb.p_q.data() + h * d * rk),
            ReadMatrix(file, TensorName(l, h, "p_k"), d, rk, lb.p_k.data() + h * d * rk),
            ReadMatrix(file, TensorName(l, h, "p_v"), d, rv, lb.p_v.data() + h * d * rv),
            ReadMatrix(file, TensorName(l, h, "r_v"), rv, d, lb.r_v.data() + h * rv * d)}) {
        if (!s.ok()) return s;
      }
    }
  }
  return out;
}

absl::StatusOr<BasisFile> ReadBasisFile(const std::string& path) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) {
    return absl::Status(file.status().code(),
                        absl::StrCat("basis file ", path, ": ", file.status().message()));
  }
  return ParseBasisFile(**file);
}

absl::Status CheckBasisMatchesModel(const BasisFile& bases, const KvCacheGeometry& g,
                                    uint64_t model_checksum) {
  const KvCacheGeometry& b = bases.basis.geometry;
  if (b.n_layers != g.n_layers || b.n_kv_heads != g.n_kv_heads || b.head_dim != g.head_dim) {
    return Invalid(absl::StrFormat(
        "geometry %d layers x %d KV heads x head_dim %d does not match the model's %d x %d x %d",
        b.n_layers, b.n_kv_heads, b.head_dim, g.n_layers, g.n_kv_heads, g.head_dim));
  }
  if (bases.info.model_checksum != model_checksum) {
    return Invalid(
        absl::StrFormat("calibrated on a different model file (checksum %016x, this model %016x)",
                        bases.info.model_checksum, model_checksum));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Basis>> LoadBasisForModel(const std::string& path,
                                                               const GgufFile& model,
                                                               const KvCacheGeometry& geometry,
                                                               const std::string& label) {
  absl::StatusOr<BasisFile> file = ReadBasisFile(path);
  if (!file.ok()) return file.status();
  if (absl::Status s = CheckBasisMatchesModel(*file, geometry, ModelChecksum(model)); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(label, ": ", s.message()));
  }
  return std::make_shared<const Basis>(std::move(file->basis));
}

}  // namespace subspace
