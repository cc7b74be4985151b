// The transform-coded cache's bytes on the GPU (TransformKvStore): the pool slices and the
// codec's tables (cuda/transform_tables.h) carved from the CUDA backend's one allocation; coding
// and decoding launch kernels/transform_blocks on the backend's stream, once per layer, the
// batch's arrays staged through a BatchStager. Also the step's decoding of coded history into
// scratch pages (ExpandInto), which reads the same tables.
#ifndef SUBSPACE_CUDA_CUDA_TRANSFORM_STORE_H_
#define SUBSPACE_CUDA_CUDA_TRANSFORM_STORE_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "cuda/batch_stager.h"
#include "cuda/device_memory.h"
#include "cuda/transform_kv_store.h"
#include "cuda/transform_tables.h"
#include "kernels/transform_blocks.h"

namespace subspace::cuda {

class CudaTransformStore final : public TransformKvStore {
 public:
  struct Device {
    uint8_t* pool = nullptr;     // [n_layers, num_pages, page_bytes]
    std::vector<float*> floats;  // [n_layers] each [2 n_kv][TransformFloats(d)]
    std::vector<int32_t*> ints;  // [n_layers] each [2 n_kv][TransformInts(d)]
    uint8_t* staging = nullptr;  // BatchStager::DeviceBytes
  };
  static void CarveDevice(Carver& c, const std::vector<kernels::KvPoolLayout>& layouts,
                          int64_t num_pages, Device* out);

  // Uploads `tables` ([n_layers], built for `layouts`), synchronously. key_rope: the model's
  // RoPE table for keys coded before RoPE (cos_sin null: keys coded as written).
  static absl::StatusOr<std::unique_ptr<CudaTransformStore>> Create(
      std::vector<kernels::KvPoolLayout> layouts, int64_t num_pages,
      const std::vector<TransformLayerTables>& tables, const kernels::TransformKeyRope& key_rope,
      const Device& device, cudaStream_t stream);

  absl::Status Code(const TransformCodeBatch& batch) override;
  absl::Status Expand(const TransformExpandBatch& batch) override;
  absl::Status Read(int layer, int64_t offset, std::span<uint8_t> out) override;
  absl::Status Write(int layer, int64_t offset, std::span<const uint8_t> bytes) override;

  // The step's history: `n` coded blocks of layer `layer` (device arrays: slab page, slot,
  // scratch page, first position) decoded into pages of `scratch`. Asynchronous.
  cudaError_t ExpandInto(int layer, uint8_t* scratch, const int32_t* src_page,
                         const int32_t* src_slot, const int32_t* dst_page, const int32_t* first_pos,
                         int32_t n) const;

  // Layer `layer`'s tables and the keys' rotation, as the decode kernel reads them.
  kernels::TransformTables Tables(size_t layer) const {
    return {device_.floats[layer], device_.ints[layer]};
  }
  const kernels::TransformKeyRope& key_rope() const { return key_rope_; }
  uint8_t* LayerPool(int layer) const {
    return device_.pool + static_cast<int64_t>(layer) * num_pages_ *
                              layouts_[static_cast<size_t>(layer)].page_bytes;
  }

 private:
  CudaTransformStore(std::vector<kernels::KvPoolLayout> layouts, int64_t num_pages,
                     const kernels::TransformKeyRope& key_rope, const Device& device,
                     cudaStream_t stream)
      : layouts_(std::move(layouts)),
        num_pages_(num_pages),
        key_rope_(key_rope),
        device_(device),
        stream_(stream) {}
  std::vector<kernels::KvPoolLayout> layouts_;
  int64_t num_pages_;
  kernels::TransformKeyRope key_rope_;
  Device device_;
  cudaStream_t stream_;
  std::unique_ptr<BatchStager> stager_;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_CUDA_TRANSFORM_STORE_H_
