// RMSNorm on the device: fp32 residual rows in, fp16 rows out (the next GEMM's input), optionally
// gathering only some rows (the final norm before the logits reads one row per sequence).
// The Params struct is plain C++ so the CPU twin (tests/kernels/layer_ops_ref.h) takes it too.
#ifndef SUBSPACE_KERNELS_RMS_NORM_H_
#define SUBSPACE_KERNELS_RMS_NORM_H_

#include <cstdint>

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

// out[i, :] = x[rows[i], :] / sqrt(mean(x[rows[i], :]^2) + eps) * weight, rounded to fp16.
// The sum of squares accumulates in fp32 per thread and is reduced across the CTA.
// With `add`, the residual add before the norm is fused: each row read first becomes
// x[row] + add[row] in fp32 and is stored back into x (the same sums a separate
// ResidualAdd would leave), then normalised; the rows must then be distinct.
struct RmsNormParams {
  float* x = nullptr;             // [*, dim] residual stream; written only with `add`
  const float* weight = nullptr;  // [dim]
  const int32_t* rows = nullptr;  // [n] rows of x to normalise; nullptr: rows 0..n-1
  uint16_t* out = nullptr;        // [n, dim] fp16 bits
  int32_t n = 0;
  int32_t dim = 0;
  float eps = 1e-5f;
  const float* add = nullptr;  // [*, dim] added into x's rows first; nullptr: no add
};

#if defined(SUBSPACE_WITH_CUDA)
// Grid (n) of 256 threads. cudaErrorInvalidValue for non-positive sizes; else the launch's own
// error. Asynchronous.
cudaError_t LaunchRmsNorm(const RmsNormParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_RMS_NORM_H_
