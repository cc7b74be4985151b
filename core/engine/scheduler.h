// Iteration-level continuous batching (vLLM v1 style): each step's plan takes the decodes of
// every running request, then chunks of unfinished prefills, then newly admitted requests, all
// under a token budget, and reserves KV-cache blocks for them, preempting when blocks run out.
// Pure bookkeeping over token counts and a KvCache; it never runs the model.
#ifndef SUBSPACE_CORE_ENGINE_SCHEDULER_H_
#define SUBSPACE_CORE_ENGINE_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/kvcache/kv_cache.h"
#include "core/kvcache/refresh_config.h"

namespace subspace {

struct SchedulerConfig {
  int max_running = 16;        // requests admitted (prefilling or decoding) at once, >= 1
  int max_batch_tokens = 512;  // tokens per step, >= max_running so every decode fits
  int max_queue = 256;         // waiting requests Add accepts (preempted ones come on top)
};

// One request's part of a step: its tokens [pos, pos + n) run through the model.
struct ScheduledChunk {
  uint64_t id = 0;
  SeqId seq = -1;
  int64_t pos = 0;  // tokens of the request already in the cache
  int64_t n = 0;
  // The chunk reaches the request's last known token, so its logits give the next token.
  bool samples = false;
  // The request's first step since it was admitted from the waiting queue.
  bool admitted = false;
};

struct StepPlan {
  std::vector<ScheduledChunk> chunks;  // decodes first, then prefill chunks, then admissions
  std::vector<uint64_t> preempted;     // running requests sent back to the queue this step
  int64_t decode_tokens = 0;           // chunks of one token that sample (generation)
  int64_t prefill_tokens = 0;          // everything else (prompts, recomputation)
  bool empty() const { return chunks.empty(); }
};

// Not thread-safe: the engine calls it from one thread at a time, under its lock. Only
// Schedule and Remove touch the cache; Add does not, so it may run while the model writes.
//
// Memory policy:
//  * Admission reserves blocks for every token of the request not yet cached (its whole
//    prompt, or prompt + generated tokens when recomputing), so a prefill split over several
//    steps never stalls or preempts halfway; generation then reserves as it goes, one token
//    per step. Admission is strictly FCFS: when the head of the queue does not fit, nothing
//    behind it is admitted (no starvation of long prompts).
//  * When a running request's next token needs a block and none is free, the scheduler takes
//    one, in this order: the cache of an idle sequence it does not own (the `reclaim_idle`
//    hook: a session between calls, least recently used first), the kept cache of a waiting
//    request (the last in the queue first), and finally preemption of the most recently
//    admitted running request, which may be the requester itself. A preempted request loses
//    its cache and goes back to the FRONT of the queue; it is recomputed (prompt + generated
//    tokens) when readmitted. No request is admitted in a step that preempted.
//  * The oldest running request therefore always progresses, and Add refuses a request whose
//    largest cache could not fit the whole pool, so every accepted request finishes.
class Scheduler {
 public:
  // Frees the cache of one idle sequence the scheduler does not own; false when none is left.
  using ReclaimFn = std::function<bool()>;

  // INVALID_ARGUMENT for a bad config; `cache` must outlive the scheduler.
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(const SchedulerConfig& config,
                                                           KvCacheBase* cache,
                                                           ReclaimFn reclaim_idle = nullptr);

  // Queues a request at the back. `num_tokens`: tokens known now (prompt, with a session's
  // history); `max_cached_tokens`: the most the request will ever keep in the cache; `seq`:
  // a cache sequence already holding the first `num_cached` tokens (a session's), which the
  // scheduler now owns, or -1. RESOURCE_EXHAUSTED when the queue is full or
  // `max_cached_tokens` cannot fit the pool; INVALID_ARGUMENT for inconsistent counts or a
  // duplicate id. `refresh`: the online basis refresh a sequence created for the request gets
  // (a session's choice); nullptr keeps the cache's default.
  absl::Status Add(uint64_t id, int64_t num_tokens, int64_t max_cached_tokens, SeqId seq,
                   int64_t num_cached, const RefreshConfig* refresh = nullptr);

  // Plans one step, reserving its blocks (and preempting as the policy above says).
  StepPlan Schedule();
  // After the step ran: the chunks' tokens are in the cache.
  void Commit(const StepPlan& plan);
  // A sampled token joins the request (its K/V is computed by a later step).
  void AppendToken(uint64_t id);

  struct Removed {
    SeqId seq = -1;          // the caller now owns it (free it, or keep it for a session)
    int64_t num_cached = 0;  // tokens it holds
  };
  // Takes a waiting or running request out; {-1, 0} for an unknown id.
  Removed Remove(uint64_t id);

  bool Contains(uint64_t id) const { return entries_.contains(id); }
  bool empty() const { return entries_.empty(); }
  int running() const { return static_cast<int>(running_.size()); }
  int waiting() const { return static_cast<int>(waiting_.size()); }
  int64_t preemptions_total() const { return preemptions_total_; }
  int64_t preemptions(uint64_t id) const;
  // Tokens one sequence can keep when it has the whole pool to itself.
  int64_t max_sequence_tokens() const { return max_sequence_tokens_; }
  const SchedulerConfig& config() const { return config_; }

 private:
  struct Entry {
    uint64_t id = 0;
    SeqId seq = -1;
    int64_t num_tokens = 0;
    int64_t num_computed = 0;  // tokens in the cache
    int64_t preemptions = 0;
    bool scheduled = false;                // in the plan being built
    std::optional<RefreshConfig> refresh;  // applied to every sequence created for it
  };

  Scheduler(const SchedulerConfig& config, KvCacheBase* cache, ReclaimFn reclaim_idle,
            int64_t max_sequence_tokens);

  // Reserves the next token of running entry `e`, making room by the policy; false when `e`
  // itself had to be preempted.
  bool ReserveForRunning(Entry& e, StepPlan& plan);
  // Reserves everything `e` (the head of the queue) lacks; false when it does not fit.
  bool ReserveForAdmission(Entry& e);
  // Frees the kept cache of the waiting entry nearest the back, other than `except`.
  bool EvictWaitingCache(const Entry* except);
  void Preempt(Entry& e);
  void FreeSeq(Entry& e);

  SchedulerConfig config_;
  KvCacheBase* cache_;
  ReclaimFn reclaim_idle_;
  int64_t max_sequence_tokens_;
  absl::flat_hash_map<uint64_t, Entry> entries_;
  std::vector<uint64_t> running_;  // admission order, oldest first
  std::deque<uint64_t> waiting_;   // FCFS; preempted requests go to the front
  int64_t preemptions_total_ = 0;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_ENGINE_SCHEDULER_H_
