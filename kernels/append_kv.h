// Writes a step's new keys and values into the pool's full fp16 pages through a slot mapping
// (vLLM's reshape_and_cache): token i goes to token slot slot_mapping[i] = page * B + t, in the
// [2][n_kv][B][head_dim] page layout of kv_layout.h. One launch per layer covers every sequence
// of the step. The Params struct is plain C++ so the CPU twin (tests/kernels/layer_ops_ref.h)
// takes it too.
#ifndef SUBSPACE_KERNELS_APPEND_KV_H_
#define SUBSPACE_KERNELS_APPEND_KV_H_

#include <cstdint>

#include "kernels/kv_layout.h"

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

struct AppendKvParams {
  KvPoolLayout layout;                    // only n_kv_heads, head_dim, block_size, page_bytes used
  uint8_t* pool = nullptr;                // [num_pages, page_bytes]
  const float* k = nullptr;               // [n, n_kv_heads, head_dim] post-RoPE
  const float* v = nullptr;               // [n, n_kv_heads, head_dim]
  const int64_t* slot_mapping = nullptr;  // [n] page * block_size + t; -1: skip the token
  int32_t n = 0;
};

#if defined(SUBSPACE_WITH_CUDA)
// Grid (n) of 128 threads. cudaErrorInvalidValue for non-positive sizes; else the launch's own
// error. Asynchronous.
cudaError_t LaunchAppendKv(const AppendKvParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_APPEND_KV_H_
