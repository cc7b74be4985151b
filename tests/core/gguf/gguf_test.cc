// Tests for the GGUF reader: metadata and tensor round-trips through in-memory files, the
// corrupt-input paths (each must return a precise error, never crash or over-read), a cheap
// deterministic mutation fuzz, and the real fixtures under tests/data/.
#include "core/gguf/gguf.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/base/tensor_types.h"
#include "tests/core/gguf/gguf_test_util.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::GgufArrayHeader;
using ::subspace::testing::GgufBuilder;
using ::subspace::testing::GgufBytesOf;
using ::subspace::testing::GgufPod;
using ::subspace::testing::GgufStr;

constexpr uint32_t kArrayType = static_cast<uint32_t>(GgufValueType::kArray);

// Expects `expr` (a Status or StatusOr) to fail with `want_code` and a message containing
// `needle`.
#define EXPECT_GGUF_ERROR(expr, want_code, needle)                                    \
  do {                                                                                \
    const absl::Status status_ = (expr).status();                                     \
    EXPECT_EQ(status_.code(), (want_code)) << status_;                                \
    EXPECT_NE(std::string(status_.message()).find(needle), std::string::npos)         \
        << "message: " << status_.message() << "\nexpected to contain: " << (needle); \
  } while (0)

std::unique_ptr<GgufFile> ParseOrDie(std::string bytes) {
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(std::move(bytes));
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? std::move(*f) : nullptr;
}

// Every tensor's bytes must lie inside the file and its offset must respect the alignment.
void ExpectTensorsInBounds(const GgufFile& f) {
  const std::string_view file = f.bytes();
  const auto* begin = reinterpret_cast<const uint8_t*>(file.data());
  for (const GgufTensorInfo& t : f.tensors()) {
    ASSERT_NE(t.data, nullptr) << t.name;
    EXPECT_GE(t.data, begin) << t.name;
    EXPECT_LE(static_cast<uint64_t>(t.data - begin) + t.num_bytes, file.size()) << t.name;
    EXPECT_EQ(static_cast<uint64_t>(t.data - begin), f.data_offset() + t.offset) << t.name;
    EXPECT_EQ(t.offset % f.alignment(), 0u) << t.name;
  }
}

std::vector<float> Iota(int n, float scale) {
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = (i - n / 2) * scale;
  return v;
}

std::string Q8Blocks(const std::vector<float>& scales) {
  std::string out;
  for (size_t b = 0; b < scales.size(); ++b) {
    BlockQ8_0 block;
    block.scale_f16 = Fp32ToFp16(scales[b]);
    for (int j = 0; j < kQ8BlockSize; ++j) block.q[j] = static_cast<int8_t>(j * 8 - 128 + b);
    out += GgufPod(block);
  }
  return out;
}

// A small file touching every feature: all scalar types, arrays (incl. nested), four tensor
// types. Used for the truncation and mutation loops.
std::string ValidSmallFile(uint32_t version = 3) {
  std::vector<uint16_t> f16;
  for (float x : Iota(8, 0.5f)) f16.push_back(Fp32ToFp16(x));
  std::vector<uint16_t> bf16;
  for (float x : Iota(6, 0.25f)) bf16.push_back(Fp32ToBf16(x));
  std::string nested = GgufArrayHeader(GgufValueType::kArray, 2);
  nested +=
      GgufArrayHeader(GgufValueType::kUint16, 2) + GgufPod<uint16_t>(1) + GgufPod<uint16_t>(2);
  nested += GgufArrayHeader(GgufValueType::kUint16, 0);
  return GgufBuilder(version)
      .AddString("general.architecture", "llama")
      .AddUint8("u8", 200)
      .AddInt8("i8", -100)
      .AddUint16("u16", 60000)
      .AddInt16("i16", -30000)
      .AddUint32("u32", 4000000000u)
      .AddInt32("i32", -2000000000)
      .AddUint64("u64", 1ull << 40)
      .AddInt64("i64", -(1ll << 40))
      .AddFloat32("f32", 1.5f)
      .AddFloat64("f64", -2.25)
      .AddBool("yes", true)
      .AddStringArray("tokens", {"<s>", "", "hello"})
      .AddFloatArray("scores", {0.0f, -1.0f, 2.5f})
      .AddInt32Array("types", {1, 2, 3})
      .AddRaw("nested", kArrayType, nested)
      .AddTensor("w32", {4, 2}, TensorType::kF32, GgufBytesOf(Iota(8, 1.0f)))
      .AddTensor("w16", {8}, TensorType::kF16, GgufBytesOf(f16))
      .AddTensor("wbf", {3, 2}, TensorType::kBF16, GgufBytesOf(bf16))
      .AddTensor("wq8", {32, 2}, TensorType::kQ8_0, Q8Blocks({0.5f, 0.125f}))
      .Build();
}

TEST(GgufTest, EveryScalarTypeRoundTrips) {
  auto f = ParseOrDie(GgufBuilder()
                          .AddUint8("u8", 255)
                          .AddInt8("i8", -128)
                          .AddUint16("u16", 65535)
                          .AddInt16("i16", -32768)
                          .AddUint32("u32", 0xffffffffu)
                          .AddInt32("i32", std::numeric_limits<int32_t>::min())
                          .AddUint64("u64", std::numeric_limits<uint64_t>::max())
                          .AddInt64("i64", std::numeric_limits<int64_t>::min())
                          .AddFloat32("f32", 0.1f)
                          .AddFloat64("f64", 1e300)
                          .AddBool("t", true)
                          .AddBool("f", false)
                          .AddString("s", std::string("a\0b\xff", 4))
                          .AddString("empty", "")
                          .Build());
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->metadata().size(), 14u);
  EXPECT_EQ(*f->GetUint("u8"), 255u);
  EXPECT_EQ(*f->GetInt("i8"), -128);
  EXPECT_EQ(*f->GetUint("u16"), 65535u);
  EXPECT_EQ(*f->GetInt("i16"), -32768);
  EXPECT_EQ(*f->GetUint("u32"), 0xffffffffu);
  EXPECT_EQ(*f->GetInt("u32"), 0xffffffffll);
  EXPECT_EQ(*f->GetInt("i32"), std::numeric_limits<int32_t>::min());
  EXPECT_EQ(*f->GetUint("u64"), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(*f->GetInt("i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(*f->GetFloat("f32"), static_cast<double>(0.1f));
  EXPECT_EQ(*f->GetFloat("f64"), 1e300);
  EXPECT_TRUE(*f->GetBool("t"));
  EXPECT_FALSE(*f->GetBool("f"));
  EXPECT_EQ(*f->GetString("s"), std::string("a\0b\xff", 4));  // no UTF-8 requirement
  EXPECT_EQ(*f->GetString("empty"), "");

  const GgufValue* v = f->Find("i16");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->type, GgufValueType::kInt16);
  EXPECT_EQ(v->i, -32768);
  EXPECT_EQ(f->Find("u32")->type, GgufValueType::kUint32);
  EXPECT_EQ(f->Find("u32")->i, 0xffffffffll);  // widened into both when it fits
  EXPECT_EQ(f->Find("missing"), nullptr);
}

TEST(GgufTest, GettersRejectWrongTypesAndMissingKeys) {
  auto f = ParseOrDie(GgufBuilder()
                          .AddInt32("neg", -1)
                          .AddUint64("big", std::numeric_limits<uint64_t>::max())
                          .AddString("s", "x")
                          .AddUint32("n", 7)
                          .AddBool("b", true)
                          .Build());
  ASSERT_NE(f, nullptr);
  EXPECT_GGUF_ERROR(f->GetString("nope"), absl::StatusCode::kNotFound, "'nope'");
  EXPECT_GGUF_ERROR(f->GetUint("neg"), absl::StatusCode::kInvalidArgument, "negative");
  EXPECT_EQ(*f->GetInt("neg"), -1);
  EXPECT_GGUF_ERROR(f->GetInt("big"), absl::StatusCode::kInvalidArgument, "int64");
  EXPECT_GGUF_ERROR(f->GetUint("s"), absl::StatusCode::kInvalidArgument, "is string");
  EXPECT_GGUF_ERROR(f->GetString("n"), absl::StatusCode::kInvalidArgument, "is uint32");
  EXPECT_GGUF_ERROR(f->GetFloat("n"), absl::StatusCode::kInvalidArgument, "float");
  EXPECT_GGUF_ERROR(f->GetBool("n"), absl::StatusCode::kInvalidArgument, "bool");
  EXPECT_GGUF_ERROR(f->GetUint("b"), absl::StatusCode::kInvalidArgument, "is bool");
  EXPECT_GGUF_ERROR(f->GetStringArray("s"), absl::StatusCode::kInvalidArgument, "array");
}

TEST(GgufTest, ArraysRoundTrip) {
  std::string nested = GgufArrayHeader(GgufValueType::kArray, 2);
  nested += GgufArrayHeader(GgufValueType::kString, 1) + GgufStr("deep");
  nested += GgufArrayHeader(GgufValueType::kUint8, 3) + "\x01\x02\x03";
  auto f = ParseOrDie(GgufBuilder()
                          .AddStringArray("tokens", {"<unk>", "", std::string("\xe2\x96\x81", 3)})
                          .AddFloatArray("scores", {0.5f, -1e9f})
                          .AddInt32Array("types", {1, -2, 3})
                          .PodArray<double>("f64s", GgufValueType::kFloat64, {0.25, 1e-300})
                          .PodArray<uint64_t>("u64s", GgufValueType::kUint64, {1, 1ull << 63})
                          .PodArray<int8_t>("i8s", GgufValueType::kInt8, {-1, 5})
                          .AddStringArray("none", {})
                          .AddRaw("nested", kArrayType, nested)
                          .Build());
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(*f->GetStringArray("tokens"),
            (std::vector<std::string>{"<unk>", "", std::string("\xe2\x96\x81", 3)}));
  EXPECT_EQ(*f->GetFloatArray("scores"), (std::vector<float>{0.5f, -1e9f}));
  EXPECT_EQ(*f->GetIntArray("types"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(*f->GetFloatArray("f64s"), (std::vector<float>{0.25f, 0.0f}));
  EXPECT_EQ(*f->GetIntArray("i8s"), (std::vector<int64_t>{-1, 5}));
  EXPECT_GGUF_ERROR(f->GetIntArray("u64s"), absl::StatusCode::kInvalidArgument, "u64s[1]");
  EXPECT_TRUE(f->GetStringArray("none")->empty());
  EXPECT_GGUF_ERROR(f->GetFloatArray("types"), absl::StatusCode::kInvalidArgument,
                    "array of int32");
  EXPECT_GGUF_ERROR(f->GetIntArray("tokens"), absl::StatusCode::kInvalidArgument,
                    "array of string");

  const GgufValue* n = f->Find("nested");
  ASSERT_NE(n, nullptr);
  ASSERT_EQ(n->elem_type, GgufValueType::kArray);
  ASSERT_EQ(n->array.size(), 2u);
  EXPECT_EQ(n->array[0].elem_type, GgufValueType::kString);
  EXPECT_EQ(n->array[0].array.at(0).s, "deep");
  ASSERT_EQ(n->array[1].array.size(), 3u);
  EXPECT_EQ(n->array[1].array[2].u, 3u);
}

// Nesting up to the limit parses; one level deeper is rejected (recursion is bounded).
TEST(GgufTest, ArrayNestingDepthIsLimited) {
  auto nest = [](int levels) {
    std::string v;
    for (int i = 1; i < levels; ++i) v += GgufArrayHeader(GgufValueType::kArray, 1);
    v += GgufArrayHeader(GgufValueType::kUint8, 0);
    return GgufBuilder().AddRaw("deep", kArrayType, v).Build();
  };
  EXPECT_TRUE(GgufFile::FromBytes(nest(8)).ok());
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(nest(9)), absl::StatusCode::kInvalidArgument,
                    "nested deeper");
  EXPECT_FALSE(GgufFile::FromBytes(nest(100000)).ok());  // no stack overflow
}

class GgufVersionTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GgufVersionTest, ParsesMetadataAndTensors) {
  auto f = ParseOrDie(ValidSmallFile(GetParam()));
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->version(), GetParam());
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->metadata().size(), 16u);
  EXPECT_EQ(*f->GetString("general.architecture"), "llama");
  EXPECT_EQ(f->tensors().size(), 4u);
  ExpectTensorsInBounds(*f);
}

INSTANTIATE_TEST_SUITE_P(V2AndV3, GgufVersionTest, ::testing::Values(2u, 3u));

TEST(GgufTest, RejectsOtherVersions) {
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder(1).Build()), absl::StatusCode::kInvalidArgument,
                    "version 1");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder(4).Build()), absl::StatusCode::kInvalidArgument,
                    "unsupported version 4");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder(0x03000000).Build()),
                    absl::StatusCode::kInvalidArgument, "big-endian");
}

TEST(GgufTest, TensorDataMatchesForEveryType) {
  const std::vector<float> f32 = Iota(6, 1.5f);
  std::vector<uint16_t> f16, bf16;
  for (float x : Iota(4, 0.5f)) f16.push_back(Fp32ToFp16(x));
  for (float x : Iota(4, 0.75f)) bf16.push_back(Fp32ToBf16(x));
  const std::string q8 = Q8Blocks({0.5f, 2.0f, 0.0625f, 1.0f});
  auto f = ParseOrDie(GgufBuilder()
                          .AddTensor("a", {3, 2}, TensorType::kF32, GgufBytesOf(f32))
                          .AddTensor("b", {4}, TensorType::kF16, GgufBytesOf(f16))
                          .AddTensor("c", {2, 2, 1, 1}, TensorType::kBF16, GgufBytesOf(bf16))
                          .AddTensor("d", {64, 2}, TensorType::kQ8_0, q8)
                          .Build());
  ASSERT_NE(f, nullptr);
  ExpectTensorsInBounds(*f);

  const GgufTensorInfo* a = f->FindTensor("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dims, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(a->num_elements, 6);
  EXPECT_EQ(a->num_bytes, 24u);
  EXPECT_EQ(std::memcmp(a->data, f32.data(), 24), 0);

  const GgufTensorInfo* b = f->FindTensor("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->type, TensorType::kF16);
  EXPECT_EQ(b->num_bytes, 8u);
  std::vector<float> out(4);
  DequantizeRow(b->type, b->data, out.data(), 4);
  EXPECT_EQ(out, Iota(4, 0.5f));

  const GgufTensorInfo* c = f->FindTensor("c");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->type, TensorType::kBF16);
  EXPECT_EQ(c->dims.size(), 4u);
  DequantizeRow(c->type, c->data, out.data(), 4);
  EXPECT_EQ(out, Iota(4, 0.75f));

  const GgufTensorInfo* d = f->FindTensor("d");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->type, TensorType::kQ8_0);
  EXPECT_EQ(d->num_elements, 128);
  EXPECT_EQ(d->num_bytes, 4 * sizeof(BlockQ8_0));
  EXPECT_EQ(std::memcmp(d->data, q8.data(), q8.size()), 0);
  std::vector<float> row(64);
  DequantizeRow(d->type, d->data + TensorRowBytes(d->type, 64), row.data(), 64);  // row 1
  EXPECT_EQ(row[0], 0.0625f * static_cast<int8_t>(-128 + 2));
  EXPECT_EQ(row[32], 1.0f * static_cast<int8_t>(-128 + 3));
  EXPECT_EQ(f->FindTensor("zzz"), nullptr);
}

TEST(GgufTest, CustomAlignment) {
  for (uint32_t alignment : {1u, 8u, 64u, 4096u}) {
    auto f = ParseOrDie(GgufBuilder()
                            .SetAlignment(alignment)
                            .AddTensor("x", {3}, TensorType::kF16, std::string(6, '\x11'))
                            .AddTensor("y", {5}, TensorType::kF32, std::string(20, '\x22'))
                            .Build());
    ASSERT_NE(f, nullptr) << alignment;
    EXPECT_EQ(f->alignment(), alignment);
    EXPECT_EQ(f->data_offset() % alignment, 0u);
    ExpectTensorsInBounds(*f);
    EXPECT_EQ(f->FindTensor("y")->data[19], 0x22);
  }
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddUint32("general.alignment", 24).Build()),
                    absl::StatusCode::kInvalidArgument, "not a power of two");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddUint32("general.alignment", 0).Build()),
                    absl::StatusCode::kInvalidArgument, "not a power of two");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddUint64("general.alignment", 32).Build()),
                    absl::StatusCode::kInvalidArgument, "must be uint32");
}

TEST(GgufTest, VocabOnlyFileMayEndBeforeAlignedDataOffset) {
  // Files without tensors (tokenizer-only) need no padding after the metadata.
  std::string bytes = GgufBuilder().AddString("k", "v").Build();
  ASSERT_NE(bytes.size() % 32, 0u);
  auto f = ParseOrDie(bytes);
  ASSERT_NE(f, nullptr);
  EXPECT_TRUE(f->tensors().empty());
}

TEST(GgufTest, RejectsBadMagicAndEmptyInput) {
  std::string bytes = ValidSmallFile();
  bytes[0] = 'g';
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(bytes), absl::StatusCode::kInvalidArgument, "bad magic");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(""), absl::StatusCode::kInvalidArgument,
                    "truncated at byte 0 reading header (magic)");
}

// Every strict prefix of a valid file is an error, never a crash: cuts land inside every
// field kind (counts, keys, values, array elements, tensor infos, padding and tensor data).
TEST(GgufTest, EveryTruncationIsAnError) {
  const std::string bytes = ValidSmallFile();
  ASSERT_TRUE(GgufFile::FromBytes(bytes).ok());
  for (size_t n = 0; n < bytes.size(); ++n) {
    absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(bytes.substr(0, n));
    ASSERT_FALSE(f.ok()) << "prefix of " << n << " bytes parsed";
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  }
}

TEST(GgufTest, TruncationMessageNamesFieldAndOffset) {
  const std::string long_name(40, 'n');
  const std::string named =
      GgufBuilder().AddTensor(long_name, {2}, TensorType::kF32, "12345678").Build();
  // Header (24 bytes), then tensor info 0's name length (8): cut 30 bytes into the name.
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(named.substr(0, 62)), absl::StatusCode::kInvalidArgument,
                    "truncated at byte 32 reading tensor info 0 (name): need 40 bytes, 30 left");
  const std::string bytes = GgufBuilder().AddTensor("w", {2}, TensorType::kF32, "12345678").Build();
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(bytes.substr(0, bytes.size() - 1)),
                    absl::StatusCode::kInvalidArgument, "tensor info 0 'w' at byte 24");
}

TEST(GgufTest, RejectsHugeCountsWithoutAllocating) {
  constexpr uint64_t kHuge = uint64_t{1} << 60;
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().OverrideKvCount(kHuge).Build()),
                    absl::StatusCode::kInvalidArgument, "kv_count 1152921504606846976");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().OverrideTensorCount(kHuge).Build()),
                    absl::StatusCode::kInvalidArgument, "tensor_count");
  EXPECT_GGUF_ERROR(
      GgufFile::FromBytes(GgufBuilder().AddRaw("s", 8, GgufPod<uint64_t>(kHuge)).Build()),
      absl::StatusCode::kInvalidArgument,
      "truncated at byte 45 reading metadata kv 0 's' (string)");
  EXPECT_GGUF_ERROR(
      GgufFile::FromBytes(GgufBuilder().AddRaw("k", 8, GgufPod<uint64_t>(~0ull)).Build()),
      absl::StatusCode::kInvalidArgument, "need 18446744073709551615 bytes");
  for (GgufValueType t : {GgufValueType::kUint8, GgufValueType::kString, GgufValueType::kArray}) {
    EXPECT_GGUF_ERROR(GgufFile::FromBytes(
                          GgufBuilder().AddRaw("a", kArrayType, GgufArrayHeader(t, kHuge)).Build()),
                      absl::StatusCode::kInvalidArgument, "array of 1152921504606846976");
  }
  // A key length past the end of the file.
  std::string bytes = GgufBuilder().AddUint8("key", 1).Build();
  bytes[24 + 7] = '\x7f';
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(bytes), absl::StatusCode::kInvalidArgument,
                    "reading metadata kv 0 (key)");
}

TEST(GgufTest, RejectsBadTypeIds) {
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddRaw("k", 13, GgufPod<uint8_t>(0)).Build()),
                    absl::StatusCode::kInvalidArgument,
                    "metadata kv 0 'k' at byte 33: unknown value type 13");
  EXPECT_GGUF_ERROR(
      GgufFile::FromBytes(GgufBuilder()
                              .AddRaw("k", kArrayType, GgufPod<uint32_t>(99) + GgufPod<uint64_t>(0))
                              .Build()),
      absl::StatusCode::kInvalidArgument, "unknown array element type 99");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddRaw("k", 7, GgufPod<uint8_t>(2)).Build()),
                    absl::StatusCode::kInvalidArgument, "bool value 2");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddTensorInfo("q", {32}, 16, 0).Build()),
                    absl::StatusCode::kInvalidArgument, "unsupported tensor type 16 (iq2_xxs)");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddTensorInfo("q", {256}, 15, 0).Build()),
                    absl::StatusCode::kInvalidArgument, "unsupported tensor type 15 (q8_K)");
  // K-quant rows are whole 256-value super-blocks (llama.cpp's Q4_K_M falls back to other types
  // for tensors whose rows are not).
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddTensorInfo("q4", {32}, 12, 0).Build()),
                    absl::StatusCode::kInvalidArgument,
                    "q4_K needs dims[0] to be a multiple of 256");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddTensorInfo("x", {32}, 1000, 0).Build()),
                    absl::StatusCode::kInvalidArgument, "unsupported tensor type 1000 (unknown)");
}

TEST(GgufTest, RejectsBadTensorShapes) {
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddTensorInfo("x", {}, 0, 0).Build()),
                    absl::StatusCode::kInvalidArgument, "n_dims 0");
  EXPECT_GGUF_ERROR(
      GgufFile::FromBytes(GgufBuilder().AddTensorInfo("x", {1, 1, 1, 1, 1}, 0, 0).Build()),
      absl::StatusCode::kInvalidArgument, "n_dims 5");
  EXPECT_GGUF_ERROR(
      GgufFile::FromBytes(GgufBuilder().AddTensorInfo("x", {1ull << 63}, 0, 0).Build()),
      absl::StatusCode::kInvalidArgument, "dims[0] = 9223372036854775808");
  EXPECT_GGUF_ERROR(
      GgufFile::FromBytes(GgufBuilder().AddTensorInfo("x", {1ull << 32, 1ull << 32}, 0, 0).Build()),
      absl::StatusCode::kInvalidArgument, "overflows int64");
  // The element count fits int64 but the byte count (x4) does not fit uint64.
  EXPECT_GGUF_ERROR(
      GgufFile::FromBytes(GgufBuilder().AddTensorInfo("x", {1ull << 31, 1ull << 31}, 0, 0).Build()),
      absl::StatusCode::kInvalidArgument, "byte size overflows");
  EXPECT_GGUF_ERROR(
      GgufFile::FromBytes(GgufBuilder().AddTensor("x", {33}, TensorType::kQ8_0, "").Build()),
      absl::StatusCode::kInvalidArgument, "multiple of 32, got 33");
}

TEST(GgufTest, RejectsTensorDataOutsideTheFile) {
  EXPECT_GGUF_ERROR(
      GgufFile::FromBytes(GgufBuilder().AddTensor("x", {4}, TensorType::kF32, "12345678").Build()),
      absl::StatusCode::kInvalidArgument, "runs past the end");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder()
                                            .AddTensor("a", {2}, TensorType::kF32, "12345678")
                                            .AddTensorInfo("b", {2}, 0, 1ull << 40)
                                            .Build()),
                    absl::StatusCode::kInvalidArgument, "tensor info 1 'b'");
  // offset + size would wrap around uint64 if added naively.
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder()
                                            .AddTensor("a", {2}, TensorType::kF32, "12345678")
                                            .AddTensorInfo("b", {8}, 0, ~0ull - 31)
                                            .Build()),
                    absl::StatusCode::kInvalidArgument, "runs past the end");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder()
                                            .AddTensor("a", {2}, TensorType::kF32, "12345678")
                                            .AddTensorInfo("b", {1}, 0, 4)
                                            .Build()),
                    absl::StatusCode::kInvalidArgument,
                    "offset 4 is not a multiple of the alignment 32");
}

TEST(GgufTest, RejectsDuplicates) {
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder().AddUint8("k", 1).AddString("k", "x").Build()),
                    absl::StatusCode::kInvalidArgument,
                    "metadata kv 1 'k' at byte 38: duplicate key");
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder()
                                            .AddTensor("w", {1}, TensorType::kF32, "1234")
                                            .AddTensor("w", {1}, TensorType::kF32, "5678")
                                            .Build()),
                    absl::StatusCode::kInvalidArgument, "duplicate tensor name");
  // Names are arbitrary bytes: errors show them escaped and cut to 64 bytes.
  const std::string odd = "\x01" + std::string(100, 'n');
  EXPECT_GGUF_ERROR(GgufFile::FromBytes(GgufBuilder()
                                            .AddTensor(odd, {1}, TensorType::kF32, "1234")
                                            .AddTensor(odd, {1}, TensorType::kF32, "5678")
                                            .Build()),
                    absl::StatusCode::kInvalidArgument,
                    "tensor info 1 '\\x01" + std::string(63, 'n') + "'... at byte");
}

// Cheap deterministic fuzz: random byte edits of a valid file must parse or fail cleanly,
// and when they parse every tensor must still lie inside the buffer.
TEST(GgufTest, RandomMutationsParseOrFailCleanly) {
  const std::string valid = ValidSmallFile();
  std::mt19937_64 rng(0x5eed);
  int parsed = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    std::string bytes = valid;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = rng() % bytes.size();
      switch (rng() % 4) {
        case 0:
          bytes[pos] = static_cast<char>(rng());
          break;
        case 1:
          bytes[pos] ^= static_cast<char>(1 << (rng() % 8));
          break;
        case 2:
          bytes[pos] = static_cast<char>(0xff);
          break;  // drives lengths/counts huge
        case 3:
          bytes.resize(pos);
          break;
      }
      if (bytes.empty()) break;
    }
    absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(bytes);
    if (!f.ok()) {
      ASSERT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
      ASSERT_EQ(f.status().message().rfind("gguf: ", 0), 0u) << f.status();
      continue;
    }
    ++parsed;
    ExpectTensorsInBounds(**f);
  }
  EXPECT_GT(parsed, 0);  // edits landing in tensor data or padding keep the file valid
}

TEST(GgufTest, OpenMapsFileAndReportsMissingFiles) {
  const std::string bytes = ValidSmallFile();
  char tmpl[] = "/tmp/gguf_test_XXXXXX";
  const int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  close(fd);
  const std::string path = tmpl;
  ASSERT_TRUE(subspace::testing::WriteFile(path, bytes));
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->bytes(), bytes);
  EXPECT_EQ((*f)->tensors().size(), 4u);
  ExpectTensorsInBounds(**f);

  ASSERT_TRUE(subspace::testing::WriteFile(path, bytes.substr(0, 100)));
  EXPECT_GGUF_ERROR(GgufFile::Open(path), absl::StatusCode::kInvalidArgument, path + ": gguf: ");
  ASSERT_TRUE(subspace::testing::WriteFile(path, ""));
  EXPECT_GGUF_ERROR(GgufFile::Open(path), absl::StatusCode::kInvalidArgument,
                    "truncated at byte 0");
  unlink(path.c_str());

  EXPECT_GGUF_ERROR(GgufFile::Open("/nonexistent/model.gguf"), absl::StatusCode::kNotFound,
                    "/nonexistent/model.gguf");
  EXPECT_GGUF_ERROR(GgufFile::Open("/tmp"), absl::StatusCode::kInvalidArgument,
                    "not a regular file");
}

TEST(GgufFixtureTest, LlamaTinyRandom) {
  const std::string path = subspace::testing::FixturePath("gguf/llama-2-tiny-random.gguf");
  SUBSPACE_ASSERT_FIXTURE(path);
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.alignment(), 32u);
  EXPECT_EQ(*g.GetString("general.architecture"), "llama");
  EXPECT_EQ(*g.GetUint("llama.embedding_length"), 8u);
  EXPECT_EQ(*g.GetUint("llama.block_count"), 1u);
  EXPECT_NEAR(*g.GetFloat("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-10);
  absl::StatusOr<std::vector<std::string>> tokens = g.GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 32000u);
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ(g.GetFloatArray("tokenizer.ggml.scores")->size(), 32000u);
  EXPECT_EQ(g.GetIntArray("tokenizer.ggml.token_type")->size(), 32000u);

  // Matrices are F16; the three RMS-norm vectors are F32.
  ASSERT_EQ(g.tensors().size(), 12u);
  for (const GgufTensorInfo& t : g.tensors()) {
    const TensorType want = t.dims.size() == 1 ? TensorType::kF32 : TensorType::kF16;
    EXPECT_EQ(t.type, want) << t.name;
    std::vector<float> values(t.num_elements);
    DequantizeRow(t.type, t.data, values.data(), t.num_elements);
    for (float v : values) ASSERT_TRUE(std::isfinite(v)) << t.name;
  }
  const GgufTensorInfo* embd = g.FindTensor("token_embd.weight");
  ASSERT_NE(embd, nullptr);
  EXPECT_EQ(embd->dims, (std::vector<int64_t>{8, 32000}));
  ExpectTensorsInBounds(g);
  // The data section is packed: the last tensor ends exactly at end of file.
  const GgufTensorInfo& last = g.tensors().back();
  EXPECT_EQ(g.data_offset() + last.offset + last.num_bytes, g.bytes().size());
}

TEST(GgufFixtureTest, VocabOnlyLlamaSpm) {
  const std::string path = subspace::testing::FixturePath("gguf/ggml-vocab-llama-spm.gguf");
  SUBSPACE_ASSERT_FIXTURE(path);
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_TRUE(g.tensors().empty());
  EXPECT_EQ(*g.GetString("tokenizer.ggml.model"), "llama");
  EXPECT_EQ(g.GetStringArray("tokenizer.ggml.tokens")->size(), 32000u);
  EXPECT_EQ(*g.GetUint("tokenizer.ggml.bos_token_id"), 1u);
  EXPECT_TRUE(*g.GetBool("tokenizer.ggml.add_bos_token"));
  EXPECT_FALSE(*g.GetBool("tokenizer.ggml.add_eos_token"));
}

}  // namespace
}  // namespace subspace
