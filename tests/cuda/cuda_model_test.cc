// The CUDA backend end to end against the CPU backend on the default model: the same steps
// (prefills, a chunked prefill over a cached prefix, decodes of several sequences in one batch)
// through CudaLlamaModel + DevicePagedKvCache and LlamaModel + PagedKvCache, logits compared
// after every step; then the engine generating greedily on each. Skips without a device.
//
// Tolerance: the CUDA path stores weights, GEMM inputs and the KV cache in fp16 (fp32
// accumulation), the CPU path keeps fp32 activations and cache, so logits differ by fp16
// rounding carried through 6 layers: we require max |cuda - cpu| <= 2 % of the step's logit
// range, and the same argmax wherever the CPU's top-2 margin exceeds 5 % of that range.
#include "cuda/cuda_model.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "core/compress/compressed_kv_cache.h"
#include "core/compress/transform_calibration.h"
#include "core/compress/transform_kv_cache.h"
#include "core/engine/engine.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/model/model.h"
#include "core/model/sampler.h"
#include "core/tokenizer/tokenizer.h"
#include "cuda/device_compressed_kv_cache.h"
#include "cuda/device_transform_kv_cache.h"
#include "cuda/step_graphs.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/core/model/tiny_model_util.h"
#include "tests/kernels/cuda_test_util.h"

namespace subspace::cuda {
namespace {

// SUBSPACE_TEST_MODEL overrides the path (binaries carried to a GPU machine by
// scripts/gpu_bundle.sh run from another checkout).
std::string ModelPath() {
  const char* env = std::getenv("SUBSPACE_TEST_MODEL");
  return env != nullptr ? env : SUBSPACE_SOURCE_DIR "/models/subspace-tiny.gguf";
}

struct Pair {
  std::shared_ptr<LlamaModel> cpu;
  std::unique_ptr<KvCache> cpu_cache;
  CudaBackend cuda;
};

// Both backends on the compressed cache with one installed basis (random orthonormal, rank
// head_dim / 4: the comparison is of the implementations, not of the basis), sinks 4, window 32.
// refresh: online refresh on both caches, inline (each publishes at the same steps).
// outlier_threshold: both caches'. query_readback_bytes: the device's kqsvd query readback.
Pair OpenCompressed(
    CoeffDtype coeff_dtype, const RefreshConfig& refresh = {}, float outlier_threshold = 1.0f,
    int64_t query_readback_bytes = CudaCompressedCacheOptions().query_readback_bytes) {
  Pair p;
  absl::StatusOr<std::unique_ptr<LlamaModel>> cpu = LlamaModel::Open(ModelPath());
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  if (!cpu.ok()) return p;
  p.cpu = *std::move(cpu);
  const KvCacheGeometry g = p.cpu->config().cache_geometry();
  const int r = g.head_dim / 4;
  std::shared_ptr<const Basis> basis = cache_test::OrthoBasis(g, r, r, 17);
  CompressedKvCacheConfig c;
  c.geometry = g;
  c.block_size = 16;
  c.policy.sink_tokens = 4;
  c.policy.window_tokens = 32;
  c.policy.coeff_dtype = coeff_dtype;
  c.capacity_bytes = int64_t{64} << 20;
  c.refresh = refresh;
  c.refresh_inline = true;
  c.policy.outlier_threshold = outlier_threshold;
  c.n_query_heads = p.cpu->config().n_heads;
  absl::StatusOr<std::unique_ptr<CompressedKvCache>> cache = CompressedKvCache::Create(c);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return p;
  absl::StatusOr<EpochId> epoch = (*cache)->InstallBasis(basis);
  EXPECT_TRUE(epoch.ok() && (*cache)->SetDefaultEpoch(*epoch).ok());
  p.cpu_cache = *std::move(cache);
  CudaCompressedCacheOptions co;
  co.policy.sink_tokens = 4;
  co.policy.window_tokens = 32;
  co.policy.coeff_dtype = coeff_dtype;
  co.basis = basis;
  co.refresh = refresh;
  co.refresh_inline = true;
  co.basis_capacity = 32;  // every epoch of the refresh test stays live
  co.policy.outlier_threshold = outlier_threshold;
  co.query_readback_bytes = query_readback_bytes;
  absl::StatusOr<CudaBackend> cuda = CreateCudaBackend(*p.cpu, {.max_batch_tokens = 256,
                                                                .max_sequences = 8,
                                                                .block_size = 16,
                                                                .kv_cache_bytes = int64_t{32} << 20,
                                                                .compressed = co});
  EXPECT_TRUE(cuda.ok()) << cuda.status();
  if (cuda.ok()) p.cuda = *std::move(cuda);
  return p;
}

Pair Open(int max_batch_tokens = 256, int max_sequences = 8,
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

// Runs `chunks` (seq index, token count) as one step on both backends and compares logits
// (within `tolerance` of each row's range; negative: only that they are finite).
void StepBoth(Pair& p, std::vector<SeqId>& cpu_seqs, std::vector<SeqId>& gpu_seqs,
              const std::vector<std::pair<int, std::vector<int32_t>>>& chunks,
              const std::string& what, float tolerance = 0.02f) {
  std::vector<SequenceChunk> cpu_batch, gpu_batch;
  for (const auto& [s, tokens] : chunks) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    ASSERT_TRUE(p.cpu_cache->Reserve(cpu_seqs[s], n).ok());
    ASSERT_TRUE(p.cuda.cache->Reserve(gpu_seqs[s], n).ok());
    cpu_batch.push_back({cpu_seqs[s], p.cpu_cache->Length(cpu_seqs[s]), tokens});
    gpu_batch.push_back({gpu_seqs[s], p.cuda.cache->Length(gpu_seqs[s]), tokens});
  }
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

TEST(CudaModelTest, LogitsMatchTheCpuBackendAcrossPrefillAndDecode) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p = Open();
  ASSERT_NE(p.cuda.model, nullptr);
  std::vector<SeqId> cpu_seqs, gpu_seqs;
  for (int s = 0; s < 3; ++s) {
    cpu_seqs.push_back(*p.cpu_cache->CreateSequence());
    gpu_seqs.push_back(*p.cuda.cache->CreateSequence());
  }
  const auto tokens = [](int n, int salt) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back(1 + (i * 37 + salt * 101) % 900);
    return t;
  };
  // Prefills of different lengths (one crossing several blocks), one step.
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, tokens(37, 0)}, {1, tokens(5, 1)}}, "prefill");
  // Decodes of both plus a chunked prefill of a third sequence: mixed step.
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, {42}}, {1, {7}}, {2, tokens(20, 2)}}, "mixed");
  // The third continues with a second chunk over its cached prefix.
  StepBoth(p, cpu_seqs, gpu_seqs, {{2, tokens(19, 3)}, {0, {99}}}, "chunked");
  for (int step = 0; step < 40; ++step) {
    StepBoth(p, cpu_seqs, gpu_seqs,
             {{0, {static_cast<int32_t>(3 + step)}},
              {1, {static_cast<int32_t>(50 + step)}},
              {2, {static_cast<int32_t>(400 + step)}}},
             "decode " + std::to_string(step));
  }
}

// Qwen2 (Q/K/V biases and the halves RoPE layout, in the RoPE kernel), Qwen3 (per-head Q/K
// norms there too, on 128-wide heads of a 256-wide model) and Phi-3 (halves RoPE, fused QKV and
// gate-up uploaded from their row slices) on the device: random tiny models against the CPU
// backend across prefill and decode.
class CudaModelFamilyTest : public ::testing::TestWithParam<std::string> {};

// A random tiny model of `architecture` with 64-wide heads (the kernels' smallest), 256 tokens
// of context, on both backends.
Pair OpenFamilyModel(const std::string& architecture, int head_dim = 0, int sliding_window = 0) {
  ::subspace::testing::TinyModelOptions o;
  o.architecture = architecture;
  o.head_dim = head_dim;
  o.dim = 256;
  o.heads = 4;
  o.kv_heads = 2;
  o.ffn = 128;
  o.context = 256;
  o.weight_std = 0.15f;
  o.sliding_window = sliding_window;
  absl::StatusOr<std::unique_ptr<GgufFile>> file =
      GgufFile::FromBytes(::subspace::testing::BuildTinyLlamaGguf(o));
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return {};
  return Open(256, 8, std::shared_ptr<const GgufFile>(*std::move(file)));
}

TEST_P(CudaModelFamilyTest, LogitsMatchTheCpuBackend) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  // Qwen3: heads wider than dim / heads (q_width 512).
  Pair p = OpenFamilyModel(GetParam(), GetParam() == "qwen3" ? 128 : 0);
  ASSERT_NE(p.cuda.model, nullptr);
  ASSERT_EQ(p.cpu->config().architecture, GetParam());
  ASSERT_EQ(p.cpu->config().qkv_bias, GetParam() == "qwen2");
  ASSERT_EQ(p.cpu->config().rope_layout, RopeLayout::kHalves);
  const int vocab = p.cpu->config().n_vocab;
  std::vector<SeqId> cpu_seqs, gpu_seqs;
  for (int s = 0; s < 2; ++s) {
    cpu_seqs.push_back(*p.cpu_cache->CreateSequence());
    gpu_seqs.push_back(*p.cuda.cache->CreateSequence());
  }
  const auto tokens = [vocab](int n, int salt) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back(1 + (i * 37 + salt * 101) % (vocab - 1));
    return t;
  };
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, tokens(37, 0)}, {1, tokens(5, 1)}}, "prefill");
  for (int step = 0; step < 20; ++step) {
    StepBoth(p, cpu_seqs, gpu_seqs,
             {{0, {static_cast<int32_t>(3 + step)}}, {1, {static_cast<int32_t>(50 + step)}}},
             "decode " + std::to_string(step));
  }
}

// A sliding-window model: the device kernels attend every cached token, so the CUDA runner
// reports the window as its context (the engine and server admit no more), where the CPU
// backend masks the window and keeps the trained context.
TEST(CudaModelTest, SlidingWindowModelIsServedUpToItsWindow) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p = OpenFamilyModel("phi3", 0, /*sliding_window=*/40);
  ASSERT_NE(p.cuda.model, nullptr);
  EXPECT_EQ(p.cpu->config().sliding_window, 40);
  EXPECT_EQ(p.cpu->config().context_length, 256);
  EXPECT_EQ(p.cuda.model->config().context_length, 40);
  EXPECT_EQ(p.cuda.model->config().sliding_window, 40);
}

INSTANTIATE_TEST_SUITE_P(Families, CudaModelFamilyTest, ::testing::Values("qwen2", "qwen3", "phi3"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// The compressed cache on both backends: prefills long enough to leave the window, a second
// chunk over a compressed history (expanded into scratch pages for the prefill kernel), then
// decodes whose attention runs over mixed blocks while more blocks are coded step by step.
class CudaModelCompressedTest : public ::testing::TestWithParam<CoeffDtype> {};

void CompareMixedSteps(Pair& p) {
  std::vector<SeqId> cpu_seqs, gpu_seqs;
  for (int s = 0; s < 3; ++s) {
    cpu_seqs.push_back(*p.cpu_cache->CreateSequence());
    gpu_seqs.push_back(*p.cuda.cache->CreateSequence());
  }
  const auto tokens = [](int n, int salt) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back(1 + (i * 37 + salt * 101) % 900);
    return t;
  };
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, tokens(100, 0)}, {1, tokens(70, 1)}}, "prefill");
  EXPECT_GT(p.cuda.cache->Stats().bytes_used_compressed, 0);
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, {42}}, {1, tokens(60, 2)}, {2, tokens(90, 3)}}, "history");
  for (int step = 0; step < 40; ++step) {
    StepBoth(p, cpu_seqs, gpu_seqs,
             {{0, {static_cast<int32_t>(3 + step)}},
              {1, {static_cast<int32_t>(50 + step)}},
              {2, {static_cast<int32_t>(400 + step)}}},
             "decode " + std::to_string(step));
  }
  // Truncation into a compressed block on both, then more decoding.
  ASSERT_TRUE(p.cpu_cache->Truncate(cpu_seqs[0], 57).ok());
  ASSERT_TRUE(p.cuda.cache->Truncate(gpu_seqs[0], 57).ok());
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, tokens(9, 4)}, {1, {5}}}, "after truncation");
}

TEST_P(CudaModelCompressedTest, LogitsMatchTheCpuCompressedCache) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p = OpenCompressed(GetParam());
  ASSERT_NE(p.cuda.model, nullptr);
  CompareMixedSteps(p);
  const KvCacheStats st = p.cuda.cache->Stats();
  EXPECT_LT(st.bytes_used_full + st.bytes_used_compressed, st.bytes_full_fp16_equivalent);
}

// The transform-coded cache on both backends (sinks 4, window 32), codes fitted on the model's
// own keys and values at 3 / 2 bits, keys coded before or after RoPE: the same mixed steps.
class CudaModelTransformTest : public ::testing::TestWithParam<bool> {};

TEST_P(CudaModelTransformTest, LogitsMatchTheCpuTransformCache) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  const bool pre_rope = GetParam();
  Pair p;
  absl::StatusOr<std::unique_ptr<LlamaModel>> cpu = LlamaModel::Open(ModelPath());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  p.cpu = *std::move(cpu);
  std::vector<int32_t> text;
  for (int i = 0; i < 600; ++i) text.push_back(1 + (i * 7919 + i / 13) % 900);
  absl::StatusOr<KvRows> rows = CollectKvRows(*p.cpu, text, {.window = 200});
  ASSERT_TRUE(rows.ok()) << rows.status();
  absl::StatusOr<TransformCodes> codes =
      FitTransformCodes(*rows, {.key_bits = 3.0, .value_bits = 2.0, .pre_rope_keys = pre_rope});
  ASSERT_TRUE(codes.ok()) << codes.status();
  TransformKvCacheConfig c;
  c.geometry = p.cpu->config().cache_geometry();
  c.block_size = 16;
  c.sink_tokens = 4;
  c.window_tokens = 32;
  c.key_codes = codes->keys;
  c.value_codes = codes->values;
  if (pre_rope) c.key_rope = rows->rope;
  c.capacity_bytes = int64_t{64} << 20;
  absl::StatusOr<std::unique_ptr<TransformKvCache>> cache = TransformKvCache::Create(c);
  ASSERT_TRUE(cache.ok()) << cache.status();
  p.cpu_cache = *std::move(cache);
  absl::StatusOr<CudaBackend> cuda = CreateCudaBackend(
      *p.cpu, {.max_batch_tokens = 256,
               .max_sequences = 8,
               .block_size = 16,
               .kv_cache_bytes = int64_t{32} << 20,
               .transform = CudaTransformCacheOptions{.sink_tokens = 4,
                                                      .window_tokens = 32,
                                                      .key_codes = codes->keys,
                                                      .value_codes = codes->values,
                                                      .pre_rope_keys = pre_rope}});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  p.cuda = *std::move(cuda);
  CompareMixedSteps(p);
  auto* device_cache = dynamic_cast<DeviceTransformKvCache*>(p.cuda.cache.get());
  ASSERT_NE(device_cache, nullptr);
  EXPECT_GT(device_cache->Detail().blocks_coded, 0);
  // The same blocks are coded on both, in fewer bytes than fp16.
  const KvCacheStats gpu = p.cuda.cache->Stats(), host = p.cpu_cache->Stats();
  EXPECT_EQ(gpu.tokens_cached, host.tokens_cached);
  EXPECT_LT(gpu.bytes_used_full + gpu.bytes_used_compressed, gpu.bytes_full_fp16_equivalent);
}

INSTANTIATE_TEST_SUITE_P(Keys, CudaModelTransformTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("PreRope") : std::string("PostRope");
                         });

// Outliers: at a threshold this low every coded token is one, in every layer on both caches
// (the device decides for all layers at once, the CPU per layer: here they agree), so the
// detection, the moves into outlier pages, decode attention through the masks, the prefill
// scratch and the truncation putting outliers back all run against the CPU cache.
TEST_P(CudaModelCompressedTest, OutlierTokensMatchTheCpuCompressedCache) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p = OpenCompressed(GetParam(), {}, /*outlier_threshold=*/1e-3f);
  ASSERT_NE(p.cuda.model, nullptr);
  CompareMixedSteps(p);
  auto* device_cache = dynamic_cast<DeviceCompressedKvCache*>(p.cuda.cache.get());
  ASSERT_NE(device_cache, nullptr);
  const DeviceCompressedKvCacheDetail detail = device_cache->Detail();
  EXPECT_GT(detail.outlier_tokens, 0);
  EXPECT_EQ(detail.outlier_tokens, detail.blocks_compressed * 16);
  EXPECT_EQ(detail.outliers_dropped, 0);
  EXPECT_GT(p.cuda.cache->Stats().bytes_used_outlier, 0);
}

// Online refresh on both caches (pca every two blocks, no compaction: every epoch stays). The
// device reads the compressed blocks back and the refresher publishes at the next Flush that
// finds the copy landed; the test waits for the device between steps, so that is the next
// step's first Flush, before its Commits: the same steps as the CPU cache's installs.
TEST_P(CudaModelCompressedTest, OnlineRefreshInstallsTheCpuCachesEpochs) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  RefreshConfig refresh;
  refresh.method = RefreshMethod::kPca;
  refresh.every_tokens = 32;
  refresh.max_epochs = 32;
  Pair p = OpenCompressed(GetParam(), refresh);
  ASSERT_NE(p.cuda.model, nullptr);
  std::vector<SeqId> cpu_seqs, gpu_seqs;
  for (int s = 0; s < 2; ++s) {
    cpu_seqs.push_back(*p.cpu_cache->CreateSequence());
    gpu_seqs.push_back(*p.cuda.cache->CreateSequence());
  }
  std::vector<int32_t> prompt;
  for (int i = 0; i < 90; ++i) prompt.push_back(1 + (i * 53) % 900);
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, prompt}, {1, {prompt.begin(), prompt.begin() + 70}}},
           "prefill");
  for (int step = 0; step < 120; ++step) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    StepBoth(p, cpu_seqs, gpu_seqs,
             {{0, {static_cast<int32_t>(3 + step)}}, {1, {static_cast<int32_t>(500 + step)}}},
             "decode " + std::to_string(step));
  }
  const KvCacheStats cpu = p.cpu_cache->Stats(), gpu = p.cuda.cache->Stats();
  EXPECT_GE(gpu.refresh.installed, 4);
  EXPECT_EQ(gpu.refresh.installed, cpu.refresh.installed);
  EXPECT_EQ(gpu.epochs_live, cpu.epochs_live);
}

// KQ-SVD refresh: the device reads every kqsvd sequence's query rows back after each step and
// hands them to the same refresher; both caches install epochs at the same steps and stay within
// the logits tolerance (the queries differ by fp16 rounding and GPU arithmetic). With a readback
// of max_sequences rows only, the prefill chunks are read back as weighted subsets: epochs land
// at the same steps (they are counted by blocks), the bases differ somewhat, logits stay finite.
TEST_P(CudaModelCompressedTest, KqsvdRefreshReadsTheQueriesBack) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  RefreshConfig refresh;
  refresh.method = RefreshMethod::kKqsvd;
  refresh.every_tokens = 32;
  refresh.max_epochs = 32;
  for (const bool tight : {false, true}) {
    SCOPED_TRACE(tight ? "readback of max_sequences rows" : "every query read back");
    std::unique_ptr<LlamaModel> probe = *LlamaModel::Open(ModelPath());
    const ModelConfig& m = probe->config();
    const int64_t row_bytes = int64_t{m.n_layers} * m.n_heads * m.head_dim * 2;
    Pair p = OpenCompressed(GetParam(), refresh, 1.0f,
                            tight ? row_bytes : CudaCompressedCacheOptions().query_readback_bytes);
    ASSERT_NE(p.cuda.model, nullptr);
    std::vector<SeqId> cpu_seqs, gpu_seqs;
    for (int s = 0; s < 2; ++s) {
      cpu_seqs.push_back(*p.cpu_cache->CreateSequence());
      gpu_seqs.push_back(*p.cuda.cache->CreateSequence());
    }
    const float tolerance = tight ? -1.0f : 0.02f;
    std::vector<int32_t> prompt;
    for (int i = 0; i < 90; ++i) prompt.push_back(1 + (i * 53) % 900);
    StepBoth(p, cpu_seqs, gpu_seqs, {{0, prompt}, {1, {prompt.begin(), prompt.begin() + 70}}},
             "prefill", tolerance);
    // A second prefill chunk once both sequences refresh (want queries), then decodes.
    StepBoth(p, cpu_seqs, gpu_seqs, {{0, {prompt.begin(), prompt.begin() + 40}}}, "chunk",
             tolerance);
    for (int step = 0; step < 100; ++step) {
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      StepBoth(p, cpu_seqs, gpu_seqs,
               {{0, {static_cast<int32_t>(3 + step)}}, {1, {static_cast<int32_t>(500 + step)}}},
               "decode " + std::to_string(step), tolerance);
    }
    const KvCacheStats cpu = p.cpu_cache->Stats(), gpu = p.cuda.cache->Stats();
    EXPECT_GE(gpu.refresh.installed, 4);
    EXPECT_EQ(gpu.refresh.installed, cpu.refresh.installed);
    EXPECT_EQ(gpu.refresh.observations_dropped, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Codes, CudaModelCompressedTest,
                         ::testing::Values(CoeffDtype::kFp16, CoeffDtype::kInt8),
                         [](const ::testing::TestParamInfo<CoeffDtype>& info) {
                           return std::string(CoeffDtypeName(info.param));
                         });

TEST(CudaModelTest, AllLogitsRowsMatch) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p = Open();
  ASSERT_NE(p.cuda.model, nullptr);
  std::vector<SeqId> cpu_seqs = {*p.cpu_cache->CreateSequence()};
  std::vector<SeqId> gpu_seqs = {*p.cuda.cache->CreateSequence()};
  std::vector<int32_t> t;
  for (int i = 0; i < 70; ++i) t.push_back(1 + i * 13 % 700);
  std::vector<SequenceChunk> cpu_batch = {{cpu_seqs[0], 0, t, true}};
  std::vector<SequenceChunk> gpu_batch = {{gpu_seqs[0], 0, t, true}};
  ASSERT_TRUE(p.cpu_cache->Reserve(cpu_seqs[0], 70).ok());
  ASSERT_TRUE(p.cuda.cache->Reserve(gpu_seqs[0], 70).ok());
  std::vector<float> c, g;
  ASSERT_TRUE(p.cpu->Forward(cpu_batch, *p.cpu_cache, &c).ok());
  ASSERT_TRUE(p.cuda.model->Forward(gpu_batch, *p.cuda.cache, &g).ok());
  ASSERT_EQ(c.size(), g.size());
  ASSERT_EQ(c.size(), 70u * p.cpu->config().n_vocab);
  double worst = 0.0;
  for (size_t i = 0; i < c.size(); ++i) worst = std::max(worst, double{std::fabs(c[i] - g[i])});
  EXPECT_LT(worst, 0.5);  // logits span ~20 on this model; fp16 rounding stays far below
}

// Decode steps replayed as CUDA graphs (the default) against the same steps launched one kernel
// at a time, on both caches: the same kernels on the same inputs, so the logits agree to float
// noise (exactly, unless cuBLAS picks another algorithm under capture); the batch size changes
// now and then, so graphs are both updated and instantiated, and mixed steps run eagerly.
TEST(CudaModelTest, DecodeStepsReplayedAsGraphsGiveTheEagerLogits) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  absl::StatusOr<std::unique_ptr<LlamaModel>> cpu = LlamaModel::Open(ModelPath());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const KvCacheGeometry g = (*cpu)->config().cache_geometry();
  for (const bool compressed : {false, true}) {
    SCOPED_TRACE(compressed ? "compressed cache" : "full-rank cache");
    CudaModelOptions options = {.max_batch_tokens = 256,
                                .max_sequences = 8,
                                .block_size = 16,
                                .kv_cache_bytes = int64_t{32} << 20,
                                .cuda_graphs = true};
    if (compressed) {
      CudaCompressedCacheOptions co;
      co.policy.window_tokens = 32;
      co.basis = cache_test::OrthoBasis(g, g.head_dim / 4, g.head_dim / 4, 17);
      options.compressed = co;
    }
    CudaModelOptions eager_options = options;
    eager_options.cuda_graphs = false;
    absl::StatusOr<CudaBackend> graphed = CreateCudaBackend(**cpu, options);
    absl::StatusOr<CudaBackend> eager = CreateCudaBackend(**cpu, eager_options);
    ASSERT_TRUE(graphed.ok() && eager.ok()) << graphed.status() << eager.status();
    std::vector<SeqId> gs, es;
    for (int s = 0; s < 3; ++s) {
      gs.push_back(*graphed->cache->CreateSequence());
      es.push_back(*eager->cache->CreateSequence());
    }
    int64_t decode_steps = 0;
    for (int step = 0; step < 60; ++step) {
      // Prompts first (eager on both); then three, sometimes two, decodes per step.
      std::vector<std::vector<int32_t>> tokens;
      for (int s = 0; s < 3; ++s) {
        if (step == 0) {
          std::vector<int32_t> prompt;
          for (int i = 0; i < 40 + 17 * s; ++i) prompt.push_back(1 + (i * 37 + s * 101) % 900);
          tokens.push_back(prompt);
        } else if (s < 2 || step % 7 != 0) {
          tokens.push_back({static_cast<int32_t>(1 + (step * 31 + s * 7) % 900)});
        }
      }
      std::vector<SequenceChunk> gb, eb;
      for (size_t s = 0; s < tokens.size(); ++s) {
        const int64_t n = static_cast<int64_t>(tokens[s].size());
        ASSERT_TRUE(graphed->cache->Reserve(gs[s], n).ok());
        ASSERT_TRUE(eager->cache->Reserve(es[s], n).ok());
        gb.push_back({gs[s], graphed->cache->Length(gs[s]), tokens[s]});
        eb.push_back({es[s], eager->cache->Length(es[s]), tokens[s]});
      }
      std::vector<float> gl, el;
      ASSERT_TRUE(graphed->model->Forward(gb, *graphed->cache, &gl).ok()) << "step " << step;
      ASSERT_TRUE(eager->model->Forward(eb, *eager->cache, &el).ok()) << "step " << step;
      ASSERT_EQ(gl.size(), el.size());
      float worst = 0.0f, range = 0.0f;
      for (size_t i = 0; i < gl.size(); ++i) {
        worst = std::max(worst, std::fabs(gl[i] - el[i]));
        range = std::max(range, std::fabs(el[i]));
      }
      EXPECT_LE(worst, 1e-4f * range) << "step " << step;
      if (step > 0) ++decode_steps;
    }
    // Each batch size's first step runs eagerly, every later one as a graph.
    const StepGraphStats st = graphed->model->graph_stats();
    EXPECT_EQ(st.capture_failures, 0);
    EXPECT_EQ(st.eager, 2);  // batch 3 and batch 2
    EXPECT_EQ(st.replays, decode_steps - 2);
    EXPECT_GT(st.updates, 0);
    EXPECT_GE(st.instantiations, 2);
    EXPECT_EQ(eager->model->graph_stats().replays + eager->model->graph_stats().eager, 0);
  }
}

// Rows sampled on the device against the host sampler on the same logits: two backends run the
// same steps, one returning logits that seeded host Samplers sample, the other sampling with
// identically seeded Samplers' rows (NextRow draws what Sample would). Greedy rows must agree
// exactly; stochastic ones too, but for draws within float rounding of a boundary.
TEST(CudaModelTest, DeviceSamplingPicksTheHostSamplersTokens) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  absl::StatusOr<std::unique_ptr<LlamaModel>> cpu = LlamaModel::Open(ModelPath());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const CudaModelOptions options = {.max_batch_tokens = 256,
                                    .max_sequences = 8,
                                    .block_size = 16,
                                    .kv_cache_bytes = int64_t{32} << 20};
  absl::StatusOr<CudaBackend> logits_backend = CreateCudaBackend(**cpu, options);
  absl::StatusOr<CudaBackend> sampling_backend = CreateCudaBackend(**cpu, options);
  ASSERT_TRUE(logits_backend.ok() && sampling_backend.ok());
  const std::vector<SamplingParams> params = {{},
                                              {.temperature = 0.8f, .top_k = 40, .seed = 7},
                                              {.temperature = 1.0f, .top_p = 0.9f, .seed = 3},
                                              {.temperature = 1.2f, .min_p = 0.05f, .seed = 11}};
  std::vector<Sampler> host_samplers, row_samplers;
  std::vector<SeqId> ls, ss;
  std::vector<std::vector<int32_t>> next(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    host_samplers.emplace_back(params[i]);
    row_samplers.emplace_back(params[i]);
    ls.push_back(*logits_backend->cache->CreateSequence());
    ss.push_back(*sampling_backend->cache->CreateSequence());
    for (int t = 0; t < 20 + 5 * static_cast<int>(i); ++t) {
      next[i].push_back(1 + (t * 37 + static_cast<int>(i) * 101) % 900);
    }
  }
  const int vocab = (*cpu)->config().n_vocab;
  int stochastic = 0, agreed = 0;
  for (int step = 0; step < 30; ++step) {
    std::vector<SequenceChunk> lb, sb;
    std::vector<RowSampling> rows;
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t n = static_cast<int64_t>(next[i].size());
      ASSERT_TRUE(logits_backend->cache->Reserve(ls[i], n).ok());
      ASSERT_TRUE(sampling_backend->cache->Reserve(ss[i], n).ok());
      lb.push_back({ls[i], logits_backend->cache->Length(ls[i]), next[i]});
      sb.push_back({ss[i], sampling_backend->cache->Length(ss[i]), next[i]});
      rows.push_back(row_samplers[i].NextRow());
    }
    std::vector<float> logits;
    std::vector<TokenLogprob> sampled;
    ASSERT_TRUE(logits_backend->model->Forward(lb, *logits_backend->cache, &logits).ok());
    ASSERT_TRUE(
        sampling_backend->model->ForwardAndSample(sb, *sampling_backend->cache, rows, &sampled)
            .ok());
    ASSERT_EQ(sampled.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      std::span<float> row(logits.data() + i * vocab, static_cast<size_t>(vocab));
      const SampledToken want = host_samplers[i].Sample(row, {});
      if (params[i].temperature == 0.0f) {
        EXPECT_EQ(sampled[i].token, want.token) << "greedy, step " << step;
      } else {
        ++stochastic;
        agreed += sampled[i].token == want.token;
      }
      if (sampled[i].token == want.token) {
        EXPECT_NEAR(sampled[i].logprob, want.logprob, 1e-3f) << "step " << step << " row " << i;
      }
      // Both continue with the host's pick, so the two caches stay identical.
      next[i] = {want.token};
    }
  }
  EXPECT_GE(agreed, stochastic - 2) << agreed << " of " << stochastic;
}

TEST(CudaModelTest, RejectsForeignCachesAndOversizedSteps) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p = Open(/*max_batch_tokens=*/32, /*max_sequences=*/2);
  ASSERT_NE(p.cuda.model, nullptr);
  const SeqId cpu_seq = *p.cpu_cache->CreateSequence();
  ASSERT_TRUE(p.cpu_cache->Reserve(cpu_seq, 1).ok());
  std::vector<int32_t> one = {1};
  std::vector<float> logits;
  std::vector<SequenceChunk> batch = {{cpu_seq, 0, one}};
  EXPECT_EQ(p.cuda.model->Forward(batch, *p.cpu_cache, &logits).code(),
            absl::StatusCode::kInvalidArgument);
  // And the CPU backend refuses the device cache.
  const SeqId gpu_seq = *p.cuda.cache->CreateSequence();
  ASSERT_TRUE(p.cuda.cache->Reserve(gpu_seq, 40).ok());
  batch = {{gpu_seq, 0, one}};
  EXPECT_EQ(p.cpu->Forward(batch, *p.cuda.cache, &logits).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> many(40, 5);
  batch = {{gpu_seq, 0, many}};
  EXPECT_EQ(p.cuda.model->Forward(batch, *p.cuda.cache, &logits).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.cuda.cache->Length(gpu_seq), 0);  // nothing committed
}

TEST(CudaModelTest, TakesExactlyTheConfiguredPool) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p = Open();
  ASSERT_NE(p.cuda.model, nullptr);
  const int64_t block = DevicePagedKvCache::BlockBytes(p.cpu->config().cache_geometry(), 16);
  EXPECT_EQ(p.cuda.cache->Stats().bytes_total, (int64_t{32} << 20) / block * block);
  EXPECT_EQ(p.cuda.model->memory_use().kv_pool, p.cuda.cache->Stats().bytes_total);
  EXPECT_GT(p.cuda.model->memory_use().weights, 0);
  EXPECT_NE(p.cuda.model->device_name().find("cuda:0"), std::string::npos);
}

// The engine, unchanged, on the CUDA backend: greedy generation equals the CPU engine's while
// the CPU's choices are clear (the tolerance above); here we only require the first 8 tokens.
TEST(CudaModelTest, EngineGeneratesOnTheCudaBackend) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(ModelPath());
  ASSERT_TRUE(file.ok());
  std::shared_ptr<const GgufFile> gguf = *std::move(file);
  std::shared_ptr<const Tokenizer> tokenizer = *Tokenizer::FromGguf(*gguf);
  std::shared_ptr<LlamaModel> cpu = *LlamaModel::Load(gguf);

  struct Collect : GenerateObserver {
    std::vector<int32_t> tokens;
    absl::Notification done;
    void OnTokens(std::span<const GeneratedTokenEvent> t) override {
      for (const auto& e : t) tokens.push_back(e.token);
    }
    void OnFinish(const GenerateResult&) override { done.Notify(); }
  };
  const auto generate = [&](std::shared_ptr<ModelRunner> model,
                            std::unique_ptr<KvCacheBase> cache) {
    EngineConfig config;
    config.max_batch_tokens = 256;
    config.max_running = 8;
    auto engine = Engine::Create(config, std::move(model), tokenizer, std::move(cache));
    EXPECT_TRUE(engine.ok()) << engine.status();
    GenerateRequest req;
    req.prompt = tokenizer->Encode("Once upon a time");
    req.max_new_tokens = 8;
    req.ignore_eos = true;
    auto obs = std::make_shared<Collect>();
    EXPECT_TRUE((*engine)->Submit(req, obs).ok());
    obs->done.WaitForNotification();
    return obs->tokens;
  };
  auto cpu_cache = *PagedKvCache::Create({.geometry = cpu->config().cache_geometry(),
                                          .block_size = 16,
                                          .capacity_bytes = int64_t{64} << 20});
  const std::vector<int32_t> want = generate(cpu, std::move(cpu_cache));
  absl::StatusOr<CudaBackend> cuda = CreateCudaBackend(*cpu, {.max_batch_tokens = 256,
                                                              .max_sequences = 8,
                                                              .block_size = 16,
                                                              .kv_cache_bytes = int64_t{32} << 20});
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  const std::vector<int32_t> got = generate(cuda->model, std::move(cuda->cache));
  EXPECT_EQ(got, want);
}

// A session on the CUDA backend's full cache moves: exported (its device pages copied out),
// imported into another CUDA engine, it continues as the uninterrupted one, its cache reused.
// A session exported from one CUDA engine continues in another exactly as the one left behind
// does. transform: on the transform-coded cache (codes fitted on the model's own rows, sinks 4,
// window 16), with a prompt long enough to have coded blocks; else the full-rank cache.
void ExpectSessionMovesBetweenCudaEnginesBitwise(bool transform) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(ModelPath());
  ASSERT_TRUE(file.ok());
  std::shared_ptr<const GgufFile> gguf = *std::move(file);
  std::shared_ptr<const Tokenizer> tokenizer = *Tokenizer::FromGguf(*gguf);
  std::shared_ptr<LlamaModel> cpu = *LlamaModel::Load(gguf);
  std::optional<CudaTransformCacheOptions> codec;
  std::string text = "Once upon a time there was";
  if (transform) {
    std::vector<int32_t> calib;
    for (int i = 0; i < 400; ++i) calib.push_back(1 + (i * 7919 + i / 13) % 900);
    absl::StatusOr<KvRows> rows = CollectKvRows(*cpu, calib, {.window = 200});
    ASSERT_TRUE(rows.ok()) << rows.status();
    absl::StatusOr<TransformCodes> codes =
        FitTransformCodes(*rows, {.key_bits = 3.0, .value_bits = 2.0});
    ASSERT_TRUE(codes.ok()) << codes.status();
    codec = CudaTransformCacheOptions{.sink_tokens = 4,
                                      .window_tokens = 16,
                                      .key_codes = codes->keys,
                                      .value_codes = codes->values,
                                      .pre_rope_keys = true};
    for (int i = 0; i < 4; ++i) text += " a small cat sat on a warm mat near the old door,";
  }
  const auto make_engine = [&]() -> std::unique_ptr<Engine> {
    absl::StatusOr<CudaBackend> cuda = CreateCudaBackend(*cpu, {.max_batch_tokens = 256,
                                                                .max_sequences = 8,
                                                                .block_size = 16,
                                                                .kv_cache_bytes = int64_t{16} << 20,
                                                                .transform = codec});
    EXPECT_TRUE(cuda.ok()) << cuda.status();
    if (!cuda.ok()) return nullptr;
    EngineConfig config;
    config.max_batch_tokens = 256;
    config.max_running = 8;
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(config, cuda->model, tokenizer, std::move(cuda->cache));
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? *std::move(engine) : nullptr;
  };
  struct Collect : GenerateObserver {
    std::vector<int32_t> tokens;
    GenerateResult result;
    absl::Notification done;
    void OnTokens(std::span<const GeneratedTokenEvent> t) override {
      for (const auto& e : t) tokens.push_back(e.token);
    }
    void OnFinish(const GenerateResult& r) override {
      result = r;
      done.Notify();
    }
  };
  const auto turn = [&](Engine& engine, const std::string& session, const std::string& text,
                        bool bos) {
    GenerateRequest req;
    req.prompt = tokenizer->Encode(text, {.add_bos = bos});
    req.max_new_tokens = 6;
    req.ignore_eos = true;
    req.session_id = session;
    auto obs = std::make_shared<Collect>();
    EXPECT_TRUE(engine.Submit(req, obs).ok());
    obs->done.WaitForNotification();
    return std::make_pair(obs->tokens, obs->result.usage.reused_tokens);
  };
  auto a = make_engine();
  auto b = make_engine();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::string moved = a->CreateSession()->id;
  const std::string stays = a->CreateSession()->id;
  EXPECT_EQ(turn(*a, moved, text, true).first, turn(*a, stays, text, true).first);
  if (transform) EXPECT_GT(a->Stats().cache.bytes_used_compressed, 0);
  absl::StatusOr<Engine::ExportedSession> exported = a->ExportSession(moved);
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_TRUE(exported->cache.ok()) << exported->cache;
  absl::StatusOr<Engine::ImportedSession> imported = b->ImportSession(exported->image);
  ASSERT_TRUE(imported.ok()) << imported.status();
  ASSERT_TRUE(imported->cache.ok()) << imported->cache;
  const auto there = turn(*b, moved, " a little", false);
  const auto here = turn(*a, stays, " a little", false);
  EXPECT_EQ(there.first, here.first);
  EXPECT_EQ(there.second, here.second);
  EXPECT_EQ(there.second, imported->info.cached_tokens);
  EXPECT_GT(there.second, 0);
}

TEST(CudaModelTest, SessionMovesBetweenCudaEnginesBitwise) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  ExpectSessionMovesBetweenCudaEnginesBitwise(/*transform=*/false);
}

TEST(CudaModelTest, TransformCodedSessionMovesBetweenCudaEnginesBitwise) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  ExpectSessionMovesBetweenCudaEnginesBitwise(/*transform=*/true);
}

}  // namespace
}  // namespace subspace::cuda
