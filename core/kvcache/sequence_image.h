// A cache sequence's image: the bytes KvCacheBase::ExportSequence writes and ImportSequence reads
// (session snapshots, core/engine/session_snapshot.h). Little-endian fields written in order;
// the reader checks every length against what is left and every count against a caller's bound,
// so a corrupt image is an error, never a read past its end or a huge allocation.
#ifndef SUBSPACE_CORE_KVCACHE_SEQUENCE_IMAGE_H_
#define SUBSPACE_CORE_KVCACHE_SEQUENCE_IMAGE_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace subspace {

class ImageWriter {
 public:
  void U8(uint8_t v) { Raw(&v, 1); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void I32(int32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void I64(int64_t v) { Raw(&v, 8); }
  void F64(double v) { Raw(&v, 8); }
  // A length (u64), then the bytes.
  void Bytes(std::string_view s) {
    U64(s.size());
    out_.append(s);
  }
  void Raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }

  std::string& data() { return out_; }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;  // the host is little-endian (x86-64, aarch64): fields go out as they are
};

// Reads what ImageWriter wrote. Every failure is DATA_LOSS naming `what` (the image's kind) and
// the field.
class ImageReader {
 public:
  ImageReader(std::string_view data, std::string_view what) : data_(data), what_(what) {}

  absl::StatusOr<uint8_t> U8(std::string_view field) { return Fixed<uint8_t>(field); }
  absl::StatusOr<uint32_t> U32(std::string_view field) { return Fixed<uint32_t>(field); }
  absl::StatusOr<int32_t> I32(std::string_view field) { return Fixed<int32_t>(field); }
  absl::StatusOr<uint64_t> U64(std::string_view field) { return Fixed<uint64_t>(field); }
  absl::StatusOr<int64_t> I64(std::string_view field) { return Fixed<int64_t>(field); }
  absl::StatusOr<double> F64(std::string_view field) { return Fixed<double>(field); }
  // An integer in [lo, hi].
  absl::StatusOr<int64_t> Int(std::string_view field, int64_t lo, int64_t hi);
  // A length-prefixed byte string of at most `max_bytes`.
  absl::StatusOr<std::string_view> Bytes(std::string_view field, uint64_t max_bytes);
  // The next n bytes.
  absl::StatusOr<std::string_view> Raw(std::string_view field, uint64_t n);
  // DATA_LOSS unless every byte was read.
  absl::Status ExpectEnd() const;
  // Reads the layout line an image starts with (KvCacheBase::ImageLayout, written as Bytes):
  // FAILED_PRECONDITION naming both when it is not `want`.
  absl::Status ExpectLayout(std::string_view want);

  size_t left() const { return data_.size() - pos_; }
  absl::Status Corrupt(std::string_view why) const;

 private:
  template <typename T>
  absl::StatusOr<T> Fixed(std::string_view field) {
    absl::StatusOr<std::string_view> bytes = Raw(field, sizeof(T));
    if (!bytes.ok()) return bytes.status();
    T v;
    std::memcpy(&v, bytes->data(), sizeof(T));
    return v;
  }

  std::string_view data_;
  std::string_view what_;
  size_t pos_ = 0;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_KVCACHE_SEQUENCE_IMAGE_H_
