// The engine's prompt cache (EngineConfig::prompt_cache_entries): a stateless request that
// starts as a finished one did takes its cache over and prefills only the rest, with the tokens
// a fresh engine gives; short prefixes, other owners, the entry limit and a short pool.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "gtest/gtest.h"
#include "tests/core/engine/engine_test_util.h"

namespace subspace {
namespace {

using namespace ::subspace::engine_test;  // NOLINT: the shared helpers

EngineConfig WithPromptCache(int entries) {
  EngineConfig config;
  config.prompt_cache_entries = entries;
  return config;
}

TEST(EnginePromptCacheTest, ResentConversationPrefillsOnlyItsNewTokens) {
  auto engine = MakeEngine(WithPromptCache(2));
  auto fresh = MakeEngine();
  ASSERT_NE(engine, nullptr);
  ASSERT_NE(fresh, nullptr);
  const std::vector<int32_t> a = RandomPrompt(1, 40, Vocab(*engine));
  constexpr int kN = 6, kM = 8;
  const Output first = Generate(*engine, Greedy(a, kN));
  EXPECT_EQ(first.result.usage.reused_tokens, 0);
  ASSERT_EQ(first.tokens.size(), static_cast<size_t>(kN));
  EXPECT_EQ(engine->Stats().prompt_cache_entries, 1);

  // The client sends the whole conversation again with a new turn.
  std::vector<int32_t> turn = RandomPrompt(2, 7, Vocab(*engine));
  turn.erase(turn.begin());  // no BOS mid-conversation
  const std::vector<int32_t> b = Concat(Concat(a, first.tokens), turn);
  const Output second = Generate(*engine, Greedy(b, kM));
  EXPECT_EQ(second.result.usage.prompt_tokens, static_cast<int64_t>(b.size()));
  // Everything but the last generated token, whose K/V was never written.
  EXPECT_EQ(second.result.usage.reused_tokens, static_cast<int64_t>(a.size()) + kN - 1);
  EXPECT_EQ(engine->Stats().prompt_cache_hits_total, 1);
  EXPECT_EQ(second.tokens, Generate(*fresh, Greedy(b, kM)).tokens);

  // A prompt that diverges inside the kept history keeps the shared part only.
  std::vector<int32_t> c(b.begin(), b.begin() + 30);
  c.push_back(b[30] == testing::kTinyFirstByte ? testing::kTinyFirstByte + 1
                                               : testing::kTinyFirstByte);
  const Output third = Generate(*engine, Greedy(c, kM));
  EXPECT_EQ(third.result.usage.reused_tokens, 30);
  EXPECT_EQ(third.tokens, Generate(*fresh, Greedy(c, kM)).tokens);
}

TEST(EnginePromptCacheTest, ShortPrefixesAndOtherOwnersStartFresh) {
  auto engine = MakeEngine(WithPromptCache(4));
  ASSERT_NE(engine, nullptr);
  const std::vector<int32_t> a = RandomPrompt(3, 40, Vocab(*engine));
  Generate(*engine, Greedy(a, 4));
  // Fewer than kMinPromptCacheReuse tokens in common: not worth taking a cache over.
  std::vector<int32_t> short_prefix(a.begin(), a.begin() + kMinPromptCacheReuse - 1);
  const std::vector<int32_t> rest = RandomPrompt(4, 20, Vocab(*engine));
  short_prefix.insert(short_prefix.end(), rest.begin() + 1, rest.end());
  EXPECT_EQ(Generate(*engine, Greedy(short_prefix, 4)).result.usage.reused_tokens, 0);
  // Another principal never reads this one's cache.
  GenerateRequest other = Greedy(a, 4);
  other.session_owner = "someone else";
  EXPECT_EQ(Generate(*engine, other).result.usage.reused_tokens, 0);
  // A request refused at the door (no room left in the context) leaves the kept caches as
  // they were.
  const int entries = engine->Stats().prompt_cache_entries;
  std::vector<int32_t> too_long = a;
  too_long.resize(engine->model_config().context_length, a.back());
  auto obs = std::make_shared<TestObserver>();
  EXPECT_EQ(engine->Submit(Greedy(too_long, 4), obs).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->Stats().prompt_cache_entries, entries);
  // Its own owner does.
  EXPECT_EQ(Generate(*engine, Greedy(a, 4)).result.usage.reused_tokens,
            static_cast<int64_t>(a.size()) - 1);
}

TEST(EnginePromptCacheTest, KeepsAtMostItsEntriesAndGivesWayToAShortPool) {
  // 32 blocks of 8 tokens over the tiny model's 2 layers (its context of 128); each request
  // holds 12 when it finishes.
  auto engine = MakeEngine(WithPromptCache(2), /*blocks=*/32);
  ASSERT_NE(engine, nullptr);
  for (uint32_t seed = 10; seed < 14; ++seed) {
    const Output out = Generate(*engine, Greedy(RandomPrompt(seed, 40, Vocab(*engine)), 6));
    EXPECT_TRUE(out.result.status.ok()) << out.result.status;
    EXPECT_LE(engine->Stats().prompt_cache_entries, 2);
  }
  EXPECT_EQ(engine->Stats().prompt_cache_entries, 2);
  // A request that needs the whole pool gets it: the kept caches give their blocks back.
  const Output big = Generate(*engine, Greedy(RandomPrompt(20, 90, Vocab(*engine)), 30));
  EXPECT_TRUE(big.result.status.ok()) << big.result.status;
  EXPECT_EQ(big.tokens.size(), 30u);
  EXPECT_EQ(engine->Stats().prompt_cache_entries, 1);  // its own; the two before gave way

  // Without a prompt cache every block is free once the requests are done (the loop's
  // snapshot of the cache's counters lags its last step).
  auto plain = MakeEngine({}, /*blocks=*/32);
  ASSERT_NE(plain, nullptr);
  Generate(*plain, Greedy(RandomPrompt(30, 40, Vocab(*plain)), 6));
  EXPECT_EQ(plain->Stats().prompt_cache_entries, 0);
  EngineStats s;
  for (absl::Time end = absl::Now() + kWait; absl::Now() < end;
       absl::SleepFor(absl::Milliseconds(2))) {
    s = plain->Stats();
    if (s.cache.blocks_free == s.cache.blocks_total) break;
  }
  EXPECT_EQ(s.cache.blocks_free, s.cache.blocks_total);
}

}  // namespace
}  // namespace subspace
