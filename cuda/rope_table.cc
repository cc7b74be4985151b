// The host-built cos/sin table the RoPE kernel reads: the angles of cpu::Rope (pos times the
// schedule's inverse frequency in double, cos and sin in double rounded to float), computed
// once per model so the device rotates bit-identically to the CPU backend.
#include "cuda/rope_table.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace subspace::cuda {

std::vector<float> RopeCosSinTable(int32_t max_position, const RopeSchedule& rope) {
  if (max_position <= 0 || rope.dim <= 0) return {};
  const int pairs = rope.dim / 2;
  std::vector<float> table(static_cast<size_t>(max_position) * static_cast<size_t>(pairs) * 2);
  for (int32_t pos = 0; pos < max_position; ++pos) {
    float* row = table.data() + static_cast<size_t>(pos) * static_cast<size_t>(pairs) * 2;
    for (int p = 0; p < pairs; ++p) {
      // The exact expression of cpu::Rope: any reassociation would move some angles by an ulp
      // and break the bit-for-bit agreement the twin test checks.
      const double angle = static_cast<double>(pos) * rope.inv_freq[static_cast<size_t>(p)];
      row[2 * p] = static_cast<float>(std::cos(angle) * rope.mscale);
      row[2 * p + 1] = static_cast<float>(std::sin(angle) * rope.mscale);
    }
  }
  return table;
}

std::vector<float> RopeCosSinTable(int32_t max_position, int32_t rope_dim, float theta) {
  absl::StatusOr<RopeSchedule> rope = RopeSchedule::Make({.dim = rope_dim, .theta = theta});
  return rope.ok() ? RopeCosSinTable(max_position, *rope) : std::vector<float>{};
}

}  // namespace subspace::cuda
