// Prefill attention on the device: causal scaled-dot-product attention of a step's prompt chunks
// (many queries per sequence, several sequences) over the full-rank fp16 pages of the paged
// pool, tiled (flash-attention style: a tile of queries streams the sequence's KV tiles through
// shared memory with one online softmax). GQA: query head h reads KV head h / (n_heads / n_kv).
// The chunk's own keys/values must already be in the pool (append_kv.h). The Params struct is
// plain C++ so the CPU twin (tests/kernels/prefill_attention_ref.h) takes it too.
#ifndef SUBSPACE_KERNELS_PREFILL_ATTENTION_H_
#define SUBSPACE_KERNELS_PREFILL_ATTENTION_H_

#include <cstdint>

#include "kernels/kv_layout.h"

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

// Query row i of sequence s (seq_q_indptr[s] <= i < seq_q_indptr[s + 1]) sits at position
// seq_q_start[s] + (i - seq_q_indptr[s]) and attends to the sequence's tokens [0, position].
// A block_table entry e >= 0 is page e of `pool`; e < 0 is page -1 - e of `scratch`, in the
// same page layout, so a backend can expand a sequence's compressed blocks into scratch pages
// and run this kernel over them without touching the pool. With scratch null no entry may be
// negative.
struct PrefillAttentionParams {
  KvPoolLayout layout;                    // full pages only: n_kv_heads, head_dim, B, page_bytes
  const uint8_t* pool = nullptr;          // [num_pages, page_bytes]
  const uint8_t* scratch = nullptr;       // [num_scratch_pages, page_bytes] expanded
                                          //   compressed blocks
  const int32_t* block_table = nullptr;   // [num_seqs, max_blocks] pages in position order;
                                          //   < 0: scratch page -1 - e
  const int32_t* seq_q_indptr = nullptr;  // [num_seqs + 1] first element 0, last n_q
  const int32_t* seq_q_start = nullptr;   // [num_seqs] position of the sequence's first query
  const float* q = nullptr;               // [n_q, n_heads, head_dim] post-RoPE
  float* out = nullptr;                   // [n_q, n_heads, head_dim]
  int32_t num_seqs = 0;
  int32_t max_blocks = 0;     // row stride of block_table
  int32_t max_q_per_seq = 0;  // most query rows of one sequence (sizes the grid)
  int32_t n_heads = 0;
  float sm_scale = 0.0f;  // 1 / sqrt(head_dim)
  // Sliding-window attention: > 0, the query at position p attends (p - window, p] only
  // (AttentionRequest::window, as the CPU caches mask it); 0, every position up to p.
  int32_t window = 0;
};

#if defined(SUBSPACE_WITH_CUDA)
// Supports head_dim 64 and 128 and block sizes 1..64; pool, scratch (when given), q and out
// 16-byte aligned (device allocations are). A CTA covers 64 (query, head) rows of one sequence
// and KV head, looping over row tiles, so max_q_per_seq only sizes the grid.
// cudaErrorInvalidValue for anything else (or when the device's opt-in shared memory is below
// the 83 KiB head_dim 128 needs); otherwise the launch's own error. Block table entries are not
// checked (a negative one with scratch null is the caller's bug, as is a page out of range).
// Asynchronous.
cudaError_t LaunchPrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_PREFILL_ATTENTION_H_
