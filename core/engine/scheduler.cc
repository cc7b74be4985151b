// Scheduler: the step planner behind the engine. The policy (FCFS admission with whole-prompt
// reservation, reserve-as-you-go generation, preemption of the newest request) is described in
// scheduler.h; this file keeps the bookkeeping of who holds which blocks consistent with it.
#include "core/engine/scheduler.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/strings/str_format.h"

namespace subspace {

namespace {

// Large enough for any pool, small enough that BlocksNeeded's arithmetic cannot overflow.
constexpr int64_t kMaxSearchTokens = int64_t{1} << 40;

// The most tokens a fresh sequence can reserve in a pool of `blocks_total` blocks.
absl::StatusOr<int64_t> MaxSequenceTokens(KvCacheBase& cache) {
  absl::StatusOr<SeqId> seq = cache.CreateSequence();
  if (!seq.ok()) return seq.status();
  const int64_t blocks_total = cache.Stats().blocks_total;
  const auto fits = [&](int64_t n) { return cache.BlocksNeeded(*seq, n) <= blocks_total; };
  // BlocksNeeded is monotone in n: find the last n that fits by doubling, then bisection.
  int64_t lo = 0;  // fits
  int64_t hi = 1;  // first candidate that may not
  while (hi < kMaxSearchTokens && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  absl::Status freed = cache.FreeSequence(*seq);
  if (!freed.ok()) return freed;
  return lo;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(const SchedulerConfig& config,
                                                             KvCacheBase* cache,
                                                             ReclaimFn reclaim_idle) {
  if (cache == nullptr) return absl::InvalidArgumentError("scheduler needs a KV cache");
  if (config.max_running < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_running must be at least 1, got %d", config.max_running));
  }
  // Every running request decodes one token per step; a smaller budget would starve some.
  if (config.max_batch_tokens < config.max_running) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_batch_tokens (%d) must be at least max_running (%d)",
                        config.max_batch_tokens, config.max_running));
  }
  if (config.max_queue < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_queue must be at least 1, got %d", config.max_queue));
  }
  absl::StatusOr<int64_t> max_tokens = MaxSequenceTokens(*cache);
  if (!max_tokens.ok()) return max_tokens.status();
  return std::unique_ptr<Scheduler>(
      new Scheduler(config, cache, std::move(reclaim_idle), *max_tokens));
}

Scheduler::Scheduler(const SchedulerConfig& config, KvCacheBase* cache, ReclaimFn reclaim_idle,
                     int64_t max_sequence_tokens)
    : config_(config),
      cache_(cache),
      reclaim_idle_(std::move(reclaim_idle)),
      max_sequence_tokens_(max_sequence_tokens) {}

absl::Status Scheduler::Add(uint64_t id, int64_t num_tokens, int64_t max_cached_tokens, SeqId seq,
                            int64_t num_cached, const RefreshConfig* refresh) {
  if (entries_.contains(id)) {
    return absl::InvalidArgumentError(absl::StrFormat("request %d is already scheduled", id));
  }
  // At least one token must be left to compute: its logits give the first sampled token.
  if (num_tokens < 1 || num_cached < 0 || num_cached >= num_tokens ||
      (seq < 0 && num_cached != 0) || max_cached_tokens < num_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "inconsistent token counts: %d tokens, %d cached (sequence %d), at most %d cached",
        num_tokens, num_cached, seq, max_cached_tokens));
  }
  if (static_cast<int64_t>(waiting_.size()) >= config_.max_queue) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("request queue is full (%d waiting)", config_.max_queue));
  }
  if (max_cached_tokens > max_sequence_tokens_) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("request needs up to %d cached tokens; the whole KV cache pool holds %d",
                        max_cached_tokens, max_sequence_tokens_));
  }
  Entry& e = entries_[id];
  e.id = id;
  e.seq = seq;
  e.num_tokens = num_tokens;
  e.num_computed = num_cached;
  if (refresh != nullptr) e.refresh = *refresh;
  waiting_.push_back(id);
  return absl::OkStatus();
}

StepPlan Scheduler::Schedule() {
  StepPlan plan;
  int64_t budget = config_.max_batch_tokens;
  for (uint64_t id : running_) entries_.at(id).scheduled = false;

  const auto add_chunk = [&](Entry& e, int64_t n, bool admitted) {
    const bool samples = e.num_computed + n == e.num_tokens;
    plan.chunks.push_back({e.id, e.seq, e.num_computed, n, samples, admitted});
    if (n == 1 && samples) {
      ++plan.decode_tokens;
    } else {
      plan.prefill_tokens += n;
    }
    e.scheduled = true;
    budget -= n;
  };

  // 1. Decodes, oldest first, so the requests that have waited longest keep their blocks.
  // Preemption takes from the back of running_, never an entry before i: i stays valid.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Entry& e = entries_.at(running_[i]);
    if (e.num_tokens - e.num_computed != 1) continue;
    if (!ReserveForRunning(e, plan)) break;  // e was the newest and preempted itself
    add_chunk(e, 1, /*admitted=*/false);
  }

  // 2. Prefills admitted in an earlier step; their blocks were reserved at admission.
  for (uint64_t id : running_) {
    if (budget == 0) break;
    Entry& e = entries_.at(id);
    if (e.scheduled) continue;
    const int64_t need = e.num_tokens - e.num_computed;
    assert(need > 0 && cache_->BlocksNeeded(e.seq, need) == 0);
    add_chunk(e, std::min(need, budget), /*admitted=*/false);
  }

  // 3. Admissions, strictly FCFS. After a preemption the pool is known to be short, and the
  // preempted requests sit at the front of the queue anyway.
  if (plan.preempted.empty()) {
    while (budget > 0 && !waiting_.empty() &&
           static_cast<int>(running_.size()) < config_.max_running) {
      Entry& e = entries_.at(waiting_.front());
      if (!ReserveForAdmission(e)) break;
      waiting_.pop_front();
      running_.push_back(e.id);
      add_chunk(e, std::min(e.num_tokens - e.num_computed, budget), /*admitted=*/true);
    }
  }
  return plan;
}

bool Scheduler::ReserveForRunning(Entry& e, StepPlan& plan) {
  while (true) {
    if (cache_->Reserve(e.seq, 1).ok()) return true;
    if (reclaim_idle_ && reclaim_idle_()) continue;
    if (EvictWaitingCache(nullptr)) continue;
    Entry& victim = entries_.at(running_.back());
    Preempt(victim);
    plan.preempted.push_back(victim.id);
    if (&victim == &e) return false;
  }
}

bool Scheduler::ReserveForAdmission(Entry& e) {
  const bool fresh = e.seq < 0;
  if (fresh) {
    absl::StatusOr<SeqId> seq = cache_->CreateSequence();
    if (!seq.ok()) return false;
    e.seq = *seq;
    if (e.refresh.has_value()) {
      // Validated when the session was made, against this cache's kind.
      const absl::Status st = cache_->SetSequenceRefresh(e.seq, *e.refresh);
      assert(st.ok());
      (void)st;
    }
  }
  if (!fresh && cache_->Length(e.seq) > e.num_computed) {
    // A session whose conversation was replaced past part of what its sequence holds (a chat
    // re-rendered by its template): the tokens after the kept prefix go.
    const absl::Status st = cache_->Truncate(e.seq, e.num_computed);
    assert(st.ok());
    (void)st;
  }
  const int64_t need = e.num_tokens - e.num_computed;
  while (!cache_->Reserve(e.seq, need).ok()) {
    if (reclaim_idle_ && reclaim_idle_()) continue;
    // Kept caches of waiting requests are only taken when nothing runs: otherwise the running
    // requests will free blocks soon, and the kept caches save recomputation. With nothing
    // running they may be all that stands between the head of the queue and the pool.
    if (running_.empty() && EvictWaitingCache(&e)) continue;
    if (fresh) FreeSeq(e);
    return false;
  }
  return true;
}

bool Scheduler::EvictWaitingCache(const Entry* except) {
  for (auto it = waiting_.rbegin(); it != waiting_.rend(); ++it) {
    Entry& w = entries_.at(*it);
    if (&w == except || w.seq < 0) continue;
    FreeSeq(w);
    return true;
  }
  return false;
}

void Scheduler::Preempt(Entry& e) {
  assert(!running_.empty() && running_.back() == e.id);
  FreeSeq(e);
  ++e.preemptions;
  ++preemptions_total_;
  running_.pop_back();
  waiting_.push_front(e.id);
}

void Scheduler::FreeSeq(Entry& e) {
  if (e.seq >= 0) {
    absl::Status st = cache_->FreeSequence(e.seq);
    assert(st.ok());
    (void)st;
  }
  e.seq = -1;
  e.num_computed = 0;
}

void Scheduler::Commit(const StepPlan& plan) {
  for (const ScheduledChunk& c : plan.chunks) {
    auto it = entries_.find(c.id);
    if (it == entries_.end()) continue;
    assert(it->second.num_computed == c.pos);
    it->second.num_computed = c.pos + c.n;
  }
}

void Scheduler::AppendToken(uint64_t id) {
  auto it = entries_.find(id);
  if (it != entries_.end()) ++it->second.num_tokens;
}

Scheduler::Removed Scheduler::Remove(uint64_t id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return {};
  if (auto r = std::find(running_.begin(), running_.end(), id); r != running_.end()) {
    running_.erase(r);
  } else if (auto w = std::find(waiting_.begin(), waiting_.end(), id); w != waiting_.end()) {
    waiting_.erase(w);
  }
  const Removed out{it->second.seq, it->second.num_computed};
  entries_.erase(it);
  return out;
}

int64_t Scheduler::preemptions(uint64_t id) const {
  auto it = entries_.find(id);
  return it == entries_.end() ? 0 : it->second.preemptions;
}

}  // namespace subspace
