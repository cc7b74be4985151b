// Session tiers: where an idle session's KV cache goes when the pool needs its blocks, instead of
// being dropped (docs/sessions.md, "Tiers"). Two tiers under the pool:
//  * host memory: the cache image as the cache exported it (compressed pages as they are, with
//    their basis epochs), capped in bytes; restoring it is one ImportSequence;
//  * disk: one session snapshot file each (session_snapshot.h: zstd, checksummed, written
//    atomically) in a directory capped in bytes, written by a background thread so that no step
//    of the engine waits for a disk.
// Each tier gives up its least recently stored entry first: a host entry moves to the disk tier
// (or is dropped when there is none), a disk entry is dropped. Only then is a session's cache
// lost, and its tokens are not: the engine keeps every session's conversation, so the next call
// prefills it again (correct, only slower) and says so through its usage.
//
// Thread-safe. Put and Erase never wait for a disk (the engine calls them under its lock); Take
// and Get of a disk entry read its file on the caller's thread.
#ifndef SUBSPACE_CORE_ENGINE_SESSION_TIERS_H_
#define SUBSPACE_CORE_ENGINE_SESSION_TIERS_H_

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/engine/session_snapshot.h"

namespace subspace {

struct SessionTierOptions {
  int64_t host_bytes = 0;     // the host tier's cap; 0: no host tier
  std::string disk_dir;       // the disk tier's directory (emptied at start); empty: no disk tier
  int64_t disk_bytes = 0;     // the disk tier's cap on its files' bytes
  SnapshotIdentity identity;  // stamped on the disk tier's files and checked when read back
  // The largest file, and section in it, a disk entry may have: anything larger is damaged and
  // must not become an allocation (the engine sets it from its pool's size).
  int64_t max_image_bytes = int64_t{1} << 32;
  // A cache image in its storage form (KvCacheBase::CompactImage), made on the writer thread
  // before a disk entry is written; null: as the host tier holds it.
  std::function<absl::StatusOr<std::string>(std::string_view)> compact_image;
  bool enabled() const { return host_bytes > 0 || (!disk_dir.empty() && disk_bytes > 0); }
};

// Where a session's cached tokens are.
enum class CacheLocation { kNone, kPool, kHost, kDisk };
const char* CacheLocationName(CacheLocation location);

// Restores from one tier (its Take and the import into the pool), per bucket, not cumulative.
struct TierRestoreLatency {
  static constexpr std::array<double, 9> kBounds = {0.0005, 0.001, 0.0025, 0.005, 0.01,
                                                    0.025,  0.05,  0.1,    0.5};
  std::array<int64_t, kBounds.size() + 1> counts{};
  double sum_seconds = 0.0;
  void Add(double seconds);
};

struct SessionTierStats {
  int64_t host_sessions = 0;
  int64_t host_bytes = 0;           // images in memory, those being written to disk included
  int64_t host_spilling_bytes = 0;  // of which queued for (or on their way to) disk
  int64_t disk_sessions = 0;
  int64_t disk_bytes = 0;   // their files
  int64_t host_tokens = 0;  // cached tokens of the images each tier holds
  int64_t disk_tokens = 0;
  int64_t stored_total = 0;         // images Put
  int64_t spilled_total = 0;        // host entries written to the disk tier
  int64_t restored_host_total = 0;  // images Taken from each tier
  int64_t restored_disk_total = 0;
  int64_t dropped_total = 0;  // images given up for room (their sessions re-prefill)
  int64_t errors_total = 0;   // disk writes or reads that failed (their images are lost too)
  TierRestoreLatency restore_host, restore_disk;  // RecordRestore's
};

class SessionTiers {
 public:
  // INVALID_ARGUMENT for negative caps; the directory's errors (it is created when missing and
  // emptied of earlier snapshot files: the caller recovers a crashed process's files first).
  static absl::StatusOr<std::unique_ptr<SessionTiers>> Create(SessionTierOptions options);
  // Stops the writer (images still queued for disk are dropped) and removes the disk tier's
  // files: what must outlive the process is exported before (the server's --session-dir).
  ~SessionTiers();
  SessionTiers(const SessionTiers&) = delete;
  SessionTiers& operator=(const SessionTiers&) = delete;

  // Keeps an idle session's image (image.cached > 0), replacing one it holds for the same id.
  // False, keeping nothing, when it is larger than every tier.
  bool Put(SessionImage image);
  // Gives back and forgets a session's image. NOT_FOUND when none is held (never put, dropped,
  // erased); a disk entry's read or decode errors (DATA_LOSS for a damaged file).
  absl::StatusOr<SessionImage> Take(std::string_view id);
  // A copy, the entry stays (exports). Errors as Take.
  absl::StatusOr<SessionImage> Get(std::string_view id) const;
  // Forgets a session's image (its file is removed in the background); nothing when none.
  void Erase(std::string_view id);
  // kHost, kDisk (its file written), or kNone.
  CacheLocation Where(std::string_view id) const;
  SessionTierStats Stats() const;
  // A restore from `from` (kHost or kDisk) took `seconds`, the import into the pool included.
  void RecordRestore(CacheLocation from, double seconds);
  // Waits until every queued write and removal is done (tests; shutdown).
  void Flush();

 private:
  struct Entry {
    std::shared_ptr<const SessionImage> image;  // null once the entry is on disk
    int64_t bytes = 0;                          // in memory, or of its file
    int64_t tokens = 0;                         // the image's cached tokens
    bool on_disk = false;
    bool spilling = false;  // queued for (or being written to) the disk tier
    uint64_t generation = 0;
    uint64_t stamp = 0;  // when it was put: the least recent goes first
  };
  struct Task {
    std::string id;
    uint64_t generation = 0;                    // the entry to write, or
    std::shared_ptr<const SessionImage> image;  // null: remove the file of `id`
  };

  explicit SessionTiers(SessionTierOptions options, std::optional<SnapshotDirectory> dir);
  // Gives up least recently stored entries until both tiers are within their caps.
  void MakeRoomLocked();
  void DropLocked(const std::string& id);
  // Whether the entry of `id` is on disk (then the file is its own).
  bool OnDiskLocked(std::string_view id) const;
  absl::StatusOr<SessionImage> ReadFile(std::string_view id) const;
  // A disk entry's bytes: the snapshot of `image`, its cache image compacted when it can be.
  std::string Encode(const SessionImage& image) const;
  void Writer();

  const SessionTierOptions options_;
  const std::optional<SnapshotDirectory> dir_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // tasks_ gained one, or stop_
  std::condition_variable idle_cv_;  // tasks_ became empty with nothing in flight
  absl::flat_hash_map<std::string, Entry> entries_;
  std::deque<Task> tasks_;
  bool writing_ = false;  // the writer holds a task
  bool stop_ = false;
  uint64_t next_generation_ = 1;
  uint64_t next_stamp_ = 1;
  SessionTierStats stats_;  // counts; the sizes are kept here too
  std::thread writer_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_ENGINE_SESSION_TIERS_H_
