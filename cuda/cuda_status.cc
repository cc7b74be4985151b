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

}  // namespace subspace::cuda
