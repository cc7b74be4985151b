#include "kernels/gemm.h"

#include <limits>

#include "kernels/cuda_status.h"

namespace subspace::kernels {

absl::StatusOr<std::unique_ptr<Gemm>> Gemm::Create(cudaStream_t stream, void* workspace,
                                                   int64_t workspace_bytes) {
  cublasHandle_t handle = nullptr;
  if (absl::Status st = CublasStatus(cublasCreate(&handle), "cublasCreate"); !st.ok()) return st;
  std::unique_ptr<Gemm> gemm(new Gemm(handle));
  if (absl::Status st = CublasStatus(cublasSetStream(handle, stream), "cublasSetStream");
      !st.ok()) {
    return st;
  }
  if (absl::Status st =
          CublasStatus(cublasSetWorkspace(handle, workspace, static_cast<size_t>(workspace_bytes)),
                       "cublasSetWorkspace");
      !st.ok()) {
    return st;
  }
  return gemm;
}

Gemm::~Gemm() { cublasDestroy(handle_); }

absl::Status Gemm::Linear(const uint16_t* w, int64_t out, int64_t in, const uint16_t* x, int64_t n,
                          float* y) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (out <= 0 || in <= 0 || n <= 0 || out > kIntMax || in > kIntMax || n > kIntMax) {
    return absl::InvalidArgumentError("GEMM sizes must be positive and fit int");
  }
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: y^T [out, n] = (w^T)^T [out, in] · x^T [in, n].
  return CublasStatus(
      cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(n),
                   static_cast<int>(in), &alpha, w, CUDA_R_16F, static_cast<int>(in), x, CUDA_R_16F,
                   static_cast<int>(in), &beta, y, CUDA_R_32F, static_cast<int>(out),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

}  // namespace subspace::kernels
