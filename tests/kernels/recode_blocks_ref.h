// CPU twin of recode_blocks.cu: the same RecodeBlocksParams with host pointers, plain loops.
// Codes are decoded as core's DecodeCoeffs decodes them, the rebuilt rows and the new
// coefficients are summed in double, the coefficients rounded once to float and encoded as
// EncodeCoeffs does, so GPU results differ from the twin only by float summation order.
// Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_RECODE_BLOCKS_REF_H_
#define SUBSPACE_TESTS_KERNELS_RECODE_BLOCKS_REF_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/recode_blocks.h"

namespace subspace::kernels {

// INVALID_ARGUMENT when the batch is unsafe or out of range (p holds host pointers): a bad
// layout, a page outside [0, num_pages), a slot outside its page, an epoch outside
// [0, num_basis_epochs), or two blocks in one slot.
absl::Status CheckRecodeBatch(const RecodeBlocksParams& p, int64_t num_pages, int num_basis_epochs);

// Runs the batch on host memory. p: host pointers, a batch CheckRecodeBatch accepts.
void RecodeBlocksRef(const RecodeBlocksParams& p);

}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_RECODE_BLOCKS_REF_H_
