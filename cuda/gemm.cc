#include "cuda/gemm.h"

#include <cublas_v2.h>
#include <dlfcn.h>

#include <limits>
#include <string>
#include <type_traits>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"

namespace subspace::cuda {
namespace {

// The cuBLAS entry points the backend calls, resolved once from the library of the major version
// we compiled against. The _v2 names are the exported symbols behind cublas_v2.h's macros.
// The exported cublasGemmEx (cublas_api.h also has a C++ overload taking a cudaDataType compute
// type, so decltype cannot name it).
using GemmExFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                    int, const void*, const void*, cudaDataType, int, const void*,
                                    cudaDataType, int, const void*, void*, cudaDataType, int,
                                    cublasComputeType_t, cublasGemmAlgo_t);

struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  GemmExFn gemm_ex = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  absl::Status loaded;
};

const CublasApi& Api() {
  static CublasApi api;
  static absl::once_flag once;
  absl::call_once(once, [] {
    const std::string name = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
    void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      api.loaded = absl::UnavailableError(absl::StrCat("cannot load ", name, ": ", dlerror()));
      return;
    }
    const auto resolve = [&](auto* fn, const char* symbol) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, symbol));
      if (*fn == nullptr && api.loaded.ok()) {
        api.loaded = absl::UnavailableError(absl::StrCat(name, " has no ", symbol));
      }
    };
    resolve(&api.create, "cublasCreate_v2");
    resolve(&api.destroy, "cublasDestroy_v2");
    resolve(&api.set_stream, "cublasSetStream_v2");
    resolve(&api.set_workspace, "cublasSetWorkspace_v2");
    resolve(&api.gemm_ex, "cublasGemmEx");
    resolve(&api.status_name, "cublasGetStatusName");
  });
  return api;
}

// OK, RESOURCE_EXHAUSTED for an allocation failure, INTERNAL otherwise.
absl::Status CublasStatus(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message =
      absl::StrCat("cuBLAS: ", what, ": ", Api().status_name(status), " (", status, ")");
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Gemm>> Gemm::Create(cudaStream_t stream, void* workspace,
                                                   int64_t workspace_bytes) {
  const CublasApi& api = Api();
  if (!api.loaded.ok()) return api.loaded;
  cublasHandle_t handle = nullptr;
  if (absl::Status st = CublasStatus(api.create(&handle), "cublasCreate"); !st.ok()) return st;
  std::unique_ptr<Gemm> gemm(new Gemm(handle));
  if (absl::Status st = CublasStatus(api.set_stream(handle, stream), "cublasSetStream"); !st.ok()) {
    return st;
  }
  if (absl::Status st =
          CublasStatus(api.set_workspace(handle, workspace, static_cast<size_t>(workspace_bytes)),
                       "cublasSetWorkspace");
      !st.ok()) {
    return st;
  }
  return gemm;
}

Gemm::~Gemm() { Api().destroy(static_cast<cublasHandle_t>(handle_)); }

absl::Status Gemm::Linear(const uint16_t* w, int64_t out, int64_t in, const uint16_t* x, int64_t n,
                          float* y) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (out <= 0 || in <= 0 || n <= 0 || out > kIntMax || in > kIntMax || n > kIntMax) {
    return absl::InvalidArgumentError("GEMM sizes must be positive and fit int");
  }
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: y^T [out, n] = (w^T)^T [out, in] · x^T [in, n].
  return CublasStatus(
      Api().gemm_ex(static_cast<cublasHandle_t>(handle_), CUBLAS_OP_T, CUBLAS_OP_N,
                    static_cast<int>(out), static_cast<int>(n), static_cast<int>(in), &alpha, w,
                    CUDA_R_16F, static_cast<int>(in), x, CUDA_R_16F, static_cast<int>(in), &beta, y,
                    CUDA_R_32F, static_cast<int>(out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

}  // namespace subspace::cuda
