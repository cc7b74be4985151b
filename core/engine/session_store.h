// Sessions: a conversation's token history and the KV-cache sequence that holds its prefix,
// kept between calls, with ids from the OS CSPRNG, an idle TTL, an owner and a cap on how many
// exist. Bookkeeping only: the engine frees the cache sequences this store hands back, on its
// thread.
#ifndef SUBSPACE_CORE_ENGINE_SESSION_STORE_H_
#define SUBSPACE_CORE_ENGINE_SESSION_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/engine/session_tiers.h"
#include "core/kvcache/kv_cache.h"
#include "core/kvcache/refresh_config.h"

namespace subspace {

struct Session {
  std::string id;
  // The principal that created it, opaque here (the server derives it from the caller's
  // credentials; empty is the anonymous one). Only its owner can see or use a session.
  std::string owner;
  std::vector<int32_t> tokens;  // the conversation so far: every prompt and generated token
  // The cache sequence holding tokens[0, cached) while the session is idle; -1 when it has
  // none, or while a request has it (the scheduler owns it then).
  SeqId seq = -1;
  int64_t cached = 0;
  // Its cache was moved out of the pool to the session tiers (seq is -1; `cached` counts the
  // tokens of the image there, if a tier still holds it).
  bool tiered = false;
  absl::Duration idle_ttl;
  absl::Time created;
  absl::Time last_used;
  uint64_t active_request = 0;  // the request running on it; 0 when idle
  // Online basis refresh for every cache sequence made for it; unset: the cache's default.
  std::optional<RefreshConfig> refresh;

  bool busy() const { return active_request != 0; }
  // Busy sessions never expire: the TTL counts from the end of the last call.
  bool Expired(absl::Time now) const { return !busy() && now >= last_used + idle_ttl; }
  // `tiers`: where a tiered session's image is (null: no tiers).
  SessionInfo Info(const SessionTiers* tiers) const;
};

// 128 random bits from the OS CSPRNG as 32 lowercase hex digits: unguessable, so an id is
// also the capability to use the session.
absl::StatusOr<std::string> NewSessionId();

// Not thread-safe; the engine guards it with its lock.
class SessionStore {
 public:
  // `tiers` (may be null) hold the images of tiered sessions: erasing such a session erases its
  // image, and its info says where the image is.
  SessionStore(int max_sessions, absl::Duration default_ttl, SessionTiers* tiers = nullptr)
      : max_sessions_(max_sessions), default_ttl_(default_ttl), tiers_(tiers) {}

  // `idle_ttl` zero means the default. INVALID_ARGUMENT for a negative TTL;
  // RESOURCE_EXHAUSTED at max_sessions (expire first: expired sessions still count).
  // `proposed_id` empty: a fresh NewSessionId(); otherwise that id, ALREADY_EXISTS when a stored
  // session has it (expire first: an expired one still holds its id), whoever owns it.
  absl::StatusOr<Session*> Create(absl::Duration idle_ttl, absl::Time now,
                                  std::string_view proposed_id = {}, std::string_view owner = {});
  // Null when unknown or expired (an expired session is as good as gone, even before the
  // engine evicts it), whoever owns it: for the engine's own bookkeeping.
  Session* Find(std::string_view id, absl::Time now);
  const Session* Find(std::string_view id, absl::Time now) const;
  // As Find, and null too when `owner` does not own it: to a caller, another principal's
  // session is indistinguishable from one that does not exist.
  Session* FindOwned(std::string_view id, std::string_view owner, absl::Time now);
  const Session* FindOwned(std::string_view id, std::string_view owner, absl::Time now) const;
  // Removes a session; its cache sequence (if any) goes to `seqs_to_free`, its tiered image (if
  // any) is erased. False if unknown.
  bool Erase(std::string_view id, std::vector<SeqId>* seqs_to_free,
             std::vector<std::string>* erased_ids = nullptr);
  // Removes every expired session, as Erase does.
  // `erased_ids` (optional) gains the ids of the sessions removed.
  void EvictExpired(absl::Time now, std::vector<SeqId>* seqs_to_free,
                    std::vector<std::string>* erased_ids = nullptr);
  // When the next idle session expires; InfiniteFuture when none can.
  absl::Time NextExpiry() const;
  // The least recently used idle session that holds a cache sequence, or null.
  Session* LeastRecentlyUsedCached();
  // The live sessions `owner` owns.
  std::vector<SessionInfo> List(std::string_view owner, absl::Time now) const;
  // Every live session, whoever owns it, by id.
  std::vector<const Session*> All(absl::Time now) const;
  int size() const { return static_cast<int>(sessions_.size()); }

 private:
  int max_sessions_;
  absl::Duration default_ttl_;
  SessionTiers* tiers_;
  absl::flat_hash_map<std::string, std::unique_ptr<Session>> sessions_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_ENGINE_SESSION_STORE_H_
