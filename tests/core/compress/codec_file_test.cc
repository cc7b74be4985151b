// The codec file: a fitted codec survives the round trip bit for bit; version 1 and 2 files are
// each refused by the other's reader, and a newer version by both, by name; a code that does
// not hold together (widths, steps, basis, budget) is refused naming the field; truncated
// files are refused, never read past.
#include "core/compress/codec_file.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/compress/basis.h"
#include "core/compress/basis_file.h"
#include "core/gguf/gguf_writer.h"

namespace subspace {
namespace {

constexpr KvCacheGeometry kGeom{2, 2, 16};

CodecFile Fitted(double bits, bool weighted) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  CodecFile c;
  c.info = {.key_bits = bits,
            .value_bits = bits,
            .pre_rope_keys = true,
            .attention_weighted = weighted,
            .joint = false,
            .calibration_tokens = 500,
            .model_checksum = 0x1234abcd5678ef90ull};
  c.geometry = kGeom;
  std::vector<float> metric(kGeom.head_dim);
  for (int i = 0; i < kGeom.head_dim; ++i) metric[i] = 0.5f + 0.1f * static_cast<float>(i);
  for (int side = 0; side < 2; ++side) {
    for (int at = 0; at < kGeom.n_layers * kGeom.n_kv_heads; ++at) {
      std::vector<float> rows(500 * kGeom.head_dim);
      for (size_t i = 0; i < rows.size(); ++i) {
        rows[i] = nd(rng) * (1.0f + static_cast<float>(i % kGeom.head_dim)) +
                  0.3f * static_cast<float>(at);
      }
      absl::StatusOr<TransformStream> s =
          AnalyzeStream(rows.data(), 500, kGeom.head_dim, {},
                        weighted ? std::span<const float>(metric) : std::span<const float>());
      EXPECT_TRUE(s.ok());
      absl::StatusOr<std::vector<TransformCode>> code = AllocateTransformCodes(
          std::span<const TransformStream>(&*s, 1), TransformCodeOptions{}.widths, bits, false);
      EXPECT_TRUE(code.ok());
      (side == 0 ? c.keys : c.values).push_back((*code)[0]);
    }
  }
  return c;
}

absl::StatusOr<CodecFile> Parse(const std::string& bytes) {
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(bytes);
  if (!f.ok()) return f.status();
  return ParseCodecFile(**f);
}

void ExpectSameCode(const TransformCode& a, const TransformCode& b) {
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.mean, b.mean);
  EXPECT_EQ(a.scale, b.scale);
  EXPECT_EQ(a.basis, b.basis);
  ASSERT_EQ(a.components.size(), b.components.size());
  for (size_t j = 0; j < a.components.size(); ++j) {
    EXPECT_EQ(a.components[j].bits, b.components[j].bits);
    EXPECT_EQ(a.components[j].offset, b.components[j].offset);
    EXPECT_EQ(a.components[j].step, b.components[j].step);
  }
}

TEST(CodecFileTest, RoundTripsBitForBit) {
  for (bool weighted : {false, true}) {
    const CodecFile c = Fitted(2.5, weighted);
    absl::StatusOr<std::string> bytes = SerializeCodecFile(c);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    absl::StatusOr<CodecFile> back = Parse(*bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->info.key_bits, 2.5);
    EXPECT_EQ(back->info.value_bits, 2.5);
    EXPECT_TRUE(back->info.pre_rope_keys);
    EXPECT_EQ(back->info.attention_weighted, weighted);
    EXPECT_FALSE(back->info.joint);
    EXPECT_EQ(back->info.calibration_tokens, 500u);
    EXPECT_EQ(back->info.model_checksum, 0x1234abcd5678ef90ull);
    EXPECT_EQ(back->geometry.head_dim, kGeom.head_dim);
    for (size_t at = 0; at < c.keys.size(); ++at) {
      ExpectSameCode(c.keys[at], back->keys[at]);
      ExpectSameCode(c.values[at], back->values[at]);
    }
  }
}

TEST(CodecFileTest, EachVersionIsReadOnlyByItsReader) {
  absl::StatusOr<std::string> codec = SerializeCodecFile(Fitted(3.0, false));
  ASSERT_TRUE(codec.ok());
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(*codec);
  ASSERT_TRUE(f.ok());
  absl::StatusOr<BasisFile> as_basis = ParseBasisFile(**f);
  ASSERT_FALSE(as_basis.ok());
  EXPECT_NE(as_basis.status().message().find("transform codec"), std::string::npos)
      << as_basis.status();

  const Basis basis = Basis::Zeros(kGeom, {4, 4}, {4, 4});
  Basis unit = basis;
  for (LayerBasis& lb : unit.layers) {
    for (int h = 0; h < kGeom.n_kv_heads; ++h) {
      for (int j = 0; j < 4; ++j) {
        lb.p_q[(h * 16 + j) * 4 + j] = lb.p_k[(h * 16 + j) * 4 + j] = 1.0f;
        lb.p_v[(h * 16 + j) * 4 + j] = lb.r_v[(h * 4 + j) * 16 + j] = 1.0f;
      }
    }
  }
  absl::StatusOr<std::string> lowrank =
      SerializeBasisFile({.method_k = "ksvd", .method_v = "ksvd"}, unit);
  ASSERT_TRUE(lowrank.ok()) << lowrank.status();
  absl::StatusOr<CodecFile> as_codec = Parse(*lowrank);
  ASSERT_FALSE(as_codec.ok());
  EXPECT_NE(as_codec.status().message().find("low-rank"), std::string::npos) << as_codec.status();

  GgufWriter future;
  future.AddString("general.architecture", "subspace-basis");
  future.AddUint32("subspace.basis.version", 3);
  absl::StatusOr<std::unique_ptr<GgufFile>> ff = GgufFile::FromBytes(future.Build());
  ASSERT_TRUE(ff.ok());
  for (absl::Status s : {ParseBasisFile(**ff).status(), ParseCodecFile(**ff).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("subspace.basis.version = 3"), std::string::npos) << s;
  }
  GgufWriter model;
  model.AddString("general.architecture", "llama");
  absl::StatusOr<std::unique_ptr<GgufFile>> mf = GgufFile::FromBytes(model.Build());
  ASSERT_TRUE(mf.ok());
  EXPECT_NE(ParseCodecFile(**mf).status().message().find("not a basis file"), std::string::npos);
}

TEST(CodecFileTest, CodesThatDoNotHoldTogetherAreRefusedByName) {
  struct Case {
    const char* want;
    void (*spoil)(CodecFile&);
  };
  const Case cases[] = {
      {"blk.0.head.1.k.quant[3]: 9 bits", [](CodecFile& c) { c.keys[1].components[3].bits = 9; }},
      {"blk.1.head.0.v.quant[0]: the step",
       [](CodecFile& c) {
         c.values[2].components[0].bits = 4;
         c.values[2].components[0].step = 0.0f;
       }},
      {"blk.0.head.0.k.mean[2] is not finite", [](CodecFile& c) { c.keys[0].mean[2] = NAN; }},
      {"blk.0.head.0.v.scale[1]",
       [](CodecFile& c) {
         c.values[0].scale = std::vector<float>(16, 1.0f), c.values[0].scale[1] = -1.0f;
       }},
      {"blk.1.head.1.k.basis: rows 0 and 0", [](CodecFile& c) { c.keys[3].basis[0] += 0.5f; }},
      {"exceed the budget",
       [](CodecFile& c) {
         for (auto& q : c.keys[2].components) q = {.bits = 8, .offset = 0.0f, .step = 1.0f};
       }},
      {"subspace.basis.value_bits = 9", [](CodecFile& c) { c.info.value_bits = 9.0; }},
      {"1 value codes", [](CodecFile& c) { c.values.resize(1); }},
      {"sizes do not match", [](CodecFile& c) { c.keys[0].mean.pop_back(); }},
  };
  for (const Case& k : cases) {
    CodecFile c = Fitted(3.0, false);
    k.spoil(c);
    const absl::Status s = ValidateCodecFile(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k.want;
    EXPECT_NE(s.message().find(k.want), std::string::npos) << s << " -- wanted: " << k.want;
    EXPECT_FALSE(SerializeCodecFile(c).ok());
  }
  // Joint: a row may pass the per-row budget, the sum may not.
  CodecFile joint = Fitted(3.0, false);
  joint.info.joint = true;
  joint.info.key_bits = joint.info.value_bits = 1.0;
  for (auto& q : joint.keys[0].components) q = {.bits = 2, .offset = 0.0f, .step = 1.0f};
  for (auto& code : joint.values) {
    for (auto& q : code.components) q = {.bits = 0, .offset = 0.0f, .step = 0.0f};
  }
  for (size_t at = 1; at < joint.keys.size(); ++at) {
    for (auto& q : joint.keys[at].components) q = {.bits = 0, .offset = 0.0f, .step = 0.0f};
  }
  EXPECT_TRUE(ValidateCodecFile(joint).ok()) << ValidateCodecFile(joint);
  for (auto& code : joint.values) {
    for (auto& q : code.components) q = {.bits = 2, .offset = 0.0f, .step = 1.0f};
  }
  EXPECT_NE(ValidateCodecFile(joint).message().find("joint budget"), std::string::npos);
}

TEST(CodecFileTest, FractionalWidthsInTheFileAndTruncationsAreRefused) {
  absl::StatusOr<std::string> bytes = SerializeCodecFile(Fitted(3.0, false));
  ASSERT_TRUE(bytes.ok());
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(*bytes);
  ASSERT_TRUE(f.ok());
  const GgufTensorInfo* quant = (*f)->FindTensor("blk.1.head.0.v.quant");
  ASSERT_NE(quant, nullptr);
  std::string spoiled = *bytes;
  const float half = 2.5f;
  std::memcpy(spoiled.data() + (reinterpret_cast<const char*>(quant->data) - (*f)->bytes().data()),
              &half, 4);
  absl::StatusOr<CodecFile> c = Parse(spoiled);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("blk.1.head.0.v.quant[0]: 2.5 bits"), std::string::npos)
      << c.status();
  for (size_t cut : {size_t{0}, size_t{8}, size_t{100}, bytes->size() / 2, bytes->size() - 4}) {
    EXPECT_FALSE(Parse(bytes->substr(0, cut)).ok()) << cut;
  }
}

}  // namespace
}  // namespace subspace
