// The basis epochs and refresh streams of a compressed KV cache's sequences: the bookkeeping the
// CPU cache (CompressedKvCache) and the device cache (DeviceCompressedKvCache) share. It holds
// the epoch registry, the default epoch (installed, or self-calibrated from the first sequence
// that compresses: CompressionPolicy says how), each sequence's epoch reference and its online-
// refresh stream. Where an epoch's bytes live is the cache's business: the device cache loads a
// registered basis into a table entry (`on_register`) and frees the entry when the last reference
// goes (`on_retire`).
#ifndef SUBSPACE_CORE_COMPRESS_COMPRESSION_EPOCHS_H_
#define SUBSPACE_CORE_COMPRESS_COMPRESSION_EPOCHS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/compress/basis.h"
#include "core/compress/compression_policy.h"
#include "core/compress/refresher.h"
#include "core/kvcache/kv_cache.h"
#include "core/kvcache/refresh_config.h"

namespace subspace {

// What every compressed cache keeps of a sequence besides its blocks and length (which its
// SequenceManager holds). A cache's own per-sequence state derives from it.
struct CompressedSequence {
  int64_t next_compress = 0;  // first block not yet considered for compression
  EpochId epoch = kNoEpoch;   // the epoch new blocks are coded with; holds one reference
  RefreshConfig refresh;
  Refresher::StreamId stream = 0;  // 0: not observed by the refresher
};

// The checks both compressed caches' Create make beyond the policy: a positive geometry, a
// block size in [1, 64] (an outlier mask is one uint64), a valid refresh, n_query_heads a
// multiple of n_kv_heads, and kqsvd refresh only with query heads (else INVALID_ARGUMENT
// `kqsvd_refused`, which says why this cache has none).
absl::Status ValidateCompressedCacheSetup(const KvCacheGeometry& geometry, int block_size,
                                          const RefreshConfig& refresh, int n_query_heads,
                                          std::string_view kqsvd_refused);

class CompressionEpochs {
 public:
  struct Options {
    KvCacheGeometry geometry;
    CompressionPolicy policy;  // resolved (ResolvePolicy): ranks per layer
    int n_query_heads = 0;     // the model's; kqsvd refresh observes queries
    Refresher::Options refresher;
    // Called when an epoch is registered, before anyone can use it; an error unregisters it.
    std::function<absl::Status(EpochId, const Basis&)> on_register;
    // Called when the last reference to an epoch goes.
    std::function<void(EpochId)> on_retire;
  };

  explicit CompressionEpochs(Options options);

  const BasisRegistry& registry() const { return registry_; }
  const Basis* Get(EpochId id) const { return registry_.Get(id); }

  // Registers `basis` (its shapes are the caller's to check) with one reference for the caller.
  absl::StatusOr<EpochId> Register(std::shared_ptr<const Basis> basis);
  // A basis from outside: INVALID_ARGUMENT unless it matches the geometry and ranks.
  absl::StatusOr<EpochId> Install(std::shared_ptr<const Basis> basis);
  // An image's epochs (compressed_image.h) as this cache's, one reference each for the caller:
  // the default epoch where bitwise equal to it, else installed. On a failure (a basis that
  // does not match, no room for one) nothing is held.
  absl::StatusOr<std::vector<EpochId>> Adopt(std::span<const std::shared_ptr<const Basis>> bases);
  absl::Status Acquire(EpochId id) { return registry_.Acquire(id); }
  void Release(EpochId id);
  // Release for callers from outside: NOT_FOUND for an unknown epoch.
  absl::Status ReleaseChecked(EpochId id);

  // The epoch new sequences start with; an explicit one replaces a self-calibrated one.
  absl::Status SetDefault(EpochId id);
  EpochId default_epoch() const { return default_epoch_; }
  bool default_self_calibrated() const { return default_self_calibrated_; }
  int64_t pca_epochs_built() const { return pca_epochs_built_; }

  // A new sequence: the default epoch (if any) and the cache's refresh.
  void StartSequence(CompressedSequence& s, const RefreshConfig& refresh);
  // A freed sequence: its stream closed, its epoch reference released.
  void EndSequence(CompressedSequence& s);
  // Blocks of `s` coded from now on use `id`.
  absl::Status SetSequenceEpoch(CompressedSequence& s, EpochId id);
  // Gives `s` an epoch before its first compression: the default, or else (and always with
  // per_sequence_pca) a basis `pca` builds from the sequence, which becomes the default unless
  // per_sequence_pca.
  absl::Status EnsureEpoch(CompressedSequence& s,
                           absl::FunctionRef<absl::StatusOr<std::shared_ptr<const Basis>>()> pca);

  // --- Online refresh ---
  Refresher* refresher() { return refresher_.get(); }
  const Refresher* refresher() const { return refresher_.get(); }
  void EnsureRefresher();
  // Starts observing `s` once it refreshes and has an epoch; no-op otherwise or when open.
  void OpenStream(CompressedSequence& s, SeqId seq);
  void CloseStream(CompressedSequence& s);
  bool has_streams() const { return !streams_.empty(); }
  // The sequence a stream observes; -1 when it was closed since.
  SeqId StreamSequence(Refresher::StreamId stream) const;

 private:
  Options options_;
  BasisRegistry registry_;
  EpochId default_epoch_ = kNoEpoch;
  bool default_self_calibrated_ = false;
  int64_t pca_epochs_built_ = 0;
  std::unique_ptr<Refresher> refresher_;  // created with the first stream
  absl::flat_hash_map<Refresher::StreamId, SeqId> streams_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_COMPRESSION_EPOCHS_H_
