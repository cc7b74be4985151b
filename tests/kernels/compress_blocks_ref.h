// CPU twin of compress_blocks.cu: the same CompressBlocksParams with host pointers, plain loops.
// The projection runs in double and is rounded once to float; the encoding is a plain-loop
// copy of core's EncodeCoeffs (checked bit-for-bit against it), so GPU results differ from the
// twin only by float summation order. Outlier detection computes k^ = P_q c from the float
// coefficients and the residual in double, as CompressedKvCache::CompressBlock does (it sums k^
// in float): tokens near the threshold may fall either way. Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_COMPRESS_BLOCKS_REF_H_
#define SUBSPACE_TESTS_KERNELS_COMPRESS_BLOCKS_REF_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/compress_blocks.h"

namespace subspace::kernels {

// INVALID_ARGUMENT when the batch is unsafe or out of range (p holds host pointers): a bad
// layout, a page outside [0, num_pages), a slot outside its page, an epoch outside
// [0, num_basis_epochs), a destination slot inside a source page of the batch, two blocks
// with one destination, or outlier masks without basis_pq.
absl::Status CheckCompressBatch(const CompressBlocksParams& p, int64_t num_pages,
                                int num_basis_epochs);

// Runs the batch on host memory. p: host pointers, a batch CheckCompressBatch accepts. With
// outlier masks, ORs each block's outlier bits into outlier_masks[i] as the kernel does.
void CompressBlocksRef(const CompressBlocksParams& p);

// r coefficients into codes [r] (fp16 or int8) and, for int8, one fp16 scale, as
// EncodeCoeffs(dtype, x, r, codes, scale).
void EncodeCoeffsRef(CoeffDtype dtype, const float* x, int r, void* codes, uint16_t* scale);

namespace testing {

// An outlier threshold for tokens with residual ratios `ratios` (|k - k^|^2 / |k|^2, the
// largest over a token's heads; at least two): its square lies mid-way across the widest gap
// between neighbouring ratios in their middle half, so between a quarter and three quarters of
// the tokens are outliers and, that gap being far wider than rounding, float and double sums
// agree on every token (callers check the margin they got).
float ThresholdInAGap(std::vector<double> ratios);

}  // namespace testing

}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_COMPRESS_BLOCKS_REF_H_
