// A minimal GGUF v3 writer -- scalars, strings, i32 arrays, F32 tensors -- for the files the
// project writes itself (basis and codec files), read back through GgufFile like any model.
#ifndef SUBSPACE_CORE_GGUF_GGUF_WRITER_H_
#define SUBSPACE_CORE_GGUF_GGUF_WRITER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace subspace {

// Little-endian (the hosts we build for are little-endian, as GGUF). Tensors are aligned to 32
// bytes, GGUF's default, so no general.alignment key is needed.
class GgufWriter {
 public:
  void AddString(std::string_view key, std::string_view value);
  void AddUint32(std::string_view key, uint32_t value);
  void AddUint64(std::string_view key, uint64_t value);
  void AddFloat64(std::string_view key, double value);
  void AddInt32Array(std::string_view key, const std::vector<int>& values);
  // A row-major [rows, cols] F32 tensor (GGUF dims {cols, rows}). data: [rows, cols]
  void AddF32Matrix(std::string_view name, int64_t rows, int64_t cols, const float* data);
  // The file's bytes.
  std::string Build() const;

 private:
  void Key(std::string_view key, uint32_t type);

  std::string kvs_, infos_, data_;
  uint64_t n_kvs_ = 0, n_tensors_ = 0;
};

// Writes `bytes` to `path` (truncating it); INTERNAL "cannot write WHAT PATH" on failure.
absl::Status WriteFileBytes(const std::string& path, std::string_view bytes, std::string_view what);

}  // namespace subspace

#endif  // SUBSPACE_CORE_GGUF_GGUF_WRITER_H_
