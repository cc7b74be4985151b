#include "core/compress/compression_epochs.h"

#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/compress/online_statistics.h"
#include "core/kvcache/sequence_manager.h"

namespace subspace {

absl::Status ValidateCompressedCacheSetup(const KvCacheGeometry& g, int block_size,
                                          const RefreshConfig& refresh, int n_query_heads,
                                          std::string_view kqsvd_refused) {
  if (absl::Status st = CheckKvGeometry(g); !st.ok()) return st;
  if (block_size < 1 || block_size > 64) {
    return absl::InvalidArgumentError(
        absl::StrFormat("block_size must be in [1, 64], got %d", block_size));
  }
  if (absl::Status st = ValidateRefreshConfig(refresh); !st.ok()) return st;
  if (n_query_heads < 0 || n_query_heads % g.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "n_query_heads %d is not a multiple of n_kv_heads %d", n_query_heads, g.n_kv_heads));
  }
  if (refresh.method == RefreshMethod::kKqsvd && n_query_heads == 0) {
    return absl::InvalidArgumentError(std::string(kqsvd_refused));
  }
  return absl::OkStatus();
}

CompressionEpochs::CompressionEpochs(Options options) : options_(std::move(options)) {}

absl::StatusOr<EpochId> CompressionEpochs::Register(std::shared_ptr<const Basis> basis) {
  const Basis& b = *basis;
  const EpochId id = registry_.Register(std::move(basis));
  if (options_.on_register) {
    if (absl::Status st = options_.on_register(id, b); !st.ok()) {
      registry_.Release(id);  // never handed out: nothing to retire
      return st;
    }
  }
  return id;
}

absl::StatusOr<EpochId> CompressionEpochs::Install(std::shared_ptr<const Basis> basis) {
  if (basis == nullptr) return absl::InvalidArgumentError("null basis");
  if (absl::Status st =
          ValidateBasis(*basis, options_.geometry, options_.policy.r_k, options_.policy.r_v);
      !st.ok()) {
    return st;
  }
  return Register(std::move(basis));
}

absl::StatusOr<std::vector<EpochId>> CompressionEpochs::Adopt(
    std::span<const std::shared_ptr<const Basis>> bases) {
  std::vector<EpochId> ids;
  const Basis* fallback = default_epoch_ == kNoEpoch ? nullptr : Get(default_epoch_);
  for (const std::shared_ptr<const Basis>& basis : bases) {
    absl::StatusOr<EpochId> id = default_epoch_;
    if (fallback != nullptr && SameBasisMatrices(*basis, *fallback)) {
      (void)Acquire(default_epoch_);
    } else {
      id = Install(basis);
    }
    if (!id.ok()) {
      for (EpochId held : ids) Release(held);
      return id.status();
    }
    ids.push_back(*id);
  }
  return ids;
}

void CompressionEpochs::Release(EpochId id) {
  registry_.Release(id);
  if (options_.on_retire && registry_.Get(id) == nullptr) options_.on_retire(id);
}

absl::Status CompressionEpochs::ReleaseChecked(EpochId id) {
  if (registry_.Get(id) == nullptr) {
    return absl::NotFoundError(absl::StrFormat("unknown basis epoch %d", id));
  }
  Release(id);
  return absl::OkStatus();
}

absl::Status CompressionEpochs::SetDefault(EpochId id) {
  if (id != kNoEpoch) {
    if (absl::Status st = registry_.Acquire(id); !st.ok()) return st;
  }
  if (default_epoch_ != kNoEpoch) Release(default_epoch_);
  default_epoch_ = id;
  default_self_calibrated_ = false;
  return absl::OkStatus();
}

void CompressionEpochs::StartSequence(CompressedSequence& s, const RefreshConfig& refresh) {
  s.next_compress = 0;
  s.epoch = default_epoch_;  // an installed one, even with per_sequence_pca
  if (s.epoch != kNoEpoch) (void)registry_.Acquire(s.epoch);
  s.refresh = refresh;
  s.stream = 0;
}

void CompressionEpochs::EndSequence(CompressedSequence& s) {
  CloseStream(s);
  if (s.epoch != kNoEpoch) Release(s.epoch);
  s.epoch = kNoEpoch;
}

absl::Status CompressionEpochs::SetSequenceEpoch(CompressedSequence& s, EpochId id) {
  if (absl::Status st = registry_.Acquire(id); !st.ok()) return st;
  if (s.epoch != kNoEpoch) Release(s.epoch);
  s.epoch = id;
  return absl::OkStatus();
}

absl::Status CompressionEpochs::EnsureEpoch(
    CompressedSequence& s, absl::FunctionRef<absl::StatusOr<std::shared_ptr<const Basis>>()> pca) {
  if (s.epoch != kNoEpoch) return absl::OkStatus();
  const bool shared = !options_.policy.per_sequence_pca;
  if (shared && default_epoch_ != kNoEpoch) {
    // Created before the default existed (or before it was self-calibrated).
    if (absl::Status st = registry_.Acquire(default_epoch_); !st.ok()) return st;
    s.epoch = default_epoch_;
    return absl::OkStatus();
  }
  absl::StatusOr<std::shared_ptr<const Basis>> basis = pca();
  if (!basis.ok()) return basis.status();
  absl::StatusOr<EpochId> id = Register(*std::move(basis));  // the sequence's reference
  if (!id.ok()) return id.status();
  ++pca_epochs_built_;
  s.epoch = *id;
  if (shared) {
    if (absl::Status st = registry_.Acquire(*id); !st.ok()) return st;  // the default's
    default_epoch_ = *id;
    default_self_calibrated_ = true;
  }
  return absl::OkStatus();
}

void CompressionEpochs::EnsureRefresher() {
  if (refresher_ == nullptr) refresher_ = std::make_unique<Refresher>(options_.refresher);
}

void CompressionEpochs::OpenStream(CompressedSequence& s, SeqId seq) {
  if (s.refresh.method == RefreshMethod::kNone || s.epoch == kNoEpoch || s.stream != 0) return;
  EnsureRefresher();
  // Without query heads kqsvd, the one method that reads queries, is refused by the caches.
  const int n_heads =
      options_.n_query_heads > 0 ? options_.n_query_heads : options_.geometry.n_kv_heads;
  s.stream = refresher_->Open([g = options_.geometry, n_heads, r_k = options_.policy.r_k,
                               r_v = options_.policy.r_v, refresh = s.refresh,
                               initial = registry_.GetShared(s.epoch)] {
    return std::make_unique<OnlineStatistics>(g, n_heads, r_k, r_v, refresh, *initial);
  });
  streams_[s.stream] = seq;
}

void CompressionEpochs::CloseStream(CompressedSequence& s) {
  if (s.stream == 0) return;
  refresher_->Close(s.stream);
  streams_.erase(s.stream);
  s.stream = 0;
}

SeqId CompressionEpochs::StreamSequence(Refresher::StreamId stream) const {
  const auto it = streams_.find(stream);
  return it == streams_.end() ? -1 : it->second;
}

}  // namespace subspace
