// Engine::Impl's sessions: create, look up, list and delete; export and import of a session's
// history and cache image (one or all, for snapshots and moves between engines); bringing a
// session back from the tiers before a call on it. Runs under mu_ as engine.cc's file comment
// says; work on the cache goes through RunOnLoopLocked.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/engine/engine_impl.h"

namespace subspace {

absl::StatusOr<SessionInfo> Engine::Impl::CreateSession(absl::Duration idle_ttl,
                                                        std::string_view proposed_id,
                                                        std::string_view owner,
                                                        std::optional<RefreshConfig> refresh) {
  if (refresh.has_value()) {
    if (absl::Status s = ValidateRefreshConfig(*refresh); !s.ok()) return s;
  }
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  if (draining_ || stop_) return absl::UnavailableError("the engine is draining");
  // Expired sessions must not hold slots against max_sessions, nor keep their ids taken.
  const size_t before = seqs_to_free_.size() + removed_sessions_.size();
  sessions_.EvictExpired(now, &seqs_to_free_, &removed_sessions_);
  if (seqs_to_free_.size() + removed_sessions_.size() != before) KickLocked();
  absl::StatusOr<Session*> session = sessions_.Create(idle_ttl, now, proposed_id, owner);
  if (!session.ok()) return session.status();
  (*session)->refresh = refresh;
  next_session_expiry_ = std::min(next_session_expiry_, now + (*session)->idle_ttl);
  KickLocked();  // the loop may be asleep until a later expiry
  return (*session)->Info(tiers_.get());
}

absl::StatusOr<SessionInfo> Engine::Impl::GetSession(std::string_view id,
                                                     std::string_view owner) const {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  const Session* session = sessions_.FindOwned(id, owner, now);
  if (session == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("session ", absl::string_view(id.data(), id.size()), " not found"));
  }
  return session->Info(tiers_.get());
}

std::vector<SessionInfo> Engine::Impl::ListSessions(std::string_view owner) const {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  return sessions_.List(owner, now);
}

std::vector<SessionInfo> Engine::Impl::ListEverySession() const {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SessionInfo> out;
  for (const Session* s : sessions_.All(now)) out.push_back(s->Info(tiers_.get()));
  return out;
}

absl::StatusOr<std::string> Engine::Impl::SessionOwner(std::string_view id) const {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  const Session* session = sessions_.Find(id, now);
  if (session == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("session ", absl::string_view(id.data(), id.size()), " not found"));
  }
  return session->owner;
}

absl::Status Engine::Impl::DeleteSession(std::string_view id, std::string_view owner) {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  Session* session = sessions_.FindOwned(id, owner, now);
  if (session == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("session ", absl::string_view(id.data(), id.size()), " not found"));
  }
  // The running request ends with kCancelled; finding its session gone, it frees its cache.
  if (session->busy()) {
    if (auto it = requests_.find(session->active_request); it != requests_.end()) {
      it->second->cancelled = true;
    }
  }
  sessions_.Erase(id, &seqs_to_free_, &removed_sessions_);
  KickLocked();
  return absl::OkStatus();
}

// The cache is the engine thread's. With mu_ held and no request in the table no step runs
// (the loop plans and frees under mu_ and forwards only the requests it holds), so the caller
// may touch it; otherwise RunOnLoopLocked hands the work to the loop between two steps.
Engine::ExportedSession Engine::Impl::ExportLocked(const Session& s) const {
  ExportedSession e;
  SessionImage& image = e.image;
  image.id = s.id;
  image.owner = s.owner;
  image.tokens = s.tokens;
  image.idle_ttl = s.idle_ttl;
  image.created = s.created;
  image.last_used = s.last_used;
  image.refresh = s.refresh;
  if (s.tiered) {
    absl::StatusOr<SessionImage> kept = tiers_->Get(s.id);
    if (kept.ok()) {
      image.cached = kept->cached;
      image.cache = std::move(kept->cache);
      image.cache_layout = std::move(kept->cache_layout);
    } else {
      e.cache = kept.status();
    }
  } else if (s.seq >= 0 && s.cached > 0) {
    absl::StatusOr<std::string> kv = cache_->ExportSequence(s.seq);
    if (kv.ok()) {
      image.cached = s.cached;
      image.cache = *std::move(kv);
      image.cache_layout = cache_->ImageLayout();
    } else {
      e.cache = kv.status();
    }
  }
  return e;
}

void Engine::Impl::RunOnLoopLocked(std::unique_lock<std::mutex>& lock,
                                   const std::function<void()>& work) const {
  if (requests_.empty()) {
    work();
    return;
  }
  LoopTask task{&work};
  tasks_.push_back(&task);
  kicked_ = true;
  kick_cv_.notify_one();
  task_cv_.wait(lock, [&] { return task.done; });
}

void Engine::Impl::RunTasksLocked() {
  if (tasks_.empty()) return;
  for (LoopTask* t : tasks_) {
    (*t->work)();
    t->done = true;
  }
  tasks_.clear();
  task_cv_.notify_all();
}

absl::StatusOr<std::vector<Engine::ExportedSession>> Engine::Impl::ExportSessions(
    absl::Time changed_since) const {
  const absl::Time now = absl::Now();
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<ExportedSession> out;
  RunOnLoopLocked(lock, [&] {
    for (const Session* s : sessions_.All(now)) {
      if (!s->busy() && s->last_used >= changed_since) out.push_back(ExportLocked(*s));
    }
  });
  lock.unlock();
  // Compacting is most of a drain's save (~10 ns a coded bit): the sessions are spread over
  // the cores, a drain having nothing else to run.
  const size_t workers =
      std::min<size_t>(out.size(), std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0};
  const auto work = [&] {
    for (size_t i = next.fetch_add(1); i < out.size(); i = next.fetch_add(1)) {
      CompactExported(out[i]);
    }
  };
  std::vector<std::thread> helpers;
  for (size_t w = 1; w < workers; ++w) helpers.emplace_back(work);
  work();
  for (std::thread& t : helpers) t.join();
  return out;
}

void Engine::Impl::CompactExported(ExportedSession& e) const {
  if (e.image.cache.empty()) return;
  // Thread-safe, so off the loop and the lock: an export for disk or the network is stored in
  // the cache's storage form. Should it fail (it reads the cache's own image), the image goes
  // as it is, which imports the same.
  absl::StatusOr<std::string> compact = cache_->CompactImage(e.image.cache);
  if (compact.ok()) e.image.cache = *std::move(compact);
}

absl::StatusOr<Engine::ExportedSession> Engine::Impl::ExportSession(std::string_view id,
                                                                    std::string_view owner) const {
  const absl::Time now = absl::Now();
  std::unique_lock<std::mutex> lock(mu_);
  const Session* session = sessions_.FindOwned(id, owner, now);
  if (session == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("session ", absl::string_view(id.data(), id.size()), " not found"));
  }
  if (session->busy()) {
    return absl::FailedPreconditionError(absl::StrFormat("session %s is busy with request %d",
                                                         session->id, session->active_request));
  }
  ExportedSession out;
  // Submit may run meanwhile: the session is checked again on the loop.
  RunOnLoopLocked(lock, [&] {
    const Session* s = sessions_.FindOwned(id, owner, now);
    if (s == nullptr || s->busy()) {
      out.cache = absl::FailedPreconditionError("session changed while it was being exported");
      return;
    }
    out = ExportLocked(*s);
  });
  lock.unlock();
  if (out.image.id.empty()) return out.cache;
  CompactExported(out);
  return out;
}

absl::StatusOr<Engine::ImportedSession> Engine::Impl::ImportSession(const SessionImage& image) {
  const ModelConfig& mc = model_->config();
  for (size_t i = 0; i < image.tokens.size(); ++i) {
    const int32_t t = image.tokens[i];
    if (t < 0 || t >= mc.n_vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("session %s: token %d = %d is outside the vocabulary [0, %d)", image.id,
                          i, t, mc.n_vocab));
    }
  }
  if (static_cast<int64_t>(image.tokens.size()) >= mc.context_length) {
    return absl::InvalidArgumentError(
        absl::StrFormat("session %s: %d tokens fill the context of %d", image.id,
                        image.tokens.size(), mc.context_length));
  }
  if (image.cached < 0 || image.cached > static_cast<int64_t>(image.tokens.size())) {
    return absl::InvalidArgumentError(absl::StrFormat("session %s: %d cached tokens of %d",
                                                      image.id, image.cached, image.tokens.size()));
  }
  if (image.refresh.has_value()) {
    if (absl::Status st = ValidateRefreshConfig(*image.refresh); !st.ok()) return st;
  }
  const absl::Time now = absl::Now();
  std::unique_lock<std::mutex> lock(mu_);
  if (draining_ || stop_) return absl::UnavailableError("the engine is draining");
  absl::StatusOr<ImportedSession> out;
  RunOnLoopLocked(lock, [&] { out = ImportLocked(image, now); });
  return out;
}

absl::StatusOr<Engine::ImportedSession> Engine::Impl::ImportLocked(const SessionImage& image,
                                                                   absl::Time now) {
  sessions_.EvictExpired(now, &seqs_to_free_, &removed_sessions_);
  // The loop frees what expired sessions held.
  if (!seqs_to_free_.empty() || !removed_sessions_.empty()) KickLocked();
  absl::StatusOr<Session*> created = sessions_.Create(image.idle_ttl, now, image.id, image.owner);
  if (!created.ok()) return created.status();
  Session& s = **created;
  s.tokens = image.tokens;
  s.created = image.created;
  s.refresh = image.refresh;
  ImportedSession out;
  if (image.cached > 0) {
    absl::StatusOr<SeqId> seq = ImportCacheLocked(image, s.refresh, /*reclaim=*/false);
    if (seq.ok()) {
      s.seq = *seq;
      s.cached = image.cached;
    } else if (absl::IsResourceExhausted(seq.status()) && tiers_ != nullptr && tiers_->Put(image)) {
      // No room in the pool: it waits in a tier, as if it had been given up for room.
      s.tiered = true;
      s.cached = image.cached;
    } else {
      out.cache = seq.status();
    }
  }
  next_session_expiry_ = std::min(next_session_expiry_, now + s.idle_ttl);
  cache_stats_ = cache_->Stats();
  KickLocked();
  out.info = s.Info(tiers_.get());
  return out;
}

absl::StatusOr<SeqId> Engine::Impl::ImportCacheLocked(const SessionImage& image,
                                                      const std::optional<RefreshConfig>& refresh,
                                                      bool reclaim) {
  if (image.cache_layout != cache_->ImageLayout()) {
    return absl::FailedPreconditionError(
        absl::StrCat("its KV cache image is of another cache configuration ('", image.cache_layout,
                     "'; this server's is '", cache_->ImageLayout(), "')"));
  }
  absl::StatusOr<SeqId> seq = cache_->ImportSequence(image.cache);
  while (reclaim && absl::IsResourceExhausted(seq.status()) && ReclaimIdleLocked()) {
    seq = cache_->ImportSequence(image.cache);
  }
  if (!seq.ok()) return seq.status();
  if (cache_->Length(*seq) != image.cached) {
    const int64_t length = cache_->Length(*seq);
    FreeSeqLocked(*seq);
    return absl::DataLossError(
        absl::StrFormat("its KV cache image holds %d tokens, not %d", length, image.cached));
  }
  if (refresh.has_value()) {
    if (absl::Status st = cache_->SetSequenceRefresh(*seq, *refresh); !st.ok()) {
      FreeSeqLocked(*seq);
      return st;
    }
  }
  return seq;
}

void Engine::Impl::RestoreTieredLocked(std::unique_lock<std::mutex>& lock, std::string_view id,
                                       std::string_view owner, absl::Time now) {
  lock.unlock();
  const absl::Time start = absl::Now();
  const CacheLocation from = tiers_->Where(id);
  absl::StatusOr<SessionImage> image = tiers_->Take(id);
  lock.lock();
  RunOnLoopLocked(lock, [&] {
    Session* s = sessions_.FindOwned(id, owner, now);
    // Restored, deleted or taken by another call meanwhile: that call decided.
    if (s == nullptr || s->busy() || !s->tiered) return;
    s->tiered = false;
    absl::StatusOr<SeqId> seq =
        image.ok() ? ImportCacheLocked(*image, s->refresh, /*reclaim=*/true) : image.status();
    if (seq.ok()) {
      s->seq = *seq;
      s->cached = image->cached;
      s->last_used = now;  // in use: the last session to give up for room
      tiers_->RecordRestore(from, absl::ToDoubleSeconds(absl::Now() - start));
    } else {
      s->cached = 0;
      ++tier_restores_failed_;
    }
    cache_stats_ = cache_->Stats();
  });
}

}  // namespace subspace
