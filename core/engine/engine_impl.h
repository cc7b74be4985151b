// Engine::Impl, the engine's state and its methods' declarations: private to core/engine.
// engine.cc holds admission, the loop, sampling and delivery; engine_sessions.cc the sessions,
// their export and import and their restore from the tiers. The locking rules and the session
// semantics are engine.cc's file comment.
#ifndef SUBSPACE_CORE_ENGINE_ENGINE_IMPL_H_
#define SUBSPACE_CORE_ENGINE_ENGINE_IMPL_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/engine/scheduler.h"
#include "core/engine/session_store.h"

namespace subspace {

class Engine::Impl {
 public:
  Impl(EngineConfig config, std::shared_ptr<ModelRunner> model,
       std::shared_ptr<const Tokenizer> tokenizer, std::unique_ptr<KvCacheBase> cache,
       std::unique_ptr<SessionTiers> tiers)
      : config_(std::move(config)),
        model_(std::move(model)),
        tokenizer_(std::move(tokenizer)),
        cache_(std::move(cache)),
        tiers_(std::move(tiers)),
        sessions_(config_.max_sessions, config_.default_session_ttl, tiers_.get()) {}

  absl::Status Start();
  ~Impl();

  absl::StatusOr<RequestId> Submit(GenerateRequest request,
                                   std::shared_ptr<GenerateObserver> observer);
  void Cancel(RequestId id);
  absl::StatusOr<SessionInfo> CreateSession(absl::Duration idle_ttl, std::string_view proposed_id,
                                            std::string_view owner,
                                            std::optional<RefreshConfig> refresh);
  absl::StatusOr<SessionInfo> GetSession(std::string_view id, std::string_view owner) const;
  std::vector<SessionInfo> ListSessions(std::string_view owner) const;
  std::vector<SessionInfo> ListEverySession() const;
  absl::StatusOr<std::string> SessionOwner(std::string_view id) const;
  absl::Status DeleteSession(std::string_view id, std::string_view owner);
  absl::StatusOr<std::vector<ExportedSession>> ExportSessions(absl::Time changed_since) const;
  absl::StatusOr<ExportedSession> ExportSession(std::string_view id, std::string_view owner) const;
  // An exported image in the cache's storage form (KvCacheBase::CompactImage).
  void CompactExported(ExportedSession& e) const;
  absl::StatusOr<ImportedSession> ImportSession(const SessionImage& image);
  bool Drain(absl::Duration timeout);
  bool draining() const;
  EngineStats Stats() const;

  const ModelConfig& model_config() const { return model_->config(); }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const EngineConfig& config() const { return config_; }

 private:
  struct Request {
    Request(RequestId id, const SamplingParams& sampling, const Tokenizer& tokenizer,
            bool strip_leading_space, std::vector<std::string> stops)
        : id(id),
          sampler(sampling),
          decoder(tokenizer, strip_leading_space),
          stop(std::move(stops)) {}

    const RequestId id;
    std::shared_ptr<GenerateObserver> observer;
    std::string session_id;
    std::string owner;            // the caller's principal (GenerateRequest::session_owner)
    std::vector<int32_t> tokens;  // session history + prompt + generated
    int64_t prompt_tokens = 0;    // of this request alone
    int64_t max_new = 0;          // clamped to the context left
    bool ignore_eos = false;
    absl::Time deadline;
    absl::Time accepted;
    bool cancelled = false;  // guarded by Impl::mu_

    // Engine thread only.
    Sampler sampler;
    StreamDecoder decoder;
    StopMatcher stop;
    int64_t generated = 0;
    int64_t reused = 0;
    bool scheduled_once = false;
    absl::Time first_scheduled;
    absl::Time last_token;
    GenerateTimings timings;
  };

  // A finished stateless request's cache, kept for a later one
  // (EngineConfig::prompt_cache_entries).
  struct PromptCacheEntry {
    SeqId seq = -1;
    std::vector<int32_t> tokens;  // prompt + generated
    int64_t cached = 0;           // of them in the cache
    std::string owner;
  };

  // Observer calls collected under the lock and made after releasing it, in order.
  struct Delivery {
    std::shared_ptr<GenerateObserver> observer;
    GeneratedTokenEvent event;
    std::optional<GenerateResult> finish;  // set: OnFinish; unset: OnTokens(event)
  };

  // What sampling one chunk's logits decided (computed without the lock).
  struct Outcome {
    GeneratedTokenEvent event;
    bool has_token = true;  // false: a prefill-only request's end, nothing sampled
    FinishReason finish = FinishReason::kNone;
  };

  void Loop();
  // *Locked methods run with mu_ held (the thread-safety annotations went with absl::Mutex:
  // std::mutex is no capability type to clang's analysis).
  // Finishes cancelled, timed-out (and, when stopping, all) requests; evicts expired sessions
  // and frees the cache sequences that deleted or expired sessions left behind.
  void ReapLocked(absl::Time now, std::vector<Delivery>* out);
  // Takes the request out of the scheduler, hands its cache to its session (or frees it),
  // queues OnFinish and forgets the request.
  void FinishLocked(Request& r, FinishReason reason, absl::Status status, absl::Time now,
                    std::vector<Delivery>* out);
  // The scheduler's reclaim hook: frees the pool blocks of the least recently used idle
  // session, its cache moving to the session tiers when there are some.
  bool ReclaimIdleLocked();
  // Brings a tiered session's cache back into the pool before a call on it (or, failing that,
  // leaves it with nothing cached). Releases mu_ while a tier reads its image.
  void RestoreTieredLocked(std::unique_lock<std::mutex>& lock, std::string_view id,
                           std::string_view owner, absl::Time now);
  // A cache sequence from an image of this engine's cache (ImportSession, the tiers): checks
  // its layout and length and applies `refresh`; with `reclaim`, gives up idle sessions' pool
  // blocks (to the tiers) while the pool is short.
  absl::StatusOr<SeqId> ImportCacheLocked(const SessionImage& image,
                                          const std::optional<RefreshConfig>& refresh,
                                          bool reclaim);
  void FreeSeqLocked(SeqId seq);
  // The kept cache sharing the longest prefix (>= kMinPromptCacheReuse, short of the prompt's
  // last token) with a stateless request's prompt, taken out of prompt_cache_; seq -1: none.
  PromptCacheEntry TakePromptCacheLocked(const std::vector<int32_t>& prompt, std::string_view owner,
                                         int64_t* shared);
  Outcome SampleAndDecode(Request& r, std::span<float> logits);
  // The rest of SampleAndDecode, for a token sampled on the device or the host.
  Outcome Decode(Request& r, SampledToken s);
  // Fills rows_ when the runner samples on its device and every request of the step lets it
  // (no repetition penalty, no top logprobs): the logits then never leave the device.
  bool PlanDeviceSampling(const std::vector<bool>& samples);
  // Takes mu_ itself: call without it.
  void Deliver(std::vector<Delivery>& out);
  // EngineConfig::on_session_removed for each id; call without mu_.
  void NotifyRemoved(std::vector<std::string>& ids);

  // Work on the cache from another thread (snapshots). Runs `work` at once, under mu_, when no
  // request is in flight; else the loop runs it under mu_ between two steps while the caller
  // waits. `work` must not take mu_.
  struct LoopTask {
    const std::function<void()>* work;
    bool done = false;
  };
  void RunOnLoopLocked(std::unique_lock<std::mutex>& lock, const std::function<void()>& work) const;
  void RunTasksLocked();  // the loop's side
  ExportedSession ExportLocked(const Session& s) const;
  absl::StatusOr<ImportedSession> ImportLocked(const SessionImage& image, absl::Time now);

  // Something for the loop to look at: wakes it.
  void KickLocked() {
    kicked_ = true;
    kick_cv_.notify_one();  // only the engine thread waits on it
  }
  bool KickedLocked() const { return kicked_ || stop_; }
  bool IdleLocked() const { return requests_.empty() && undelivered_finishes_ == 0; }

  const EngineConfig config_;
  const std::shared_ptr<ModelRunner> model_;
  const std::shared_ptr<const Tokenizer> tokenizer_;
  const std::unique_ptr<KvCacheBase> cache_;   // engine thread only (see the file comment)
  const std::unique_ptr<SessionTiers> tiers_;  // null: none (thread-safe itself)

  mutable std::mutex mu_;
  mutable std::condition_variable kick_cv_;  // KickedLocked() may have become true
  std::condition_variable idle_cv_;          // IdleLocked() may have become true
  // Guarded by mu_, from here to cache_stats_:
  std::unique_ptr<Scheduler> scheduler_;
  SessionStore sessions_;
  absl::flat_hash_map<RequestId, std::unique_ptr<Request>> requests_;
  std::vector<SeqId> seqs_to_free_;
  std::list<PromptCacheEntry> prompt_cache_;  // most recently finished first
  int64_t prompt_cache_hits_ = 0;
  std::vector<std::string> removed_sessions_;  // ended, for on_session_removed (the loop's)
  RequestId next_id_ = 1;
  mutable bool kicked_ = false;  // something for the loop to look at (set through KickLocked)
  bool draining_ = false;
  bool stop_ = false;
  // Finishes taken out of requests_ whose OnFinish has not returned yet (Drain waits for them).
  int64_t undelivered_finishes_ = 0;
  int64_t steps_total_ = 0;
  int64_t tier_restores_failed_ = 0;
  // No idle session expires before this (a lower bound, so the sessions are scanned only
  // when one may have expired, not on every step).
  absl::Time next_session_expiry_ = absl::InfiniteFuture();
  KvCacheStats cache_stats_;
  // RunOnLoopLocked's queue: tasks_ and their done flags under mu_; waiters on task_cv_.
  mutable std::vector<LoopTask*> tasks_;
  mutable std::condition_variable task_cv_;

  // Engine thread only: the step's batch, reused across steps.
  std::vector<SequenceChunk> batch_;
  std::vector<Request*> batch_requests_;
  std::vector<float> logits_;
  std::vector<RowSampling> rows_;      // device sampling: one per chunk
  std::vector<TokenLogprob> sampled_;  // ... and what it chose
  std::thread thread_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_ENGINE_ENGINE_IMPL_H_
