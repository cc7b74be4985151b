// CPU twin of recode_blocks.cu: the same RecodeBlocksParams with host pointers, plain loops.
// Codes are decoded as core's DecodeCoeffs decodes them, the rebuilt rows and the new
// coefficients are summed in double, the coefficients rounded once to float and encoded as
// EncodeCoeffs does, so GPU results differ from the twin only by float summation order.
// Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_RECODE_BLOCKS_REF_H_
#define SUBSPACE_TESTS_KERNELS_RECODE_BLOCKS_REF_H_

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "kernels/recode_blocks.h"
#include "tests/kernels/expand_blocks_ref.h"

namespace subspace::kernels {

// INVALID_ARGUMENT when the batch is unsafe or out of range (p holds host pointers): a bad
// layout, a page outside [0, num_pages), a slot outside its page, an epoch outside
// [0, num_basis_epochs), or two blocks in one slot.
absl::Status CheckRecodeBatch(const RecodeBlocksParams& p, int64_t num_pages, int num_basis_epochs);

// Runs the batch on host memory. p: host pointers, a batch CheckRecodeBatch accepts.
void RecodeBlocksRef(const RecodeBlocksParams& p);

namespace testing {

// A random batch: expand_blocks_ref's coded slots (one pool, every other byte poisoned) with its
// bases and the epochs that coded them, and a random epoch to re-code each block-head into.
struct RecodeCase {
  ExpandCase coded;
  std::vector<int32_t> to;  // [n_blocks, n_kv]

  // Params over `pool` (a copy of coded.src_pool, or its device mirror's host twin) and this
  // case's host arrays.
  RecodeBlocksParams HostParams(std::vector<uint8_t>& pool) const;
};

RecodeCase RandomRecodeCase(const KvPoolLayout& l, int n_blocks, int n_epochs,
                            std::mt19937_64& rng);

}  // namespace testing

}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_RECODE_BLOCKS_REF_H_
