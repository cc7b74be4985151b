// A view of one weight matrix as stored in the model file, kept in its stored type so the
// CPU kernels can read fp16/bf16/Q8_0 directly (half or a quarter of the fp32 bytes).
#ifndef SUBSPACE_CORE_BASE_WEIGHT_H_
#define SUBSPACE_CORE_BASE_WEIGHT_H_

#include <cstdint>

#include "core/base/tensor_types.h"

namespace subspace {

// Row-major [rows, cols]: row r holds output feature r (GGUF dims {cols, rows}).
struct WeightMatrix {
  TensorType type = TensorType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  const uint8_t* data = nullptr;  // rows * TensorRowBytes(type, cols) bytes

  uint64_t row_bytes() const { return TensorRowBytes(type, cols); }
  const uint8_t* row(int64_t r) const { return data + static_cast<uint64_t>(r) * row_bytes(); }
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_BASE_WEIGHT_H_
