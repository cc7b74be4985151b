// BatchStager: per-block arrays through pinned memory to the device (batch_stager.h).
#include "cuda/batch_stager.h"

#include <algorithm>
#include <cstring>

#include "cuda/cuda_status.h"

namespace subspace::cuda {

absl::StatusOr<std::unique_ptr<BatchStager>> BatchStager::Create(uint8_t* device,
                                                                 int64_t bytes_per_block,
                                                                 cudaStream_t stream) {
  std::unique_ptr<BatchStager> s(new BatchStager(device, bytes_per_block, stream));
  absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> host =
      PinnedHostBuffer::Create(DeviceBytes(bytes_per_block), "batch staging");
  if (!host.ok()) return host.status();
  s->host_ = *std::move(host);
  if (absl::Status st = CudaStatus(cudaEventCreateWithFlags(&s->staged_, cudaEventDisableTiming),
                                   "cudaEventCreate");
      !st.ok()) {
    return st;
  }
  return s;
}

BatchStager::~BatchStager() {
  if (staged_ != nullptr) {
    cudaEventSynchronize(staged_);  // the copy in flight still reads host_
    cudaEventDestroy(staged_);
  }
}

absl::Status BatchStager::Run(int64_t n, std::initializer_list<Column> columns,
                              absl::FunctionRef<absl::Status(const void* const staged[kMaxColumns],
                                                             int64_t first, int32_t chunk)>
                                  launch) {
  int64_t per_block = 0;
  for (const Column& c : columns) per_block += c.bytes_per_block;
  if (columns.size() > static_cast<size_t>(kMaxColumns) || per_block > bytes_per_block_) {
    return absl::InvalidArgumentError("a batch wider than its staging area");
  }
  for (int64_t first = 0; first < n; first += kStagedBlocks) {
    const int64_t chunk = std::min(kStagedBlocks, n - first);
    // The previous staging copy must have left the pinned buffer before it is rewritten.
    if (absl::Status st = CudaStatus(cudaEventSynchronize(staged_), "staging"); !st.ok()) {
      return st;
    }
    const void* staged[kMaxColumns] = {};
    int64_t offset = 0;
    int i = 0;
    for (const Column& c : columns) {
      const int64_t bytes = chunk * c.bytes_per_block;
      std::memcpy(host_->data() + offset,
                  static_cast<const uint8_t*>(c.host) + first * c.bytes_per_block,
                  static_cast<size_t>(bytes));
      staged[i++] = device_ + offset;
      offset += AlignUp(bytes, 8);
    }
    absl::Status st =
        CudaStatus(cudaMemcpyAsync(device_, host_->data(), static_cast<size_t>(offset),
                                   cudaMemcpyHostToDevice, stream_),
                   "staging copy");
    if (st.ok()) st = CudaStatus(cudaEventRecord(staged_, stream_), "staging");
    if (st.ok()) st = launch(staged, first, static_cast<int32_t>(chunk));
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace subspace::cuda
