#include "cuda/cuda_status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace subspace::cuda {

absl::Status CudaStatus(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat("CUDA: ", std::string(what), ": ", cudaGetErrorName(err),
                                           " (", cudaGetErrorString(err), ")");
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status CopyAfterStream(cudaStream_t stream, void* dst, const void* src, size_t n,
                             cudaMemcpyKind kind) {
  if (absl::Status st = CudaStatus(cudaStreamSynchronize(stream), "KV image: stream sync");
      !st.ok()) {
    return st;
  }
  return CudaStatus(cudaMemcpy(dst, src, n, kind),
                    kind == cudaMemcpyDeviceToHost ? "KV image: read" : "KV image: write");
}

}  // namespace subspace::cuda
