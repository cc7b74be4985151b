// CUDA runtime results as absl::Status, so the CUDA backend reports failures the way the rest
// of the server does: INTERNAL naming the operation and the library's own error name.
#ifndef SUBSPACE_CUDA_CUDA_STATUS_H_
#define SUBSPACE_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string_view>

#include "absl/status/status.h"

namespace subspace::cuda {

// OK for cudaSuccess; RESOURCE_EXHAUSTED for cudaErrorMemoryAllocation; INTERNAL otherwise.
absl::Status CudaStatus(cudaError_t err, std::string_view what);

// The session images' copy of `n` bytes between pageable host memory and the device (`kind`),
// after every operation queued on `stream`: it waits for them, then for the copy.
absl::Status CopyAfterStream(cudaStream_t stream, void* dst, const void* src, size_t n,
                             cudaMemcpyKind kind);

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_CUDA_STATUS_H_
