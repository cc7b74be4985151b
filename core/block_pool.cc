// BlockPool: one aligned allocation at start-up; Allocate/Free only move ids on a free list.
#include "core/block_pool.h"

#include <cassert>
#include <cstdlib>
#include <limits>
#include <new>

#include "absl/strings/str_format.h"

namespace subspace {

namespace {
constexpr size_t kAlignment = 64;  // a cache line; also what AVX-512 loads like
}  // namespace

void BlockPool::AlignedFree::operator()(float* p) const { std::free(p); }

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(int64_t block_floats,
                                                             int64_t num_blocks) {
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

}  // namespace subspace
