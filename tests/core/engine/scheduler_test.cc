// Scheduler planning on a real paged cache without a model: the token budget, max_running,
// chunked prefill, FCFS admission, the order in which blocks are taken back (idle sessions,
// waiting caches, then the newest running request) and recomputation after preemption.
#include "core/engine/scheduler.h"

#include <cstdint>
#include <memory>
#include <ostream>
#include <vector>

#include "absl/status/status.h"
#include "core/kvcache/paged_kv_cache.h"
#include "gtest/gtest.h"

namespace subspace {
namespace {

constexpr int kBlock = 4;  // tokens per block; one layer, so one block per 4 tokens

std::unique_ptr<PagedKvCache> MakeCache(int64_t blocks) {
  PagedKvCache::Config c;
  c.geometry = {1, 1, 4};
  c.block_size = kBlock;
  c.capacity_bytes = blocks * PagedKvCache::BlockBytes(c.geometry, kBlock);
  absl::StatusOr<std::unique_ptr<PagedKvCache>> cache = PagedKvCache::Create(c);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return *std::move(cache);
}

std::unique_ptr<Scheduler> MakeScheduler(KvCache* cache, int max_running, int max_batch_tokens,
                                         int max_queue = 16,
                                         Scheduler::ReclaimFn reclaim = nullptr) {
  absl::StatusOr<std::unique_ptr<Scheduler>> s =
      Scheduler::Create({max_running, max_batch_tokens, max_queue}, cache, std::move(reclaim));
  EXPECT_TRUE(s.ok()) << s.status();
  return *std::move(s);
}

// What the engine does after a step: the model commits the chunks, the scheduler learns it,
// and every sampling chunk yields a token.
void RunStep(KvCache& cache, Scheduler& s, const StepPlan& plan) {
  for (const ScheduledChunk& c : plan.chunks) {
    ASSERT_TRUE(cache.Commit(c.seq, c.pos + c.n).ok());
  }
  s.Commit(plan);
  for (const ScheduledChunk& c : plan.chunks) {
    if (c.samples) s.AppendToken(c.id);
  }
}

// A chunk as (id, pos, n, samples) for compact expectations.
struct C {
  uint64_t id;
  int64_t pos;
  int64_t n;
  bool samples;
  bool operator==(const C&) const = default;
};
std::vector<C> Chunks(const StepPlan& plan) {
  std::vector<C> out;
  for (const ScheduledChunk& c : plan.chunks) out.push_back({c.id, c.pos, c.n, c.samples});
  return out;
}
std::ostream& operator<<(std::ostream& os, const C& c) {
  return os << "{" << c.id << " @" << c.pos << " x" << c.n << (c.samples ? " S" : "") << "}";
}

TEST(SchedulerTest, RejectsBadConfig) {
  auto cache = MakeCache(8);
  EXPECT_EQ(Scheduler::Create({0, 8, 4}, cache.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Scheduler::Create({4, 2, 4}, cache.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Scheduler::Create({4, 8, 0}, cache.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Scheduler::Create({4, 8, 4}, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SchedulerTest, MaxSequenceTokensIsThePool) {
  auto cache = MakeCache(8);
  auto s = MakeScheduler(cache.get(), 4, 16);
  EXPECT_EQ(s->max_sequence_tokens(), 8 * kBlock);
  EXPECT_EQ(cache->Stats().sequences, 0);  // the probe sequence is gone
}

TEST(SchedulerTest, AddValidates) {
  auto cache = MakeCache(8);
  auto s = MakeScheduler(cache.get(), 4, 16, /*max_queue=*/2);
  EXPECT_EQ(s->Add(1, 0, 4, -1, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Add(1, 4, 3, -1, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Add(1, 4, 8, -1, 2).code(), absl::StatusCode::kInvalidArgument);
  // Larger than the whole pool: it could never run.
  EXPECT_EQ(s->Add(1, 4, 8 * kBlock + 1, -1, 0).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(s->Add(1, 4, 8 * kBlock, -1, 0).ok());
  EXPECT_EQ(s->Add(1, 4, 8, -1, 0).code(), absl::StatusCode::kInvalidArgument);  // duplicate
  ASSERT_TRUE(s->Add(2, 4, 8, -1, 0).ok());
  EXPECT_EQ(s->Add(3, 4, 8, -1, 0).code(), absl::StatusCode::kResourceExhausted);  // queue
  EXPECT_EQ(s->waiting(), 2);
}

TEST(SchedulerTest, ChunkedPrefillThenDecode) {
  auto cache = MakeCache(16);
  auto s = MakeScheduler(cache.get(), 4, 8);
  ASSERT_TRUE(s->Add(1, 20, 30, -1, 0).ok());
  StepPlan p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 0, 8, false}}));
  EXPECT_TRUE(p.chunks[0].admitted);
  EXPECT_EQ(p.prefill_tokens, 8);
  // The whole prompt was reserved at admission.
  EXPECT_EQ(cache->Stats().blocks_free, 16 - 5);
  RunStep(*cache, *s, p);
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 8, 8, false}}));
  EXPECT_FALSE(p.chunks[0].admitted);
  RunStep(*cache, *s, p);
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 16, 4, true}}));
  RunStep(*cache, *s, p);
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 20, 1, true}}));
  EXPECT_EQ(p.decode_tokens, 1);
  EXPECT_EQ(p.prefill_tokens, 0);
  EXPECT_EQ(cache->Stats().blocks_free, 16 - 6);  // token 21 opened a sixth block
}

TEST(SchedulerTest, DecodesFirstThenPrefillsUnderTheBudget) {
  auto cache = MakeCache(32);
  auto s = MakeScheduler(cache.get(), 4, 8);
  ASSERT_TRUE(s->Add(1, 3, 10, -1, 0).ok());
  RunStep(*cache, *s, s->Schedule());  // 1 is decoding now
  ASSERT_TRUE(s->Add(2, 20, 30, -1, 0).ok());
  ASSERT_TRUE(s->Add(3, 2, 10, -1, 0).ok());
  StepPlan p = s->Schedule();
  // 1's decode, then 2 takes the rest of the budget; 3 is admitted only when budget remains.
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 3, 1, true}, {2, 0, 7, false}}));
  RunStep(*cache, *s, p);
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 4, 1, true}, {2, 7, 7, false}}));
  RunStep(*cache, *s, p);
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 5, 1, true}, {2, 14, 6, true}, {3, 0, 1, false}}));
  EXPECT_EQ(s->running(), 3);
}

TEST(SchedulerTest, MaxRunning) {
  auto cache = MakeCache(32);
  auto s = MakeScheduler(cache.get(), 2, 64);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(s->Add(id, 4, 8, -1, 0).ok());
  StepPlan p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 0, 4, true}, {2, 0, 4, true}}));
  EXPECT_EQ(s->running(), 2);
  EXPECT_EQ(s->waiting(), 1);
  RunStep(*cache, *s, p);
  Scheduler::Removed r = s->Remove(1);
  EXPECT_GE(r.seq, 0);
  EXPECT_EQ(r.num_cached, 4);
  ASSERT_TRUE(cache->FreeSequence(r.seq).ok());
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{2, 4, 1, true}, {3, 0, 4, true}}));
}

TEST(SchedulerTest, AdmissionIsFirstComeFirstServed) {
  auto cache = MakeCache(8);
  auto s = MakeScheduler(cache.get(), 4, 64);
  ASSERT_TRUE(s->Add(1, 20, 24, -1, 0).ok());  // 5 blocks
  RunStep(*cache, *s, s->Schedule());
  ASSERT_TRUE(s->Add(2, 16, 16, -1, 0).ok());  // 4 blocks: does not fit the 3 left
  ASSERT_TRUE(s->Add(3, 4, 4, -1, 0).ok());    // 1 block: fits, but must not jump the queue
  StepPlan p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 20, 1, true}}));
  EXPECT_EQ(s->waiting(), 2);
  RunStep(*cache, *s, p);
  ASSERT_TRUE(cache->FreeSequence(s->Remove(1).seq).ok());
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{2, 0, 16, true}, {3, 0, 4, true}}));
}

TEST(SchedulerTest, PreemptsTheNewestAndRecomputesIt) {
  auto cache = MakeCache(4);
  auto s = MakeScheduler(cache.get(), 4, 64);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(s->Add(id, 4, 8, -1, 0).ok());
  RunStep(*cache, *s, s->Schedule());  // each holds one full block; one block free
  StepPlan p = s->Schedule();
  // 1 takes the free block; 2 needs one, so 3 (admitted last) loses its cache.
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 4, 1, true}, {2, 4, 1, true}}));
  EXPECT_EQ(p.preempted, (std::vector<uint64_t>{3}));
  EXPECT_EQ(s->preemptions(3), 1);
  EXPECT_EQ(s->preemptions_total(), 1);
  EXPECT_EQ(s->running(), 2);
  EXPECT_EQ(s->waiting(), 1);
  RunStep(*cache, *s, p);
  p = s->Schedule();  // no room for 3 yet
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 5, 1, true}, {2, 5, 1, true}}));
  RunStep(*cache, *s, p);
  ASSERT_TRUE(cache->FreeSequence(s->Remove(1).seq).ok());
  // 3 comes back with its prompt and its sampled token recomputed in one chunk.
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{2, 6, 1, true}, {3, 0, 5, true}}));
  EXPECT_TRUE(p.chunks[1].admitted);
}

TEST(SchedulerTest, PreemptedRequestsKeepTheirOrderAtTheFront) {
  auto cache = MakeCache(4);
  auto s = MakeScheduler(cache.get(), 4, 64);
  ASSERT_TRUE(s->Add(1, 7, 15, -1, 0).ok());  // 2 blocks
  ASSERT_TRUE(s->Add(2, 4, 8, -1, 0).ok());   // 1 block
  ASSERT_TRUE(s->Add(3, 4, 8, -1, 0).ok());   // 1 block
  RunStep(*cache, *s, s->Schedule());         // pool full
  StepPlan p = s->Schedule();                 // 2 needs a block: 3 goes
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 7, 1, true}, {2, 4, 1, true}}));
  EXPECT_EQ(p.preempted, (std::vector<uint64_t>{3}));
  RunStep(*cache, *s, p);
  ASSERT_TRUE(s->Add(4, 1, 1, -1, 0).ok());
  p = s->Schedule();  // 1 needs a third block: 2 goes, in front of 3 and 4
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 8, 1, true}}));
  EXPECT_EQ(p.preempted, (std::vector<uint64_t>{2}));
  EXPECT_EQ(s->preemptions_total(), 2);
  RunStep(*cache, *s, p);
  ASSERT_TRUE(cache->FreeSequence(s->Remove(1).seq).ok());
  // 2 (6 tokens: prompt + two sampled) and 3 (5) fill the pool; 4 waits its turn.
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{2, 0, 6, true}, {3, 0, 5, true}}));
  EXPECT_EQ(s->waiting(), 1);
}

TEST(SchedulerTest, NewestPreemptsItself) {
  auto cache = MakeCache(3);
  auto s = MakeScheduler(cache.get(), 4, 64);
  ASSERT_TRUE(s->Add(1, 4, 12, -1, 0).ok());
  ASSERT_TRUE(s->Add(2, 8, 12, -1, 0).ok());
  RunStep(*cache, *s, s->Schedule());  // 1: one block, 2: two blocks; pool full
  StepPlan p = s->Schedule();
  // 1 (the oldest) needs a block: 2 is preempted; 2 never gets to schedule.
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 4, 1, true}}));
  EXPECT_EQ(p.preempted, (std::vector<uint64_t>{2}));

  // Now the newest running request is the one that needs a block.
  auto cache2 = MakeCache(3);
  auto s2 = MakeScheduler(cache2.get(), 4, 64);
  ASSERT_TRUE(s2->Add(1, 7, 12, -1, 0).ok());  // 2 blocks, room for one more token
  ASSERT_TRUE(s2->Add(2, 4, 12, -1, 0).ok());  // 1 block, full
  RunStep(*cache2, *s2, s2->Schedule());
  p = s2->Schedule();  // 1 decodes into its own block; 2 needs a block and is the newest
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 7, 1, true}}));
  EXPECT_EQ(p.preempted, (std::vector<uint64_t>{2}));
  EXPECT_EQ(s2->running(), 1);
}

TEST(SchedulerTest, ReclaimsIdleCachesBeforePreempting) {
  auto cache = MakeCache(4);
  // An idle "session" holding two blocks, outside the scheduler.
  absl::StatusOr<SeqId> idle = cache->CreateSequence();
  ASSERT_TRUE(idle.ok());
  ASSERT_TRUE(cache->Reserve(*idle, 8).ok());
  ASSERT_TRUE(cache->Commit(*idle, 8).ok());
  int reclaimed = 0;
  auto s = MakeScheduler(cache.get(), 4, 64, 16, [&]() {
    if (*idle < 0) return false;
    EXPECT_TRUE(cache->FreeSequence(*idle).ok());
    *idle = -1;
    ++reclaimed;
    return true;
  });
  ASSERT_TRUE(s->Add(1, 4, 12, -1, 0).ok());
  ASSERT_TRUE(s->Add(2, 4, 12, -1, 0).ok());
  RunStep(*cache, *s, s->Schedule());  // pool full
  StepPlan p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 4, 1, true}, {2, 4, 1, true}}));
  EXPECT_EQ(reclaimed, 1);
  EXPECT_TRUE(p.preempted.empty());
  // Nothing idle is left: the next shortage preempts.
  RunStep(*cache, *s, p);
  for (int i = 0; i < 3; ++i) RunStep(*cache, *s, s->Schedule());  // both at 8 tokens
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 8, 1, true}}));
  EXPECT_EQ(p.preempted, (std::vector<uint64_t>{2}));
}

TEST(SchedulerTest, WaitingCachesGoBeforeRunningRequests) {
  auto cache = MakeCache(3);
  auto s = MakeScheduler(cache.get(), /*max_running=*/1, 64);
  ASSERT_TRUE(s->Add(1, 8, 12, -1, 0).ok());
  RunStep(*cache, *s, s->Schedule());  // 1: two blocks
  // A session request with one cached block waits behind max_running.
  absl::StatusOr<SeqId> kept = cache->CreateSequence();
  ASSERT_TRUE(kept.ok());
  ASSERT_TRUE(cache->Reserve(*kept, 4).ok());
  ASSERT_TRUE(cache->Commit(*kept, 4).ok());
  ASSERT_TRUE(s->Add(2, 6, 10, *kept, 4).ok());
  StepPlan p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{1, 8, 1, true}}));
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_EQ(cache->Stats().sequences, 1);  // 2's kept cache was dropped
  RunStep(*cache, *s, p);
  ASSERT_TRUE(cache->FreeSequence(s->Remove(1).seq).ok());
  p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{2, 0, 6, true}}));  // recomputed from the start
}

TEST(SchedulerTest, SessionCacheIsReused) {
  auto cache = MakeCache(8);
  auto s = MakeScheduler(cache.get(), 4, 64);
  absl::StatusOr<SeqId> kept = cache->CreateSequence();
  ASSERT_TRUE(kept.ok());
  ASSERT_TRUE(cache->Reserve(*kept, 9).ok());
  ASSERT_TRUE(cache->Commit(*kept, 9).ok());
  ASSERT_TRUE(s->Add(7, 12, 20, *kept, 9).ok());
  StepPlan p = s->Schedule();
  EXPECT_EQ(Chunks(p), (std::vector<C>{{7, 9, 3, true}}));
  EXPECT_EQ(p.chunks[0].seq, *kept);
  RunStep(*cache, *s, p);
  Scheduler::Removed r = s->Remove(7);
  EXPECT_EQ(r.seq, *kept);
  EXPECT_EQ(r.num_cached, 12);
  EXPECT_TRUE(s->empty());
}

TEST(SchedulerTest, RemoveWaitingAndUnknown) {
  auto cache = MakeCache(8);
  auto s = MakeScheduler(cache.get(), 4, 64);
  ASSERT_TRUE(s->Add(1, 4, 8, -1, 0).ok());
  EXPECT_TRUE(s->Contains(1));
  Scheduler::Removed r = s->Remove(1);
  EXPECT_EQ(r.seq, -1);
  EXPECT_FALSE(s->Contains(1));
  EXPECT_EQ(s->waiting(), 0);
  r = s->Remove(42);
  EXPECT_EQ(r.seq, -1);
  EXPECT_TRUE(s->Schedule().empty());
}

}  // namespace
}  // namespace subspace
