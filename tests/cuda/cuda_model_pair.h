// What the CUDA backend's end-to-end tests share (cuda_model_test.cc, the full cache;
// cuda_model_cache_test.cc, the compressed and transform-coded caches): the default model, a
// CPU and a CUDA backend side by side, and one step run on both with its logits compared.
//
// Tolerance: the CUDA path stores weights, GEMM inputs and the KV cache in fp16 (fp32
// accumulation), the CPU path keeps fp32 activations and cache, so logits differ by fp16
// rounding carried through 6 layers: we require max |cuda - cpu| <= 2 % of the step's logit
// range, and the same argmax wherever the CPU's top-2 margin exceeds 5 % of that range.
#ifndef SUBSPACE_TESTS_CUDA_CUDA_MODEL_PAIR_H_
#define SUBSPACE_TESTS_CUDA_CUDA_MODEL_PAIR_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/gguf/gguf.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/model/decoder_ops.h"
#include "core/model/model.h"
#include "cuda/cuda_model.h"

namespace subspace::cuda {

// SUBSPACE_TEST_MODEL overrides the path (binaries carried to a GPU machine by
// scripts/gpu_bundle.sh run from another checkout).
inline std::string ModelPath() {
  const char* env = std::getenv("SUBSPACE_TEST_MODEL");
  return env != nullptr ? env : SUBSPACE_SOURCE_DIR "/models/subspace-tiny.gguf";
}

struct Pair {
  std::shared_ptr<LlamaModel> cpu;
  std::unique_ptr<KvCache> cpu_cache;
  CudaBackend cuda;
};

inline Pair Open(int max_batch_tokens = 256, int max_sequences = 8,
                 const std::shared_ptr<const GgufFile>& file = nullptr) {
  Pair p;
  absl::StatusOr<std::unique_ptr<LlamaModel>> cpu =
      file != nullptr ? LlamaModel::Load(file) : LlamaModel::Open(ModelPath());
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  if (!cpu.ok()) return p;
  p.cpu = *std::move(cpu);
  absl::StatusOr<std::unique_ptr<PagedKvCache>> cache =
      PagedKvCache::Create({.geometry = p.cpu->config().cache_geometry(),
                            .block_size = 16,
                            .capacity_bytes = int64_t{64} << 20});
  EXPECT_TRUE(cache.ok()) << cache.status();
  p.cpu_cache = *std::move(cache);
  absl::StatusOr<CudaBackend> cuda =
      CreateCudaBackend(*p.cpu, {.max_batch_tokens = max_batch_tokens,
                                 .max_sequences = max_sequences,
                                 .block_size = 16,
                                 .kv_cache_bytes = int64_t{32} << 20});
  EXPECT_TRUE(cuda.ok()) << cuda.status();
  if (cuda.ok()) p.cuda = *std::move(cuda);
  return p;
}

// n token ids in 1 .. vocab - 1, a fixed pattern varied by `salt`.
inline std::vector<int32_t> PatternTokens(int n, int salt, int vocab) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(1 + (i * 37 + salt * 101) % (vocab - 1));
  return t;
}

// n new sequences on each backend, appended to cpu_seqs and gpu_seqs.
inline void CreateSequences(Pair& p, int n, std::vector<SeqId>* cpu_seqs,
                            std::vector<SeqId>* gpu_seqs) {
  for (int s = 0; s < n; ++s) {
    cpu_seqs->push_back(*p.cpu_cache->CreateSequence());
    gpu_seqs->push_back(*p.cuda.cache->CreateSequence());
  }
}

using StepChunks = std::vector<std::pair<int, std::vector<int32_t>>>;

// `chunks` (seq index, tokens) as one step's batch on each backend, their ranges reserved.
inline void ReserveBoth(Pair& p, std::vector<SeqId>& cpu_seqs, std::vector<SeqId>& gpu_seqs,
                        const StepChunks& chunks, std::vector<SequenceChunk>* cpu_batch,
                        std::vector<SequenceChunk>* gpu_batch) {
  for (const auto& [s, tokens] : chunks) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    ASSERT_TRUE(p.cpu_cache->Reserve(cpu_seqs[s], n).ok());
    ASSERT_TRUE(p.cuda.cache->Reserve(gpu_seqs[s], n).ok());
    cpu_batch->push_back({cpu_seqs[s], p.cpu_cache->Length(cpu_seqs[s]), tokens});
    gpu_batch->push_back({gpu_seqs[s], p.cuda.cache->Length(gpu_seqs[s]), tokens});
  }
}

// Runs `chunks` (seq index, tokens) as one step on both backends and compares logits
// (within `tolerance` of each row's range; negative: only that they are finite).
inline void StepBoth(Pair& p, std::vector<SeqId>& cpu_seqs, std::vector<SeqId>& gpu_seqs,
                     const StepChunks& chunks, const std::string& what, float tolerance = 0.02f) {
  std::vector<SequenceChunk> cpu_batch, gpu_batch;
  ReserveBoth(p, cpu_seqs, gpu_seqs, chunks, &cpu_batch, &gpu_batch);
  if (::testing::Test::HasFatalFailure()) return;
  std::vector<float> cpu_logits, gpu_logits;
  ASSERT_TRUE(p.cpu->Forward(cpu_batch, *p.cpu_cache, &cpu_logits).ok());
  const absl::Status st = p.cuda.model->Forward(gpu_batch, *p.cuda.cache, &gpu_logits);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(cpu_logits.size(), gpu_logits.size());
  const int vocab = p.cpu->config().n_vocab;
  for (size_t r = 0; r * vocab < cpu_logits.size(); ++r) {
    const float* c = cpu_logits.data() + r * vocab;
    const float* g = gpu_logits.data() + r * vocab;
    const auto [lo, hi] = std::minmax_element(c, c + vocab);
    const float range = *hi - *lo;
    float worst = 0.0f;
    for (int i = 0; i < vocab; ++i) {
      ASSERT_TRUE(std::isfinite(g[i])) << what << " row " << r << " logit " << i;
      worst = std::max(worst, std::fabs(g[i] - c[i]));
    }
    if (tolerance < 0.0f) continue;
    EXPECT_LE(worst, tolerance * range) << what << " row " << r;
    std::vector<float> sorted(c, c + vocab);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    if (sorted[0] - sorted[1] > 0.05f * range) {
      EXPECT_EQ(std::max_element(c, c + vocab) - c, std::max_element(g, g + vocab) - g)
          << what << " row " << r;
    }
  }
}

// The op harness's step (tests/cuda/cuda_model_ops_test.cc): `chunks` on both backends, traced,
// the device's ops each run on the CPU's inputs (OpTrace::inputs); returns the worst difference
// seen relative to an output's largest CPU magnitude, and fails at the first output whose
// difference exceeds `tolerance` of it, naming the op.
inline float CompareOpsBoth(Pair& p, std::vector<SeqId>& cpu_seqs, std::vector<SeqId>& gpu_seqs,
                            const StepChunks& chunks, const std::string& what, float tolerance) {
  std::vector<SequenceChunk> cpu_batch, gpu_batch;
  ReserveBoth(p, cpu_seqs, gpu_seqs, chunks, &cpu_batch, &gpu_batch);
  if (::testing::Test::HasFatalFailure()) return 0.0f;
  OpTrace cpu_trace, gpu_trace;
  std::vector<float> cpu_logits, gpu_logits;
  absl::Status st = p.cpu->ForwardTraced(cpu_batch, *p.cpu_cache, &cpu_logits, &cpu_trace);
  EXPECT_TRUE(st.ok()) << st;
  gpu_trace.inputs = &cpu_trace;  // each op alone, on the CPU's inputs
  st = p.cuda.model->ForwardTraced(gpu_batch, *p.cuda.cache, &gpu_logits, &gpu_trace);
  EXPECT_TRUE(st.ok()) << st;
  if (!st.ok()) return 0.0f;
  EXPECT_EQ(gpu_trace.entries.size(), cpu_trace.entries.size()) << what;
  float worst = 0.0f;
  const size_t n = std::min(cpu_trace.entries.size(), gpu_trace.entries.size());
  for (size_t e = 0; e < n; ++e) {
    const OpTrace::Entry& c = cpu_trace.entries[e];
    const OpTrace::Entry& g = gpu_trace.entries[e];
    EXPECT_EQ(g.name, c.name) << what;
    EXPECT_EQ(g.rows, c.rows) << what << ", " << c.name;
    EXPECT_EQ(g.width, c.width) << what << ", " << c.name;
    if (g.values.size() != c.values.size()) return worst;
    float scale = 1e-6f, diff = 0.0f;
    size_t at = 0;
    for (size_t j = 0; j < c.values.size(); ++j) {
      scale = std::max(scale, std::fabs(c.values[j]));
      if (!(std::fabs(g.values[j] - c.values[j]) <= diff)) {  // NaN lands here too
        diff = std::isfinite(g.values[j]) ? std::fabs(g.values[j] - c.values[j]) : INFINITY;
        at = j;
      }
    }
    const float rel = diff / scale;
    worst = std::max(worst, rel);
    if (!(rel <= tolerance)) {
      ADD_FAILURE() << what << ": first disagreeing op " << c.name << ": |device - cpu| " << diff
                    << " at row " << at / c.width << " column " << at % c.width << " (device "
                    << g.values[at] << ", cpu " << c.values[at] << "), " << rel
                    << " of the output's largest magnitude " << scale;
      return worst;
    }
  }
  return worst;
}

}  // namespace subspace::cuda

#endif  // SUBSPACE_TESTS_CUDA_CUDA_MODEL_PAIR_H_
