// Shared by the engine's tests (engine_test.cc, engine_session_test.cc): the tiny model's
// engine, a recording observer, greedy requests and a direct greedy loop to compare with.
#ifndef SUBSPACE_TESTS_CORE_ENGINE_ENGINE_TEST_UTIL_H_
#define SUBSPACE_TESTS_CORE_ENGINE_ENGINE_TEST_UTIL_H_

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "core/kvcache/paged_kv_cache.h"
#include "gtest/gtest.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace::engine_test {

using ::subspace::testing::LoadTinyModel;
using ::subspace::testing::MakeTinyCache;
using ::subspace::testing::TinyModel;
using ::subspace::testing::TinyModelOptions;

inline constexpr absl::Duration kWait = absl::Seconds(60);
inline constexpr int kBlockSize = 8;

// A one-shot event to wait on. std primitives rather than absl::Mutex throughout this test:
// ThreadSanitizer sees through them even with a prebuilt (uninstrumented) Abseil.
class Latch {
 public:
  void Notify() {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    cv_.notify_all();
  }
  bool Wait(absl::Duration timeout = kWait) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoSeconds(timeout), [this] { return done_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

// Collects one request's events. Hooks run on the engine thread, outside the engine's lock.
class TestObserver : public GenerateObserver {
 public:
  using Hook = std::function<void(TestObserver&, const GeneratedTokenEvent&)>;
  explicit TestObserver(Hook on_token = nullptr) : on_token_(std::move(on_token)) {}

  void OnTokens(std::span<const GeneratedTokenEvent> events) override {
    for (const GeneratedTokenEvent& e : events) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        EXPECT_EQ(finishes_, 0) << "OnTokens after OnFinish";
        tokens_.push_back(e.token);
        text_ += e.text;
      }
      if (on_token_) on_token_(*this, e);
    }
  }
  void OnFinish(const GenerateResult& result) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++finishes_;
    result_ = result;
    cv_.notify_all();
  }

  bool WaitDone(absl::Duration timeout = kWait) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, absl::ToChronoSeconds(timeout), [this] { return finishes_ > 0; });
  }
  std::vector<int32_t> tokens() const {
    std::lock_guard<std::mutex> lock(mu_);
    return tokens_;
  }
  std::string text() const {
    std::lock_guard<std::mutex> lock(mu_);
    return text_;
  }
  GenerateResult result() const {
    std::lock_guard<std::mutex> lock(mu_);
    return result_;
  }
  int finishes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return finishes_;
  }

 private:
  Hook on_token_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int32_t> tokens_;
  std::string text_;
  GenerateResult result_;
  int finishes_ = 0;
};

struct Output {
  std::vector<int32_t> tokens;
  std::string text;
  GenerateResult result;
};

std::unique_ptr<Engine> MakeEngine(EngineConfig config = {}, int64_t blocks = 512,
                                   TinyModelOptions options = {}) {
  absl::StatusOr<TinyModel> tm = LoadTinyModel(options);
  EXPECT_TRUE(tm.ok()) << tm.status();
  if (!tm.ok()) return nullptr;
  auto cache = MakeTinyCache(tm->model->config(), kBlockSize, blocks);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(std::move(config), tm->model, tm->tokenizer, *std::move(cache));
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

GenerateRequest Greedy(std::vector<int32_t> prompt, int32_t max_new, std::string session = "") {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new;
  r.ignore_eos = true;
  r.session_id = std::move(session);
  return r;
}

Output Generate(Engine& engine, GenerateRequest request) {
  auto obs = std::make_shared<TestObserver>();
  absl::StatusOr<RequestId> id = engine.Submit(std::move(request), obs);
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return {};
  EXPECT_TRUE(obs->WaitDone());
  EXPECT_EQ(obs->finishes(), 1);
  return {obs->tokens(), obs->text(), obs->result()};
}

// Prompts of ordinary tokens (no control tokens), reproducible per seed.
std::vector<int32_t> RandomPrompt(uint32_t seed, int length, int32_t vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(testing::kTinyFirstByte, vocab - 1);
  std::vector<int32_t> p = {testing::kTinyBos};
  while (static_cast<int>(p.size()) < length) p.push_back(dist(rng));
  return p;
}

// Greedy decoding with the model alone: one prefill, then one token per forward pass.
std::vector<int32_t> DirectGreedy(const std::vector<int32_t>& prompt, int n) {
  absl::StatusOr<TinyModel> tm = LoadTinyModel();
  EXPECT_TRUE(tm.ok());
  auto cache = MakeTinyCache(tm->model->config(), kBlockSize, 64);
  EXPECT_TRUE(cache.ok());
  KvCache& c = **cache;
  const SeqId seq = *c.CreateSequence();
  std::vector<int32_t> all = prompt;
  std::vector<int32_t> out;
  std::vector<float> logits;
  int64_t pos = 0;
  while (static_cast<int>(out.size()) < n) {
    const int64_t len = static_cast<int64_t>(all.size()) - pos;
    EXPECT_TRUE(c.Reserve(seq, len).ok());
    SequenceChunk chunk{seq, pos, std::span<const int32_t>(all.data() + pos, len)};
    EXPECT_TRUE(tm->model->Forward({&chunk, 1}, c, &logits).ok());
    pos += len;
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(next);
    all.push_back(next);
  }
  return out;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Holds the engine thread inside the first OnTokens of a one-token request until released,
// so requests submitted meanwhile all wait in the queue together.
class Gate {
 public:
  explicit Gate(Engine& engine) {
    observer_ = std::make_shared<TestObserver>([this](TestObserver&, const GeneratedTokenEvent&) {
      entered_.Notify();
      release_.Wait();
    });
    absl::StatusOr<RequestId> id = engine.Submit(Greedy({testing::kTinyBos, 10}, 1), observer_);
    EXPECT_TRUE(id.ok()) << id.status();
    EXPECT_TRUE(entered_.Wait());
  }
  void Release() {
    release_.Notify();
    EXPECT_TRUE(observer_->WaitDone());
  }

 private:
  Latch entered_;
  Latch release_;
  std::shared_ptr<TestObserver> observer_;
};

int32_t Vocab(const Engine& e) { return e.model_config().n_vocab; }

}  // namespace subspace::engine_test

#endif  // SUBSPACE_TESTS_CORE_ENGINE_ENGINE_TEST_UTIL_H_
