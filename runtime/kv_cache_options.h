// Which KV cache to build (full-rank paged, quantized paged or low-rank compressed) and the
// compressed cache's policy, as the server's --kv-* flags set them; checked before the model
// loads, and turned into a cache once the model's geometry is known. The one place options
// become a host cache, with one set of defaults: the server, the tools and the benchmarks build
// theirs here (runtime/backend.h adds the device).
#ifndef SUBSPACE_RUNTIME_KV_CACHE_OPTIONS_H_
#define SUBSPACE_RUNTIME_KV_CACHE_OPTIONS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/base/coeff_codec.h"
#include "core/base/rope.h"
#include "core/compress/basis.h"
#include "core/compress/codec_file.h"
#include "core/compress/compressed_kv_cache.h"
#include "core/compress/compression_policy.h"
#include "core/compress/transform_kv_cache.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/kv_cache.h"
#include "core/kvcache/kv_quant.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/kvcache/refresh_config.h"
#include "core/model/model_runner.h"

namespace subspace::runtime {

// kFull: paged fp32; kQuantized: paged rows in q8_0 / q4_0 (--kv-dtype), llama.cpp's quantized
// cache types; kCompressed: low-rank blocks outside the sinks and the window; kTransform: blocks
// outside the sinks and the window stored as the transform codec's codes (--codec).
enum class KvCacheKind : uint8_t { kFull, kCompressed, kQuantized, kTransform };

// Both caches draw from one pool of --kv-cache-bytes cut into --block-size token blocks; those
// two live in ServerAppConfig. The rest applies to the compressed cache only.
struct KvCacheOptions {
  KvCacheKind kind = KvCacheKind::kCompressed;
  KvDtype kv_dtype = KvDtype::kQ8_0;  // kQuantized: q8_0 or q4_0
  // The flags of CompressionPolicy (core/compress/compression_policy.h), whose defaults these are.
  int sink_tokens = CompressionPolicy::kDefaultSinkTokens;      // S: blocks overlapping [0, S)
  int window_tokens = CompressionPolicy::kDefaultWindowTokens;  // W: the last W tokens
  int rank_k = 0;  // key coefficients per token and KV head; 0: DefaultRank (head_dim / 4)
  int rank_v = 0;  // value coefficients; 0: DefaultRank
  // int8 by default: on docs/longctx.md's suite int8 codes score as fp16 ones at every rank and
  // method, at 24-40 % fewer bytes per token. (The library's CompressionPolicy keeps fp16.)
  CoeffDtype coeff_dtype = CoeffDtype::kInt8;
  // Full-rank blocks (sinks, window, outliers): fp16, or fp32 for exactness checks.
  CoeffDtype full_dtype = CoeffDtype::kFp16;
  // Relative key residual above which a token stays full-rank; >= 1: no outliers.
  float outlier_threshold = 1.0f;
  // --bases: a calibrated basis file (subspace-calibrate) installed as the default epoch; its
  // per-layer ranks replace rank_k / rank_v, which must then be left at 0. Empty: none (the
  // cache self-calibrates from the first sequence).
  std::string bases_path;
  // --refresh-*: the online refresh every session gets unless it asks for another
  // (CreateSessionRequest.refresh). method kNone: static bases.
  RefreshConfig refresh;
  // Refresh on the engine thread instead of the refresher's: deterministic (tools, tests).
  bool refresh_inline = false;
  // --codec: kTransform's codec file (subspace-calibrate --kv-budget); it or kv_budget is
  // required by kTransform, and both are refused by every other kind. The sinks and the window
  // above apply to it too.
  std::string codec_path;
  // --kv-budget / --kv-budget-v: kTransform without a codec file: the codec is fitted at
  // start-up (FitCodecFile) for this many bits per key / value element (value 0: the key
  // budget), on the first calib_tokens tokens of --calib-text (a file or a directory of text),
  // or with no text on as many tokens the model writes itself (SampleCalibrationTokens);
  // keys coded before RoPE unless codec_post_rope (--codec-post-rope: faster decode, lower
  // quality per byte), errors weighted by attention unless !codec_weighted (the defaults of
  // subspace-calibrate; docs/transform_codec.md measures both).
  double kv_budget = 0.0, kv_budget_v = 0.0;
  std::string calib_text_path;
  int64_t calib_tokens = 20000;
  bool codec_post_rope = false;
  bool codec_weighted = true;
};

// What a cache is built from besides its options: the files loaded at start-up.
struct KvCacheInputs {
  std::shared_ptr<const Basis> bases;      // kCompressed: --bases (LoadBases), or none
  std::shared_ptr<const CodecFile> codec;  // kTransform: --codec (LoadCodec)
};

// "full", "compressed", "quantized" or "transform"
const char* KvCacheKindName(KvCacheKind kind);
// INVALID_ARGUMENT naming the flag for anything but the names below.
absl::StatusOr<KvCacheKind> ParseKvCacheKind(std::string_view name);   // full|compressed|...
absl::StatusOr<KvDtype> ParseQuantizedKvDtype(std::string_view name);  // q8_0 | q4_0
absl::StatusOr<CoeffDtype> ParseCoeffDtype(std::string_view name);     // fp32 | fp16 | int8
absl::StatusOr<CoeffDtype> ParseFullDtype(std::string_view name);      // fp16 | fp32

// --kv-cache and --codec as the server resolves them, before validation. kind "auto" (the
// default) picks the transform cache when a codec is asked for (--codec FILE, --kv-budget) or,
// on the CPU backend, when the model ships one and nothing asks for the low-rank cache (--bases,
// --kv-rank-k/-v, a refresh method only it has); the compressed cache otherwise. A model's own
// codec is `<model>.codec` beside `<model>.gguf` (subspace-calibrate --kv-budget, checked
// against the model when loaded); the transform cache reads it unless --codec names another,
// --kv-budget fits one or codec is "none". The CUDA backend (cpu_backend false: --device cuda or
// auto) keeps the compressed cache under "auto" until its transform cache has run on a real GPU.
struct KvCacheFlags {  // as given on the command line
  std::string_view kind = "auto";
  std::string_view codec;  // --codec
  double kv_budget = 0.0;  // --kv-budget
  std::string_view bases;  // --bases
  int rank_k = 0, rank_v = 0;
  RefreshMethod refresh = RefreshMethod::kNone;
};
struct KvCacheChoice {
  KvCacheKind kind = KvCacheKind::kCompressed;
  std::string codec_path;    // the --codec file to load; empty for none
  bool model_codec = false;  // codec_path is the model's own (`<model>.codec`)
};
// INVALID_ARGUMENT for an unknown kind.
absl::StatusOr<KvCacheChoice> ResolveKvCacheChoice(const KvCacheFlags& flags,
                                                   std::string_view model_path, bool cpu_backend);

// The basis file --bases names: a path as given; "none" for none (self-calibration); empty for
// the model's own, `<model>.bases` beside `<model>.gguf`, when that file exists, the cache is
// compressed and --kv-rank-k/v are unset (a calibrated basis keeps retrieval at 1,024 tokens
// where self-calibration loses it: docs/longctx.md), else none.
std::string ResolveBasesPath(std::string_view flag, std::string_view model_path, KvCacheKind kind,
                             int rank_k, int rank_v);

// The checks that need no model, as INVALID_ARGUMENT naming the flag. block_size is
// --block-size (the compressed cache keeps one 64-bit outlier mask per block).
absl::Status ValidateKvCacheOptions(const KvCacheOptions& options, int block_size);

// Reads the --bases file and checks it against the model: its geometry and the model file's
// checksum (ModelChecksum). INVALID_ARGUMENT naming the file and the mismatch; NOT_FOUND when
// the file does not exist.
absl::StatusOr<std::shared_ptr<const Basis>> LoadBases(const std::string& path,
                                                       const GgufFile& model,
                                                       const KvCacheGeometry& geometry);
// Reads the --codec file and checks it against the model likewise (LoadCodecForModel).
absl::StatusOr<std::shared_ptr<const CodecFile>> LoadCodec(const std::string& path,
                                                           const GgufFile& model,
                                                           const KvCacheGeometry& geometry);

// `options` with the model-dependent defaults filled in: rank 0 becomes head_dim / 4 (at least
// 1), or with `bases` the largest rank of its layers (for reporting; the cache takes the ranks
// per layer from the basis). The full cache's options are returned unchanged.
KvCacheOptions ResolveKvCacheOptions(KvCacheOptions options, const KvCacheGeometry& geometry,
                                     const Basis* bases = nullptr);

// The policy both backends' compressed caches get from resolved options: `bases`'s ranks per
// layer when given, else rank_k / rank_v in every layer. INVALID_ARGUMENT naming the flag when
// a rank exceeds the model's head_dim, or when `bases` has another number of layers.
absl::StatusOr<CompressionPolicy> CompressionPolicyFor(const KvCacheOptions& resolved,
                                                       const KvCacheGeometry& geometry,
                                                       const Basis* bases = nullptr);

// Builds the host cache of `model` from resolved options. INVALID_ARGUMENT naming the flag when
// a rank exceeds the model's head_dim or an input the kind needs is missing; otherwise whatever
// the cache's Create returns (a pool too small). kCompressed with inputs.bases: the basis's
// per-layer ranks, installed as the default epoch; kqsvd refresh reads the model's query heads.
// kTransform: inputs.codec's codes, keys rotated by the model's RoPE when coded before it.
absl::StatusOr<std::unique_ptr<KvCache>> CreateKvCache(const KvCacheOptions& resolved,
                                                       const ModelConfig& model, int block_size,
                                                       int64_t capacity_bytes,
                                                       const KvCacheInputs& inputs = {});
// The halves of CreateKvCache, for callers that need the cache's own interface (the tools read
// the compressed cache's Detail and install bases of their own). CreatePagedKvCache takes kFull
// (fp32 rows) or kQuantized (kv_dtype rows); CreateCompressedKvCache kCompressed;
// CreateTransformKvCache kTransform (key_rope: the model's, used when the codec codes keys
// before RoPE).
absl::StatusOr<std::unique_ptr<PagedKvCache>> CreatePagedKvCache(const KvCacheOptions& options,
                                                                 const KvCacheGeometry& geometry,
                                                                 int block_size,
                                                                 int64_t capacity_bytes);
absl::StatusOr<std::unique_ptr<CompressedKvCache>> CreateCompressedKvCache(
    const KvCacheOptions& resolved, const KvCacheGeometry& geometry, int block_size,
    int64_t capacity_bytes, std::shared_ptr<const Basis> bases = nullptr, int n_query_heads = 0);
absl::StatusOr<std::unique_ptr<TransformKvCache>> CreateTransformKvCache(
    const KvCacheOptions& options, const KvCacheGeometry& geometry, int block_size,
    int64_t capacity_bytes, const CodecFile& codec, const RopeSchedule& key_rope);

}  // namespace subspace::runtime

#endif  // SUBSPACE_RUNTIME_KV_CACHE_OPTIONS_H_
