// Engine tests on a tiny random-weight model: greedy output against a direct model loop,
// batching and preemption that must not change results, cancellation, deadlines, drain, stop
// sequences, EOS and seeded sampling (sessions: engine_session_test.cc). Waits are on observer
// notifications with generous timeouts; nothing asserts on time.
#include "core/engine/engine.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/core/engine/engine_test_util.h"

namespace subspace {
namespace {

using namespace ::subspace::engine_test;  // NOLINT: the shared helpers

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

// A chat re-rendered whole on its session (prompt_replaces_history): the cached prefix it

// shares with the session's history is reused -- all of it when the new conversation extends

// the old, up to the first difference when it rewrites the past -- and the output equals a

// fresh run of the same conversation.

// A client-proposed id (so a proxy can route on it before the session exists) is the session's

// id; a live one cannot be taken twice, an expired or deleted one can. Its form is the server's

// concern (request_validation), not the engine's.

// A session belongs to the owner that created it: to any other owner it does not exist (the

// same NOT_FOUND as an unknown id) and it is not listed. "" is the anonymous owner.

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
