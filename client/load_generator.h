// A serving benchmark in the manner of vLLM's benchmark_serving: N streaming requests at a
// bounded concurrency and an optional Poisson arrival rate, with seeded prompt and output
// lengths, reporting throughput and TTFT / TPOT / ITL / end-to-end latency percentiles.
#ifndef SUBSPACE_CLIENT_LOAD_GENERATOR_H_
#define SUBSPACE_CLIENT_LOAD_GENERATOR_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/subspace_client.h"

namespace subspace::client {

// A length drawn uniformly from [min, max], both inclusive; min == max for a fixed length.
struct LengthRange {
  int32_t min = 0;
  int32_t max = 0;
};

// Parses "64" or "32:128" (min:max, min >= 1, min <= max).
absl::StatusOr<LengthRange> ParseLengthRange(const std::string& text);

enum class PromptKind {
  kTokens,  // random token ids from the vocabulary, special ids (< kFirstOrdinaryToken) avoided
  kText,    // random words; the prompt's token count is whatever the tokenizer makes of them
};

struct BenchConfig {
  int32_t num_requests = 100;
  int32_t concurrency = 16;  // requests in flight at most, one thread each
  // Mean arrivals per second of a Poisson process; infinity sends every request at once (still
  // bounded by `concurrency`).
  double request_rate = std::numeric_limits<double>::infinity();
  LengthRange prompt_tokens{64, 64};
  LengthRange output_tokens{64, 64};
  PromptKind prompt_kind = PromptKind::kTokens;
  uint64_t seed = 0;  // lengths, prompts, arrival times and per-request sampling seeds
  float temperature = 0.0f;
  // Generate past EOS so every request produces exactly its drawn output length.
  bool ignore_eos = true;
};

// Token ids below this are <unk>, <s>, </s> in Llama-style vocabularies.
inline constexpr int32_t kFirstOrdinaryToken = 3;

// One request's measurements; times in seconds.
struct RequestResult {
  bool ok = false;
  std::string error;          // "CODE: message" when !ok
  int32_t prompt_tokens = 0;  // as the server counted them (planned count if it failed)
  int32_t output_tokens = 0;
  double ttft = 0;          // send -> first chunk
  double latency = 0;       // send -> final message
  std::vector<double> itl;  // gaps between consecutive chunks
};

// mean and percentiles (numpy-style linear interpolation) in milliseconds.
struct LatencyStats {
  double mean_ms = 0;
  double p50_ms = 0;
  double p90_ms = 0;
  double p99_ms = 0;
  double max_ms = 0;
};

LatencyStats SummarizeSeconds(std::vector<double> seconds);

struct BenchReport {
  BenchConfig config;
  std::string server;
  std::string model;
  int32_t successful = 0;
  int32_t failed = 0;
  double duration_s = 0;
  int64_t total_input_tokens = 0;
  int64_t total_output_tokens = 0;
  double request_throughput = 0;      // successful requests / s
  double output_throughput = 0;       // output tokens / s
  double total_token_throughput = 0;  // (input + output) tokens / s
  LatencyStats ttft;
  LatencyStats tpot;  // (latency - ttft) / (output_tokens - 1), requests with >1 output token
  LatencyStats itl;
  LatencyStats e2e;
  std::vector<RequestResult> requests;  // in request order
};

// Runs the benchmark. Errors only for setup problems (bad config, GetModelInfo failing, lengths
// that cannot fit the context); failed requests are counted in the report.
absl::StatusOr<BenchReport> RunBench(SubspaceClient& client, const BenchConfig& config);

// The human-readable summary table.
std::string FormatReportTable(const BenchReport& report);
// Every number of the report, per-request measurements included, as a JSON object.
std::string ReportToJson(const BenchReport& report);

}  // namespace subspace::client

#endif  // SUBSPACE_CLIENT_LOAD_GENERATOR_H_
