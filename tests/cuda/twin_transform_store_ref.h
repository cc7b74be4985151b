// A TransformKvStore in host memory that runs the transform kernels' CPU twins
// (transform_blocks_ref) and checks every batch the cache hands it first, so the device
// transform cache's bookkeeping is tested on any machine against the references the GPU kernels
// are held to.
#ifndef SUBSPACE_TESTS_CUDA_TWIN_TRANSFORM_STORE_REF_H_
#define SUBSPACE_TESTS_CUDA_TWIN_TRANSFORM_STORE_REF_H_

#include <cstdint>
#include <span>
#include <vector>

#include "cuda/transform_kv_store.h"
#include "cuda/transform_tables.h"
#include "kernels/transform_blocks.h"

namespace subspace::cuda {

class TwinTransformStore final : public TransformKvStore {
 public:
  // layouts and tables: [n_layers]; key_rope.cos_sin a host table (or null). Pages start
  // poisoned (0xff).
  TwinTransformStore(std::vector<kernels::KvPoolLayout> layouts, int64_t num_pages,
                     std::vector<TransformLayerTables> tables, kernels::TransformKeyRope key_rope);

  // INVALID_ARGUMENT for a batch CheckTransformCodeBatch / CheckTransformExpandBatch rejects.
  absl::Status Code(const TransformCodeBatch& batch) override;
  absl::Status Expand(const TransformExpandBatch& batch) override;
  // INVALID_ARGUMENT for a range outside the layer's slice.
  absl::Status Read(int layer, int64_t offset, std::span<uint8_t> out) override;
  absl::Status Write(int layer, int64_t offset, std::span<const uint8_t> bytes) override;

  uint8_t* pool(int layer) { return pools_[static_cast<size_t>(layer)].data(); }
  const std::vector<uint8_t>& pool_bytes(int layer) const {
    return pools_[static_cast<size_t>(layer)];
  }
  int64_t blocks_coded() const { return blocks_coded_; }
  int64_t blocks_expanded() const { return blocks_expanded_; }

 private:
  std::vector<kernels::KvPoolLayout> layouts_;
  int64_t num_pages_;
  std::vector<TransformLayerTables> tables_;
  kernels::TransformKeyRope key_rope_;
  std::vector<std::vector<uint8_t>> pools_;
  int64_t blocks_coded_ = 0;
  int64_t blocks_expanded_ = 0;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_TESTS_CUDA_TWIN_TRANSFORM_STORE_REF_H_
