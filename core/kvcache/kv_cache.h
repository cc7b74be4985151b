// The KV-cache interface the model writes keys/values into and attends over, and the shared
// types of its implementations: full-rank paged (core/kvcache/paged_kv_cache.h), compressed
// (core/compress/compressed_kv_cache.h) and their device twins (cuda/). Every one keeps its
// sequences and block tables in a SequenceManager (sequence_manager.h). A host cache owns its
// attention: a compressed cache attends in coefficient space without expanding keys.
#ifndef SUBSPACE_CORE_KVCACHE_KV_CACHE_H_
#define SUBSPACE_CORE_KVCACHE_KV_CACHE_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/kvcache/refresh_config.h"

namespace subspace {

using SeqId = int32_t;

struct KvCacheGeometry {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
};

// Online basis refresh (compressed cache only; zero elsewhere). Cumulative since start.
struct BasisRefreshStats {
  // Upper bounds (seconds) of the refresh-latency histogram buckets; the last is +inf.
  static constexpr std::array<double, 8> kLatencyBounds = {0.001, 0.005, 0.01, 0.05,
                                                           0.1,   0.5,   1.0,  5.0};
  int64_t refreshes = 0;             // new epochs computed
  int64_t failures = 0;              // refreshes that produced no epoch
  int64_t observations_dropped = 0;  // blocks the refresher never saw: its queue was full
  int64_t installed = 0;             // epochs the cache switched a sequence to
  int64_t blocks_reprojected = 0;    // block-heads the compactor moved to a newer epoch
  int64_t streams = 0;               // sequences tracked now
  double latency_seconds_sum = 0.0;
  std::array<int64_t, kLatencyBounds.size() + 1> latency_counts{};  // per bucket, not cumulative
};

struct KvCacheStats {
  int64_t bytes_total = 0;  // pool capacity, allocated once
  int64_t bytes_used_full = 0;
  int64_t bytes_used_compressed = 0;
  int64_t bytes_used_outlier = 0;
  // What the cached tokens would take full-rank at fp16: tokens_cached * n_layers * 2 (k, v)
  // * n_kv_heads * head_dim * 2 bytes; effective compression ratio = this / bytes used.
  // Below 1 for the fp32 full-rank cache (0.5), above 1 once blocks are compressed.
  int64_t bytes_full_fp16_equivalent = 0;
  int64_t blocks_total = 0;
  int64_t blocks_free = 0;
  int64_t tokens_cached = 0;  // summed over sequences (not layers)
  int32_t sequences = 0;
  int64_t epochs_live = 0;  // basis epochs registered (compressed cache)
  BasisRefreshStats refresh;
};

// One sequence's queries for one layer's attention. Query i sits at position pos + i and
// attends causally to cached tokens [0, pos + i]; its own K/V must already be written.
struct AttentionRequest {
  SeqId seq = -1;
  int64_t pos = 0;
  int64_t n = 0;
  const float* q = nullptr;  // [n, n_heads, head_dim], post-RoPE
  float* out = nullptr;      // [n, n_heads, head_dim]
  // Sliding-window attention: > 0, the query at position p attends positions
  // (p - window, p] only (Mistral's and Phi-3's window, llama.cpp's "standard" SWA); 0, all of
  // [0, p].
  int64_t window = 0;
  // The first position the query at position p attends.
  int64_t FirstAttended(int64_t p) const {
    return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
  }
};

class KvCache;

// A KV cache's sequences, blocks and accounting, wherever its bytes live: what the engine and
// the scheduler use (admission, reservation, commit, truncation, stats). Called from one thread
// (the engine's step loop). The bytes are written and attended by the backend that owns them:
// KvCache below for caches in host memory (the CPU backend calls Write and Attend); device
// caches (cuda/device_paged_kv_cache.h) are written and read by the CUDA backend's kernels.
class KvCacheBase {
 public:
  virtual ~KvCacheBase() = default;

  virtual const KvCacheGeometry& geometry() const = 0;
  virtual int block_size() const = 0;

  virtual absl::StatusOr<SeqId> CreateSequence() = 0;
  // NOT_FOUND for an unknown id. Frees every block of the sequence.
  virtual absl::Status FreeSequence(SeqId seq) = 0;
  // Tokens committed for `seq` (0 for an unknown id).
  virtual int64_t Length(SeqId seq) const = 0;
  // Ensures blocks for tokens [0, Length(seq) + n) in every layer. RESOURCE_EXHAUSTED
  // (and nothing changed) when the pool has too few free blocks.
  virtual absl::Status Reserve(SeqId seq, int64_t n) = 0;
  // Blocks needed beyond those held to Reserve `n` more tokens (admission control).
  virtual int64_t BlocksNeeded(SeqId seq, int64_t n) const = 0;
  // Marks tokens [0, length) as complete in every layer (after the step wrote all layers).
  virtual absl::Status Commit(SeqId seq, int64_t length) = 0;
  // Drops tokens at and past `length`, freeing whole blocks past it.
  virtual absl::Status Truncate(SeqId seq, int64_t length) = 0;

  // Online basis refresh for one sequence from now on (the compressed cache overrides it).
  // Caches without bases accept only RefreshMethod::kNone: FAILED_PRECONDITION otherwise.
  virtual absl::Status SetSequenceRefresh(SeqId seq, const RefreshConfig& config) {
    (void)seq;
    if (config.method == RefreshMethod::kNone) return absl::OkStatus();
    return absl::FailedPreconditionError("online basis refresh needs the compressed KV cache");
  }

  virtual KvCacheStats Stats() const = 0;

  // This cache as one in host memory (the CPU backend writes and attends through it); null for
  // a cache whose bytes live on a device.
  virtual KvCache* AsHostCache() { return nullptr; }

  // --- Images (session snapshots: core/engine/session_snapshot.h) ---
  // What an image of this cache depends on (kind, geometry, block size, storage types, policy)
  // as one line; images import only into a cache with the same line. Empty: no images.
  virtual std::string ImageLayout() const { return {}; }
  // The stored bytes of `seq`'s committed tokens, exactly (sequence_image.h): importing them
  // gives a sequence whose attention is bitwise the original's (online refresh included: its
  // epochs go with it, its statistics do not). NOT_FOUND for an unknown id; UNIMPLEMENTED where
  // the cache has no images.
  virtual absl::StatusOr<std::string> ExportSequence(SeqId seq) const {
    (void)seq;
    return absl::UnimplementedError("this KV cache cannot export a sequence");
  }
  // `image` (an ExportSequence of a cache with this ImageLayout) in its storage form: smaller,
  // slower to make, for disk and the network (the transform-coded caches range-code their
  // codes); ImportSequence takes both forms. Thread-safe: it may run beside any other call.
  // Default: the image as it is.
  virtual absl::StatusOr<std::string> CompactImage(std::string_view image) const {
    return std::string(image);
  }
  // A new sequence from an image of a cache with this ImageLayout. DATA_LOSS for a corrupt
  // image, FAILED_PRECONDITION for another layout or for state this cache cannot hold (the
  // CUDA caches: blocks decided per layer, refreshed transform codes), RESOURCE_EXHAUSTED when
  // the pool is short; nothing changes on failure.
  virtual absl::StatusOr<SeqId> ImportSequence(std::string_view image) {
    (void)image;
    return absl::UnimplementedError("this KV cache cannot import a sequence");
  }
};

// A KV cache in host memory: the CPU backend writes keys/values and attends through it.
// Thread-safety: Write and Attend may run concurrently for different sequences; everything
// else is called from one thread (the engine's step loop).
class KvCache : public KvCacheBase {
 public:
  KvCache* AsHostCache() final { return this; }

  // Stores keys (post-RoPE) and values of tokens [pos, pos + n) for `layer`; the range must
  // be reserved.   k, v: [n, n_kv_heads, head_dim]
  virtual void Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k,
                     const float* v) = 0;
  // Scaled-dot-product attention (scale 1/sqrt(head_dim)) with GQA: query head h reads KV
  // head h / (n_heads / n_kv_heads). Parallel inside over requests, heads and queries.
  virtual void Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) = 0;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_KVCACHE_KV_CACHE_H_
