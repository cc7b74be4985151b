#include "core/gguf/gguf_writer.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "core/base/tensor_types.h"
#include "core/gguf/gguf.h"

namespace subspace {
namespace {

constexpr uint64_t kAlignment = 32;

template <typename T>
void Pod(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void Str(std::string& s, std::string_view v) {
  Pod(s, static_cast<uint64_t>(v.size()));
  s.append(v);
}

}  // namespace

void GgufWriter::Key(std::string_view key, uint32_t type) {
  Str(kvs_, key);
  Pod(kvs_, type);
  ++n_kvs_;
}

void GgufWriter::AddString(std::string_view key, std::string_view value) {
  Key(key, static_cast<uint32_t>(GgufValueType::kString));
  Str(kvs_, value);
}

void GgufWriter::AddUint32(std::string_view key, uint32_t value) {
  Key(key, static_cast<uint32_t>(GgufValueType::kUint32));
  Pod(kvs_, value);
}

void GgufWriter::AddUint64(std::string_view key, uint64_t value) {
  Key(key, static_cast<uint32_t>(GgufValueType::kUint64));
  Pod(kvs_, value);
}

void GgufWriter::AddFloat64(std::string_view key, double value) {
  Key(key, static_cast<uint32_t>(GgufValueType::kFloat64));
  Pod(kvs_, value);
}

void GgufWriter::AddInt32Array(std::string_view key, const std::vector<int>& values) {
  Key(key, static_cast<uint32_t>(GgufValueType::kArray));
  Pod(kvs_, static_cast<uint32_t>(GgufValueType::kInt32));
  Pod(kvs_, static_cast<uint64_t>(values.size()));
  for (int v : values) Pod(kvs_, static_cast<int32_t>(v));
}

void GgufWriter::AddF32Matrix(std::string_view name, int64_t rows, int64_t cols,
                              const float* data) {
  data_.resize((data_.size() + kAlignment - 1) / kAlignment * kAlignment, '\0');
  Str(infos_, name);
  Pod(infos_, uint32_t{2});
  Pod(infos_, static_cast<uint64_t>(cols));
  Pod(infos_, static_cast<uint64_t>(rows));
  Pod(infos_, static_cast<uint32_t>(TensorType::kF32));
  Pod(infos_, static_cast<uint64_t>(data_.size()));
  data_.append(reinterpret_cast<const char*>(data), static_cast<size_t>(rows * cols) * 4);
  ++n_tensors_;
}

std::string GgufWriter::Build() const {
  std::string out = "GGUF";
  Pod(out, uint32_t{3});
  Pod(out, n_tensors_);
  Pod(out, n_kvs_);
  out += kvs_;
  out += infos_;
  out.resize((out.size() + kAlignment - 1) / kAlignment * kAlignment, '\0');
  out += data_;
  return out;
}

absl::Status WriteFileBytes(const std::string& path, std::string_view bytes,
                            std::string_view what) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", std::string(what), " ", path));
  return absl::OkStatus();
}

}  // namespace subspace
