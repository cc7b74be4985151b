#include "core/kvcache/refresh_config.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace subspace {

const char* RefreshMethodName(RefreshMethod m) {
  switch (m) {
    case RefreshMethod::kNone:
      return "none";
    case RefreshMethod::kPca:
      return "pca";
    case RefreshMethod::kKqsvd:
      return "kqsvd";
    case RefreshMethod::kOja:
      return "oja";
    case RefreshMethod::kFd:
      return "fd";
  }
  return "?";
}

absl::StatusOr<RefreshMethod> ParseRefreshMethod(std::string_view name) {
  for (RefreshMethod m : {RefreshMethod::kNone, RefreshMethod::kPca, RefreshMethod::kKqsvd,
                          RefreshMethod::kOja, RefreshMethod::kFd}) {
    if (name == RefreshMethodName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown refresh method '", std::string(name),
                                                 "' (none, pca, kqsvd, oja or fd)"));
}

absl::Status ValidateRefreshConfig(const RefreshConfig& c) {
  if (c.every_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("refresh every_tokens must be >= 0, got ", c.every_tokens));
  }
  if (!(c.residual_threshold >= 0.0) || !std::isfinite(c.residual_threshold)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refresh residual_threshold must be finite and >= 0, got ", c.residual_threshold));
  }
  if (!(c.half_life_tokens >= 0.0) || !std::isfinite(c.half_life_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("refresh half_life_tokens must be finite and >= 0, got ", c.half_life_tokens));
  }
  if (!(c.oja_learning_rate > 0.0) || !std::isfinite(c.oja_learning_rate)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refresh oja_learning_rate must be finite and > 0, got ", c.oja_learning_rate));
  }
  if (c.max_epochs < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("refresh max_epochs must be >= 1, got ", c.max_epochs));
  }
  if (c.method != RefreshMethod::kNone && c.every_tokens == 0 && c.residual_threshold == 0.0) {
    return absl::InvalidArgumentError(
        "online refresh needs a trigger: refresh every_tokens > 0 or refresh residual_threshold > "
        "0");
  }
  return absl::OkStatus();
}

}  // namespace subspace
