// The calibrated basis file: a GGUF container holding one basis epoch (per layer and KV head
// P_q, P_k, P_v, R_v as F32 tensors) with the calibration's provenance, written by
// subspace-calibrate and loaded by the server's --bases.
//
// Metadata (all under "subspace.basis."): version (u32, 1; absent in the first files), method_k,
// method_v (strings), energy (f64, 0 for a fixed rank), calibration_tokens (u64), model_fnv1a64
// (u64, ModelChecksum of the model file), n_layers, n_kv_heads, head_dim (u32), rank_k, rank_v
// (i32 arrays [n_layers]). Version 2 of the same container holds a transform codec instead
// (core/compress/codec_file.h); each reader refuses the other's version by name.
// Tensors: blk.L.head.H.p_q, .p_k [d, r_k]; .p_v [d, r_v]; .r_v [r_v, d] (row-major; GGUF dims
// list the row length first, e.g. p_q has dims {r_k, d}).
#ifndef SUBSPACE_CORE_COMPRESS_BASIS_FILE_H_
#define SUBSPACE_CORE_COMPRESS_BASIS_FILE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/compress/basis.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

// subspace.basis.version: what the container holds.
inline constexpr uint32_t kBasisFileLowRank = 1;         // a low-rank basis epoch (this file)
inline constexpr uint32_t kBasisFileTransformCodec = 2;  // a transform codec (codec_file.h)
// The file's version (kBasisFileLowRank when the key is absent); INVALID_ARGUMENT for a file
// that is not a basis file, a version of the wrong type, or one newer than this build reads.
absl::StatusOr<uint32_t> BasisFileVersion(const GgufFile& file);
// OK when the file is of version `want`; otherwise BasisFileVersion's error, or
// INVALID_ARGUMENT "<label>: subspace.basis.version = V: the file holds <what V holds>".
absl::Status RequireBasisFileVersion(const GgufFile& file, uint32_t want, std::string_view label);
// Copies the F32 tensor `name` of shape [rows, cols] into dst ([rows, cols]), the readers of
// both versions' tensors; INVALID_ARGUMENT "<label>: tensor NAME ..." naming what is wrong
// (missing, its type, its dims, its size).
absl::Status ReadF32Matrix(const GgufFile& file, const std::string& name, int64_t rows,
                           int64_t cols, float* dst, std::string_view label);

struct BasisFileInfo {
  std::string method_k;
  std::string method_v;
  double energy = 0.0;  // 0: fixed rank
  uint64_t calibration_tokens = 0;
  uint64_t model_checksum = 0;  // ModelChecksum of the model the basis was calibrated on
};

struct BasisFile {
  BasisFileInfo info;
  Basis basis;
};

// 64-bit FNV-1a over the model file's bytes, taken as little-endian 64-bit words (the tail of
// 0-7 bytes byte by byte): ~8x cheaper than byte-wise FNV-1a, and it identifies the exact file
// (not a cryptographic hash; it guards against loading bases for the wrong model).
uint64_t ModelChecksum(const GgufFile& model);

// The GGUF bytes of `info` and `basis`. INVALID_ARGUMENT when the basis is inconsistent.
absl::StatusOr<std::string> SerializeBasisFile(const BasisFileInfo& info, const Basis& basis);
absl::Status WriteBasisFile(const std::string& path, const BasisFileInfo& info, const Basis& basis);

// Parses and checks the file's own consistency (keys present with the right types, ranks in
// [1, head_dim], every tensor present, F32 and of the stated shape). INVALID_ARGUMENT naming
// the problem.
absl::StatusOr<BasisFile> ParseBasisFile(const GgufFile& file);
absl::StatusOr<BasisFile> ReadBasisFile(const std::string& path);

// INVALID_ARGUMENT unless the file's geometry is the model's and its checksum the model's.
absl::Status CheckBasisMatchesModel(const BasisFile& bases, const KvCacheGeometry& geometry,
                                    uint64_t model_checksum);

// ReadBasisFile, then CheckBasisMatchesModel against `model` (its geometry and ModelChecksum):
// the basis ready to install; a mismatch's message is prefixed with `label` and ": ". The
// server's --bases and subspace-longctx's file: caches.
absl::StatusOr<std::shared_ptr<const Basis>> LoadBasisForModel(const std::string& path,
                                                               const GgufFile& model,
                                                               const KvCacheGeometry& geometry,
                                                               const std::string& label);

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_BASIS_FILE_H_
