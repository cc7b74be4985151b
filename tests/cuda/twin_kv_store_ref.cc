#include "tests/cuda/twin_kv_store_ref.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/base/tensor_types.h"
#include "kernels/compress_blocks.h"
#include "kernels/expand_blocks.h"
#include "tests/cuda/twin_pool_bytes.h"
#include "tests/kernels/compress_blocks_ref.h"
#include "tests/kernels/expand_blocks_ref.h"
#include "tests/kernels/outlier_tokens_ref.h"
#include "tests/kernels/recode_blocks_ref.h"

namespace subspace::cuda {

TwinKvStore::TwinKvStore(std::vector<kernels::KvPoolLayout> layouts, int64_t num_pages,
                         int basis_capacity, int64_t readback_capacity, int readback_delay)
    : layouts_(std::move(layouts)),
      num_pages_(num_pages),
      capacity_(basis_capacity),
      readback_capacity_(readback_capacity),
      readback_delay_(readback_delay) {
  for (const kernels::KvPoolLayout& l : layouts_) {
    pools_.emplace_back(static_cast<size_t>(num_pages * l.page_bytes), uint8_t{0xff});
    const size_t k = static_cast<size_t>(capacity_) * l.n_kv_heads * l.head_dim * l.rank_k;
    const size_t v = static_cast<size_t>(capacity_) * l.n_kv_heads * l.head_dim * l.rank_v;
    pk_.emplace_back(k, 0.0f);
    pq_.emplace_back(k, 0.0f);
    pv_.emplace_back(v, 0.0f);
    rv_.emplace_back(v, 0.0f);
  }
}

absl::Status TwinKvStore::LoadBasis(int entry, const Basis& basis) {
  if (entry < 0 || entry >= capacity_ || basis.layers.size() != layouts_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("basis entry %d / %d layers out of range", entry, basis.layers.size()));
  }
  for (size_t l = 0; l < layouts_.size(); ++l) {
    const LayerBasis& lb = basis.layers[l];
    const size_t k = lb.p_k.size(), v = lb.p_v.size();
    if (k * capacity_ != pk_[l].size() || v * capacity_ != pv_[l].size() || lb.p_q.size() != k ||
        lb.r_v.size() != v) {
      return absl::InvalidArgumentError(absl::StrFormat("layer %d basis does not match", l));
    }
    std::copy(lb.p_k.begin(), lb.p_k.end(), pk_[l].begin() + entry * k);
    std::copy(lb.p_q.begin(), lb.p_q.end(), pq_[l].begin() + entry * k);
    std::copy(lb.p_v.begin(), lb.p_v.end(), pv_[l].begin() + entry * v);
    std::copy(lb.r_v.begin(), lb.r_v.end(), rv_[l].begin() + entry * v);
  }
  return absl::OkStatus();
}

absl::Status TwinKvStore::Compress(const CompressBatch& batch) {
  ++compress_calls_;
  blocks_compressed_ += static_cast<int64_t>(batch.src_page.size());
  const bool detect = !batch.outlier_masks.empty();
  if (detect && batch.outlier_masks.size() != batch.src_page.size()) {
    return absl::InvalidArgumentError("one outlier mask per block");
  }
  std::fill(batch.outlier_masks.begin(), batch.outlier_masks.end(), uint64_t{0});
  for (size_t l = 0; l < layouts_.size(); ++l) {
    kernels::CompressBlocksParams p;
    p.layout = layouts_[l];
    p.pool = pools_[l].data();
    p.basis_pk = pk_[l].data();
    p.basis_pv = pv_[l].data();
    p.src_page = batch.src_page.data();
    p.dst_page = batch.dst_page.data();
    p.dst_slot = batch.dst_slot.data();
    p.epoch = batch.epoch.data();
    p.n_blocks = static_cast<int32_t>(batch.src_page.size());
    if (detect) {
      p.basis_pq = pq_[l].data();
      p.outlier_masks = batch.outlier_masks.data();
      p.outlier_threshold = batch.outlier_threshold;
    }
    if (absl::Status st = kernels::CheckCompressBatch(p, num_pages_, capacity_); !st.ok())
      return st;
    kernels::CompressBlocksRef(p);
  }
  return absl::OkStatus();
}

absl::Status TwinKvStore::MoveOutliers(const OutlierBatch& batch) {
  const size_t n = batch.block_page.size();
  if (batch.mask.size() != n || batch.first_slot.size() != n ||
      batch.outlier_page.size() != 2 * n) {
    return absl::InvalidArgumentError("outlier batch arrays of different lengths");
  }
  outlier_moves_ += static_cast<int64_t>(n);
  for (size_t l = 0; l < layouts_.size(); ++l) {
    kernels::OutlierTokensParams p;
    p.layout = layouts_[l];
    p.block_pool = pools_[l].data();
    p.outlier_pool = pools_[l].data();
    p.block_page = batch.block_page.data();
    p.mask = batch.mask.data();
    p.first_slot = batch.first_slot.data();
    p.outlier_page = batch.outlier_page.data();
    p.n_blocks = static_cast<int32_t>(n);
    p.direction = batch.direction;
    if (absl::Status st = kernels::CheckOutlierBatch(p, num_pages_, num_pages_, /*same_pool=*/true);
        !st.ok()) {
      return st;
    }
    kernels::OutlierTokensRef(p);
  }
  return absl::OkStatus();
}

absl::Status TwinKvStore::Expand(const ExpandBatch& batch) {
  blocks_expanded_ += static_cast<int64_t>(batch.src_page.size());
  for (size_t l = 0; l < layouts_.size(); ++l) {
    kernels::ExpandBlocksParams p;
    p.layout = layouts_[l];
    p.src_pool = pools_[l].data();
    p.dst_pool = pools_[l].data();
    p.basis_pq = pq_[l].data();
    p.basis_rv = rv_[l].data();
    p.src_page = batch.src_page.data();
    p.src_slot = batch.src_slot.data();
    p.dst_page = batch.dst_page.data();
    p.epoch = batch.epoch.data();
    p.n_blocks = static_cast<int32_t>(batch.src_page.size());
    if (absl::Status st = kernels::CheckExpandBatch(p, num_pages_, num_pages_, capacity_);
        !st.ok()) {
      return st;
    }
    kernels::ExpandBlocksRef(p);
  }
  return absl::OkStatus();
}

absl::Status TwinKvStore::Recode(const RecodeBatch& batch) {
  const size_t n = batch.page.size(), n_kv = static_cast<size_t>(layouts_[0].n_kv_heads);
  if (batch.slot.size() != n || batch.from.size() != n * n_kv || batch.to.size() != n * n_kv) {
    return absl::InvalidArgumentError("recode batch arrays of different lengths");
  }
  blocks_recoded_ += static_cast<int64_t>(n);
  for (size_t l = 0; l < layouts_.size(); ++l) {
    kernels::RecodeBlocksParams p;
    p.layout = layouts_[l];
    p.pool = pools_[l].data();
    p.basis_pq = pq_[l].data();
    p.basis_rv = rv_[l].data();
    p.basis_pk = pk_[l].data();
    p.basis_pv = pv_[l].data();
    p.page = batch.page.data();
    p.slot = batch.slot.data();
    p.from_epoch = batch.from.data();
    p.to_epoch = batch.to.data();
    p.n_blocks = static_cast<int32_t>(n);
    if (absl::Status st = kernels::CheckRecodeBatch(p, num_pages_, capacity_); !st.ok()) return st;
    kernels::RecodeBlocksRef(p);
  }
  return absl::OkStatus();
}

absl::Status TwinKvStore::ReadPage(int layer, int32_t page, std::span<uint16_t> out) {
  const kernels::KvPoolLayout& l = layouts_[static_cast<size_t>(layer)];
  if (page < 0 || page >= num_pages_ || static_cast<int64_t>(out.size()) * 2 != l.page_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat("page %d out of range", page));
  }
  std::memcpy(out.data(), pools_[static_cast<size_t>(layer)].data() + l.Page(page),
              static_cast<size_t>(l.page_bytes));
  return absl::OkStatus();
}

absl::Status TwinKvStore::Read(int layer, int64_t offset, std::span<uint8_t> out) {
  return ReadPoolBytes(pools_[static_cast<size_t>(layer)], offset, out);
}

absl::Status TwinKvStore::Write(int layer, int64_t offset, std::span<const uint8_t> bytes) {
  return WritePoolBytes(pools_[static_cast<size_t>(layer)], offset, bytes);
}

absl::Status TwinKvStore::StartReadback(std::span<const int32_t> pages) {
  if (readback_started_) return absl::FailedPreconditionError("a readback is in flight");
  if (static_cast<int64_t>(pages.size()) > readback_capacity_) {
    return absl::InvalidArgumentError("readback larger than its capacity");
  }
  const size_t page_halves = static_cast<size_t>(layouts_[0].page_bytes / 2);
  readback_.resize(layouts_.size() * pages.size() * page_halves);
  uint16_t* dst = readback_.data();
  for (size_t l = 0; l < layouts_.size(); ++l) {
    for (const int32_t page : pages) {
      if (absl::Status st = ReadPage(static_cast<int>(l), page, {dst, page_halves}); !st.ok()) {
        return st;
      }
      dst += page_halves;
    }
  }
  readback_started_ = true;
  readback_polls_left_ = readback_delay_;
  pages_read_back_ += static_cast<int64_t>(pages.size());
  return absl::OkStatus();
}

absl::StatusOr<bool> TwinKvStore::TakeReadback(std::vector<uint16_t>* out) {
  if (!readback_started_) return false;
  if (readback_polls_left_ > 0) {
    --readback_polls_left_;
    return false;
  }
  readback_started_ = false;
  out->swap(readback_);
  return true;
}

void TwinKvStore::WriteToken(int layer, int32_t page, int t, const float* k, const float* v) {
  const kernels::KvPoolLayout& l = layouts_[static_cast<size_t>(layer)];
  uint8_t* pool = pools_[static_cast<size_t>(layer)].data();
  for (int h = 0; h < l.n_kv_heads; ++h) {
    auto* kd = reinterpret_cast<uint16_t*>(pool + l.FullK(page, h)) + t * l.head_dim;
    auto* vd = reinterpret_cast<uint16_t*>(pool + l.FullV(page, h)) + t * l.head_dim;
    for (int i = 0; i < l.head_dim; ++i) {
      kd[i] = Fp32ToFp16(k[h * l.head_dim + i]);
      vd[i] = Fp32ToFp16(v[h * l.head_dim + i]);
    }
  }
}

}  // namespace subspace::cuda
