// The transform codec's file: version 2 of the basis-file container (basis_file.h), holding
// per layer and KV head the key and value codes of core/compress/transform_codec.h and how
// they were fitted; written by subspace-calibrate --kv-budget, read by subspace-longctx's
// tcfile: caches (and by the compressed cache once it stores codes).
//
// Metadata (under "subspace.basis."): version (u32, 2), key_bits, value_bits (f64, the budgets
// in bits per element of a coded key or value row), pre_rope_keys, attention_weighted, joint
// (u32, 0 or 1),
// calibration_tokens (u64), model_fnv1a64 (u64), n_layers, n_kv_heads, head_dim (u32).
// Tensors, for S in {k, v}: blk.L.head.H.S.mean, .S.scale [1, d]; .S.basis [d, d] (row j =
// component j); .S.quant [d, 3] (per component: bits, offset, step). All F32.
#ifndef SUBSPACE_CORE_COMPRESS_CODEC_FILE_H_
#define SUBSPACE_CORE_COMPRESS_CODEC_FILE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/compress/transform_codec.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

struct CodecFileInfo {
  double key_bits = 0.0, value_bits = 0.0;  // the budgets the widths were allocated under
  bool pre_rope_keys = true;                // keys are coded before RoPE
  bool attention_weighted = false;
  bool joint = false;  // one budget over all layer-heads (a row may exceed its side's)
  uint64_t calibration_tokens = 0;
  uint64_t model_checksum = 0;  // ModelChecksum of the model it was fitted on
};

struct CodecFile {
  CodecFileInfo info;
  KvCacheGeometry geometry;
  std::vector<TransformCode> keys, values;  // [n_layers * n_kv_heads], layer-major
};

// INVALID_ARGUMENT naming the field for a code that does not hold together: sizes, widths
// outside [0, 8] or not whole, a non-positive or non-finite step where bits > 0, non-finite
// means or offsets, a scale that is not positive and finite, a basis that is not orthonormal
// (1e-3), or a row wider than the budget (without joint: key_bits or value_bits * head_dim;
// with it, the sum over every row against their mean).
absl::Status ValidateCodecFile(const CodecFile& codec);

absl::StatusOr<std::string> SerializeCodecFile(const CodecFile& codec);
absl::Status WriteCodecFile(const std::string& path, const CodecFile& codec);
// Parses and validates; INVALID_ARGUMENT naming the key or tensor at fault, including a
// version-1 file (a low-rank basis) or one newer than this build reads.
absl::StatusOr<CodecFile> ParseCodecFile(const GgufFile& file);
absl::StatusOr<CodecFile> ReadCodecFile(const std::string& path);
// ReadCodecFile, then the geometry and ModelChecksum against `model`; messages prefixed with
// `label` and ": ".
absl::StatusOr<CodecFile> LoadCodecForModel(const std::string& path, const GgufFile& model,
                                            const KvCacheGeometry& geometry,
                                            const std::string& label);

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_CODEC_FILE_H_
