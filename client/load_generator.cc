// The bench: plans every request up front from one seeded generator (so lengths, prompts and
// arrival times do not depend on thread timing), then runs them on `concurrency` threads, each
// a blocking stream, and summarizes the client-side timings.
#include "client/load_generator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace subspace::client {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Our own draws instead of std:: distributions, whose algorithms differ between standard
// libraries: the same seed gives the same workload with any toolchain.
class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  // Uniform in [lo, hi]; the modulo bias is negligible for the small ranges used here.
  int32_t Int(int32_t lo, int32_t hi) {
    return lo + static_cast<int32_t>(engine_() % static_cast<uint64_t>(hi - lo + 1));
  }
  double Unit() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }  // [0, 1)
  double Exponential(double rate) { return -std::log1p(-Unit()) / rate; }

 private:
  std::mt19937_64 engine_;  // its output sequence is fixed by the standard
};

constexpr const char* kWords[] = {
    "the",    "of",     "and",   "to",     "in",     "is",      "that",   "for",
    "it",     "as",     "was",   "with",   "be",     "by",      "on",     "not",
    "he",     "this",   "are",   "or",     "his",    "from",    "at",     "which",
    "but",    "have",   "an",    "had",    "they",   "you",     "were",   "their",
    "one",    "all",    "we",    "can",    "her",    "has",     "there",  "been",
    "if",     "more",   "when",  "will",   "would",  "who",     "so",     "no",
    "river",  "market", "light", "stone",  "winter", "garden",  "signal", "engine",
    "forest", "number", "paper", "silver", "window", "harbour", "letter", "moment",
};

struct PlannedRequest {
  v1::GenerateRequest request;
  int32_t prompt_tokens = 0;  // planned; text prompts count words
  double arrival_s = 0;       // offset from the start of the run
};

absl::Status ValidateConfig(const BenchConfig& config) {
  if (config.num_requests < 1) return absl::InvalidArgumentError("--num-requests must be >= 1");
  if (config.concurrency < 1) return absl::InvalidArgumentError("--concurrency must be >= 1");
  if (!(config.request_rate > 0)) {
    return absl::InvalidArgumentError("--request-rate must be > 0 (inf for no pacing)");
  }
  for (const LengthRange* r : {&config.prompt_tokens, &config.output_tokens}) {
    if (r->min < 1 || r->min > r->max) {
      return absl::InvalidArgumentError(absl::StrCat("bad length range ", r->min, ":", r->max));
    }
  }
  return absl::OkStatus();
}

std::vector<PlannedRequest> Plan(const BenchConfig& config, int32_t vocab_size) {
  Rng rng(config.seed);
  // Arrival times draw from their own stream, so changing --request-rate keeps the workload.
  Rng arrivals(config.seed ^ 0x9e3779b97f4a7c15ull);
  std::vector<PlannedRequest> plan(config.num_requests);
  double arrival = 0;
  for (int32_t i = 0; i < config.num_requests; ++i) {
    PlannedRequest& p = plan[i];
    p.prompt_tokens = rng.Int(config.prompt_tokens.min, config.prompt_tokens.max);
    const int32_t output_tokens = rng.Int(config.output_tokens.min, config.output_tokens.max);
    if (config.prompt_kind == PromptKind::kTokens) {
      v1::TokenIds* ids = p.request.mutable_tokens();
      for (int32_t t = 0; t < p.prompt_tokens; ++t) {
        ids->add_ids(rng.Int(kFirstOrdinaryToken, vocab_size - 1));
      }
    } else {
      std::string text;
      for (int32_t t = 0; t < p.prompt_tokens; ++t) {
        if (t > 0) text += ' ';
        text += kWords[rng.Int(0, static_cast<int32_t>(std::size(kWords)) - 1)];
      }
      p.request.set_text(std::move(text));
    }
    v1::SamplingParams* sampling = p.request.mutable_sampling();
    sampling->set_max_new_tokens(output_tokens);
    sampling->set_ignore_eos(config.ignore_eos);
    sampling->set_temperature(config.temperature);
    sampling->set_seed(config.seed + i);
    p.request.set_request_id(absl::StrCat("bench-", i));
    if (std::isfinite(config.request_rate)) arrival += arrivals.Exponential(config.request_rate);
    p.arrival_s = arrival;
  }
  return plan;
}

RequestResult RunOne(SubspaceClient& client, const PlannedRequest& planned) {
  RequestResult result;
  result.prompt_tokens = planned.prompt_tokens;
  const Clock::time_point start = Clock::now();
  Clock::time_point last = start;
  bool first = true;
  absl::StatusOr<StreamResult> stream =
      client.Stream(planned.request, [&](const v1::GenerateStreamResponse&) {
        const Clock::time_point now = Clock::now();
        if (first) {
          result.ttft = SecondsBetween(start, now);
          first = false;
        } else {
          result.itl.push_back(SecondsBetween(last, now));
        }
        last = now;
        return true;
      });
  result.latency = SecondsBetween(start, Clock::now());
  if (!stream.ok()) {
    result.error = stream.status().ToString();
    return result;
  }
  if (first) result.ttft = result.latency;  // no chunk: nothing was generated
  result.ok = true;
  result.prompt_tokens = static_cast<int32_t>(stream->final.usage().prompt_tokens());
  result.output_tokens = static_cast<int32_t>(stream->final.usage().generated_tokens());
  return result;
}

void Summarize(BenchReport& report) {
  std::vector<double> ttft, tpot, itl, e2e;
  for (const RequestResult& r : report.requests) {
    if (!r.ok) {
      ++report.failed;
      continue;
    }
    ++report.successful;
    report.total_input_tokens += r.prompt_tokens;
    report.total_output_tokens += r.output_tokens;
    ttft.push_back(r.ttft);
    e2e.push_back(r.latency);
    if (r.output_tokens > 1) tpot.push_back((r.latency - r.ttft) / (r.output_tokens - 1));
    itl.insert(itl.end(), r.itl.begin(), r.itl.end());
  }
  const double d = report.duration_s > 0 ? report.duration_s : 1e-9;
  report.request_throughput = report.successful / d;
  report.output_throughput = report.total_output_tokens / d;
  report.total_token_throughput = (report.total_input_tokens + report.total_output_tokens) / d;
  report.ttft = SummarizeSeconds(std::move(ttft));
  report.tpot = SummarizeSeconds(std::move(tpot));
  report.itl = SummarizeSeconds(std::move(itl));
  report.e2e = SummarizeSeconds(std::move(e2e));
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string JsonNumber(double v) { return std::isfinite(v) ? absl::StrFormat("%.9g", v) : "null"; }

std::string JsonStats(const LatencyStats& s) {
  return absl::StrFormat(R"({"mean": %s, "p50": %s, "p90": %s, "p99": %s, "max": %s})",
                         JsonNumber(s.mean_ms), JsonNumber(s.p50_ms), JsonNumber(s.p90_ms),
                         JsonNumber(s.p99_ms), JsonNumber(s.max_ms));
}

std::string FormatRange(const LengthRange& r) {
  return r.min == r.max ? absl::StrCat(r.min) : absl::StrCat(r.min, ":", r.max);
}

}  // namespace

absl::StatusOr<LengthRange> ParseLengthRange(const std::string& text) {
  LengthRange range;
  const size_t colon = text.find(':');
  bool ok;
  if (colon == std::string::npos) {
    ok = absl::SimpleAtoi(text, &range.min);
    range.max = range.min;
  } else {
    ok = absl::SimpleAtoi(text.substr(0, colon), &range.min) &&
         absl::SimpleAtoi(text.substr(colon + 1), &range.max);
  }
  if (!ok || range.min < 1 || range.min > range.max) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad length \"", text, "\": want N or MIN:MAX with 1 <= MIN <= MAX"));
  }
  return range;
}

LatencyStats SummarizeSeconds(std::vector<double> seconds) {
  LatencyStats stats;
  if (seconds.empty()) return stats;
  std::sort(seconds.begin(), seconds.end());
  auto percentile = [&](double p) {  // numpy's default ("linear") interpolation
    const double pos = p / 100.0 * static_cast<double>(seconds.size() - 1);
    const size_t lo = static_cast<size_t>(pos);
    const size_t hi = std::min(lo + 1, seconds.size() - 1);
    return 1e3 * (seconds[lo] + (pos - static_cast<double>(lo)) * (seconds[hi] - seconds[lo]));
  };
  double sum = 0;
  for (double s : seconds) sum += s;
  stats.mean_ms = 1e3 * sum / static_cast<double>(seconds.size());
  stats.p50_ms = percentile(50);
  stats.p90_ms = percentile(90);
  stats.p99_ms = percentile(99);
  stats.max_ms = 1e3 * seconds.back();
  return stats;
}

absl::StatusOr<BenchReport> RunBench(SubspaceClient& client, const BenchConfig& config) {
  if (absl::Status s = ValidateConfig(config); !s.ok()) return s;
  absl::StatusOr<v1::ModelInfo> info = client.GetModelInfo();
  if (!info.ok()) return info.status();
  const int64_t context = info->context_length();
  if (config.prompt_kind == PromptKind::kTokens) {
    if (info->vocab_size() <= static_cast<uint32_t>(kFirstOrdinaryToken)) {
      return absl::FailedPreconditionError("the model's vocabulary has no ordinary tokens");
    }
    if (context > 0 && config.prompt_tokens.max + config.output_tokens.max > context) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt (", config.prompt_tokens.max, ") + output (", config.output_tokens.max,
          ") tokens exceed the model's context of ", context));
    }
  }

  BenchReport report;
  report.config = config;
  report.server = client.options().server;
  report.model = info->name();
  const std::vector<PlannedRequest> plan = Plan(config, static_cast<int32_t>(info->vocab_size()));
  report.requests.resize(plan.size());

  std::atomic<size_t> next{0};
  const bool paced = std::isfinite(config.request_rate);
  const Clock::time_point start = Clock::now();
  auto worker = [&] {
    // Requests are claimed in order, so with pacing a request waits for its arrival time and
    // then for a free slot, as behind a semaphore.
    for (size_t i = next++; i < plan.size(); i = next++) {
      if (paced) {
        std::this_thread::sleep_until(start +
                                      std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(plan[i].arrival_s)));
      }
      report.requests[i] = RunOne(client, plan[i]);
    }
  };
  const int32_t threads = std::min(config.concurrency, config.num_requests);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int32_t t = 0; t < threads; ++t) pool.emplace_back(worker);
  for (std::thread& t : pool) t.join();
  report.duration_s = SecondsBetween(start, Clock::now());
  Summarize(report);
  return report;
}

std::string FormatReportTable(const BenchReport& r) {
  const BenchConfig& c = r.config;
  std::string out;
  absl::StrAppendFormat(&out, "%s\n", std::string(62, '='));
  absl::StrAppendFormat(&out, "Serving benchmark: %s @ %s\n", r.model, r.server);
  absl::StrAppendFormat(&out,
                        "requests %d, concurrency %d, rate %s req/s, prompt %s %s, output %s, "
                        "seed %d\n",
                        c.num_requests, c.concurrency,
                        std::isfinite(c.request_rate) ? absl::StrCat(c.request_rate) : "inf",
                        FormatRange(c.prompt_tokens),
                        c.prompt_kind == PromptKind::kTokens ? "tokens" : "words",
                        FormatRange(c.output_tokens), c.seed);
  absl::StrAppendFormat(&out, "%s\n", std::string(62, '-'));
  auto line = [&](const char* name, const std::string& value) {
    absl::StrAppendFormat(&out, "%-40s %21s\n", name, value);
  };
  line("Successful requests:", absl::StrCat(r.successful));
  line("Failed requests:", absl::StrCat(r.failed));
  line("Benchmark duration (s):", absl::StrFormat("%.3f", r.duration_s));
  line("Total input tokens:", absl::StrCat(r.total_input_tokens));
  line("Total generated tokens:", absl::StrCat(r.total_output_tokens));
  line("Request throughput (req/s):", absl::StrFormat("%.3f", r.request_throughput));
  line("Output token throughput (tok/s):", absl::StrFormat("%.2f", r.output_throughput));
  line("Total token throughput (tok/s):", absl::StrFormat("%.2f", r.total_token_throughput));
  absl::StrAppendFormat(&out, "%s\n", std::string(62, '-'));
  absl::StrAppendFormat(&out, "%-12s %9s %9s %9s %9s %9s\n", "Latency (ms)", "mean", "p50", "p90",
                        "p99", "max");
  auto row = [&](const char* name, const LatencyStats& s) {
    absl::StrAppendFormat(&out, "%-12s %9.2f %9.2f %9.2f %9.2f %9.2f\n", name, s.mean_ms, s.p50_ms,
                          s.p90_ms, s.p99_ms, s.max_ms);
  };
  row("TTFT", r.ttft);
  row("TPOT", r.tpot);
  row("ITL", r.itl);
  row("E2E", r.e2e);
  absl::StrAppendFormat(&out, "%s\n", std::string(62, '='));
  // A few distinct errors, so a misconfigured run says why without flooding the terminal.
  std::vector<std::string> errors;
  for (const RequestResult& q : r.requests) {
    if (!q.ok && std::find(errors.begin(), errors.end(), q.error) == errors.end()) {
      errors.push_back(q.error);
      if (errors.size() == 5) break;
    }
  }
  for (const std::string& e : errors) absl::StrAppendFormat(&out, "error: %s\n", e);
  return out;
}

std::string ReportToJson(const BenchReport& r) {
  const BenchConfig& c = r.config;
  std::string out = "{\n";
  absl::StrAppend(&out, "  \"server\": ", JsonString(r.server), ",\n");
  absl::StrAppend(&out, "  \"model\": ", JsonString(r.model), ",\n");
  absl::StrAppendFormat(
      &out,
      "  \"config\": {\"num_requests\": %d, \"concurrency\": %d, \"request_rate\": %s, "
      "\"prompt_tokens\": {\"min\": %d, \"max\": %d}, \"output_tokens\": {\"min\": %d, "
      "\"max\": %d}, \"prompt_kind\": \"%s\", \"seed\": %d, \"temperature\": %s, "
      "\"ignore_eos\": %s},\n",
      c.num_requests, c.concurrency,
      std::isfinite(c.request_rate) ? JsonNumber(c.request_rate) : "\"inf\"", c.prompt_tokens.min,
      c.prompt_tokens.max, c.output_tokens.min, c.output_tokens.max,
      c.prompt_kind == PromptKind::kTokens ? "tokens" : "text", c.seed, JsonNumber(c.temperature),
      c.ignore_eos ? "true" : "false");
  absl::StrAppendFormat(&out, "  \"successful\": %d,\n  \"failed\": %d,\n", r.successful, r.failed);
  absl::StrAppend(&out, "  \"duration_s\": ", JsonNumber(r.duration_s), ",\n");
  absl::StrAppendFormat(&out, "  \"total_input_tokens\": %d,\n  \"total_output_tokens\": %d,\n",
                        r.total_input_tokens, r.total_output_tokens);
  absl::StrAppend(&out, "  \"request_throughput\": ", JsonNumber(r.request_throughput), ",\n");
  absl::StrAppend(&out, "  \"output_throughput\": ", JsonNumber(r.output_throughput), ",\n");
  absl::StrAppend(&out, "  \"total_token_throughput\": ", JsonNumber(r.total_token_throughput),
                  ",\n");
  absl::StrAppend(&out, "  \"ttft_ms\": ", JsonStats(r.ttft), ",\n");
  absl::StrAppend(&out, "  \"tpot_ms\": ", JsonStats(r.tpot), ",\n");
  absl::StrAppend(&out, "  \"itl_ms\": ", JsonStats(r.itl), ",\n");
  absl::StrAppend(&out, "  \"e2e_ms\": ", JsonStats(r.e2e), ",\n");
  out += "  \"requests\": [";
  for (size_t i = 0; i < r.requests.size(); ++i) {
    const RequestResult& q = r.requests[i];
    std::vector<std::string> itl;
    itl.reserve(q.itl.size());
    for (double s : q.itl) itl.push_back(JsonNumber(1e3 * s));
    absl::StrAppendFormat(&out,
                          "%s\n    {\"ok\": %s, \"error\": %s, \"prompt_tokens\": %d, "
                          "\"output_tokens\": %d, \"ttft_ms\": %s, \"e2e_ms\": %s, "
                          "\"itl_ms\": [%s]}",
                          i == 0 ? "" : ",", q.ok ? "true" : "false", JsonString(q.error),
                          q.prompt_tokens, q.output_tokens, JsonNumber(1e3 * q.ttft),
                          JsonNumber(1e3 * q.latency), absl::StrJoin(itl, ", "));
  }
  out += "\n  ]\n}\n";
  return out;
}

}  // namespace subspace::client
