// A KvCache that forwards every call to an inner cache: the base of decorators that observe
// what the model writes and attends (calibration statistics, evaluation captures) without
// changing the cache's behaviour. Subclasses override what they watch and call through.
#ifndef SUBSPACE_CORE_KVCACHE_FORWARDING_KV_CACHE_H_
#define SUBSPACE_CORE_KVCACHE_FORWARDING_KV_CACHE_H_

#include <memory>
#include <span>
#include <utility>

#include "core/kvcache/kv_cache.h"

namespace subspace {

class ForwardingKvCache : public KvCache {
 public:
  explicit ForwardingKvCache(std::unique_ptr<KvCache> inner) : inner_(std::move(inner)) {}

  const KvCacheGeometry& geometry() const override { return inner_->geometry(); }
  int block_size() const override { return inner_->block_size(); }
  absl::StatusOr<SeqId> CreateSequence() override { return inner_->CreateSequence(); }
  absl::Status FreeSequence(SeqId seq) override { return inner_->FreeSequence(seq); }
  int64_t Length(SeqId seq) const override { return inner_->Length(seq); }
  absl::Status Reserve(SeqId seq, int64_t n) override { return inner_->Reserve(seq, n); }
  int64_t BlocksNeeded(SeqId seq, int64_t n) const override { return inner_->BlocksNeeded(seq, n); }
  void Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k,
             const float* v) override {
    inner_->Write(layer, seq, pos, n, k, v);
  }
  void Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) override {
    inner_->Attend(layer, requests, n_heads);
  }
  absl::Status Commit(SeqId seq, int64_t length) override { return inner_->Commit(seq, length); }
  absl::Status Truncate(SeqId seq, int64_t length) override {
    return inner_->Truncate(seq, length);
  }
  absl::Status SetSequenceRefresh(SeqId seq, const RefreshConfig& config) override {
    return inner_->SetSequenceRefresh(seq, config);
  }
  KvCacheStats Stats() const override { return inner_->Stats(); }

 protected:
  KvCache& inner() { return *inner_; }

 private:
  std::unique_ptr<KvCache> inner_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_KVCACHE_FORWARDING_KV_CACHE_H_
