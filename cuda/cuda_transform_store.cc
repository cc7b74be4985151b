// CudaTransformStore: the transform codec's kernels over the device pool (cuda_transform_store.h).
#include "cuda/cuda_transform_store.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "cuda/cuda_status.h"

namespace subspace::cuda {
namespace {

constexpr int64_t kStagedBytesPerBlock = 4 * 4;  // four int32 columns

}  // namespace

void CudaTransformStore::CarveDevice(Carver& c, const std::vector<kernels::KvPoolLayout>& layouts,
                                     int64_t num_pages, Device* out) {
  out->pool = c.Take(static_cast<int64_t>(layouts.size()) * num_pages * layouts[0].page_bytes);
  out->floats.clear();
  out->ints.clear();
  for (const kernels::KvPoolLayout& l : layouts) {
    out->floats.push_back(
        c.TakeArray<float>(2 * l.n_kv_heads * kernels::TransformFloats(l.head_dim)));
    out->ints.push_back(
        c.TakeArray<int32_t>(2 * l.n_kv_heads * kernels::TransformInts(l.head_dim)));
  }
  out->staging = c.Take(BatchStager::DeviceBytes(kStagedBytesPerBlock));
}

absl::StatusOr<std::unique_ptr<CudaTransformStore>> CudaTransformStore::Create(
    std::vector<kernels::KvPoolLayout> layouts, int64_t num_pages,
    const std::vector<TransformLayerTables>& tables, const kernels::TransformKeyRope& key_rope,
    const Device& device, cudaStream_t stream) {
  if (tables.size() != layouts.size() || device.floats.size() != layouts.size()) {
    return absl::InvalidArgumentError("transform store: one table per layer");
  }
  std::unique_ptr<CudaTransformStore> store(
      new CudaTransformStore(std::move(layouts), num_pages, key_rope, device, stream));
  for (size_t l = 0; l < tables.size(); ++l) {
    const kernels::KvPoolLayout& kv = store->layouts_[l];
    const size_t nf =
        static_cast<size_t>(2 * kv.n_kv_heads * kernels::TransformFloats(kv.head_dim));
    const size_t ni = static_cast<size_t>(2 * kv.n_kv_heads * kernels::TransformInts(kv.head_dim));
    if (tables[l].floats.size() != nf || tables[l].ints.size() != ni) {
      return absl::InvalidArgumentError(
          absl::StrFormat("transform store: layer %d's tables do not match its layout", l));
    }
    if (absl::Status st = CudaStatus(
            cudaMemcpy(device.floats[l], tables[l].floats.data(), nf * 4, cudaMemcpyHostToDevice),
            "transform tables upload");
        !st.ok()) {
      return st;
    }
    if (absl::Status st = CudaStatus(
            cudaMemcpy(device.ints[l], tables[l].ints.data(), ni * 4, cudaMemcpyHostToDevice),
            "transform tables upload");
        !st.ok()) {
      return st;
    }
  }
  absl::StatusOr<std::unique_ptr<BatchStager>> stager =
      BatchStager::Create(device.staging, kStagedBytesPerBlock, stream);
  if (!stager.ok()) return stager.status();
  store->stager_ = *std::move(stager);
  return store;
}

absl::Status CudaTransformStore::Code(const TransformCodeBatch& batch) {
  return stager_->Run(static_cast<int64_t>(batch.src_page.size()),
                      {{batch.src_page.data(), 4},
                       {batch.dst_page.data(), 4},
                       {batch.dst_slot.data(), 4},
                       {batch.first_pos.data(), 4}},
                      [&](const void* const d[BatchStager::kMaxColumns], int64_t, int32_t n) {
                        for (size_t l = 0; l < layouts_.size(); ++l) {
                          uint8_t* pool = LayerPool(static_cast<int>(l));
                          const cudaError_t err = kernels::LaunchTransformCode(
                              {.layout = layouts_[l],
                               .tables = Tables(l),
                               .key_rope = key_rope_,
                               .src_pool = pool,
                               .dst_pool = pool,
                               .src_page = static_cast<const int32_t*>(d[0]),
                               .dst_page = static_cast<const int32_t*>(d[1]),
                               .dst_slot = static_cast<const int32_t*>(d[2]),
                               .first_pos = static_cast<const int32_t*>(d[3]),
                               .n_blocks = n},
                              stream_);
                          if (absl::Status st = CudaStatus(err, "transform code blocks"); !st.ok())
                            return st;
                        }
                        return absl::OkStatus();
                      });
}

absl::Status CudaTransformStore::Expand(const TransformExpandBatch& batch) {
  return stager_->Run(
      static_cast<int64_t>(batch.src_page.size()),
      {{batch.src_page.data(), 4},
       {batch.src_slot.data(), 4},
       {batch.dst_page.data(), 4},
       {batch.first_pos.data(), 4}},
      [&](const void* const d[BatchStager::kMaxColumns], int64_t, int32_t n) {
        for (size_t l = 0; l < layouts_.size(); ++l) {
          const cudaError_t err =
              ExpandInto(static_cast<int>(l), LayerPool(static_cast<int>(l)),
                         static_cast<const int32_t*>(d[0]), static_cast<const int32_t*>(d[1]),
                         static_cast<const int32_t*>(d[2]), static_cast<const int32_t*>(d[3]), n);
          if (absl::Status st = CudaStatus(err, "transform expand blocks"); !st.ok()) return st;
        }
        return absl::OkStatus();
      });
}

absl::Status CudaTransformStore::Read(int layer, int64_t offset, std::span<uint8_t> out) {
  return CopyAfterStream(stream_, out.data(), LayerPool(layer) + offset, out.size(),
                         cudaMemcpyDeviceToHost);
}

absl::Status CudaTransformStore::Write(int layer, int64_t offset, std::span<const uint8_t> bytes) {
  return CopyAfterStream(stream_, LayerPool(layer) + offset, bytes.data(), bytes.size(),
                         cudaMemcpyHostToDevice);
}

cudaError_t CudaTransformStore::ExpandInto(int layer, uint8_t* scratch, const int32_t* src_page,
                                           const int32_t* src_slot, const int32_t* dst_page,
                                           const int32_t* first_pos, int32_t n) const {
  const auto l = static_cast<size_t>(layer);
  return kernels::LaunchTransformExpand({.layout = layouts_[l],
                                         .tables = Tables(l),
                                         .key_rope = key_rope_,
                                         .src_pool = LayerPool(layer),
                                         .dst_pool = scratch,
                                         .src_page = src_page,
                                         .src_slot = src_slot,
                                         .dst_page = dst_page,
                                         .first_pos = first_pos,
                                         .n_blocks = n},
                                        stream_);
}

}  // namespace subspace::cuda
