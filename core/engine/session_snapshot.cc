#include "core/engine/session_snapshot.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/kvcache/sequence_image.h"

namespace subspace {

namespace {

constexpr char kMagic[16] = {'S', 'U', 'B', 'S', 'P', 'A', 'C', 'E',
                             '-', 'S', 'E', 'S', 'S', 'I', 'O', 'N'};
constexpr uint32_t Tag(const char (&s)[5]) {
  return static_cast<uint32_t>(static_cast<uint8_t>(s[0])) |
         static_cast<uint32_t>(static_cast<uint8_t>(s[1])) << 8 |
         static_cast<uint32_t>(static_cast<uint8_t>(s[2])) << 16 |
         static_cast<uint32_t>(static_cast<uint8_t>(s[3])) << 24;
}
constexpr uint32_t kMeta = Tag("META");
constexpr uint32_t kSession = Tag("SESS");
constexpr uint32_t kCache = Tag("KVC0");
constexpr int kZstdLevel = 3;
constexpr uint64_t kMaxIdBytes = 1024;
constexpr uint64_t kMaxOwnerBytes = 64 * 1024;
constexpr uint64_t kMaxNameBytes = 4096;
constexpr const char* kSuffix = ".session";

absl::string_view A(std::string_view s) { return absl::string_view(s.data(), s.size()); }

std::string TagName(uint32_t tag) {
  std::string s(4, '?');
  for (int i = 0; i < 4; ++i) {
    const char c = static_cast<char>((tag >> (8 * i)) & 0xff);
    s[static_cast<size_t>(i)] = absl::ascii_isprint(static_cast<unsigned char>(c)) ? c : '?';
  }
  return s;
}

// CRC-32 (zlib's) of a section's stored bytes: zstd's own checksum covers what a frame
// decodes to, and a flipped bit that changes nothing decoded would pass it.
uint32_t Crc32(std::string_view bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (size_t done = 0; done < bytes.size();) {
    const uInt n = static_cast<uInt>(std::min<size_t>(bytes.size() - done, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + done), n);
    done += n;
  }
  return static_cast<uint32_t>(crc);
}

void AppendSection(ImageWriter& file, uint32_t tag, std::string_view content) {
  std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> ctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
  ZSTD_CCtx_setParameter(ctx.get(), ZSTD_c_compressionLevel, kZstdLevel);
  ZSTD_CCtx_setParameter(ctx.get(), ZSTD_c_checksumFlag, 1);
  ZSTD_CCtx_setParameter(ctx.get(), ZSTD_c_contentSizeFlag, 1);
  std::string frame(ZSTD_compressBound(content.size()), '\0');
  const size_t n =
      ZSTD_compress2(ctx.get(), frame.data(), frame.size(), content.data(), content.size());
  // Compressing into ZSTD_compressBound bytes cannot fail but for memory, which throws first.
  frame.resize(ZSTD_isError(n) ? 0 : n);
  file.U32(tag);
  file.U64(frame.size());
  file.U64(content.size());
  file.U32(Crc32(frame));
  file.Raw(frame.data(), frame.size());
}

// The next section, which must be `tag`, checked and expanded.
absl::StatusOr<std::string> ReadSection(ImageReader& file, uint32_t tag, uint64_t max_bytes) {
  absl::StatusOr<uint32_t> got = file.U32("section tag");
  if (!got.ok()) return got.status();
  if (*got != tag) {
    return file.Corrupt(
        absl::StrCat("section '", TagName(*got), "' where '", TagName(tag), "' belongs"));
  }
  const std::string name = TagName(tag);
  absl::StatusOr<uint64_t> stored = file.U64(name + " stored size");
  absl::StatusOr<uint64_t> content = file.U64(name + " size");
  absl::StatusOr<uint32_t> crc = file.U32(name + " checksum");
  if (!stored.ok()) return stored.status();
  if (!content.ok()) return content.status();
  if (!crc.ok()) return crc.status();
  if (*content > max_bytes) {
    return file.Corrupt(absl::StrFormat("section %s claims %d bytes, more than the limit %d", name,
                                        *content, max_bytes));
  }
  absl::StatusOr<std::string_view> frame = file.Raw(name, *stored);
  if (!frame.ok()) return frame.status();
  if (Crc32(*frame) != *crc) {
    return file.Corrupt(absl::StrCat("section ", name, " fails its checksum"));
  }
  if (ZSTD_findFrameCompressedSize(frame->data(), frame->size()) != frame->size() ||
      ZSTD_getFrameContentSize(frame->data(), frame->size()) != *content) {
    return file.Corrupt(absl::StrCat("section ", name, " is not one frame of its stated size"));
  }
  std::string out(static_cast<size_t>(*content), '\0');
  const size_t n = ZSTD_decompress(out.data(), out.size(), frame->data(), frame->size());
  if (ZSTD_isError(n) || n != out.size()) {
    return file.Corrupt(absl::StrCat("section ", name, ": ",
                                     ZSTD_isError(n) ? ZSTD_getErrorName(n) : "short frame"));
  }
  return out;
}

std::string FileName(std::string_view id) {
  const bool plain =
      !id.empty() && id.size() <= 128 && std::all_of(id.begin(), id.end(), [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
      });
  return absl::StrCat(plain ? std::string(id) : "x" + absl::BytesToHexString(A(id)), kSuffix);
}

absl::Status OsError(std::string_view what, const std::string& path) {
  const int err = errno;
  return absl::Status(err == ENOSPC || err == EDQUOT ? absl::StatusCode::kResourceExhausted
                                                     : absl::StatusCode::kUnavailable,
                      absl::StrCat(A(what), " ", path, ": ", std::strerror(err)));
}

}  // namespace

std::string EncodeSessionSnapshot(const SessionImage& image, const SnapshotIdentity& identity) {
  ImageWriter meta;
  meta.U64(identity.model_checksum);
  meta.Bytes(identity.model_name);

  ImageWriter sess;
  sess.Bytes(image.id);
  sess.Bytes(image.owner);
  sess.I64(absl::ToInt64Milliseconds(image.idle_ttl));
  sess.I64(absl::ToUnixMicros(image.created));
  sess.I64(absl::ToUnixMicros(image.last_used));
  sess.U8(image.refresh.has_value() ? 1 : 0);
  if (image.refresh.has_value()) {
    const RefreshConfig& r = *image.refresh;
    sess.U8(static_cast<uint8_t>(r.method));
    sess.I64(r.every_tokens);
    sess.F64(r.residual_threshold);
    sess.F64(r.half_life_tokens);
    sess.F64(r.oja_learning_rate);
    sess.I64(r.max_epochs);
  }
  sess.I64(image.cached);
  sess.I64(static_cast<int64_t>(image.tokens.size()));
  sess.Raw(image.tokens.data(), image.tokens.size() * sizeof(int32_t));

  ImageWriter cache;
  cache.Bytes(image.cache_layout);
  cache.Bytes(image.cache);

  ImageWriter file;
  file.Raw(kMagic, sizeof(kMagic));
  file.U32(kSessionSnapshotVersion);
  file.U32(3);
  AppendSection(file, kMeta, meta.data());
  AppendSection(file, kSession, sess.data());
  AppendSection(file, kCache, cache.data());
  return file.Take();
}

absl::StatusOr<SessionImage> DecodeSessionSnapshot(std::string_view bytes,
                                                   const SnapshotIdentity& expected,
                                                   uint64_t max_section_bytes) {
  ImageReader file(bytes, "session snapshot");
  absl::StatusOr<std::string_view> magic = file.Raw("magic", sizeof(kMagic));
  if (!magic.ok()) return magic.status();
  if (std::memcmp(magic->data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError("not a session snapshot (its first 16 bytes are not the magic)");
  }
  absl::StatusOr<uint32_t> version = file.U32("version");
  absl::StatusOr<uint32_t> sections = file.U32("section count");
  if (!version.ok()) return version.status();
  if (!sections.ok()) return sections.status();
  if (*version != kSessionSnapshotVersion) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session snapshot format v%d; this server reads v%d", *version, kSessionSnapshotVersion));
  }
  if (*sections != 3) return file.Corrupt(absl::StrFormat("%d sections, v1 has 3", *sections));

  absl::StatusOr<std::string> meta_bytes = ReadSection(file, kMeta, max_section_bytes);
  if (!meta_bytes.ok()) return meta_bytes.status();
  ImageReader meta(*meta_bytes, "session snapshot META");
  absl::StatusOr<uint64_t> checksum = meta.U64("model checksum");
  if (!checksum.ok()) return checksum.status();
  absl::StatusOr<std::string_view> model_name = meta.Bytes("model name", kMaxNameBytes);
  if (!model_name.ok()) return model_name.status();
  if (absl::Status st = meta.ExpectEnd(); !st.ok()) return st;
  if (*checksum != expected.model_checksum) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session snapshot of another model: %s (checksum %016x); this server runs %s "
        "(checksum %016x)",
        *model_name, *checksum, expected.model_name, expected.model_checksum));
  }

  absl::StatusOr<std::string> sess_bytes = ReadSection(file, kSession, max_section_bytes);
  if (!sess_bytes.ok()) return sess_bytes.status();
  ImageReader sess(*sess_bytes, "session snapshot SESS");
  SessionImage image;
  absl::StatusOr<std::string_view> id = sess.Bytes("id", kMaxIdBytes);
  if (!id.ok()) return id.status();
  if (id->empty()) return sess.Corrupt("empty session id");
  image.id = std::string(*id);
  absl::StatusOr<std::string_view> owner = sess.Bytes("owner", kMaxOwnerBytes);
  if (!owner.ok()) return owner.status();
  image.owner = std::string(*owner);
  absl::StatusOr<int64_t> ttl_ms = sess.Int("idle TTL", 1, int64_t{1} << 50);
  absl::StatusOr<int64_t> created = sess.I64("created");
  absl::StatusOr<int64_t> last_used = sess.I64("last used");
  absl::StatusOr<uint8_t> has_refresh = sess.U8("refresh");
  if (!ttl_ms.ok()) return ttl_ms.status();
  if (!created.ok()) return created.status();
  if (!last_used.ok()) return last_used.status();
  if (!has_refresh.ok()) return has_refresh.status();
  image.idle_ttl = absl::Milliseconds(*ttl_ms);
  image.created = absl::FromUnixMicros(*created);
  image.last_used = absl::FromUnixMicros(*last_used);
  if (*has_refresh > 1) return sess.Corrupt("refresh flag");
  if (*has_refresh == 1) {
    RefreshConfig r;
    absl::StatusOr<uint8_t> method = sess.U8("refresh method");
    absl::StatusOr<int64_t> every = sess.I64("refresh every");
    absl::StatusOr<double> threshold = sess.F64("refresh threshold");
    absl::StatusOr<double> half_life = sess.F64("refresh half-life");
    absl::StatusOr<double> rate = sess.F64("refresh rate");
    absl::StatusOr<int64_t> max_epochs = sess.Int("refresh epochs", 1, 1 << 20);
    for (const absl::Status& st : {method.status(), every.status(), threshold.status(),
                                   half_life.status(), rate.status(), max_epochs.status()}) {
      if (!st.ok()) return st;
    }
    if (*method > static_cast<uint8_t>(RefreshMethod::kFd)) return sess.Corrupt("refresh method");
    r.method = static_cast<RefreshMethod>(*method);
    r.every_tokens = *every;
    r.residual_threshold = *threshold;
    r.half_life_tokens = *half_life;
    r.oja_learning_rate = *rate;
    r.max_epochs = static_cast<int>(*max_epochs);
    if (absl::Status st = ValidateRefreshConfig(r); !st.ok()) {
      return sess.Corrupt(absl::StrCat("refresh: ", st.message()));
    }
    image.refresh = r;
  }
  absl::StatusOr<int64_t> cached = sess.Int("cached", 0, int64_t{1} << 40);
  if (!cached.ok()) return cached.status();
  absl::StatusOr<int64_t> n_tokens =
      sess.Int("tokens", 0, static_cast<int64_t>(sess.left() / sizeof(int32_t)));
  if (!n_tokens.ok()) return n_tokens.status();
  if (*cached > *n_tokens) return sess.Corrupt("more cached tokens than tokens");
  image.cached = *cached;
  absl::StatusOr<std::string_view> tokens =
      sess.Raw("tokens", static_cast<uint64_t>(*n_tokens) * sizeof(int32_t));
  if (!tokens.ok()) return tokens.status();
  image.tokens.resize(static_cast<size_t>(*n_tokens));
  // An empty vector's data() may be null, which memcpy may not be given even for 0 bytes.
  if (!tokens->empty()) std::memcpy(image.tokens.data(), tokens->data(), tokens->size());
  if (absl::Status st = sess.ExpectEnd(); !st.ok()) return st;

  absl::StatusOr<std::string> cache_bytes = ReadSection(file, kCache, max_section_bytes);
  if (!cache_bytes.ok()) return cache_bytes.status();
  ImageReader cache(*cache_bytes, "session snapshot KVC0");
  absl::StatusOr<std::string_view> layout = cache.Bytes("cache layout", kMaxNameBytes);
  if (!layout.ok()) return layout.status();
  absl::StatusOr<std::string_view> kv = cache.Bytes("cache image", max_section_bytes);
  if (!kv.ok()) return kv.status();
  if (absl::Status st = cache.ExpectEnd(); !st.ok()) return st;
  if (kv->empty() != (image.cached == 0)) {
    return cache.Corrupt("a cache image without cached tokens, or cached tokens without one");
  }
  image.cache_layout = std::string(*layout);
  image.cache = std::string(*kv);
  if (absl::Status st = file.ExpectEnd(); !st.ok()) return st;
  return image;
}

// ---- SnapshotDirectory ----------------------------------------------------------------------

absl::StatusOr<SnapshotDirectory> SnapshotDirectory::Open(std::string path) {
  if (path.empty()) return absl::InvalidArgumentError("the session directory is empty");
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    return OsError("cannot create the session directory", path);
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return OsError("cannot stat the session directory", path);
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a directory"));
  }
  if (::access(path.c_str(), R_OK | W_OK | X_OK) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("the session directory ", path, " is not readable and writable"));
  }
  return SnapshotDirectory(std::move(path));
}

std::string SnapshotDirectory::PathOf(std::string_view session_id) const {
  return absl::StrCat(path_, "/", FileName(session_id));
}

absl::Status SnapshotDirectory::Write(std::string_view session_id, std::string_view bytes) const {
  const std::string final_path = PathOf(session_id);
  const std::string tmp = absl::StrCat(final_path, ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return OsError("cannot create", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status st = OsError("cannot write", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return st;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    absl::Status st = OsError("cannot sync", tmp);
    ::close(fd);
    ::unlink(tmp.c_str());
    return st;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    absl::Status st = OsError("cannot rename into place", final_path);
    ::unlink(tmp.c_str());
    return st;
  }
  // The rename is durable once the directory is.
  const int dir = ::open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    (void)::fsync(dir);
    ::close(dir);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SnapshotDirectory::Read(const std::string& file,
                                                    uint64_t max_bytes) const {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return OsError("cannot open", file);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat(file, " is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    return absl::DataLossError(
        absl::StrFormat("%s is %d bytes, more than the limit %d", file, st.st_size, max_bytes));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  out.resize(done);
  return out;
}

absl::Status SnapshotDirectory::Remove(std::string_view session_id) const {
  const std::string path = PathOf(session_id);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return OsError("cannot remove", path);
  return absl::OkStatus();
}

absl::Status SnapshotDirectory::Reject(const std::string& file) const {
  const std::string to = absl::StrCat(file, ".rejected");
  if (::rename(file.c_str(), to.c_str()) != 0) return OsError("cannot move aside", file);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> SnapshotDirectory::List() const {
  DIR* dir = ::opendir(path_.c_str());
  if (dir == nullptr) return OsError("cannot list", path_);
  std::vector<std::string> files;
  while (const dirent* e = ::readdir(dir)) {
    const absl::string_view name = e->d_name;
    const std::string full = absl::StrCat(path_, "/", name);
    if (absl::EndsWith(name, absl::StrCat(kSuffix, ".tmp"))) {
      ::unlink(full.c_str());  // a write a crash cut short
    } else if (absl::EndsWith(name, kSuffix)) {
      files.push_back(full);
    }
  }
  ::closedir(dir);
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace subspace
