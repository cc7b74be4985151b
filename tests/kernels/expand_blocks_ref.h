// CPU twin of expand_blocks.cu: the same ExpandBlocksParams with host pointers, plain loops.
// Codes are decoded as core's DecodeCoeffs decodes them, each output is summed in double and
// rounded once to float, then to fp16 (nearest even), so GPU results differ from the twin only
// by float summation order. Also the random batches both the twin's and the kernel's tests
// draw. Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_EXPAND_BLOCKS_REF_H_
#define SUBSPACE_TESTS_KERNELS_EXPAND_BLOCKS_REF_H_

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "kernels/expand_blocks.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {

// INVALID_ARGUMENT when the batch is unsafe or out of range (p holds host pointers): a bad
// layout, a source page outside [0, num_src_pages), a slot outside its page, a destination page
// outside [0, num_dst_pages), an epoch outside [0, num_basis_epochs), two blocks with one
// destination page, or, when src_pool == dst_pool, a destination page that is a source page of
// the batch.
absl::Status CheckExpandBatch(const ExpandBlocksParams& p, int64_t num_src_pages,
                              int64_t num_dst_pages, int num_basis_epochs);

// Runs the batch on host memory. p: host pointers, a batch CheckExpandBatch accepts.
void ExpandBlocksRef(const ExpandBlocksParams& p);

namespace testing {

// A random batch: coded slots scattered over shuffled slab pages (every other byte of the
// source pool poisoned), destinations on shuffled pages of a poisoned pool with two pages
// nobody names. With one_pool the destinations lie in the source pool (Truncate), else in a
// pool of their own (prefill scratch).
struct ExpandCase {
  KvPoolLayout layout;
  bool one_pool = false;
  int64_t num_src_pages = 0;
  int64_t num_dst_pages = 0;      // == num_src_pages with one_pool
  std::vector<uint8_t> src_pool;  // [num_src_pages * page_bytes]
  std::vector<uint8_t> dst_pool;  // [num_dst_pages * page_bytes]; empty with one_pool
  BasisTable bases;               // p_q and r_v are what expansion reads
  std::vector<int32_t> src_page, src_slot, dst_page;  // [n_blocks]
  std::vector<int32_t> epoch;                         // [n_blocks, n_kv]

  int32_t n_blocks() const { return static_cast<int32_t>(src_page.size()); }
  // The bytes destinations are written into: dst_pool, or src_pool with one_pool.
  std::vector<uint8_t>& dst_bytes() { return one_pool ? src_pool : dst_pool; }
  // Params over this case's host buffers.
  ExpandBlocksParams HostParams();
};

// Codes N(0, head_dim / r) so expanded rows are about unit-scale under RandomBases.
ExpandCase RandomExpandCase(const KvPoolLayout& l, int n_blocks, int n_epochs, bool one_pool,
                            std::mt19937_64& rng);

}  // namespace testing
}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_EXPAND_BLOCKS_REF_H_
