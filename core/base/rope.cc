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
  if (!(p.attn_factor > 0.0) || !std::isfinite(p.attn_factor)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("RoPE attention factor %g must be positive", p.attn_factor));
  }
  RopeSchedule s;
  s.dim = p.dim;
  s.layout = p.layout;
  s.mscale = p.attn_factor;
  // YaRN's correction range: the pairs [low, high] between "turns beta_fast times over the
  // original context" and "turns beta_slow times" (ggml_rope_yarn_corr_dims).
  double low = 0.0;
  double high = 0.0;
  const bool yarn = p.yarn && p.yarn_ext_factor != 0.0;
  if (p.yarn) {
    if (p.yarn_original_context <= 0) {
      return absl::InvalidArgumentError("YaRN needs the original context length");
    }
    const auto corr_dim = [&](double rotations) {
      return p.dim * std::log(p.yarn_original_context / (rotations * 2.0 * M_PI)) /
             (2.0 * std::log(p.theta));
    };
    low = std::max(0.0, std::floor(corr_dim(p.yarn_beta_fast)));
    high = std::min(static_cast<double>(p.dim - 1), std::ceil(corr_dim(p.yarn_beta_slow)));
    if (yarn) s.mscale *= 1.0 + 0.1 * std::log(1.0 / p.freq_scale);
  }
  s.inv_freq.resize(static_cast<size_t>(pairs));
  for (int i = 0; i < pairs; ++i) {
    double scale = p.freq_scale;
    if (yarn) {
      const double ramp =
          1.0 - std::min(1.0, std::max(0.0, (i - low) / std::max(0.001, high - low)));
      const double mix = ramp * p.yarn_ext_factor;
      scale = p.freq_scale * (1.0 - mix) + mix;
    }
    double f = scale * std::pow(p.theta, -2.0 * i / p.dim);
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
