// The codec the server fits at start-up (--kv-budget): the option checks that name each flag,
// the calibration text read from a file or a directory (in name order, cut at the token limit),
// and a fitted codec that matches the model and its budgets and codes rows as the calibration
// tool's code path does.
#include "runtime/codec_calibration.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "runtime/kv_cache_options.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace::runtime {
namespace {

KvCacheOptions Transform() {
  KvCacheOptions o;
  o.kind = KvCacheKind::kTransform;
  o.kv_budget = 2.5;
  o.calib_text_path = "calib.txt";
  return o;
}

std::string Message(const KvCacheOptions& o) {
  const absl::Status s = ValidateKvCacheOptions(o, 16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  return std::string(s.message());
}

TEST(CodecCalibrationTest, BudgetOptionsAreCheckedNamingTheFlag) {
  EXPECT_TRUE(ValidateKvCacheOptions(Transform(), 16).ok());
  KvCacheOptions o = Transform();
  o.kv_budget = 0.0;
  o.calib_text_path.clear();
  EXPECT_NE(Message(o).find("--codec FILE"), std::string::npos);  // neither codec nor budget
  o = Transform();
  o.codec_path = "x.codec";
  EXPECT_NE(Message(o).find("exclude each other"), std::string::npos);
  o = Transform();
  o.kv_budget = 9.0;
  EXPECT_NE(Message(o).find("--kv-budget must be in (0, 8]"), std::string::npos);
  o = Transform();
  o.kv_budget_v = -1.0;
  EXPECT_NE(Message(o).find("--kv-budget-v"), std::string::npos);
  o = Transform();
  o.calib_text_path.clear();  // the model writes its own
  EXPECT_TRUE(ValidateKvCacheOptions(o, 16).ok());
  o = Transform();
  o.calib_tokens = 10;
  EXPECT_NE(Message(o).find("--calib-tokens"), std::string::npos);
  o = Transform();
  o.kv_budget = 0.0;
  o.codec_path = "x.codec";  // a file, plus a flag only a fitted codec uses
  EXPECT_NE(Message(o).find("need --kv-budget instead of --codec"), std::string::npos);
  KvCacheOptions compressed;
  compressed.kv_budget = 3.0;
  EXPECT_NE(Message(compressed).find("--kv-budget needs --kv-cache=transform"), std::string::npos);
  compressed = {};
  compressed.codec_post_rope = true;
  EXPECT_NE(Message(compressed).find("--codec-post-rope needs"), std::string::npos);
}

// The transform cache refreshes by pca every N tokens: other methods and the residual trigger
// are refused naming the flag, as is refresh on a cache without codes or bases.
TEST(CodecCalibrationTest, TransformRefreshIsCheckedNamingTheFlag) {
  KvCacheOptions o = Transform();
  o.refresh.method = RefreshMethod::kPca;
  EXPECT_TRUE(ValidateKvCacheOptions(o, 16).ok());
  o.refresh.method = RefreshMethod::kOja;
  EXPECT_NE(Message(o).find("by pca, not oja"), std::string::npos);
  o.refresh.method = RefreshMethod::kPca;
  o.refresh.residual_threshold = 0.2;
  EXPECT_NE(Message(o).find("--refresh-residual-threshold must be 0"), std::string::npos);
  o.refresh.residual_threshold = 0.0;
  o.refresh.every_tokens = 0;
  EXPECT_NE(Message(o).find("--refresh-every-tokens"), std::string::npos);
  KvCacheOptions quantized;
  quantized.kind = KvCacheKind::kQuantized;
  quantized.refresh.method = RefreshMethod::kPca;
  EXPECT_NE(Message(quantized).find("needs --kv-cache=compressed or --kv-cache=transform"),
            std::string::npos);
}

TEST(CodecCalibrationTest, ReadsAFileOrADirectoryInNameOrderUpToTheLimit) {
  absl::StatusOr<testing::TinyModel> tiny = testing::LoadTinyModel();
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  const Tokenizer& tok = *tiny->tokenizer;
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "calib_dir";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "b.txt") << "second file";
  std::ofstream(dir / "a.txt") << "first file ";
  const std::vector<int32_t> a = tok.Encode("first file ", {.add_bos = false});
  const std::vector<int32_t> b = tok.Encode("second file", {.add_bos = false});

  absl::StatusOr<std::vector<int32_t>> all = ReadCalibrationTokens(dir.string(), tok, 0);
  ASSERT_TRUE(all.ok()) << all.status();
  std::vector<int32_t> want = a;
  want.insert(want.end(), b.begin(), b.end());
  EXPECT_EQ(*all, want);
  absl::StatusOr<std::vector<int32_t>> one =
      ReadCalibrationTokens((dir / "a.txt").string(), tok, 0);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, a);
  absl::StatusOr<std::vector<int32_t>> cut = ReadCalibrationTokens(dir.string(), tok, 3);
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(*cut, std::vector<int32_t>(want.begin(), want.begin() + 3));

  EXPECT_EQ(ReadCalibrationTokens((dir / "none").string(), tok, 0).status().code(),
            absl::StatusCode::kNotFound);
  const fs::path empty_dir = dir / "empty";
  fs::create_directories(empty_dir);
  EXPECT_EQ(ReadCalibrationTokens(empty_dir.string(), tok, 0).status().code(),
            absl::StatusCode::kNotFound);
  std::ofstream(empty_dir / "blank.txt") << "";
  EXPECT_EQ(ReadCalibrationTokens(empty_dir.string(), tok, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  fs::remove_all(dir);
}

// The model's own text: as many tokens as asked, in the vocabulary, never EOS, the same for a
// seed and another for another seed, in streams that each restart from BOS (a stream's first
// token follows BOS as the model's first tokens do).
TEST(CodecCalibrationTest, SamplesItsOwnTextReproducibly) {
  absl::StatusOr<testing::TinyModel> tiny = testing::LoadTinyModel();
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  const int32_t vocab = tiny->model->config().n_vocab;
  // Windows of 40: 140 tokens are four streams (the last cut to 20), 700 two rounds (sixteen
  // streams, 640 tokens, at once).
  for (const int64_t n : {int64_t{140}, int64_t{700}}) {
    absl::StatusOr<std::vector<int32_t>> a =
        runtime::SampleCalibrationTokens(*tiny->model, testing::kTinyBos, testing::kTinyEos, n,
                                         /*window=*/40, /*seed=*/7);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_EQ(static_cast<int64_t>(a->size()), n);
    for (int32_t t : *a) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, vocab);
      ASSERT_NE(t, testing::kTinyEos);
    }
    absl::StatusOr<std::vector<int32_t>> again = runtime::SampleCalibrationTokens(
        *tiny->model, testing::kTinyBos, testing::kTinyEos, n, 40, 7);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*a, *again);
    absl::StatusOr<std::vector<int32_t>> other = runtime::SampleCalibrationTokens(
        *tiny->model, testing::kTinyBos, testing::kTinyEos, n, 40, 8);
    ASSERT_TRUE(other.ok());
    EXPECT_NE(*a, *other);
  }
  EXPECT_EQ(
      runtime::SampleCalibrationTokens(*tiny->model, testing::kTinyBos, testing::kTinyEos, 0, 40, 1)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(runtime::SampleCalibrationTokens(*tiny->model, -1, testing::kTinyEos, 10, 40, 1)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CodecCalibrationTest, FitsACodecForTheModelAndItsBudgets) {
  absl::StatusOr<testing::TinyModel> tiny = testing::LoadTinyModel();
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  std::vector<int32_t> tokens;
  for (int i = 0; i < 400; ++i) tokens.push_back(3 + (i * 37) % 250);
  for (const bool pre_rope : {true, false}) {
    const TransformFitOptions fit{.key_bits = 3.0,
                                  .value_bits = 2.0,
                                  .pre_rope_keys = pre_rope,
                                  .attention_weighted = !pre_rope};
    absl::StatusOr<CodecFile> file =
        FitCodecFile(*tiny->model, *tiny->file, tokens, fit,
                     {.window = 128, .max_tokens = 0, .bos = 1, .progress = {}});
    ASSERT_TRUE(file.ok()) << file.status();
    const ModelConfig& c = tiny->model->config();
    EXPECT_EQ(file->info.model_checksum, ModelChecksum(*tiny->file));
    EXPECT_EQ(file->info.pre_rope_keys, pre_rope);
    EXPECT_EQ(file->info.attention_weighted, !pre_rope);
    EXPECT_EQ(file->keys[0].scale.empty(), pre_rope);  // the weights ride in the codes
    EXPECT_EQ(file->info.key_bits, 3.0);
    EXPECT_EQ(file->info.value_bits, 2.0);
    EXPECT_GE(file->info.calibration_tokens, tokens.size());
    EXPECT_EQ(file->geometry.n_layers, c.n_layers);
    ASSERT_EQ(file->keys.size(), static_cast<size_t>(c.n_layers * c.n_kv_heads));
    ASSERT_EQ(file->values.size(), file->keys.size());
    for (size_t i = 0; i < file->keys.size(); ++i) {
      // Each layer-head gets its own budget (not joint): at most bits x head_dim a row.
      EXPECT_LE(file->keys[i].BitsPerRow(), 3 * c.head_dim) << i;
      EXPECT_LE(file->values[i].BitsPerRow(), 2 * c.head_dim) << i;
      EXPECT_GT(file->keys[i].BitsPerRow(), 2 * c.head_dim) << i;  // the budget is spent
    }
  }
}

}  // namespace
}  // namespace subspace::runtime
