#include "core/engine/session_tiers.h"

#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace subspace {

const char* CacheLocationName(CacheLocation location) {
  switch (location) {
    case CacheLocation::kNone:
      return "none";
    case CacheLocation::kPool:
      return "pool";
    case CacheLocation::kHost:
      return "host";
    case CacheLocation::kDisk:
      return "disk";
  }
  return "unknown";
}

namespace {

// The map's key type (Debian's Abseil has its own string_view).
absl::string_view Key(std::string_view id) { return absl::string_view(id.data(), id.size()); }

// What an image holds in memory.
int64_t ImageBytes(const SessionImage& image) {
  return static_cast<int64_t>(sizeof(SessionImage) + image.cache.size() +
                              image.tokens.size() * sizeof(int32_t) + image.id.size() +
                              image.owner.size() + image.cache_layout.size());
}

}  // namespace

absl::StatusOr<std::unique_ptr<SessionTiers>> SessionTiers::Create(SessionTierOptions options) {
  if (options.host_bytes < 0 || options.disk_bytes < 0 || options.max_image_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "session tiers: host_bytes %d and disk_bytes %d must not be negative, max_image_bytes %d "
        "must be positive",
        options.host_bytes, options.disk_bytes, options.max_image_bytes));
  }
  std::optional<SnapshotDirectory> dir;
  if (!options.disk_dir.empty() && options.disk_bytes > 0) {
    absl::StatusOr<SnapshotDirectory> opened = SnapshotDirectory::Open(options.disk_dir);
    if (!opened.ok()) return opened.status();
    absl::StatusOr<std::vector<std::string>> stale = opened->List();
    if (!stale.ok()) return stale.status();
    for (const std::string& file : *stale) {
      std::error_code ec;
      if (!std::filesystem::remove(file, ec) && ec) {
        return absl::InternalError(absl::StrCat("cannot remove ", file, ": ", ec.message()));
      }
    }
    dir = *std::move(opened);
  }
  return std::unique_ptr<SessionTiers>(new SessionTiers(std::move(options), std::move(dir)));
}

SessionTiers::SessionTiers(SessionTierOptions options, std::optional<SnapshotDirectory> dir)
    : options_(std::move(options)), dir_(std::move(dir)) {
  if (dir_.has_value()) writer_ = std::thread([this] { Writer(); });
}

SessionTiers::~SessionTiers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    work_cv_.notify_all();
  }
  if (writer_.joinable()) writer_.join();
  if (!dir_.has_value()) return;
  for (const auto& [id, e] : entries_) {
    // A spill the writer was cut off from may have left its file too.
    if (e.on_disk || e.spilling) (void)dir_->Remove(id);
  }
  std::error_code ec;
  std::filesystem::remove(dir_->path(), ec);  // when empty: the tier leaves nothing behind
}

bool SessionTiers::Put(SessionImage image) {
  const int64_t bytes = ImageBytes(image);
  const bool fits_host = bytes <= options_.host_bytes;
  const bool has_disk = dir_.has_value();
  if (!fits_host && !has_disk) return false;
  std::string id = image.id;
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.contains(Key(id))) {
    DropLocked(id);
    --stats_.dropped_total;  // replaced, not given up
  }
  Entry e;
  e.image = std::make_shared<const SessionImage>(std::move(image));
  e.bytes = bytes;
  e.tokens = e.image->cached;
  e.generation = next_generation_++;
  e.stamp = next_stamp_++;
  ++stats_.stored_total;
  ++stats_.host_sessions;
  stats_.host_bytes += bytes;
  stats_.host_tokens += e.tokens;
  if (!fits_host) {
    // Straight to disk; it is in memory only until written.
    e.spilling = true;
    stats_.host_spilling_bytes += bytes;
    tasks_.push_back({id, e.generation, e.image});
    work_cv_.notify_one();
  }
  entries_.emplace(std::move(id), std::move(e));
  MakeRoomLocked();
  return true;
}

void SessionTiers::MakeRoomLocked() {
  const auto least_recent = [this](bool on_disk) {
    const std::string* best = nullptr;
    uint64_t stamp = std::numeric_limits<uint64_t>::max();
    for (const auto& [id, e] : entries_) {
      if (e.on_disk == on_disk && !e.spilling && e.stamp < stamp) {
        best = &id;
        stamp = e.stamp;
      }
    }
    return best == nullptr ? std::string() : *best;
  };
  // Images on their way to disk leave the host tier as soon as they are written.
  while (stats_.host_bytes - stats_.host_spilling_bytes > options_.host_bytes) {
    const std::string id = least_recent(/*on_disk=*/false);
    if (id.empty()) break;
    if (!dir_.has_value()) {
      DropLocked(id);
      continue;
    }
    Entry& e = entries_.at(id);
    e.spilling = true;
    stats_.host_spilling_bytes += e.bytes;
    tasks_.push_back({id, e.generation, e.image});
    work_cv_.notify_one();
  }
  while (stats_.disk_bytes > options_.disk_bytes) {
    const std::string id = least_recent(/*on_disk=*/true);
    if (id.empty()) break;
    DropLocked(id);
  }
}

void SessionTiers::DropLocked(const std::string& id) {
  auto it = entries_.find(Key(id));
  if (it == entries_.end()) return;
  Entry& e = it->second;
  if (e.on_disk) {
    --stats_.disk_sessions;
    stats_.disk_bytes -= e.bytes;
    stats_.disk_tokens -= e.tokens;
    tasks_.push_back({id, 0, nullptr});  // remove its file
    work_cv_.notify_one();
  } else {
    --stats_.host_sessions;
    stats_.host_bytes -= e.bytes;
    stats_.host_tokens -= e.tokens;
    if (e.spilling) stats_.host_spilling_bytes -= e.bytes;  // the writer removes what it wrote
  }
  ++stats_.dropped_total;
  entries_.erase(it);
}

absl::StatusOr<SessionImage> SessionTiers::Take(std::string_view id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(Key(id));
    if (it == entries_.end()) {
      return absl::NotFoundError(
          absl::StrCat("no tier holds the KV cache of session ", std::string(id)));
    }
    Entry& e = it->second;
    if (!e.on_disk) {
      SessionImage image = *e.image;
      --stats_.host_sessions;
      stats_.host_bytes -= e.bytes;
      stats_.host_tokens -= e.tokens;
      if (e.spilling) stats_.host_spilling_bytes -= e.bytes;
      ++stats_.restored_host_total;
      entries_.erase(it);
      return image;
    }
    --stats_.disk_sessions;
    stats_.disk_bytes -= e.bytes;
    stats_.disk_tokens -= e.tokens;
    entries_.erase(it);
  }
  absl::StatusOr<SessionImage> image = ReadFile(id);
  std::lock_guard<std::mutex> lock(mu_);
  if (!OnDiskLocked(id)) (void)dir_->Remove(id);
  if (image.ok()) {
    ++stats_.restored_disk_total;
  } else {
    ++stats_.errors_total;
  }
  return image;
}

absl::StatusOr<SessionImage> SessionTiers::Get(std::string_view id) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(Key(id));
    if (it == entries_.end()) {
      return absl::NotFoundError(
          absl::StrCat("no tier holds the KV cache of session ", std::string(id)));
    }
    if (!it->second.on_disk) return *it->second.image;
  }
  return ReadFile(id);
}

std::string SessionTiers::Encode(const SessionImage& image) const {
  if (options_.compact_image != nullptr && !image.cache.empty()) {
    absl::StatusOr<std::string> compact = options_.compact_image(image.cache);
    if (compact.ok()) {
      SessionImage copy = image;
      copy.cache = *std::move(compact);
      return EncodeSessionSnapshot(copy, options_.identity);
    }
    // Not the cache's own image (it cannot be): written as it is, which imports the same.
  }
  return EncodeSessionSnapshot(image, options_.identity);
}

absl::StatusOr<SessionImage> SessionTiers::ReadFile(std::string_view id) const {
  absl::StatusOr<std::string> bytes =
      dir_->Read(dir_->PathOf(id), static_cast<uint64_t>(options_.max_image_bytes));
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<SessionImage> image = DecodeSessionSnapshot(
      *bytes, options_.identity, static_cast<uint64_t>(options_.max_image_bytes));
  if (!image.ok()) return image.status();
  if (image->id != id) {
    return absl::DataLossError(absl::StrCat("the disk tier's file for session ", std::string(id),
                                            " holds session ", image->id));
  }
  return image;
}

void SessionTiers::Erase(std::string_view id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!entries_.contains(Key(id))) return;
  DropLocked(std::string(id));
  --stats_.dropped_total;  // forgotten, not given up for room
}

bool SessionTiers::OnDiskLocked(std::string_view id) const {
  auto it = entries_.find(Key(id));
  return it != entries_.end() && it->second.on_disk;
}

CacheLocation SessionTiers::Where(std::string_view id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(Key(id));
  if (it == entries_.end()) return CacheLocation::kNone;
  return it->second.on_disk ? CacheLocation::kDisk : CacheLocation::kHost;
}

SessionTierStats SessionTiers::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void TierRestoreLatency::Add(double seconds) {
  size_t i = 0;
  while (i < kBounds.size() && seconds > kBounds[i]) ++i;
  ++counts[i];
  sum_seconds += seconds;
}

void SessionTiers::RecordRestore(CacheLocation from, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  (from == CacheLocation::kDisk ? stats_.restore_disk : stats_.restore_host).Add(seconds);
}

void SessionTiers::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] { return (tasks_.empty() && !writing_) || stop_; });
}

void SessionTiers::Writer() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
    if (stop_) break;
    Task task = std::move(tasks_.front());
    tasks_.pop_front();
    if (task.image == nullptr) {
      // A dropped or erased entry's file, unless a newer entry of the id has been written since.
      if (!OnDiskLocked(task.id)) (void)dir_->Remove(task.id);
    } else {
      auto it = entries_.find(task.id);
      if (it != entries_.end() && it->second.generation == task.generation && it->second.spilling) {
        writing_ = true;
        lock.unlock();
        const std::string bytes = Encode(*task.image);
        const absl::Status written = dir_->Write(task.id, bytes);
        task.image.reset();
        lock.lock();
        writing_ = false;
        it = entries_.find(task.id);
        const bool current = it != entries_.end() && it->second.generation == task.generation;
        if (!current) {
          // Taken, erased or dropped while it was written: the file is stale even when a newer
          // entry of the id exists (that one is written by a later task, the queue is in order).
          if (written.ok()) (void)dir_->Remove(task.id);
        } else if (!written.ok()) {
          ++stats_.errors_total;
          DropLocked(task.id);
        } else {
          Entry& e = it->second;
          --stats_.host_sessions;
          stats_.host_bytes -= e.bytes;
          stats_.host_tokens -= e.tokens;
          stats_.host_spilling_bytes -= e.bytes;
          e.image.reset();
          e.spilling = false;
          e.on_disk = true;
          e.bytes = static_cast<int64_t>(bytes.size());
          ++stats_.disk_sessions;
          stats_.disk_bytes += e.bytes;
          stats_.disk_tokens += e.tokens;
          ++stats_.spilled_total;
          MakeRoomLocked();
        }
      }
    }
    if (tasks_.empty()) idle_cv_.notify_all();
  }
  idle_cv_.notify_all();
}

}  // namespace subspace
