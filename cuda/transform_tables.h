// The transform codec's tables as the device kernels read them (kernels/transform_blocks.h),
// built on the host from the codes a codec file or a start-up fit gives (TransformCode,
// core/compress/transform_codec.h) with the run layout every transform-coded cache shares
// (LayOutCodedRun). Host C++ only.
#ifndef SUBSPACE_CUDA_TRANSFORM_TABLES_H_
#define SUBSPACE_CUDA_TRANSFORM_TABLES_H_

#include <cstdint>
#include <vector>

#include "core/compress/transform_codec.h"

namespace subspace::cuda {

// One layer's tables: the records of kernels::TransformTables, and the bytes of one coded block
// (every KV head's key run, then every head's value run, as TransformKvCache stores them).
struct TransformLayerTables {
  std::vector<float> floats;  // [2 n_kv][kernels::TransformFloats(d)]
  std::vector<int32_t> ints;  // [2 n_kv][kernels::TransformInts(d)]
  int64_t coded_bytes = 0;
};

// Layer `layer`'s tables from the codes of every layer ([layer * n_kv + h], TransformKvCache's
// order), each of dimension `head_dim`, for blocks of `block_size` tokens.
TransformLayerTables BuildTransformTables(const std::vector<TransformCode>& key_codes,
                                          const std::vector<TransformCode>& value_codes, int layer,
                                          int n_kv_heads, int head_dim, int block_size);

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_TRANSFORM_TABLES_H_
