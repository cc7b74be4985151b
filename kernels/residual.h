// Residual-stream element-wise ops on the device: x += y after each sub-layer, the fp32 -> fp16
// cast that feeds attention output into the output projection GEMM, and the gathering cast that
// collects the query rows a step reads back for KQ-SVD refresh. The Params structs are
// plain C++ so the CPU twins (tests/kernels/layer_ops_ref.h) take them too.
#ifndef SUBSPACE_KERNELS_RESIDUAL_H_
#define SUBSPACE_KERNELS_RESIDUAL_H_

#include <cstdint>

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

struct ResidualAddParams {
  float* x = nullptr;        // [n] updated in place
  const float* y = nullptr;  // [n]
  int64_t n = 0;
};

struct CastToHalfParams {
  const float* in = nullptr;  // [n]
  uint16_t* out = nullptr;    // [n] fp16 bits, round to nearest even
  int64_t n = 0;
};

// out[i] = fp16(in[rows[i]]), row by row.
struct GatherRowsToHalfParams {
  const float* in = nullptr;      // [*, width]
  const int32_t* rows = nullptr;  // [n_rows] rows of `in` (planned on the host: each valid)
  uint16_t* out = nullptr;        // [n_rows, width] fp16 bits, round to nearest even
  int32_t n_rows = 0;
  int32_t width = 0;
};

#if defined(SUBSPACE_WITH_CUDA)
// Grid-stride launches. cudaErrorInvalidValue for n <= 0; else the launch's own error.
// Asynchronous.
cudaError_t LaunchResidualAdd(const ResidualAddParams& params, cudaStream_t stream);
cudaError_t LaunchCastToHalf(const CastToHalfParams& params, cudaStream_t stream);
// Grid (n_rows); cudaErrorInvalidValue for n_rows or width <= 0.
cudaError_t LaunchGatherRowsToHalf(const GatherRowsToHalfParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_RESIDUAL_H_
