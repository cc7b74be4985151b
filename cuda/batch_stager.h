// Per-block arrays of a host batch staged to the device for a kernel launch, without an
// allocation per call: copied into a pinned buffer, then in one asynchronous copy to a device
// staging area carved by the backend, on its stream; a batch larger than kStagedBlocks goes in
// chunks. An event tells when the pinned buffer may be rewritten. Used by the device caches'
// stores (cuda_kv_store.h, cuda_transform_store.h).
#ifndef SUBSPACE_CUDA_BATCH_STAGER_H_
#define SUBSPACE_CUDA_BATCH_STAGER_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <memory>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "cuda/device_memory.h"

namespace subspace::cuda {

class BatchStager {
 public:
  static constexpr int kMaxColumns = 4;           // per-block arrays of one batch at most
  static constexpr int64_t kStagedBlocks = 1024;  // blocks per staged chunk
  // One per-block array of a batch: `bytes_per_block` bytes of each block from `host`.
  struct Column {
    const void* host = nullptr;
    int64_t bytes_per_block = 0;
  };
  // Device bytes of the staging area for batches of at most `bytes_per_block` bytes a block
  // (all columns together).
  static int64_t DeviceBytes(int64_t bytes_per_block) {
    return kStagedBlocks * bytes_per_block + kMaxColumns * 8;  // + each column's alignment
  }
  // `device`: DeviceBytes(bytes_per_block) of device memory the caller keeps alive.
  static absl::StatusOr<std::unique_ptr<BatchStager>> Create(uint8_t* device,
                                                             int64_t bytes_per_block,
                                                             cudaStream_t stream);
  ~BatchStager();
  BatchStager(const BatchStager&) = delete;
  BatchStager& operator=(const BatchStager&) = delete;

  // Stages the columns of blocks [first, first + chunk) for each chunk and calls `launch` with
  // the staged device arrays (8-byte aligned, in column order), `first` and `chunk`. A column
  // past kMaxColumns or over bytes_per_block in all is INVALID_ARGUMENT.
  absl::Status Run(int64_t n, std::initializer_list<Column> columns,
                   absl::FunctionRef<absl::Status(const void* const staged[kMaxColumns],
                                                  int64_t first, int32_t chunk)>
                       launch);

 private:
  BatchStager(uint8_t* device, int64_t bytes_per_block, cudaStream_t stream)
      : device_(device), bytes_per_block_(bytes_per_block), stream_(stream) {}

  uint8_t* device_;
  int64_t bytes_per_block_;
  cudaStream_t stream_;
  std::unique_ptr<PinnedHostBuffer> host_;
  cudaEvent_t staged_ = nullptr;  // the last staging copy has been read from the host buffer
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_BATCH_STAGER_H_
