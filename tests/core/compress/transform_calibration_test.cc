// The transform codec's calibration on a tiny model: every written row is kept, pre-RoPE keys
// rotate back onto the written ones, the attention energies are positive, and the fitted codes
// respect the key and value budgets, apart or joint.
#include "core/compress/transform_calibration.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/cpu/ops.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace {
namespace {

class TransformCalibrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing::TinyModel> tiny = testing::LoadTinyModel({.head_dim = 16});
    ASSERT_TRUE(tiny.ok()) << tiny.status();
    tiny_ = *std::move(tiny);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 6; ++i) {
      const std::vector<int32_t> t = tiny_.tokenizer->Encode(
          "hello world and the world is hello to the world of it in a the", {false});
      tokens.insert(tokens.end(), t.begin(), t.end());
    }
    tokens_ = static_cast<int64_t>(tokens.size());
    absl::StatusOr<KvRows> rows =
        CollectKvRows(*tiny_.model, tokens, {.window = 32, .bos = tiny_.tokenizer->bos_id()});
    ASSERT_TRUE(rows.ok()) << rows.status();
    rows_ = *std::move(rows);
  }

  testing::TinyModel tiny_;
  int64_t tokens_ = 0;
  KvRows rows_;
};

TEST_F(TransformCalibrationTest, KeepsEveryRowAndPreRopeKeysRotateBack) {
  const KvCacheGeometry& g = rows_.geometry;
  const int64_t windows = (tokens_ + 31) / 32;
  EXPECT_EQ(rows_.tokens, tokens_ + windows);  // a BOS per window
  const size_t heads = static_cast<size_t>(g.n_layers) * g.n_kv_heads;
  ASSERT_EQ(rows_.keys_pre.size(), heads);
  for (size_t at = 0; at < heads; ++at) {
    ASSERT_EQ(rows_.keys_post[at].size(), static_cast<size_t>(rows_.tokens) * g.head_dim);
    ASSERT_EQ(rows_.values[at].size(), rows_.keys_post[at].size());
    // The first window's rows sit at positions 0..32: rotating pre-RoPE keys forward by their
    // position gives the written ones.
    for (int64_t p = 0; p < 33; ++p) {
      std::vector<float> k(rows_.keys_pre[at].begin() + p * g.head_dim,
                           rows_.keys_pre[at].begin() + (p + 1) * g.head_dim);
      cpu::Rope(k.data(), 1, 1, g.head_dim, rows_.rope, &p);
      for (int i = 0; i < g.head_dim; ++i) {
        EXPECT_NEAR(k[i], rows_.keys_post[at][p * g.head_dim + i], 1e-4) << at << " " << p;
      }
    }
    ASSERT_EQ(rows_.query_energy[at].size(), static_cast<size_t>(g.head_dim));
    for (float e : rows_.query_energy[at]) EXPECT_GT(e, 0.0f);
    for (float e : rows_.output_energy[at]) EXPECT_GT(e, 0.0f);
  }
}

TEST_F(TransformCalibrationTest, CodesRespectTheKeyAndValueBudgets) {
  const int d = rows_.geometry.head_dim;
  for (bool weighted : {false, true}) {
    TransformFitOptions o{.key_bits = 3.0, .value_bits = 1.0, .attention_weighted = weighted};
    absl::StatusOr<TransformCodes> c = FitTransformCodes(rows_, o);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_EQ(c->keys->size(), c->values->size());
    int key_bits = 0, value_bits = 0;
    for (const TransformCode& k : *c->keys) {
      EXPECT_LE(k.BitsPerRow(), 3 * d);
      EXPECT_EQ(k.scale.empty(), !weighted);
      key_bits += k.BitsPerRow();
    }
    for (const TransformCode& v : *c->values) {
      EXPECT_LE(v.BitsPerRow(), d);
      value_bits += v.BitsPerRow();
    }
    EXPECT_GT(key_bits, 2 * value_bits) << "the keys' budget is three times the values'";
    o.joint = true;
    absl::StatusOr<TransformCodes> j = FitTransformCodes(rows_, o);
    ASSERT_TRUE(j.ok()) << j.status();
    int total = 0;
    for (const auto* side : {&*j->keys, &*j->values}) {
      for (const TransformCode& t : *side) total += t.BitsPerRow();
    }
    EXPECT_LE(total, 2 * d * static_cast<int>(2 * j->keys->size()));  // the mean, 2 bits
  }
  // A coded row decodes close to the row at 8 bits, far from it at 0.
  TransformFitOptions fine{.key_bits = 8.0, .value_bits = 0.0};
  absl::StatusOr<TransformCodes> c = FitTransformCodes(rows_, fine);
  ASSERT_TRUE(c.ok());
  std::vector<float> k(rows_.keys_pre[0].begin(), rows_.keys_pre[0].begin() + d);
  double err = 0, norm = 0;
  std::vector<float> rt = k;
  (*c->keys)[0].RoundTrip(rt.data());
  for (int i = 0; i < d; ++i) {
    err += (rt[i] - k[i]) * (rt[i] - k[i]);
    norm += k[i] * k[i];
  }
  EXPECT_LT(err, 1e-3 * norm);
  for (const TransformCode& v : *c->values) EXPECT_EQ(v.BitsPerRow(), 0);
}

}  // namespace
}  // namespace subspace
