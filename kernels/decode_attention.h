// Decode attention on the device: one query token per sequence, GQA, over a sequence's mixed
// blocks of one layer (full-rank fp16 sinks, window and outlier pages; fp16 or int8 coefficient
// blocks of several basis epochs), in one streaming softmax. The query is projected once per
// live epoch (q~_e = P_q[e]^T q); values accumulate per epoch in coefficient space and are
// expanded once with R_v[e]^T (docs/design.md, "Exactness across basis changes"). Split-K as in
// flash-decoding: CTAs write partial (max, sum, acc, u) per work item; a merge kernel combines
// them. The Params struct is plain C++ so the CPU twin (tests/kernels/decode_attention_ref.h) takes
// it too.
#ifndef SUBSPACE_KERNELS_DECODE_ATTENTION_H_
#define SUBSPACE_KERNELS_DECODE_ATTENTION_H_

#include <cstdint>

#include "kernels/decode_plan.h"
#include "kernels/kv_layout.h"
#include "kernels/transform_blocks.h"

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

struct DecodeAttentionParams {
  KvPoolLayout layout;
  DecodePlanView plan;              // a copy of cuda::DecodePlan::buffer (device for the kernels)
  const uint8_t* pool = nullptr;    // [num_pages, page_bytes]
  const float* basis_pq = nullptr;  // [n_epochs, n_kv, head_dim, r_k]  q~ = P_q^T q
  const float* basis_rv = nullptr;  // [n_epochs, n_kv, r_v, head_dim]  o += R_v^T u
  const float* q = nullptr;         // [num_seqs, n_heads, head_dim] post-RoPE
  float* out = nullptr;             // [num_seqs, n_heads, head_dim]
  float* workspace = nullptr;       // [DecodeWorkspaceFloats] split-K partials (twin: unused)
  int32_t n_heads = 0;              // query heads; head hq reads KV head hq / (n_heads / n_kv)
  float sm_scale = 0.0f;            // 1 / sqrt(head_dim), as the full model
  // The transform-coded cache (transform_blocks.h): with transform.floats set, every block that
  // is not full is a coded block of this layer's codec (layout.slot_bytes its slot), read in code
  // space: keys as q~ . c + q . e with q~_a = (q / scale) . u_a (once per CTA), values as the
  // weighted sums of their coefficients, expanded once by the merge. Keys coded before RoPE
  // (key_rope set) are decoded into fp16 rows as TransformExpand decodes them (rotated to their
  // positions) and scored as full rows. The bases and the plan's epochs are unused.
  TransformTables transform;
  TransformKeyRope key_rope;
};

// One partial row per work item and query head: [max, sum, coded, pad, acc[head_dim], u[...]].
// The compressed cache's u is [max_seq_epochs, r_v] (each epoch's value coefficients); the
// transform cache's is [head_dim] (the weighted sums of the value components' coefficients), and
// `coded` the weight of its coded tokens (what the components without bits and the mean add).
SUBSPACE_HOST_DEVICE inline int64_t DecodePartialStride(const DecodePlanView& plan,
                                                        const KvPoolLayout& kv, bool transform) {
  return 4 + kv.head_dim +
         (transform ? kv.head_dim : static_cast<int64_t>(plan.max_seq_epochs) * kv.rank_v);
}
// Floats of workspace a launch needs: [num_work, n_heads, DecodePartialStride]. Allocate once
// for the largest plan (no allocation on the request path).
inline int64_t DecodeWorkspaceFloats(const DecodePlanView& plan, const KvPoolLayout& kv,
                                     int n_heads, bool transform) {
  return static_cast<int64_t>(plan.num_work) * n_heads * DecodePartialStride(plan, kv, transform);
}

#if defined(SUBSPACE_WITH_CUDA)
// Two kernels on `stream`: the split kernel, grid (num_work, n_kv) of 128 threads (one CTA per
// work item and KV head, all group query heads together), then the merge kernel, grid
// (num_seqs, n_heads) of 128 threads. Supports head_dim 64 and 128, block sizes 1..64, fp16
// and int8 codes. cudaErrorInvalidValue for anything else or when the shared memory a CTA
// needs exceeds the device's opt-in limit; otherwise the launches' own error. Asynchronous.
cudaError_t LaunchDecodeAttention(const DecodeAttentionParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_DECODE_ATTENTION_H_
