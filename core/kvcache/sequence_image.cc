#include "core/kvcache/sequence_image.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace subspace {

absl::Status ImageReader::Corrupt(std::string_view why) const {
  return absl::DataLossError(absl::StrCat(std::string(what_), " is corrupt: ", std::string(why)));
}

absl::StatusOr<std::string_view> ImageReader::Raw(std::string_view field, uint64_t n) {
  if (n > left()) {
    return Corrupt(absl::StrFormat("%s needs %d bytes, %d are left (truncated)", field, n, left()));
  }
  std::string_view out = data_.substr(pos_, static_cast<size_t>(n));
  pos_ += static_cast<size_t>(n);
  return out;
}

absl::StatusOr<int64_t> ImageReader::Int(std::string_view field, int64_t lo, int64_t hi) {
  absl::StatusOr<int64_t> v = I64(field);
  if (!v.ok()) return v.status();
  if (*v < lo || *v > hi) {
    return Corrupt(absl::StrFormat("%s = %d is outside [%d, %d]", field, *v, lo, hi));
  }
  return *v;
}

absl::StatusOr<std::string_view> ImageReader::Bytes(std::string_view field, uint64_t max_bytes) {
  absl::StatusOr<uint64_t> n = U64(field);
  if (!n.ok()) return n.status();
  if (*n > max_bytes) {
    return Corrupt(
        absl::StrFormat("%s claims %d bytes, more than its limit %d", field, *n, max_bytes));
  }
  return Raw(field, *n);
}

absl::Status ImageReader::ExpectLayout(std::string_view want) {
  absl::StatusOr<std::string_view> layout = Bytes("layout", 4096);
  if (!layout.ok()) return layout.status();
  if (*layout != want) {
    return absl::FailedPreconditionError(absl::StrCat("KV cache image of another cache: '",
                                                      std::string(*layout), "', this one is '",
                                                      std::string(want), "'"));
  }
  return absl::OkStatus();
}

absl::Status ImageReader::ExpectEnd() const {
  if (left() != 0) return Corrupt(absl::StrFormat("%d bytes past its end", left()));
  return absl::OkStatus();
}

}  // namespace subspace
