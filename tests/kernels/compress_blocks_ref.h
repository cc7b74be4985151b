// CPU twin of compress_blocks.cu: the same CompressBlocksParams with host pointers, plain loops.
// The projection runs in double and is rounded once to float; the encoding is a plain-loop
// copy of core's EncodeCoeffs (checked bit-for-bit against it), so GPU results differ from the
// twin only by float summation order. Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_COMPRESS_BLOCKS_REF_H_
#define SUBSPACE_TESTS_KERNELS_COMPRESS_BLOCKS_REF_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/compress_blocks.h"

namespace subspace::kernels {

// INVALID_ARGUMENT when the batch is unsafe or out of range (p holds host pointers): a bad
// layout, a page outside [0, num_pages), a slot outside its page, an epoch outside
// [0, num_basis_epochs), a destination slot inside a source page of the batch, or two blocks
// with one destination.
absl::Status CheckCompressBatch(const CompressBlocksParams& p, int64_t num_pages,
                                int num_basis_epochs);

// Runs the batch on host memory. p: host pointers, a batch CheckCompressBatch accepts.
void CompressBlocksRef(const CompressBlocksParams& p);

// r coefficients into codes [r] (fp16 or int8) and, for int8, one fp16 scale, as
// EncodeCoeffs(dtype, x, r, codes, scale).
void EncodeCoeffsRef(CoeffDtype dtype, const float* x, int r, void* codes, uint16_t* scale);

}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_COMPRESS_BLOCKS_REF_H_
