// A CompressedKvStore in host memory that runs the kernels' CPU twins (compress_blocks_ref,
// expand_blocks_ref, recode_blocks_ref, outlier_tokens_ref) and checks every batch the cache hands
// it first, so the device cache's bookkeeping is tested on any machine against the same references
// the GPU kernels are held to. It also writes tokens the way the append kernel does and exposes the
// pool and basis tables for the decode-attention twin.
#ifndef SUBSPACE_TESTS_CUDA_TWIN_KV_STORE_REF_H_
#define SUBSPACE_TESTS_CUDA_TWIN_KV_STORE_REF_H_

#include <cstdint>
#include <span>
#include <vector>

#include "cuda/compressed_kv_store.h"
#include "kernels/kv_layout.h"

namespace subspace::cuda {

class TwinKvStore final : public CompressedKvStore {
 public:
  // layouts: [n_layers] (each layer's ranks); pages start poisoned (0xff: fp16 NaN).
  // A readback lands when TakeReadback is called `readback_delay` times after it started
  // (0: at once), as a GPU copy lands some steps later.
  TwinKvStore(std::vector<kernels::KvPoolLayout> layouts, int64_t num_pages, int basis_capacity,
              int64_t readback_capacity = 16, int readback_delay = 0);

  int basis_capacity() const override { return capacity_; }
  // INVALID_ARGUMENT for an entry out of range or a basis whose layers do not match.
  absl::Status LoadBasis(int entry, const Basis& basis) override;
  // INVALID_ARGUMENT for a batch CheckCompressBatch / CheckExpandBatch rejects.
  absl::Status Compress(const CompressBatch& batch) override;
  absl::Status Expand(const ExpandBatch& batch) override;
  // INVALID_ARGUMENT for a batch CheckRecodeBatch rejects.
  absl::Status Recode(const RecodeBatch& batch) override;
  // INVALID_ARGUMENT for a batch CheckOutlierBatch rejects.
  absl::Status MoveOutliers(const OutlierBatch& batch) override;
  absl::Status ReadPage(int layer, int32_t page, std::span<uint16_t> out) override;
  absl::Status Read(int layer, int64_t offset, std::span<uint8_t> out) override;
  absl::Status Write(int layer, int64_t offset, std::span<const uint8_t> bytes) override;
  int64_t readback_capacity() const override { return readback_capacity_; }
  absl::Status StartReadback(std::span<const int32_t> pages) override;
  absl::StatusOr<bool> TakeReadback(std::vector<uint16_t>* out) override;

  // Token t of full page `page` in `layer`, as the append kernel writes it (rounded to fp16).
  // k, v: [n_kv, head_dim]
  void WriteToken(int layer, int32_t page, int t, const float* k, const float* v);

  uint8_t* pool(int layer) { return pools_[static_cast<size_t>(layer)].data(); }
  const float* basis_pq(int layer) const { return pq_[static_cast<size_t>(layer)].data(); }
  const float* basis_rv(int layer) const { return rv_[static_cast<size_t>(layer)].data(); }
  int64_t num_pages() const { return num_pages_; }
  int64_t compress_calls() const { return compress_calls_; }
  int64_t blocks_compressed() const { return blocks_compressed_; }
  int64_t blocks_expanded() const { return blocks_expanded_; }
  int64_t blocks_recoded() const { return blocks_recoded_; }
  int64_t pages_read_back() const { return pages_read_back_; }
  int64_t outlier_moves() const { return outlier_moves_; }  // blocks, both directions

 private:
  std::vector<kernels::KvPoolLayout> layouts_;
  int64_t num_pages_;
  int capacity_;
  std::vector<std::vector<uint8_t>> pools_;            // [n_layers][num_pages * page_bytes]
  std::vector<std::vector<float>> pk_, pq_, pv_, rv_;  // [n_layers][capacity, n_kv, ...]
  int64_t compress_calls_ = 0, blocks_compressed_ = 0, blocks_expanded_ = 0, outlier_moves_ = 0,
          blocks_recoded_ = 0;
  int64_t readback_capacity_;
  int readback_delay_;
  // The readback in flight: copied when it starts (what a stream-ordered copy would see).
  bool readback_started_ = false;
  int readback_polls_left_ = 0;
  std::vector<uint16_t> readback_;
  int64_t pages_read_back_ = 0;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_TESTS_CUDA_TWIN_KV_STORE_REF_H_
