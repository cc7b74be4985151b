// A fixed pool of equal-sized KV blocks (pages) carved from one buffer allocated at start-up,
// with a LIFO free list and per-kind accounting; and a slab allocator that packs smaller
// compressed blocks into pages, so full and compressed blocks draw from one budget.
#ifndef SUBSPACE_CORE_KVCACHE_BLOCK_POOL_H_
#define SUBSPACE_CORE_KVCACHE_BLOCK_POOL_H_

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
  // The ids and accounting alone, for blocks whose bytes live elsewhere (the CUDA backend's
  // device pool): no host buffer, and data() must not be called. Same checks as Create.
  static absl::StatusOr<std::unique_ptr<BlockPool>> CreateBookkeeping(int64_t block_floats,
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
  // num_blocks * block_floats overflows int32 on real pools). Not for a bookkeeping pool.
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

// Fixed-size slots packed into BlockPool pages, for blocks smaller than a page (compressed
// coefficient blocks). Each slot class has its own slot size; a page belongs to one class
// while any of its slots is in use and goes back to the pool when its last slot is freed, so
// compressed and full blocks share one budget. Waste: the page tail (page % slot bytes) and,
// under churn, partly used pages (at most one page per class while slots are only allocated;
// frees in the middle can leave more, which a compactor would repack). All bookkeeping arrays
// are sized by the pool at construction: Allocate/Free never allocate.
class SlabAllocator {
 public:
  static constexpr int kMaxSlotsPerPage = 64;  // one uint64 occupancy mask per page

  struct Slot {
    int32_t page = -1;
    int32_t index = -1;
  };

  // `pool` outlives the allocator; pages taken from it are tagged `kind`.
  SlabAllocator(BlockPool* pool, BlockKind kind);
  SlabAllocator(const SlabAllocator&) = delete;
  SlabAllocator& operator=(const SlabAllocator&) = delete;

  // Adds a class of slots of `slot_bytes` (rounded up to 16 bytes); returns its id. -1 when a
  // slot would not fit in a page.
  int AddClass(int64_t slot_bytes);
  // A slot of class `cls`, or {-1, -1} when no page has room and the pool has no free page.
  Slot Allocate(int cls);
  void Free(Slot slot);
  // Whether Allocate(cls) would succeed without taking a page from the pool.
  bool HasRoom(int cls) const { return classes_[static_cast<size_t>(cls)].partial_head >= 0; }

  uint8_t* data(Slot slot) {
    return reinterpret_cast<uint8_t*>(pool_->data(slot.page)) +
           static_cast<int64_t>(slot.index) * classes_[page_class_[slot.page]].slot_bytes;
  }
  const uint8_t* data(Slot slot) const {
    return reinterpret_cast<const uint8_t*>(pool_->data(slot.page)) +
           static_cast<int64_t>(slot.index) * classes_[page_class_[slot.page]].slot_bytes;
  }
  int64_t slot_bytes(int cls) const { return classes_[static_cast<size_t>(cls)].slot_bytes; }
  int slots_per_page(int cls) const { return classes_[static_cast<size_t>(cls)].per_page; }
  int64_t pages_held() const { return pages_held_; }
  int64_t slot_bytes_used() const { return slot_bytes_used_; }

 private:
  struct Class {
    int64_t slot_bytes = 0;
    int per_page = 0;
    int32_t partial_head = -1;  // pages of this class with a free slot (doubly linked)
  };
  void Unlink(int32_t page);
  void PushPartial(int32_t page);

  BlockPool* pool_;
  BlockKind kind_;
  std::vector<Class> classes_;
  std::vector<int16_t> page_class_;   // [num_blocks] class of a held page
  std::vector<uint64_t> used_mask_;   // [num_blocks] occupied slots of a held page
  std::vector<int32_t> prev_, next_;  // [num_blocks] partial-page list links
  int64_t pages_held_ = 0;
  int64_t slot_bytes_used_ = 0;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_KVCACHE_BLOCK_POOL_H_
