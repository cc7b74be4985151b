// CudaKvStore: batches staged through pinned memory, one launch per layer and chunk.
#include "cuda/cuda_kv_store.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "cuda/cuda_status.h"
#include "kernels/compress_blocks.h"
#include "kernels/expand_blocks.h"
#include "kernels/outlier_tokens.h"
#include "kernels/recode_blocks.h"

namespace subspace::cuda {
namespace {

constexpr int64_t kStagedBlocks = BatchStager::kStagedBlocks;

// The widest block of any batch: compress and expand stage three int32 columns and the epochs
// [n_kv] int32; an outlier move stages page, slot and two pages (int32) and a mask (uint64).
int64_t StagedBytesPerBlock(int n_kv) { return std::max<int64_t>(4 * (3 + n_kv), 4 + 8 + 4 + 8); }

}  // namespace

void CudaKvStore::CarveDevice(Carver& c, const std::vector<kernels::KvPoolLayout>& layouts,
                              int64_t num_pages, int capacity, Device* out) {
  out->pool = c.Take(static_cast<int64_t>(layouts.size()) * num_pages * layouts[0].page_bytes);
  out->pk.clear();
  out->pq.clear();
  out->pv.clear();
  out->rv.clear();
  for (const kernels::KvPoolLayout& l : layouts) {
    const int64_t k = int64_t{capacity} * l.n_kv_heads * l.head_dim * l.rank_k;
    const int64_t v = int64_t{capacity} * l.n_kv_heads * l.head_dim * l.rank_v;
    out->pk.push_back(c.TakeArray<float>(k));
    out->pq.push_back(c.TakeArray<float>(k));
    out->pv.push_back(c.TakeArray<float>(v));
    out->rv.push_back(c.TakeArray<float>(v));
  }
  out->staging = c.Take(BatchStager::DeviceBytes(StagedBytesPerBlock(layouts[0].n_kv_heads)));
  out->outlier_masks = c.TakeArray<uint64_t>(kStagedBlocks);
}

absl::StatusOr<std::unique_ptr<CudaKvStore>> CudaKvStore::Create(
    std::vector<kernels::KvPoolLayout> layouts, int64_t num_pages, int capacity,
    int64_t readback_pages, const Device& device, cudaStream_t stream) {
  std::unique_ptr<CudaKvStore> store(
      new CudaKvStore(std::move(layouts), num_pages, capacity, readback_pages, device, stream));
  absl::StatusOr<std::unique_ptr<BatchStager>> stager = BatchStager::Create(
      device.staging, StagedBytesPerBlock(store->layouts_[0].n_kv_heads), stream);
  if (!stager.ok()) return stager.status();
  store->stager_ = *std::move(stager);
  absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> masks =
      PinnedHostBuffer::Create(kStagedBlocks * 8, "outlier masks");
  if (!masks.ok()) return masks.status();
  store->masks_host_ = *std::move(masks);
  if (readback_pages > 0) {
    int device = 0, max_pitch = 0;
    if (absl::Status st = CudaStatus(cudaGetDevice(&device), "cudaGetDevice"); !st.ok()) return st;
    if (absl::Status st = CudaStatus(
            cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, device), "max pitch");
        !st.ok()) {
      return st;
    }
    store->max_pitch_ = max_pitch;
    const int64_t bytes = static_cast<int64_t>(store->layouts_.size()) * readback_pages *
                          store->layouts_[0].page_bytes;
    absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> rb =
        PinnedHostBuffer::Create(bytes, "refresher readback");
    if (!rb.ok()) return rb.status();
    store->readback_host_ = *std::move(rb);
    if (absl::Status st =
            CudaStatus(cudaEventCreateWithFlags(&store->read_back_, cudaEventDisableTiming),
                       "cudaEventCreate");
        !st.ok()) {
      return st;
    }
  }
  return store;
}

CudaKvStore::CudaKvStore(std::vector<kernels::KvPoolLayout> layouts, int64_t num_pages,
                         int capacity, int64_t readback_pages, const Device& device,
                         cudaStream_t stream)
    : layouts_(std::move(layouts)),
      num_pages_(num_pages),
      capacity_(capacity),
      device_(device),
      stream_(stream),
      readback_capacity_(readback_pages) {}

CudaKvStore::~CudaKvStore() {
  // A readback still in flight writes into readback_host_: let it land before that goes.
  if (read_back_ != nullptr) {
    cudaEventSynchronize(read_back_);
    cudaEventDestroy(read_back_);
  }
}

absl::Status CudaKvStore::LoadBasis(int entry, const Basis& basis) {
  if (entry < 0 || entry >= capacity_ || basis.layers.size() != layouts_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("basis entry %d outside [0, %d)", entry, capacity_));
  }
  for (size_t l = 0; l < layouts_.size(); ++l) {
    const LayerBasis& lb = basis.layers[l];
    const kernels::KvPoolLayout& kv = layouts_[l];
    const size_t k = static_cast<size_t>(kv.n_kv_heads) * kv.head_dim * kv.rank_k;
    const size_t v = static_cast<size_t>(kv.n_kv_heads) * kv.head_dim * kv.rank_v;
    if (lb.p_k.size() != k || lb.p_q.size() != k || lb.p_v.size() != v || lb.r_v.size() != v) {
      return absl::InvalidArgumentError(absl::StrFormat("basis layer %d does not match", l));
    }
    const std::pair<float*, const std::vector<float>*> copies[] = {
        {device_.pk[l] + entry * k, &lb.p_k},
        {device_.pq[l] + entry * k, &lb.p_q},
        {device_.pv[l] + entry * v, &lb.p_v},
        {device_.rv[l] + entry * v, &lb.r_v}};
    for (const auto& [dst, src] : copies) {
      if (absl::Status st = CudaStatus(
              cudaMemcpyAsync(dst, src->data(), src->size() * 4, cudaMemcpyHostToDevice, stream_),
              "basis upload");
          !st.ok()) {
        return st;
      }
    }
  }
  // From pageable memory: wait, so the caller's basis may go as soon as this returns.
  return CudaStatus(cudaStreamSynchronize(stream_), "basis upload");
}

absl::Status CudaKvStore::StageAndLaunch(
    int64_t n, std::initializer_list<Column> columns, const char* what,
    absl::FunctionRef<cudaError_t(size_t layer, const void* const staged[kMaxColumns],
                                  int64_t first, int32_t n)>
        launch) {
  return stager_->Run(
      n, columns, [&](const void* const staged[kMaxColumns], int64_t first, int32_t chunk) {
        for (size_t l = 0; l < layouts_.size(); ++l) {
          if (absl::Status st = CudaStatus(launch(l, staged, first, chunk), what); !st.ok()) {
            return st;
          }
        }
        return absl::OkStatus();
      });
}

absl::Status CudaKvStore::Compress(const CompressBatch& batch) {
  const int n_kv = layouts_[0].n_kv_heads;
  const bool detect = !batch.outlier_masks.empty();
  if (detect && batch.outlier_masks.size() != batch.src_page.size()) {
    return absl::InvalidArgumentError("one outlier mask per block");
  }
  return StageAndLaunch(
      static_cast<int64_t>(batch.src_page.size()),
      {{batch.src_page.data(), 4},
       {batch.dst_page.data(), 4},
       {batch.dst_slot.data(), 4},
       {batch.epoch.data(), 4 * n_kv}},
      "compress blocks", [&](size_t l, const void* const d[kMaxColumns], int64_t first, int32_t n) {
        const size_t mask_bytes = static_cast<size_t>(n) * 8;
        // The layers' launches OR into one mask per block: zeroed before the first.
        if (detect && l == 0) {
          if (cudaError_t e = cudaMemsetAsync(device_.outlier_masks, 0, mask_bytes, stream_);
              e != cudaSuccess) {
            return e;
          }
        }
        kernels::CompressBlocksParams p;
        p.layout = layouts_[l];
        p.pool = LayerPool(static_cast<int>(l));
        p.basis_pk = device_.pk[l];
        p.basis_pv = device_.pv[l];
        p.src_page = static_cast<const int32_t*>(d[0]);
        p.dst_page = static_cast<const int32_t*>(d[1]);
        p.dst_slot = static_cast<const int32_t*>(d[2]);
        p.epoch = static_cast<const int32_t*>(d[3]);
        p.n_blocks = n;
        if (detect) {
          p.basis_pq = device_.pq[l];
          p.outlier_masks = device_.outlier_masks;
          p.outlier_threshold = batch.outlier_threshold;
        }
        cudaError_t e = kernels::LaunchCompressBlocks(p, stream_);
        if (e != cudaSuccess || !detect || l + 1 < layouts_.size()) return e;
        // After the last layer: the chunk's masks, waited for (the caller places the outliers
        // before it frees the source pages).
        e = cudaMemcpyAsync(masks_host_->data(), device_.outlier_masks, mask_bytes,
                            cudaMemcpyDeviceToHost, stream_);
        if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
        if (e == cudaSuccess) {
          std::memcpy(batch.outlier_masks.data() + first, masks_host_->data(), mask_bytes);
        }
        return e;
      });
}

absl::Status CudaKvStore::Expand(const ExpandBatch& batch) {
  const int n_kv = layouts_[0].n_kv_heads;
  return StageAndLaunch(static_cast<int64_t>(batch.src_page.size()),
                        {{batch.src_page.data(), 4},
                         {batch.src_slot.data(), 4},
                         {batch.dst_page.data(), 4},
                         {batch.epoch.data(), 4 * n_kv}},
                        "expand blocks",
                        [&](size_t l, const void* const d[kMaxColumns], int64_t, int32_t n) {
                          kernels::ExpandBlocksParams p;
                          p.layout = layouts_[l];
                          p.src_pool = LayerPool(static_cast<int>(l));
                          p.dst_pool = LayerPool(static_cast<int>(l));
                          p.basis_pq = device_.pq[l];
                          p.basis_rv = device_.rv[l];
                          p.src_page = static_cast<const int32_t*>(d[0]);
                          p.src_slot = static_cast<const int32_t*>(d[1]);
                          p.dst_page = static_cast<const int32_t*>(d[2]);
                          p.epoch = static_cast<const int32_t*>(d[3]);
                          p.n_blocks = n;
                          return kernels::LaunchExpandBlocks(p, stream_);
                        });
}

absl::Status CudaKvStore::Recode(const RecodeBatch& batch) {
  const int n_kv = layouts_[0].n_kv_heads;
  const size_t n = batch.page.size();
  if (batch.slot.size() != n || batch.from.size() != n * n_kv || batch.to.size() != n * n_kv) {
    return absl::InvalidArgumentError("recode batch arrays of different lengths");
  }
  return StageAndLaunch(static_cast<int64_t>(n),
                        {{batch.page.data(), 4},
                         {batch.slot.data(), 4},
                         {batch.from.data(), 4 * n_kv},
                         {batch.to.data(), 4 * n_kv}},
                        "recode blocks",
                        [&](size_t l, const void* const d[kMaxColumns], int64_t, int32_t count) {
                          kernels::RecodeBlocksParams p;
                          p.layout = layouts_[l];
                          p.pool = LayerPool(static_cast<int>(l));
                          p.basis_pq = device_.pq[l];
                          p.basis_rv = device_.rv[l];
                          p.basis_pk = device_.pk[l];
                          p.basis_pv = device_.pv[l];
                          p.page = static_cast<const int32_t*>(d[0]);
                          p.slot = static_cast<const int32_t*>(d[1]);
                          p.from_epoch = static_cast<const int32_t*>(d[2]);
                          p.to_epoch = static_cast<const int32_t*>(d[3]);
                          p.n_blocks = count;
                          return kernels::LaunchRecodeBlocks(p, stream_);
                        });
}

absl::Status CudaKvStore::MoveOutliers(const OutlierBatch& batch) {
  const size_t n = batch.block_page.size();
  if (batch.mask.size() != n || batch.first_slot.size() != n ||
      batch.outlier_page.size() != 2 * n) {
    return absl::InvalidArgumentError("outlier batch arrays of different lengths");
  }
  return StageAndLaunch(static_cast<int64_t>(n),
                        {{batch.mask.data(), 8},
                         {batch.block_page.data(), 4},
                         {batch.first_slot.data(), 4},
                         {batch.outlier_page.data(), 8}},
                        "outlier tokens",
                        [&](size_t l, const void* const d[kMaxColumns], int64_t, int32_t chunk) {
                          kernels::OutlierTokensParams p;
                          p.layout = layouts_[l];
                          p.block_pool = LayerPool(static_cast<int>(l));
                          p.outlier_pool = LayerPool(static_cast<int>(l));
                          p.mask = static_cast<const uint64_t*>(d[0]);
                          p.block_page = static_cast<const int32_t*>(d[1]);
                          p.first_slot = static_cast<const int32_t*>(d[2]);
                          p.outlier_page = static_cast<const int32_t*>(d[3]);
                          p.n_blocks = chunk;
                          p.direction = batch.direction;
                          return kernels::LaunchOutlierTokens(p, stream_);
                        });
}

absl::Status CudaKvStore::ReadPage(int layer, int32_t page, std::span<uint16_t> out) {
  const kernels::KvPoolLayout& l = layouts_[static_cast<size_t>(layer)];
  if (page < 0 || page >= num_pages_ || static_cast<int64_t>(out.size()) * 2 != l.page_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat("page %d outside the pool", page));
  }
  absl::Status st = CudaStatus(
      cudaMemcpyAsync(out.data(), LayerPool(layer) + l.Page(page),
                      static_cast<size_t>(l.page_bytes), cudaMemcpyDeviceToHost, stream_),
      "page read");
  const absl::Status sync = CudaStatus(cudaStreamSynchronize(stream_), "page read");
  return st.ok() ? sync : st;
}

absl::Status CudaKvStore::Read(int layer, int64_t offset, std::span<uint8_t> out) {
  const int64_t slice = num_pages_ * layouts_[static_cast<size_t>(layer)].page_bytes;
  if (offset < 0 || offset + static_cast<int64_t>(out.size()) > slice) {
    return absl::InvalidArgumentError("KV image: read outside the layer's pool");
  }
  return CopyAfterStream(stream_, out.data(), LayerPool(layer) + offset, out.size(),
                         cudaMemcpyDeviceToHost);
}

absl::Status CudaKvStore::Write(int layer, int64_t offset, std::span<const uint8_t> bytes) {
  const int64_t slice = num_pages_ * layouts_[static_cast<size_t>(layer)].page_bytes;
  if (offset < 0 || offset + static_cast<int64_t>(bytes.size()) > slice) {
    return absl::InvalidArgumentError("KV image: write outside the layer's pool");
  }
  return CopyAfterStream(stream_, LayerPool(layer) + offset, bytes.data(), bytes.size(),
                         cudaMemcpyHostToDevice);
}

// One strided copy per page: the page in every layer's slice (num_pages * page_bytes apart)
// lands [n_layers][n][page] in the pinned buffer, on the copy engine, in stream order.
absl::Status CudaKvStore::StartReadback(std::span<const int32_t> pages) {
  if (readback_pages_ >= 0) return absl::FailedPreconditionError("a readback is in flight");
  const int64_t n = static_cast<int64_t>(pages.size());
  if (n > readback_capacity_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("readback of %d pages, capacity %d", n, readback_capacity_));
  }
  const size_t page_bytes = static_cast<size_t>(layouts_[0].page_bytes);
  const size_t layer_bytes = static_cast<size_t>(num_pages_) * page_bytes;  // one layer's slice
  const bool strided = static_cast<int64_t>(layer_bytes) <= max_pitch_;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t page = pages[static_cast<size_t>(i)];
    if (page < 0 || page >= num_pages_) {
      return absl::InvalidArgumentError(absl::StrFormat("page %d outside the pool", page));
    }
    uint8_t* dst = readback_host_->data() + i * page_bytes;  // layer l at + l * n * page_bytes
    const uint8_t* src = device_.pool + page * page_bytes;   // layer l at + l * layer_bytes
    cudaError_t e = cudaSuccess;
    if (strided) {
      e = cudaMemcpy2DAsync(dst, n * page_bytes, src, layer_bytes, page_bytes, layouts_.size(),
                            cudaMemcpyDeviceToHost, stream_);
    } else {
      for (size_t l = 0; l < layouts_.size() && e == cudaSuccess; ++l) {
        e = cudaMemcpyAsync(dst + l * n * page_bytes, src + l * layer_bytes, page_bytes,
                            cudaMemcpyDeviceToHost, stream_);
      }
    }
    if (absl::Status st = CudaStatus(e, "refresher readback"); !st.ok()) return st;
  }
  if (absl::Status st = CudaStatus(cudaEventRecord(read_back_, stream_), "refresher readback");
      !st.ok()) {
    return st;
  }
  readback_pages_ = n;
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaKvStore::TakeReadback(std::vector<uint16_t>* out) {
  if (readback_pages_ < 0) return false;
  const cudaError_t e = cudaEventQuery(read_back_);
  if (e == cudaErrorNotReady) return false;
  if (absl::Status st = CudaStatus(e, "refresher readback"); !st.ok()) return st;
  const auto* host = reinterpret_cast<const uint16_t*>(readback_host_->data());
  out->assign(host, host + static_cast<int64_t>(layouts_.size()) * readback_pages_ *
                               layouts_[0].page_bytes / 2);
  readback_pages_ = -1;
  return true;
}

}  // namespace subspace::cuda
