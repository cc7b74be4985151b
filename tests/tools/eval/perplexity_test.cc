// ComputePerplexity against a direct computation: one all-logits forward per window built by
// hand from the documented rule ([BOS] + chunks of window - 1 tokens).
#include "tools/eval/perplexity.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/core/model/tiny_model_util.h"

namespace subspace::eval {
namespace {

using testing::kTinyBos;
using testing::LoadTinyModel;
using testing::MakeTinyCache;

double ReferenceMeanNll(LlamaModel& model, KvCache& cache, const std::vector<int32_t>& tokens,
                        int window, int64_t* scored) {
  const int n_vocab = model.config().n_vocab;
  double nll = 0.0;
  *scored = 0;
  for (size_t begin = 0; begin < tokens.size(); begin += window - 1) {
    std::vector<int32_t> w = {kTinyBos};
    for (size_t i = begin; i < std::min(tokens.size(), begin + window - 1); ++i) {
      w.push_back(tokens[i]);
    }
    SeqId seq = *cache.CreateSequence();
    EXPECT_TRUE(cache.Reserve(seq, w.size()).ok());
    std::vector<float> logits;
    SequenceChunk chunk{seq, 0, w, true};
    EXPECT_TRUE(model.Forward({&chunk, 1}, cache, &logits).ok());
    for (size_t i = 0; i + 1 < w.size(); ++i) {
      const float* row = &logits[i * n_vocab];
      double sum = 0.0;
      for (int v = 0; v < n_vocab; ++v) sum += std::exp(static_cast<double>(row[v]));
      nll += std::log(sum) - row[w[i + 1]];
      ++*scored;
    }
    EXPECT_TRUE(cache.FreeSequence(seq).ok());
  }
  return nll / *scored;
}

TEST(PerplexityTest, MatchesDirectComputationOverSeveralWindows) {
  absl::StatusOr<testing::TinyModel> tiny = LoadTinyModel();
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  auto cache = MakeTinyCache(tiny->model->config(), 8, 64);
  ASSERT_TRUE(cache.ok());
  std::vector<int32_t> tokens;
  for (int i = 0; i < 45; ++i) tokens.push_back(3 + (i * 37) % 200);
  for (int window : {2, 7, 16, 128}) {
    int64_t scored = 0;
    const double want = ReferenceMeanNll(*tiny->model, **cache, tokens, window, &scored);
    absl::StatusOr<PerplexityResult> got =
        ComputePerplexity(*tiny->model, **cache, tokens, kTinyBos, window);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->tokens_scored, 45) << "every token is predicted exactly once";
    EXPECT_EQ(scored, 45);
    // Same logits on both sides; ComputePerplexity shifts by the max in fp32 first, which
    // moves the log-sum-exp by ~1e-8 relative.
    EXPECT_NEAR(got->mean_nll, want, 1e-6 * std::abs(want)) << "window " << window;
    EXPECT_NEAR(got->perplexity, std::exp(want), 1e-5 * std::exp(want));
    EXPECT_EQ(got->windows, (45 + window - 2) / (window - 1));
    EXPECT_EQ((*cache)->Stats().sequences, 0) << "windows must free their sequences";
  }
}

TEST(PerplexityTest, RejectsBadArguments) {
  absl::StatusOr<testing::TinyModel> tiny = LoadTinyModel();
  ASSERT_TRUE(tiny.ok());
  auto cache = MakeTinyCache(tiny->model->config(), 8, 64);
  ASSERT_TRUE(cache.ok());
  const std::vector<int32_t> tokens = {5, 6, 7};
  EXPECT_EQ(ComputePerplexity(*tiny->model, **cache, tokens, kTinyBos, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputePerplexity(*tiny->model, **cache, tokens, kTinyBos, 100000).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputePerplexity(*tiny->model, **cache, {}, kTinyBos, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputePerplexity(*tiny->model, **cache, tokens, -1, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace subspace::eval
