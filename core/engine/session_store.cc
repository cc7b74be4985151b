// SessionStore: creation with random ids, TTL expiry and the LRU choice of which idle
// session's cache to give up when the pool runs short.
#include "core/engine/session_store.h"

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/base/random_id.h"

namespace subspace {

SessionInfo Session::Info(const SessionTiers* tiers) const {
  SessionInfo info;
  info.id = id;
  info.owner = owner;
  info.tokens = static_cast<int64_t>(tokens.size());
  info.cached_tokens = cached;
  if (tiered) {
    info.cache_location = tiers == nullptr ? CacheLocation::kNone : tiers->Where(id);
    if (info.cache_location == CacheLocation::kNone) info.cached_tokens = 0;  // dropped
  } else if (seq >= 0 && cached > 0) {
    info.cache_location = CacheLocation::kPool;
  }
  info.idle_ttl = idle_ttl;
  info.created = created;
  info.last_used = last_used;
  info.busy = busy();
  info.refresh_method = refresh.has_value() ? refresh->method : RefreshMethod::kNone;
  return info;
}

absl::StatusOr<std::string> NewSessionId() { return NewRandomHexId(); }

absl::StatusOr<Session*> SessionStore::Create(absl::Duration idle_ttl, absl::Time now,
                                              std::string_view proposed_id,
                                              std::string_view owner) {
  if (idle_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("idle_ttl must not be negative");
  }
  if (static_cast<int>(sessions_.size()) >= max_sessions_) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("too many sessions (max_sessions = %d)", max_sessions_));
  }
  absl::StatusOr<std::string> id =
      proposed_id.empty() ? NewSessionId() : absl::StatusOr<std::string>(proposed_id);
  if (!id.ok()) return id.status();
  if (!proposed_id.empty() && sessions_.contains(*id)) {
    return absl::AlreadyExistsError(absl::StrFormat("session %s already exists", *id));
  }
  auto session = std::make_unique<Session>();
  session->id = *id;
  session->owner = std::string(owner);
  session->idle_ttl = idle_ttl == absl::ZeroDuration() ? default_ttl_ : idle_ttl;
  session->created = now;
  session->last_used = now;
  Session* out = session.get();
  // 128 random bits do not collide in practice; a collision would only make Create fail.
  // (A proposed id was checked above.)
  if (!sessions_.try_emplace(*id, std::move(session)).second) {
    return absl::InternalError("session id collision");
  }
  return out;
}

const Session* SessionStore::Find(std::string_view id, absl::Time now) const {
  auto it = sessions_.find(absl::string_view(id.data(), id.size()));
  if (it == sessions_.end() || it->second->Expired(now)) return nullptr;
  return it->second.get();
}

Session* SessionStore::Find(std::string_view id, absl::Time now) {
  return const_cast<Session*>(std::as_const(*this).Find(id, now));
}

const Session* SessionStore::FindOwned(std::string_view id, std::string_view owner,
                                       absl::Time now) const {
  const Session* session = Find(id, now);
  return session != nullptr && session->owner == owner ? session : nullptr;
}

Session* SessionStore::FindOwned(std::string_view id, std::string_view owner, absl::Time now) {
  return const_cast<Session*>(std::as_const(*this).FindOwned(id, owner, now));
}

bool SessionStore::Erase(std::string_view id, std::vector<SeqId>* seqs_to_free,
                         std::vector<std::string>* erased_ids) {
  auto it = sessions_.find(absl::string_view(id.data(), id.size()));
  if (it == sessions_.end()) return false;
  if (erased_ids != nullptr) erased_ids->push_back(it->first);
  if (it->second->seq >= 0) seqs_to_free->push_back(it->second->seq);
  if (it->second->tiered && tiers_ != nullptr) tiers_->Erase(it->first);
  sessions_.erase(it);
  return true;
}

void SessionStore::EvictExpired(absl::Time now, std::vector<SeqId>* seqs_to_free,
                                std::vector<std::string>* erased_ids) {
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second->Expired(now)) {
      if (erased_ids != nullptr) erased_ids->push_back(it->first);
      if (it->second->seq >= 0) seqs_to_free->push_back(it->second->seq);
      if (it->second->tiered && tiers_ != nullptr) tiers_->Erase(it->first);
      sessions_.erase(it++);
    } else {
      ++it;
    }
  }
}

absl::Time SessionStore::NextExpiry() const {
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [id, s] : sessions_) {
    if (!s->busy()) next = std::min(next, s->last_used + s->idle_ttl);
  }
  return next;
}

Session* SessionStore::LeastRecentlyUsedCached() {
  Session* lru = nullptr;
  for (auto& [id, s] : sessions_) {
    if (s->busy() || s->seq < 0) continue;
    if (lru == nullptr || s->last_used < lru->last_used) lru = s.get();
  }
  return lru;
}

std::vector<SessionInfo> SessionStore::List(std::string_view owner, absl::Time now) const {
  std::vector<SessionInfo> out;
  for (const auto& [id, s] : sessions_) {
    if (!s->Expired(now) && s->owner == owner) out.push_back(s->Info(tiers_));
  }
  return out;
}

std::vector<const Session*> SessionStore::All(absl::Time now) const {
  std::vector<const Session*> out;
  for (const auto& [id, s] : sessions_) {
    if (!s->Expired(now)) out.push_back(s.get());
  }
  std::sort(out.begin(), out.end(),
            [](const Session* a, const Session* b) { return a->id < b->id; });
  return out;
}

}  // namespace subspace
