// BlockPool: one aligned allocation at start-up; Allocate/Free only move ids on a free list.
#include "core/kvcache/block_pool.h"

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <limits>
#include <new>

#include "absl/strings/str_format.h"

namespace subspace {

namespace {
constexpr size_t kAlignment = 64;  // a cache line; also what AVX-512 loads like

absl::Status CheckPoolSizes(int64_t block_floats, int64_t num_blocks) {
  if (block_floats <= 0 || num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("block pool needs positive sizes, got %d floats per block and %d blocks",
                        block_floats, num_blocks));
  }
  if (num_blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("block pool of %d blocks exceeds int32 block ids", num_blocks));
  }
  const int64_t max_floats = std::numeric_limits<int64_t>::max() / 8;
  if (block_floats > max_floats / num_blocks) {
    return absl::InvalidArgumentError("block pool size overflows");
  }
  return absl::OkStatus();
}

}  // namespace

void BlockPool::AlignedFree::operator()(float* p) const { std::free(p); }

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::CreateBookkeeping(int64_t block_floats,
                                                                        int64_t num_blocks) {
  if (absl::Status s = CheckPoolSizes(block_floats, num_blocks); !s.ok()) return s;
  return std::unique_ptr<BlockPool>(new BlockPool(block_floats, num_blocks, nullptr));
}

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(int64_t block_floats,
                                                             int64_t num_blocks) {
  if (absl::Status s = CheckPoolSizes(block_floats, num_blocks); !s.ok()) return s;
  // aligned_alloc wants a size that is a multiple of the alignment.
  size_t bytes = static_cast<size_t>(block_floats * num_blocks) * sizeof(float);
  bytes = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* mem = std::aligned_alloc(kAlignment, bytes);
  if (mem == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cannot allocate a KV block pool of %d bytes", bytes));
  }
  return std::unique_ptr<BlockPool>(
      new BlockPool(block_floats, num_blocks, static_cast<float*>(mem)));
}

BlockPool::BlockPool(int64_t block_floats, int64_t num_blocks, float* base)
    : block_floats_(block_floats),
      num_blocks_(num_blocks),
      storage_(base),
      base_(base),
      kind_(static_cast<size_t>(num_blocks), kFreeTag) {
  free_.reserve(static_cast<size_t>(num_blocks));
  // Pushed in reverse so the first allocations hand out ids 0, 1, 2... (readable in tests,
  // and low addresses first).
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

int32_t BlockPool::Allocate(BlockKind kind) {
  if (free_.empty()) return -1;
  const int32_t block = free_.back();
  free_.pop_back();
  kind_[block] = static_cast<uint8_t>(kind);
  ++used_[static_cast<int>(kind)];
  return block;
}

bool BlockPool::AllocateMany(int64_t n, BlockKind kind, std::vector<int32_t>* out) {
  if (n < 0 || n > num_free()) return false;
  for (int64_t i = 0; i < n; ++i) out->push_back(Allocate(kind));
  return true;
}

void BlockPool::Free(int32_t block) {
  assert(block >= 0 && block < num_blocks_);
  assert(kind_[block] != kFreeTag && "double free of a KV block");
  // A double free would put one id on the list twice and hand one block to two sequences;
  // ignoring it in release builds keeps the pool consistent.
  if (block < 0 || block >= num_blocks_ || kind_[block] == kFreeTag) return;
  --used_[kind_[block]];
  kind_[block] = kFreeTag;
  free_.push_back(block);
}

SlabAllocator::SlabAllocator(BlockPool* pool, BlockKind kind)
    : pool_(pool),
      kind_(kind),
      page_class_(static_cast<size_t>(pool->num_blocks()), -1),
      used_mask_(static_cast<size_t>(pool->num_blocks()), 0),
      prev_(static_cast<size_t>(pool->num_blocks()), -1),
      next_(static_cast<size_t>(pool->num_blocks()), -1) {}

int SlabAllocator::AddClass(int64_t slot_bytes) {
  slot_bytes = (slot_bytes + 15) / 16 * 16;
  if (slot_bytes <= 0 || slot_bytes > pool_->block_bytes()) return -1;
  Class c;
  c.slot_bytes = slot_bytes;
  c.per_page =
      static_cast<int>(std::min<int64_t>(pool_->block_bytes() / slot_bytes, kMaxSlotsPerPage));
  classes_.push_back(c);
  return static_cast<int>(classes_.size()) - 1;
}

void SlabAllocator::Unlink(int32_t page) {
  Class& c = classes_[static_cast<size_t>(page_class_[page])];
  if (prev_[page] >= 0) next_[prev_[page]] = next_[page];
  if (next_[page] >= 0) prev_[next_[page]] = prev_[page];
  if (c.partial_head == page) c.partial_head = next_[page];
  prev_[page] = next_[page] = -1;
}

void SlabAllocator::PushPartial(int32_t page) {
  Class& c = classes_[static_cast<size_t>(page_class_[page])];
  prev_[page] = -1;
  next_[page] = c.partial_head;
  if (c.partial_head >= 0) prev_[c.partial_head] = page;
  c.partial_head = page;
}

SlabAllocator::Slot SlabAllocator::Allocate(int cls) {
  Class& c = classes_[static_cast<size_t>(cls)];
  int32_t page = c.partial_head;
  if (page < 0) {
    page = pool_->Allocate(kind_);
    if (page < 0) return {};
    ++pages_held_;
    page_class_[page] = static_cast<int16_t>(cls);
    used_mask_[page] = 0;
    PushPartial(page);
  }
  const uint64_t free_bits = ~used_mask_[page];
  const int index = __builtin_ctzll(free_bits);
  used_mask_[page] |= uint64_t{1} << index;
  if (__builtin_popcountll(used_mask_[page]) == c.per_page) Unlink(page);
  slot_bytes_used_ += c.slot_bytes;
  return {page, index};
}

void SlabAllocator::Free(Slot slot) {
  const int32_t page = slot.page;
  assert(page >= 0 && page < pool_->num_blocks() && page_class_[page] >= 0);
  assert((used_mask_[page] >> slot.index) & 1u);
  Class& c = classes_[static_cast<size_t>(page_class_[page])];
  const bool was_full = __builtin_popcountll(used_mask_[page]) == c.per_page;
  used_mask_[page] &= ~(uint64_t{1} << slot.index);
  slot_bytes_used_ -= c.slot_bytes;
  if (used_mask_[page] == 0) {
    if (!was_full) Unlink(page);
    page_class_[page] = -1;
    --pages_held_;
    pool_->Free(page);
  } else if (was_full) {
    PushPartial(page);
  }
}

}  // namespace subspace
