// The engine with session tiers: an idle session's cache given up for room goes to the host
// tier or the disk tier and comes back before the session's next call, which then prefills only
// its new tokens and continues exactly as the uninterrupted conversation; a cache no tier could
// keep is recomputed (never anything wrong); deletion erases the image, an export carries it,
// and an import into a full pool waits in a tier.
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/engine/engine.h"
#include "gtest/gtest.h"
#include "tests/core/engine/engine_test_util.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using namespace ::subspace::engine_test;  // NOLINT: the shared helpers
using ::subspace::testing::FilesIn;
using ::subspace::testing::TempDir;

// 36 blocks = 18 per layer = 144 tokens: the big request grows to 16 per layer, so an idle
// session of 30 tokens (4 per layer) must leave the pool.
constexpr int64_t kBlocks = 36;

EngineConfig WithTiers(int64_t host_bytes, std::string disk_dir = "", int64_t disk_bytes = 0) {
  EngineConfig c;
  c.session_tiers.host_bytes = host_bytes;
  c.session_tiers.disk_dir = std::move(disk_dir);
  c.session_tiers.disk_bytes = disk_bytes;
  return c;
}

// Polls until the session's cache is at `where` (a disk tier writes in the background).
bool WaitForLocation(Engine& engine, const std::string& id, CacheLocation where) {
  for (absl::Time end = absl::Now() + kWait; absl::Now() < end;) {
    absl::StatusOr<SessionInfo> info = engine.GetSession(id);
    if (info.ok() && info->cache_location == where) return true;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return false;
}

struct Conversation {
  std::string session;
  std::vector<int32_t> a, b;
  Output first;
};

// A session's first call, then a big one-shot request that needs the session's pool blocks.
Conversation FirstCallThenPressure(Engine& engine) {
  Conversation c;
  absl::StatusOr<SessionInfo> session = engine.CreateSession();
  EXPECT_TRUE(session.ok()) << session.status();
  c.session = session->id;
  c.a = RandomPrompt(5, 20, Vocab(engine));
  c.b = RandomPrompt(6, 5, Vocab(engine));
  c.first = Generate(engine, Greedy(c.a, 10, c.session));
  EXPECT_EQ(engine.GetSession(c.session)->cache_location, CacheLocation::kPool);
  Output big = Generate(engine, Greedy(RandomPrompt(7, 100, Vocab(engine)), 27));
  EXPECT_EQ(big.result.finish, FinishReason::kLength);
  EXPECT_EQ(engine.Stats().preemptions_total, 0);
  return c;
}

// The session's second call against the same conversation in one call.
void ExpectSecondCallContinues(Engine& engine, const Conversation& c, int64_t reused) {
  Output second = Generate(engine, Greedy(c.b, 8, c.session));
  EXPECT_EQ(second.result.usage.reused_tokens, reused);
  Output one_shot = Generate(engine, Greedy(Concat(Concat(c.a, c.first.tokens), c.b), 8));
  EXPECT_EQ(second.tokens, one_shot.tokens);
}

TEST(EngineTierTest, CacheGivenUpForRoomComesBackFromTheHostTier) {
  auto engine = MakeEngine(WithTiers(/*host_bytes=*/1 << 20), kBlocks);
  ASSERT_NE(engine, nullptr);
  const Conversation c = FirstCallThenPressure(*engine);
  absl::StatusOr<SessionInfo> info = engine->GetSession(c.session);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->cache_location, CacheLocation::kHost);
  EXPECT_EQ(info->cached_tokens, 29);
  EXPECT_EQ(info->tokens, 30);
  EngineStats stats = engine->Stats();
  EXPECT_EQ(stats.tiers.host_sessions, 1);
  EXPECT_GT(stats.tiers.host_bytes, 0);
  EXPECT_EQ(stats.tiers.stored_total, 1);
  EXPECT_EQ(stats.tiers.host_tokens, 29);

  ExpectSecondCallContinues(*engine, c, /*reused=*/29);
  stats = engine->Stats();
  EXPECT_EQ(stats.tiers.restored_host_total, 1);
  EXPECT_EQ(stats.tiers.host_sessions, 0);
  EXPECT_EQ(stats.tiers.host_tokens, 0);
  int64_t restores = 0;
  for (int64_t c : stats.tiers.restore_host.counts) restores += c;
  EXPECT_EQ(restores, 1);
  EXPECT_GT(stats.tiers.restore_host.sum_seconds, 0.0);
  EXPECT_EQ(stats.tier_restores_failed_total, 0);
  EXPECT_EQ(engine->GetSession(c.session)->cache_location, CacheLocation::kPool);
}

TEST(EngineTierTest, CacheGivenUpForRoomComesBackFromTheDiskTier) {
  TempDir tmp("engine_tiers");
  const std::string dir = tmp.path() + "/tier";
  {
    // No host tier: the image goes straight to disk.
    auto engine = MakeEngine(WithTiers(0, dir, 1 << 20), kBlocks);
    ASSERT_NE(engine, nullptr);
    const Conversation c = FirstCallThenPressure(*engine);
    ASSERT_TRUE(WaitForLocation(*engine, c.session, CacheLocation::kDisk));
    EXPECT_EQ(FilesIn(dir), std::vector<std::string>{c.session + ".session"});
    EXPECT_EQ(engine->GetSession(c.session)->cached_tokens, 29);

    ExpectSecondCallContinues(*engine, c, /*reused=*/29);
    EXPECT_EQ(engine->Stats().tiers.restored_disk_total, 1);
    EXPECT_TRUE(FilesIn(dir).empty());

    // Given up again, then deleted: its file goes too.
    Output big = Generate(*engine, Greedy(RandomPrompt(8, 100, Vocab(*engine)), 27));
    ASSERT_TRUE(WaitForLocation(*engine, c.session, CacheLocation::kDisk));
    ASSERT_TRUE(engine->DeleteSession(c.session).ok());
    for (absl::Time end = absl::Now() + kWait; absl::Now() < end && !FilesIn(dir).empty();) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    EXPECT_TRUE(FilesIn(dir).empty());
    EXPECT_EQ(engine->Stats().tiers.disk_sessions, 0);
  }
  EXPECT_TRUE(FilesIn(tmp.path()).empty());
}

TEST(EngineTierTest, CacheNoTierCanKeepIsRecomputed) {
  // A host tier too small for the image: it is dropped, as without tiers.
  auto engine = MakeEngine(WithTiers(/*host_bytes=*/1024), kBlocks);
  ASSERT_NE(engine, nullptr);
  const Conversation c = FirstCallThenPressure(*engine);
  absl::StatusOr<SessionInfo> info = engine->GetSession(c.session);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->cache_location, CacheLocation::kNone);
  EXPECT_EQ(info->cached_tokens, 0);
  ExpectSecondCallContinues(*engine, c, /*reused=*/0);
}

TEST(EngineTierTest, ImageDroppedFromItsTierIsRecomputed) {
  // The host tier holds one image: the second session's pushes the first one's out.
  auto engine = MakeEngine(WithTiers(/*host_bytes=*/12 << 10), kBlocks);
  ASSERT_NE(engine, nullptr);
  const Conversation c = FirstCallThenPressure(*engine);
  ASSERT_EQ(engine->GetSession(c.session)->cache_location, CacheLocation::kHost);
  absl::StatusOr<SessionInfo> other = engine->CreateSession();
  ASSERT_TRUE(other.ok());
  Generate(*engine, Greedy(RandomPrompt(9, 20, Vocab(*engine)), 10, other->id));
  Generate(*engine, Greedy(RandomPrompt(10, 100, Vocab(*engine)), 27));
  EXPECT_EQ(engine->GetSession(other->id)->cache_location, CacheLocation::kHost);
  absl::StatusOr<SessionInfo> info = engine->GetSession(c.session);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->cache_location, CacheLocation::kNone);
  EXPECT_EQ(info->cached_tokens, 0);
  EXPECT_EQ(engine->Stats().tiers.dropped_total, 1);

  ExpectSecondCallContinues(*engine, c, /*reused=*/0);
  EXPECT_EQ(engine->Stats().tier_restores_failed_total, 1);
}

TEST(EngineTierTest, ExportCarriesATieredCacheAndImportIntoAFullPoolWaitsInATier) {
  auto engine = MakeEngine(WithTiers(1 << 20), kBlocks);
  ASSERT_NE(engine, nullptr);
  const Conversation c = FirstCallThenPressure(*engine);
  ASSERT_EQ(engine->GetSession(c.session)->cache_location, CacheLocation::kHost);
  absl::StatusOr<Engine::ExportedSession> exported = engine->ExportSession(c.session);
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_TRUE(exported->cache.ok()) << exported->cache;
  EXPECT_EQ(exported->image.cached, 29);
  EXPECT_FALSE(exported->image.cache.empty());

  // Another engine whose pool an idle session fills: the import waits in its host tier, and the
  // session's next call brings it back (giving up the other session's blocks).
  auto other = MakeEngine(WithTiers(1 << 20), kBlocks);
  ASSERT_NE(other, nullptr);
  absl::StatusOr<SessionInfo> filler = other->CreateSession();
  ASSERT_TRUE(filler.ok());
  Output warm = Generate(*other, Greedy(RandomPrompt(11, 120, Vocab(*other)), 0, filler->id));
  EXPECT_EQ(warm.result.finish, FinishReason::kLength);
  absl::StatusOr<Engine::ImportedSession> imported = other->ImportSession(exported->image);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_TRUE(imported->cache.ok()) << imported->cache;
  EXPECT_EQ(imported->info.cache_location, CacheLocation::kHost);
  EXPECT_EQ(imported->info.cached_tokens, 29);

  ExpectSecondCallContinues(*other, c, /*reused=*/29);
  EXPECT_EQ(other->GetSession(filler->id)->cache_location, CacheLocation::kHost);
}

// The soak: ten times more sessions than the pool holds, every call over the pool and both
// tiers (some caches dropped when both are full), against an engine whose pool holds them all:
// every call succeeds with the same tokens, the tiers stay within their caps, and deleting the
// sessions leaves no block, image or file behind.
TEST(EngineTierTest, TenTimesMoreSessionsThanThePoolHolds) {
  TempDir tmp("engine_tiers");
  const std::string dir = tmp.path() + "/tier";
  constexpr int64_t kHostCap = 48 << 10, kDiskCap = 96 << 10;
  auto engine = MakeEngine(WithTiers(kHostCap, dir, kDiskCap), kBlocks);
  auto reference = MakeEngine({}, /*blocks=*/1024);
  ASSERT_NE(engine, nullptr);
  ASSERT_NE(reference, nullptr);
  constexpr int kSessions = 40;  // the pool holds about 4 of them
  std::vector<std::string> ids, ref_ids;
  for (int i = 0; i < kSessions; ++i) {
    absl::StatusOr<SessionInfo> a = engine->CreateSession();
    absl::StatusOr<SessionInfo> b = reference->CreateSession();
    ASSERT_TRUE(a.ok() && b.ok());
    ids.push_back(a->id);
    ref_ids.push_back(b->id);
  }
  int64_t reused_calls = 0;
  for (int round = 0; round < 3; ++round) {
    // Forward, then backward: a round starts with the sessions the last one used most recently
    // (in the pool or the host tier) and ends with those it used first (on disk, or dropped).
    for (int step = 0; step < kSessions; ++step) {
      const int i = round % 2 == 0 ? step : kSessions - 1 - step;
      const std::vector<int32_t> prompt =
          RandomPrompt(static_cast<uint32_t>(100 * round + i), round == 0 ? 20 : 5, Vocab(*engine));
      GenerateRequest got_request = Greedy(prompt, 6, ids[static_cast<size_t>(i)]);
      GenerateRequest want_request = Greedy(prompt, 6, ref_ids[static_cast<size_t>(i)]);
      if (round > 0) {
        // A continuation: no BOS in the middle of the conversation.
        got_request.prompt.erase(got_request.prompt.begin());
        want_request.prompt.erase(want_request.prompt.begin());
      }
      const Output got = Generate(*engine, std::move(got_request));
      const Output want = Generate(*reference, std::move(want_request));
      ASSERT_TRUE(got.result.status.ok()) << got.result.status;
      ASSERT_EQ(got.tokens, want.tokens) << "round " << round << " session " << i;
      reused_calls += got.result.usage.reused_tokens > 0 ? 1 : 0;
      // The disk writer catches up before the next call, as on an idle machine: what lands on
      // disk or is dropped then follows from the calls alone, not from this machine's load (a
      // loaded one restored every image from memory before its write began, and dropped none).
      for (absl::Time end = absl::Now() + kWait;
           absl::Now() < end && engine->Stats().tiers.host_spilling_bytes > 0;) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      const SessionTierStats st = engine->Stats().tiers;
      ASSERT_LE(st.host_bytes - st.host_spilling_bytes, kHostCap);
      ASSERT_LE(st.disk_bytes, kDiskCap);
    }
  }
  const EngineStats stats = engine->Stats();
  EXPECT_GT(stats.tiers.restored_host_total, 0);
  EXPECT_GT(stats.tiers.restored_disk_total, 0);
  EXPECT_GT(stats.tiers.dropped_total, 0);  // both tiers full: some caches were recomputed
  EXPECT_EQ(stats.tiers.errors_total, 0);
  EXPECT_GT(reused_calls, stats.tiers.restored_host_total);  // pool hits and restores
  EXPECT_EQ(stats.preemptions_total, 0);

  for (const std::string& id : ids) ASSERT_TRUE(engine->DeleteSession(id).ok());
  for (absl::Time end = absl::Now() + kWait; absl::Now() < end;) {
    const EngineStats s = engine->Stats();
    if (s.cache.blocks_free == s.cache.blocks_total && s.tiers.disk_sessions == 0 &&
        FilesIn(dir).empty()) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  const EngineStats end = engine->Stats();
  EXPECT_EQ(end.cache.blocks_free, end.cache.blocks_total);
  EXPECT_EQ(end.tiers.host_sessions, 0);
  EXPECT_EQ(end.tiers.host_bytes, 0);
  EXPECT_EQ(end.tiers.disk_sessions, 0);
  EXPECT_EQ(end.tiers.disk_bytes, 0);
  EXPECT_TRUE(FilesIn(dir).empty());
}

}  // namespace
}  // namespace subspace
