// LlamaModel + PagedKvCache against the float64 NumPy reference (tests/reference/): logits
// of every position for one-chunk prefill, chunked prefill and token-by-token decode, greedy
// determinism, batched decode equal to each sequence alone, and a real third-party GGUF.
//
// Error measure, per logits row: rel = max_j |engine_j - ref_j| / max_j |ref_j|. The test
// takes the worst row and holds it to the tolerance the manifest gives per model (1e-4 for
// F32/F16/BF16/Q8_0 weights, whose rounding the reference shares).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/model/model.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::TestDataPath;

struct Record {
  std::string kind;  // "case" or "greedy"
  std::map<std::string, std::string> fields;
  const std::string& operator[](const std::string& key) const { return fields.at(key); }
};

std::vector<int32_t> ParseTokens(const std::string& s) {
  std::vector<int32_t> out;
  for (absl::string_view t : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int32_t v = 0;
    EXPECT_TRUE(absl::SimpleAtoi(t, &v)) << t;
    out.push_back(v);
  }
  return out;
}

std::vector<Record> ReadManifest() {
  std::vector<Record> out;
  const std::string text = ::subspace::testing::ReadFileOrDie(TestDataPath("manifest.txt"));
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (line[0] == '#') continue;
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
    Record r;
    r.kind = parts[0];
    for (size_t i = 1; i < parts.size(); ++i) {
      std::vector<std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
      r.fields[kv[0]] = kv.size() > 1 ? kv[1] : "";
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<double> ReadF64(const std::string& file) {
  const std::string bytes = ::subspace::testing::ReadFileOrDie(TestDataPath(file));
  std::vector<double> out(bytes.size() / sizeof(double));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(double));
  return out;
}

// Models load once per process; Forward runs from one thread, as in the engine.
LlamaModel& ModelAt(const std::string& path) {
  static std::map<std::string, std::unique_ptr<LlamaModel>> models;
  std::unique_ptr<LlamaModel>& m = models[path];
  if (m == nullptr) {
    absl::StatusOr<std::unique_ptr<LlamaModel>> loaded = LlamaModel::Open(path);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    if (!loaded.ok()) std::abort();
    m = *std::move(loaded);
  }
  return *m;
}
LlamaModel& Model(const std::string& gguf) { return ModelAt(TestDataPath(gguf)); }

std::unique_ptr<PagedKvCache> MakeCache(const LlamaModel& m, int block_size) {
  absl::StatusOr<std::unique_ptr<PagedKvCache>> cache =
      PagedKvCache::Create({m.config().cache_geometry(), block_size, int64_t{8} << 20});
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? *std::move(cache) : nullptr;
}

// Worst per-row relative error of `got` [rows, vocab] against `ref` rows [first, first+rows).
double WorstRowError(const std::vector<float>& got, const std::vector<double>& ref,
                     int64_t first_row, int64_t rows, int vocab) {
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double diff = 0, scale = 0;
    for (int j = 0; j < vocab; ++j) {
      const double a = got[r * vocab + j];
      const double b = ref[(first_row + r) * vocab + j];
      if (!std::isfinite(a)) return INFINITY;
      diff = std::max(diff, std::abs(a - b));
      scale = std::max(scale, std::abs(b));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

// Runs `tokens` through a fresh sequence in chunks of `sizes` (cycled), logits of every
// position. Returns [n, vocab] concatenated.
std::vector<float> RunChunked(LlamaModel& m, KvCache& cache, const std::vector<int32_t>& tokens,
                              const std::vector<int>& sizes, bool all_logits_each_chunk) {
  const int vocab = m.config().n_vocab;
  SeqId seq = *cache.CreateSequence();
  std::vector<float> all, step;
  size_t done = 0, k = 0;
  while (done < tokens.size()) {
    const size_t n =
        std::min<size_t>(static_cast<size_t>(sizes[k++ % sizes.size()]), tokens.size() - done);
    EXPECT_TRUE(cache.Reserve(seq, static_cast<int64_t>(n)).ok());
    SequenceChunk chunk{seq, static_cast<int64_t>(done),
                        std::span<const int32_t>(tokens).subspan(done, n), all_logits_each_chunk};
    absl::Status st = m.Forward({&chunk, 1}, cache, &step);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return {};
    EXPECT_EQ(step.size(), (all_logits_each_chunk ? n : 1) * static_cast<size_t>(vocab));
    all.insert(all.end(), step.begin(), step.end());
    done += n;
  }
  EXPECT_EQ(cache.Length(seq), static_cast<int64_t>(tokens.size()));
  EXPECT_TRUE(cache.FreeSequence(seq).ok());
  return all;
}

class ModelReferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SUBSPACE_REQUIRE_FILE(TestDataPath("manifest.txt"));
    records_ = ReadManifest();
    ASSERT_FALSE(records_.empty());
  }
  std::vector<Record> records_;
};

// One prefill chunk (B=16), uneven chunks (B=4) and one token per step (B=1, decode path:
// logits of the last token only) all agree with the reference at every position.
TEST_F(ModelReferenceTest, LogitsMatchReferenceEveryPosition) {
  std::cout << absl::StrFormat("%-14s %-6s %-5s %10s %10s %10s %8s\n", "model", "case", "wtype",
                               "one-chunk", "chunked", "decode", "tol");
  for (const Record& r : records_) {
    if (r.kind != "case") continue;
    SCOPED_TRACE(r["model"] + " " + r["name"]);
    LlamaModel& m = Model(r["gguf"]);
    const int vocab = m.config().n_vocab;
    const std::vector<int32_t> tokens = ParseTokens(r["tokens"]);
    const std::vector<double> ref = ReadF64(r["logits"]);
    ASSERT_EQ(ref.size(), tokens.size() * static_cast<size_t>(vocab));
    double tol = 0;
    ASSERT_TRUE(absl::SimpleAtod(r["tol"], &tol));
    const int64_t n = static_cast<int64_t>(tokens.size());

    auto cache16 = MakeCache(m, 16);
    const double e_one =
        WorstRowError(RunChunked(m, *cache16, tokens, {1 << 20}, true), ref, 0, n, vocab);
    auto cache4 = MakeCache(m, 4);
    const double e_chunked =
        WorstRowError(RunChunked(m, *cache4, tokens, {5, 1, 17, 3}, true), ref, 0, n, vocab);
    auto cache1 = MakeCache(m, 1);
    const double e_decode =
        WorstRowError(RunChunked(m, *cache1, tokens, {1}, false), ref, 0, n, vocab);
    std::cout << absl::StrFormat("%-14s %-6s %-5s %10.2e %10.2e %10.2e %8.0e\n", r["model"],
                                 r["name"], r["wtype"], e_one, e_chunked, e_decode, tol);
    EXPECT_LE(e_one, tol);
    EXPECT_LE(e_chunked, tol);
    EXPECT_LE(e_decode, tol);
    // The cache must be empty again: every sequence was freed.
    EXPECT_EQ(cache16->Stats().blocks_free, cache16->Stats().blocks_total);
  }
}

std::vector<int32_t> Greedy(LlamaModel& m, const std::vector<int32_t>& prompt, int steps) {
  const int vocab = m.config().n_vocab;
  auto cache = MakeCache(m, 4);
  SeqId seq = *cache->CreateSequence();
  std::vector<int32_t> history = prompt, generated;
  std::vector<float> logits;
  size_t fed = 0;
  for (int s = 0; s < steps; ++s) {
    const int64_t n = static_cast<int64_t>(history.size() - fed);
    EXPECT_TRUE(cache->Reserve(seq, n).ok());
    SequenceChunk chunk{seq, static_cast<int64_t>(fed),
                        std::span<const int32_t>(history).subspan(fed)};
    EXPECT_TRUE(m.Forward({&chunk, 1}, *cache, &logits).ok());
    fed = history.size();
    const int32_t next = static_cast<int32_t>(
        std::max_element(logits.begin(), logits.begin() + vocab) - logits.begin());
    generated.push_back(next);
    history.push_back(next);
  }
  return generated;
}

// Greedy decoding is deterministic, and follows the reference's greedy path wherever the
// reference's top-2 gap is far above the logit error.
TEST_F(ModelReferenceTest, GreedyIsDeterministicAndMatchesReference) {
  for (const Record& r : records_) {
    if (r.kind != "greedy") continue;
    SCOPED_TRACE(r["model"]);
    LlamaModel& m = Model(r["gguf"]);
    const std::vector<int32_t> prompt = ParseTokens(r["prompt"]);
    const std::vector<int32_t> expected = ParseTokens(r["generated"]);
    const std::vector<int32_t> first = Greedy(m, prompt, static_cast<int>(expected.size()));
    const std::vector<int32_t> second = Greedy(m, prompt, static_cast<int>(expected.size()));
    EXPECT_EQ(first, second);
    double margin = 0, tol = 0;
    ASSERT_TRUE(absl::SimpleAtod(r["min_margin"], &margin));
    for (const Record& c : records_) {
      if (c.kind == "case" && c["model"] == r["model"]) absl::SimpleAtod(c["tol"], &tol);
    }
    // |logit| stays under ~20 for these models, so 50 * tol bounds twice the absolute error.
    if (margin > 50 * tol) {
      EXPECT_EQ(first, expected);
    } else {
      std::cout << r["model"] << ": reference top-2 gap " << margin
                << " too small to compare greedy paths\n";
    }
  }
}

struct BatchedResult {
  double worst_rel = 0;
  bool bit_exact = true;
};

// Four sequences of different lengths decode one token each in a single Forward, optionally
// with a fifth prefilling a 9-token chunk in the same step; compares each row with that
// sequence run alone (prefill, then its decode step by itself).
BatchedResult BatchedVersusAlone(LlamaModel& m, const std::vector<int32_t>& tokens,
                                 bool with_prefill) {
  const int vocab = m.config().n_vocab;
  const std::vector<int> lengths = {1, 6, 19, 33};  // prompt lengths before the decode step
  const int prefill_len = 9;
  std::vector<std::vector<float>> alone;
  for (int len : lengths) {
    auto cache = MakeCache(m, 4);
    std::vector<int32_t> seq_tokens(tokens.begin(), tokens.begin() + len + 1);
    std::vector<float> all = RunChunked(m, *cache, seq_tokens, {len, 1}, false);
    alone.emplace_back(all.end() - vocab, all.end());
  }
  if (with_prefill) {
    auto cache = MakeCache(m, 4);
    std::vector<int32_t> chunk(tokens.end() - prefill_len, tokens.end());
    alone.insert(alone.begin() + 2, RunChunked(m, *cache, chunk, {prefill_len}, false));
  }

  auto cache = MakeCache(m, 4);
  std::vector<SeqId> ids;
  std::vector<float> logits;
  for (int len : lengths) {
    ids.push_back(*cache->CreateSequence());
    EXPECT_TRUE(cache->Reserve(ids.back(), len).ok());
    SequenceChunk c{ids.back(), 0, std::span<const int32_t>(tokens).first(len)};
    EXPECT_TRUE(m.Forward({&c, 1}, *cache, &logits).ok());
  }
  std::vector<SequenceChunk> batch;
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_TRUE(cache->Reserve(ids[i], 1).ok());
    batch.push_back({ids[i], lengths[i], std::span<const int32_t>(tokens).subspan(lengths[i], 1)});
  }
  if (with_prefill) {
    const SeqId fifth = *cache->CreateSequence();
    EXPECT_TRUE(cache->Reserve(fifth, prefill_len).ok());
    batch.insert(batch.begin() + 2, {fifth, 0, std::span<const int32_t>(tokens).last(prefill_len)});
  }
  absl::Status st = m.Forward(batch, *cache, &logits);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(logits.size(), batch.size() * static_cast<size_t>(vocab));
  BatchedResult res;
  if (logits.size() != batch.size() * static_cast<size_t>(vocab)) return {INFINITY, false};
  for (size_t row = 0; row < batch.size(); ++row) {
    const std::vector<float>& a = alone[row];
    double diff = 0, scale = 0;
    for (int j = 0; j < vocab; ++j) {
      const float b = logits[row * static_cast<size_t>(vocab) + static_cast<size_t>(j)];
      res.bit_exact = res.bit_exact && b == a[static_cast<size_t>(j)];
      diff = std::max(diff, std::abs(static_cast<double>(b) - a[static_cast<size_t>(j)]));
      scale = std::max(scale, std::abs(static_cast<double>(a[static_cast<size_t>(j)])));
    }
    res.worst_rel = std::max(res.worst_rel, diff / scale);
  }
  return res;
}

// Batching must not change a sequence's logits beyond rounding: the matmuls may pick another
// kernel for more rows (decode streaming vs sgemm), so bit-exactness is reported, not required.
TEST_F(ModelReferenceTest, BatchedStepEqualsEachSequenceAlone) {
  std::map<std::string, bool> seen;
  for (const Record& r : records_) {
    if (r.kind != "case" || r["name"] != "long" || seen[r["model"]]) continue;
    seen[r["model"]] = true;
    SCOPED_TRACE(r["model"]);
    LlamaModel& m = Model(r["gguf"]);
    const std::vector<int32_t> tokens = ParseTokens(r["tokens"]);
    for (bool with_prefill : {false, true}) {
      const BatchedResult res = BatchedVersusAlone(m, tokens, with_prefill);
      std::cout << absl::StrFormat("%-14s %-22s vs alone: %-13s worst row rel error %.2e\n",
                                   r["model"], with_prefill ? "4 decodes + 1 prefill" : "4 decodes",
                                   res.bit_exact ? "bit-exact," : "not bit-exact,", res.worst_rel);
      EXPECT_LE(res.worst_rel, 1e-6);
    }
  }
}

// The same random-weight files run by llama.cpp (tests/data/llamacpp/, written by
// tools/llama_ref/build.sh with llama.cpp c392e509): Llama, Llama 3 frequency factors, Qwen2
// (biases, halves RoPE, tied output; F32, Q8_0 and YaRN) and Phi-3 (fused tensors, and a
// 13-token sliding window over 24 tokens, which llama.cpp masks). Every
// position's logits within the reference's tolerance, and llama.cpp's greedy continuation token for
// token.
TEST(LlamaCppReferenceTest, LogitsAndGreedyMatchLlamaCpp) {
  const std::string manifest = ::subspace::testing::FixturePath("llamacpp/manifest.txt");
  SUBSPACE_ASSERT_FIXTURE(manifest);
  int checked = 0;
  for (absl::string_view line :
       absl::StrSplit(::subspace::testing::ReadFileOrDie(manifest), '\n', absl::SkipEmpty())) {
    if (line[0] == '#') continue;
    std::map<std::string, std::string> r;
    for (absl::string_view part : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      std::vector<std::string> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
      r[kv[0]] = kv.size() > 1 ? kv[1] : "";
    }
    SCOPED_TRACE(r["model"]);
    LlamaModel& m = ModelAt(::subspace::testing::FixturePath("llamacpp/" + r["gguf"]));
    const int vocab = m.config().n_vocab;
    const std::vector<int32_t> tokens = ParseTokens(r["tokens"]);
    const std::string raw = ::subspace::testing::ReadFileOrDie(
        ::subspace::testing::FixturePath("llamacpp/" + r["logits"]));
    ASSERT_EQ(raw.size(), tokens.size() * vocab * sizeof(float));
    std::vector<float> ref32(tokens.size() * vocab);
    std::memcpy(ref32.data(), raw.data(), raw.size());
    const std::vector<double> ref(ref32.begin(), ref32.end());
    double tol = 0;
    ASSERT_TRUE(absl::SimpleAtod(r["tol"], &tol));
    auto cache = MakeCache(m, 4);
    const std::vector<float> got = RunChunked(m, *cache, tokens, {7, 1, 16}, true);
    const double err = WorstRowError(got, ref, 0, static_cast<int64_t>(tokens.size()), vocab);
    std::cout << absl::StrFormat("%-18s vs llama.cpp: worst row rel error %.2e (tol %g)\n",
                                 r["model"], err, tol);
    EXPECT_LE(err, tol);
    const std::vector<int32_t> greedy = ParseTokens(r["greedy"]);
    EXPECT_EQ(Greedy(m, tokens, static_cast<int>(greedy.size())), greedy);
    ++checked;
  }
  EXPECT_EQ(checked, 7);
}

// A GGUF written by another project (ollama's test data): loads and yields finite logits.
TEST(ModelSharedFixtureTest, TinyRandomLlamaRuns) {
  const std::string path = ::subspace::testing::FixturePath("gguf/llama-2-tiny-random.gguf");
  SUBSPACE_ASSERT_FIXTURE(path);
  absl::StatusOr<std::unique_ptr<LlamaModel>> m = LlamaModel::Open(path);
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config();
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.n_layers, 1);
  EXPECT_EQ(c.dim, 8);
  EXPECT_EQ(c.n_vocab, 32000);
  auto cache = PagedKvCache::Create({c.cache_geometry(), 16, int64_t{1} << 20});
  ASSERT_TRUE(cache.ok()) << cache.status();
  SeqId seq = *(*cache)->CreateSequence();
  const std::vector<int32_t> tokens = {1, 15043, 3186, 29892, 31999};
  ASSERT_TRUE((*cache)->Reserve(seq, static_cast<int64_t>(tokens.size())).ok());
  SequenceChunk chunk{seq, 0, tokens, true};
  std::vector<float> logits;
  ASSERT_TRUE((*m)->Forward({&chunk, 1}, **cache, &logits).ok());
  ASSERT_EQ(logits.size(), tokens.size() * 32000u);
  double sum_abs = 0;
  for (float x : logits) {
    ASSERT_TRUE(std::isfinite(x));
    sum_abs += std::abs(x);
  }
  EXPECT_GT(sum_abs, 0.0);
}

}  // namespace
}  // namespace subspace
