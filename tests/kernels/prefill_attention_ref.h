// CPU twin of prefill_attention.cu: the same PrefillAttentionParams with host pointers, plain
// loops in double. Every query row walks its sequence's keys 0..position through the block
// table in one pass (no tiles, no online softmax), so the kernel's tiling, causal skipping and
// GQA sharing are checked against it, not copied into it. Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_PREFILL_ATTENTION_REF_H_
#define SUBSPACE_TESTS_KERNELS_PREFILL_ATTENTION_REF_H_

#include "kernels/prefill_attention.h"

namespace subspace::kernels {

// Writes p.out for every query row of every sequence. p: host pointers; every sequence's block
// table covers its tokens [0, seq_q_start + its query rows). max_q_per_seq is not read (it
// only sizes the kernel's grid).
void PrefillAttentionRef(const PrefillAttentionParams& p);

}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_PREFILL_ATTENTION_REF_H_
