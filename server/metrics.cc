// Metric families, the scrape-time engine collector and the HTTP exporter.
#include "server/metrics.h"

#include <prometheus/client_metric.h>
#include <prometheus/collectable.h>
#include <prometheus/gauge.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <exception>
#include <iterator>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/net_util.h"

namespace subspace::server {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildHistogram;
using prometheus::ClientMetric;
using prometheus::Histogram;
using prometheus::MetricFamily;
using prometheus::MetricType;

// Latency buckets follow vLLM's, extended downwards because a small model on a CPU answers in
// milliseconds.
const Histogram::BucketBoundaries& LatencyBuckets() {
  static const Histogram::BucketBoundaries kBuckets = {
      0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,
      0.75,  1.0,    2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 320.0};
  return kBuckets;
}

const Histogram::BucketBoundaries& InterTokenBuckets() {
  static const Histogram::BucketBoundaries kBuckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15,
      0.2,    0.3,   0.4,    0.5,   0.75, 1.0,   2.5,  5.0,   10.0};
  return kBuckets;
}

const Histogram::BucketBoundaries& StepBuckets() {
  static const Histogram::BucketBoundaries kBuckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
  return kBuckets;
}

// Powers of two: tokens per request or per step.
Histogram::BucketBoundaries TokenBuckets(double max) {
  Histogram::BucketBoundaries b;
  for (double v = 1; v <= max; v *= 2) b.push_back(v);
  return b;
}

MetricFamily Family(std::string name, std::string help, MetricType type) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

ClientMetric Gauge(double value, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  return m;
}

}  // namespace

double CompressionRatio(const KvCacheStats& cache) {
  const double used = static_cast<double>(cache.bytes_used_full + cache.bytes_used_compressed +
                                          cache.bytes_used_outlier);
  if (cache.tokens_cached == 0 || used <= 0) return 0.0;
  return static_cast<double>(cache.bytes_full_fp16_equivalent) / used;
}

// Basis epochs and the online refresh (zero with the full cache or static bases).
template <typename GaugeFn, typename CounterFn>
void AddRefreshFamilies(const KvCacheStats& c, GaugeFn gauge, CounterFn counter,
                        std::vector<MetricFamily>& out) {
  const BasisRefreshStats& r = c.refresh;
  gauge("subspace_basis_epochs_live", "Basis epochs registered in the compressed KV cache.",
        static_cast<double>(c.epochs_live));
  gauge("subspace_basis_refresh_sessions", "Sessions whose bases the refresher is tracking.",
        static_cast<double>(r.streams));
  counter("subspace_basis_refreshes_total", "New basis epochs computed by the online refresh.",
          static_cast<double>(r.refreshes));
  counter("subspace_basis_refresh_failures_total",
          "Online refreshes that produced no epoch (non-finite statistics); the old epoch stays.",
          static_cast<double>(r.failures));
  counter("subspace_basis_epochs_installed_total",
          "Refreshed epochs a session switched to (refreshes of sessions that ended are not).",
          static_cast<double>(r.installed));
  counter("subspace_basis_refresh_observations_dropped_total",
          "Compressed blocks the refresher never saw because it was behind (its queue was full).",
          static_cast<double>(r.observations_dropped));
  counter("subspace_basis_blocks_reprojected_total",
          "Block-heads the compactor re-projected into a newer epoch (to cap live epochs).",
          static_cast<double>(r.blocks_reprojected));
  out.push_back(Family("subspace_basis_refresh_duration_seconds",
                       "Time to compute one refreshed basis epoch (refresher thread).",
                       MetricType::Histogram));
  ClientMetric h;
  uint64_t cumulative = 0;
  for (size_t i = 0; i < BasisRefreshStats::kLatencyBounds.size(); ++i) {
    cumulative += static_cast<uint64_t>(r.latency_counts[i]);
    h.histogram.bucket.push_back({cumulative, BasisRefreshStats::kLatencyBounds[i]});
  }
  cumulative += static_cast<uint64_t>(r.latency_counts.back());
  h.histogram.bucket.push_back({cumulative, std::numeric_limits<double>::infinity()});
  h.histogram.sample_count = cumulative;
  h.histogram.sample_sum = r.latency_seconds_sum;
  out.back().metric.push_back(std::move(h));
}

// The session tiers (core/engine/session_tiers.h): what each holds, what moved.
template <typename Counter>
void AddTierFamilies(const EngineStats& s, const Counter& counter, std::vector<MetricFamily>& out) {
  const SessionTierStats& t = s.tiers;
  const auto by_tier = [&out](const char* name, const char* help, MetricType type, double host,
                              double disk) {
    out.push_back(Family(name, help, type));
    for (const auto& [tier, value] : {std::pair{"host", host}, std::pair{"disk", disk}}) {
      ClientMetric m;
      m.label.push_back({"tier", tier});
      if (type == MetricType::Gauge) {
        m.gauge.value = value;
      } else {
        m.counter.value = value;
      }
      out.back().metric.push_back(std::move(m));
    }
  };
  by_tier("subspace_session_tier_sessions",
          "Idle sessions whose KV cache a tier holds (given up by the pool for room).",
          MetricType::Gauge, static_cast<double>(t.host_sessions),
          static_cast<double>(t.disk_sessions));
  by_tier("subspace_session_tier_bytes",
          "Bytes a tier holds: images in host memory (those being written to disk included), "
          "files on disk.",
          MetricType::Gauge, static_cast<double>(t.host_bytes), static_cast<double>(t.disk_bytes));
  by_tier("subspace_session_tier_restored_total",
          "Session caches a tier gave back to the pool for a call on the session.",
          MetricType::Counter, static_cast<double>(t.restored_host_total),
          static_cast<double>(t.restored_disk_total));
  by_tier("subspace_session_tier_tokens",
          "Cached tokens of the images a tier holds (bytes over tokens: what a token costs there).",
          MetricType::Gauge, static_cast<double>(t.host_tokens),
          static_cast<double>(t.disk_tokens));
  out.push_back(Family("subspace_session_tier_restore_seconds",
                       "Time to bring a session's cache back from a tier: the tier's read and the "
                       "import into the pool.",
                       MetricType::Histogram));
  for (const auto& [tier, latency] :
       {std::pair{"host", &t.restore_host}, std::pair{"disk", &t.restore_disk}}) {
    ClientMetric h;
    h.label.push_back({"tier", tier});
    uint64_t cumulative = 0;
    for (size_t i = 0; i < TierRestoreLatency::kBounds.size(); ++i) {
      cumulative += static_cast<uint64_t>(latency->counts[i]);
      h.histogram.bucket.push_back({cumulative, TierRestoreLatency::kBounds[i]});
    }
    cumulative += static_cast<uint64_t>(latency->counts.back());
    h.histogram.bucket.push_back({cumulative, std::numeric_limits<double>::infinity()});
    h.histogram.sample_count = cumulative;
    h.histogram.sample_sum = latency->sum_seconds;
    out.back().metric.push_back(std::move(h));
  }
  counter("subspace_session_tier_stored_total",
          "Idle session caches moved out of the pool into the tiers.",
          static_cast<double>(t.stored_total));
  counter("subspace_session_tier_spilled_total",
          "Session caches moved from the host tier to the disk tier.",
          static_cast<double>(t.spilled_total));
  counter("subspace_session_tier_dropped_total",
          "Session caches given up because every tier was full (their next call recomputes).",
          static_cast<double>(t.dropped_total));
  counter("subspace_session_tier_errors_total",
          "Disk tier writes or reads that failed (those caches are recomputed).",
          static_cast<double>(t.errors_total));
  counter("subspace_session_tier_restores_failed_total",
          "Calls on a tiered session whose cache did not come back (dropped, a disk error, no "
          "room): they prefilled the conversation again.",
          static_cast<double>(s.tier_restores_failed_total));
}

// Reads Engine::Stats() once per scrape, so gauges are exact at scrape time and nothing runs
// between scrapes.
class Metrics::EngineCollector : public prometheus::Collectable {
 public:
  void Attach(const Engine* engine) { engine_.store(engine, std::memory_order_release); }

  std::vector<MetricFamily> Collect() const override {
    const Engine* engine = engine_.load(std::memory_order_acquire);
    if (engine == nullptr) return {};
    const EngineStats s = engine->Stats();
    const KvCacheStats& c = s.cache;
    std::vector<MetricFamily> out;
    const auto gauge = [&out](const char* name, const char* help, double value) {
      out.push_back(Family(name, help, MetricType::Gauge));
      out.back().metric.push_back(Gauge(value));
    };
    const auto counter = [&out](const char* name, const char* help, double value) {
      out.push_back(Family(name, help, MetricType::Counter));
      ClientMetric m;
      m.counter.value = value;
      out.back().metric.push_back(std::move(m));
    };
    gauge("subspace_requests_running", "Requests admitted to the batch (prefilling or decoding).",
          s.running);
    gauge("subspace_requests_waiting", "Requests queued for admission.", s.waiting);
    gauge("subspace_sessions_active", "Sessions alive (busy or idle).", s.sessions);
    gauge("subspace_prompt_cache_entries",
          "Finished stateless requests whose caches are kept for a later request that starts "
          "the same way (--prompt-cache-entries).",
          s.prompt_cache_entries);
    counter("subspace_prompt_cache_hits_total",
            "Stateless requests that took over a kept cache and prefilled only the rest.",
            static_cast<double>(s.prompt_cache_hits_total));
    gauge("subspace_kv_pool_capacity_bytes", "KV cache pool size, allocated at start-up.",
          static_cast<double>(c.bytes_total));
    out.push_back(Family("subspace_kv_pool_used_bytes",
                         "KV cache pool bytes in use, by kind of block.", MetricType::Gauge));
    out.back().metric.push_back(Gauge(static_cast<double>(c.bytes_used_full), {{"kind", "full"}}));
    out.back().metric.push_back(
        Gauge(static_cast<double>(c.bytes_used_compressed), {{"kind", "compressed"}}));
    out.back().metric.push_back(
        Gauge(static_cast<double>(c.bytes_used_outlier), {{"kind", "outlier"}}));
    gauge("subspace_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0 to 1).",
          c.blocks_total > 0 ? static_cast<double>(c.blocks_total - c.blocks_free) / c.blocks_total
                             : 0.0);
    gauge("subspace_kv_cached_tokens", "Tokens whose keys and values the cache holds.",
          static_cast<double>(c.tokens_cached));
    gauge("subspace_kv_compression_ratio",
          "Full-rank fp16 bytes of the cached tokens over the KV pool bytes in use (0 when "
          "empty; at most 0.5 for the fp32 full cache, above 1 when compression pays).",
          CompressionRatio(c));
    counter("subspace_preemptions_total",
            "Requests preempted for lack of cache blocks (recomputed later).",
            static_cast<double>(s.preemptions_total));
    counter("subspace_engine_steps_total", "Scheduler steps run.",
            static_cast<double>(s.steps_total));
    AddTierFamilies(s, counter, out);
    AddRefreshFamilies(c, gauge, counter, out);
    return out;
  }

 private:
  std::atomic<const Engine*> engine_{nullptr};
};

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      collector_(std::make_shared<EngineCollector>()),
      requests_(BuildCounter()
                    .Name("subspace_requests_total")
                    .Help("Generate requests finished, by gRPC status and finish reason.")
                    .Register(*registry_)),
      prompt_tokens_(BuildCounter()
                         .Name("subspace_prompt_tokens_total")
                         .Help("Prompt tokens of finished requests (reused ones included).")
                         .Register(*registry_)
                         .Add({})),
      generation_tokens_(BuildCounter()
                             .Name("subspace_generation_tokens_total")
                             .Help("Tokens generated.")
                             .Register(*registry_)
                             .Add({})),
      reused_tokens_(BuildCounter()
                         .Name("subspace_reused_tokens_total")
                         .Help("Session tokens whose KV cache was reused instead of recomputed.")
                         .Register(*registry_)
                         .Add({})),
      ttft_(BuildHistogram()
                .Name("subspace_time_to_first_token_seconds")
                .Help("Time from acceptance to the first generated token.")
                .Register(*registry_)
                .Add({}, LatencyBuckets())),
      inter_token_(BuildHistogram()
                       .Name("subspace_inter_token_latency_seconds")
                       .Help("Time between consecutive generated tokens of a request.")
                       .Register(*registry_)
                       .Add({}, InterTokenBuckets())),
      request_duration_(BuildHistogram()
                            .Name("subspace_request_duration_seconds")
                            .Help("End-to-end time from acceptance to the last token.")
                            .Register(*registry_)
                            .Add({}, LatencyBuckets())),
      queue_time_(BuildHistogram()
                      .Name("subspace_request_queue_seconds")
                      .Help("Time from acceptance to the first scheduled step.")
                      .Register(*registry_)
                      .Add({}, LatencyBuckets())),
      prompt_tokens_per_request_(BuildHistogram()
                                     .Name("subspace_request_prompt_tokens")
                                     .Help("Prompt tokens per finished request.")
                                     .Register(*registry_)
                                     .Add({}, TokenBuckets(1 << 17))),
      generation_tokens_per_request_(BuildHistogram()
                                         .Name("subspace_request_generation_tokens")
                                         .Help("Generated tokens per finished request.")
                                         .Register(*registry_)
                                         .Add({}, TokenBuckets(1 << 17))),
      batch_size_(BuildHistogram()
                      .Name("subspace_batch_size")
                      .Help("Tokens per scheduler step (decodes plus prefill chunks).")
                      .Register(*registry_)
                      .Add({}, TokenBuckets(1 << 14))),
      step_duration_(BuildHistogram()
                         .Name("subspace_step_duration_seconds")
                         .Help("Wall time of one scheduler step (forward and sampling).")
                         .Register(*registry_)
                         .Add({}, StepBuckets())),
      sessions_written_(BuildCounter()
                            .Name("subspace_sessions_written_total")
                            .Help("Session snapshots written to --session-dir, by reason "
                                  "(checkpoint, drain).")
                            .Register(*registry_)),
      snapshot_bytes_(BuildCounter()
                          .Name("subspace_session_snapshot_bytes_total")
                          .Help("Bytes of the session snapshots written, by reason.")
                          .Register(*registry_)),
      sessions_restored_(BuildCounter()
                             .Name("subspace_sessions_restored_total")
                             .Help("Session snapshots read at start, by result (restored, "
                                   "refused).")
                             .Register(*registry_)),
      sessions_moved_(BuildCounter()
                          .Name("subspace_sessions_moved_total")
                          .Help("Sessions moved by ExportSession / ImportSession, by direction.")
                          .Register(*registry_)) {
  // Zero from the start, so a dashboard's rate() has a series before the first event.
  for (const char* reason : {"checkpoint", "drain"}) {
    sessions_written_.Add({{"reason", reason}});
    snapshot_bytes_.Add({{"reason", reason}});
  }
  for (const char* result : {"restored", "refused"}) sessions_restored_.Add({{"result", result}});
  for (const char* direction : {"export", "import"}) {
    sessions_moved_.Add({{"direction", direction}});
  }
}

Metrics::~Metrics() = default;

std::shared_ptr<prometheus::Collectable> Metrics::engine_collector() const { return collector_; }

void Metrics::AttachEngine(const Engine* engine) { collector_->Attach(engine); }

std::string Metrics::ExpositionText() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<prometheus::MetricFamily> engine = collector_->Collect();
  families.insert(families.end(), std::make_move_iterator(engine.begin()),
                  std::make_move_iterator(engine.end()));
  return prometheus::TextSerializer().Serialize(families);
}

void Metrics::RecordStep(const StepStats& step) {
  batch_size_.Observe(step.decode_tokens + step.prefill_tokens);
  step_duration_.Observe(step.seconds);
}

void Metrics::RecordFinished(const GenerateResult& result, absl::StatusCode code) {
  requests_
      .Add({{"status", absl::StatusCodeToString(code)},
            {"finish_reason", FinishReasonName(result.finish)}})
      .Increment();
  const GenerateUsage& u = result.usage;
  prompt_tokens_.Increment(static_cast<double>(u.prompt_tokens));
  generation_tokens_.Increment(static_cast<double>(u.generated_tokens));
  reused_tokens_.Increment(static_cast<double>(u.reused_tokens));
  prompt_tokens_per_request_.Observe(static_cast<double>(u.prompt_tokens));
  generation_tokens_per_request_.Observe(static_cast<double>(u.generated_tokens));
  const GenerateTimings& t = result.timings;
  if (u.generated_tokens > 0) ttft_.Observe(t.ttft_seconds);
  for (float gap : t.inter_token_seconds) inter_token_.Observe(gap);
  request_duration_.Observe(t.total_seconds);
  queue_time_.Observe(t.queue_seconds);
}

void Metrics::RecordRejected(absl::StatusCode code) {
  requests_.Add({{"status", absl::StatusCodeToString(code)}, {"finish_reason", "none"}})
      .Increment();
}

void Metrics::RecordSessionsWritten(const std::string& reason, int64_t sessions, int64_t bytes) {
  sessions_written_.Add({{"reason", reason}}).Increment(static_cast<double>(sessions));
  snapshot_bytes_.Add({{"reason", reason}}).Increment(static_cast<double>(bytes));
}

void Metrics::RecordSessionsRestored(int64_t restored, int64_t refused) {
  sessions_restored_.Add({{"result", "restored"}}).Increment(static_cast<double>(restored));
  sessions_restored_.Add({{"result", "refused"}}).Increment(static_cast<double>(refused));
}

void Metrics::RecordSessionMoved(const std::string& direction) {
  sessions_moved_.Add({{"direction", direction}}).Increment();
}

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(const std::string& host,
                                                                        int port,
                                                                        const Metrics& metrics) {
  const std::string address = JoinHostPort(host, port);
  std::unique_ptr<prometheus::Exposer> exposer;
  // civetweb reports a failed bind by throwing; exceptions stop at this boundary.
  try {
    exposer = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  exposer->RegisterCollectable(metrics.registry());
  exposer->RegisterCollectable(metrics.engine_collector());
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics server on ", address, " reports no listening port"));
  }
  return std::unique_ptr<MetricsExporter>(new MetricsExporter(std::move(exposer), ports[0]));
}

MetricsExporter::~MetricsExporter() = default;

}  // namespace subspace::server
