// The backend's linear layers through cuBLAS: y[n, out] = x[n, in] · w[out, in]ᵀ with fp16
// weights and activations and fp32 accumulation and output (tensor cores on sm_80+). Row-major
// on our side; cuBLAS is column-major, so the call computes yᵀ = w · xᵀ with w transposed.
#ifndef SUBSPACE_KERNELS_GEMM_H_
#define SUBSPACE_KERNELS_GEMM_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace subspace::kernels {

class Gemm {
 public:
  // Work goes to `stream`; cuBLAS's scratch is `workspace` (device, `workspace_bytes`), given
  // up front so cuBLAS never allocates on the request path (nor inside a graph capture).
  static absl::StatusOr<std::unique_ptr<Gemm>> Create(cudaStream_t stream, void* workspace,
                                                      int64_t workspace_bytes);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // w: [out, in] fp16 bits; x: [n, in] fp16 bits; y: [n, out] fp32. Asynchronous.
  absl::Status Linear(const uint16_t* w, int64_t out, int64_t in, const uint16_t* x, int64_t n,
                      float* y);

 private:
  explicit Gemm(cublasHandle_t handle) : handle_(handle) {}
  cublasHandle_t handle_;
};

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_GEMM_H_
