// SwiGLU on the device over the fused gate/up projection: each row of [n, 2 * ffn] holds gate
// then up (the fused weight [w_gate; w_up]); out = silu(gate) * up rounded to fp16, the down
// projection's input. The Params struct is plain C++ so the CPU twin (tests/kernels/
// layer_ops_ref.h) takes it too.
#ifndef SUBSPACE_KERNELS_SWIGLU_H_
#define SUBSPACE_KERNELS_SWIGLU_H_

#include <cstdint>

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

struct SwiGluParams {
  const float* gate_up = nullptr;  // [n, 2 * ffn] gate columns, then up columns
  uint16_t* out = nullptr;         // [n, ffn] fp16 bits
  int32_t n = 0;
  int32_t ffn = 0;
};

#if defined(SUBSPACE_WITH_CUDA)
// A grid-stride launch over n * ffn elements. cudaErrorInvalidValue for non-positive sizes;
// else the launch's own error. Asynchronous.
cudaError_t LaunchSwiGlu(const SwiGluParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_SWIGLU_H_
