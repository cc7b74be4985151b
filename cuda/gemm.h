// The backend's linear layers through cuBLAS: y[n, out] = x[n, in] · w[out, in]ᵀ with fp16
// weights and activations and fp32 accumulation and output (tensor cores on sm_80+). Row-major
// on our side; cuBLAS is column-major, so the call computes yᵀ = w · xᵀ with w transposed.
// cuBLAS is opened with dlopen on first use (see kernels/CMakeLists.txt for why it is not linked).
#ifndef SUBSPACE_CUDA_GEMM_H_
#define SUBSPACE_CUDA_GEMM_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace subspace::cuda {

class Gemm {
 public:
  // Work goes to `stream`; cuBLAS's scratch is `workspace` (device, `workspace_bytes`), given
  // up front so cuBLAS never allocates on the request path (nor inside a graph capture).
  // UNAVAILABLE when libcublas cannot be loaded.
  static absl::StatusOr<std::unique_ptr<Gemm>> Create(cudaStream_t stream, void* workspace,
                                                      int64_t workspace_bytes);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // w: [out, in] fp16 bits; x: [n, in] fp16 bits; y: [n, out] fp32. Asynchronous.
  absl::Status Linear(const uint16_t* w, int64_t out, int64_t in, const uint16_t* x, int64_t n,
                      float* y);

 private:
  explicit Gemm(void* handle) : handle_(handle) {}
  void* handle_;  // cublasHandle_t
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_GEMM_H_
