// Attention over paged KV blocks, written once for every paged cache: the paged cache (fp32
// rows in place, or q8_0 / q4_0 rows dequantized) and the transform-coded cache (fp16 rows for
// its sinks and window; coded blocks scored and accumulated in its code space). The cache says
// where a block's rows are, or does a coded block's products itself (BlockRowSource); this walks
// the block tables with a streaming softmax, split-KV for small batches and sliding-window
// masking. The low-rank compressed cache attends in coefficient space with epochs and outliers
// and has its own loop (core/compress/compressed_kv_cache_attention.cc).
#ifndef SUBSPACE_CORE_KVCACHE_PAGED_ATTENTION_H_
#define SUBSPACE_CORE_KVCACHE_PAGED_ATTENTION_H_

#include <cstdint>
#include <span>

#include "core/base/coeff_codec.h"
#include "core/kvcache/kv_cache.h"

namespace subspace {

// Floats of state per query head that a source's code space needs (BlockRowSource).
struct CodedFloats {
  int query = 0;  // the query, projected once per work item
  int value = 0;  // the value accumulator
};

// A block's key or value rows as attention reads them: [n_kv_heads][B][head_dim] of `dtype`
// (fp32, or fp16 widened in the kernels' registers). data == nullptr: the block is read in the
// source's code space.
struct BlockRows {
  const void* data = nullptr;
  CoeffDtype dtype = CoeffDtype::kFp32;
};

// One layer's blocks, as the attention reads them. Called from worker threads at once: every
// method must only read the cache.
class BlockRowSource {
 public:
  virtual ~BlockRowSource() = default;
  // The key (values = false) or value rows of block `block` of `seq`, of which rows [0, valid)
  // of each head are read. In place, or written into `scratch` ([n_kv_heads * B * head_dim]
  // fp32, the calling thread's) when NeedsScratch(). No data: the block is read in the source's
  // code space, through the methods below.
  virtual BlockRows Rows(SeqId seq, int64_t block, bool values, int valid,
                         float* scratch) const = 0;
  virtual bool NeedsScratch() const = 0;
  // Block `block` of `seq` will be read soon (a hint; the default does nothing).
  virtual void Prefetch(SeqId seq, int64_t block) const {
    (void)seq;
    (void)block;
  }

  // Code space (the transform-coded cache's coded blocks): attention never sees their rows.
  // Per query head of KV head kvh, the floats of its projected query and value accumulator.
  virtual CodedFloats CodedStateFloats(int kvh) const {
    (void)kvh;
    return {};
  }
  // Once per work item and KV head: the group's queries q ([group] rows at stride head_dim) of
  // a query of `seq` projected into `query` ([group * CodedStateFloats(kvh).query], laid out as
  // the source likes); scores come out times `scale`.
  virtual void PrepareQueries(SeqId seq, int kvh, const float* q, int group, float scale,
                              float* query) const {
    (void)seq, (void)kvh, (void)q, (void)group, (void)scale, (void)query;
  }
  // scores[g * nb + t] = scale * q_g . k_t over the first nb keys of head kvh in the block.
  virtual void CodedScores(SeqId seq, int64_t block, int kvh, int group, int nb, const float* query,
                           float* scores) const {
    (void)seq, (void)block, (void)kvh, (void)group, (void)nb, (void)query, (void)scores;
  }
  // value[g] += sum_t p[g * nb + t] v_t over the first nb values of head kvh in the block,
  // kept in code space: value is [group][CodedStateFloats(kvh).value] (query head g's floats
  // at g * CodedStateFloats(kvh).value) and linear in p, so the online softmax rescales it as
  // it rescales the output.
  virtual void CodedAccumulate(SeqId seq, int64_t block, int kvh, int group, int nb, const float* p,
                               float* value) const {
    (void)seq, (void)block, (void)kvh, (void)group, (void)nb, (void)p, (void)value;
  }
  // acc[g] ([group] rows at stride head_dim) += value[g] expanded to head_dim, for a query of
  // `seq`.
  virtual void ExpandValues(SeqId seq, int kvh, int group, const float* value, float* acc) const {
    (void)seq, (void)kvh, (void)group, (void)value, (void)acc;
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
