// The engine's device-sampling path (ModelRunner::ForwardAndSample) on the CPU: a runner that
// wraps the tiny CPU model and samples its logits rows with the sampling kernel's twin, as the
// CUDA backend samples with the kernel. Seeded requests must generate the tokens the host
// sampler generates (the engine hands the device the uniform the request's Sampler draws), and
// requests the device cannot serve (repetition penalty, top logprobs) take the logits path.
#include <gtest/gtest.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "kernels/sampling.h"
#include "tests/core/model/tiny_model_util.h"
#include "tests/kernels/sampling_ref.h"

namespace subspace {
namespace {

// The tiny CPU model, sampling its rows with the kernel's twin (counts which path each step took).
class TwinSamplingRunner final : public ModelRunner {
 public:
  explicit TwinSamplingRunner(std::shared_ptr<LlamaModel> model) : model_(std::move(model)) {}

  const ModelConfig& config() const override { return model_->config(); }
  std::string device_name() const override { return "cpu (twin sampling)"; }
  absl::Status Forward(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                       std::vector<float>* logits) override {
    ++logit_steps;
    return model_->Forward(batch, cache, logits);
  }
  bool samples_rows() const override { return true; }
  absl::Status ForwardAndSample(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                                std::span<const RowSampling> rows,
                                std::vector<TokenLogprob>* sampled) override {
    ++sampled_steps;
    if (rows.size() != batch.size()) return absl::InvalidArgumentError("one row per chunk");
    if (absl::Status st = model_->Forward(batch, cache, &logits_); !st.ok()) return st;
    const size_t n = rows.size();
    std::vector<float> temperature(n), top_p(n), min_p(n), uniform(n), logprob(n);
    std::vector<int32_t> top_k(n), token(n);
    for (size_t i = 0; i < n; ++i) {
      temperature[i] = rows[i].temperature;
      top_k[i] = rows[i].top_k;
      top_p[i] = rows[i].top_p;
      min_p[i] = rows[i].min_p;
      uniform[i] = rows[i].uniform;
    }
    kernels::SampleTokensRef({.logits = logits_.data(),
                              .temperature = temperature.data(),
                              .top_k = top_k.data(),
                              .top_p = top_p.data(),
                              .min_p = min_p.data(),
                              .uniform = uniform.data(),
                              .token = token.data(),
                              .logprob = logprob.data(),
                              .n_rows = static_cast<int32_t>(n),
                              .vocab = model_->config().n_vocab});
    sampled->resize(n);
    for (size_t i = 0; i < n; ++i) (*sampled)[i] = {token[i], logprob[i]};
    return absl::OkStatus();
  }

  int logit_steps = 0;  // engine thread only; read after the engine is idle
  int sampled_steps = 0;

 private:
  std::shared_ptr<LlamaModel> model_;
  std::vector<float> logits_;
};

class Collector : public GenerateObserver {
 public:
  void OnTokens(std::span<const GeneratedTokenEvent> events) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const GeneratedTokenEvent& e : events) {
      tokens_.push_back(e.token);
      logprobs_.push_back(e.logprob);
    }
  }
  void OnFinish(const GenerateResult&) override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    ASSERT_TRUE(cv_.wait_for(lock, std::chrono::seconds(60), [this] { return done_; }));
  }
  std::vector<int32_t> tokens() {
    std::lock_guard<std::mutex> lock(mu_);
    return tokens_;
  }
  std::vector<float> logprobs() {
    std::lock_guard<std::mutex> lock(mu_);
    return logprobs_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int32_t> tokens_;
  std::vector<float> logprobs_;
  bool done_ = false;
};

std::unique_ptr<Engine> MakeEngine(std::shared_ptr<ModelRunner> runner,
                                   const testing::TinyModel& tm) {
  auto cache = testing::MakeTinyCache(runner->config(), 16, 512);
  EXPECT_TRUE(cache.ok()) << cache.status();
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create({}, std::move(runner), tm.tokenizer, *std::move(cache));
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

// Submits every request at once (so steps batch them) and collects each one's tokens.
std::vector<std::shared_ptr<Collector>> RunAll(Engine& engine,
                                               const std::vector<GenerateRequest>& requests) {
  std::vector<std::shared_ptr<Collector>> out;
  for (const GenerateRequest& r : requests) {
    out.push_back(std::make_shared<Collector>());
    EXPECT_TRUE(engine.Submit(r, out.back()).ok());
  }
  for (auto& c : out) c->Wait();
  return out;
}

GenerateRequest Request(int salt, SamplingParams sampling) {
  GenerateRequest r;
  for (int i = 0; i < 12 + salt; ++i) {
    r.prompt.push_back(testing::kTinyFirstByte + (i * 37 + salt * 11) % 200);
  }
  r.max_new_tokens = 24;
  r.ignore_eos = true;
  r.sampling = sampling;
  return r;
}

TEST(EngineRowSamplingTest, SeededRequestsGenerateTheHostSamplersTokens) {
  absl::StatusOr<testing::TinyModel> host_tm = testing::LoadTinyModel();
  absl::StatusOr<testing::TinyModel> twin_tm = testing::LoadTinyModel();
  ASSERT_TRUE(host_tm.ok() && twin_tm.ok());
  auto twin = std::make_shared<TwinSamplingRunner>(twin_tm->model);
  std::unique_ptr<Engine> host = MakeEngine(host_tm->model, *host_tm);
  std::unique_ptr<Engine> device = MakeEngine(twin, *twin_tm);
  ASSERT_NE(host, nullptr);
  ASSERT_NE(device, nullptr);
  const std::vector<GenerateRequest> requests = {
      Request(0, {}),  // greedy
      Request(1, {.temperature = 0.8f, .top_k = 40, .seed = 7}),
      Request(2, {.temperature = 1.0f, .top_p = 0.9f, .seed = 3}),
      Request(3, {.temperature = 1.3f, .min_p = 0.05f, .seed = 11}),
      Request(4, {.temperature = 0.7f, .top_k = 20, .top_p = 0.8f, .min_p = 0.02f, .seed = 5}),
  };
  const auto want = RunAll(*host, requests);
  const auto got = RunAll(*device, requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(got[i]->tokens(), want[i]->tokens()) << "request " << i;
    const std::vector<float> a = got[i]->logprobs(), b = want[i]->logprobs();
    ASSERT_EQ(a.size(), b.size());
    for (size_t t = 0; t < a.size(); ++t) EXPECT_NEAR(a[t], b[t], 1e-4f) << i << " " << t;
  }
  EXPECT_GT(twin->sampled_steps, 0);
  EXPECT_EQ(twin->logit_steps, 0);
}

TEST(EngineRowSamplingTest, RequestsTheDeviceCannotServeTakeTheLogitsPath) {
  absl::StatusOr<testing::TinyModel> tm = testing::LoadTinyModel();
  ASSERT_TRUE(tm.ok());
  auto twin = std::make_shared<TwinSamplingRunner>(tm->model);
  std::unique_ptr<Engine> engine = MakeEngine(twin, *tm);
  ASSERT_NE(engine, nullptr);
  RunAll(*engine, {Request(0, {.repetition_penalty = 1.3f})});
  EXPECT_EQ(twin->sampled_steps, 0);
  EXPECT_GT(twin->logit_steps, 0);
  const int before = twin->logit_steps;
  RunAll(*engine, {Request(1, {.logprobs = 3})});
  EXPECT_GT(twin->logit_steps, before);
  EXPECT_EQ(twin->sampled_steps, 0);
  RunAll(*engine, {Request(2, {})});
  EXPECT_GT(twin->sampled_steps, 0);
}

}  // namespace
}  // namespace subspace
