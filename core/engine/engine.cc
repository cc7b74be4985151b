// Engine: validation and admission on the caller's thread; on the engine thread, a loop that
// reaps (cancel, deadline, TTL), plans a step with the Scheduler, runs the model, samples,
// detokenizes and reports through observers with the lock released. Sessions, their export,
// import and tiers: engine_sessions.cc; the state: engine_impl.h.
//
// Locking: mu_ guards the request table, the scheduler, the sessions and the stats. The cache
// is touched only by the engine thread -- planning and session bookkeeping under mu_, the
// forward pass outside it -- so Submit and friends never wait for a forward pass, and Stats()
// reads a snapshot of the cache's counters taken by the engine thread. mu_ is a std::mutex, not
// an absl::Mutex, so that ThreadSanitizer sees its happens-before edges (Debian's Abseil is not
// built with TSan). The loop sleeps on kick_cv_ and Drain on idle_cv_; whoever may make
// KickedLocked() or IdleLocked() true signals the variable (absl's Await re-evaluated them on
// every unlock by itself).
//
// Session and EOS semantics (documented for the API):
//  * A request on a session runs over the session's history + its prompt; only tokens not in
//    the session's cache are prefilled (usage.reused_tokens counts the rest). However it ends,
//    the session's history becomes history + prompt + every generated token reported through
//    OnTokens -- an EOS included, and the token that completed a stop sequence too -- so the
//    next call continues exactly what the model produced. The last generated token's K/V is
//    not cached yet: it is prefilled with the next call's prompt.
//  * EOS is reported as a token (its text is empty) and counted in generated_tokens.
//  * max_new_tokens is clamped to the context left (history + prompt + generated tokens never
//    exceed context_length; the request then ends with kLength); only a prompt that leaves no
//    room to generate is rejected.
//  * max_new_tokens 0 on a session only prefills: the prompt's K/V are all cached (its last
//    token's too, unlike a generating request's last token), nothing is sampled or reported
//    through OnTokens, and the request ends with kLength. The session is then warm: the next
//    call prefills only its own tokens.
//  * A cancelled or timed-out request drops text held back by the UTF-8 decoder or the stop
//    matcher; a request ending by length or EOS flushes it into its last token's text.
#include "core/engine/engine.h"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/engine/engine_impl.h"
#include "core/engine/scheduler.h"
#include "core/engine/session_store.h"

namespace subspace {

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kDeadline:
      return "deadline";
  }
  return "unknown";
}

namespace {

// How long the loop sleeps when requests wait but none could be scheduled (it cannot happen
// with the scheduler's policy; the poll only keeps deadlines honoured if it ever did).
constexpr absl::Duration kBlockedPoll = absl::Milliseconds(10);

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// The leading tokens a cached `history` (at most its first `limit`) and a new `prompt` share,
// short of the prompt's last token: generation needs that token's logits. prompt: not empty.
int64_t SharedPrefix(const std::vector<int32_t>& history, const std::vector<int32_t>& prompt,
                     int64_t limit) {
  const int64_t n = std::min(
      {limit, static_cast<int64_t>(history.size()), static_cast<int64_t>(prompt.size()) - 1});
  int64_t i = 0;
  while (i < n && history[static_cast<size_t>(i)] == prompt[static_cast<size_t>(i)]) ++i;
  return i;
}

// Waits on `cv` until `ready()` holds or absl's clock passes `deadline` (which may be
// absl::InfiniteFuture()); true when ready. Each wait is capped so the conversion to a chrono
// duration cannot overflow; an early wake-up only re-checks.
template <typename Ready>
bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, absl::Time deadline,
               Ready ready) {
  constexpr absl::Duration kMaxWait = absl::Hours(1);
  while (!ready()) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    cv.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, kMaxWait)));
  }
  return true;
}

}  // namespace

absl::Status Engine::Impl::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  SchedulerConfig sc;
  sc.max_running = config_.max_running;
  sc.max_batch_tokens = config_.max_batch_tokens;
  sc.max_queue = config_.max_queue;
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler =
      Scheduler::Create(sc, cache_.get(), [this]() {
        // Called from Schedule(), which runs under mu_ on the engine thread.
        return ReclaimIdleLocked();
      });
  if (!scheduler.ok()) return scheduler.status();
  scheduler_ = *std::move(scheduler);
  cache_stats_ = cache_->Stats();
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

Engine::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    kick_cv_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<RequestId> Engine::Impl::Submit(GenerateRequest request,
                                               std::shared_ptr<GenerateObserver> observer) {
  if (observer == nullptr) return absl::InvalidArgumentError("observer is null");
  const ModelConfig& mc = model_->config();
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t t = request.prompt[i];
    if (t < 0 || t >= mc.n_vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("prompt[%d] = %d is outside the vocabulary [0, %d)", i, t, mc.n_vocab));
    }
  }
  if (request.max_new_tokens < 0 || (request.max_new_tokens == 0 && request.session_id.empty())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max_new_tokens must be at least 1 (0 only prefills a session's prompt), got %d",
        request.max_new_tokens));
  }
  if (absl::Status st = ValidateSamplingParams(request.sampling); !st.ok()) return st;

  const absl::Time now = absl::Now();
  std::unique_lock<std::mutex> lock(mu_);
  Session* session = nullptr;
  // A session's cache in a tier comes back first (a few tries: under pool pressure the loop may
  // give it up again before this thread gets the lock back).
  for (int attempt = 0;; ++attempt) {
    if (draining_ || stop_) return absl::UnavailableError("the engine is draining");
    if (request.session_id.empty()) break;
    session = sessions_.FindOwned(request.session_id, request.session_owner, now);
    if (session == nullptr) {
      return absl::NotFoundError(absl::StrCat("session ", request.session_id, " not found"));
    }
    if (session->busy()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "session %s is busy with request %d", request.session_id, session->active_request));
    }
    if (!session->tiered) break;
    if (attempt == 3) {
      tiers_->Erase(session->id);
      session->tiered = false;
      session->cached = 0;
      ++tier_restores_failed_;
      break;
    }
    RestoreTieredLocked(lock, request.session_id, request.session_owner, now);
  }
  const bool replaces = session != nullptr && request.prompt_replaces_history;
  // Tokens of the session's cache the new conversation keeps: its common prefix with the old
  // history.
  int64_t kept = session == nullptr ? 0 : session->cached;
  int64_t shared = 0;
  if (replaces) {
    shared =
        SharedPrefix(session->tokens, request.prompt, static_cast<int64_t>(session->tokens.size()));
    kept = std::min(kept, shared);
  }
  // A stateless request may take over a kept cache that starts as its prompt does (given back
  // if the request is refused below).
  PromptCacheEntry reuse;
  if (session == nullptr)
    reuse = TakePromptCacheLocked(request.prompt, request.session_owner, &shared);
  if (reuse.seq >= 0) kept = shared;
  const int64_t history =
      session == nullptr || replaces ? 0 : static_cast<int64_t>(session->tokens.size());
  const int64_t total = history + static_cast<int64_t>(request.prompt.size());
  if (total >= mc.context_length) {
    if (reuse.seq >= 0) prompt_cache_.push_front(std::move(reuse));
    return absl::InvalidArgumentError(absl::StrFormat(
        "prompt: %d tokens (session history %d + prompt %d) leave no room to generate in the "
        "context of %d",
        total, history, request.prompt.size(), mc.context_length));
  }
  const int64_t max_new = std::min<int64_t>(request.max_new_tokens, mc.context_length - total);

  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<size_t>(total + max_new));
  if (session != nullptr && !replaces) tokens = session->tokens;
  tokens.insert(tokens.end(), request.prompt.begin(), request.prompt.end());
  // The decoder strips the dummy-prefix space only when the output starts the text, i.e.
  // nothing before it produced any bytes (e.g. the prompt is just BOS).
  const bool strip_leading_space = std::all_of(
      tokens.begin(), tokens.end(), [&](int32_t t) { return tokenizer_->TokenToBytes(t).empty(); });

  const RequestId id = next_id_;
  // The longest the sequence gets in the cache: the last generated token is never written (a
  // prefill-only request writes its whole prompt).
  const SeqId seq = session != nullptr ? session->seq : reuse.seq;
  absl::Status added =
      scheduler_->Add(id, total, total + std::max<int64_t>(max_new - 1, 0), seq, seq < 0 ? 0 : kept,
                      session != nullptr && session->refresh ? &*session->refresh : nullptr);
  if (!added.ok()) {
    // Back where it was (this thread must not touch the cache: the loop owns it).
    if (reuse.seq >= 0) prompt_cache_.push_front(std::move(reuse));
    return added;
  }
  if (reuse.seq >= 0) ++prompt_cache_hits_;
  ++next_id_;

  auto r = std::make_unique<Request>(id, request.sampling, *tokenizer_, strip_leading_space,
                                     std::move(request.stop));
  r->observer = std::move(observer);
  r->session_id = std::move(request.session_id);
  r->owner = std::move(request.session_owner);
  r->tokens = std::move(tokens);
  // A replaced conversation counts what it added past the shared prefix as its prompt.
  r->prompt_tokens = static_cast<int64_t>(request.prompt.size()) - (replaces ? shared : 0);
  r->max_new = max_new;
  r->ignore_eos = request.ignore_eos;
  r->deadline = request.deadline;
  r->accepted = now;
  if (session != nullptr) {
    session->seq = -1;  // the scheduler owns it until the request finishes
    session->active_request = id;
    session->last_used = now;
  }
  requests_.emplace(id, std::move(r));
  KickLocked();
  return id;
}

void Engine::Impl::Cancel(RequestId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  it->second->cancelled = true;
  KickLocked();
}

bool Engine::Impl::Drain(absl::Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  draining_ = true;
  return WaitUntil(idle_cv_, lock, absl::Now() + timeout, [this] { return IdleLocked(); });
}

bool Engine::Impl::draining() const {
  std::lock_guard<std::mutex> lock(mu_);
  return draining_;
}

EngineStats Engine::Impl::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats s;
  s.running = scheduler_->running();
  s.waiting = scheduler_->waiting();
  s.sessions = sessions_.size();
  s.prompt_cache_entries = static_cast<int>(prompt_cache_.size());
  s.prompt_cache_hits_total = prompt_cache_hits_;
  s.preemptions_total = scheduler_->preemptions_total();
  s.steps_total = steps_total_;
  s.cache = cache_stats_;
  if (tiers_ != nullptr) s.tiers = tiers_->Stats();
  s.tier_restores_failed_total = tier_restores_failed_;
  return s;
}

// ---- Engine thread ------------------------------------------------------------------------

void Engine::Impl::Loop() {
  std::vector<Delivery> out;
  std::vector<std::string> removed;
  const int64_t n_vocab = model_->config().n_vocab;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    absl::Time now = absl::Now();
    kicked_ = false;
    RunTasksLocked();
    ReapLocked(now, &out);
    removed.insert(removed.end(), removed_sessions_.begin(), removed_sessions_.end());
    removed_sessions_.clear();
    cache_stats_ = cache_->Stats();  // reaped blocks show before the OnFinish calls
    if (stop_ && requests_.empty()) break;

    StepPlan plan;
    if (!scheduler_->empty()) plan = scheduler_->Schedule();
    if (plan.empty()) {
      if (!out.empty() || !removed.empty()) {
        lock.unlock();
        Deliver(out);
        NotifyRemoved(removed);
        lock.lock();
        continue;
      }
      const absl::Time wake = scheduler_->empty() ? next_session_expiry_ : now + kBlockedPoll;
      WaitUntil(kick_cv_, lock, wake, [this] { return KickedLocked(); });
      continue;
    }

    batch_.clear();
    batch_requests_.clear();
    for (const ScheduledChunk& c : plan.chunks) {
      Request& r = *requests_.at(c.id);
      if (!r.scheduled_once) {
        r.scheduled_once = true;
        r.first_scheduled = now;
        r.reused = c.pos;  // what the session's cache saved at first admission
      }
      batch_.push_back({c.seq, c.pos,
                        std::span<const int32_t>(r.tokens.data() + c.pos, static_cast<size_t>(c.n)),
                        /*all_logits=*/false});
      batch_requests_.push_back(&r);
    }
    lock.unlock();
    Deliver(out);
    NotifyRemoved(removed);

    // The forward pass and sampling run without the lock: only this thread touches the cache
    // and the requests' generation state, and no request is erased while the lock is free.
    const absl::Time start = absl::Now();
    std::vector<bool> samples(plan.chunks.size());
    // A prefill-only request's last chunk ends it without sampling.
    std::vector<bool> prefilled(plan.chunks.size());
    for (size_t i = 0; i < plan.chunks.size(); ++i) {
      prefilled[i] = plan.chunks[i].samples && batch_requests_[i]->max_new == 0;
      samples[i] = plan.chunks[i].samples && !prefilled[i];
    }
    const bool on_device = PlanDeviceSampling(samples);
    const absl::Status forward = on_device
                                     ? model_->ForwardAndSample(batch_, *cache_, rows_, &sampled_)
                                     : model_->Forward(batch_, *cache_, &logits_);
    std::vector<std::optional<Outcome>> outcomes(plan.chunks.size());
    std::vector<absl::Time> token_times(plan.chunks.size());
    if (forward.ok()) {
      for (size_t i = 0; i < plan.chunks.size(); ++i) {
        if (prefilled[i]) {
          outcomes[i] = Outcome{.has_token = false, .finish = FinishReason::kLength};
          token_times[i] = absl::Now();
          continue;
        }
        if (!samples[i]) continue;
        if (on_device) {
          outcomes[i] = Decode(*batch_requests_[i],
                               {.token = sampled_[i].token, .logprob = sampled_[i].logprob});
        } else {
          std::span<float> row(logits_.data() + static_cast<int64_t>(i) * n_vocab,
                               static_cast<size_t>(n_vocab));
          outcomes[i] = SampleAndDecode(*batch_requests_[i], row);
        }
        token_times[i] = absl::Now();
      }
    }
    const absl::Time end = absl::Now();

    StepStats step;
    step.sequences = static_cast<int>(plan.chunks.size());
    step.decode_tokens = static_cast<int>(plan.decode_tokens);
    step.prefill_tokens = static_cast<int>(plan.prefill_tokens);
    step.seconds = Seconds(end - start);

    lock.lock();
    ++steps_total_;
    if (!forward.ok()) {
      // The batch's cache state is unknown: FinishLocked frees every sequence in it.
      const absl::Status internal =
          absl::InternalError(absl::StrCat("engine step failed: ", forward.message()));
      for (Request* r : batch_requests_) FinishLocked(*r, FinishReason::kNone, internal, end, &out);
    } else {
      scheduler_->Commit(plan);
      for (size_t i = 0; i < plan.chunks.size(); ++i) {
        if (!outcomes[i].has_value()) continue;
        Request& r = *batch_requests_[i];
        const absl::Time t = token_times[i];
        if (!outcomes[i]->has_token) {
          FinishLocked(r, outcomes[i]->finish, absl::OkStatus(), t, &out);
          continue;
        }
        scheduler_->AppendToken(r.id);
        if (r.generated == 1) {
          r.timings.ttft_seconds = Seconds(t - r.accepted);
        } else {
          r.timings.inter_token_seconds.push_back(static_cast<float>(Seconds(t - r.last_token)));
        }
        r.last_token = t;
        out.push_back({r.observer, std::move(outcomes[i]->event), std::nullopt});
        if (outcomes[i]->finish != FinishReason::kNone) {
          FinishLocked(r, outcomes[i]->finish, absl::OkStatus(), t, &out);
        }
      }
    }
    cache_stats_ = cache_->Stats();
    lock.unlock();
    Deliver(out);
    if (config_.on_step) config_.on_step(step);
    lock.lock();
  }
  RunTasksLocked();  // no caller waits on a loop that is gone
  cache_stats_ = cache_->Stats();
  removed.insert(removed.end(), removed_sessions_.begin(), removed_sessions_.end());
  removed_sessions_.clear();
  lock.unlock();
  Deliver(out);
  NotifyRemoved(removed);
}

void Engine::Impl::NotifyRemoved(std::vector<std::string>& ids) {
  if (config_.on_session_removed) {
    for (const std::string& id : ids) config_.on_session_removed(id);
  }
  ids.clear();
}

void Engine::Impl::ReapLocked(absl::Time now, std::vector<Delivery>* out) {
  std::vector<std::pair<Request*, FinishReason>> done;
  for (auto& [id, r] : requests_) {
    if (stop_ || r->cancelled) {
      done.emplace_back(r.get(), FinishReason::kCancelled);
    } else if (now >= r->deadline) {
      done.emplace_back(r.get(), FinishReason::kDeadline);
    }
  }
  // Oldest first, so observers see finishes in submission order.
  std::sort(done.begin(), done.end(),
            [](const auto& a, const auto& b) { return a.first->id < b.first->id; });
  for (auto& [r, reason] : done) FinishLocked(*r, reason, absl::OkStatus(), now, out);

  if (now >= next_session_expiry_) {
    sessions_.EvictExpired(now, &seqs_to_free_, &removed_sessions_);
    next_session_expiry_ = sessions_.NextExpiry();
  }
  for (SeqId seq : seqs_to_free_) FreeSeqLocked(seq);
  seqs_to_free_.clear();
}

void Engine::Impl::FinishLocked(Request& r, FinishReason reason, absl::Status status,
                                absl::Time now, std::vector<Delivery>* out) {
  GenerateResult result;
  result.status = std::move(status);
  result.finish = reason;
  result.preemptions = scheduler_->preemptions(r.id);
  Scheduler::Removed removed = scheduler_->Remove(r.id);
  if (!result.status.ok() && removed.seq >= 0) {
    FreeSeqLocked(removed.seq);  // a failed step leaves the cache contents undefined
    removed = {};
  }
  Session* session = r.session_id.empty() ? nullptr : sessions_.Find(r.session_id, now);
  if (session != nullptr && session->active_request == r.id) {
    session->tokens = std::move(r.tokens);
    session->seq = removed.seq;
    session->cached = removed.seq >= 0 ? removed.num_cached : 0;
    session->active_request = 0;
    session->last_used = now;
    next_session_expiry_ = std::min(next_session_expiry_, now + session->idle_ttl);
  } else if (removed.seq >= 0 && r.session_id.empty() && config_.prompt_cache_entries > 0 &&
             removed.num_cached > 0 && !stop_) {
    // A stateless request's cache stays for a later request that starts the same way.
    prompt_cache_.push_front({removed.seq, std::move(r.tokens), removed.num_cached, r.owner});
    while (static_cast<int>(prompt_cache_.size()) > config_.prompt_cache_entries) {
      FreeSeqLocked(prompt_cache_.back().seq);
      prompt_cache_.pop_back();
    }
  } else if (removed.seq >= 0) {
    FreeSeqLocked(removed.seq);  // a one-shot request, or its session was deleted
  }

  result.usage.prompt_tokens = r.prompt_tokens;
  result.usage.reused_tokens = r.reused;
  result.usage.generated_tokens = r.generated;
  result.timings = std::move(r.timings);
  result.timings.queue_seconds = Seconds((r.scheduled_once ? r.first_scheduled : now) - r.accepted);
  result.timings.total_seconds = Seconds(now - r.accepted);
  out->push_back({std::move(r.observer), {}, std::move(result)});
  ++undelivered_finishes_;
  const RequestId id = r.id;
  requests_.erase(id);  // destroys r
}

bool Engine::Impl::ReclaimIdleLocked() {
  // Kept stateless caches go first, oldest first: nobody was promised them.
  if (!prompt_cache_.empty()) {
    FreeSeqLocked(prompt_cache_.back().seq);
    prompt_cache_.pop_back();
    return true;
  }
  Session* s = sessions_.LeastRecentlyUsedCached();
  if (s == nullptr) return false;
  if (tiers_ != nullptr && s->cached > 0) {
    // A cache without images (online refresh, the device caches) is dropped as before.
    ExportedSession e = ExportLocked(*s);
    if (e.cache.ok() && e.image.cached > 0 && tiers_->Put(std::move(e.image))) s->tiered = true;
  }
  FreeSeqLocked(s->seq);
  s->seq = -1;
  if (!s->tiered) s->cached = 0;
  return true;
}

Engine::Impl::PromptCacheEntry Engine::Impl::TakePromptCacheLocked(
    const std::vector<int32_t>& prompt, std::string_view owner, int64_t* shared) {
  auto best = prompt_cache_.end();
  int64_t best_shared = 0;
  for (auto it = prompt_cache_.begin(); it != prompt_cache_.end(); ++it) {
    if (it->owner != owner) continue;
    const int64_t n = SharedPrefix(it->tokens, prompt, it->cached);
    if (n > best_shared) {
      best_shared = n;
      best = it;
    }
  }
  if (best == prompt_cache_.end() || best_shared < kMinPromptCacheReuse) return {};
  PromptCacheEntry taken = std::move(*best);
  prompt_cache_.erase(best);
  *shared = best_shared;
  return taken;
}

void Engine::Impl::FreeSeqLocked(SeqId seq) {
  // Only ids this engine created reach here; a failure would be a bookkeeping bug, and the
  // worst outcome is a sequence's blocks staying allocated.
  absl::Status st = cache_->FreeSequence(seq);
  (void)st;
}

bool Engine::Impl::PlanDeviceSampling(const std::vector<bool>& samples) {
  if (!model_->samples_rows()) return false;
  for (size_t i = 0; i < samples.size(); ++i) {
    if (samples[i] && !batch_requests_[i]->sampler.RowSamplingApplies()) return false;
  }
  rows_.clear();
  for (size_t i = 0; i < samples.size(); ++i) {
    // A chunk that samples nothing (a prompt's first part) still has a row: argmax, ignored.
    rows_.push_back(samples[i] ? batch_requests_[i]->sampler.NextRow() : RowSampling{});
  }
  return true;
}

Engine::Impl::Outcome Engine::Impl::SampleAndDecode(Request& r, std::span<float> logits) {
  return Decode(r, r.sampler.Sample(logits, r.tokens));
}

Engine::Impl::Outcome Engine::Impl::Decode(Request& r, SampledToken s) {
  r.tokens.push_back(s.token);
  ++r.generated;
  Outcome o;
  o.event.token = s.token;
  o.event.logprob = s.logprob;
  o.event.top = std::move(s.top);
  StopMatcher::Result m = r.stop.Push(r.decoder.Push(s.token));
  o.event.text = std::move(m.text);
  if (m.stopped) {
    o.finish = FinishReason::kStop;
    return o;
  }
  if (!r.ignore_eos && tokenizer_->IsEndOfGeneration(s.token)) {
    o.finish = FinishReason::kEos;
  } else if (r.generated >= r.max_new) {
    o.finish = FinishReason::kLength;
  } else {
    return o;
  }
  // Ending normally: release what the decoder and the stop matcher held back.
  StopMatcher::Result tail = r.stop.Push(r.decoder.Flush());
  o.event.text += tail.text;
  if (tail.stopped) {
    o.finish = FinishReason::kStop;
  } else {
    o.event.text += r.stop.Flush();
  }
  return o;
}

void Engine::Impl::Deliver(std::vector<Delivery>& out) {
  if (out.empty()) return;
  int64_t finishes = 0;
  for (Delivery& d : out) {
    if (d.finish.has_value()) {
      d.observer->OnFinish(*d.finish);
      ++finishes;
    } else {
      d.observer->OnTokens(std::span<const GeneratedTokenEvent>(&d.event, 1));
    }
  }
  out.clear();
  if (finishes > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    undelivered_finishes_ -= finishes;
    if (IdleLocked()) idle_cv_.notify_all();  // Drain may wait on several threads
  }
}

// ---- Engine -------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(EngineConfig config,
                                                       std::shared_ptr<ModelRunner> model,
                                                       std::shared_ptr<const Tokenizer> tokenizer,
                                                       std::unique_ptr<KvCacheBase> cache) {
  if (model == nullptr) return absl::InvalidArgumentError("engine needs a model");
  if (tokenizer == nullptr) return absl::InvalidArgumentError("engine needs a tokenizer");
  if (cache == nullptr) return absl::InvalidArgumentError("engine needs a KV cache");
  const ModelConfig& mc = model->config();
  const KvCacheGeometry& g = cache->geometry();
  if (g.n_layers != mc.n_layers || g.n_kv_heads != mc.n_kv_heads || g.head_dim != mc.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV cache geometry (layers %d, kv heads %d, head_dim %d) does not match the model "
        "(%d, %d, %d)",
        g.n_layers, g.n_kv_heads, g.head_dim, mc.n_layers, mc.n_kv_heads, mc.head_dim));
  }
  if (config.max_sessions < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_sessions must not be negative, got %d", config.max_sessions));
  }
  if (config.default_session_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("default_session_ttl must be positive");
  }
  std::unique_ptr<SessionTiers> tiers;
  if (config.session_tiers.enabled()) {
    // A tier's file holds at most a session's share of the pool (plus its bases).
    config.session_tiers.max_image_bytes = 2 * cache->Stats().bytes_total + (int64_t{256} << 20);
    // Disk entries in the cache's storage form, made by the tiers' writer (CompactImage is
    // thread-safe; the tiers are destroyed, their writer joined, before the cache).
    config.session_tiers.compact_image = [c = cache.get()](std::string_view image) {
      return c->CompactImage(image);
    };
    absl::StatusOr<std::unique_ptr<SessionTiers>> made = SessionTiers::Create(config.session_tiers);
    if (!made.ok()) return made.status();
    tiers = *std::move(made);
  }
  auto impl = std::make_unique<Impl>(std::move(config), std::move(model), std::move(tokenizer),
                                     std::move(cache), std::move(tiers));
  if (absl::Status st = impl->Start(); !st.ok()) return st;
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

absl::StatusOr<RequestId> Engine::Submit(GenerateRequest request,
                                         std::shared_ptr<GenerateObserver> observer) {
  return impl_->Submit(std::move(request), std::move(observer));
}
void Engine::Cancel(RequestId id) { impl_->Cancel(id); }
absl::StatusOr<SessionInfo> Engine::CreateSession(absl::Duration idle_ttl,
                                                  std::string_view proposed_id,
                                                  std::string_view owner,
                                                  std::optional<RefreshConfig> refresh) {
  return impl_->CreateSession(idle_ttl, proposed_id, owner, refresh);
}
absl::StatusOr<SessionInfo> Engine::GetSession(std::string_view id, std::string_view owner) const {
  return impl_->GetSession(id, owner);
}
std::vector<SessionInfo> Engine::ListSessions(std::string_view owner) const {
  return impl_->ListSessions(owner);
}
std::vector<SessionInfo> Engine::ListEverySession() const { return impl_->ListEverySession(); }
absl::StatusOr<std::string> Engine::SessionOwner(std::string_view id) const {
  return impl_->SessionOwner(id);
}
absl::Status Engine::DeleteSession(std::string_view id, std::string_view owner) {
  return impl_->DeleteSession(id, owner);
}
absl::StatusOr<std::vector<Engine::ExportedSession>> Engine::ExportSessions(
    absl::Time changed_since) const {
  return impl_->ExportSessions(changed_since);
}
absl::StatusOr<Engine::ExportedSession> Engine::ExportSession(std::string_view id,
                                                              std::string_view owner) const {
  return impl_->ExportSession(id, owner);
}
absl::StatusOr<Engine::ImportedSession> Engine::ImportSession(const SessionImage& image) {
  return impl_->ImportSession(image);
}
bool Engine::Drain(absl::Duration timeout) { return impl_->Drain(timeout); }
bool Engine::draining() const { return impl_->draining(); }
EngineStats Engine::Stats() const { return impl_->Stats(); }
const ModelConfig& Engine::model_config() const { return impl_->model_config(); }
const Tokenizer& Engine::tokenizer() const { return impl_->tokenizer(); }
const EngineConfig& Engine::config() const { return impl_->config(); }

}  // namespace subspace
