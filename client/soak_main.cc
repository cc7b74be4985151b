// subspace-soak: runs a bounded soak (client/soak.h) against a running server and exits 0 when
// it passed, 1 when it found a leak, RSS growth past the bound or calls that ended wrongly, 2 for
// bad flags or a server it cannot reach.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/flags.h"
#include "client/load_generator.h"
#include "client/soak.h"
#include "client/subspace_client.h"

ABSL_FLAG(std::string, server, "localhost:50051", "server address, host:port");
ABSL_FLAG(int32_t, concurrency, 8, "workers, each with one call in flight");
ABSL_FLAG(double, duration_seconds, 600, "how long the load runs");
ABSL_FLAG(double, report_seconds, 60, "one table row per this many seconds");
ABSL_FLAG(int64_t, server_pid, 0,
          "pid of the server (on this machine) whose VmRSS is reported and bounded; 0 = no RSS");
ABSL_FLAG(int64_t, max_rss_growth_mb, 64,
          "fail when the server's VmRSS grows more than this many MiB from the first report to "
          "the end (read once the server is idle again). By the first report a whole interval "
          "of load has brought malloc arenas, gRPC buffers and thread stacks to their working "
          "size; what may still grow is a new high-water mark of KV pool pages in use (the pool "
          "is allocated at start and touched on first use: 8 KiB a page on the default model, "
          "under 500 pages for this load), a few MiB. A 10-minute soak of the default model "
          "grew 1.9 MiB. 64 MiB leaves room for larger models' pages and allocator noise and "
          "still catches a leak of 10 KiB per call over a 10-minute run's ~6,000 calls");
ABSL_FLAG(double, idle_timeout_seconds, 60,
          "at the end, how long to wait for the server to finish its work and free the pool");
ABSL_FLAG(uint64_t, seed, 1, "seed of the operation mix, prompts and sampling");
ABSL_FLAG(std::string, prompt_tokens, "8:48",
          "tokens per call's prompt (a session turn's new tokens), N or MIN:MAX");
ABSL_FLAG(std::string, output_tokens, "8:64", "tokens generated per call, N or MIN:MAX");
ABSL_FLAG(double, wait_seconds, 30, "wait this long for the server to report SERVING first");
ABSL_FLAG(int32_t, sessions_per_worker, 1,
          "sessions each worker keeps, turning among them at random: more than the pool holds "
          "sends idle ones to the server's session tiers and back, and every turn must still "
          "succeed");
ABSL_FLAG(int64_t, min_calls, 0,
          "keep the load on past --duration-seconds, a report interval at a time (up to ten times "
          "the duration), until this many calls have ended; fewer fails the soak (a loaded "
          "machine otherwise serves too few calls for the state a soak is meant to reach)");
ABSL_FLAG(std::string, session_dir, "",
          "the server's --session-dir (on this machine): each row counts its snapshot files, and "
          "the soak fails if any stays after its sessions are deleted");

namespace {

constexpr char kUsage[] = R"(subspace-soak [--server host:port] [--concurrency 8]
    [--duration-seconds 600] [--report-seconds 60] [--server-pid PID] [--max-rss-growth-mb 64]
    [--sessions-per-worker 1] [--session-dir DIR] [--min-calls 0]

Runs a fixed-concurrency mix against a running server -- multi-turn session generations (unary
and streamed), streams cancelled mid-way, one-shot streams, calls with 5-200 ms deadlines --
and prints one row per report interval: calls by status, p50/p99 latency of the calls that
ended OK, server RSS (with --server-pid), KV pool blocks in use, tokens cached, sessions, the
sessions whose cache the host and disk tiers hold, and snapshot files (with --session-dir).
At the end it waits for the server to go idle, deletes its sessions and exits 1 if any pool
block is still in use, a tier still holds an image or a snapshot file stays, the disk tier
went over its cap, the RSS grew past --max-rss-growth-mb plus the most the host tier held, or a call
ended with a status its kind does not allow. Use a server no other client is using, started with
--prompt-cache-entries 0 (it otherwise keeps finished calls' caches on purpose).)";

int Fail(const std::string& message) {
  std::fprintf(stderr, "subspace-soak: %s\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  subspace::cli::ParseFlags(argc, argv, kUsage);
  using namespace subspace::client;

  SoakConfig config;
  config.concurrency = absl::GetFlag(FLAGS_concurrency);
  config.duration = absl::Seconds(absl::GetFlag(FLAGS_duration_seconds));
  config.report_interval = absl::Seconds(absl::GetFlag(FLAGS_report_seconds));
  config.server_pid = absl::GetFlag(FLAGS_server_pid);
  config.max_rss_growth_mb = absl::GetFlag(FLAGS_max_rss_growth_mb);
  config.idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_idle_timeout_seconds));
  config.seed = absl::GetFlag(FLAGS_seed);
  config.sessions_per_worker = absl::GetFlag(FLAGS_sessions_per_worker);
  config.session_dir = absl::GetFlag(FLAGS_session_dir);
  config.min_calls = absl::GetFlag(FLAGS_min_calls);
  absl::StatusOr<LengthRange> prompt = ParseLengthRange(absl::GetFlag(FLAGS_prompt_tokens));
  if (!prompt.ok()) return Fail(std::string(prompt.status().message()));
  absl::StatusOr<LengthRange> output = ParseLengthRange(absl::GetFlag(FLAGS_output_tokens));
  if (!output.ok()) return Fail(std::string(output.status().message()));
  config.prompt_tokens = *prompt;
  config.output_tokens = *output;
  if (config.max_rss_growth_mb < 0) return Fail("--max-rss-growth-mb must be >= 0");
  if (config.server_pid > 0) {
    if (absl::StatusOr<int64_t> rss = ReadVmRssKb(config.server_pid); !rss.ok()) {
      return Fail(std::string(rss.status().message()));
    }
  }

  ClientOptions options;
  options.server = absl::GetFlag(FLAGS_server);
  options.timeout = absl::Seconds(10);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(options.server, grpc::InsecureChannelCredentials());
  {
    SubspaceClient probe(channel, options);
    const absl::Time deadline = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_wait_seconds));
    absl::StatusOr<ServingStatus> health = probe.Health();
    while (!(health.ok() && *health == health_v1::HealthCheckResponse::SERVING) &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(200));
      health = probe.Health();
    }
    if (!health.ok() || *health != health_v1::HealthCheckResponse::SERVING) {
      return Fail("the server at " + options.server + " is not SERVING");
    }
  }
  std::printf(
      "subspace-soak: %s, concurrency %d x %d sessions, %.0f s, a row every %.0f s, seed %llu\n",
      options.server.c_str(), config.concurrency, config.sessions_per_worker,
      absl::ToDoubleSeconds(config.duration), absl::ToDoubleSeconds(config.report_interval),
      static_cast<unsigned long long>(config.seed));
  absl::StatusOr<SoakReport> report =
      RunSoak(channel, options, config, [](const std::string& text) {
        std::fputs(text.c_str(), stdout);
        std::fflush(stdout);
      });
  if (!report.ok()) return Fail(report.status().ToString());
  std::fputs(FormatSoakSummary(*report, config).c_str(), stdout);
  return report->passed() ? 0 : 1;
}
