// A bounded soak of a running server: a fixed number of workers for a fixed time, mixing
// multi-turn session generations (unary and streamed), streams cancelled mid-way, one-shot
// streams and calls with short deadlines. Every report interval gives one row -- calls by status,
// latency percentiles, the server's RSS, the KV pool's use -- and at the end the soak deletes its
// sessions, waits for the server to go idle and fails when pool blocks stay in use (a leak) or
// the server's RSS grew past a bound. Run it against a server no other client is using: the
// end-of-run check expects every block of the pool back free.
#ifndef SUBSPACE_CLIENT_SOAK_H_
#define SUBSPACE_CLIENT_SOAK_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/load_generator.h"
#include "client/subspace_client.h"

namespace subspace::client {

struct SoakConfig {
  int32_t concurrency = 8;  // workers, each one call at a time
  absl::Duration duration = absl::Seconds(600);
  absl::Duration report_interval = absl::Seconds(60);
  // > 0: the server's pid, whose VmRSS (/proc/<pid>/status) is reported and bounded; 0: no RSS.
  int64_t server_pid = 0;
  // Allowed VmRSS growth from the first report to the end, in MiB (see soak_main.cc's help).
  int64_t max_rss_growth_mb = 64;
  // How long the end of the run waits for the server to finish its work and free the pool.
  absl::Duration idle_timeout = absl::Seconds(60);
  uint64_t seed = 1;
  LengthRange prompt_tokens{8, 48};  // per call (a session turn's new tokens)
  LengthRange output_tokens{8, 64};
  int32_t max_session_turns = 8;  // then the session is deleted and a new one made
  // Short-deadline calls get a deadline drawn from this range, in milliseconds, and ask for
  // output_tokens.max tokens, so some finish and some run out of time.
  LengthRange short_deadline_ms{5, 200};
  // Sessions each worker keeps, turning among them at random: with more sessions than the pool
  // holds, idle ones go to the server's tiers and come back (docs/sessions.md, "Tiers"), and
  // every turn must still succeed.
  int32_t sessions_per_worker = 1;
  // The load goes on past `duration`, a report interval at a time (up to ten times the
  // duration), until this many calls have ended; fewer by then fails the soak.
  int64_t min_calls = 0;
  // The server's --session-dir, when it has one: each row counts the snapshot files under it
  // (checkpoints and the disk tier's), and the run fails if any stays after the soak deleted
  // its sessions.
  std::string session_dir;
};

// The calls of one report interval, by what they ended with.
struct SoakCounts {
  int64_t ok = 0;
  int64_t cancelled = 0;          // streams the soak cancelled mid-way
  int64_t deadline_exceeded = 0;  // short-deadline calls that ran out of time
  // Any status the call's kind does not allow (e.g. INTERNAL, UNAVAILABLE, FAILED_PRECONDITION).
  int64_t unexpected = 0;
  int64_t total() const { return ok + cancelled + deadline_exceeded + unexpected; }
};

struct SoakRow {
  int32_t index = 0;
  double start_s = 0;  // offsets from the start of the run
  double end_s = 0;
  SoakCounts counts;
  LatencyStats latency;  // end to end, of the calls that ended OK
  int64_t rss_kb = -1;   // -1: not measured
  // GetCacheStats at the end of the interval (blocks_total 0 when the call failed).
  uint64_t blocks_total = 0;
  uint64_t blocks_free = 0;
  uint64_t tokens_cached = 0;
  uint32_t sessions = 0;
  // Tokens of the soak's own sessions' conversations (the server keeps them in the pool, in a
  // tier, or as tokens it prefills again): against tokens_cached, how far past the pool they go.
  int64_t session_tokens = 0;
  // The session tiers (0 without them): sessions whose image each holds; the disk tier's bytes
  // and cap.
  uint32_t tier_host = 0;
  uint32_t tier_disk = 0;
  uint64_t tier_host_bytes = 0;
  uint64_t tier_disk_bytes = 0;
  uint64_t tier_disk_capacity = 0;
  int64_t session_files = -1;  // snapshot files under SoakConfig::session_dir; -1: not counted
};

struct SoakReport {
  std::vector<SoakRow> rows;
  SoakCounts totals;
  std::vector<std::string> unexpected_examples;  // a few distinct "kind: CODE: message"
  bool became_idle = false;           // nothing running or queued before the end deadline
  int64_t blocks_in_use_at_end = -1;  // after the soak's sessions were deleted; 0 = no leak
  int64_t rss_first_kb = -1;          // at the first report
  int64_t rss_end_kb = -1;            // after the server went idle
  uint64_t tier_host_peak = 0;        // the host tier's most bytes at a report: RSS may grow
                                      //   by them on top of the bound
  int64_t tier_sessions_at_end = -1;  // images the tiers still hold after the deletions
  int64_t session_files_at_end = -1;  // snapshot files left under session_dir; -1: not counted
  int64_t sessions_created = 0;       // by the workers, over the run
  std::vector<std::string> failures;  // empty: the soak passed
  bool passed() const { return failures.empty(); }
};

// Runs the soak on `channel` with `options` (server name, credentials; its timeout is replaced
// per call). `on_text` receives the table header and each row as soon as it is measured.
// Errors only when the server cannot be asked for its model (the soak cannot start); everything
// found during the run is in the report.
absl::StatusOr<SoakReport> RunSoak(const std::shared_ptr<grpc::Channel>& channel,
                                   const ClientOptions& options, const SoakConfig& config,
                                   const std::function<void(const std::string&)>& on_text);

std::string FormatSoakHeader();
std::string FormatSoakRow(const SoakRow& row);
// The end-of-run lines: totals, the idle pool and RSS checks, PASS or FAIL with the reasons.
std::string FormatSoakSummary(const SoakReport& report, const SoakConfig& config);

// VmRSS of process `pid` in KiB, from /proc/<pid>/status.
absl::StatusOr<int64_t> ReadVmRssKb(int64_t pid);

}  // namespace subspace::client

#endif  // SUBSPACE_CLIENT_SOAK_H_
