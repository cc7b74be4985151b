// CUDA runtime results as absl::Status, so the CUDA backend reports failures the way the rest
// of the server does: INTERNAL naming the operation and the library's own error name.
#ifndef SUBSPACE_CUDA_CUDA_STATUS_H_
#define SUBSPACE_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include <string_view>

#include "absl/status/status.h"

namespace subspace::cuda {

// OK for cudaSuccess; RESOURCE_EXHAUSTED for cudaErrorMemoryAllocation; INTERNAL otherwise.
absl::Status CudaStatus(cudaError_t err, std::string_view what);

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_CUDA_STATUS_H_
