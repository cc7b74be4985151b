// Prometheus metrics of the server (prefix subspace_, vLLM's semantics where they overlap):
// request counters and latency histograms recorded as requests finish, step histograms from the
// engine's on_step hook, and gauges read from Engine::Stats() when /metrics is scraped.
#ifndef SUBSPACE_SERVER_METRICS_H_
#define SUBSPACE_SERVER_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/engine/engine.h"

namespace subspace::server {

// Effective compression ratio: the bytes the cached tokens would take full-rank at fp16
// (KvCacheStats::bytes_full_fp16_equivalent) over the pool bytes in use (full, compressed and
// outlier pages, partly filled ones whole); 0 when nothing is cached. The fp32 full-rank cache
// reports at most 0.5; the compressed cache passes 1 once enough blocks are compressed.
double CompressionRatio(const KvCacheStats& cache);

class Metrics {
 public:
  Metrics();
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // What an Exposer serves: the registry and the collector of engine gauges.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  std::shared_ptr<prometheus::Collectable> engine_collector() const;

  // Every metric in Prometheus' text format, as the exporter serves it (the HTTP API's
  // /metrics).
  std::string ExpositionText() const;

  // The engine whose Stats() the gauges show (nullptr: none, the gauges are left out). The
  // engine must outlive every scrape, i.e. detach or stop the exposer before destroying it.
  void AttachEngine(const Engine* engine);

  // Engine thread, after every step: two histogram observations.
  void RecordStep(const StepStats& step);
  // A request the engine accepted has finished, with the status the client gets.
  void RecordFinished(const GenerateResult& result, absl::StatusCode code);
  // A request refused before reaching the engine (validation, unknown session, queue full...).
  void RecordRejected(absl::StatusCode code);
  // Session snapshots: written (`reason` "checkpoint" or "drain"), restored at start, moved by
  // the ExportSession / ImportSession RPCs (`direction` "export" or "import").
  void RecordSessionsWritten(const std::string& reason, int64_t sessions, int64_t bytes);
  void RecordSessionsRestored(int64_t restored, int64_t refused);
  void RecordSessionMoved(const std::string& direction);

 private:
  class EngineCollector;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<EngineCollector> collector_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Counter& prompt_tokens_;
  prometheus::Counter& generation_tokens_;
  prometheus::Counter& reused_tokens_;
  prometheus::Histogram& ttft_;
  prometheus::Histogram& inter_token_;
  prometheus::Histogram& request_duration_;
  prometheus::Histogram& queue_time_;
  prometheus::Histogram& prompt_tokens_per_request_;
  prometheus::Histogram& generation_tokens_per_request_;
  prometheus::Histogram& batch_size_;
  prometheus::Histogram& step_duration_;
  prometheus::Family<prometheus::Counter>& sessions_written_;
  prometheus::Family<prometheus::Counter>& snapshot_bytes_;
  prometheus::Family<prometheus::Counter>& sessions_restored_;
  prometheus::Family<prometheus::Counter>& sessions_moved_;
};

// Serves GET /metrics over HTTP on its own threads (civetweb).
class MetricsExporter {
 public:
  // `port` 0 picks a free one. UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(const std::string& host, int port,
                                                                const Metrics& metrics);
  ~MetricsExporter();
  int port() const { return port_; }

 private:
  MetricsExporter(std::unique_ptr<prometheus::Exposer> exposer, int port)
      : exposer_(std::move(exposer)), port_(port) {}
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_;
};

}  // namespace subspace::server

#endif  // SUBSPACE_SERVER_METRICS_H_
