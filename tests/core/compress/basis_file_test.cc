// The basis file: bit-exact round trip of a calibrated basis, and clear INVALID_ARGUMENT errors
// for corrupt files, inconsistent ones (hand-built with GgufBuilder) and model mismatches.
#include "core/compress/basis_file.h"

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/core/gguf/gguf_test_util.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace {
namespace {

using testing::GgufBuilder;

// A random basis with different ranks per layer and P_q != P_k.
Basis RandomBasis(const KvCacheGeometry& g, uint32_t seed) {
  std::vector<int> r_k, r_v;
  for (int l = 0; l < g.n_layers; ++l) {
    r_k.push_back(1 + l % g.head_dim);
    r_v.push_back(g.head_dim - l % g.head_dim);
  }
  Basis b = Basis::Zeros(g, r_k, r_v);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (LayerBasis& lb : b.layers)
    for (auto* m : {&lb.p_q, &lb.p_k, &lb.p_v, &lb.r_v})
      for (float& x : *m) x = normal(rng);
  return b;
}

absl::StatusOr<BasisFile> Parse(std::string bytes) {
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(std::move(bytes));
  if (!f.ok()) return f.status();
  return ParseBasisFile(**f);
}

BasisFileInfo Info() {
  return {.method_k = "kqsvd",
          .method_v = "ksvd",
          .energy = 0.9,
          .calibration_tokens = 1234,
          .model_checksum = 0xfeedfacecafebeefull};
}

TEST(BasisFileTest, RoundTripIsExact) {
  const KvCacheGeometry g{3, 2, 8};
  const Basis b = RandomBasis(g, 1);
  const std::string path = ::testing::TempDir() + "/basis_file_test.gguf";
  ASSERT_TRUE(WriteBasisFile(path, Info(), b).ok());
  absl::StatusOr<BasisFile> f = ReadBasisFile(path);
  std::remove(path.c_str());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->info.method_k, "kqsvd");
  EXPECT_EQ(f->info.method_v, "ksvd");
  EXPECT_EQ(f->info.energy, 0.9);
  EXPECT_EQ(f->info.calibration_tokens, 1234u);
  EXPECT_EQ(f->info.model_checksum, 0xfeedfacecafebeefull);
  EXPECT_EQ(f->basis.geometry.n_layers, 3);
  EXPECT_EQ(f->basis.geometry.n_kv_heads, 2);
  EXPECT_EQ(f->basis.geometry.head_dim, 8);
  ASSERT_EQ(f->basis.layers.size(), 3u);
  for (size_t l = 0; l < 3; ++l) {
    const LayerBasis &want = b.layers[l], &got = f->basis.layers[l];
    EXPECT_EQ(got.rank_k, want.rank_k);
    EXPECT_EQ(got.rank_v, want.rank_v);
    EXPECT_EQ(got.p_q, want.p_q);
    EXPECT_EQ(got.p_k, want.p_k);
    EXPECT_EQ(got.p_v, want.p_v);
    EXPECT_EQ(got.r_v, want.r_v);
  }
  EXPECT_TRUE(CheckBasisMatchesModel(*f, g, 0xfeedfacecafebeefull).ok());
}

TEST(BasisFileTest, RejectsModelMismatch) {
  const KvCacheGeometry g{2, 2, 8};
  absl::StatusOr<BasisFile> f = Parse(*SerializeBasisFile(Info(), RandomBasis(g, 2)));
  ASSERT_TRUE(f.ok()) << f.status();
  for (const KvCacheGeometry& other :
       {KvCacheGeometry{3, 2, 8}, KvCacheGeometry{2, 1, 8}, KvCacheGeometry{2, 2, 16}}) {
    const absl::Status s = CheckBasisMatchesModel(*f, other, Info().model_checksum);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("geometry"), std::string::npos) << s;
  }
  const absl::Status s = CheckBasisMatchesModel(*f, g, 42);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("different model"), std::string::npos) << s;
}

TEST(BasisFileTest, RejectsCorruptFiles) {
  const KvCacheGeometry g{2, 1, 4};
  const std::string good = *SerializeBasisFile(Info(), RandomBasis(g, 3));
  ASSERT_TRUE(Parse(good).ok());
  // Truncated anywhere: the GGUF reader refuses it, nothing is read past the end.
  for (size_t len : {size_t{0}, size_t{3}, size_t{40}, good.size() / 2, good.size() - 1}) {
    EXPECT_FALSE(Parse(good.substr(0, len)).ok()) << len;
  }
  EXPECT_EQ(ReadBasisFile("/nonexistent/bases.gguf").status().code(), absl::StatusCode::kNotFound);
}

// Hand-built files, each broken in one way. d = 4, one layer, one head, ranks (2, 3).
struct Breakage {
  const char* name;
  const char* expect;  // substring of the error
  std::string drop_key;
  int rank_k = 2;
  uint64_t p_k_rows = 4;
  TensorType p_v_type = TensorType::kF32;
  bool drop_r_v = false;
  int ranks_entries = 1;
};

std::string BuildBroken(const Breakage& br) {
  GgufBuilder b;
  auto key = [&](const char* k) { return std::string("subspace.basis.") + k; };
  auto maybe = [&](const char* k, auto add) {
    if (br.drop_key != k) add(key(k));
  };
  maybe("method_k", [&](const std::string& k) { b.AddString(k, "kqsvd"); });
  maybe("method_v", [&](const std::string& k) { b.AddString(k, "kqsvd"); });
  maybe("energy", [&](const std::string& k) { b.AddFloat64(k, 0.9); });
  maybe("calibration_tokens", [&](const std::string& k) { b.AddUint64(k, 10); });
  maybe("model_fnv1a64", [&](const std::string& k) { b.AddUint64(k, 1); });
  maybe("n_layers", [&](const std::string& k) { b.AddUint32(k, 1); });
  maybe("n_kv_heads", [&](const std::string& k) { b.AddUint32(k, 1); });
  maybe("head_dim", [&](const std::string& k) { b.AddUint32(k, 4); });
  maybe("rank_k", [&](const std::string& k) {
    b.AddInt32Array(k, std::vector<int32_t>(static_cast<size_t>(br.ranks_entries), br.rank_k));
  });
  maybe("rank_v", [&](const std::string& k) { b.AddInt32Array(k, {3}); });
  auto f32 = [](size_t n) { return std::string(n * 4, '\0'); };
  b.AddTensor("blk.0.head.0.p_q", {2, 4}, TensorType::kF32, f32(8));
  b.AddTensor("blk.0.head.0.p_k", {2, br.p_k_rows}, TensorType::kF32, f32(2 * br.p_k_rows));
  if (br.p_v_type == TensorType::kF32) {
    b.AddTensor("blk.0.head.0.p_v", {3, 4}, TensorType::kF32, f32(12));
  } else {
    b.AddTensor("blk.0.head.0.p_v", {3, 4}, br.p_v_type, std::string(24, '\0'));
  }
  if (!br.drop_r_v) b.AddTensor("blk.0.head.0.r_v", {4, 3}, TensorType::kF32, f32(12));
  return b.Build();
}

TEST(BasisFileTest, RejectsInconsistentFiles) {
  ASSERT_TRUE(Parse(BuildBroken({.name = "valid", .expect = ""})).ok());
  const std::vector<Breakage> cases = {
      {.name = "no head_dim", .expect = "head_dim", .drop_key = "head_dim"},
      {.name = "no method", .expect = "method_k", .drop_key = "method_k"},
      {.name = "no checksum", .expect = "model_fnv1a64", .drop_key = "model_fnv1a64"},
      {.name = "no ranks", .expect = "rank_v", .drop_key = "rank_v"},
      {.name = "rank 0", .expect = "outside [1, 4]", .rank_k = 0},
      {.name = "rank > d", .expect = "outside [1, 4]", .rank_k = 5},
      {.name = "ranks per layer", .expect = "expected 1", .ranks_entries = 2},
      {.name = "p_k shape", .expect = "blk.0.head.0.p_k has dims {2, 5}", .p_k_rows = 5},
      {.name = "p_v type", .expect = "expected F32", .p_v_type = TensorType::kF16},
      {.name = "no r_v", .expect = "blk.0.head.0.r_v is missing", .drop_r_v = true},
  };
  for (const Breakage& br : cases) {
    const absl::StatusOr<BasisFile> f = Parse(BuildBroken(br));
    ASSERT_FALSE(f.ok()) << br.name;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << br.name;
    EXPECT_NE(f.status().message().find(br.expect), std::string::npos)
        << br.name << ": " << f.status();
  }
}

// Regression (basis_file_fuzzer): a file of a few hundred bytes whose geometry claims tensors of
// terabytes must be refused before anything is allocated, not abort on a huge allocation.
TEST(BasisFileTest, RejectsGeometryLargerThanTheFile) {
  GgufBuilder b;
  b.AddString("subspace.basis.method_k", "ksvd").AddString("subspace.basis.method_v", "ksvd");
  b.AddFloat64("subspace.basis.energy", 0).AddUint64("subspace.basis.calibration_tokens", 1);
  b.AddUint64("subspace.basis.model_fnv1a64", 1).AddUint32("subspace.basis.n_layers", 1);
  b.AddUint32("subspace.basis.n_kv_heads", 65536).AddUint32("subspace.basis.head_dim", 65536);
  b.AddInt32Array("subspace.basis.rank_k", {65536}).AddInt32Array("subspace.basis.rank_v", {65536});
  const absl::StatusOr<BasisFile> f = Parse(b.Build());
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("need more tensor bytes than the file's"), std::string::npos)
      << f.status();
}

TEST(BasisFileTest, ModelChecksumIdentifiesTheFile) {
  auto a = GgufFile::FromBytes(testing::BuildTinyLlamaGguf({.seed = 1}));
  auto a2 = GgufFile::FromBytes(testing::BuildTinyLlamaGguf({.seed = 1}));
  auto b = GgufFile::FromBytes(testing::BuildTinyLlamaGguf({.seed = 2}));
  ASSERT_TRUE(a.ok() && a2.ok() && b.ok());
  EXPECT_EQ(ModelChecksum(**a), ModelChecksum(**a2));
  EXPECT_NE(ModelChecksum(**a), ModelChecksum(**b));
}

}  // namespace
}  // namespace subspace
