// CudaKvStore: batches staged through pinned memory, one launch per layer and chunk.
#include "kernels/cuda_kv_store.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "kernels/compress_blocks.h"
#include "kernels/cuda_status.h"
#include "kernels/expand_blocks.h"

namespace subspace::kernels {
namespace {

// Blocks per staged launch: a batch larger than this (a long prompt's first commit) goes in
// chunks, so the staging buffers stay small whatever the pool.
constexpr int64_t kStagedBlocks = 1024;

int64_t StagingInts(int n_kv) { return kStagedBlocks * (3 + n_kv); }

}  // namespace

void CudaKvStore::CarveDevice(Carver& c, const std::vector<KvPoolLayout>& layouts,
                              int64_t num_pages, int capacity, Device* out) {
  out->pool = c.Take(static_cast<int64_t>(layouts.size()) * num_pages * layouts[0].page_bytes);
  out->pk.clear();
  out->pq.clear();
  out->pv.clear();
  out->rv.clear();
  for (const KvPoolLayout& l : layouts) {
    const int64_t k = int64_t{capacity} * l.n_kv_heads * l.head_dim * l.rank_k;
    const int64_t v = int64_t{capacity} * l.n_kv_heads * l.head_dim * l.rank_v;
    out->pk.push_back(c.TakeArray<float>(k));
    out->pq.push_back(c.TakeArray<float>(k));
    out->pv.push_back(c.TakeArray<float>(v));
    out->rv.push_back(c.TakeArray<float>(v));
  }
  out->staging = c.TakeArray<int32_t>(StagingInts(layouts[0].n_kv_heads));
}

absl::StatusOr<std::unique_ptr<CudaKvStore>> CudaKvStore::Create(std::vector<KvPoolLayout> layouts,
                                                                 int64_t num_pages, int capacity,
                                                                 int64_t readback_pages,
                                                                 const Device& device,
                                                                 cudaStream_t stream) {
  std::unique_ptr<CudaKvStore> store(
      new CudaKvStore(std::move(layouts), num_pages, capacity, readback_pages, device, stream));
  absl::StatusOr<std::unique_ptr<PinnedHostBuffer>> host = PinnedHostBuffer::Create(
      StagingInts(store->layouts_[0].n_kv_heads) * 4, "KV store staging");
  if (!host.ok()) return host.status();
  store->staging_host_ = *std::move(host);
  if (absl::Status st = CudaStatus(
          cudaEventCreateWithFlags(&store->staged_, cudaEventDisableTiming), "cudaEventCreate");
      !st.ok()) {
    return st;
  }
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

CudaKvStore::CudaKvStore(std::vector<KvPoolLayout> layouts, int64_t num_pages, int capacity,
                         int64_t readback_pages, const Device& device, cudaStream_t stream)
    : layouts_(std::move(layouts)),
      num_pages_(num_pages),
      capacity_(capacity),
      device_(device),
      stream_(stream),
      readback_capacity_(readback_pages) {}

CudaKvStore::~CudaKvStore() {
  if (staged_ != nullptr) cudaEventDestroy(staged_);
  // A readback still in flight writes into readback_host_: let it land before that goes.
  if (read_back_ != nullptr) {
    cudaEventSynchronize(read_back_);
    cudaEventDestroy(read_back_);
  }
}

absl::Status CudaKvStore::LoadBasis(int entry, const Basis& basis) {
  if (entry < 0 || entry >= capacity_ || basis.layers.size() != layouts_.size()) {
    return absl::InvalidArgumentError(absl::StrFormat("basis entry %d outside [0, %d)", entry,
                                                      capacity_));
  }
  for (size_t l = 0; l < layouts_.size(); ++l) {
    const LayerBasis& lb = basis.layers[l];
    const KvPoolLayout& kv = layouts_[l];
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
      if (absl::Status st = CudaStatus(cudaMemcpyAsync(dst, src->data(), src->size() * 4,
                                                       cudaMemcpyHostToDevice, stream_),
                                       "basis upload");
          !st.ok()) {
        return st;
      }
    }
  }
  // From pageable memory: wait, so the caller's basis may go as soon as this returns.
  return CudaStatus(cudaStreamSynchronize(stream_), "basis upload");
}

absl::Status CudaKvStore::Stage(const int32_t* a, const int32_t* b, const int32_t* c,
                                const int32_t* epoch, int64_t n, const int32_t* out[4]) {
  const int n_kv = layouts_[0].n_kv_heads;
  // The previous staging copy must have left the pinned buffer before it is rewritten.
  if (absl::Status st = CudaStatus(cudaEventSynchronize(staged_), "staging"); !st.ok()) return st;
  auto* host = reinterpret_cast<int32_t*>(staging_host_->data());
  const size_t bytes = static_cast<size_t>(n) * 4;
  std::memcpy(host, a, bytes);
  std::memcpy(host + n, b, bytes);
  std::memcpy(host + 2 * n, c, bytes);
  std::memcpy(host + 3 * n, epoch, bytes * n_kv);
  const int64_t ints = n * (3 + n_kv);
  absl::Status st = CudaStatus(cudaMemcpyAsync(device_.staging, host, static_cast<size_t>(ints) * 4,
                                               cudaMemcpyHostToDevice, stream_),
                               "staging copy");
  if (st.ok()) st = CudaStatus(cudaEventRecord(staged_, stream_), "staging");
  for (int i = 0; i < 4; ++i) out[i] = device_.staging + i * n;
  return st;
}

absl::Status CudaKvStore::StageAndLaunch(
    std::span<const int32_t> a, std::span<const int32_t> b, std::span<const int32_t> c,
    std::span<const int32_t> epoch, const char* what,
    absl::FunctionRef<cudaError_t(size_t layer, const int32_t* const staged[4], int32_t n)>
        launch) {
  const int n_kv = layouts_[0].n_kv_heads;
  const int64_t total = static_cast<int64_t>(a.size());
  for (int64_t first = 0; first < total; first += kStagedBlocks) {
    const int64_t n = std::min(kStagedBlocks, total - first);
    const int32_t* d[4];
    if (absl::Status st = Stage(a.data() + first, b.data() + first, c.data() + first,
                                epoch.data() + first * n_kv, n, d);
        !st.ok()) {
      return st;
    }
    for (size_t l = 0; l < layouts_.size(); ++l) {
      if (absl::Status st = CudaStatus(launch(l, d, static_cast<int32_t>(n)), what); !st.ok()) {
        return st;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CudaKvStore::Compress(const CompressBatch& batch) {
  return StageAndLaunch(
      batch.src_page, batch.dst_page, batch.dst_slot, batch.epoch, "compress blocks",
      [&](size_t l, const int32_t* const d[4], int32_t n) {
        CompressBlocksParams p;
        p.layout = layouts_[l];
        p.pool = LayerPool(static_cast<int>(l));
        p.basis_pk = device_.pk[l];
        p.basis_pv = device_.pv[l];
        p.src_page = d[0];
        p.dst_page = d[1];
        p.dst_slot = d[2];
        p.epoch = d[3];
        p.n_blocks = n;
        return LaunchCompressBlocks(p, stream_);
      });
}

absl::Status CudaKvStore::Expand(const ExpandBatch& batch) {
  return StageAndLaunch(
      batch.src_page, batch.src_slot, batch.dst_page, batch.epoch, "expand blocks",
      [&](size_t l, const int32_t* const d[4], int32_t n) {
        ExpandBlocksParams p;
        p.layout = layouts_[l];
        p.src_pool = LayerPool(static_cast<int>(l));
        p.dst_pool = LayerPool(static_cast<int>(l));
        p.basis_pq = device_.pq[l];
        p.basis_rv = device_.rv[l];
        p.src_page = d[0];
        p.src_slot = d[1];
        p.dst_page = d[2];
        p.epoch = d[3];
        p.n_blocks = n;
        return LaunchExpandBlocks(p, stream_);
      });
}

absl::Status CudaKvStore::ReadPage(int layer, int32_t page, std::span<uint16_t> out) {
  const KvPoolLayout& l = layouts_[static_cast<size_t>(layer)];
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

}  // namespace subspace::kernels
