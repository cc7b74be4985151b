// The engine's sessions: continuation over several calls equal to one call, prefill-only warming,
// a replaced
// history keeping its shared prefix, eviction and recomputation, ids, owners, errors, deletion
// and expiry.
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "gtest/gtest.h"
#include "tests/core/engine/engine_test_util.h"

namespace subspace {
namespace {

using namespace ::subspace::engine_test;  // NOLINT: the shared helpers

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

// max_new_tokens 0 on a session only prefills: nothing is generated, the whole prompt is cached,
// and the next call prefills only its own tokens and continues as the one-shot conversation.
TEST(EngineTest, PrefillOnlyWarmsTheSession) {
  auto engine = MakeEngine();
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<SessionInfo> session = engine->CreateSession();
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<int32_t> a = engine->tokenizer().Encode("hello world and the rest of it");
  const std::vector<int32_t> b = engine->tokenizer().Encode(" then", {.add_bos = false});
  constexpr int kM = 8;

  Output warm = Generate(*engine, Greedy(a, 0, session->id));
  ASSERT_TRUE(warm.result.status.ok()) << warm.result.status;
  EXPECT_EQ(warm.result.finish, FinishReason::kLength);
  EXPECT_TRUE(warm.tokens.empty());
  EXPECT_EQ(warm.result.usage.generated_tokens, 0);
  EXPECT_EQ(warm.result.usage.prompt_tokens, static_cast<int64_t>(a.size()));
  absl::StatusOr<SessionInfo> info = engine->GetSession(session->id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens, static_cast<int64_t>(a.size()));
  EXPECT_EQ(info->cached_tokens, info->tokens);  // the prompt's last token too

  Output next = Generate(*engine, Greedy(b, kM, session->id));
  EXPECT_EQ(next.result.usage.reused_tokens, static_cast<int64_t>(a.size()));
  Output one_shot = Generate(*engine, Greedy(Concat(a, b), kM));
  EXPECT_EQ(next.tokens, one_shot.tokens);

  // Without a session there is nothing to warm.
  GenerateRequest alone = Greedy(a, 0);
  EXPECT_EQ(engine->Submit(alone, std::make_shared<TestObserver>()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

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
  EXPECT_EQ(engine->ListSessions("alice")[0].owner, "alice");

  // What an operator sees (server/session_access.h): every owner's sessions, and whose each is.
  absl::StatusOr<SessionInfo> bobs = engine->CreateSession(absl::ZeroDuration(), {}, "bob");
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  const std::vector<SessionInfo> every = engine->ListEverySession();
  ASSERT_EQ(every.size(), 2u);
  EXPECT_LT(every[0].id, every[1].id);  // by id
  for (const SessionInfo& s : every) {
    EXPECT_EQ(s.owner, s.id == mine->id ? "alice" : "bob") << s.id;
    EXPECT_EQ(engine->SessionOwner(s.id).value_or("?"), s.owner);
  }
  EXPECT_EQ(engine->SessionOwner(unknown).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(engine->DeleteSession(mine->id, "alice").ok());
  EXPECT_EQ(engine->SessionOwner(mine->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(engine->DeleteSession(bobs->id, "bob").ok());
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

}  // namespace
}  // namespace subspace
