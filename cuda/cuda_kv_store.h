// The compressed KV cache's bytes on the GPU (CompressedKvStore): the pool slices and the basis
// tables are carved from the CUDA backend's one allocation; compression, expansion, re-coding and
// outlier moves launch compress_blocks / expand_blocks / recode_blocks / outlier_tokens on the
// backend's stream, once per layer, with the batch's arrays staged through a pinned buffer (no
// allocation per call). Readbacks for the refresher are strided copies (one per page, every layer)
// into a second pinned buffer, polled by event.
#ifndef SUBSPACE_CUDA_CUDA_KV_STORE_H_
#define SUBSPACE_CUDA_CUDA_KV_STORE_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "cuda/batch_stager.h"
#include "cuda/compressed_kv_store.h"
#include "cuda/device_memory.h"
#include "kernels/kv_layout.h"

namespace subspace::cuda {

class CudaKvStore final : public CompressedKvStore {
 public:
  // Per-block arrays one staged batch has at most.
  static constexpr int kMaxColumns = BatchStager::kMaxColumns;

  // Device buffers, carved by the backend (CarveDevice with a counting Carver sizes them).
  struct Device {
    uint8_t* pool = nullptr;             // [n_layers, num_pages, page_bytes]
    std::vector<float*> pk, pq, pv, rv;  // [n_layers] each [capacity, n_kv, d, r] / [.., r_v, d]
    uint8_t* staging = nullptr;          // BatchStager::DeviceBytes
    uint64_t* outlier_masks = nullptr;   // [BatchStager::kStagedBlocks] one chunk's outliers
  };
  static void CarveDevice(Carver& c, const std::vector<kernels::KvPoolLayout>& layouts,
                          int64_t num_pages, int capacity, Device* out);

  // readback_pages: full pages a refresher readback holds (0: none; no pinned buffer then).
  // INTERNAL / RESOURCE_EXHAUSTED for a CUDA failure (pinned buffer, event).
  static absl::StatusOr<std::unique_ptr<CudaKvStore>> Create(
      std::vector<kernels::KvPoolLayout> layouts, int64_t num_pages, int capacity,
      int64_t readback_pages, const Device& device, cudaStream_t stream);
  ~CudaKvStore() override;

  int basis_capacity() const override { return capacity_; }
  absl::Status LoadBasis(int entry, const Basis& basis) override;
  absl::Status Compress(const CompressBatch& batch) override;
  absl::Status Expand(const ExpandBatch& batch) override;
  absl::Status Recode(const RecodeBatch& batch) override;
  // With outlier masks: waits for them, one chunk of the batch at a time.
  absl::Status MoveOutliers(const OutlierBatch& batch) override;
  absl::Status ReadPage(int layer, int32_t page, std::span<uint16_t> out) override;
  absl::Status Read(int layer, int64_t offset, std::span<uint8_t> out) override;
  absl::Status Write(int layer, int64_t offset, std::span<const uint8_t> bytes) override;
  int64_t readback_capacity() const override { return readback_capacity_; }
  absl::Status StartReadback(std::span<const int32_t> pages) override;
  absl::StatusOr<bool> TakeReadback(std::vector<uint16_t>* out) override;

  uint8_t* LayerPool(int layer) const {
    return device_.pool + static_cast<int64_t>(layer) * num_pages_ *
                              layouts_[static_cast<size_t>(layer)].page_bytes;
  }
  const float* basis_pq(int layer) const { return device_.pq[static_cast<size_t>(layer)]; }
  const float* basis_rv(int layer) const { return device_.rv[static_cast<size_t>(layer)]; }

 private:
  CudaKvStore(std::vector<kernels::KvPoolLayout> layouts, int64_t num_pages, int capacity,
              int64_t readback_pages, const Device& device, cudaStream_t stream);
  using Column = BatchStager::Column;
  // Stages the batch's columns (blocks of n) in chunks (BatchStager) and calls `launch` for
  // every layer of each chunk with the staged device arrays, the chunk's first block and size.
  absl::Status StageAndLaunch(
      int64_t n, std::initializer_list<Column> columns, const char* what,
      absl::FunctionRef<cudaError_t(size_t layer, const void* const staged[kMaxColumns],
                                    int64_t first, int32_t n)>
          launch);

  std::vector<kernels::KvPoolLayout> layouts_;
  int64_t num_pages_;
  int capacity_;
  Device device_;
  cudaStream_t stream_;
  std::unique_ptr<BatchStager> stager_;
  std::unique_ptr<PinnedHostBuffer> masks_host_;  // [kStagedBlocks] detected outliers, read back
  int64_t readback_capacity_;
  std::unique_ptr<PinnedHostBuffer> readback_host_;  // [n_layers][readback_capacity_][page]
  cudaEvent_t read_back_ = nullptr;                  // the readback in flight has landed
  int64_t readback_pages_ = -1;                      // pages in flight; -1: none
  // cudaMemcpy2D refuses pitches past the device's maximum (2^31 - 1 bytes on current GPUs): a
  // layer slice larger than that is read back one copy per layer and page instead.
  int64_t max_pitch_ = 0;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_CUDA_KV_STORE_H_
