#include "core/base/rope.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace subspace {

std::string_view RopeLayoutName(RopeLayout layout) {
  return layout == RopeLayout::kHalves ? "halves (neox)" : "adjacent pairs";
}

absl::StatusOr<RopeSchedule> RopeSchedule::Make(const RopeParams& p) {
  if (p.dim <= 0 || p.dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("RoPE dims %d must be even and positive", p.dim));
  }
  if (!(p.theta > 0.0) || !std::isfinite(p.theta)) {
    return absl::InvalidArgumentError(absl::StrFormat("RoPE base %g must be positive", p.theta));
  }
  if (!(p.freq_scale > 0.0) || !std::isfinite(p.freq_scale)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("RoPE frequency scale %g must be positive", p.freq_scale));
  }
  const int pairs = p.dim / 2;
  if (!p.freq_factors.empty() && static_cast<int>(p.freq_factors.size()) != pairs) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "RoPE frequency factors: %d values for %d rotated pairs", p.freq_factors.size(), pairs));
  }
  RopeSchedule s;
  s.dim = p.dim;
  s.layout = p.layout;
  s.inv_freq.resize(static_cast<size_t>(pairs));
  for (int i = 0; i < pairs; ++i) {
    double f = p.freq_scale * std::pow(p.theta, -2.0 * i / p.dim);
    if (!p.freq_factors.empty()) {
      const double factor = p.freq_factors[static_cast<size_t>(i)];
      if (!(factor > 0.0) || !std::isfinite(factor)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("RoPE frequency factor %d is %g; it must be positive", i, factor));
      }
      f /= factor;
    }
    s.inv_freq[static_cast<size_t>(i)] = f;
  }
  return s;
}

}  // namespace subspace
