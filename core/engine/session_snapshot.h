// Session snapshots: one session (its conversation, settings and the KV cache image of its
// cached tokens) as a self-describing, versioned file, and the directory that holds them across
// restarts (docs/sessions.md, "Sessions that survive a restart").
//
// File format v1 (little-endian):
//   magic "SUBSPACE-SESSION" (16 bytes), u32 version, u32 sections;
//   per section: u32 tag, u64 stored bytes, u64 content bytes, u32 CRC-32 of the stored bytes,
//   then one zstd frame with its content checksum (XXH64): every section is checked before a
//   byte of it is used.
//   Sections, in this order: 'META' (model checksum and name), 'SESS' (id, owner, TTL, times,
//   refresh, tokens, cached count), 'KVC0' (the cache's ImageLayout and image).
// The reader refuses, naming why: another magic, a truncated or corrupt file, a checksum
// mismatch (DATA_LOSS); a newer version or another model (FAILED_PRECONDITION).
#ifndef SUBSPACE_CORE_ENGINE_SESSION_SNAPSHOT_H_
#define SUBSPACE_CORE_ENGINE_SESSION_SNAPSHOT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/kvcache/refresh_config.h"

namespace subspace {

inline constexpr uint32_t kSessionSnapshotVersion = 1;

// One session as Engine::ExportSessions gives it and Engine::ImportSession takes it.
struct SessionImage {
  std::string id;
  std::string owner;
  std::vector<int32_t> tokens;  // the conversation so far
  int64_t cached = 0;           // tokens[0, cached) are in `cache`
  absl::Duration idle_ttl;
  absl::Time created;
  absl::Time last_used;
  std::optional<RefreshConfig> refresh;
  // KvCacheBase::ExportSequence of tokens[0, cached) and the exporting cache's ImageLayout;
  // both empty when cached is 0 (the session's next call prefills its whole history).
  std::string cache;
  std::string cache_layout;
};

// The model a snapshot belongs to: its file's ModelChecksum (core/compress/basis_file.h);
// model_name is for messages only. (A cache image of another cache configuration is not the
// reader's business: Engine::ImportSession keeps such a session's tokens and drops the image.)
struct SnapshotIdentity {
  uint64_t model_checksum = 0;
  std::string model_name;
};

std::string EncodeSessionSnapshot(const SessionImage& image, const SnapshotIdentity& identity);

// `max_section_bytes` bounds what one section may expand to (a corrupt size never becomes a
// huge allocation).
absl::StatusOr<SessionImage> DecodeSessionSnapshot(std::string_view bytes,
                                                   const SnapshotIdentity& expected,
                                                   uint64_t max_section_bytes);

// A directory of snapshots, <session id>.session each. Writes are atomic (a temporary file,
// fsync, rename, fsync of the directory): a crash leaves the old file or the new one, never a
// torn one; leftover temporaries are removed by List.
class SnapshotDirectory {
 public:
  // Creates the directory when missing. INVALID_ARGUMENT / the OS error when it cannot be used.
  static absl::StatusOr<SnapshotDirectory> Open(std::string path);

  const std::string& path() const { return path_; }
  std::string PathOf(std::string_view session_id) const;
  absl::Status Write(std::string_view session_id, std::string_view bytes) const;
  absl::StatusOr<std::string> Read(const std::string& file, uint64_t max_bytes) const;
  // Removes a session's file; OK when there is none.
  absl::Status Remove(std::string_view session_id) const;
  // Moves a file that cannot be restored aside (<name>.rejected), so that nothing is lost and
  // the next start does not trip over it again.
  absl::Status Reject(const std::string& file) const;
  // The snapshot files (full paths), sorted.
  absl::StatusOr<std::vector<std::string>> List() const;

 private:
  explicit SnapshotDirectory(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_ENGINE_SESSION_SNAPSHOT_H_
