// Building the transform codec's device tables (transform_tables.h).
#include "cuda/transform_tables.h"

#include <algorithm>

#include "kernels/transform_blocks.h"

namespace subspace::cuda {

TransformLayerTables BuildTransformTables(const std::vector<TransformCode>& key_codes,
                                          const std::vector<TransformCode>& value_codes, int layer,
                                          int n_kv_heads, int head_dim, int block_size) {
  using kernels::TransformField;
  const int d = head_dim;
  const int64_t nf = kernels::TransformFloats(d), ni = kernels::TransformInts(d);
  TransformLayerTables t;
  t.floats.assign(static_cast<size_t>(2 * n_kv_heads * nf), 0.0f);
  t.ints.assign(static_cast<size_t>(2 * n_kv_heads * ni), 0);
  for (int side = 0; side < 2; ++side) {
    for (int h = 0; h < n_kv_heads; ++h) {
      const TransformCode& code =
          (side == 0 ? key_codes : value_codes)[static_cast<size_t>(layer * n_kv_heads + h)];
      const int64_t rec = int64_t{side} * n_kv_heads + h;
      float* f = t.floats.data() + rec * nf;
      int32_t* n = t.ints.data() + rec * ni;
      const CodedRunLayout run = LayOutCodedRun(code, block_size);
      n[TransformField::kActive] = run.active();
      n[TransformField::kRunOffset] = static_cast<int32_t>(t.coded_bytes);
      std::vector<double> ext(static_cast<size_t>(d), 0.0);
      for (int j = 0; j < d; ++j) {  // the components without bits, in component order
        const ComponentQuantizer& q = code.components[static_cast<size_t>(j)];
        if (q.bits != 0) continue;
        const float* row = code.basis.data() + static_cast<int64_t>(j) * d;
        for (int i = 0; i < d; ++i) ext[static_cast<size_t>(i)] += double{q.offset} * row[i];
      }
      for (int i = 0; i < d; ++i) {
        const float s = code.scale.empty() ? 1.0f : code.scale[static_cast<size_t>(i)];
        f[TransformField::kMean * d + i] = code.mean[static_cast<size_t>(i)];
        f[TransformField::kScale * d + i] = s;
        f[TransformField::kInvScale * d + i] = 1.0f / s;
        f[TransformField::kExt * d + i] = static_cast<float>(
            ext[static_cast<size_t>(i)] + double{code.mean[static_cast<size_t>(i)]} * s);
      }
      for (int a = 0; a < run.active(); ++a) {
        const int j = run.components[static_cast<size_t>(a)];
        const ComponentQuantizer& q = code.components[static_cast<size_t>(j)];
        f[TransformField::kOffset * d + a] = q.offset;
        f[TransformField::kStep * d + a] = q.step;
        std::copy_n(code.basis.data() + static_cast<int64_t>(j) * d, d,
                    f + TransformField::kBasis * d + static_cast<int64_t>(a) * d);
        n[TransformField::kBits + a] = q.bits;
        n[TransformField::kBits + d + a] =
            static_cast<int32_t>(run.byte_at[static_cast<size_t>(a)]);
      }
      t.coded_bytes += run.run_bytes;
    }
  }
  return t;
}

}  // namespace subspace::cuda
