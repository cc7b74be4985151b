// GGUF v2/v3 parser. The file is untrusted input: every count and length is checked against
// the bytes that remain before anything is allocated, all size arithmetic is overflow-checked,
// and each error names the field and byte offset so a corrupt download is easy to diagnose.
#include "core/gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace subspace {

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader assumes a little-endian host");

namespace {

constexpr char kMagic[4] = {'G', 'G', 'U', 'F'};
constexpr uint64_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;
// Arrays of arrays are legal GGUF but nothing real nests deeply; the cap bounds recursion.
constexpr int kMaxArrayDepth = 8;
// Each metadata value costs ~100 bytes in memory however small it is on disk (a uint8 array
// element is 1 byte), so cap the total to keep a hostile file from ballooning memory.
// Real vocabularies use well under a million values.
constexpr uint64_t kMaxMetadataValues = uint64_t{1} << 24;

// Per value type, indexed by its GGUF id: its name and its smallest on-disk encoding, used to
// bound counts before allocating (a string is at least its u64 length, an array its u32
// element type and u64 count).
struct ValueTypeInfo {
  const char* name;
  uint64_t min_size;
};
constexpr ValueTypeInfo kValueTypes[] = {
    {"uint8", 1},  {"int8", 1},    {"uint16", 2},  {"int16", 2},  {"uint32", 4},
    {"int32", 4},  {"float32", 4}, {"bool", 1},    {"string", 8}, {"array", 12},
    {"uint64", 8}, {"int64", 8},   {"float64", 8},
};

bool IsValidValueType(uint32_t raw) {
  return raw <= static_cast<uint32_t>(GgufValueType::kFloat64);
}

bool IsIntegerType(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
      return true;
    default:
      return false;
  }
}

bool IsFloatType(GgufValueType t) {
  return t == GgufValueType::kFloat32 || t == GgufValueType::kFloat64;
}

bool IsSignedType(GgufValueType t) {
  return t == GgufValueType::kInt8 || t == GgufValueType::kInt16 || t == GgufValueType::kInt32 ||
         t == GgufValueType::kInt64;
}

// Keys and tensor names are arbitrary bytes of any length; keep error messages printable and
// short.
std::string Quote(absl::string_view name) {
  constexpr size_t kMaxShown = 64;
  std::string out = absl::StrCat("'", absl::CHexEscape(name.substr(0, kMaxShown)), "'");
  if (name.size() > kMaxShown) absl::StrAppend(&out, "...");
  return out;
}

// Bounds-checked little-endian reader over the file. `context_` names the item being parsed
// ("tensor info 3 'blk.0.attn_q.weight'") so errors can say where they happened.
class Cursor {
 public:
  Cursor(const uint8_t* data, uint64_t size) : data_(data), size_(size) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }
  void set_context(std::string context) { context_ = std::move(context); }

  absl::Status Need(uint64_t n, absl::string_view field) const {
    if (n <= remaining()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("gguf: truncated at byte ", pos_, " reading ",
                                                   context_, " (", field, "): need ", n, " bytes, ",
                                                   remaining(), " left"));
  }

  template <typename T>
  absl::Status Read(T* out, absl::string_view field) {
    if (absl::Status s = Need(sizeof(T), field); !s.ok()) return s;
    std::memcpy(out, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }

  absl::Status ReadString(std::string* out, absl::string_view field) {
    uint64_t len = 0;
    if (absl::Status s = Read(&len, absl::StrCat(field, " length")); !s.ok()) return s;
    if (absl::Status s = Need(len, field); !s.ok()) return s;
    out->assign(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += len;
    return absl::OkStatus();
  }

  // A semantic error about the current item; `at` is the byte offset of the bad field.
  absl::Status Invalid(uint64_t at, absl::string_view message) const {
    return absl::InvalidArgumentError(
        absl::StrCat("gguf: ", context_, " at byte ", at, ": ", message));
  }

 private:
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
  std::string context_ = "header";
};

absl::Status ReadValue(Cursor& c, GgufValueType type, int depth, uint64_t* budget, GgufValue* out);

absl::Status ReadArray(Cursor& c, int depth, uint64_t* budget, GgufValue* out) {
  const uint64_t at = c.pos();
  if (depth >= kMaxArrayDepth) {
    return c.Invalid(at, absl::StrCat("arrays nested deeper than ", kMaxArrayDepth));
  }
  uint32_t raw_elem = 0;
  if (absl::Status s = c.Read(&raw_elem, "array element type"); !s.ok()) return s;
  if (!IsValidValueType(raw_elem)) {
    return c.Invalid(at, absl::StrCat("unknown array element type ", raw_elem));
  }
  const auto elem_type = static_cast<GgufValueType>(raw_elem);
  uint64_t count = 0;
  const uint64_t count_at = c.pos();
  if (absl::Status s = c.Read(&count, "array length"); !s.ok()) return s;
  // Checked before reserve(): a corrupt count of 2^60 must fail here, not in the allocator.
  const uint64_t min_size = kValueTypes[raw_elem].min_size;
  if (count > c.remaining() / min_size) {
    return c.Invalid(count_at, absl::StrCat("array of ", count, " ", GgufValueTypeName(elem_type),
                                            " needs at least ", min_size, " bytes each but only ",
                                            c.remaining(), " bytes remain"));
  }
  if (count > *budget) {
    return c.Invalid(count_at, absl::StrCat("array of ", count, " elements exceeds the limit of ",
                                            kMaxMetadataValues, " metadata values per file"));
  }
  *budget -= count;
  out->elem_type = elem_type;
  out->array.resize(static_cast<size_t>(count));
  for (GgufValue& elem : out->array) {
    if (absl::Status s = ReadValue(c, elem_type, depth + 1, budget, &elem); !s.ok()) return s;
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status ReadInteger(Cursor& c, GgufValue* out) {
  T v;
  if (absl::Status s = c.Read(&v, "value"); !s.ok()) return s;
  if constexpr (std::is_signed_v<T>) {
    out->i = v;
    if (v >= 0) out->u = static_cast<uint64_t>(v);
  } else {
    out->u = v;
    if (static_cast<uint64_t>(v) <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      out->i = static_cast<int64_t>(v);
    }
  }
  return absl::OkStatus();
}

absl::Status ReadValue(Cursor& c, GgufValueType type, int depth, uint64_t* budget, GgufValue* out) {
  out->type = type;
  switch (type) {
    case GgufValueType::kUint8:
      return ReadInteger<uint8_t>(c, out);
    case GgufValueType::kInt8:
      return ReadInteger<int8_t>(c, out);
    case GgufValueType::kUint16:
      return ReadInteger<uint16_t>(c, out);
    case GgufValueType::kInt16:
      return ReadInteger<int16_t>(c, out);
    case GgufValueType::kUint32:
      return ReadInteger<uint32_t>(c, out);
    case GgufValueType::kInt32:
      return ReadInteger<int32_t>(c, out);
    case GgufValueType::kUint64:
      return ReadInteger<uint64_t>(c, out);
    case GgufValueType::kInt64:
      return ReadInteger<int64_t>(c, out);
    case GgufValueType::kFloat32: {
      float v;
      if (absl::Status s = c.Read(&v, "value"); !s.ok()) return s;
      out->f = v;
      return absl::OkStatus();
    }
    case GgufValueType::kFloat64:
      return c.Read(&out->f, "value");
    case GgufValueType::kBool: {
      const uint64_t at = c.pos();
      uint8_t v;
      if (absl::Status s = c.Read(&v, "value"); !s.ok()) return s;
      if (v > 1) return c.Invalid(at, absl::StrCat("bool value ", v, " (must be 0 or 1)"));
      out->b = v != 0;
      return absl::OkStatus();
    }
    case GgufValueType::kString:
      return c.ReadString(&out->s, "string");
    case GgufValueType::kArray:
      return ReadArray(c, depth, budget, out);
  }
  return c.Invalid(c.pos(), "unknown value type");  // unreachable: callers validate the type
}

// Reads one tensor info (after its name), validating everything that can be checked before
// the data section's position is known.
absl::Status ReadTensorInfo(Cursor& c, uint64_t alignment, GgufTensorInfo* t) {
  uint64_t at = c.pos();
  uint32_t n_dims = 0;
  if (absl::Status s = c.Read(&n_dims, "n_dims"); !s.ok()) return s;
  if (n_dims == 0 || n_dims > kMaxDims) {
    return c.Invalid(at, absl::StrCat("n_dims ", n_dims, " (must be 1..", kMaxDims, ")"));
  }
  int64_t num_elements = 1;
  bool elements_overflow = false;
  for (uint32_t d = 0; d < n_dims; ++d) {
    at = c.pos();
    uint64_t dim = 0;
    if (absl::Status s = c.Read(&dim, absl::StrCat("dims[", d, "]")); !s.ok()) return s;
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return c.Invalid(at, absl::StrCat("dims[", d, "] = ", dim, " exceeds int64"));
    }
    t->dims.push_back(static_cast<int64_t>(dim));
    elements_overflow |=
        __builtin_mul_overflow(num_elements, static_cast<int64_t>(dim), &num_elements);
  }
  if (elements_overflow) {
    return c.Invalid(at, "element count (product of dims) overflows int64");
  }
  t->num_elements = num_elements;

  at = c.pos();
  uint32_t raw_type = 0;
  if (absl::Status s = c.Read(&raw_type, "type"); !s.ok()) return s;
  if (!IsSupportedTensorType(raw_type)) {
    return c.Invalid(
        at, absl::StrCat("unsupported tensor type ", raw_type, " (",
                         TensorTypeName(static_cast<TensorType>(raw_type)),
                         "); supported: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, "
                         "q4_K, q5_K, q6_K, iq4_nl"));
  }
  t->type = static_cast<TensorType>(raw_type);
  const int64_t block = TensorBlockElems(t->type);
  if (t->dims[0] % block != 0) {
    return c.Invalid(
        at, absl::StrCat(TensorTypeName(t->type), " needs dims[0] to be a multiple of ", block,
                         ", got ", t->dims[0]));
  }
  if (__builtin_mul_overflow(static_cast<uint64_t>(num_elements / block), TensorBlockBytes(t->type),
                             &t->num_bytes)) {
    return c.Invalid(at, "tensor byte size overflows uint64");
  }

  at = c.pos();
  if (absl::Status s = c.Read(&t->offset, "offset"); !s.ok()) return s;
  if (t->offset % alignment != 0) {
    return c.Invalid(
        at, absl::StrCat("offset ", t->offset, " is not a multiple of the alignment ", alignment));
  }
  return absl::OkStatus();
}

}  // namespace

const char* GgufValueTypeName(GgufValueType type) {
  const auto id = static_cast<uint32_t>(type);
  return IsValidValueType(id) ? kValueTypes[id].name : "unknown";
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("gguf: cannot open ", path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("gguf: cannot stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("gguf: ", path, " is not a regular file"));
  }
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->size_ = static_cast<uint64_t>(st.st_size);
  // mmap rejects length 0; an empty file then fails parsing with a "truncated" error.
  if (file->size_ > 0) {
    void* mapped = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapped == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat("gguf: cannot mmap ", path));
    }
    file->mapped_ = mapped;
    file->bytes_ = static_cast<const uint8_t*>(mapped);
  }
  ::close(fd);  // the mapping keeps its own reference to the file
  if (absl::Status s = file->Parse(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::FromBytes(std::string bytes) {
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->owned_ = std::move(bytes);
  file->bytes_ = reinterpret_cast<const uint8_t*>(file->owned_.data());
  file->size_ = file->owned_.size();
  if (absl::Status s = file->Parse(); !s.ok()) return s;
  return file;
}

GgufFile::~GgufFile() {
  if (mapped_ != nullptr) ::munmap(mapped_, size_);
}

absl::Status GgufFile::Parse() {
  Cursor c(bytes_, size_);
  char magic[4];
  if (absl::Status s = c.Read(&magic, "magic"); !s.ok()) return s;
  if (std::memcmp(magic, kMagic, sizeof(magic)) != 0) {
    return c.Invalid(0, "bad magic (not a GGUF file)");
  }
  if (absl::Status s = c.Read(&version_, "version"); !s.ok()) return s;
  if (version_ == 1) {
    return c.Invalid(4,
                     "version 1 (32-bit counts) is not supported; re-convert the model to "
                     "GGUF v3");
  }
  if (version_ != 2 && version_ != 3) {
    // A big-endian v3 file reads as 0x03000000 here; say so instead of a baffling number.
    const uint32_t swapped = __builtin_bswap32(version_);
    if (swapped == 2 || swapped == 3) {
      return c.Invalid(4, absl::StrCat("big-endian GGUF (version ", swapped, ") is not supported"));
    }
    return c.Invalid(4, absl::StrCat("unsupported version ", version_, " (supported: 2, 3)"));
  }
  uint64_t tensor_count = 0;
  uint64_t kv_count = 0;
  if (absl::Status s = c.Read(&tensor_count, "tensor_count"); !s.ok()) return s;
  if (absl::Status s = c.Read(&kv_count, "kv_count"); !s.ok()) return s;

  // Smallest kv: u64 key length, u32 type, 1-byte value. Smallest tensor info: u64 name
  // length, u32 n_dims, one u64 dim, u32 type, u64 offset.
  constexpr uint64_t kMinKvBytes = 8 + 4 + 1;
  constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;
  if (kv_count > c.remaining() / kMinKvBytes) {
    return c.Invalid(16, absl::StrCat("kv_count ", kv_count, " cannot fit in the ", c.remaining(),
                                      " bytes that remain"));
  }
  if (tensor_count > c.remaining() / kMinTensorInfoBytes) {
    return c.Invalid(8, absl::StrCat("tensor_count ", tensor_count, " cannot fit in the ",
                                     c.remaining(), " bytes that remain"));
  }

  alignment_ = kDefaultAlignment;
  uint64_t budget = kMaxMetadataValues;
  for (uint64_t k = 0; k < kv_count; ++k) {
    c.set_context(absl::StrCat("metadata kv ", k));
    std::string key;
    const uint64_t key_at = c.pos();
    if (absl::Status s = c.ReadString(&key, "key"); !s.ok()) return s;
    c.set_context(absl::StrCat("metadata kv ", k, " ", Quote(key)));
    const uint64_t type_at = c.pos();
    uint32_t raw_type = 0;
    if (absl::Status s = c.Read(&raw_type, "value type"); !s.ok()) return s;
    if (!IsValidValueType(raw_type)) {
      return c.Invalid(type_at, absl::StrCat("unknown value type ", raw_type));
    }
    GgufValue value;
    if (absl::Status s =
            ReadValue(c, static_cast<GgufValueType>(raw_type), /*depth=*/0, &budget, &value);
        !s.ok()) {
      return s;
    }
    if (key == "general.alignment") {
      // Validated here, where the error can point at the value.
      if (value.type != GgufValueType::kUint32) {
        return c.Invalid(type_at,
                         absl::StrCat("must be uint32, got ", GgufValueTypeName(value.type)));
      }
      if (value.u == 0 || (value.u & (value.u - 1)) != 0) {
        return c.Invalid(type_at, absl::StrCat("alignment ", value.u, " is not a power of two"));
      }
      alignment_ = value.u;
    }
    if (!metadata_.emplace(std::move(key), std::move(value)).second) {
      return c.Invalid(key_at, "duplicate key");
    }
  }

  c.set_context("header");
  if (tensor_count > c.remaining() / kMinTensorInfoBytes) {
    return c.Invalid(8, absl::StrCat("tensor_count ", tensor_count, " cannot fit in the ",
                                     c.remaining(), " bytes left after the metadata"));
  }
  tensors_.reserve(static_cast<size_t>(tensor_count));
  std::vector<uint64_t> info_at;  // where each info starts, for the bounds errors below
  info_at.reserve(static_cast<size_t>(tensor_count));
  for (uint64_t i = 0; i < tensor_count; ++i) {
    c.set_context(absl::StrCat("tensor info ", i));
    GgufTensorInfo t;
    const uint64_t name_at = c.pos();
    info_at.push_back(name_at);
    if (absl::Status s = c.ReadString(&t.name, "name"); !s.ok()) return s;
    c.set_context(absl::StrCat("tensor info ", i, " ", Quote(t.name)));
    if (absl::Status s = ReadTensorInfo(c, alignment_, &t); !s.ok()) return s;
    if (!tensor_index_.emplace(t.name, tensors_.size()).second) {
      return c.Invalid(name_at, "duplicate tensor name");
    }
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the first aligned offset after the infos. A file without
  // tensors may end before that point (vocab-only files do), so only require it when needed.
  const uint64_t infos_end = c.pos();
  const uint64_t padding = (alignment_ - infos_end % alignment_) % alignment_;
  data_offset_ = infos_end + padding;  // infos_end <= size_, so no overflow
  if (tensors_.empty()) return absl::OkStatus();
  if (data_offset_ > size_) {
    c.set_context("data section");
    return c.Invalid(infos_end, absl::StrCat("starts at byte ", data_offset_,
                                             ", past the end of the ", size_, "-byte file"));
  }
  const uint64_t data_size = size_ - data_offset_;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    GgufTensorInfo& t = tensors_[i];
    if (t.offset > data_size || t.num_bytes > data_size - t.offset) {
      c.set_context(absl::StrCat("tensor info ", i, " ", Quote(t.name)));
      return c.Invalid(info_at[i], absl::StrCat("data at offset ", t.offset, " with ", t.num_bytes,
                                                " bytes runs past the end of the ", data_size,
                                                "-byte data section (file truncated?)"));
    }
    t.data = bytes_ + data_offset_ + t.offset;
  }
  return absl::OkStatus();
}

const GgufValue* GgufFile::Find(std::string_view key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

// This absl build's string_view is not std::string_view, so keys are converted for StrCat.
absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::StatusOr<const GgufValue*> Lookup(const GgufFile& f, std::string_view key) {
  const GgufValue* v = f.Find(key);
  if (v == nullptr) {
    return absl::NotFoundError(absl::StrCat("gguf: no metadata key '", AsAbsl(key), "'"));
  }
  return v;
}

absl::Status WrongType(absl::string_view key, const GgufValue& v, absl::string_view wanted) {
  std::string got = GgufValueTypeName(v.type);
  if (v.type == GgufValueType::kArray)
    absl::StrAppend(&got, " of ", GgufValueTypeName(v.elem_type));
  return absl::InvalidArgumentError(
      absl::StrCat("gguf: metadata '", key, "' is ", got, ", not ", wanted));
}

// Integer values convert when they fit: a negative value is no uint, and a uint64 above
// INT64_MAX is no int.
absl::StatusOr<uint64_t> AsUint(absl::string_view key, const GgufValue& v) {
  if (!IsIntegerType(v.type)) return WrongType(key, v, "an integer");
  if (IsSignedType(v.type) && v.i < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gguf: metadata '", key, "' is negative (", v.i, "), not an unsigned value"));
  }
  return v.u;
}

absl::StatusOr<int64_t> AsInt(absl::string_view key, const GgufValue& v) {
  if (!IsIntegerType(v.type)) return WrongType(key, v, "an integer");
  if (!IsSignedType(v.type) && v.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("gguf: metadata '", key, "' value ", v.u, " does not fit in int64"));
  }
  return v.i;
}

}  // namespace

absl::StatusOr<std::string> GgufFile::GetString(std::string_view key) const {
  absl::StatusOr<const GgufValue*> v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  if ((*v)->type != GgufValueType::kString) return WrongType(AsAbsl(key), **v, "string");
  return (*v)->s;
}

absl::StatusOr<uint64_t> GgufFile::GetUint(std::string_view key) const {
  absl::StatusOr<const GgufValue*> v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  return AsUint(AsAbsl(key), **v);
}

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  absl::StatusOr<const GgufValue*> v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  return AsInt(AsAbsl(key), **v);
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  absl::StatusOr<const GgufValue*> v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  if (!IsFloatType((*v)->type)) return WrongType(AsAbsl(key), **v, "float32 or float64");
  return (*v)->f;
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  absl::StatusOr<const GgufValue*> v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  if ((*v)->type != GgufValueType::kBool) return WrongType(AsAbsl(key), **v, "bool");
  return (*v)->b;
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(std::string_view key) const {
  absl::StatusOr<const GgufValue*> v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  const GgufValue& a = **v;
  if (a.type != GgufValueType::kArray || a.elem_type != GgufValueType::kString) {
    return WrongType(AsAbsl(key), a, "array of string");
  }
  std::vector<std::string> out;
  out.reserve(a.array.size());
  for (const GgufValue& e : a.array) out.push_back(e.s);
  return out;
}

absl::StatusOr<std::vector<float>> GgufFile::GetFloatArray(std::string_view key) const {
  absl::StatusOr<const GgufValue*> v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  const GgufValue& a = **v;
  if (a.type != GgufValueType::kArray || !IsFloatType(a.elem_type)) {
    return WrongType(AsAbsl(key), a, "array of float32 or float64");
  }
  std::vector<float> out;
  out.reserve(a.array.size());
  for (const GgufValue& e : a.array) out.push_back(static_cast<float>(e.f));
  return out;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  absl::StatusOr<const GgufValue*> v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  const GgufValue& a = **v;
  if (a.type != GgufValueType::kArray || !IsIntegerType(a.elem_type)) {
    return WrongType(AsAbsl(key), a, "array of integers");
  }
  std::vector<int64_t> out;
  out.reserve(a.array.size());
  for (size_t i = 0; i < a.array.size(); ++i) {
    const GgufValue& e = a.array[i];
    if (!IsSignedType(e.type) && e.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat("gguf: metadata '", AsAbsl(key), "[", i,
                                                     "]' value ", e.u, " does not fit in int64"));
    }
    out.push_back(e.i);
  }
  return out;
}

}  // namespace subspace
