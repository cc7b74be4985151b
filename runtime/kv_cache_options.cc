// Flag-level checks and construction of a host KV cache; see kv_cache_options.h.
#include "runtime/kv_cache_options.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/compress/basis_file.h"
#include "core/compress/codec_file.h"

namespace subspace::runtime {
namespace {

constexpr int kMaxCompressedBlockSize = 64;  // CompressedKvCacheConfig::block_size

absl::Status CheckRank(int rank, int head_dim, const char* flag) {
  if (rank < 1 || rank > head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " must be in [1, ", head_dim,
                                                   "] (the model's head_dim) or 0, got ", rank));
  }
  return absl::OkStatus();
}

}  // namespace

const char* KvCacheKindName(KvCacheKind kind) {
  switch (kind) {
    case KvCacheKind::kFull:
      return "full";
    case KvCacheKind::kCompressed:
      return "compressed";
    case KvCacheKind::kQuantized:
      return "quantized";
    case KvCacheKind::kTransform:
      return "transform";
  }
  return "unknown";
}

absl::StatusOr<KvCacheKind> ParseKvCacheKind(std::string_view name) {
  for (KvCacheKind kind : {KvCacheKind::kFull, KvCacheKind::kCompressed, KvCacheKind::kQuantized,
                           KvCacheKind::kTransform}) {
    if (name == KvCacheKindName(kind)) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-cache must be 'full', 'compressed', 'quantized' or 'transform', got '",
                   std::string(name), "'"));
}

absl::StatusOr<KvDtype> ParseQuantizedKvDtype(std::string_view name) {
  for (KvDtype dtype : {KvDtype::kQ8_0, KvDtype::kQ4_0}) {
    if (name == KvDtypeName(dtype)) return dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-dtype must be 'q8_0' or 'q4_0', got '", std::string(name), "'"));
}

namespace {

// `<model>` + ext beside the model file (`.gguf` dropped) when that file exists, else "".
std::string ModelSidecar(std::string_view model_path, std::string_view ext) {
  std::string sidecar(model_path);
  if (sidecar.size() >= 5 && sidecar.compare(sidecar.size() - 5, 5, ".gguf") == 0) {
    sidecar.resize(sidecar.size() - 5);
  }
  sidecar += ext;
  std::error_code error;
  return std::filesystem::is_regular_file(sidecar, error) ? sidecar : "";
}

}  // namespace

absl::StatusOr<KvCacheChoice> ResolveKvCacheChoice(const KvCacheFlags& f,
                                                   std::string_view model_path, bool cpu_backend) {
  KvCacheChoice choice;
  const bool codec_given = !f.codec.empty() && f.codec != "none";
  const std::string model_codec =
      f.codec.empty() && f.kv_budget == 0.0 ? ModelSidecar(model_path, ".codec") : "";
  if (f.kind == "auto") {
    const bool low_rank_asked =
        !f.bases.empty() || f.rank_k != 0 || f.rank_v != 0 ||
        (f.refresh != RefreshMethod::kNone && f.refresh != RefreshMethod::kPca);  // kqsvd, oja, fd
    const bool take_model_codec = !model_codec.empty() && cpu_backend && !low_rank_asked;
    choice.kind = codec_given || f.kv_budget != 0.0 || take_model_codec ? KvCacheKind::kTransform
                                                                        : KvCacheKind::kCompressed;
  } else {
    absl::StatusOr<KvCacheKind> kind = ParseKvCacheKind(f.kind);
    if (!kind.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv-cache must be 'auto', 'full', 'compressed', 'quantized' or "
                       "'transform', got '",
                       std::string(f.kind), "'"));
    }
    choice.kind = *kind;
  }
  if (codec_given) {
    choice.codec_path = std::string(f.codec);  // refused by the other kinds' validation
  } else if (choice.kind == KvCacheKind::kTransform && !model_codec.empty()) {
    choice.codec_path = model_codec;
    choice.model_codec = true;
  }
  return choice;
}

std::string ResolveBasesPath(std::string_view flag, std::string_view model_path, KvCacheKind kind,
                             int rank_k, int rank_v) {
  if (flag == "none") return "";
  if (!flag.empty()) return std::string(flag);
  if (kind != KvCacheKind::kCompressed || rank_k != 0 || rank_v != 0) return "";
  return ModelSidecar(model_path, ".bases");
}

absl::StatusOr<CoeffDtype> ParseCoeffDtype(std::string_view name) {
  for (CoeffDtype dtype :
       {CoeffDtype::kFp32, CoeffDtype::kFp16, CoeffDtype::kInt8, CoeffDtype::kInt4}) {
    if (name == CoeffDtypeName(dtype)) return dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--kv-coeff-dtype must be 'fp16', 'int8', 'int4' or 'fp32', got '", std::string(name), "'"));
}

absl::StatusOr<CoeffDtype> ParseFullDtype(std::string_view name) {
  for (CoeffDtype dtype : {CoeffDtype::kFp32, CoeffDtype::kFp16}) {
    if (name == CoeffDtypeName(dtype)) return dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-full-dtype must be 'fp16' or 'fp32', got '", std::string(name), "'"));
}

absl::Status ValidateKvCacheOptions(const KvCacheOptions& o, int block_size) {
  const bool budget =
      o.kv_budget != 0.0 || o.kv_budget_v != 0.0 || !o.calib_text_path.empty() || o.codec_post_rope;
  if (o.kind != KvCacheKind::kTransform && (!o.codec_path.empty() || budget)) {
    return absl::InvalidArgumentError(absl::StrCat(!o.codec_path.empty()  ? "--codec"
                                                   : o.kv_budget != 0.0   ? "--kv-budget"
                                                   : o.kv_budget_v != 0.0 ? "--kv-budget-v"
                                                   : !o.calib_text_path.empty()
                                                       ? "--calib-text"
                                                       : "--codec-post-rope",
                                                   " needs --kv-cache=transform"));
  }
  if (o.kind == KvCacheKind::kTransform) {
    if (o.codec_path.empty() == (o.kv_budget == 0.0)) {
      return absl::InvalidArgumentError(
          o.codec_path.empty()
              ? "--kv-cache transform needs a codec: --codec FILE (subspace-calibrate "
                "--kv-budget), or --kv-budget BITS with --calib-text TEXT to fit one at start-up"
              : "--codec and --kv-budget exclude each other: the codec file carries its budget");
    }
    if (o.codec_path.empty()) {
      if (!(o.kv_budget > 0.0 && o.kv_budget <= 8.0) ||
          !(o.kv_budget_v >= 0.0 && o.kv_budget_v <= 8.0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--kv-budget must be in (0, 8] bits per element and --kv-budget-v in "
                         "[0, 8] (0: the key budget), got ",
                         o.kv_budget, " and ", o.kv_budget_v));
      }
      if (o.calib_tokens < 64) {
        return absl::InvalidArgumentError(
            absl::StrCat("--calib-tokens must be at least 64, got ", o.calib_tokens));
      }
    } else if (budget) {
      return absl::InvalidArgumentError(
          "--kv-budget-v, --calib-text and --codec-post-rope fit a codec at start-up: they "
          "need --kv-budget instead of --codec");
    }
  }
  if (o.kind == KvCacheKind::kTransform && (o.sink_tokens < 0 || o.window_tokens < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(o.sink_tokens < 0 ? "--kv-sink-tokens" : "--kv-window-tokens",
                     " must be >= 0, got ", o.sink_tokens < 0 ? o.sink_tokens : o.window_tokens));
  }
  // The refresh's fields by their flags' names (the core names them "refresh <field>").
  const auto refresh_error = [](const absl::Status& st) {
    std::string message(st.message());
    for (const char* field : {"every_tokens", "residual_threshold", "half_life_tokens",
                              "oja_learning_rate", "max_epochs"}) {
      const std::string from = absl::StrCat("refresh ", field);
      std::string to = absl::StrCat("--refresh-", field);
      std::replace(to.begin(), to.end(), '_', '-');
      if (const size_t at = message.find(from); at != std::string::npos) {
        message.replace(at, from.size(), to);
      }
    }
    return absl::InvalidArgumentError(message);
  };
  if (o.kind == KvCacheKind::kTransform && o.refresh.method != RefreshMethod::kNone) {
    if (absl::Status st = CheckTransformRefreshConfig(o.refresh); !st.ok()) {
      return refresh_error(st);
    }
  }
  if (o.kind != KvCacheKind::kCompressed) {
    if (!o.bases_path.empty()) {
      return absl::InvalidArgumentError("--bases needs --kv-cache=compressed");
    }
    if (o.kind != KvCacheKind::kTransform && o.refresh.method != RefreshMethod::kNone) {
      return absl::InvalidArgumentError(
          "--refresh-method needs --kv-cache=compressed or --kv-cache=transform");
    }
    if (o.kind == KvCacheKind::kQuantized && o.kv_dtype != KvDtype::kQ8_0 &&
        o.kv_dtype != KvDtype::kQ4_0) {
      return absl::InvalidArgumentError("--kv-dtype must be q8_0 or q4_0");
    }
    return absl::OkStatus();
  }
  if (absl::Status s = ValidateRefreshConfig(o.refresh); !s.ok()) return refresh_error(s);
  if (block_size > kMaxCompressedBlockSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("--block-size must be at most ", kMaxCompressedBlockSize,
                     " with --kv-cache=compressed, got ", block_size));
  }
  if (o.sink_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-sink-tokens must be >= 0, got ", o.sink_tokens));
  }
  if (o.window_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-window-tokens must be >= 0, got ", o.window_tokens));
  }
  if (!o.bases_path.empty() && (o.rank_k != 0 || o.rank_v != 0)) {
    return absl::InvalidArgumentError(
        "--kv-rank-k and --kv-rank-v must be left at 0 with --bases (the file sets the ranks)");
  }
  // The upper bound (head_dim) is checked once the model is loaded.
  if (o.rank_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-rank-k must be >= 0 (0: head_dim / 4), got ", o.rank_k));
  }
  if (o.rank_v < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-rank-v must be >= 0 (0: head_dim / 4), got ", o.rank_v));
  }
  if (o.coeff_dtype != CoeffDtype::kFp32 && o.coeff_dtype != CoeffDtype::kFp16 &&
      o.coeff_dtype != CoeffDtype::kInt8 && o.coeff_dtype != CoeffDtype::kInt4) {
    return absl::InvalidArgumentError("--kv-coeff-dtype is not a known dtype");
  }
  if (o.full_dtype != CoeffDtype::kFp32 && o.full_dtype != CoeffDtype::kFp16) {
    return absl::InvalidArgumentError("--kv-full-dtype must be fp16 or fp32");
  }
  // NaN fails both comparisons; 0 would keep every token with any residual full-rank.
  if (!(o.outlier_threshold > 0.0f) || !std::isfinite(o.outlier_threshold)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-outlier-threshold must be a finite number > 0 (>= 1: no outliers), got ",
                     o.outlier_threshold));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Basis>> LoadBases(const std::string& path,
                                                       const GgufFile& model,
                                                       const KvCacheGeometry& geometry) {
  return LoadBasisForModel(path, model, geometry, "--bases " + path);
}

absl::StatusOr<std::shared_ptr<const CodecFile>> LoadCodec(const std::string& path,
                                                           const GgufFile& model,
                                                           const KvCacheGeometry& geometry) {
  absl::StatusOr<CodecFile> codec = LoadCodecForModel(path, model, geometry, "--codec " + path);
  if (!codec.ok()) return codec.status();
  return std::make_shared<const CodecFile>(*std::move(codec));
}

KvCacheOptions ResolveKvCacheOptions(KvCacheOptions o, const KvCacheGeometry& g,
                                     const Basis* bases) {
  if (o.kind != KvCacheKind::kCompressed) return o;
  if (bases != nullptr) {
    for (const LayerBasis& lb : bases->layers) {
      o.rank_k = std::max(o.rank_k, lb.rank_k);
      o.rank_v = std::max(o.rank_v, lb.rank_v);
    }
  }
  const int default_rank = CompressionPolicy::DefaultRank(g.head_dim);
  if (o.rank_k == 0) o.rank_k = default_rank;
  if (o.rank_v == 0) o.rank_v = default_rank;
  return o;
}

absl::StatusOr<CompressionPolicy> CompressionPolicyFor(const KvCacheOptions& o,
                                                       const KvCacheGeometry& g,
                                                       const Basis* bases) {
  const int rank_k = o.rank_k == 0 ? CompressionPolicy::DefaultRank(g.head_dim) : o.rank_k;
  const int rank_v = o.rank_v == 0 ? CompressionPolicy::DefaultRank(g.head_dim) : o.rank_v;
  if (absl::Status s = CheckRank(rank_k, g.head_dim, "--kv-rank-k"); !s.ok()) return s;
  if (absl::Status s = CheckRank(rank_v, g.head_dim, "--kv-rank-v"); !s.ok()) return s;
  CompressionPolicy p;
  p.sink_tokens = o.sink_tokens;
  p.window_tokens = o.window_tokens;
  p.coeff_dtype = o.coeff_dtype;
  p.outlier_threshold = o.outlier_threshold;
  p.r_k.assign(static_cast<size_t>(g.n_layers), rank_k);
  p.r_v.assign(static_cast<size_t>(g.n_layers), rank_v);
  if (bases != nullptr) {
    if (bases->layers.size() != static_cast<size_t>(g.n_layers)) {
      return absl::InvalidArgumentError("--bases: the basis does not match the model's layers");
    }
    for (size_t l = 0; l < bases->layers.size(); ++l) {
      p.r_k[l] = bases->layers[l].rank_k;
      p.r_v[l] = bases->layers[l].rank_v;
    }
  }
  return p;
}

absl::StatusOr<std::unique_ptr<PagedKvCache>> CreatePagedKvCache(const KvCacheOptions& o,
                                                                 const KvCacheGeometry& g,
                                                                 int block_size,
                                                                 int64_t capacity_bytes) {
  if (o.kind == KvCacheKind::kCompressed) {
    return absl::InvalidArgumentError("a paged KV cache is --kv-cache full or quantized");
  }
  return PagedKvCache::Create(
      {.geometry = g,
       .block_size = block_size,
       .capacity_bytes = capacity_bytes,
       .dtype = o.kind == KvCacheKind::kQuantized ? o.kv_dtype : KvDtype::kF32});
}

absl::StatusOr<std::unique_ptr<CompressedKvCache>> CreateCompressedKvCache(
    const KvCacheOptions& o, const KvCacheGeometry& g, int block_size, int64_t capacity_bytes,
    std::shared_ptr<const Basis> bases, int n_query_heads) {
  if (o.kind != KvCacheKind::kCompressed) {
    return absl::InvalidArgumentError("a compressed KV cache is --kv-cache compressed");
  }
  absl::StatusOr<CompressionPolicy> policy = CompressionPolicyFor(o, g, bases.get());
  if (!policy.ok()) return policy.status();
  CompressedKvCacheConfig c;
  c.geometry = g;
  c.block_size = block_size;
  c.policy = *std::move(policy);
  c.full_dtype = o.full_dtype;
  c.capacity_bytes = capacity_bytes;
  c.refresh = o.refresh;
  c.n_query_heads = n_query_heads;
  c.refresh_inline = o.refresh_inline;
  if (o.refresh.method == RefreshMethod::kKqsvd && n_query_heads == 0) {
    return absl::InvalidArgumentError("--refresh-method=kqsvd needs the model's query heads");
  }
  absl::StatusOr<std::unique_ptr<CompressedKvCache>> cache = CompressedKvCache::Create(c);
  if (!cache.ok()) return cache.status();
  if (bases != nullptr) {
    absl::StatusOr<EpochId> epoch = (*cache)->InstallBasis(std::move(bases));
    if (!epoch.ok()) return epoch.status();
    // The default holds its own reference; ours is not needed past installation.
    if (absl::Status s = (*cache)->SetDefaultEpoch(*epoch); !s.ok()) return s;
    if (absl::Status s = (*cache)->ReleaseEpoch(*epoch); !s.ok()) return s;
  }
  return cache;
}

absl::StatusOr<std::unique_ptr<TransformKvCache>> CreateTransformKvCache(
    const KvCacheOptions& o, const KvCacheGeometry& g, int block_size, int64_t capacity_bytes,
    const CodecFile& codec, const RopeSchedule& key_rope) {
  if (o.kind != KvCacheKind::kTransform) {
    return absl::InvalidArgumentError("a transform-coded KV cache is --kv-cache transform");
  }
  TransformKvCacheConfig c;
  c.geometry = g;
  c.block_size = block_size;
  c.sink_tokens = o.sink_tokens;
  c.window_tokens = o.window_tokens;
  c.key_codes = std::make_shared<const std::vector<TransformCode>>(codec.keys);
  c.value_codes = std::make_shared<const std::vector<TransformCode>>(codec.values);
  if (codec.info.pre_rope_keys) c.key_rope = key_rope;
  c.capacity_bytes = capacity_bytes;
  c.refresh = o.refresh;
  c.refresh_inline = o.refresh_inline;
  return TransformKvCache::Create(c);
}

absl::StatusOr<std::unique_ptr<KvCache>> CreateKvCache(const KvCacheOptions& o,
                                                       const ModelConfig& model, int block_size,
                                                       int64_t capacity_bytes,
                                                       const KvCacheInputs& inputs) {
  const KvCacheGeometry g = model.cache_geometry();
  absl::StatusOr<std::unique_ptr<KvCache>> cache;
  switch (o.kind) {
    case KvCacheKind::kFull:
    case KvCacheKind::kQuantized:
      cache = CreatePagedKvCache(o, g, block_size, capacity_bytes);
      break;
    case KvCacheKind::kCompressed:
      cache =
          CreateCompressedKvCache(o, g, block_size, capacity_bytes, inputs.bases, model.n_heads);
      break;
    case KvCacheKind::kTransform: {
      if (inputs.codec == nullptr) {
        return absl::InvalidArgumentError("--kv-cache transform needs the --codec file loaded");
      }
      absl::StatusOr<RopeSchedule> rope = model.rope();
      if (!rope.ok()) return rope.status();
      cache = CreateTransformKvCache(o, g, block_size, capacity_bytes, *inputs.codec, *rope);
      break;
    }
  }
  return cache;
}

}  // namespace subspace::runtime
