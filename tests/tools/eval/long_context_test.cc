// The long-context evaluation's pieces on the embedded model: suite lines parse into the
// tokens and scored span they describe, a run scores what the model predicts there, and a run
// scored against itself has no divergence while eviction's has some.
#include "tools/eval/long_context.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/paged_kv_cache.h"
#include "tests/test_util.h"
#include "tools/eval/baseline_kv_caches.h"

namespace subspace::eval {
namespace {

class LongContextTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<GgufFile>> f =
        GgufFile::Open(::subspace::testing::SourcePath("models/subspace-tiny.gguf"));
    ASSERT_TRUE(f.ok()) << f.status();
    gguf_ = new std::shared_ptr<const GgufFile>(*std::move(f));
    tok_ = Tokenizer::FromGguf(**gguf_)->release();
    model_ = LlamaModel::Load(*gguf_)->release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete tok_;
    delete gguf_;
  }
  std::unique_ptr<PagedKvCache> Full() {
    return *PagedKvCache::Create({.geometry = model_->config().cache_geometry(),
                                  .block_size = 16,
                                  .capacity_bytes = int64_t{32} << 20});
  }
  static std::shared_ptr<const GgufFile>* gguf_;
  static Tokenizer* tok_;
  static LlamaModel* model_;
};
std::shared_ptr<const GgufFile>* LongContextTest::gguf_ = nullptr;
Tokenizer* LongContextTest::tok_ = nullptr;
LlamaModel* LongContextTest::model_ = nullptr;

TEST_F(LongContextTest, SuiteLinesParse) {
  absl::StatusOr<LongContextItem> pk = ParseSuiteLine(
      R"({"kind": "passkey_filler", "length": 30, "depth": 0.5,
          "prompt": "The pass key is 123. What is the pass key? The pass key is",
          "answer": " 123"})",
      *tok_, 512);
  ASSERT_TRUE(pk.ok()) << pk.status();
  EXPECT_TRUE(pk->retrieval());
  EXPECT_EQ(pk->tokens[0], tok_->bos_id());
  EXPECT_EQ(
      tok_->Decode(std::vector<int32_t>(pk->tokens.begin() + pk->scored_from, pk->tokens.end()),
                   /*strip_leading_space=*/false),
      " 123");
  EXPECT_DOUBLE_EQ(pk->depth, 0.5);

  const std::string text = "In the beginning God created the heaven and the earth. In the";
  absl::StatusOr<LongContextItem> rec =
      ParseSuiteLine(absl::StrCat(R"({"kind": "recurrence", "distance": 9, "text": ")", text,
                                  R"(", "scored_from": )", text.rfind(" In the"), "}"),
                     *tok_, 512);
  ASSERT_TRUE(rec.ok()) << rec.status();
  EXPECT_EQ(
      tok_->Decode(std::vector<int32_t>(rec->tokens.begin() + rec->scored_from, rec->tokens.end()),
                   /*strip_leading_space=*/false),
      " In the");

  // A continuation scores the rest of the passage after its cue; scored_from is required.
  absl::StatusOr<LongContextItem> cont =
      ParseSuiteLine(absl::StrCat(R"({"kind": "continuation", "distance": 9, "text": ")", text,
                                  R"(", "scored_from": )", text.rfind(" the earth"), "}"),
                     *tok_, 512);
  ASSERT_TRUE(cont.ok()) << cont.status();
  EXPECT_FALSE(cont->retrieval());
  EXPECT_EQ(tok_->Decode(
                std::vector<int32_t>(cont->tokens.begin() + cont->scored_from, cont->tokens.end()),
                /*strip_leading_space=*/false),
            " the earth. In the");
  EXPECT_FALSE(ParseSuiteLine(absl::StrCat(R"({"kind": "continuation", "text": ")", text, R"("})"),
                              *tok_, 512)
                   .ok());

  EXPECT_FALSE(ParseSuiteLine("not json", *tok_, 512).ok());
  EXPECT_FALSE(ParseSuiteLine(R"({"kind": "poem", "text": "x"})", *tok_, 512).ok());
  EXPECT_FALSE(ParseSuiteLine(R"({"kind": "kv", "prompt": "x"})", *tok_, 512).ok());
  EXPECT_FALSE(ParseSuiteLine(R"({"kind": "plain", "text": "a b c d e f g"})", *tok_, 3).ok())
      << "longer than the context";
}

TEST_F(LongContextTest, RunsScoreThePredictionsAndDivergeOnlyWhenTheCacheDoes) {
  // A passage the model can only continue from its first occurrence, ~150 tokens back.
  std::string text =
      "And God said, Let there be light: and there was light. And God saw the light, that it "
      "was good: and God divided the light from the darkness.";
  std::string filler;
  for (int i = 0; i < 8; ++i) filler += " The grass is green. The sky is blue.";
  const std::string line =
      absl::StrCat(R"({"kind": "recurrence", "text": ")", text, filler, " ", text,
                   R"(", "scored_from": )", text.size() + filler.size(), "}");
  absl::StatusOr<LongContextItem> item = ParseSuiteLine(line, *tok_, 512);
  ASSERT_TRUE(item.ok()) << item.status();
  ASSERT_GT(item->scored_from, 100);

  auto full = Full();
  absl::StatusOr<ItemRun> a = RunItem(*model_, *full, *item, 16);
  absl::StatusOr<ItemRun> b = RunItem(*model_, *full, *item, 64);  // other chunks, same math
  ASSERT_TRUE(a.ok() && b.ok());
  const int v = model_->config().n_vocab;
  const ItemScore self = ScoreItem(*item, *a, &*b, v);
  EXPECT_EQ(self.scored, static_cast<int64_t>(item->tokens.size()) - item->scored_from);
  EXPECT_LT(self.kld / static_cast<double>(self.scored), 1e-6);
  EXPECT_EQ(self.top1_agree, self.scored);
  EXPECT_GT(self.nll, 0.0);
  EXPECT_EQ(full->Stats().sequences, 0) << "a run frees its sequence";

  auto evict = *BaselineKvCache::Create({.geometry = model_->config().cache_geometry(),
                                         .kind = BaselineKind::kEvict,
                                         .sink_tokens = 4,
                                         .window_tokens = 16,
                                         .capacity_bytes = int64_t{32} << 20});
  absl::StatusOr<ItemRun> e = RunItem(*model_, *evict, *item, 16);
  ASSERT_TRUE(e.ok());
  const ItemScore ev = ScoreItem(*item, *e, &*a, v);
  EXPECT_GT(ev.kld / static_cast<double>(ev.scored), 1e-3) << "eviction changed nothing";

  // `correct` counts the positions whose argmax is the text's token.
  for (const auto& [run, score] : {std::pair{&*a, self}, std::pair{&*e, ev}}) {
    int64_t correct = 0;
    for (int64_t j = 0; j < score.scored; ++j) {
      correct += run->argmax[static_cast<size_t>(j)] ==
                 item->tokens[static_cast<size_t>(item->scored_from + j)];
    }
    EXPECT_EQ(score.correct, correct);
  }
}

}  // namespace
}  // namespace subspace::eval
