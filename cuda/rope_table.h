// The RoPE cos/sin table the rotation kernel (kernels/rope.h) reads, built once per model on
// the host from the same RopeSchedule (core/base/rope.h) the CPU backend rotates by.
#ifndef SUBSPACE_CUDA_ROPE_TABLE_H_
#define SUBSPACE_CUDA_ROPE_TABLE_H_

#include <cstdint>
#include <vector>

#include "core/base/rope.h"

namespace subspace::cuda {

// The cos/sin table for positions [0, max_position): [max_position, rope.dim / 2, 2]. Empty
// when max_position or rope.dim is not positive.
std::vector<float> RopeCosSinTable(int32_t max_position, const RopeSchedule& rope);
// The same for the plain schedule (theta^(-2p/rope_dim), no scaling); empty when rope_dim is
// not a positive even number.
std::vector<float> RopeCosSinTable(int32_t max_position, int32_t rope_dim, float theta);

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_ROPE_TABLE_H_
