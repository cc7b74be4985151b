// The rotary position embedding's schedule, shared by every backend: which dims pair up and
// the angle per position of each pair, with the scalings models use. The CPU kernel
// (cpu::Rope) and the CUDA backend's cos/sin table both take their angles from here, so the
// two paths cannot drift.
#ifndef SUBSPACE_CORE_BASE_ROPE_H_
#define SUBSPACE_CORE_BASE_ROPE_H_

#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace subspace {

enum class RopeLayout {
  // (x[2i], x[2i+1]): GGUF "llama" files, whose converter permutes Q/K rows for it.
  kAdjacentPairs,
  // (x[i], x[i + dim/2]): the original layout of Qwen2, Qwen3, Phi-3 and others
  // (llama.cpp's ROPE_TYPE_NEOX).
  kHalves,
};

std::string_view RopeLayoutName(RopeLayout layout);

struct RopeParams {
  int dim = 0;  // dims rotated per head, even
  double theta = 10000.0;
  RopeLayout layout = RopeLayout::kAdjacentPairs;
  // Linear position interpolation: angles times freq_scale (1 / rope.scaling.factor).
  double freq_scale = 1.0;
  // Per-pair divisors of the frequency (Llama 3.x's rope_freqs tensor); empty for none.
  std::vector<float> freq_factors;
  // YaRN (rope.scaling.type = yarn): pairs that turn fewer than beta_slow times over the
  // original context are interpolated by freq_scale, those that turn more than beta_fast
  // times are left alone, with a linear ramp between (times ext_factor); cos and sin grow by
  // 1 + 0.1 ln(1 / freq_scale). The formulas of the YaRN paper as ggml implements them.
  bool yarn = false;
  int yarn_original_context = 0;
  double yarn_ext_factor = 1.0;
  double yarn_beta_fast = 32.0;
  double yarn_beta_slow = 1.0;
  // Multiplies cos and sin (rope.scaling.attn_factor); YaRN's own factor comes on top.
  double attn_factor = 1.0;
};

struct RopeSchedule {
  int dim = 0;
  RopeLayout layout = RopeLayout::kAdjacentPairs;
  // Radians per position of pair i: freq_scale * theta^(-2i/dim) / freq_factors[i] (with YaRN,
  // the scale blends towards 1 for the fast pairs), in double (pos * freq in fp32 loses ~1e-4
  // rad by position 4096).
  std::vector<double> inv_freq;  // [dim / 2]
  // cos and sin are multiplied by this (1 but for YaRN and rope.scaling.attn_factor).
  double mscale = 1.0;

  // INVALID_ARGUMENT for an odd or non-positive dim, a non-positive theta or scale, or factors
  // that are not dim / 2 positive finite numbers.
  static absl::StatusOr<RopeSchedule> Make(const RopeParams& params);
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_BASE_ROPE_H_
