// The soak: `concurrency` worker threads each draw operations from a seeded mix and run them
// back to back through SubspaceClient; the calling thread wakes once per report interval to
// take the interval's counts and latencies, the server's RSS and its cache stats. Each worker
// keeps up to sessions_per_worker sessions alive, turning among them at random, and tracks each
// one's token count exactly (usage.generated_tokens, or GetSession after a cancelled turn), so
// no turn is refused for running past the context.
#include "client/soak.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace subspace::client {
namespace {

// Deadline of every call that is not a short-deadline one: long enough for any call of a
// healthy server under load, so a call that reaches it is reported as hung (unexpected).
constexpr absl::Duration kCallTimeout = absl::Seconds(120);
// After a cancelled turn the session stays busy until the engine reaps the request (within a
// step); the worker waits this long at most before calling it a fault.
constexpr absl::Duration kSessionReleaseTimeout = absl::Seconds(30);
constexpr size_t kMaxUnexpectedExamples = 8;

enum class Op {
  kSessionTurn,          // Generate on the worker's session
  kSessionStreamTurn,    // GenerateStream on the worker's session
  kSessionStreamCancel,  // GenerateStream on the session, cancelled after 1-3 chunks
  kOneShotStream,        // GenerateStream without a session
  kShortDeadline,        // Generate without a session under a deadline of a few ms
};

const char* OpName(Op op) {
  switch (op) {
    case Op::kSessionTurn:
      return "session turn";
    case Op::kSessionStreamTurn:
      return "session stream turn";
    case Op::kSessionStreamCancel:
      return "session stream cancelled";
    case Op::kOneShotStream:
      return "one-shot stream";
    case Op::kShortDeadline:
      return "short deadline";
  }
  return "?";
}

// Weights of the mix, in percent, in Op order.
constexpr int kOpWeights[] = {30, 20, 15, 15, 20};

double SecondsSince(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

class Soak {
 public:
  Soak(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options,
       const SoakConfig& config, int64_t context_length, int32_t vocab_size, int32_t bos_id)
      : channel_(std::move(channel)),
        options_(WithTimeout(options, kCallTimeout)),
        client_(channel_, options_),
        config_(config),
        context_length_(context_length),
        vocab_size_(vocab_size),
        bos_id_(bos_id) {}

  void Worker(int index) {
    std::mt19937_64 rng(config_.seed * 1000003 + static_cast<uint64_t>(index));
    std::vector<WorkerState> states(static_cast<size_t>(config_.sessions_per_worker));
    while (!stop_.load(std::memory_order_acquire)) {
      const Op op = DrawOp(rng);
      switch (op) {
        case Op::kSessionTurn:
        case Op::kSessionStreamTurn:
        case Op::kSessionStreamCancel:
          // One session: the mix of the single-session soak, draw for draw.
          SessionTurn(op, rng, states.size() == 1 ? states[0] : states[rng() % states.size()]);
          break;
        case Op::kOneShotStream:
          OneShotStream(rng);
          break;
        case Op::kShortDeadline:
          ShortDeadline(rng);
          break;
      }
    }
    absl::MutexLock lock(&mu_);
    for (const WorkerState& state : states) {
      if (!state.session.empty()) sessions_.push_back(state.session);
    }
  }

  void Stop() { stop_.store(true, std::memory_order_release); }

  // Takes what the workers recorded since the last call.
  void TakeInterval(SoakCounts* counts, std::vector<double>* latencies) {
    absl::MutexLock lock(&mu_);
    *counts = interval_;
    interval_ = SoakCounts();
    *latencies = std::move(latencies_);
    latencies_.clear();
  }

  SoakCounts totals() {
    absl::MutexLock lock(&mu_);
    return totals_;
  }
  std::vector<std::string> unexpected_examples() {
    absl::MutexLock lock(&mu_);
    return examples_;
  }
  // The sessions the workers still held when they stopped.
  std::vector<std::string> live_sessions() {
    absl::MutexLock lock(&mu_);
    return sessions_;
  }
  int64_t sessions_created() const { return sessions_created_.load(std::memory_order_relaxed); }
  // Tokens of the conversations the workers' sessions hold (what the server must keep somewhere:
  // pool, tiers, or as tokens to prefill again).
  int64_t live_tokens() const { return live_tokens_.load(std::memory_order_relaxed); }

  SubspaceClient& client() { return client_; }

  // A status the soak does not expect, outside any generation call (session management).
  void RecordFault(const std::string& what, const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    ++interval_.unexpected;
    ++totals_.unexpected;
    AddExample(absl::StrCat(what, ": ", status.ToString()));
  }

 private:
  struct WorkerState {
    std::string session;
    int64_t tokens = 0;  // the session's conversation so far
    int32_t turns = 0;
  };

  static ClientOptions WithTimeout(ClientOptions options, absl::Duration timeout) {
    options.timeout = timeout;
    return options;
  }

  static int32_t Uniform(std::mt19937_64& rng, const LengthRange& r) {
    return r.min + static_cast<int32_t>(rng() % static_cast<uint64_t>(r.max - r.min + 1));
  }

  static Op DrawOp(std::mt19937_64& rng) {
    int pick = static_cast<int>(rng() % 100);
    for (int i = 0; i < 5; ++i) {
      if (pick < kOpWeights[i]) return static_cast<Op>(i);
      pick -= kOpWeights[i];
    }
    return Op::kOneShotStream;
  }

  v1::GenerateRequest MakeRequest(std::mt19937_64& rng, int32_t prompt_tokens,
                                  int32_t max_new_tokens, bool starts_sequence) {
    v1::GenerateRequest request;
    v1::TokenIds* ids = request.mutable_tokens();
    if (starts_sequence && bos_id_ >= 0) ids->add_ids(bos_id_);
    while (ids->ids_size() < prompt_tokens) {
      ids->add_ids(
          kFirstOrdinaryToken +
          static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab_size_ - kFirstOrdinaryToken)));
    }
    v1::SamplingParams* s = request.mutable_sampling();
    s->set_max_new_tokens(static_cast<uint32_t>(max_new_tokens));
    s->set_ignore_eos(true);  // exact token accounting and a steady load
    if (rng() % 2 == 0) {
      s->set_temperature(0.8f);
      s->set_top_p(0.95f);
    }
    s->set_seed(rng());
    return request;
  }

  void Record(Op op, const absl::Status& status, double latency_s) {
    absl::MutexLock lock(&mu_);
    if (status.ok()) {
      ++interval_.ok;
      ++totals_.ok;
      latencies_.push_back(latency_s);
    } else if (op == Op::kSessionStreamCancel && status.code() == absl::StatusCode::kCancelled) {
      ++interval_.cancelled;
      ++totals_.cancelled;
    } else if (op == Op::kShortDeadline && status.code() == absl::StatusCode::kDeadlineExceeded) {
      ++interval_.deadline_exceeded;
      ++totals_.deadline_exceeded;
    } else {
      ++interval_.unexpected;
      ++totals_.unexpected;
      AddExample(absl::StrCat(OpName(op), ": ", status.ToString()));
    }
  }

  void AddExample(const std::string& example) {
    if (examples_.size() < kMaxUnexpectedExamples &&
        std::find(examples_.begin(), examples_.end(), example) == examples_.end()) {
      examples_.push_back(example);
    }
  }

  // Keeps the sum over every worker's sessions (live_tokens) with the session's count.
  void SetTokens(WorkerState& state, int64_t tokens) {
    live_tokens_.fetch_add(tokens - state.tokens, std::memory_order_relaxed);
    state.tokens = tokens;
  }

  // After a failed turn the session's state is unknown (the failure is counted): the next turn
  // replaces it, deleting it, so it cannot hold blocks past the end of the run.
  void Retire(WorkerState& state) { state.turns = config_.max_session_turns; }

  // Ends the worker's session (when it has one) and starts a fresh one; false on failure.
  bool NewSession(WorkerState& state) {
    if (!state.session.empty()) {
      const absl::Status deleted = client_.DeleteSession(state.session);
      if (!deleted.ok()) RecordFault("DeleteSession", deleted);
      state.session.clear();
    }
    absl::StatusOr<v1::Session> session = client_.CreateSession();
    if (!session.ok()) {
      RecordFault("CreateSession", session.status());
      return false;
    }
    state.session = session->session_id();
    SetTokens(state, 0);
    state.turns = 0;
    sessions_created_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  // After a cancelled turn: waits until the server has reaped the request and takes the
  // session's token count from it (the turn's prompt and whatever was generated before).
  bool WaitSessionReleased(WorkerState& state) {
    const absl::Time deadline = absl::Now() + kSessionReleaseTimeout;
    while (true) {
      absl::StatusOr<v1::Session> info = client_.GetSession(state.session);
      if (!info.ok()) {
        RecordFault("GetSession", info.status());
        return false;
      }
      if (!info->busy()) {
        SetTokens(state, info->tokens());
        return true;
      }
      if (absl::Now() >= deadline) {
        RecordFault("GetSession", absl::DeadlineExceededError(
                                      "the session stayed busy after its request was cancelled"));
        return false;
      }
      absl::SleepFor(absl::Milliseconds(2));
    }
  }

  void SessionTurn(Op op, std::mt19937_64& rng, WorkerState& state) {
    const int32_t prompt = Uniform(rng, config_.prompt_tokens);
    const int32_t max_new = Uniform(rng, config_.output_tokens);
    // A fresh session when there is none, it has had its turns, or the turn might not fit.
    if (state.session.empty() || state.turns >= config_.max_session_turns ||
        state.tokens + prompt + max_new + 1 >= context_length_) {
      if (!NewSession(state)) return;
    }
    v1::GenerateRequest request = MakeRequest(rng, prompt, max_new, state.tokens == 0);
    request.set_session_id(state.session);
    ++state.turns;
    const absl::Time start = absl::Now();
    if (op == Op::kSessionTurn) {
      absl::StatusOr<v1::GenerateResponse> response = client_.Generate(request);
      Record(op, response.status(), SecondsSince(start));
      if (response.ok()) {
        SetTokens(state, state.tokens + request.tokens().ids_size() +
                             response->usage().generated_tokens());
      } else {
        Retire(state);
      }
      return;
    }
    const int cancel_after = op == Op::kSessionStreamCancel ? 1 + static_cast<int>(rng() % 3) : 0;
    int chunks = 0;
    absl::StatusOr<StreamResult> stream =
        client_.Stream(request, [&](const v1::GenerateStreamResponse&) {
          return cancel_after == 0 || ++chunks < cancel_after;
        });
    Record(op, stream.status(), SecondsSince(start));
    if (stream.ok()) {
      SetTokens(state, state.tokens + request.tokens().ids_size() +
                           stream->final.usage().generated_tokens());
    } else if (stream.status().code() == absl::StatusCode::kCancelled) {
      if (!WaitSessionReleased(state)) Retire(state);
    } else {
      Retire(state);
    }
  }

  void OneShotStream(std::mt19937_64& rng) {
    const v1::GenerateRequest request = MakeRequest(rng, Uniform(rng, config_.prompt_tokens),
                                                    Uniform(rng, config_.output_tokens), true);
    const absl::Time start = absl::Now();
    absl::StatusOr<StreamResult> stream = client_.Stream(request, nullptr);
    Record(Op::kOneShotStream, stream.status(), SecondsSince(start));
  }

  void ShortDeadline(std::mt19937_64& rng) {
    const v1::GenerateRequest request =
        MakeRequest(rng, Uniform(rng, config_.prompt_tokens), config_.output_tokens.max, true);
    SubspaceClient client(
        channel_,
        WithTimeout(options_, absl::Milliseconds(Uniform(rng, config_.short_deadline_ms))));
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::GenerateResponse> response = client.Generate(request);
    Record(Op::kShortDeadline, response.status(), SecondsSince(start));
  }

  const std::shared_ptr<grpc::Channel> channel_;
  const ClientOptions options_;
  SubspaceClient client_;
  const SoakConfig config_;
  const int64_t context_length_;
  const int32_t vocab_size_;
  const int32_t bos_id_;  // -1: the model has none
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> sessions_created_{0};
  std::atomic<int64_t> live_tokens_{0};

  absl::Mutex mu_;
  SoakCounts interval_ ABSL_GUARDED_BY(mu_);
  SoakCounts totals_ ABSL_GUARDED_BY(mu_);
  std::vector<double> latencies_ ABSL_GUARDED_BY(mu_);  // this interval's OK calls, seconds
  std::vector<std::string> examples_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> sessions_ ABSL_GUARDED_BY(mu_);  // of the workers that stopped
};

void FillCache(SubspaceClient& client, SoakRow* row) {
  absl::StatusOr<v1::CacheStats> stats = client.GetCacheStats();
  if (!stats.ok()) return;
  row->blocks_total = stats->blocks_total();
  row->blocks_free = stats->blocks_free();
  row->tokens_cached = stats->tokens_cached();
  row->sessions = stats->sessions();
  row->tier_host = stats->tier_sessions_host();
  row->tier_disk = stats->tier_sessions_disk();
  row->tier_host_bytes = stats->tier_bytes_host();
  row->tier_disk_bytes = stats->tier_bytes_disk();
  row->tier_disk_capacity = stats->tier_capacity_bytes_disk();
}

// Snapshot files (<id>.session, and temporaries being written) under `dir`, its subdirectories
// (the disk tier's) included; -1 when it cannot be listed.
int64_t CountSessionFiles(const std::string& dir) {
  std::error_code ec;
  int64_t n = 0;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (it->is_regular_file(ec) &&
        (absl::EndsWith(name, ".session") || absl::EndsWith(name, ".session.tmp"))) {
      ++n;
    }
  }
  return ec ? -1 : n;
}

// Polls GetCacheStats until `done` holds or `deadline` passes; the last stats read, if any.
absl::StatusOr<v1::CacheStats> PollStats(SubspaceClient& client, absl::Time deadline,
                                         const std::function<bool(const v1::CacheStats&)>& done) {
  absl::StatusOr<v1::CacheStats> stats;
  while (true) {
    stats = client.GetCacheStats();
    if ((stats.ok() && done(*stats)) || absl::Now() >= deadline) return stats;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

double Mib(int64_t kb) { return static_cast<double>(kb) / 1024.0; }

}  // namespace

absl::StatusOr<int64_t> ReadVmRssKb(int64_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  if (!in) return absl::NotFoundError(absl::StrCat("no process ", pid));
  for (std::string line; std::getline(in, line);) {
    absl::string_view rest(line);
    if (!absl::ConsumePrefix(&rest, "VmRSS:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, "kB");
    int64_t kb = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kb)) return kb;
  }
  return absl::InternalError(absl::StrCat("no VmRSS in /proc/", pid, "/status"));
}

absl::StatusOr<SoakReport> RunSoak(const std::shared_ptr<grpc::Channel>& channel,
                                   const ClientOptions& options, const SoakConfig& config,
                                   const std::function<void(const std::string&)>& on_text) {
  if (config.concurrency < 1) return absl::InvalidArgumentError("--concurrency must be >= 1");
  if (config.min_calls < 0) return absl::InvalidArgumentError("--min-calls must be >= 0");
  if (config.sessions_per_worker < 1) {
    return absl::InvalidArgumentError("--sessions-per-worker must be >= 1");
  }
  if (config.duration <= absl::ZeroDuration() || config.report_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--duration-seconds and --report-seconds must be > 0");
  }
  for (const LengthRange* r :
       {&config.prompt_tokens, &config.output_tokens, &config.short_deadline_ms}) {
    if (r->min < 1 || r->min > r->max) {
      return absl::InvalidArgumentError(absl::StrCat("bad range ", r->min, ":", r->max));
    }
  }
  SubspaceClient info_client(channel, options);
  absl::StatusOr<v1::ModelInfo> info = info_client.GetModelInfo();
  if (!info.ok()) return info.status();
  if (config.prompt_tokens.max + config.output_tokens.max + 2 >=
      static_cast<int32_t>(info->context_length())) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt (", config.prompt_tokens.max, ") + output (", config.output_tokens.max,
                     ") tokens do not fit the model's context of ", info->context_length()));
  }
  if (info->vocab_size() <= static_cast<uint32_t>(kFirstOrdinaryToken)) {
    return absl::FailedPreconditionError("the model's vocabulary has no ordinary tokens");
  }

  Soak soak(channel, options, config, info->context_length(),
            static_cast<int32_t>(info->vocab_size()), info->bos_token_id());
  SoakReport report;
  on_text(FormatSoakHeader());
  const absl::Time start = absl::Now();
  std::vector<std::thread> workers;
  workers.reserve(config.concurrency);
  for (int i = 0; i < config.concurrency; ++i) workers.emplace_back([&soak, i] { soak.Worker(i); });

  // The load runs for `duration`, then on, a report interval at a time, until min_calls calls
  // have ended (a loaded machine serves a time-bounded soak too few calls to reach the state it
  // is meant to hold), up to ten times the duration.
  absl::Duration end = config.duration;
  for (int32_t index = 1;; ++index) {
    const absl::Duration elapsed = config.report_interval * index;
    const absl::Time at = start + std::min(elapsed, end);
    absl::SleepFor(at - absl::Now());
    SoakRow row;
    row.index = index;
    row.start_s = report.rows.empty() ? 0.0 : report.rows.back().end_s;
    row.end_s = absl::ToDoubleSeconds(at - start);
    std::vector<double> latencies;
    soak.TakeInterval(&row.counts, &latencies);
    row.latency = SummarizeSeconds(std::move(latencies));
    if (config.server_pid > 0) {
      absl::StatusOr<int64_t> rss = ReadVmRssKb(config.server_pid);
      if (rss.ok()) row.rss_kb = *rss;
    }
    FillCache(soak.client(), &row);
    row.session_tokens = soak.live_tokens();
    if (!config.session_dir.empty()) row.session_files = CountSessionFiles(config.session_dir);
    if (row.tier_disk_capacity > 0 && row.tier_disk_bytes > row.tier_disk_capacity) {
      report.failures.push_back(
          absl::StrFormat("row %d: the disk tier held %d bytes, over its cap of %d", row.index,
                          row.tier_disk_bytes, row.tier_disk_capacity));
    }
    on_text(FormatSoakRow(row));
    report.tier_host_peak = std::max(report.tier_host_peak, row.tier_host_bytes);
    report.rows.push_back(row);
    if (elapsed >= end) {
      if (soak.totals().total() >= config.min_calls || elapsed >= 10 * config.duration) break;
      end = elapsed + config.report_interval;
    }
  }
  soak.Stop();
  for (std::thread& t : workers) t.join();  // each finishes its call: bounded by kCallTimeout
  report.totals = soak.totals();

  // The end: the server finishes what the workers left (cancelled streams are reaped within a
  // step), the soak deletes its sessions, and every pool block must come back.
  SubspaceClient& client = soak.client();
  const absl::Time idle_deadline = absl::Now() + config.idle_timeout;
  absl::StatusOr<v1::CacheStats> idle =
      PollStats(client, idle_deadline,
                [](const v1::CacheStats& s) { return s.running() == 0 && s.waiting() == 0; });
  report.became_idle = idle.ok() && idle->running() == 0 && idle->waiting() == 0;
  report.sessions_created = soak.sessions_created();
  for (const std::string& session : soak.live_sessions()) {
    const absl::Status deleted = client.DeleteSession(session);
    if (!deleted.ok() && deleted.code() != absl::StatusCode::kNotFound) {
      soak.RecordFault("DeleteSession", deleted);
    }
  }
  absl::StatusOr<v1::CacheStats> freed =
      PollStats(client, std::max(idle_deadline, absl::Now() + absl::Seconds(5)),
                [](const v1::CacheStats& s) { return s.blocks_free() == s.blocks_total(); });
  if (freed.ok()) {
    report.blocks_in_use_at_end =
        static_cast<int64_t>(freed->blocks_total() - freed->blocks_free());
    report.tier_sessions_at_end =
        static_cast<int64_t>(freed->tier_sessions_host() + freed->tier_sessions_disk());
  }
  if (!config.session_dir.empty()) {
    // A deleted session's files go at once (the disk tier's on the writer thread: poll briefly).
    const absl::Time files_deadline = absl::Now() + absl::Seconds(5);
    do {
      report.session_files_at_end = CountSessionFiles(config.session_dir);
    } while (report.session_files_at_end != 0 && absl::Now() < files_deadline &&
             (absl::SleepFor(absl::Milliseconds(20)), true));
  }
  report.totals = soak.totals();  // the deletions above may have added a fault
  report.unexpected_examples = soak.unexpected_examples();
  if (config.server_pid > 0) {
    for (const SoakRow& row : report.rows) {
      if (row.rss_kb >= 0) {
        report.rss_first_kb = row.rss_kb;
        break;
      }
    }
    absl::StatusOr<int64_t> rss = ReadVmRssKb(config.server_pid);
    if (rss.ok()) report.rss_end_kb = *rss;
  }

  if (!report.became_idle) {
    report.failures.push_back(
        absl::StrFormat("the server did not go idle within %s (requests still running or queued)",
                        absl::FormatDuration(config.idle_timeout)));
  }
  if (!freed.ok()) {
    report.failures.push_back(absl::StrCat("GetCacheStats failed: ", freed.status().ToString()));
  } else if (report.blocks_in_use_at_end != 0) {
    report.failures.push_back(absl::StrFormat(
        "%d of %d pool blocks still in use after the soak's sessions were deleted (%d sessions "
        "left on the server): leaked blocks, unless the server keeps finished calls' caches "
        "(--prompt-cache-entries > 0: run it with 0 for this check)",
        report.blocks_in_use_at_end, freed->blocks_total(), freed->sessions()));
  }
  if (report.tier_sessions_at_end > 0) {
    report.failures.push_back(absl::StrFormat(
        "the session tiers still hold %d images after the soak's sessions were deleted",
        report.tier_sessions_at_end));
  }
  if (report.session_files_at_end != 0 && !config.session_dir.empty()) {
    report.failures.push_back(
        report.session_files_at_end < 0
            ? absl::StrCat("cannot list ", config.session_dir)
            : absl::StrFormat("%d snapshot files left under %s after the soak's sessions were "
                              "deleted",
                              report.session_files_at_end, config.session_dir));
  }
  if (config.server_pid > 0) {
    // Idle sessions' images in the host tier are memory the server holds on purpose (up to the
    // tier's cap): the most it held at a report comes on top of the bound. Freed, that memory
    // may stay with the allocator rather than go back to the system.
    const int64_t allowed_kb =
        config.max_rss_growth_mb * 1024 + static_cast<int64_t>(report.tier_host_peak / 1024);
    if (report.rss_first_kb < 0 || report.rss_end_kb < 0) {
      report.failures.push_back(absl::StrCat("cannot read VmRSS of pid ", config.server_pid));
    } else if (report.rss_end_kb - report.rss_first_kb > allowed_kb) {
      report.failures.push_back(absl::StrFormat(
          "server RSS grew %.1f MiB (%.1f -> %.1f MiB), more than --max-rss-growth-mb=%d plus "
          "the host tier's peak of %.1f MiB",
          Mib(report.rss_end_kb - report.rss_first_kb), Mib(report.rss_first_kb),
          Mib(report.rss_end_kb), config.max_rss_growth_mb,
          Mib(static_cast<int64_t>(report.tier_host_peak / 1024))));
    }
  }
  if (report.totals.total() < config.min_calls) {
    report.failures.push_back(absl::StrFormat(
        "only %d calls ended in %s, fewer than --min-calls=%d", report.totals.total(),
        absl::FormatDuration(10 * config.duration), config.min_calls));
  }
  if (report.totals.unexpected > 0) {
    report.failures.push_back(absl::StrCat(report.totals.unexpected,
                                           " calls ended with a status their kind does not allow"));
  }
  return report;
}

std::string FormatSoakHeader() {
  return absl::StrFormat(
      "%4s %13s %7s %7s %6s %6s %6s %8s %8s %8s %15s %6s %7s %7s %5s %5s %5s %5s\n", "row",
      "interval_s", "calls", "ok", "cancel", "dline", "other", "p50_ms", "p99_ms", "rss_mb",
      "pool_used", "pool%", "tokens", "conv", "sess", "host", "disk", "files");
}

std::string FormatSoakRow(const SoakRow& r) {
  const uint64_t used = r.blocks_total - r.blocks_free;
  const std::string rss = r.rss_kb >= 0 ? absl::StrFormat("%.1f", Mib(r.rss_kb)) : "-";
  const std::string pool =
      r.blocks_total > 0 ? absl::StrCat(used, "/", r.blocks_total) : std::string("-");
  const std::string pct =
      r.blocks_total > 0 ? absl::StrFormat("%.1f", 100.0 * used / r.blocks_total) : "-";
  const std::string files = r.session_files >= 0 ? absl::StrCat(r.session_files) : "-";
  return absl::StrFormat(
      "%4d %6.0f-%-6.0f %7d %7d %6d %6d %6d %8.1f %8.1f %8s %15s %6s %7d %7d %5d %5d %5d %5s\n",
      r.index, r.start_s, r.end_s, r.counts.total(), r.counts.ok, r.counts.cancelled,
      r.counts.deadline_exceeded, r.counts.unexpected, r.latency.p50_ms, r.latency.p99_ms, rss,
      pool, pct, r.tokens_cached, r.session_tokens, r.sessions, r.tier_host, r.tier_disk, files);
}

std::string FormatSoakSummary(const SoakReport& r, const SoakConfig& config) {
  std::string out;
  const SoakCounts& t = r.totals;
  absl::StrAppendFormat(
      &out, "calls: %d (ok %d, cancelled mid-stream %d, deadline exceeded %d, other %d)\n",
      t.total(), t.ok, t.cancelled, t.deadline_exceeded, t.unexpected);
  for (const std::string& e : r.unexpected_examples)
    absl::StrAppendFormat(&out, "  other: %s\n", e);
  absl::StrAppendFormat(&out,
                        "idle: %s; pool blocks in use after deleting the soak's sessions: %s\n",
                        r.became_idle ? "yes" : "NO",
                        r.blocks_in_use_at_end >= 0 ? absl::StrCat(r.blocks_in_use_at_end) : "?");
  int64_t most_sessions = 0;
  for (const SoakRow& row : r.rows) most_sessions = std::max<int64_t>(most_sessions, row.sessions);
  absl::StrAppendFormat(
      &out,
      "sessions: %d created, at most %d alive at a report; tier images left "
      "after the deletions: %s; snapshot files left: %s\n",
      r.sessions_created, most_sessions,
      r.tier_sessions_at_end >= 0 ? absl::StrCat(r.tier_sessions_at_end) : "?",
      r.session_files_at_end >= 0 ? absl::StrCat(r.session_files_at_end) : "not counted");
  if (config.server_pid > 0 && r.rss_first_kb >= 0 && r.rss_end_kb >= 0) {
    absl::StrAppendFormat(
        &out,
        "rss: %.1f MiB at the first report, %.1f MiB at the end (%+.1f MiB, limit %d + the host "
        "tier's peak %.1f)\n",
        Mib(r.rss_first_kb), Mib(r.rss_end_kb), Mib(r.rss_end_kb - r.rss_first_kb),
        config.max_rss_growth_mb, Mib(static_cast<int64_t>(r.tier_host_peak / 1024)));
  } else if (config.server_pid <= 0) {
    out += "rss: not measured (no --server-pid)\n";
  }
  if (r.passed()) {
    out += "PASS\n";
  } else {
    for (const std::string& f : r.failures) absl::StrAppendFormat(&out, "FAIL: %s\n", f);
  }
  return out;
}

}  // namespace subspace::client
