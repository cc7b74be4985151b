// A fixed pool of equal-sized KV blocks carved from one buffer allocated at start-up, with a
// LIFO free list and per-kind accounting. Shared by the full-rank paged cache and, next, the
// compressed cache, whose sink/window/outlier and coefficient blocks come from the same pool.
#ifndef SUBSPACE_CORE_BLOCK_POOL_H_
#define SUBSPACE_CORE_BLOCK_POOL_H_

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

namespace subspace {

// What a block in use holds; the pool only counts them, callers decide the layout.
enum class BlockKind : uint8_t {
  kFull = 0,        // full-rank K/V (sinks, recent window)
  kCompressed = 1,  // low-rank coefficients
  kOutlier = 2,     // full-rank tokens kept beside compressed blocks
};
inline constexpr int kNumBlockKinds = 3;

class BlockPool {
 public:
  // Allocates `num_blocks` blocks of `block_floats` fp32 each, 64-byte aligned, once.
  // INVALID_ARGUMENT for non-positive sizes; RESOURCE_EXHAUSTED when the buffer cannot be had.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(int64_t block_floats,
                                                           int64_t num_blocks);

  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // One block id, or -1 when none is free.
  int32_t Allocate(BlockKind kind);
  // Appends `n` block ids to `out`, all or none: false (and `out` untouched) when fewer than
  // `n` are free.
  bool AllocateMany(int64_t n, BlockKind kind, std::vector<int32_t>* out);
  void Free(int32_t block);

  // Block storage: [block_floats]. Block ids go to int64 before the multiply (vLLM habit:
  // num_blocks * block_floats overflows int32 on real pools).
  float* data(int32_t block) { return base_ + static_cast<int64_t>(block) * block_floats_; }
  const float* data(int32_t block) const {
    return base_ + static_cast<int64_t>(block) * block_floats_;
  }

  int64_t block_floats() const { return block_floats_; }
  int64_t block_bytes() const { return block_floats_ * static_cast<int64_t>(sizeof(float)); }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_used(BlockKind kind) const { return used_[static_cast<int>(kind)]; }
  BlockKind kind(int32_t block) const { return static_cast<BlockKind>(kind_[block]); }
  bool in_use(int32_t block) const { return kind_[block] != kFreeTag; }

 private:
  static constexpr uint8_t kFreeTag = 0xff;
  struct AlignedFree {
    void operator()(float* p) const;
  };

  BlockPool(int64_t block_floats, int64_t num_blocks, float* base);

  int64_t block_floats_;
  int64_t num_blocks_;
  std::unique_ptr<float, AlignedFree> storage_;
  float* base_;
  std::vector<int32_t> free_;  // LIFO: the most recently freed block is still warm in cache
  std::vector<uint8_t> kind_;  // [num_blocks] BlockKind or kFreeTag; catches double frees
  std::array<int64_t, kNumBlockKinds> used_{};
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_BLOCK_POOL_H_
