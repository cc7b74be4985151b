// The compressed KV cache in device memory (the CUDA backend's --kv-cache=compressed): the CPU
// reference's policy (core/compress/compressed_kv_cache.h: full-rank sinks and window, older blocks
// coded into low-rank coefficients with the sequence's basis epoch, a self-calibrated default
// epoch) over the layout the kernels read (kernels/kv_layout.h). The bytes live in a
// CompressedKvStore; this class holds the host bookkeeping and tells the store what to do.
//
// One block table per sequence serves every layer, as in DevicePagedKvCache: the policy is the
// same in every layer (a block leaves the window at the same step everywhere, with the same
// epoch), so block b of a sequence is full page p, or slot s of slab page p, in every layer's
// slice. The slab class is the largest compressed block over the layers; a layer with smaller
// blocks addresses slot s at s * its own slot_bytes, inside the page all the same. One decode
// plan thus serves all layers.
//
// Compression is queued at Commit and issued by Flush as one batch (the backend flushes after
// its step's commits; every other mutating call flushes first). The queued blocks' full pages
// are freed only at Flush, after the batch is issued: a slot of the batch never lies in one of
// its source pages (CheckCompressBatch), and the store's stream order keeps a freed page from
// being rewritten before it has been read. So compression does need a free page now and then:
// Reserve leaves one page of headroom, and Commit flushes early when the slabs run out.
//
// Online refresh (pca, oja, fd) runs as on the CPU: the blocks a Flush compresses for refreshing
// sequences are read back (one asynchronous copy in flight, polled at each Flush, never waited
// for) and handed, still fp16, to the Refresher's thread; its new epochs are loaded into free
// basis-table entries at the sequence's next Commit. The compactor keeps at most
// refresh.max_epochs epochs among a sequence's coded blocks: Flush re-codes blocks of its oldest
// epoch into the current one in place (recode_blocks: the CPU compactor's exact r x r maps; no
// page is needed), a whole block, every KV head, at once. kqsvd also needs the queries: the
// backend reads back the query rows of the sequences that WantsQueries names (all of them, or an
// even, weighted subset when its buffer is short) and hands them over with ObserveQueries.
//
// Outlier tokens (outlier_threshold < 1): the compression kernel flags the tokens whose key
// residual exceeds the threshold, and Flush waits for those masks (a few bytes, behind the
// step's last kernels) to move the flagged tokens full-rank into the sequence's outlier pages,
// B to a page in position order, before their source pages go. As everything else here, one
// decision serves every layer: a token is an outlier in all layers when it is one in any (the
// CPU cache decides per layer), since a page id spans every layer's slice and one decode plan
// serves them all. Expanding a block (Truncate, the prefill scratch) puts its outliers back.
#ifndef SUBSPACE_CUDA_DEVICE_COMPRESSED_KV_CACHE_H_
#define SUBSPACE_CUDA_DEVICE_COMPRESSED_KV_CACHE_H_

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
#include "core/kvcache/sequence_manager.h"
#include "cuda/compressed_kv_store.h"
#include "cuda/decode_plan_builder.h"
#include "cuda/device_kv_cache.h"
#include "kernels/kv_layout.h"

namespace subspace::cuda {

struct DeviceCompressedKvCacheConfig {
  KvCacheGeometry geometry;
  int block_size = 16;  // B, 1..64
  // The CPU cache's policy (core/compress/compression_policy.h), coefficients in fp16 or int8 (the
  // kernels' codes). Outliers: see above (one decision for every layer).
  CompressionPolicy policy;
  int64_t num_pages = 0;  // pages in each layer's slice of the store's pool
  // Online refresh every new sequence starts with (SetSequenceRefresh changes one sequence's).
  RefreshConfig refresh;
  bool refresh_inline = false;  // refresh on the caller's thread: deterministic (tests)
  int64_t refresh_queue_bytes = int64_t{64} << 20;  // Refresher::Options::max_queued_bytes
  // The model's query heads, when the backend reads queries back for kqsvd refresh; 0 refuses
  // kqsvd. A multiple of n_kv_heads.
  int n_query_heads = 0;
};

// Beyond KvCacheStats (tests, benchmarks, the start-up log).
struct DeviceCompressedKvCacheDetail {
  int64_t pages_full = 0;             // per layer
  int64_t pages_compressed = 0;       // slab pages, per layer
  int64_t blocks_compressed = 0;      // per layer
  int64_t compressions_deferred = 0;  // blocks left full for a while: no page for a slab
  int64_t pca_epochs_built = 0;
  int64_t basis_entries_used = 0;
  bool default_self_calibrated = false;
  int64_t refreshes_unplaced = 0;  // new epochs dropped: every basis-table entry in use
  int64_t blocks_unobserved = 0;   // refreshing sequences' blocks not read back (busy)
  int64_t blocks_recoded = 0;      // blocks the compactor moved to a newer epoch
  int64_t pages_outlier = 0;       // per layer
  int64_t outlier_tokens = 0;      // of live sequences (every layer holds each)
  int64_t outliers_dropped = 0;    // outliers compressed anyway: the pool had no page
};

class DeviceCompressedKvCache final : public DeviceKvCache {
 public:
  // One block table entry: a full page (slot kFullBlock, entry -1), or a slab slot coded with
  // basis-table entry `entry` (every KV head alike: no compactor mixes them) whose tokens
  // `outliers` (bit t: token t) are read from the sequence's outlier pages instead.
  struct Block {
    int32_t page = -1;
    int32_t slot = kernels::kFullBlock;
    int32_t entry = -1;
    uint64_t outliers = 0;
  };
  // Where a compressed block's outliers sit, as OutlierBatch addresses them.
  struct BlockOutliers {
    uint64_t mask = 0;
    int32_t first_slot = 0;
    int32_t pages[2] = {-1, -1};
  };

  // INVALID_ARGUMENT for a bad geometry, block size, ranks or dtype, a compressed block larger
  // than a page, or fewer than two pages (one holds the compression headroom).
  static absl::StatusOr<std::unique_ptr<DeviceCompressedKvCache>> Create(
      const DeviceCompressedKvCacheConfig& config, std::shared_ptr<CompressedKvStore> store);

  const KvCacheGeometry& geometry() const override { return config_.geometry; }
  int block_size() const override { return config_.block_size; }
  absl::StatusOr<SeqId> CreateSequence() override;
  absl::Status FreeSequence(SeqId seq) override;
  int64_t Length(SeqId seq) const override;
  // New tokens land in full pages, as in the CPU cache; one page is held back for compression.
  absl::Status Reserve(SeqId seq, int64_t n) override;
  int64_t BlocksNeeded(SeqId seq, int64_t n) const override;
  // Commits, then queues every full block that has left the window (and the sinks) for
  // compression. The first sequence to compress without a default epoch reads its keys and
  // values back and builds one by PCA.
  absl::Status Commit(SeqId seq, int64_t length) override;
  // A compressed block cut in the middle is expanded back into a full page (the keys as queries
  // saw them) so that new tokens can be written after it. RESOURCE_EXHAUSTED when no page is
  // free for it (nothing changed then).
  absl::Status Truncate(SeqId seq, int64_t length) override;
  absl::Status SetSequenceRefresh(SeqId seq, const RefreshConfig& config) override;
  KvCacheStats Stats() const override;
  DeviceCompressedKvCacheDetail Detail() const;

  // Issues the queued compressions to the store and frees their full pages; hands landed
  // readbacks to the refresher and starts the next; runs the compactor.
  absl::Status Flush() override;

  // Images (session snapshots, tiers, Export; device_compressed_kv_cache_image.cc): the CPU
  // compressed cache's format and layout line with fp16 full blocks, so a session moves between
  // a CPU and a GPU server. Export flushes first and copies the sequence's pages and slots out
  // (between two steps: it waits for the store). Import reads and checks the whole image before
  // it takes a page; FAILED_PRECONDITION for an image whose blocks are decided differently
  // across layers or KV heads (a CPU cache may do that, this one cannot hold it),
  // RESOURCE_EXHAUSTED when the pool or the basis tables lack room. A refreshing sequence goes
  // with its epochs; its refresher's statistics start empty on the target.
  CompressedImageFormat ImageFormat() const;
  std::string ImageLayout() const override;
  absl::StatusOr<std::string> ExportSequence(SeqId seq) const override;
  absl::StatusOr<SeqId> ImportSequence(std::string_view image) override;

  // --- Basis epochs (as CompressedKvCache's) ---
  // RESOURCE_EXHAUSTED when the store's basis tables are full; INVALID_ARGUMENT for a basis
  // that does not match the geometry and ranks. The caller holds one reference.
  absl::StatusOr<EpochId> InstallBasis(std::shared_ptr<const Basis> basis);
  absl::Status ReleaseEpoch(EpochId id);
  absl::Status SetDefaultEpoch(EpochId id);
  EpochId default_epoch() const { return epochs_.default_epoch(); }
  const BasisRegistry& registry() const { return epochs_.registry(); }
  // The basis-table entry of a live epoch; -1 for an unknown one.
  int32_t EpochEntry(EpochId id) const;

  // --- The CUDA backend's view ---
  // Layer `layer`'s geometry (its ranks and slot size).
  const kernels::KvPoolLayout& layout(int layer) const {
    return layouts_[static_cast<size_t>(layer)];
  }
  // The layout whose slots are largest: the one every slot index fits (decode plan checks).
  const kernels::KvPoolLayout& plan_layout() const {
    return layouts_[static_cast<size_t>(widest_layer_)];
  }
  int64_t num_pages() const { return config_.num_pages; }
  const std::vector<int>& r_k() const { return r_k_; }
  const std::vector<int>& r_v() const { return r_v_; }
  // Blocks of `seq` in position order; empty for an unknown id.
  std::span<const Block> BlockTable(SeqId seq) const;
  // DeviceKvCache: the block table's entry with its outliers' addresses; every layer alike.
  DeviceBlockRef BlockOf(SeqId seq, int64_t b) const override;
  void DescribeDecode(SeqId seq, int64_t length, DecodeSeqDesc* desc) const override;
  DecodePlanBounds plan_bounds() const override {
    return {.layout = plan_layout(),
            .num_pages = config_.num_pages,
            .num_basis_epochs = store_->basis_capacity()};
  }
  // The epoch `seq` codes new blocks with (kNoEpoch before its first compression).
  EpochId SequenceEpoch(SeqId seq) const;
  // Positions of `seq`'s outlier tokens, ascending, and the pages holding them (B to a page).
  std::span<const int64_t> OutlierPositions(SeqId seq) const;
  std::span<const int32_t> OutlierPages(SeqId seq) const;
  // Block b's outliers (mask 0: none, or not a compressed block of `seq`).
  BlockOutliers OutliersOf(SeqId seq, int64_t b) const;
  Refresher* refresher() { return epochs_.refresher(); }  // null until a sequence refreshes
  // Whether `seq` refreshes by kqsvd now and wants its queries (from its first compression on).
  bool WantsQueries(SeqId seq) const override;
  // Queries of `seq` for its refresher: every layer's rows of one step, still fp16
  // ([n_layers, n, n_query_heads * head_dim]). NOT_FOUND for an unknown sequence,
  // FAILED_PRECONDITION when it does not want them, INVALID_ARGUMENT for other shapes.
  absl::Status ObserveQueries(SeqId seq, HalfQueryObservation queries) override;

 private:
  // next_compress, epoch, refresh stream: CompressedSequence; length and the block table (one
  // for every layer, tables[0]): the manager's.
  struct SequenceState : CompressedSequence {
    std::vector<EpochId> block_epochs;  // [blocks] kNoEpoch for full blocks; one ref each
    absl::flat_hash_map<EpochId, int64_t> coded_blocks;  // epoch -> blocks coded with it
    std::vector<int64_t> outlier_pos;                    // [outliers] ascending
    std::vector<int32_t> outlier_pages;                  // [ceil(outliers / B)]
  };
  using Sequences = SequenceManager<Block, SequenceState>;
  using Sequence = Sequences::Sequence;

  // Pages Reserve leaves free so that Commit can open a slab page before it frees the queued
  // blocks' full pages at Flush.
  static constexpr int64_t kCompressionHeadroom = 1;

  // `config` with its policy resolved.
  DeviceCompressedKvCache(const DeviceCompressedKvCacheConfig& config,
                          std::unique_ptr<BlockPool> pool,
                          std::shared_ptr<CompressedKvStore> store);

  absl::StatusOr<std::shared_ptr<const Basis>> PcaOfSequence(const Sequence& s);
  // epochs_'s hooks: a registered epoch is loaded into a free basis-table entry
  // (RESOURCE_EXHAUSTED when none is free); a retired one gives its entry back.
  absl::Status LoadEpoch(EpochId id, const Basis& basis);
  void RetireEpoch(EpochId id);
  // false: no slab slot to be had (the block stays full for now).
  absl::StatusOr<bool> QueueCompression(Sequence& s, SeqId seq, int64_t b);
  void FreeBlock(Sequence& s, int64_t b);
  absl::Status ExpandBlock(Sequence& s, int64_t b);
  BlockOutliers OutliersOf(const Sequence& s, int64_t b) const;
  // Gives each flagged token of the batch just issued a slot in its sequence's outlier pages
  // and moves it there from the block's source page (still held).
  absl::Status PlaceOutliers();
  // Drops the outliers at positions >= `from` and the pages they leave empty.
  void DropOutliers(Sequence& s, int64_t from);

  // Refresh (device_compressed_kv_cache_refresh.cc).
  void InstallPublishedEpochs();
  // Starts reading back the queued blocks of refreshing sequences (before they are issued).
  absl::Status StartObservations();
  // Hands a landed readback to the refresher.
  absl::Status PollObservations();
  // Re-codes up to a budget of blocks of queued sequences' oldest epochs.
  absl::Status Compact();
  bool NeedsCompaction(const Sequence& s) const;
  void QueueCompaction(const Sequence& s, SeqId seq);

  DeviceCompressedKvCacheConfig config_;
  std::vector<int> r_k_, r_v_;
  std::vector<kernels::KvPoolLayout> layouts_;  // [n_layers]
  int widest_layer_ = 0;
  std::unique_ptr<BlockPool> pool_;  // page ids only: the bytes are the store's
  SlabAllocator slabs_;
  int slab_class_ = 0;
  std::shared_ptr<CompressedKvStore> store_;

  absl::flat_hash_map<EpochId, int32_t> entries_;  // live epoch -> basis-table entry
  std::vector<int32_t> free_entries_;
  CompressionEpochs epochs_;  // registry, default epoch, refresh streams; after the entries

  Sequences seqs_;
  int64_t blocks_compressed_ = 0;
  int64_t compressions_deferred_ = 0;

  // Queued compressions (CompressBatch) and the full pages they free once issued; per block
  // also its sequence's refresher stream (0: none) and epoch, for the readback.
  std::vector<int32_t> pending_src_, pending_dst_page_, pending_dst_slot_, pending_epoch_;
  std::vector<Refresher::StreamId> pending_stream_;
  std::vector<EpochId> pending_epoch_id_;
  std::vector<SeqId> pending_seq_;
  std::vector<int64_t> pending_block_;
  std::vector<uint64_t> pending_outliers_;  // the masks Compress fills
  int64_t outlier_tokens_ = 0;
  int64_t outliers_dropped_ = 0;

  std::vector<HalfBlockBatch::Block> readback_blocks_;  // the readback in flight; empty: none
  std::vector<SeqId> compact_;                          // sequences with too many epochs
  int64_t refreshes_installed_ = 0;
  int64_t refreshes_unplaced_ = 0;
  int64_t blocks_unobserved_ = 0;
  int64_t blocks_recoded_ = 0;
};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_DEVICE_COMPRESSED_KV_CACHE_H_
