// CPU twin of sampling.cu: the same SampleTokensParams with host pointers, plain loops. Each row
// is fully sorted by (logit descending, id ascending) and then walked through
// core/model/sampler.cc's policy step by step with the host sampler's own arithmetic (float weights
// from std::exp, double running sums in the host's order), so for the same uniform it picks exactly
// the token core::Sampler picks (sampling_ref_test.cc holds it to that). Builds without nvcc.
#ifndef SUBSPACE_TESTS_KERNELS_SAMPLING_REF_H_
#define SUBSPACE_TESTS_KERNELS_SAMPLING_REF_H_

#include <cstdint>
#include <span>

#include "kernels/sampling.h"

namespace subspace::kernels {

struct SampleRowResult {
  int32_t token = 0;
  float logprob = 0.0f;
  double log_z = 0.0;  // log of the raw softmax normaliser; -inf when every logit is -inf
  // How near the pick came to going another way: the smallest relative distance of any float
  // comparison it made from that comparison's boundary. Min-p: |w - min_p| / min_p over the
  // candidates; top-p: the running sum from the target on either side of the cut, over the
  // total; the draw: r from the running sums around the chosen token, over the kept total.
  // +inf for greedy rows. An implementation whose weights differ from these by a relative e
  // (and whose sums are exact enough) can only pick differently when margin <= 2e or so.
  double margin = 0.0;
};

// One row. `uniform` is a double so a test can hand over core::Sampler's own draw unrounded.
SampleRowResult SampleRowRef(std::span<const float> logits, float temperature, int32_t top_k,
                             float top_p, float min_p, double uniform);

// Every row of p (host pointers) into p.token and p.logprob; `margin` [p.n_rows] if not null.
void SampleTokensRef(const SampleTokensParams& p, double* margin = nullptr);

}  // namespace subspace::kernels

#endif  // SUBSPACE_TESTS_KERNELS_SAMPLING_REF_H_
