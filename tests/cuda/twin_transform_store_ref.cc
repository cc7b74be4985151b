// TwinTransformStore: the transform kernels' twins over host pools (twin_transform_store_ref.h).
#include "tests/cuda/twin_transform_store_ref.h"

#include <cstring>
#include <utility>

#include "tests/cuda/twin_pool_bytes.h"
#include "tests/kernels/transform_blocks_ref.h"

namespace subspace::cuda {

TwinTransformStore::TwinTransformStore(std::vector<kernels::KvPoolLayout> layouts,
                                       int64_t num_pages, std::vector<TransformLayerTables> tables,
                                       kernels::TransformKeyRope key_rope)
    : layouts_(std::move(layouts)),
      num_pages_(num_pages),
      tables_(std::move(tables)),
      key_rope_(key_rope) {
  for (const kernels::KvPoolLayout& l : layouts_) {
    pools_.emplace_back(static_cast<size_t>(num_pages_ * l.page_bytes), uint8_t{0xff});
  }
}

absl::Status TwinTransformStore::Code(const TransformCodeBatch& batch) {
  for (size_t l = 0; l < layouts_.size(); ++l) {
    const kernels::TransformCodeParams p = {
        .layout = layouts_[l],
        .tables = {tables_[l].floats.data(), tables_[l].ints.data()},
        .key_rope = key_rope_,
        .src_pool = pools_[l].data(),
        .dst_pool = pools_[l].data(),
        .src_page = batch.src_page.data(),
        .dst_page = batch.dst_page.data(),
        .dst_slot = batch.dst_slot.data(),
        .first_pos = batch.first_pos.data(),
        .n_blocks = static_cast<int32_t>(batch.src_page.size())};
    if (absl::Status st = kernels::CheckTransformCodeBatch(p, num_pages_, num_pages_); !st.ok()) {
      return st;
    }
    kernels::TransformCodeRef(p);
  }
  blocks_coded_ += static_cast<int64_t>(batch.src_page.size());
  return absl::OkStatus();
}

absl::Status TwinTransformStore::Expand(const TransformExpandBatch& batch) {
  for (size_t l = 0; l < layouts_.size(); ++l) {
    const kernels::TransformExpandParams p = {
        .layout = layouts_[l],
        .tables = {tables_[l].floats.data(), tables_[l].ints.data()},
        .key_rope = key_rope_,
        .src_pool = pools_[l].data(),
        .dst_pool = pools_[l].data(),
        .src_page = batch.src_page.data(),
        .src_slot = batch.src_slot.data(),
        .dst_page = batch.dst_page.data(),
        .first_pos = batch.first_pos.data(),
        .n_blocks = static_cast<int32_t>(batch.src_page.size())};
    if (absl::Status st = kernels::CheckTransformExpandBatch(p, num_pages_, num_pages_); !st.ok()) {
      return st;
    }
    kernels::TransformExpandRef(p);
  }
  blocks_expanded_ += static_cast<int64_t>(batch.src_page.size());
  return absl::OkStatus();
}

absl::Status TwinTransformStore::Read(int layer, int64_t offset, std::span<uint8_t> out) {
  return ReadPoolBytes(pools_[static_cast<size_t>(layer)], offset, out);
}

absl::Status TwinTransformStore::Write(int layer, int64_t offset, std::span<const uint8_t> bytes) {
  return WritePoolBytes(pools_[static_cast<size_t>(layer)], offset, bytes);
}

}  // namespace subspace::cuda
