// CPU twin of decode_attention.cu: the same DecodeAttentionParams with host pointers (the plan
// through DecodePlan::HostView), plain loops in double. It reads the same pool bytes and plan
// the kernels read, but walks each sequence's blocks in one pass with no split-K, so the
// kernels' partition and merge are checked against it, not copied into it. Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_DECODE_ATTENTION_REF_H_
#define SUBSPACE_TESTS_KERNELS_DECODE_ATTENTION_REF_H_

#include "kernels/decode_attention.h"

namespace subspace::kernels {

// Writes p.out; ignores p.workspace. p: host pointers, a plan BuildDecodePlan accepted.
void DecodeAttentionRef(const DecodeAttentionParams& p);

}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_DECODE_ATTENTION_REF_H_
