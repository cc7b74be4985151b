// The session directory (--session-dir) while a server runs (docs/sessions.md): the snapshots
// it restores at start, the checkpoints it writes while serving (the sessions used since the
// last one), the files of sessions that ended (deleted, expired), which go at once, and every
// session at drain. The disk tier lives in its tier/ folder; files a killed process left there
// are moved up at open and restored with the others.
#ifndef SUBSPACE_SERVER_SESSION_PERSISTENCE_H_
#define SUBSPACE_SERVER_SESSION_PERSISTENCE_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/engine/session_snapshot.h"
#include "server/metrics.h"

namespace subspace::server {

class SessionPersistence {
 public:
  // Opens (creating) `dir` and recovers its disk tier's leftovers. `checkpoint_interval` zero:
  // sessions are written at drain only.
  // `metrics` (may be null) counts what is written and restored.
  static absl::StatusOr<std::unique_ptr<SessionPersistence>> Open(
      const std::string& dir, SnapshotIdentity identity, absl::Duration checkpoint_interval,
      Metrics* metrics);
  ~SessionPersistence();  // StopCheckpoints()
  SessionPersistence(const SessionPersistence&) = delete;
  SessionPersistence& operator=(const SessionPersistence&) = delete;

  const std::string& path() const;
  // Where the engine's disk tier goes.
  std::string TierDir() const;
  // For EngineConfig::on_session_removed: the session's file goes (also one a checkpoint is
  // writing at that moment). Safe to call after this object is gone.
  std::function<void(const std::string&)> RemovalHook() const;

  // Every snapshot in the directory into `engine`; refused ones are moved aside as
  // <file>.rejected with a log line saying why. Restored ones stay as the sessions' checkpoints,
  // or without checkpoints are removed (the session lives in this process only).
  void Restore(Engine& engine);
  // Every checkpoint interval, the sessions used since the last checkpoint are written. `engine`
  // outlives StopCheckpoints().
  void StartCheckpoints(Engine* engine);
  void StopCheckpoints();
  // Every live session, written (after StopCheckpoints, so no older checkpoint overwrites it).
  void Save(Engine& engine);

 private:
  struct Files;  // the directory and the removal bookkeeping, shared with RemovalHook
  SessionPersistence(std::shared_ptr<Files> files, SnapshotIdentity identity,
                     absl::Duration checkpoint_interval, Metrics* metrics);
  // Writes `sessions` (a checkpoint's: skipping those removed meanwhile); counts into the log.
  struct Written {
    int sessions = 0, failed = 0;
    int64_t bytes = 0, cached = 0;
  };
  Written Write(const std::vector<Engine::ExportedSession>& sessions, bool checkpoint);
  void CheckpointLoop(Engine* engine);

  const std::shared_ptr<Files> files_;
  const SnapshotIdentity identity_;
  const absl::Duration checkpoint_interval_;
  Metrics* const metrics_;

  std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread checkpointer_;
};

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_SESSION_PERSISTENCE_H_
