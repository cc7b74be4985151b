// libcublas.so.<major> for the emulated device: the entry points cuda/gemm.cc resolves with
// dlopen, cublasGemmEx as cuBLAS defines it (column-major, op(A) and op(B), leading dimensions,
// fp16 inputs, fp32 output and accumulation). The emulated backend test puts this library first
// on the loader's path, so gemm.cc's real calls, transposes and strides are what is checked.
// Work goes through the emulated stream (subspace::emu::Submit, exported by the test binary), so
// a GEMM captured into a graph runs when the graph does.
#include <cublas_api.h>
#include <cuda_fp16.h>

#include <vector>

#include "tests/cuda_emu/cuda_emu.h"

namespace {
const char kGemmNode = 0;  // the graph node key of a GEMM
}  // namespace

struct cublasContext {
  cudaStream_t stream = nullptr;
};

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (bytes > 0 && workspace == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    default:
      return "CUBLAS_STATUS_UNKNOWN (emulated)";
  }
}

// The one configuration the backend uses: fp16 A and B, fp32 C, fp32 compute and scalars.
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (Atype != CUDA_R_16F || Btype != CUDA_R_16F || Ctype != CUDA_R_32F ||
      compute != CUBLAS_COMPUTE_32F) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  if (m < 0 || n < 0 || k < 0 || lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m || lda < 1 ||
      ldb < 1 || ldc < 1 || alpha == nullptr || beta == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const float a_scale = *static_cast<const float*>(alpha);
  const float b_scale = *static_cast<const float*>(beta);
  const auto* a = static_cast<const __half*>(A);
  const auto* b = static_cast<const __half*>(B);
  auto* c = static_cast<float*>(C);
  subspace::emu::Submit(handle->stream, &kGemmNode, [=] {
    std::vector<float> col(static_cast<size_t>(k));
    for (int j = 0; j < n; ++j) {
      for (int l = 0; l < k; ++l) {
        col[static_cast<size_t>(l)] = __half2float(tb ? b[j + static_cast<size_t>(l) * ldb]
                                                      : b[l + static_cast<size_t>(j) * ldb]);
      }
      for (int i = 0; i < m; ++i) {
        float acc = 0.0f;
        for (int l = 0; l < k; ++l) {
          const __half av =
              ta ? a[l + static_cast<size_t>(i) * lda] : a[i + static_cast<size_t>(l) * lda];
          acc += __half2float(av) * col[static_cast<size_t>(l)];
        }
        float& out = c[i + static_cast<size_t>(j) * ldc];
        out = a_scale * acc + (b_scale == 0.0f ? 0.0f : b_scale * out);
      }
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
