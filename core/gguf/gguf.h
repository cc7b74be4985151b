// GGUF container reader (versions 2 and 3): metadata key/values, tensor infos and
// memory-mapped tensor data. Every read is bounds-checked against the file size, so a
// truncated or corrupt file yields a precise absl::Status instead of a crash or over-read.
#ifndef SUBSPACE_CORE_GGUF_GGUF_H_
#define SUBSPACE_CORE_GGUF_GGUF_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/base/tensor_types.h"

namespace subspace {

// Metadata value types, numbered as in the GGUF specification.
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

const char* GgufValueTypeName(GgufValueType type);

// One metadata value. Integers of every width are widened into `u`/`i` (both are set
// when the value fits), floats into `f`; arrays keep their element type and elements.
struct GgufValue {
  GgufValueType type = GgufValueType::kUint8;
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0.0;
  bool b = false;
  std::string s;
  GgufValueType elem_type = GgufValueType::kUint8;  // only for kArray
  std::vector<GgufValue> array;                     // only for kArray
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // GGUF order: dims[0] varies fastest (a row's length)
  TensorType type = TensorType::kF32;
  uint64_t offset = 0;  // relative to the start of the data section
  int64_t num_elements = 0;
  uint64_t num_bytes = 0;
  const uint8_t* data = nullptr;  // inside the mapping; valid while the GgufFile lives
};

class GgufFile {
 public:
  // Memory-maps `path` read-only and parses it.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses an in-memory copy (tests, fuzzing).
  static absl::StatusOr<std::unique_ptr<GgufFile>> FromBytes(std::string bytes);

  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue, std::less<>>& metadata() const { return metadata_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  // Absolute byte offset of the data section; tensor offsets are relative to it.
  uint64_t data_offset() const { return data_offset_; }
  // The whole file (mapped or owned); valid while this object lives. Every tensor's
  // [data, data + num_bytes) lies inside it.
  std::string_view bytes() const {
    return {reinterpret_cast<const char*>(bytes_), static_cast<size_t>(size_)};
  }

  const GgufValue* Find(std::string_view key) const;
  const GgufTensorInfo* FindTensor(std::string_view name) const;

  // Typed getters: NOT_FOUND when the key is absent, INVALID_ARGUMENT when the stored type
  // cannot represent the request (any integer type is accepted for integer getters if the
  // value fits; float getters accept float32/float64).
  absl::StatusOr<std::string> GetString(std::string_view key) const;
  absl::StatusOr<uint64_t> GetUint(std::string_view key) const;
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;
  absl::StatusOr<double> GetFloat(std::string_view key) const;
  absl::StatusOr<bool> GetBool(std::string_view key) const;
  absl::StatusOr<std::vector<std::string>> GetStringArray(std::string_view key) const;
  absl::StatusOr<std::vector<float>> GetFloatArray(std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> GetIntArray(std::string_view key) const;

 private:
  GgufFile() = default;
  absl::Status Parse();

  // Either a read-only mapping (mapped_ != nullptr) or an owned buffer.
  void* mapped_ = nullptr;
  std::string owned_;
  const uint8_t* bytes_ = nullptr;
  uint64_t size_ = 0;

  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue, std::less<>> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_GGUF_GGUF_H_
