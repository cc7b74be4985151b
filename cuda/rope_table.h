// The RoPE cos/sin table the rotation kernel (kernels/rope.h) reads, built once per model on
// the host with the CPU backend's exact angles.
#ifndef SUBSPACE_CUDA_ROPE_TABLE_H_
#define SUBSPACE_CUDA_ROPE_TABLE_H_

#include <cstdint>
#include <vector>

namespace subspace::cuda {

// The cos/sin table for positions [0, max_position): [max_position, rope_dim / 2, 2]. Empty
// when max_position or rope_dim is not positive.
std::vector<float> RopeCosSinTable(int32_t max_position, int32_t rope_dim, float theta);

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_ROPE_TABLE_H_
