// Compressed paged KV cache (CPU reference): full-rank fp16 (or fp32) blocks for the attention
// sinks and the recent window, low-rank coefficient blocks (fp32/fp16/int8) for everything
// older, and full-rank outlier tokens whose keys the basis represents badly. Attention runs on the
// coefficients with one streaming softmax across all parts (docs/design.md, "The compressed KV
// cache"). See compressed_kv_cache.cc for the pool layout and the policy.
#ifndef SUBSPACE_CORE_COMPRESS_COMPRESSED_KV_CACHE_H_
#define SUBSPACE_CORE_COMPRESS_COMPRESSED_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/base/coeff_codec.h"
#include "core/compress/basis.h"
#include "core/compress/compressed_image.h"
#include "core/compress/compression_epochs.h"
#include "core/compress/compression_policy.h"
#include "core/compress/refresher.h"
#include "core/kvcache/block_pool.h"
#include "core/kvcache/kv_cache.h"
#include "core/kvcache/refresh_config.h"
#include "core/kvcache/sequence_manager.h"

namespace subspace {

struct CompressedKvCacheConfig {
  KvCacheGeometry geometry;
  int block_size = 16;  // B tokens per block, 1..64 (outlier masks are one uint64)
  // Sinks, window, ranks, coefficient dtype, outliers, self-calibration: shared with the device
  // cache. Any coefficient dtype (fp32, fp16, int8).
  CompressionPolicy policy;
  // Full-rank blocks (sinks, window, outliers): kFp16 (as the GPU layout stores them) or kFp32
  // (exactness tests: attention then equals PagedKvCache's at rank = head_dim). Sets the page.
  CoeffDtype full_dtype = CoeffDtype::kFp16;
  int64_t capacity_bytes = 0;  // pool budget; pages = capacity_bytes / PageBytes

  // Online refresh every new sequence starts with (SetSequenceRefresh changes one sequence's).
  RefreshConfig refresh;
  int n_query_heads = 0;        // the model's query heads: KQ-SVD refresh observes queries
  bool refresh_inline = false;  // refresh in the engine thread: deterministic (tools, tests)
  int64_t refresh_queue_bytes = int64_t{64} << 20;  // Refresher::Options::max_queued_bytes
};

// Breakdown beyond KvCacheStats (tests, benchmarks, metrics).
struct CompressedKvCacheDetail {
  int64_t pages_full = 0;
  int64_t pages_compressed = 0;  // slab pages holding coefficient blocks
  int64_t pages_outlier = 0;
  int64_t compressed_slot_bytes = 0;  // payload of the compressed blocks (pages minus waste)
  int64_t blocks_compressed = 0;      // summed over layers
  int64_t outlier_tokens = 0;         // summed over layers
  int64_t outliers_dropped = 0;       // outliers compressed anyway: the pool had no page
  int64_t epochs_live = 0;
  int64_t pca_epochs_built = 0;     // PCA bases computed by this cache (self-calibration)
  int64_t max_sequence_epochs = 0;  // most epochs live in one layer of one sequence
  // Over every block compressed so far: sum ||k - k^||^2 and sum ||k||^2 of its keys (k^ = P_q c,
  // the key a query sees, under the epoch that compressed it). Their ratio is the residual-energy
  // ratio (RER) the cache has actually incurred.
  double key_residual_energy = 0.0;
  double key_energy = 0.0;
  bool default_self_calibrated = false;  // the default epoch is a self-calibrated one
};

class CompressedKvCache final : public KvCache {
 public:
  // INVALID_ARGUMENT for a bad geometry, block size, ranks, full_dtype, a compressed block
  // larger than a page (fp32 coefficients at high rank with fp16 full blocks), or a capacity
  // below one page per layer.
  static absl::StatusOr<std::unique_ptr<CompressedKvCache>> Create(
      const CompressedKvCacheConfig& config);

  // Bytes of one page = one full block: [2][n_kv_heads][B][head_dim] at full_dtype.
  static int64_t PageBytes(const KvCacheGeometry& geometry, int block_size, CoeffDtype full_dtype);
  // Bytes of one compressed block of a layer with ranks (r_k, r_v), before 16-byte rounding:
  // codes [n_kv][B][r_k] + [n_kv][B][r_v], and for int8 fp16 scales [2][n_kv][B].
  static int64_t CompressedBlockBytes(const KvCacheGeometry& geometry, int block_size, int r_k,
                                      int r_v, CoeffDtype dtype);

  const KvCacheGeometry& geometry() const override { return config_.geometry; }
  int block_size() const override { return config_.block_size; }

  absl::StatusOr<SeqId> CreateSequence() override;
  absl::Status FreeSequence(SeqId seq) override;
  int64_t Length(SeqId seq) const override;
  // Reserve and BlocksNeeded count full pages for the new tokens, exactly as the paged cache:
  // new tokens always land in full blocks. Compression at Commit only gives pages back.
  absl::Status Reserve(SeqId seq, int64_t n) override;
  int64_t BlocksNeeded(SeqId seq, int64_t n) const override;

  // k, v: [n, n_kv_heads, head_dim] (post-RoPE k); the range must be reserved and not yet
  // compressed. Stored rounded to full_dtype.
  void Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k, const float* v) override;
  void Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) override;
  // Commits, then compresses every full block that has left the window (and the sinks).
  absl::Status Commit(SeqId seq, int64_t length) override;
  // Drops tokens at and past `length`. A compressed block cut in the middle is expanded back
  // to a full block holding the keys as queries saw them (k^ = P_q c, v^ = R_v^T u), so
  // attention is unchanged (up to rounding k^, v^ to an fp16 full_dtype) and new tokens can
  // be written after it.
  absl::Status Truncate(SeqId seq, int64_t length) override;

  // Starts (or stops, with kNone) online refresh for `seq`. INVALID_ARGUMENT for a bad config
  // (kqsvd without n_query_heads), NOT_FOUND for an unknown sequence. Statistics start empty;
  // blocks already compressed keep their epochs.
  absl::Status SetSequenceRefresh(SeqId seq, const RefreshConfig& config) override;

  KvCacheStats Stats() const override;
  CompressedKvCacheDetail Detail() const;

  // Images (compressed_kv_cache_image.cc): full blocks' committed rows, compressed blocks' codes
  // as stored with their outlier masks and epochs, outlier rows, and every basis the sequence
  // uses. Importing one reuses this cache's default epoch where a basis is bitwise that one and
  // installs the others. A refreshing sequence's image carries its refreshed bases as epochs,
  // not its refresher's statistics: on import, SetSequenceRefresh starts them empty, so its
  // next refresh is fitted on the blocks coded after the move.
  std::string ImageLayout() const override;
  // The format of this cache's images (compressed_image.h), shared with the CUDA backend's cache.
  CompressedImageFormat ImageFormat() const;
  absl::StatusOr<std::string> ExportSequence(SeqId seq) const override;
  absl::StatusOr<SeqId> ImportSequence(std::string_view image) override;
  // Exists from Create when config.refresh enables a method, else from the first sequence that
  // starts refreshing (tests install hooks on it).
  Refresher* refresher() { return epochs_.refresher(); }
  // Installs the epochs the refresher has published (Commit does this too). Tests and tools
  // call it after Refresher::Flush to see every refresh at once.
  void InstallPublishedEpochs();

  // --- Basis epochs ---
  // Registers an external basis (ranks must match the config); the caller holds one reference
  // until ReleaseEpoch.
  absl::StatusOr<EpochId> InstallBasis(std::shared_ptr<const Basis> basis);
  absl::Status ReleaseEpoch(EpochId id);
  // Blocks of `seq` compressed from now on use `id`; older blocks keep theirs.
  absl::Status SetSequenceEpoch(SeqId seq, EpochId id);
  // Epoch new sequences start with, and that sequences still without one pick up when they
  // first compress. While it is kNoEpoch, the first sequence to compress builds epoch 0 by PCA
  // of its own full-rank keys/values and installs it here (self-calibration: the stopgap until
  // the calibration tool's basis file exists; policy.per_sequence_pca keeps one per sequence).
  // An epoch set here explicitly replaces a self-calibrated one and is never replaced by one.
  absl::Status SetDefaultEpoch(EpochId id);
  EpochId default_epoch() const { return epochs_.default_epoch(); }
  EpochId SequenceEpoch(SeqId seq) const;
  const BasisRegistry& registry() const { return epochs_.registry(); }
  const std::vector<int>& r_k() const { return r_k_; }
  const std::vector<int>& r_v() const { return r_v_; }

  // --- Introspection (tests) ---
  bool IsCompressed(SeqId seq, int layer, int64_t block) const;
  EpochId BlockEpoch(SeqId seq, int layer, int64_t block, int kv_head) const;
  // Positions of the outlier tokens of one sequence and layer, ascending.
  std::span<const int64_t> OutlierPositions(SeqId seq, int layer) const;
  const BlockPool& pool() const { return *pool_; }

 private:
  struct BlockEntry {
    int32_t page = -1;      // full block: its page; compressed: the slab page
    int32_t slot = -1;      // -1: full block; else the slot index in the slab page
    uint64_t outliers = 0;  // compressed: bit t set = token t is kept in the outlier store
  };
  struct LiveEpoch {
    EpochId id = kNoEpoch;
    const LayerBasis* basis = nullptr;
    int64_t uses = 0;  // block-heads of this layer coded with it
  };
  // A layer's state beyond its block table (the manager's tables[layer]).
  struct LayerState {
    std::vector<EpochId> block_epochs;   // [blocks, n_kv]; kNoEpoch for full blocks
    std::vector<LiveEpoch> live;         // epochs used by this layer's compressed blocks
    std::vector<int64_t> outlier_pos;    // [outliers] ascending
    std::vector<int32_t> outlier_pages;  // [ceil(outliers / B)] pages of [2][n_kv][B][hd]
  };
  // next_compress, epoch, refresh stream: CompressedSequence; length and block tables (one per
  // layer): the manager's.
  struct SequenceState : CompressedSequence {
    std::vector<LayerState> layers;
  };
  using Sequences = SequenceManager<BlockEntry, SequenceState>;
  using Sequence = Sequences::Sequence;

  // `config` with its policy resolved.
  CompressedKvCache(const CompressedKvCacheConfig& config, std::unique_ptr<BlockPool> pool);

  int64_t KOffset(int h, int64_t t) const {
    return (static_cast<int64_t>(h) * config_.block_size + t) * config_.geometry.head_dim;
  }
  int64_t VOffset(int h, int64_t t) const { return v_half_ + KOffset(h, t); }
  // Full-rank rows in the pool: element `offset` (KOffset / VOffset) of page `page`, stored at
  // full_dtype. Typed views go through these, never through pool_->data's float*.
  uint8_t* FullAt(int32_t page, int64_t offset) {
    return reinterpret_cast<uint8_t*>(pool_->data(page)) + offset * full_bytes_;
  }
  const uint8_t* FullAt(int32_t page, int64_t offset) const {
    return reinterpret_cast<const uint8_t*>(pool_->data(page)) + offset * full_bytes_;
  }
  // n elements between fp32 and full_dtype. src/dst: [n]
  void StoreFull(const float* src, int64_t n, uint8_t* dst) const;
  void LoadFull(const uint8_t* src, int64_t n, float* dst) const;

  // A basis by PCA of the sequence's full-rank keys and values (self-calibration).
  std::shared_ptr<const Basis> PcaOfSequence(const Sequence& s) const;
  void CompressBlock(Sequence& s, int layer, int64_t b);
  // Gives back block b of a layer (entry `e` of its table): its page, or its slot and epochs.
  void FreeEntry(LayerState& ls, int64_t b, BlockEntry& e);
  void AddEpochUse(LayerState& ls, int layer, EpochId id);
  void DropEpochUse(LayerState& ls, EpochId id);
  // Expands compressed block b of a layer back into a full block (Truncate).
  absl::Status Decompress(Sequence& s, int layer, int64_t b);

  // --- Online refresh (compressed_kv_cache_refresh.cc) ---
  // Hands a block just compressed to the refresher. full: [2, n_kv, B, hd] fp32
  void ObserveBlock(const Sequence& s, int layer, const float* full, double residual,
                    double energy);
  void ObserveQueries(int layer, std::span<const AttentionRequest> requests, int n_heads);
  // Compactor: re-projects blocks of the oldest epochs of `s` into its current one until every
  // layer has at most max_epochs live, at most `budget` block-heads per call. Returns the
  // block-heads moved.
  int64_t Compact(Sequence& s, int64_t budget);
  void ReprojectBlockHead(Sequence& s, int layer, int64_t b, int h, EpochId to);

  CompressedKvCacheConfig config_;
  std::vector<int> r_k_, r_v_;   // [n_layers]
  std::vector<int> slab_class_;  // [n_layers] slab class of the layer's compressed blocks
  int64_t v_half_;               // elements of the K half of a full block: n_kv * B * head_dim
  int64_t full_bytes_;           // bytes of one full-rank element: 4 (fp32) or 2 (fp16)
  std::unique_ptr<BlockPool> pool_;
  SlabAllocator slabs_;
  CompressionEpochs epochs_;  // registry, default epoch, refresh streams
  Sequences seqs_;
  int64_t outliers_dropped_ = 0;
  std::vector<float> page_scratch_;  // [2 * v_half_] fp32 full block: compression / expansion

  int64_t refreshes_installed_ = 0;
  double key_residual_sum_ = 0.0, key_energy_sum_ = 0.0;
  int64_t blocks_reprojected_ = 0;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_COMPRESSED_KV_CACHE_H_
