// Rotary embedding on the device, fused with splitting the fused QKV projection: reads one
// [n, (n_heads + 2 n_kv) * head_dim] row block (Q, then K, then V columns, the layout of the
// fused weight [wq; wk; wv]) and writes Q and K rotated and V as is into contiguous arrays.
// Angles come from a host-built table (pos * theta^(-2i/rope_dim) and its cos/sin in double,
// the cos/sin rounded to fp32, as the CPU backend's Rope computes them), and the kernel rotates
// without FMA contraction, so device and CPU rotate bit-identically per element.
// The Params struct is plain C++ so the CPU twin (tests/kernels/layer_ops_ref.h) takes it too.
#ifndef SUBSPACE_KERNELS_ROPE_H_
#define SUBSPACE_KERNELS_ROPE_H_

#include <cstdint>
#include <vector>

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

// Pairs of the first rope_dim dims of every head -- adjacent (x[2p], x[2p+1]) for GGUF "llama"
// files, or halves (x[p], x[p + rope_dim/2]) -- are rotated by the angle of (position, p), as
// core/cpu/ops.h Rope does (after AddBias when there are biases).
struct RopeSplitQkvParams {
  const float* qkv = nullptr;          // [n, (n_heads + 2 * n_kv_heads) * head_dim]
  const int32_t* positions = nullptr;  // [n] each in [0, max_position); a position outside
                                       //   gives NaN q and k rows (loud), never a wild read
  const float* cos_sin = nullptr;      // [max_position, rope_dim / 2, 2] (cos, sin) per pair
  float* q = nullptr;                  // [n, n_heads, head_dim] rotated
  float* k = nullptr;                  // [n, n_kv_heads, head_dim] rotated
  float* v = nullptr;                  // [n, n_kv_heads, head_dim] copied
  int32_t n = 0;
  int32_t n_heads = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t rope_dim = 0;  // even, <= head_dim
  int32_t max_position = 0;
  // Qwen2-style models (both off by default): Q/K/V biases added to the row before anything
  // else, [(n_heads + 2 * n_kv_heads) * head_dim] or null; and the halves layout, pair p being
  // (x[p], x[p + rope_dim/2]) of each head instead of (x[2p], x[2p+1]) (core/base/rope.h).
  const float* bias = nullptr;
  bool halves = false;
  // Qwen3 (off by default): every Q head, then every K head, RMS-normalised over head_dim and
  // scaled by q_norm / k_norm [head_dim], after the bias and before the rotation, as
  // core/model/model.cc does with cpu::RmsNorm (the sum of squares in double here).
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float norm_eps = 0.0f;
};

// cos_sin is built on the host by cuda::RopeCosSinTable (cuda/rope_table.h).

#if defined(SUBSPACE_WITH_CUDA)
// Grid (n) of 128 threads. cudaErrorInvalidValue for non-positive sizes (n = 0 included: skip
// empty launches) or an odd rope_dim or
// one above head_dim; else the launch's own error. Asynchronous.
cudaError_t LaunchRopeSplitQkv(const RopeSplitQkvParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_ROPE_H_
