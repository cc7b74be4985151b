// Engine tests on a tiny random-weight model: greedy output against a direct model loop,
// batching and preemption that must not change results, cancellation, deadlines, sessions
// (exact continuation, reuse, eviction, TTL, limits), drain, stop sequences, EOS and seeded
// sampling. Waits are on observer notifications with generous timeouts; nothing asserts on time.
#include "core/engine/engine.h"

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
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/kvcache/paged_kv_cache.h"
#include "gtest/gtest.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace {
namespace {

using ::subspace::testing::LoadTinyModel;
using ::subspace::testing::MakeTinyCache;
using ::subspace::testing::TinyModel;
using ::subspace::testing::TinyModelOptions;

constexpr absl::Duration kWait = absl::Seconds(60);
constexpr int kBlockSize = 8;

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

TEST(EngineTest, GreedyMatchesDirectModelLoop) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  std::vector<int32_t> prompt = engine->tokenizer().Encode("hello world, the end");
  Output out = Generate(*engine, Greedy(prompt, 20));
  EXPECT_EQ(out.tokens, DirectGreedy(prompt, 20));
  const GenerateResult& r = out.result;
  EXPECT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.finish, FinishReason::kLength);
  EXPECT_EQ(r.usage.prompt_tokens, static_cast<int64_t>(prompt.size()));
  EXPECT_EQ(r.usage.generated_tokens, 20);
  EXPECT_EQ(r.usage.reused_tokens, 0);
  EXPECT_EQ(r.preemptions, 0);
  EXPECT_EQ(r.timings.inter_token_seconds.size(), 19u);
  EXPECT_GE(r.timings.ttft_seconds, r.timings.queue_seconds);
  EXPECT_GE(r.timings.total_seconds, r.timings.ttft_seconds);
  // The text is the streamed detokenization of the tokens (a continuation keeps its space).
  StreamDecoder decoder(engine->tokenizer(), /*strip_leading_space=*/false);
  std::string expected;
  for (int32_t t : out.tokens) expected += decoder.Push(t);
  expected += decoder.Flush();
  EXPECT_EQ(out.text, expected);
  const EngineStats stats = engine->Stats();
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.waiting, 0);
  EXPECT_GE(stats.steps_total, 20);
  EXPECT_EQ(stats.cache.blocks_free, stats.cache.blocks_total);
}

TEST(EngineTest, ConcurrentRequestsMatchOneAtATime) {
  int max_sequences = 0;
  std::mutex step_mu;
  EngineConfig config;
  config.on_step = [&](const StepStats& s) {
    std::lock_guard<std::mutex> lock(step_mu);
    max_sequences = std::max(max_sequences, s.sequences);
  };
  auto engine = MakeEngine(config);
  ASSERT_NE(engine, nullptr);
  constexpr int kRequests = 8;
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    requests.push_back(Greedy(RandomPrompt(100 + i, 3 + 5 * i, Vocab(*engine)), 10 + 2 * i));
  }
  std::vector<std::vector<int32_t>> alone;
  for (const GenerateRequest& r : requests) alone.push_back(Generate(*engine, r).tokens);

  Gate gate(*engine);
  std::vector<std::shared_ptr<TestObserver>> observers;
  for (const GenerateRequest& r : requests) {
    observers.push_back(std::make_shared<TestObserver>());
    ASSERT_TRUE(engine->Submit(r, observers.back()).ok());
  }
  gate.Release();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(observers[i]->WaitDone());
    EXPECT_EQ(observers[i]->tokens(), alone[i]) << "request " << i;
    EXPECT_EQ(observers[i]->result().finish, FinishReason::kLength);
    EXPECT_EQ(observers[i]->finishes(), 1);
  }
  std::lock_guard<std::mutex> lock(step_mu);
  EXPECT_EQ(max_sequences, kRequests);  // all eight ran in the same steps
}

TEST(EngineTest, PreemptionDoesNotChangeResults) {
  constexpr int kRequests = 8;
  auto big = MakeEngine();
  ASSERT_NE(big, nullptr);
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    requests.push_back(Greedy(RandomPrompt(200 + i, 10, Vocab(*big)), 30));
  }
  std::vector<std::vector<int32_t>> expected;
  for (const GenerateRequest& r : requests) expected.push_back(Generate(*big, r).tokens);

  // 30 blocks (15 per layer, 120 tokens) hold seven 10-token prompts but not their growth.
  auto engine = MakeEngine({}, /*blocks=*/30);
  ASSERT_NE(engine, nullptr);
  Gate gate(*engine);
  std::vector<std::shared_ptr<TestObserver>> observers;
  for (const GenerateRequest& r : requests) {
    observers.push_back(std::make_shared<TestObserver>());
    ASSERT_TRUE(engine->Submit(r, observers.back()).ok());
  }
  gate.Release();
  int64_t preemptions = 0;
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(observers[i]->WaitDone());
    const GenerateResult r = observers[i]->result();
    EXPECT_TRUE(r.status.ok());
    EXPECT_EQ(r.finish, FinishReason::kLength);
    EXPECT_EQ(observers[i]->tokens(), expected[i]) << "request " << i;
    EXPECT_EQ(r.usage.generated_tokens, 30);
    preemptions += r.preemptions;
  }
  const EngineStats stats = engine->Stats();
  EXPECT_GT(stats.preemptions_total, 0);
  EXPECT_EQ(preemptions, stats.preemptions_total);
  EXPECT_EQ(stats.cache.blocks_free, stats.cache.blocks_total);
}

TEST(EngineTest, QueueFull) {
  EngineConfig config;
  config.max_queue = 2;
  auto engine = MakeEngine(config);
  ASSERT_NE(engine, nullptr);
  Gate gate(*engine);
  std::vector<std::shared_ptr<TestObserver>> observers;
  for (int i = 0; i < 2; ++i) {
    observers.push_back(std::make_shared<TestObserver>());
    ASSERT_TRUE(engine->Submit(Greedy({1, 20, 30}, 3), observers.back()).ok());
  }
  EXPECT_EQ(engine->Stats().waiting, 2);
  absl::StatusOr<RequestId> third =
      engine->Submit(Greedy({1, 20, 30}, 3), std::make_shared<TestObserver>());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  gate.Release();
  for (auto& o : observers) EXPECT_TRUE(o->WaitDone());
}

TEST(EngineTest, ValidatesRequests) {
  auto engine = MakeEngine({}, /*blocks=*/64);
  ASSERT_NE(engine, nullptr);
  const auto submit = [&](GenerateRequest r) {
    return engine->Submit(std::move(r), std::make_shared<TestObserver>()).status();
  };
  const auto expect_invalid = [](const absl::Status& st, const std::string& field) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(field), std::string::npos) << st;
  };
  expect_invalid(submit(Greedy({}, 4)), "prompt");
  expect_invalid(submit(Greedy({1, Vocab(*engine)}, 4)), "prompt[1]");
  expect_invalid(submit(Greedy({1, -1}, 4)), "prompt[1]");
  expect_invalid(submit(Greedy({1, 5}, 0)), "max_new_tokens");
  GenerateRequest bad = Greedy({1, 5}, 4);
  bad.sampling.temperature = -1.0f;
  expect_invalid(submit(bad), "temperature");
  const int ctx = engine->model_config().context_length;
  expect_invalid(submit(Greedy(std::vector<int32_t>(ctx, 5), 1)), "prompt");
  EXPECT_EQ(engine->Submit(Greedy({1, 5}, 4), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  // 64 blocks = 32 per layer = 256 tokens: a full context fits, so this engine accepts all.
  Output clamped = Generate(*engine, Greedy(std::vector<int32_t>(ctx - 5, 7), 64));
  EXPECT_EQ(clamped.result.finish, FinishReason::kLength);
  EXPECT_EQ(clamped.result.usage.generated_tokens, 5);  // clamped to the context left

  // A pool of 4 blocks (16 tokens per layer) can never hold 10 + 20 tokens.
  auto small = MakeEngine({}, /*blocks=*/4);
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(
      small
          ->Submit(Greedy(RandomPrompt(1, 10, Vocab(*small)), 20), std::make_shared<TestObserver>())
          .status()
          .code(),
      absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(
      small->Submit(Greedy(RandomPrompt(1, 10, Vocab(*small)), 7), std::make_shared<TestObserver>())
          .ok());
}

TEST(EngineTest, CancelFreesBlocks) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  Latch id_ready;
  RequestId id = 0;
  Engine* e = engine.get();
  auto obs = std::make_shared<TestObserver>([&](TestObserver&, const GeneratedTokenEvent&) {
    id_ready.Wait();
    e->Cancel(id);
  });
  absl::StatusOr<RequestId> submitted = engine->Submit(Greedy({1, 40, 41, 42}, 100), obs);
  ASSERT_TRUE(submitted.ok());
  id = *submitted;
  id_ready.Notify();
  ASSERT_TRUE(obs->WaitDone());
  EXPECT_EQ(obs->result().finish, FinishReason::kCancelled);
  EXPECT_TRUE(obs->result().status.ok());
  EXPECT_EQ(obs->result().usage.generated_tokens, 1);
  const EngineStats stats = engine->Stats();
  EXPECT_EQ(stats.cache.blocks_free, stats.cache.blocks_total);
  EXPECT_EQ(stats.running + stats.waiting, 0);
  engine->Cancel(id);  // finished: ignored
  engine->Cancel(12345);
  EXPECT_EQ(obs->finishes(), 1);
}

TEST(EngineTest, Deadlines) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  GenerateRequest past = Greedy({1, 40, 41}, 50);
  past.deadline = absl::InfinitePast();
  Output out = Generate(*engine, past);
  EXPECT_EQ(out.result.finish, FinishReason::kDeadline);
  EXPECT_EQ(out.result.usage.generated_tokens, 0);

  GenerateRequest soon = Greedy({1, 40, 41}, 100);
  soon.deadline = absl::Now() + absl::Milliseconds(20);
  const absl::Time deadline = soon.deadline;
  auto obs = std::make_shared<TestObserver>([deadline](TestObserver&, const GeneratedTokenEvent&) {
    // Holding the engine thread past the deadline makes the outcome independent of speed.
    absl::SleepFor(deadline - absl::Now() + absl::Milliseconds(1));
  });
  ASSERT_TRUE(engine->Submit(soon, obs).ok());
  ASSERT_TRUE(obs->WaitDone());
  EXPECT_EQ(obs->result().finish, FinishReason::kDeadline);
  EXPECT_LE(obs->result().usage.generated_tokens, 1);
  const EngineStats stats = engine->Stats();
  EXPECT_EQ(stats.cache.blocks_free, stats.cache.blocks_total);
}

TEST(EngineTest, SessionContinuationIsExact) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<SessionInfo> session = engine->CreateSession();
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(session->id.size(), 32u);
  EXPECT_EQ(session->idle_ttl, engine->config().default_session_ttl);

  const std::vector<int32_t> a = engine->tokenizer().Encode("hello world");
  const std::vector<int32_t> b = engine->tokenizer().Encode("and the", {.add_bos = false});
  constexpr int kN = 6, kM = 8;
  Output first = Generate(*engine, Greedy(a, kN, session->id));
  EXPECT_EQ(first.result.usage.reused_tokens, 0);
  ASSERT_EQ(first.tokens.size(), static_cast<size_t>(kN));
  absl::StatusOr<SessionInfo> info = engine->GetSession(session->id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens, static_cast<int64_t>(a.size()) + kN);
  EXPECT_EQ(info->cached_tokens, info->tokens - 1);  // the last token is not cached yet
  EXPECT_FALSE(info->busy);

  Output second = Generate(*engine, Greedy(b, kM, session->id));
  EXPECT_EQ(second.result.usage.prompt_tokens, static_cast<int64_t>(b.size()));
  EXPECT_EQ(second.result.usage.reused_tokens, static_cast<int64_t>(a.size()) + kN - 1);

  // The same conversation in one call continues identically.
  Output one_shot = Generate(*engine, Greedy(Concat(Concat(a, first.tokens), b), kM));
  EXPECT_EQ(second.tokens, one_shot.tokens);
  info = engine->GetSession(session->id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens, static_cast<int64_t>(a.size() + b.size()) + kN + kM);
  EXPECT_EQ(info->cached_tokens, info->tokens - 1);
  EXPECT_EQ(engine->ListSessions().size(), 1u);

  ASSERT_TRUE(engine->DeleteSession(session->id).ok());
  EXPECT_EQ(engine->GetSession(session->id).status().code(), absl::StatusCode::kNotFound);
  // The loop frees the deleted session's cache at its next turn.
  for (absl::Time end = absl::Now() + kWait; absl::Now() < end;) {
    const EngineStats s = engine->Stats();
    if (s.cache.blocks_free == s.cache.blocks_total) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  const EngineStats stats = engine->Stats();
  EXPECT_EQ(stats.cache.blocks_free, stats.cache.blocks_total);
  EXPECT_EQ(stats.sessions, 0);
}

// A chat re-rendered whole on its session (prompt_replaces_history): the cached prefix it
// shares with the session's history is reused -- all of it when the new conversation extends
// the old, up to the first difference when it rewrites the past -- and the output equals a
// fresh run of the same conversation.
TEST(EngineTest, ReplacedHistoryKeepsTheSharedPrefix) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<SessionInfo> session = engine->CreateSession();
  ASSERT_TRUE(session.ok()) << session.status();
  const int32_t vocab = engine->model_config().n_vocab;
  const std::vector<int32_t> a = RandomPrompt(11, 40, vocab);
  constexpr int kN = 6, kM = 7;
  Output first = Generate(*engine, Greedy(a, kN, session->id));
  ASSERT_EQ(first.tokens.size(), static_cast<size_t>(kN));

  // The whole conversation again, with a new turn: only the new tokens are prefilled.
  const std::vector<int32_t> turn = {testing::kTinyFirstByte + 40, testing::kTinyFirstByte + 41};
  std::vector<int32_t> whole = Concat(Concat(a, first.tokens), turn);
  GenerateRequest extend = Greedy(whole, kM, session->id);
  extend.prompt_replaces_history = true;
  Output second = Generate(*engine, extend);
  EXPECT_EQ(second.result.usage.reused_tokens, static_cast<int64_t>(a.size()) + kN - 1);
  EXPECT_EQ(second.result.usage.prompt_tokens, static_cast<int64_t>(turn.size()));
  EXPECT_EQ(second.tokens, Generate(*engine, Greedy(whole, kM)).tokens);
  absl::StatusOr<SessionInfo> info = engine->GetSession(session->id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens, static_cast<int64_t>(whole.size()) + kM);

  // A conversation that differs from token 25 on: the session keeps 25 cached tokens, drops
  // the rest (blocks included) and continues exactly as a fresh run would.
  std::vector<int32_t> rewritten(whole.begin(), whole.begin() + 25);
  for (int i = 0; i < 12; ++i) rewritten.push_back(testing::kTinyFirstByte + 50 + i);
  GenerateRequest rewrite = Greedy(rewritten, kM, session->id);
  rewrite.prompt_replaces_history = true;
  Output third = Generate(*engine, rewrite);
  EXPECT_EQ(third.result.usage.reused_tokens, 25);
  EXPECT_EQ(third.tokens, Generate(*engine, Greedy(rewritten, kM)).tokens);
  info = engine->GetSession(session->id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens, static_cast<int64_t>(rewritten.size()) + kM);
  EXPECT_EQ(info->cached_tokens, info->tokens - 1);

  // The same conversation once more: everything but the last token is reused.
  std::vector<int32_t> same = Concat(rewritten, third.tokens);
  GenerateRequest again = Greedy(same, 3, session->id);
  again.prompt_replaces_history = true;
  Output fourth = Generate(*engine, again);
  EXPECT_EQ(fourth.result.usage.reused_tokens, static_cast<int64_t>(same.size()) - 1);
  EXPECT_EQ(fourth.tokens, Generate(*engine, Greedy(same, 3)).tokens);
}

TEST(EngineTest, SessionEvictedFromThePoolIsRecomputed) {
  // 36 blocks = 18 per layer = 144 tokens; the big request grows to 16 per layer, so the idle
  // session's 4 per layer must go.
  auto engine = MakeEngine({}, /*blocks=*/36);
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<SessionInfo> session = engine->CreateSession();
  ASSERT_TRUE(session.ok());
  const std::vector<int32_t> a = RandomPrompt(5, 20, Vocab(*engine));
  const std::vector<int32_t> b = RandomPrompt(6, 5, Vocab(*engine));
  Output first = Generate(*engine, Greedy(a, 10, session->id));
  EXPECT_GT(engine->GetSession(session->id)->cached_tokens, 0);

  Output big = Generate(*engine, Greedy(RandomPrompt(7, 100, Vocab(*engine)), 27));
  EXPECT_EQ(big.result.finish, FinishReason::kLength);
  EXPECT_EQ(engine->Stats().preemptions_total, 0);  // idle caches go before running requests
  absl::StatusOr<SessionInfo> info = engine->GetSession(session->id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->cached_tokens, 0);
  EXPECT_EQ(info->tokens, 30);

  Output second = Generate(*engine, Greedy(b, 8, session->id));
  EXPECT_EQ(second.result.usage.reused_tokens, 0);
  Output one_shot = Generate(*engine, Greedy(Concat(Concat(a, first.tokens), b), 8));
  EXPECT_EQ(second.tokens, one_shot.tokens);
}

// A client-proposed id (so a proxy can route on it before the session exists) is the session's
// id; a live one cannot be taken twice, an expired or deleted one can. Its form is the server's
// concern (request_validation), not the engine's.
TEST(EngineTest, ProposedSessionId) {
  auto engine = MakeEngine(EngineConfig());
  ASSERT_NE(engine, nullptr);
  const std::string id = "0123456789abcdef0123456789abcdef";
  absl::StatusOr<SessionInfo> session = engine->CreateSession(absl::Seconds(30), id);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(session->id, id);
  EXPECT_EQ(session->idle_ttl, absl::Seconds(30));
  EXPECT_TRUE(engine->GetSession(id).ok());

  absl::StatusOr<SessionInfo> again = engine->CreateSession(absl::ZeroDuration(), id);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(engine->ListSessions().size(), 1u);

  // The session works like a server-made one.
  Generate(*engine, Greedy({1, 5, 6}, 2, id));
  EXPECT_EQ(engine->GetSession(id)->tokens, 5);

  ASSERT_TRUE(engine->DeleteSession(id).ok());
  EXPECT_TRUE(engine->CreateSession(absl::ZeroDuration(), id).ok());

  // An expired session no longer holds its id.
  const std::string short_lived = "short-lived_session-0123456789ABCDEF";
  ASSERT_TRUE(engine->CreateSession(absl::Milliseconds(1), short_lived).ok());
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(engine->CreateSession(absl::ZeroDuration(), short_lived).ok());

  // Without a proposal the engine still makes 32 hex digits.
  absl::StatusOr<SessionInfo> made = engine->CreateSession();
  ASSERT_TRUE(made.ok());
  EXPECT_EQ(made->id.size(), 32u);
}

// A session belongs to the owner that created it: to any other owner it does not exist (the
// same NOT_FOUND as an unknown id) and it is not listed. "" is the anonymous owner.
TEST(EngineTest, SessionsBelongToTheirOwner) {
  auto engine = MakeEngine(EngineConfig());
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<SessionInfo> mine = engine->CreateSession(absl::ZeroDuration(), {}, "alice");
  ASSERT_TRUE(mine.ok()) << mine.status();
  const std::string unknown = "0123456789abcdef0123456789abcdef";
  const absl::Status unknown_status = engine->GetSession(unknown, "alice").status();
  ASSERT_EQ(unknown_status.code(), absl::StatusCode::kNotFound);

  for (const std::string other : {"bob", ""}) {
    SCOPED_TRACE(other);
    const absl::Status got = engine->GetSession(mine->id, other).status();
    EXPECT_EQ(got.code(), absl::StatusCode::kNotFound);
    // Nothing in the message tells "someone else's" from "unknown".
    EXPECT_EQ(got.message(), absl::StrReplaceAll(unknown_status.message(), {{unknown, mine->id}}));
    EXPECT_EQ(engine->DeleteSession(mine->id, other).code(), absl::StatusCode::kNotFound);
    GenerateRequest request = Greedy({1, 5, 6}, 2, mine->id);
    request.session_owner = other;
    EXPECT_EQ(engine->Submit(request, std::make_shared<TestObserver>()).status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_TRUE(engine->ListSessions(other).empty());
  }

  // The owner still has it, untouched by the others' attempts.
  GenerateRequest request = Greedy({1, 5, 6}, 2, mine->id);
  request.session_owner = "alice";
  Generate(*engine, request);
  absl::StatusOr<SessionInfo> info = engine->GetSession(mine->id, "alice");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokens, 5);
  ASSERT_EQ(engine->ListSessions("alice").size(), 1u);
  EXPECT_EQ(engine->ListSessions("alice")[0].id, mine->id);
  EXPECT_TRUE(engine->DeleteSession(mine->id, "alice").ok());
}

TEST(EngineTest, SessionErrors) {
  EngineConfig config;
  config.max_sessions = 2;
  auto engine = MakeEngine(config);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(
      engine->Submit(Greedy({1, 5}, 2, "0123"), std::make_shared<TestObserver>()).status().code(),
      absl::StatusCode::kNotFound);
  EXPECT_EQ(engine->GetSession("0123").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine->DeleteSession("0123").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine->CreateSession(absl::Seconds(-1)).status().code(),
            absl::StatusCode::kInvalidArgument);

  absl::StatusOr<SessionInfo> s1 = engine->CreateSession(absl::Seconds(30));
  absl::StatusOr<SessionInfo> s2 = engine->CreateSession();
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_NE(s1->id, s2->id);
  EXPECT_EQ(s1->idle_ttl, absl::Seconds(30));
  EXPECT_EQ(engine->CreateSession().status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(engine->DeleteSession(s2->id).ok());
  EXPECT_TRUE(engine->CreateSession().ok());

  // A second request on a busy session is refused while the first runs.
  Latch release;
  auto busy = std::make_shared<TestObserver>(
      [&](TestObserver&, const GeneratedTokenEvent&) { release.Wait(); });
  ASSERT_TRUE(engine->Submit(Greedy({1, 5, 6}, 3, s1->id), busy).ok());
  EXPECT_TRUE(engine->GetSession(s1->id)->busy);
  EXPECT_EQ(
      engine->Submit(Greedy({7}, 2, s1->id), std::make_shared<TestObserver>()).status().code(),
      absl::StatusCode::kFailedPrecondition);
  release.Notify();
  ASSERT_TRUE(busy->WaitDone());
  Output next = Generate(*engine, Greedy({7}, 2, s1->id));
  EXPECT_EQ(next.result.usage.reused_tokens, 5);
}

TEST(EngineTest, DeleteSessionCancelsItsRequest) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<SessionInfo> session = engine->CreateSession();
  ASSERT_TRUE(session.ok());
  Engine* e = engine.get();
  const std::string id = session->id;
  auto obs = std::make_shared<TestObserver>([&](TestObserver& o, const GeneratedTokenEvent&) {
    if (o.tokens().size() == 2) {
      EXPECT_TRUE(e->DeleteSession(id).ok());
    }
  });
  ASSERT_TRUE(engine->Submit(Greedy({1, 5, 6, 7}, 100, id), obs).ok());
  ASSERT_TRUE(obs->WaitDone());
  EXPECT_EQ(obs->result().finish, FinishReason::kCancelled);
  EXPECT_EQ(obs->result().usage.generated_tokens, 2);
  EXPECT_EQ(engine->GetSession(id).status().code(), absl::StatusCode::kNotFound);
  const EngineStats stats = engine->Stats();
  EXPECT_EQ(stats.cache.blocks_free, stats.cache.blocks_total);
  EXPECT_EQ(stats.sessions, 0);
}

TEST(EngineTest, IdleSessionsExpire) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<SessionInfo> session = engine->CreateSession(absl::Milliseconds(30));
  ASSERT_TRUE(session.ok());
  Output out = Generate(*engine, Greedy({1, 5, 6, 7}, 4, session->id));
  EXPECT_EQ(out.result.finish, FinishReason::kLength);
  bool gone = false;
  for (absl::Time end = absl::Now() + kWait; absl::Now() < end && !gone;) {
    const EngineStats s = engine->Stats();
    gone = s.sessions == 0 && s.cache.blocks_free == s.cache.blocks_total;
    if (!gone) absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(gone);
  EXPECT_EQ(engine->GetSession(session->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(engine->ListSessions().empty());
}

TEST(EngineTest, DrainFinishesWorkAndRefusesMore) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  std::vector<std::shared_ptr<TestObserver>> observers;
  for (int i = 0; i < 3; ++i) {
    observers.push_back(std::make_shared<TestObserver>());
    ASSERT_TRUE(
        engine->Submit(Greedy(RandomPrompt(i, 6, Vocab(*engine)), 12), observers.back()).ok());
  }
  EXPECT_FALSE(engine->draining());
  EXPECT_TRUE(engine->Drain(kWait));
  EXPECT_TRUE(engine->draining());
  for (auto& o : observers) {
    EXPECT_EQ(o->finishes(), 1);  // delivered before Drain returned
    EXPECT_EQ(o->result().finish, FinishReason::kLength);
  }
  EXPECT_EQ(engine->Submit(Greedy({1, 5}, 2), std::make_shared<TestObserver>()).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(engine->CreateSession().status().code(), absl::StatusCode::kUnavailable);
}

TEST(EngineTest, DestructorFinishesEveryRequestOnce) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  std::vector<std::shared_ptr<TestObserver>> observers;
  for (int i = 0; i < 4; ++i) {
    observers.push_back(std::make_shared<TestObserver>());
    ASSERT_TRUE(
        engine->Submit(Greedy(RandomPrompt(i, 6, Vocab(*engine)), 100), observers.back()).ok());
  }
  engine.reset();
  for (auto& o : observers) {
    EXPECT_EQ(o->finishes(), 1);
    const FinishReason f = o->result().finish;
    EXPECT_TRUE(f == FinishReason::kCancelled || f == FinishReason::kLength) << FinishReasonName(f);
  }
}

TEST(EngineTest, StopSequences) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  const std::vector<int32_t> prompt = engine->tokenizer().Encode("the world is");
  Output full = Generate(*engine, Greedy(prompt, 40));
  ASSERT_GE(full.text.size(), 8u) << "the tiny model produced too little text";
  const std::string stop = full.text.substr(full.text.size() / 2, 3);
  const size_t at = full.text.find(stop);

  GenerateRequest r = Greedy(prompt, 40);
  r.stop = {"\x01never", stop};
  Output out = Generate(*engine, r);
  EXPECT_EQ(out.result.finish, FinishReason::kStop);
  EXPECT_EQ(out.text, full.text.substr(0, at));
  ASSERT_LE(out.tokens.size(), full.tokens.size());
  EXPECT_TRUE(std::equal(out.tokens.begin(), out.tokens.end(), full.tokens.begin()));
  EXPECT_EQ(out.result.usage.generated_tokens, static_cast<int64_t>(out.tokens.size()));
}

TEST(EngineTest, EndOfSequence) {
  const std::vector<int32_t> prompt = {testing::kTinyBos, 30, 31, 32};
  auto reference = MakeEngine();
  ASSERT_NE(reference, nullptr);
  Output full = Generate(*reference, Greedy(prompt, 16));
  // Make the model's fourth new token (if new to the output) the end of sequence: same weights,
  // a tokenizer whose eos_token_id is that token.
  size_t k = 3;
  while (k < full.tokens.size() && std::find(full.tokens.begin(), full.tokens.begin() + k,
                                             full.tokens[k]) != full.tokens.begin() + k) {
    ++k;
  }
  ASSERT_LT(k, full.tokens.size()) << "no fresh token to use as EOS";
  TinyModelOptions options;
  options.eos_id = full.tokens[k];
  auto engine = MakeEngine({}, 512, options);
  ASSERT_NE(engine, nullptr);
  ASSERT_EQ(engine->tokenizer().eos_id(), full.tokens[k]);

  absl::StatusOr<SessionInfo> session = engine->CreateSession();
  ASSERT_TRUE(session.ok());
  GenerateRequest r = Greedy(prompt, 16, session->id);
  r.ignore_eos = false;
  Output out = Generate(*engine, r);
  EXPECT_EQ(out.result.finish, FinishReason::kEos);
  // EOS is reported as the last token and stays in the session's history.
  EXPECT_EQ(out.tokens, std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + k + 1));
  EXPECT_EQ(engine->GetSession(session->id)->tokens, static_cast<int64_t>(prompt.size() + k + 1));

  Output ignoring = Generate(*engine, Greedy(prompt, 16));
  EXPECT_EQ(ignoring.result.finish, FinishReason::kLength);
  EXPECT_EQ(ignoring.tokens, full.tokens);
}

TEST(EngineTest, SeededSamplingIsReproducible) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  const auto sampled = [&](uint64_t seed) {
    GenerateRequest r = Greedy(RandomPrompt(9, 5, Vocab(*engine)), 24);
    r.sampling.temperature = 1.0f;
    r.sampling.top_p = 0.95f;
    r.sampling.seed = seed;
    r.sampling.logprobs = 2;
    return r;
  };
  Output a = Generate(*engine, sampled(7));
  Output b = Generate(*engine, sampled(7));
  EXPECT_EQ(a.tokens, b.tokens);
  Output c = Generate(*engine, sampled(8));
  EXPECT_NE(a.tokens, c.tokens);

  // Batched with other requests, the same seed still gives the same tokens.
  Gate gate(*engine);
  auto with_seed = std::make_shared<TestObserver>();
  auto other = std::make_shared<TestObserver>();
  ASSERT_TRUE(engine->Submit(sampled(8), other).ok());
  ASSERT_TRUE(engine->Submit(sampled(7), with_seed).ok());
  gate.Release();
  ASSERT_TRUE(with_seed->WaitDone());
  ASSERT_TRUE(other->WaitDone());
  EXPECT_EQ(with_seed->tokens(), a.tokens);
  EXPECT_EQ(other->tokens(), c.tokens);
}

TEST(EngineTest, RejectsBadConfig) {
  absl::StatusOr<TinyModel> tm = LoadTinyModel();
  ASSERT_TRUE(tm.ok());
  const auto create = [&](EngineConfig config) {
    return Engine::Create(std::move(config), tm->model, tm->tokenizer,
                          *MakeTinyCache(tm->model->config(), kBlockSize, 64))
        .status();
  };
  EngineConfig c;
  c.max_running = 0;
  EXPECT_EQ(create(c).code(), absl::StatusCode::kInvalidArgument);
  c = {};
  c.max_batch_tokens = 4;
  c.max_running = 8;
  EXPECT_EQ(create(c).code(), absl::StatusCode::kInvalidArgument);
  c = {};
  c.default_session_ttl = absl::ZeroDuration();
  EXPECT_EQ(create(c).code(), absl::StatusCode::kInvalidArgument);
  // A cache whose geometry is not the model's.
  PagedKvCache::Config pc;
  pc.geometry = {1, 1, 4};
  pc.capacity_bytes = 1 << 20;
  EXPECT_EQ(Engine::Create({}, tm->model, tm->tokenizer, *PagedKvCache::Create(pc)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace subspace
