// CPU twin of outlier_tokens.cu: the same OutlierTokensParams with host pointers, plain loops
// and a memcpy per row, so the kernel must match it byte for byte. Also the random batches both
// the twin's and the kernel's tests draw. Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_OUTLIER_TOKENS_REF_H_
#define SUBSPACE_TESTS_KERNELS_OUTLIER_TOKENS_REF_H_

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "kernels/outlier_tokens.h"

namespace subspace::kernels {

// INVALID_ARGUMENT when the batch is unsafe or out of range (p holds host pointers): a bad
// layout (KvPoolLayoutError) or a head_dim the kernel does not support, a negative n_blocks,
// mask bits at or past block_size, a first_slot outside [0, B), a block page outside
// [0, num_block_pages), for a block with outliers a first outlier page outside
// [0, num_outlier_pages) and, when first_slot + popcount(mask) > B, a second one missing or out
// of range, two blocks writing one destination token, or, with same_pool (block_pool and
// outlier_pool are one buffer), a destination token that is a source token of the batch.
absl::Status CheckOutlierBatch(const OutlierTokensParams& p, int64_t num_block_pages,
                               int64_t num_outlier_pages, bool same_pool);

// Runs the batch on host memory. p: host pointers, a batch CheckOutlierBatch accepts.
void OutlierTokensRef(const OutlierTokensParams& p);

namespace testing {

// A random batch, as one sequence's outlier store fills: block pages of random fp16 rows, the
// outliers of consecutive blocks packed in order into shuffled outlier pages from a random
// first slot (so blocks share pages and some straddle two), every outlier page and one spare
// page per block (where the blocks expand back to) poisoned. Masks: every fourth block (from
// block 1) has no outliers, every fourth (from block 2) only outliers, the rest draw each token
// with p_outlier. Second outlier pages a block does not use are -1, as are both pages of a
// block without outliers. With same_pool every page lies in one pool, else the block and spare
// pages in a pool of their own; a page nobody names in each pool.
struct OutlierCase {
  KvPoolLayout layout;
  bool same_pool = false;
  int64_t num_block_pages = 0;
  int64_t num_outlier_pages = 0;      // == num_block_pages with same_pool
  std::vector<uint8_t> block_pool;    // [num_block_pages * page_bytes]; empty with same_pool
  std::vector<uint8_t> outlier_pool;  // [num_outlier_pages * page_bytes]
  std::vector<int32_t> block_page;    // [n_blocks] random rows
  std::vector<int32_t> spare_page;    // [n_blocks] poisoned, in the block pool
  std::vector<uint64_t> mask;         // [n_blocks]
  std::vector<int32_t> first_slot;    // [n_blocks]
  std::vector<int32_t> outlier_page;  // [n_blocks, 2]

  int32_t n_blocks() const { return static_cast<int32_t>(block_page.size()); }
  // The bytes the block pages are in: block_pool, or outlier_pool with same_pool.
  std::vector<uint8_t>& block_bytes() { return same_pool ? outlier_pool : block_pool; }
  // Params over this case's host buffers; `pages` names the block pages (block_page or
  // spare_page).
  OutlierTokensParams HostParams(OutlierMove direction, const std::vector<int32_t>& pages);
};

OutlierCase RandomOutlierCase(const KvPoolLayout& l, int n_blocks, bool same_pool, double p_outlier,
                              std::mt19937_64& rng);

}  // namespace testing
}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_OUTLIER_TOKENS_REF_H_
