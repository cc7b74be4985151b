// Token embedding lookup on the device: rows of the fp16 embedding table gathered into the fp32
// residual stream. The Params struct is plain C++ so the CPU twin (tests/kernels/
// layer_ops_ref.h) takes it too.
#ifndef SUBSPACE_KERNELS_EMBEDDING_H_
#define SUBSPACE_KERNELS_EMBEDDING_H_

#include <cstdint>

#if defined(SUBSPACE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace subspace::kernels {

struct EmbeddingParams {
  const uint16_t* table = nullptr;  // [n_vocab, dim] fp16 bits
  const int32_t* tokens = nullptr;  // [n] ids; the host validated them, an id outside
                                    //   [0, n_vocab) still gives a zero row, never a wild read
  float* out = nullptr;             // [n, dim]
  int32_t n = 0;
  int32_t dim = 0;
  int32_t n_vocab = 0;
};

#if defined(SUBSPACE_WITH_CUDA)
// Grid (n) of 256 threads. cudaErrorInvalidValue for non-positive sizes; else the launch's own
// error. Asynchronous.
cudaError_t LaunchEmbedding(const EmbeddingParams& params, cudaStream_t stream);
#endif

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_EMBEDDING_H_
