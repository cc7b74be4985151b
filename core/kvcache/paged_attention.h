// Attention over paged KV blocks, written once for every cache that can hand it a block's rows
// in fp32: the paged cache (fp32 rows in place, or q8_0 / q4_0 rows dequantized) and the
// transform-coded cache (rows decoded from their codes). The cache says where a block's rows
// are (BlockRowSource); this walks the block tables with a streaming softmax, split-KV for small
// batches and sliding-window masking. The low-rank compressed cache attends in coefficient
// space and has its own loop (core/compress/compressed_kv_cache_attention.cc).
#ifndef SUBSPACE_CORE_KVCACHE_PAGED_ATTENTION_H_
#define SUBSPACE_CORE_KVCACHE_PAGED_ATTENTION_H_

#include <cstdint>
#include <span>

#include "core/kvcache/kv_cache.h"

namespace subspace {

// One layer's blocks, as the attention reads them. Called from worker threads at once: Rows and
// Prefetch must only read the cache.
class BlockRowSource {
 public:
  virtual ~BlockRowSource() = default;
  // The key (values = false) or value rows of block `block` of `seq`: [n_kv_heads][B][head_dim]
  // fp32, of which rows [0, valid) of each head are read. In place, or written into `scratch`
  // ([n_kv_heads * B * head_dim], the calling thread's) when NeedsScratch().
  virtual const float* Rows(SeqId seq, int64_t block, bool values, int valid,
                            float* scratch) const = 0;
  virtual bool NeedsScratch() const = 0;
  // Block `block` of `seq` will be read soon (a hint; the default does nothing).
  virtual void Prefetch(SeqId seq, int64_t block) const {
    (void)seq;
    (void)block;
  }
};

// Scaled-dot-product attention (scale 1/sqrt(head_dim)) with GQA for every request over the
// blocks `source` hands out: KvCache::Attend of a paged cache. Parallel inside over requests,
// queries and runs of blocks.
void AttendPagedBlocks(const KvCacheGeometry& geometry, int block_size,
                       std::span<const AttentionRequest> requests, int n_heads,
                       const BlockRowSource& source);

}  // namespace subspace

#endif  // SUBSPACE_CORE_KVCACHE_PAGED_ATTENTION_H_
