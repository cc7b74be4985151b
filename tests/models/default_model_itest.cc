// The committed models (models/subspace-tiny.gguf, the default, and models/subspace-long.gguf,
// the long-context one) against the PyTorch reference numbers that tools/train/reference.py
// wrote beside each (models/<name>.expected.json): tokenizer ids, greedy continuations and
// test-split perplexity -- for the long model in windows of 2,048 tokens, so every RoPE position
// it serves is checked.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/gguf/gguf.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/model/model.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/test_util.h"
#include "tools/eval/perplexity.h"

namespace subspace {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

// Each committed model, by its file name without ".gguf".
constexpr const char* kModels[] = {"subspace-tiny", "subspace-long"};

std::vector<int32_t> Ids(const Value& v) {
  std::vector<int32_t> ids;
  for (const Value& e : v.list_value().values())
    ids.push_back(static_cast<int32_t>(e.number_value()));
  return ids;
}

class DefaultModelTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const std::string name = GetParam();
    const std::string model_path = testing::SourcePath("models/" + name + ".gguf");
    const std::string expected_path = testing::SourcePath("models/" + name + ".expected.json");
    // The model is committed, so it must exist in every checkout, CI or not.
    ASSERT_TRUE(testing::FileExists(model_path)) << model_path;
    ASSERT_TRUE(testing::FileExists(expected_path)) << expected_path;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(testing::ReadFileOrDie(expected_path),
                                                            &expected_)
                    .ok());
    absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(model_path);
    ASSERT_TRUE(file.ok()) << file.status();
    std::shared_ptr<const GgufFile> shared = std::move(*file);
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromGguf(*shared);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::move(*tokenizer);
    absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(shared);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    PagedKvCache::Config config;
    config.geometry = model_->config().cache_geometry();
    config.capacity_bytes = 64ll << 20;
    absl::StatusOr<std::unique_ptr<PagedKvCache>> cache = PagedKvCache::Create(config);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  const Value& Field(const Struct& s, const std::string& key) {
    static const Value kNull;
    auto it = s.fields().find(key);
    return it == s.fields().end() ? kNull : it->second;
  }

  Struct expected_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<PagedKvCache> cache_;
};

TEST_P(DefaultModelTest, TokenizerMatchesSentencePiece) {
  const ListValue& cases = Field(expected_, "tokenizer_cases").list_value();
  ASSERT_GT(cases.values_size(), 0);
  for (const Value& c : cases.values()) {
    const std::string& text = Field(c.struct_value(), "text").string_value();
    EXPECT_EQ(tokenizer_->Encode(text, {.add_bos = false}), Ids(Field(c.struct_value(), "ids")))
        << "text: " << text;
  }
}

TEST_P(DefaultModelTest, GreedyContinuationsMatchPyTorch) {
  const ListValue& prompts = Field(expected_, "prompts").list_value();
  ASSERT_GE(prompts.values_size(), 3);
  for (const Value& p : prompts.values()) {
    const Struct& prompt = p.struct_value();
    const std::string& text = Field(prompt, "text").string_value();
    std::vector<int32_t> ids = tokenizer_->Encode(text, {.add_bos = true});
    ASSERT_EQ(ids, Ids(Field(prompt, "ids"))) << text;
    const std::vector<int32_t> want = Ids(Field(prompt, "greedy_ids"));
    const ListValue& margins = Field(prompt, "greedy_top2_margin").list_value();

    absl::StatusOr<SeqId> seq = cache_->CreateSequence();
    ASSERT_TRUE(seq.ok());
    ASSERT_TRUE(cache_->Reserve(*seq, ids.size() + want.size()).ok());
    std::vector<float> logits;
    SequenceChunk chunk{*seq, 0, ids, false};
    ASSERT_TRUE(model_->Forward({&chunk, 1}, *cache_, &logits).ok());
    for (size_t i = 0; i < want.size(); ++i) {
      const int32_t got =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      // fp16 weights are the same on both sides; only fp32 summation order differs, so a
      // mismatch is a bug unless PyTorch's own top-2 margin was a near tie.
      if (margins.values(i).number_value() < 1e-3) break;
      ASSERT_EQ(got, want[i]) << "prompt '" << text << "' step " << i;
      ids.push_back(got);
      SequenceChunk step{*seq, static_cast<int64_t>(ids.size()) - 1, {&ids.back(), 1}, false};
      ASSERT_TRUE(model_->Forward({&step, 1}, *cache_, &logits).ok());
    }
    ASSERT_TRUE(cache_->FreeSequence(*seq).ok());
  }
}

TEST_P(DefaultModelTest, TestSplitPerplexityMatchesPyTorch) {
  const Struct& test = Field(expected_, "test").struct_value();
  const std::string text =
      testing::ReadFileOrDie(testing::SourcePath(Field(test, "file").string_value()));
  const std::vector<int32_t> tokens = tokenizer_->Encode(text, {.add_bos = false});
  ASSERT_EQ(static_cast<double>(tokens.size()), Field(test, "num_file_tokens").number_value());
  const int context = static_cast<int>(Field(expected_, "context_length").number_value());
  absl::StatusOr<eval::PerplexityResult> got =
      eval::ComputePerplexity(*model_, *cache_, tokens, tokenizer_->bos_id(), context);
  ASSERT_TRUE(got.ok()) << got.status();
  const double want = Field(test, "perplexity").number_value();
  std::printf("test-split perplexity: engine %.4f, PyTorch %.4f (%lld tokens, %lld windows)\n",
              got->perplexity, want, static_cast<long long>(got->tokens_scored),
              static_cast<long long>(got->windows));
  EXPECT_EQ(static_cast<double>(got->tokens_scored),
            Field(test, "predicted_tokens").number_value());
  EXPECT_NEAR(got->perplexity, want, 0.005 * want)
      << "engine " << got->perplexity << " vs PyTorch " << want;
}

INSTANTIATE_TEST_SUITE_P(CommittedModels, DefaultModelTest, ::testing::ValuesIn(kModels),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace subspace
