// Header-only in-memory GGUF writer for tests: build a small valid file in a few lines, or a
// deliberately broken one through the raw hooks (AddRaw, AddTensorInfo). Output is the GGUF
// v2/v3 little-endian layout; Build() returns the bytes, WriteFile() puts them on disk.
#ifndef SUBSPACE_TESTS_CORE_GGUF_GGUF_TEST_UTIL_H_
#define SUBSPACE_TESTS_CORE_GGUF_GGUF_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/gguf/gguf.h"

namespace subspace::testing {

// Little-endian encoders, public so tests can hand-craft values (e.g. nested arrays).
template <typename T>
std::string GgufPod(T v) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::string out(sizeof(T), '\0');
  std::memcpy(out.data(), &v, sizeof(T));
  return out;
}
inline std::string GgufStr(std::string_view s) {
  return GgufPod<uint64_t>(s.size()) + std::string(s);
}
// Array payload header: element type then count; append `count` encoded elements after it.
inline std::string GgufArrayHeader(GgufValueType elem_type, uint64_t count) {
  return GgufPod(static_cast<uint32_t>(elem_type)) + GgufPod(count);
}

class GgufBuilder {
 public:
  explicit GgufBuilder(uint32_t version = 3) : version_(version) {}

  // Scalars.
  GgufBuilder& AddUint8(std::string_view k, uint8_t v) { return Pod(k, GgufValueType::kUint8, v); }
  GgufBuilder& AddInt8(std::string_view k, int8_t v) { return Pod(k, GgufValueType::kInt8, v); }
  GgufBuilder& AddUint16(std::string_view k, uint16_t v) {
    return Pod(k, GgufValueType::kUint16, v);
  }
  GgufBuilder& AddInt16(std::string_view k, int16_t v) { return Pod(k, GgufValueType::kInt16, v); }
  GgufBuilder& AddUint32(std::string_view k, uint32_t v) {
    return Pod(k, GgufValueType::kUint32, v);
  }
  GgufBuilder& AddInt32(std::string_view k, int32_t v) { return Pod(k, GgufValueType::kInt32, v); }
  GgufBuilder& AddUint64(std::string_view k, uint64_t v) {
    return Pod(k, GgufValueType::kUint64, v);
  }
  GgufBuilder& AddInt64(std::string_view k, int64_t v) { return Pod(k, GgufValueType::kInt64, v); }
  GgufBuilder& AddFloat32(std::string_view k, float v) {
    return Pod(k, GgufValueType::kFloat32, v);
  }
  GgufBuilder& AddFloat64(std::string_view k, double v) {
    return Pod(k, GgufValueType::kFloat64, v);
  }
  GgufBuilder& AddBool(std::string_view k, bool v) {
    return Pod(k, GgufValueType::kBool, static_cast<uint8_t>(v));
  }
  GgufBuilder& AddString(std::string_view k, std::string_view v) {
    return AddRaw(k, static_cast<uint32_t>(GgufValueType::kString), GgufStr(v));
  }

  // Arrays.
  GgufBuilder& AddStringArray(std::string_view k, const std::vector<std::string>& v) {
    std::string payload = GgufArrayHeader(GgufValueType::kString, v.size());
    for (const std::string& s : v) payload += GgufStr(s);
    return AddRaw(k, static_cast<uint32_t>(GgufValueType::kArray), std::move(payload));
  }
  GgufBuilder& AddFloatArray(std::string_view k, const std::vector<float>& v) {
    return PodArray(k, GgufValueType::kFloat32, v);
  }
  GgufBuilder& AddInt32Array(std::string_view k, const std::vector<int32_t>& v) {
    return PodArray(k, GgufValueType::kInt32, v);
  }
  template <typename T>
  GgufBuilder& PodArray(std::string_view k, GgufValueType elem_type, const std::vector<T>& v) {
    std::string payload = GgufArrayHeader(elem_type, v.size());
    for (const T& x : v) payload += GgufPod(x);
    return AddRaw(k, static_cast<uint32_t>(GgufValueType::kArray), std::move(payload));
  }

  // Any key with a raw type id and pre-encoded value bytes (may be invalid on purpose).
  GgufBuilder& AddRaw(std::string_view key, uint32_t raw_type, std::string value_bytes) {
    kvs_ += GgufStr(key) + GgufPod(raw_type) + value_bytes;
    ++kv_count_;
    return *this;
  }

  // Writes general.alignment and lays tensor data out on that boundary.
  GgufBuilder& SetAlignment(uint32_t alignment) {
    alignment_ = alignment;
    return AddUint32("general.alignment", alignment);
  }

  // A tensor whose `data` is placed at the next aligned offset of the data section.
  // dims are in GGUF order (dims[0] is the row length).
  GgufBuilder& AddTensor(std::string_view name, std::vector<uint64_t> dims, TensorType type,
                         std::string data) {
    tensors_.push_back({std::string(name), std::move(dims), static_cast<uint32_t>(type),
                        std::nullopt, std::move(data)});
    return *this;
  }
  // Only a tensor info, with whatever type id and offset the test wants; no data is written.
  GgufBuilder& AddTensorInfo(std::string_view name, std::vector<uint64_t> dims, uint32_t raw_type,
                             uint64_t offset) {
    tensors_.push_back({std::string(name), std::move(dims), raw_type, offset, ""});
    return *this;
  }
  // Overrides the counts written in the header (to fake huge or wrong counts).
  GgufBuilder& OverrideKvCount(uint64_t n) {
    kv_count_override_ = n;
    return *this;
  }
  GgufBuilder& OverrideTensorCount(uint64_t n) {
    tensor_count_override_ = n;
    return *this;
  }

  std::string Build() const {
    std::string data;  // the data section, relative offsets
    std::string infos;
    for (const Tensor& t : tensors_) {
      uint64_t offset = 0;
      if (t.offset.has_value()) {
        offset = *t.offset;
      } else {
        data.resize(AlignUp(data.size(), alignment_), '\0');
        offset = data.size();
        data += t.data;
      }
      infos += GgufStr(t.name) + GgufPod(static_cast<uint32_t>(t.dims.size()));
      for (uint64_t d : t.dims) infos += GgufPod(d);
      infos += GgufPod(t.raw_type) + GgufPod(offset);
    }
    std::string out = "GGUF";
    out += GgufPod(version_);
    out += GgufPod(tensor_count_override_.value_or(tensors_.size()));
    out += GgufPod(kv_count_override_.value_or(kv_count_));
    out += kvs_;
    out += infos;
    if (!tensors_.empty()) {
      out.resize(AlignUp(out.size(), alignment_), '\0');
      out += data;
    }
    return out;
  }

 private:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> dims;
    uint32_t raw_type;
    std::optional<uint64_t> offset;  // nullopt: placed by Build()
    std::string data;
  };

  template <typename T>
  GgufBuilder& Pod(std::string_view k, GgufValueType type, T v) {
    return AddRaw(k, static_cast<uint32_t>(type), GgufPod(v));
  }
  static uint64_t AlignUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

  uint32_t version_;
  uint64_t alignment_ = 32;
  std::string kvs_;
  uint64_t kv_count_ = 0;
  std::vector<Tensor> tensors_;
  std::optional<uint64_t> kv_count_override_;
  std::optional<uint64_t> tensor_count_override_;
};

// Writes `bytes` to `path`; returns false on failure.
inline bool WriteFile(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return static_cast<bool>(out);
}

// Raw little-endian bytes of a vector of trivially copyable values (tensor payloads).
template <typename T>
std::string GgufBytesOf(const std::vector<T>& v) {
  static_assert(std::is_trivially_copyable_v<T>);
  std::string out(v.size() * sizeof(T), '\0');
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

}  // namespace subspace::testing

#endif  // SUBSPACE_TESTS_CORE_GGUF_GGUF_TEST_UTIL_H_
