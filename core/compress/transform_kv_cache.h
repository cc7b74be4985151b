// The transform-coded KV cache (CPU): full-rank fp16 blocks for the attention sinks and the
// recent window, and every older block stored as the transform codec's codes
// (core/compress/transform_codec.h: mean, PCA basis over all head dims, a per-component uniform
// quantizer of 0-8 bits), one code per layer and KV head for keys and one for values, as
// subspace-calibrate --kv-budget writes them (core/compress/codec_file.h). Keys are coded before
// RoPE when the codec says so (rotated back at coding, rotated again at decoding).
//
// Pool: one BlockPool of pages of one full block ([2][n_kv][B][head_dim] fp16); coded blocks,
// smaller, packed into pages by a SlabAllocator (one class per distinct coded-block size), so
// full and coded blocks draw from one budget. A coded block holds, per KV head, the key codes
// and then (after every head's keys) the value codes, component-major: component a's B codes
// of w_a bits packed least significant bit first in ceil(B w_a / 8) bytes, the components with
// bits one after the other, widest first ([K: h0 (c0 t0..tB-1)(c1 ...) h1 ...][V: ...]), so a
// kernel widens eight tokens' codes of one component at once, with shifts fixed per width.
// Sequences and block tables: the SequenceManager every cache uses.
//
// Policy, at Commit, as the compressed cache's (CompressionPolicy::CompressibleBlocks): blocks
// overlapping the first S tokens stay full; a block is coded once it ends at or before
// length - W; its page is freed before its slot is taken, so coding never needs a free page.
//
// Online refresh (--refresh-method pca; transform_refresh.h): the blocks a sequence codes go to
// the background Refresher, which fits new codes -- basis, quantizers and widths, under the bits
// each stream had -- every T tokens; they become an epoch the sequence codes its next blocks
// with. A block keeps the epoch that coded it and is read with that epoch's tables, so pages
// stay exact across epochs. A sequence keeps at most max_epochs epochs live in a layer: the
// compactor re-codes blocks of its oldest epoch with its current one (decoded and coded again,
// a second rounding), a bounded number per Commit. Epoch 0 is the codec file's.
//
// Attention (the paged attention every paged cache shares, core/kvcache/paged_attention.h)
// reads coded blocks in code space: a value row is linear in its components,
// v = (sum_a c_a u_a + e) * s^-1, so the softmax weights accumulate the components
// (sum_t p_t c_t) and the sum is expanded once per query; keys coded after RoPE are scored as
// (U q s^-1) . c + e . q s^-1, the query projected once. Keys coded before RoPE must be rotated
// to their positions: they are decoded (a small product a block) once per Attend call.
#ifndef SUBSPACE_CORE_COMPRESS_TRANSFORM_KV_CACHE_H_
#define SUBSPACE_CORE_COMPRESS_TRANSFORM_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/base/rope.h"
#include "core/compress/compression_policy.h"
#include "core/compress/refresher.h"
#include "core/compress/transform_codec.h"
#include "core/compress/transform_image.h"
#include "core/kvcache/block_pool.h"
#include "core/kvcache/kv_cache.h"
#include "core/kvcache/sequence_manager.h"

namespace subspace {

struct TransformKvCacheConfig {
  KvCacheGeometry geometry;
  int block_size = 16;  // B tokens per block
  int sink_tokens = CompressionPolicy::kDefaultSinkTokens;
  int window_tokens = CompressionPolicy::kDefaultWindowTokens;
  // The codes of layer l, KV head h at [l * n_kv_heads + h], each of dim head_dim (CodecFile's
  // keys and values).
  std::shared_ptr<const std::vector<TransformCode>> key_codes, value_codes;
  // Set: keys are coded before RoPE with this schedule (CodecFileInfo::pre_rope_keys).
  std::optional<RopeSchedule> key_rope;
  int64_t capacity_bytes = 0;  // pool budget; pages = capacity_bytes / PageBytes
  // Online refresh every new sequence starts with (SetSequenceRefresh changes one sequence's):
  // method kNone or kPca.
  RefreshConfig refresh;
  bool refresh_inline = false;  // refresh on the caller's thread: deterministic (tools, tests)
  int64_t refresh_queue_bytes = int64_t{64} << 20;  // observations beyond are dropped
};

// INVALID_ARGUMENT naming `side` ("key", "value") unless `codes` holds n_layers x n_kv_heads
// codes of dimension head_dim with widths of 0..8 bits: the check of every transform-coded
// cache, on the CPU and on the device.
absl::Status CheckTransformCacheCodes(
    const std::shared_ptr<const std::vector<TransformCode>>& codes, const KvCacheGeometry& geometry,
    const char* side);

// INVALID_ARGUMENT naming the field ("refresh <field>") unless `refresh` is one a
// transform-coded cache runs: none, or pca by token count (every_tokens > 0, no residual
// threshold), with valid fields.
absl::Status CheckTransformRefreshConfig(const RefreshConfig& refresh);

// Beyond KvCacheStats (tests, benchmarks).
struct TransformKvCacheDetail {
  int64_t pages_full = 0;
  int64_t pages_coded = 0;         // slab pages holding coded blocks
  int64_t blocks_coded = 0;        // summed over layers
  int64_t coded_slot_bytes = 0;    // payload of the coded blocks (slab pages minus waste)
  int64_t epochs_live = 0;         // code epochs held (the codec file's included)
  int64_t refreshes_unplaced = 0;  // published codes refused: a layer's blocks outgrew its slot
};

class TransformKvCache final : public KvCache {
 public:
  // INVALID_ARGUMENT for a bad geometry or block size, codes missing or of the wrong count or
  // dim, a key_rope of another dim than head_dim, or a capacity below one page per layer.
  static absl::StatusOr<std::unique_ptr<TransformKvCache>> Create(
      const TransformKvCacheConfig& config);

  // Bytes of one page = one full fp16 block: [2][n_kv_heads][B][head_dim] x 2.
  static int64_t PageBytes(const KvCacheGeometry& geometry, int block_size);
  // Bytes of one coded block of `layer` with the codec file's codes: sum over KV heads and
  // components of the key and value codes of ceil(B x width / 8) bytes (before the slab's
  // 16-byte rounding). A slot's size; refreshed epochs fit in it.
  int64_t CodedBlockBytes(int layer) const;
  // Block-layers the pool could hold at most (its pages, each of the most slots a layer fits):
  // the bound an image's decoded codes are read under.
  int64_t MaxImageBlocks() const;

  const KvCacheGeometry& geometry() const override { return config_.geometry; }
  int block_size() const override { return config_.block_size; }

  absl::StatusOr<SeqId> CreateSequence() override;
  absl::Status FreeSequence(SeqId seq) override;
  int64_t Length(SeqId seq) const override { return seqs_.Length(seq); }
  // New tokens land in full blocks: counted as the paged cache counts them.
  absl::Status Reserve(SeqId seq, int64_t n) override;
  int64_t BlocksNeeded(SeqId seq, int64_t n) const override;
  // k (post-RoPE), v: [n, n_kv_heads, head_dim], stored at fp16; the range must be reserved and
  // not yet coded.
  void Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k, const float* v) override;
  void Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) override;
  // Commits, then codes every full block that has left the window (and the sinks).
  absl::Status Commit(SeqId seq, int64_t length) override;
  // Drops tokens at and past `length`. A coded block cut in the middle is decoded back into a
  // full block (its rows as attention read them, at fp16) so new tokens can follow it;
  // RESOURCE_EXHAUSTED when no page is free for that.
  absl::Status Truncate(SeqId seq, int64_t length) override;

  // Online refresh: INVALID_ARGUMENT for a method other than none and pca or a residual
  // threshold (the transform cache refreshes by count), NOT_FOUND for an unknown sequence.
  absl::Status SetSequenceRefresh(SeqId seq, const RefreshConfig& config) override;

  KvCacheStats Stats() const override;

  // Images (session snapshots, tiers; transform_kv_cache_image.cc): the geometry, the policy and
  // a checksum of the codes in the layout line, then per layer and block either the committed
  // fp16 rows of a full block or a coded block's codes as stored, so a restored sequence
  // continues bitwise. Import takes a full page for every block first (coded ones give theirs
  // back for a slot, as Commit does): RESOURCE_EXHAUSTED when the pool lacks them. A sequence
  // with online refresh goes with its epochs (each block's codes and the current ones); its
  // refresher's statistics do not: the importer's SetSequenceRefresh starts them empty, so its
  // attention is the source's, bitwise, until its next refresh.
  std::string ImageLayout() const override;
  absl::StatusOr<std::string> CompactImage(std::string_view image) const override {
    return image_format_.Compact(image);
  }
  absl::StatusOr<std::string> ExportSequence(SeqId seq) const override;
  absl::StatusOr<SeqId> ImportSequence(std::string_view image) override;
  TransformKvCacheDetail Detail() const;

  // Whether block `block` of `seq` in `layer` is coded (tests).
  bool IsCoded(SeqId seq, int layer, int64_t block) const;
  // The epoch that coded block `block` of `seq` in `layer`; -1 for a full or unknown block.
  int32_t BlockEpoch(SeqId seq, int layer, int64_t block) const;
  // The codes of a live epoch (tests: a block's reconstruction); null for a retired id.
  const TransformCodes* EpochCodes(int32_t epoch) const;
  // Waits until the refresher has processed everything handed to it (tests, tools).
  void FlushRefresher();
  const BlockPool& pool() const { return *pool_; }

 private:
  struct Block {
    int32_t page = -1;  // full block: its page; coded: the slab page
    int32_t slot = -1;  // -1: full block; else the slot index in the slab page
    int32_t epoch = 0;  // coded: the epoch whose codes it holds
  };
  struct EpochUse {
    int32_t epoch = 0;
    int64_t blocks = 0;  // coded blocks of one layer
  };
  struct SequenceState {
    int64_t next_compress = 0;  // first block not yet considered for coding
    int32_t epoch = 0;          // the epoch new blocks are coded with (holds a reference)
    RefreshConfig refresh;
    Refresher::StreamId stream = 0;                 // 0: not observed
    std::vector<std::vector<EpochUse>> epoch_uses;  // [n_layers] epochs of its coded blocks
  };
  using Sequences = SequenceManager<Block, SequenceState>;
  using Sequence = Sequences::Sequence;
  class RowSource;  // the paged attention's view of a layer
  // One code laid out for a block's component-major codes: its components with bits, their
  // quantizers and byte offsets in a head's run of codes, their basis rows stacked [active, d],
  // and what the components without bits and the mean add. A row is
  // x = (sum_a c_a basis_a + ext) * inv_scale with c_a = offset_a + code_a step_a and
  // ext = sum_{0-bit j} offset_j basis_j + mean * scale: TransformCode::Decode's numbers.
  struct DecodeTable {
    std::vector<int> bits;                // [active]
    std::vector<int64_t> byte_at;         // [active] in a head's run of B rows
    std::vector<float> offset, step;      // [active]
    std::vector<float> basis;             // [active, d]
    std::vector<float> ext;               // [d]
    std::vector<float> inv_scale, scale;  // [d] or empty
    const float* mean = nullptr;          // [d], the code's
    int64_t run_bytes = 0;                // one head's codes in a block
    int active() const { return static_cast<int>(bits.size()); }
    static DecodeTable Of(const TransformCode& code, int block_size);
  };

  // One set of codes and what reading and writing them takes. Epoch 0 is the codec file's and
  // is never retired; a refreshed one lives while a sequence codes with it or a block holds it.
  struct CodeEpoch {
    TransformCodes codes;
    std::vector<int64_t> offsets;     // [n_layers][2][n_kv] byte offsets in a coded block
    std::vector<int64_t> bytes;       // [n_layers] bytes of a coded block
    std::vector<DecodeTable> decode;  // [n_layers][2][n_kv], as offsets
    int64_t refs = 0;
  };

  TransformKvCache(const TransformKvCacheConfig& config, std::unique_ptr<BlockPool> pool);

  // The tables of `codes` (already checked against the geometry).
  CodeEpoch MakeEpoch(const TransformCodes& codes) const;
  const CodeEpoch& Epoch(int32_t id) const { return *epochs_[static_cast<size_t>(id)]; }
  // Adds `epoch` under a free id, holding one reference (the caller's).
  int32_t AddEpoch(CodeEpoch epoch);
  void AcquireEpoch(int32_t id) { ++epochs_[static_cast<size_t>(id)]->refs; }
  void ReleaseEpoch(int32_t id);
  // Counts a coded block of `layer` in epoch `id` for `s` (one reference), or drops one.
  void AddBlockUse(SequenceState& s, int layer, int32_t id);
  void DropBlockUse(SequenceState& s, int layer, int32_t id);
  // A sequence starts with epoch 0 and the refresh `refresh` (its stream opened if it has one).
  void StartSequence(SequenceState& s, SeqId seq, const RefreshConfig& refresh);
  void CloseStream(SequenceState& s);
  // Installs the codes the refresher published as the epochs of their sequences.
  void InstallPublished();
  // Re-codes at most `budget` block-layers of `s` so each layer keeps at most max_epochs epochs.
  int64_t Compact(Sequence& s, int64_t budget);
  // The compactor's work per Commit: a decode and an encode of one block-layer each (~0.1 ms at
  // B = 16, d = 64, 2 KV heads), so catching up after a refresh is spread over steps.
  static constexpr int64_t kCompactBlocksPerCommit = 32;
  // Element offsets of row t of head h in a full page: keys, then values after all keys.
  int64_t KOffset(int h, int64_t t) const {
    return (static_cast<int64_t>(h) * config_.block_size + t) * config_.geometry.head_dim;
  }
  int64_t VOffset(int h, int64_t t) const { return v_half_ + KOffset(h, t); }
  uint16_t* FullAt(int32_t page, int64_t offset) {
    return reinterpret_cast<uint16_t*>(pool_->data(page)) + offset;
  }
  const uint16_t* FullAt(int32_t page, int64_t offset) const {
    return reinterpret_cast<const uint16_t*>(pool_->data(page)) + offset;
  }
  // The bytes of head h's key (values = false) or value rows in a coded block of `layer`.
  int64_t CodedOffset(int32_t epoch, int layer, int h, bool values) const {
    return Epoch(epoch).offsets[static_cast<size_t>(
        (layer * 2 + (values ? 1 : 0)) * config_.geometry.n_kv_heads + h)];
  }
  const DecodeTable& Table(int32_t epoch, int layer, bool values, int h) const {
    return Epoch(epoch).decode[static_cast<size_t>(
        (layer * 2 + (values ? 1 : 0)) * config_.geometry.n_kv_heads + h)];
  }
  // The components of rows [0, n) of one head's run of codes, widened: [active][n].
  static void Unpack(const DecodeTable& table, const uint8_t* run, int n, float* out);
  // Decodes rows [0, valid) of every head of one side of a coded block of `epoch` into `out`
  // ([n_kv][B][head_dim] fp32): keys rotated back to their positions when coded pre-RoPE,
  // unless `as_coded` (the rows as they were coded: the compactor's).
  void DecodeRows(int32_t epoch, int layer, const uint8_t* codes, int64_t block, bool values,
                  int valid, float* out, bool as_coded = false) const;
  // Codes the B rows of one head (rows: [B, head_dim] fp32, keys already rotated back) into
  // its run of codes.
  void EncodeRows(const DecodeTable& table, float* rows, uint8_t* run) const;
  // Rotates rows [0, valid) of one head ([valid, head_dim], positions first, first + 1, ...) by
  // the keys' RoPE, from rope_cos_sin_ (which covers every coded position).
  void RotateKeys(float* rows, int valid, int64_t first) const;
  // Grows rope_cos_sin_ to cover positions [0, end) (engine thread, at coding).
  void EnsureRopeTable(int64_t end);
  // Codes full block b of `layer` (every token committed) with `epoch` into
  // out[CodedBlockBytes(layer)]; reads the cache only (Commit runs it on worker threads).
  // `coded`, when set, receives the rows as they were coded (keys before RoPE when the codes
  // say so; [n_kv][B][head_dim] each) for the refresher.
  void CodeBlock(const Block& e, int32_t epoch, int layer, int64_t b, uint8_t* out,
                 BlockObservation* coded) const;
  // Decodes coded block b of `layer` back into a full page (Truncate).
  absl::Status ExpandBlock(Sequence& s, int layer, int64_t b);
  // Frees a block of `layer` of `s` (a coded one drops its epoch use).
  void FreeBlock(SequenceState& s, int layer, Block& e);

  TransformKvCacheConfig config_;
  CompressionPolicy policy_;                // sinks and window: which blocks a Commit codes
  std::optional<RopeSchedule> key_unrope_;  // key_rope's inverse (scale divided out)
  // key_rope's cos and sin (times its scale) per position and pair (cpu::RopeCosSin):
  // [positions][pairs][2]. Decoding rotates every coded key row each step, and a sincos per
  // pair and row cost more than the decoding itself.
  std::vector<float> rope_cos_sin_;
  int64_t v_half_;                    // elements of the K half of a full page: n_kv * B * head_dim
  std::vector<int64_t> coded_bytes_;  // [n_layers] CodedBlockBytes: epoch 0's, the slot sizes
  // By id; null once retired. Attend reads them; only Commit, Truncate and FreeSequence (the
  // engine thread, never during an Attend) add or retire them.
  std::vector<std::unique_ptr<CodeEpoch>> epochs_;
  std::unique_ptr<Refresher> refresher_;  // created with the first stream
  absl::flat_hash_map<Refresher::StreamId, SeqId> streams_;
  int64_t refreshes_installed_ = 0, refreshes_unplaced_ = 0, blocks_recoded_ = 0;
  std::unique_ptr<BlockPool> pool_;
  SlabAllocator slabs_;
  std::vector<int> slab_class_;  // [n_layers]
  Sequences seqs_;
  TransformImageFormat image_format_;  // of this cache's images
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_TRANSFORM_KV_CACHE_H_
