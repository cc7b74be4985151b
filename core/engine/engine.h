// The serving engine: owns the model, tokenizer and KV cache, runs the continuous-batching
// loop on its own thread, and keeps sessions (a conversation's tokens and KV cache kept
// between calls). Requests come in through Submit; results go out through an observer whose
// callbacks run on the engine thread and must never block. Knows nothing of gRPC.
#ifndef SUBSPACE_CORE_ENGINE_ENGINE_H_
#define SUBSPACE_CORE_ENGINE_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/session_snapshot.h"
#include "core/engine/session_tiers.h"
#include "core/kvcache/kv_cache.h"
#include "core/kvcache/refresh_config.h"
#include "core/model/model_runner.h"
#include "core/model/sampler.h"
#include "core/tokenizer/tokenizer.h"

namespace subspace {

// One scheduler step, reported to EngineConfig::on_step (metrics).
struct StepStats {
  int sequences = 0;       // sequences in the batch
  int decode_tokens = 0;   // one per decoding sequence
  int prefill_tokens = 0;  // prompt tokens of prefill chunks
  double seconds = 0.0;    // wall time of the step (forward + sampling)
};

struct EngineConfig {
  int max_running = 16;        // sequences admitted (prefilling or decoding) at once
  int max_batch_tokens = 512;  // tokens per step: decodes + prefill chunks; >= max_running
  int max_queue = 256;         // waiting requests; more get RESOURCE_EXHAUSTED
  int max_sessions = 1024;     // more get RESOURCE_EXHAUSTED
  absl::Duration default_session_ttl = absl::Minutes(10);
  // Where idle sessions' caches go when the pool needs their blocks (session_tiers.h); none
  // enabled: they are dropped, and the next call prefills the conversation again. The engine
  // sets max_image_bytes from its pool.
  SessionTierOptions session_tiers;
  // Stateless requests (no session) whose caches are kept after they finish, most recent first:
  // a later stateless request of the same owner that starts with at least
  // kMinPromptCacheReuse of one's tokens (a chat client resending its conversation, a shared
  // system prompt) takes that cache over and prefills only the rest. 0: freed at once. The
  // pool reclaims them before any session's blocks.
  int prompt_cache_entries = 0;
  // Called on the engine thread after each step; must not block.
  std::function<void(const StepStats&)> on_step;
  // Called on the engine thread, without the engine's lock, after a session ended: deleted or
  // expired (a session moved away ends by its DeleteSession too). Must be quick.
  std::function<void(const std::string& session_id)> on_session_removed;
};

enum class FinishReason { kNone, kLength, kStop, kEos, kCancelled, kDeadline };
const char* FinishReasonName(FinishReason reason);

struct GenerateRequest {
  std::string request_id;
  std::vector<int32_t> prompt;  // token ids, BOS included when wanted
  std::string session_id;       // empty: a one-shot request with its own sequence
  std::string session_owner;    // the caller's principal; only the session's owner may use it
  SamplingParams sampling;
  int32_t max_new_tokens = 64;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  absl::Time deadline = absl::InfiniteFuture();
  // With a session: `prompt` is the whole conversation (a chat re-rendered by its template),
  // not a continuation. The session's cached tokens that prompt shares as a prefix are kept,
  // the rest of its history is dropped, and only the prompt past the shared prefix is
  // prefilled (at least its last token, whose logits start generation).
  bool prompt_replaces_history = false;
};

struct GeneratedTokenEvent {
  int32_t token = 0;
  std::string text;  // whole UTF-8 code points only; stop sequences are never included
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;
};

struct GenerateUsage {
  int64_t prompt_tokens = 0;
  int64_t reused_tokens = 0;  // session tokens whose K/V were already cached
  int64_t generated_tokens = 0;
};

struct GenerateTimings {
  double queue_seconds = 0.0;
  double ttft_seconds = 0.0;
  double total_seconds = 0.0;
  std::vector<float> inter_token_seconds;
};

struct GenerateResult {
  // OK for every finish reason; an internal failure of the step gives INTERNAL.
  absl::Status status;
  FinishReason finish = FinishReason::kNone;
  GenerateUsage usage;
  GenerateTimings timings;
  int64_t preemptions = 0;  // times this request was preempted and recomputed
};

// Callbacks run on the engine thread, in order, and must return quickly.
class GenerateObserver {
 public:
  virtual ~GenerateObserver() = default;
  // New tokens of one step (usually one).
  virtual void OnTokens(std::span<const GeneratedTokenEvent> tokens) = 0;
  // Exactly once, last.
  virtual void OnFinish(const GenerateResult& result) = 0;
};

struct SessionInfo {
  std::string id;
  std::string owner;  // the principal it belongs to (CreateSession's `owner`)
  int64_t tokens = 0;
  int64_t cached_tokens = 0;
  absl::Duration idle_ttl;
  absl::Time created;
  absl::Time last_used;
  bool busy = false;
  // Where cached_tokens are: the pool, a tier (the next call restores them before prefilling
  // its new tokens), or nowhere (cached_tokens 0).
  CacheLocation cache_location = CacheLocation::kNone;
  RefreshMethod refresh_method = RefreshMethod::kNone;  // as set at creation (none: the default)
};

// The shortest common prefix for which a stateless request takes over a kept cache.
inline constexpr int64_t kMinPromptCacheReuse = 16;

struct EngineStats {
  int running = 0;
  int waiting = 0;
  int sessions = 0;
  int prompt_cache_entries = 0;         // stateless requests' caches kept (EngineConfig)
  int64_t prompt_cache_hits_total = 0;  // stateless requests that reused one
  int64_t preemptions_total = 0;
  int64_t steps_total = 0;
  KvCacheStats cache;
  SessionTierStats tiers;
  // Calls on a tiered session whose image could not come back (dropped for room, a disk error,
  // no room in the pool): they prefilled the conversation again.
  int64_t tier_restores_failed_total = 0;
};

using RequestId = uint64_t;

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(EngineConfig config,
                                                        std::shared_ptr<ModelRunner> model,
                                                        std::shared_ptr<const Tokenizer> tokenizer,
                                                        std::unique_ptr<KvCacheBase> cache);
  // Cancels whatever is still running (observers get kCancelled) and joins the thread.
  ~Engine();

  // INVALID_ARGUMENT: empty prompt, token ids out of range, max_new_tokens < 1 (0 is allowed on
  //   a session: the prompt is only prefilled into its cache, see engine.cc), a prompt
  //   (after the session's history) that leaves no room to generate in the context, bad
  //   sampling parameters (message names the field); otherwise max_new_tokens is clamped
  //   to the context left and the request ends with kLength there;
  // NOT_FOUND: unknown session (or one session_owner does not own); FAILED_PRECONDITION: the
  // session is busy with another request; RESOURCE_EXHAUSTED: queue full, or the request can
  // never fit the pool;
  // UNAVAILABLE: draining. Observer calls may begin before Submit returns.
  // On a session whose cache is in a tier, Submit first brings it back into the pool (a disk
  // tier's file is read without the engine's lock, the import runs between two steps), so it
  // may wait for one step: never call it from an observer callback.
  // On a session, the request runs over the session's history + `prompt`; when it ends
  // (for any reason) the history gains the prompt and every token reported through
  // OnTokens, EOS included. EOS is reported as a token with empty text.
  absl::StatusOr<RequestId> Submit(GenerateRequest request,
                                   std::shared_ptr<GenerateObserver> observer);
  // The request finishes with kCancelled and its blocks are freed within one step.
  // Unknown or finished ids are ignored.
  void Cancel(RequestId id);

  // Zero `idle_ttl`: the configured default. INVALID_ARGUMENT for a negative TTL;
  // RESOURCE_EXHAUSTED at max_sessions; UNAVAILABLE when draining. Busy sessions never expire;
  // SessionInfo's counts are as of the session's last finished request.
  // `proposed_id` empty: a fresh 128-bit random id. Otherwise the session takes that id (so a
  // client can route on it before the session exists), ALREADY_EXISTS when a live session has
  // it. The engine does not judge its form or randomness: the caller does (the server checks it
  // in request_validation).
  // `owner` is an opaque principal (empty: the anonymous one) the session belongs to. Get,
  // Delete and Submit by any other owner get NOT_FOUND, exactly as for an unknown id, and
  // ListSessions lists only the owner's sessions.
  // `refresh`: online basis refresh for the session's cache sequences (INVALID_ARGUMENT when
  // out of range; the cache must support it); unset: the cache's default.
  absl::StatusOr<SessionInfo> CreateSession(absl::Duration idle_ttl = absl::ZeroDuration(),
                                            std::string_view proposed_id = {},
                                            std::string_view owner = {},
                                            std::optional<RefreshConfig> refresh = std::nullopt);
  absl::StatusOr<SessionInfo> GetSession(std::string_view id, std::string_view owner = {}) const;
  std::vector<SessionInfo> ListSessions(std::string_view owner = {}) const;
  // Every principal's live sessions, by id, and the owner of one (NOT_FOUND when unknown): for
  // an operator moving sessions off a replica, never for a principal's own calls.
  std::vector<SessionInfo> ListEverySession() const;
  absl::StatusOr<std::string> SessionOwner(std::string_view id) const;
  // NOT_FOUND when unknown; a running request on it is cancelled first.
  absl::Status DeleteSession(std::string_view id, std::string_view owner = {});

  // Session snapshots (session_snapshot.h). They touch the cache between two of the loop's
  // steps (at once when no request runs), so a call waits at most for one step.
  // Every live idle session, expired ones aside. A session whose cache has no image (a cache
  // kind without images, or an export that failed) comes with its tokens only:
  // `cache` says why;
  // restored, its next call prefills its history.
  struct ExportedSession {
    SessionImage image;
    absl::Status cache;
  };
  // `changed_since`: only the sessions used at or after that time (a checkpoint's increment).
  absl::StatusOr<std::vector<ExportedSession>> ExportSessions(
      absl::Time changed_since = absl::InfinitePast()) const;
  // One session, for its owner: NOT_FOUND as GetSession, FAILED_PRECONDITION while busy. It
  // stays here: moving it is export, import elsewhere, then DeleteSession.
  absl::StatusOr<ExportedSession> ExportSession(std::string_view id,
                                                std::string_view owner = {}) const;
  // A session from an image, with its id, owner, TTL (counted from now), refresh and tokens;
  // its cached tokens too when the image's cache layout is this cache's and the pool has room
  // (else `cache` says why -- another layout, a full pool, a corrupt image -- and the next call
  // prefills the history). INVALID_ARGUMENT for tokens outside the vocabulary or the context;
  // ALREADY_EXISTS when a live session has the id; RESOURCE_EXHAUSTED at max_sessions;
  // UNAVAILABLE while draining.
  struct ImportedSession {
    SessionInfo info;
    absl::Status cache;
  };
  absl::StatusOr<ImportedSession> ImportSession(const SessionImage& image);

  // Stops admitting (Submit gives UNAVAILABLE) and waits up to `timeout` for in-flight and
  // queued requests to finish. True when all finished in time.
  bool Drain(absl::Duration timeout);
  bool draining() const;

  EngineStats Stats() const;
  const ModelConfig& model_config() const;
  const Tokenizer& tokenizer() const;
  const EngineConfig& config() const;

 private:
  class Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_ENGINE_ENGINE_H_
