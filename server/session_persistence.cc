#include "server/session_persistence.h"

#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace subspace::server {

struct SessionPersistence::Files {
  explicit Files(SnapshotDirectory d) : dir(std::move(d)) {}

  // A session ended: its file goes, and a write in progress must not bring it back.
  void Removed(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    if (absl::Status st = dir.Remove(id); !st.ok()) {
      spdlog::warn("the snapshot of ended session {} stays: {}", id, std::string(st.message()));
    }
    if (tracking > 0) removed.insert(id);
  }
  void BeginTracking() {
    std::lock_guard<std::mutex> lock(mu);
    if (tracking++ == 0) removed.clear();
  }
  void EndTracking() {
    std::lock_guard<std::mutex> lock(mu);
    --tracking;
  }

  const SnapshotDirectory dir;
  std::mutex mu;
  int tracking = 0;                          // exports whose writes are pending
  absl::flat_hash_set<std::string> removed;  // sessions that ended meanwhile
};

namespace {

// A snapshot section holds at most a session's share of the pool (plus its bases): anything
// claiming far more is corrupt, and must not become an allocation.
uint64_t MaxSnapshotBytes(const KvCacheStats& cache) {
  return 2 * static_cast<uint64_t>(cache.bytes_total) + (uint64_t{256} << 20);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SessionPersistence>> SessionPersistence::Open(
    const std::string& dir, SnapshotIdentity identity, absl::Duration checkpoint_interval,
    Metrics* metrics) {
  absl::StatusOr<SnapshotDirectory> opened = SnapshotDirectory::Open(dir);
  if (!opened.ok()) {
    return absl::Status(opened.status().code(),
                        absl::StrCat("--session-dir: ", opened.status().message()));
  }
  auto files = std::make_shared<Files>(*std::move(opened));
  // A process that was killed left the sessions it had spilled to disk: complete snapshots,
  // restored with the others.
  const std::string tier = absl::StrCat(dir, "/tier");
  std::error_code ec;
  int recovered = 0;
  for (const auto& e : std::filesystem::directory_iterator(tier, ec)) {
    if (e.path().extension() != ".session") continue;
    std::error_code moved;
    std::filesystem::rename(e.path(), std::filesystem::path(dir) / e.path().filename(), moved);
    if (moved) {
      spdlog::warn("disk tier file {} not recovered: {}", e.path().string(), moved.message());
    } else {
      ++recovered;
    }
  }
  if (recovered > 0) {
    spdlog::info("recovered {} sessions from the disk tier {} of a process that did not stop",
                 recovered, tier);
  }
  return std::unique_ptr<SessionPersistence>(
      new SessionPersistence(std::move(files), std::move(identity), checkpoint_interval, metrics));
}

SessionPersistence::SessionPersistence(std::shared_ptr<Files> files, SnapshotIdentity identity,
                                       absl::Duration checkpoint_interval, Metrics* metrics)
    : files_(std::move(files)),
      identity_(std::move(identity)),
      checkpoint_interval_(checkpoint_interval),
      metrics_(metrics) {}

SessionPersistence::~SessionPersistence() { StopCheckpoints(); }

const std::string& SessionPersistence::path() const { return files_->dir.path(); }

std::string SessionPersistence::TierDir() const { return absl::StrCat(path(), "/tier"); }

std::function<void(const std::string&)> SessionPersistence::RemovalHook() const {
  return [files = files_](const std::string& id) { files->Removed(id); };
}

void SessionPersistence::Restore(Engine& engine) {
  const SnapshotDirectory& dir = files_->dir;
  absl::StatusOr<std::vector<std::string>> files = dir.List();
  if (!files.ok()) {
    spdlog::error("sessions not restored: {}", std::string(files.status().message()));
    return;
  }
  const absl::Time start = absl::Now();
  const uint64_t max_bytes = MaxSnapshotBytes(engine.Stats().cache);
  int restored = 0, refused = 0;
  int64_t tokens = 0, cached = 0;
  for (const std::string& file : *files) {
    absl::StatusOr<std::string> bytes = dir.Read(file, max_bytes);
    absl::StatusOr<SessionImage> image = bytes.ok()
                                             ? DecodeSessionSnapshot(*bytes, identity_, max_bytes)
                                             : absl::StatusOr<SessionImage>(bytes.status());
    absl::StatusOr<Engine::ImportedSession> imported =
        image.ok() ? engine.ImportSession(*image)
                   : absl::StatusOr<Engine::ImportedSession>(image.status());
    if (!imported.ok()) {
      ++refused;
      const absl::Status moved = dir.Reject(file);
      spdlog::warn("session snapshot {} refused ({}): {}; {}", file,
                   absl::StatusCodeToString(imported.status().code()),
                   std::string(imported.status().message()),
                   moved.ok() ? "moved aside as .rejected" : std::string(moved.message()));
      continue;
    }
    ++restored;
    tokens += imported->info.tokens;
    cached += imported->info.cached_tokens;
    if (!imported->cache.ok()) {
      spdlog::warn(
          "session {} restored without its KV cache ({}): its next call prefills {} tokens",
          imported->info.id, std::string(imported->cache.message()), imported->info.tokens);
    }
    // With checkpoints the file stays the session's checkpoint until the next one rewrites it
    // (or the session ends and it goes). Without, the session lives in this process only now:
    // the next drain writes it again, and a kill before then must not roll it back to this.
    if (checkpoint_interval_ > absl::ZeroDuration()) continue;
    if (absl::Status st = dir.Remove(imported->info.id); !st.ok()) {
      spdlog::warn("session {} restored, but its snapshot stays: {}", imported->info.id,
                   std::string(st.message()));
    }
  }
  if (metrics_ != nullptr) metrics_->RecordSessionsRestored(restored, refused);
  if (restored + refused > 0) {
    spdlog::info(
        "restored {} sessions ({} tokens, {} of them cached) from {} in {:.3f} s; {} "
        "refused",
        restored, tokens, cached, dir.path(), absl::ToDoubleSeconds(absl::Now() - start), refused);
  }
}

SessionPersistence::Written SessionPersistence::Write(
    const std::vector<Engine::ExportedSession>& sessions, bool checkpoint) {
  Written w;
  for (const Engine::ExportedSession& s : sessions) {
    if (!s.cache.ok() && !checkpoint) {
      spdlog::info("session {} saved without its KV cache ({}): its next call prefills {} tokens",
                   s.image.id, std::string(s.cache.message()), s.image.tokens.size());
    }
    const std::string snapshot = EncodeSessionSnapshot(s.image, identity_);
    if (absl::Status st = files_->dir.Write(s.image.id, snapshot); !st.ok()) {
      ++w.failed;
      spdlog::error("session {} not {}: {}", s.image.id, checkpoint ? "checkpointed" : "saved",
                    std::string(st.message()));
      continue;
    }
    {
      // Deleted or expired since the export: the file it had is gone, and so goes this one.
      std::lock_guard<std::mutex> lock(files_->mu);
      if (files_->removed.contains(s.image.id)) {
        (void)files_->dir.Remove(s.image.id);
        continue;
      }
    }
    ++w.sessions;
    w.bytes += static_cast<int64_t>(snapshot.size());
    w.cached += s.image.cached;
  }
  return w;
}

void SessionPersistence::StartCheckpoints(Engine* engine) {
  if (checkpoint_interval_ <= absl::ZeroDuration() || checkpointer_.joinable()) return;
  checkpointer_ = std::thread([this, engine] { CheckpointLoop(engine); });
}

void SessionPersistence::StopCheckpoints() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    stop_cv_.notify_all();
  }
  if (checkpointer_.joinable()) checkpointer_.join();
}

void SessionPersistence::CheckpointLoop(Engine* engine) {
  absl::Time since = absl::InfinitePast();
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    stop_cv_.wait_for(lock, absl::ToChronoNanoseconds(checkpoint_interval_),
                      [this] { return stop_; });
    if (stop_) break;
    lock.unlock();
    const absl::Time start = absl::Now();
    files_->BeginTracking();
    absl::StatusOr<std::vector<Engine::ExportedSession>> sessions = engine->ExportSessions(since);
    if (sessions.ok()) {
      const Written w = Write(*sessions, /*checkpoint=*/true);
      if (metrics_ != nullptr) metrics_->RecordSessionsWritten("checkpoint", w.sessions, w.bytes);
      if (w.failed == 0) since = start;  // a failed write is retried with the next increment
      if (w.sessions + w.failed > 0) {
        spdlog::debug("checkpoint: {} sessions ({} bytes) written to {} in {:.3f} s{}", w.sessions,
                      w.bytes, path(), absl::ToDoubleSeconds(absl::Now() - start),
                      w.failed > 0 ? absl::StrCat("; ", w.failed, " failed") : std::string());
      }
    } else {
      spdlog::error("checkpoint skipped: {}", std::string(sessions.status().message()));
    }
    files_->EndTracking();
    lock.lock();
  }
}

void SessionPersistence::Save(Engine& engine) {
  const absl::Time start = absl::Now();
  files_->BeginTracking();
  absl::StatusOr<std::vector<Engine::ExportedSession>> sessions = engine.ExportSessions();
  if (!sessions.ok()) {
    files_->EndTracking();
    spdlog::error("sessions not saved: {}", std::string(sessions.status().message()));
    return;
  }
  const Written w = Write(*sessions, /*checkpoint=*/false);
  files_->EndTracking();
  if (metrics_ != nullptr) metrics_->RecordSessionsWritten("drain", w.sessions, w.bytes);
  spdlog::info("saved {} sessions to {} in {:.3f} s: {} bytes, {:.1f} per cached token{}",
               w.sessions, path(), absl::ToDoubleSeconds(absl::Now() - start), w.bytes,
               w.cached > 0 ? static_cast<double>(w.bytes) / static_cast<double>(w.cached) : 0.0,
               w.failed > 0 ? absl::StrCat("; ", w.failed, " failed") : std::string());
}

}  // namespace subspace::server
