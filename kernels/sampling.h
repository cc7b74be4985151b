// Token sampling on the device, one CTA per logits row: greedy argmax, or top-k, softmax at a
// temperature, min-p and top-p truncation and one draw with a host-supplied uniform number, the
// policy (and order) of core/model/sampler.h. Only the chosen token and its log-probability come
// back to the host instead of a [rows, vocab] logits copy. Repetition penalties stay on the host
// sampler. The Params struct is plain C++ so the CPU twin (tests/kernels/sampling_ref.h) takes
// it too.
#ifndef SUBSPACE_KERNELS_SAMPLING_H_
#define SUBSPACE_KERNELS_SAMPLING_H_

#include <cstdint>

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

// Per row: temperature 0 → argmax (ties → lowest id). Otherwise candidates are the top_k best
// (0 = all; order: logit descending, then id), weights w = exp((logit - max) / temperature),
// min-p drops w < min_p (the best has w = 1), top-p keeps the shortest prefix of the sorted
// candidates whose weight reaches top_p of the total, and the draw picks the first candidate in
// that order whose cumulative weight exceeds uniform * total — in id order when neither top-k
// nor top-p applies, as the host sampler (which never sorts then) walks them. NaN logits count
// as -inf, +inf as the largest float; no finite logit → token 0. Weights are float, sums double.
// logprob: the chosen token's log-softmax under the raw logits (temperature 1, untruncated).
struct SampleTokensParams {
  const float* logits = nullptr;       // [n_rows, vocab]
  const float* temperature = nullptr;  // [n_rows] >= 0
  const int32_t* top_k = nullptr;      // [n_rows] >= 0; 0 = off
  const float* top_p = nullptr;        // [n_rows] (0, 1]; 1 = off
  const float* min_p = nullptr;        // [n_rows] [0, 1); 0 = off
  const float* uniform = nullptr;      // [n_rows] in [0, 1), drawn by the host's RNG
  int32_t* token = nullptr;            // [n_rows] out
  float* logprob = nullptr;            // [n_rows] out
  int32_t n_rows = 0;
  int32_t vocab = 0;
};

#if defined(SUBSPACE_WITH_CUDA)
// Grid (n_rows) of 1024 threads. cudaErrorInvalidValue for non-positive sizes, a vocab above
// INT32_MAX - 1024, or null pointers; else the launch's own error. Asynchronous.
cudaError_t LaunchSampleTokens(const SampleTokensParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_SAMPLING_H_
