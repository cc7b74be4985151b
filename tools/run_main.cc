// subspace-run: local generation and perplexity from a GGUF model on the CPU backend,
// without the server. Prints the continuation on stdout and throughput on stderr.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cli/flags.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/model/model.h"
#include "core/model/model_file.h"
#include "core/model/sampler.h"
#include "core/tokenizer/tokenizer.h"
#include "tools/eval/perplexity.h"

ABSL_FLAG(std::string, model, "", "path of the GGUF model");
ABSL_FLAG(std::string, prompt, "", "prompt text");
ABSL_FLAG(int32_t, n, 64, "tokens to generate");
ABSL_FLAG(float, temperature, 0.0f, "sampling temperature; 0 = greedy");
ABSL_FLAG(int32_t, top_k, 0, "top-k sampling; 0 = off");
ABSL_FLAG(float, top_p, 1.0f, "nucleus sampling threshold in (0, 1]");
ABSL_FLAG(float, min_p, 0.0f, "min-p sampling threshold in [0, 1)");
ABSL_FLAG(float, repetition_penalty, 1.0f, "repetition penalty; 1 = off");
ABSL_FLAG(uint64_t, seed, 0, "sampling seed");
ABSL_FLAG(std::vector<std::string>, stop, {}, "comma-separated stop sequences");
ABSL_FLAG(bool, ignore_eos, false, "keep generating past the end-of-sequence token");
ABSL_FLAG(std::string, ppl, "", "print the perplexity of this text file instead of generating");
ABSL_FLAG(int32_t, ppl_window, 0, "perplexity window in tokens; 0 = model context");
ABSL_FLAG(int64_t, kv_cache_bytes, 256ll << 20, "KV cache pool size in bytes");
ABSL_FLAG(int32_t, block_size, 16, "KV cache block size in tokens");
ABSL_FLAG(std::string, tokenize, "",
          "print the token ids of this text (space-separated, BOS as the model's metadata says) "
          "and exit; reads only the tokenizer, so vocab-only GGUF files work");
ABSL_FLAG(bool, parse_special, true,
          "--tokenize: text like <s> becomes the special token (as llama-tokenize does); "
          "--noparse_special keeps it as text");

namespace subspace {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status RunPerplexity(LlamaModel& model, KvCache& cache, const Tokenizer& tokenizer) {
  absl::StatusOr<std::string> text = ReadFile(absl::GetFlag(FLAGS_ppl));
  if (!text.ok()) return text.status();
  std::vector<int32_t> tokens = tokenizer.Encode(*text, {.add_bos = false});
  int window = absl::GetFlag(FLAGS_ppl_window);
  if (window <= 0) window = model.config().context_length;
  const auto start = Clock::now();
  absl::StatusOr<eval::PerplexityResult> result = eval::ComputePerplexity(
      model, cache, tokens, tokenizer.bos_id(), window, [&](int64_t done, int64_t total) {
        std::fprintf(stderr, "\rperplexity: window %lld/%lld", static_cast<long long>(done),
                     static_cast<long long>(total));
      });
  std::fprintf(stderr, "\n");
  if (!result.ok()) return result.status();
  const double seconds = SecondsSince(start);
  std::printf("perplexity %.4f over %lld tokens (%lld windows of <= %d), %.1f tokens/s\n",
              result->perplexity, static_cast<long long>(result->tokens_scored),
              static_cast<long long>(result->windows), window,
              static_cast<double>(tokens.size()) / seconds);
  return absl::OkStatus();
}

absl::Status RunGenerate(LlamaModel& model, KvCache& cache, const Tokenizer& tokenizer) {
  SamplingParams params;
  params.temperature = absl::GetFlag(FLAGS_temperature);
  params.top_k = absl::GetFlag(FLAGS_top_k);
  params.top_p = absl::GetFlag(FLAGS_top_p);
  params.min_p = absl::GetFlag(FLAGS_min_p);
  params.repetition_penalty = absl::GetFlag(FLAGS_repetition_penalty);
  params.seed = absl::GetFlag(FLAGS_seed);
  if (absl::Status s = ValidateSamplingParams(params); !s.ok()) return s;
  const int32_t max_new = absl::GetFlag(FLAGS_n);
  if (max_new < 0) return absl::InvalidArgumentError("-n must be >= 0");

  std::vector<int32_t> tokens =
      tokenizer.Encode(absl::GetFlag(FLAGS_prompt), {.add_bos = tokenizer.add_bos()});
  if (tokens.empty()) return absl::InvalidArgumentError("the prompt encodes to no tokens");
  const int64_t context = model.config().context_length;
  if (static_cast<int64_t>(tokens.size()) >= context) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt of ", tokens.size(), " tokens does not fit the context of ", context));
  }
  const int64_t n_prompt = static_cast<int64_t>(tokens.size());
  const int64_t budget = std::min<int64_t>(max_new, context - n_prompt);

  absl::StatusOr<SeqId> seq = cache.CreateSequence();
  if (!seq.ok()) return seq.status();
  if (absl::Status s = cache.Reserve(*seq, n_prompt + budget); !s.ok()) return s;

  Sampler sampler(params);
  StopMatcher stops(absl::GetFlag(FLAGS_stop));
  // The prompt is echoed first, so the continuation keeps its leading space; only text that
  // starts the output drops the space the tokenizer's dummy prefix added.
  StreamDecoder decoder(tokenizer, /*strip_leading_space=*/absl::GetFlag(FLAGS_prompt).empty());
  std::vector<float> logits;
  const int n_vocab = model.config().n_vocab;

  std::fputs(absl::GetFlag(FLAGS_prompt).c_str(), stdout);
  std::fflush(stdout);
  const auto prefill_start = Clock::now();
  SequenceChunk chunk{*seq, 0, tokens, false};
  if (absl::Status s = model.Forward({&chunk, 1}, cache, &logits); !s.ok()) return s;
  const double prefill_seconds = SecondsSince(prefill_start);

  const auto decode_start = Clock::now();
  int64_t generated = 0;
  std::string finish = "length";
  while (generated < budget) {
    SampledToken next = sampler.Sample({logits.data(), static_cast<size_t>(n_vocab)}, tokens);
    ++generated;
    if (tokenizer.IsEndOfGeneration(next.token) && !absl::GetFlag(FLAGS_ignore_eos)) {
      finish = "eos";
      break;
    }
    tokens.push_back(next.token);
    StopMatcher::Result out = stops.Push(decoder.Push(next.token));
    std::fputs(out.text.c_str(), stdout);
    std::fflush(stdout);
    if (out.stopped) {
      finish = "stop";
      break;
    }
    if (generated == budget) break;
    SequenceChunk step{*seq, static_cast<int64_t>(tokens.size()) - 1, {&tokens.back(), 1}, false};
    if (absl::Status s = model.Forward({&step, 1}, cache, &logits); !s.ok()) return s;
  }
  if (finish != "stop") std::fputs(stops.Push(decoder.Flush()).text.c_str(), stdout);
  if (finish == "length") std::fputs(stops.Flush().c_str(), stdout);
  std::fputs("\n", stdout);
  std::fflush(stdout);  // keep the text ahead of the stats line on a shared terminal
  const double decode_seconds = SecondsSince(decode_start);
  cache.FreeSequence(*seq).IgnoreError();

  std::fprintf(stderr,
               "prompt %lld tokens, prefill %.1f tokens/s; generated %lld tokens, decode %.1f "
               "tokens/s; finish: %s\n",
               static_cast<long long>(n_prompt), n_prompt / prefill_seconds,
               static_cast<long long>(generated),
               generated > 1 ? (generated - 1) / decode_seconds : 0.0, finish.c_str());
  return absl::OkStatus();
}

// --tokenize: the ids of the text, like llama.cpp's llama-tokenize --ids, from the tokenizer in
// the GGUF metadata alone.
absl::Status RunTokenize(const std::string& path) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromGguf(**file);
  if (!tokenizer.ok()) return tokenizer.status();
  const std::vector<int32_t> ids =
      (*tokenizer)
          ->Encode(absl::GetFlag(FLAGS_tokenize),
                   {.add_bos = (*tokenizer)->add_bos(),
                    .parse_special = absl::GetFlag(FLAGS_parse_special)});
  std::string line;
  for (int32_t id : ids) absl::StrAppend(&line, line.empty() ? "" : " ", id);
  std::printf("%s\n", line.c_str());
  return absl::OkStatus();
}

absl::Status Run() {
  const std::string path = absl::GetFlag(FLAGS_model);
  if (path.empty()) return absl::InvalidArgumentError("--model is required");
  if (!absl::GetFlag(FLAGS_tokenize).empty()) return RunTokenize(path);
  absl::StatusOr<ModelFile> files = OpenModelFile(path);
  if (!files.ok()) return files.status();
  LlamaModel& model = *files->model;
  const Tokenizer& tokenizer = *files->tokenizer;

  PagedKvCache::Config cache_config;
  cache_config.geometry = model.config().cache_geometry();
  cache_config.block_size = absl::GetFlag(FLAGS_block_size);
  cache_config.capacity_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  absl::StatusOr<std::unique_ptr<PagedKvCache>> cache = PagedKvCache::Create(cache_config);
  if (!cache.ok()) return cache.status();

  if (!absl::GetFlag(FLAGS_ppl).empty()) return RunPerplexity(model, **cache, tokenizer);
  return RunGenerate(model, **cache, tokenizer);
}

}  // namespace
}  // namespace subspace

int main(int argc, char** argv) {
  subspace::cli::ParseFlags(
      argc, argv,
      "subspace-run --model M.gguf --prompt TEXT -n N [--temperature T --seed S ...]\n"
      "  or: subspace-run --model M.gguf --ppl FILE\n"
      "  or: subspace-run --model M.gguf --tokenize TEXT [--noparse_special]");
  absl::Status status = subspace::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "subspace-run: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
