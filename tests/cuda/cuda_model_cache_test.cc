// The CUDA backend's compressed and transform-coded caches end to end against the CPU caches
// on the default model: prefills long enough to leave the window, a chunk over coded history,
// decodes over mixed blocks, truncation into a coded block; outliers, online refresh (PCA and
// KQ-SVD with the queries read back) on the compressed cache; keys before and after RoPE on the
// transform-coded one. Logits compared after every step (cuda_model_pair.h). Skips without a
// device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/compress/compressed_kv_cache.h"
#include "core/compress/transform_calibration.h"
#include "core/compress/transform_kv_cache.h"
#include "core/gguf/gguf.h"
#include "core/model/model.h"
#include "cuda/cuda_model.h"
#include "cuda/device_compressed_kv_cache.h"
#include "cuda/device_transform_kv_cache.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/core/model/tiny_model_util.h"
#include "tests/cuda/cuda_model_pair.h"
#include "tests/kernels/cuda_test_util.h"

namespace subspace::cuda {
namespace {

// Both backends on the compressed cache with one installed basis (random orthonormal, rank
// head_dim / 4: the comparison is of the implementations, not of the basis), sinks 4, window 32.
// refresh: online refresh on both caches, inline (each publishes at the same steps).
// outlier_threshold: both caches'. query_readback_bytes: the device's kqsvd query readback.
// file: another model than the default one.
Pair OpenCompressed(
    CoeffDtype coeff_dtype, const RefreshConfig& refresh = {}, float outlier_threshold = 1.0f,
    int64_t query_readback_bytes = CudaCompressedCacheOptions().query_readback_bytes,
    const std::shared_ptr<const GgufFile>& file = nullptr) {
  Pair p;
  absl::StatusOr<std::unique_ptr<LlamaModel>> cpu =
      file != nullptr ? LlamaModel::Load(file) : LlamaModel::Open(ModelPath());
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

// The op harness over coded history (cuda_model_pair.h's CompareOpsBoth): a prefill past the
// window, a chunk over a coded history and decodes, each device op on the CPU's inputs. The
// device codes the K/V rows it is given (the CPU's, rounded to fp16), so its codes could differ
// from the CPU cache's at a quantizer's boundary; measured, every op of both coded caches stays
// within 0.05 % of its output's largest magnitude (the emulated device, 2026-11-29).
constexpr float kCodedTolerance = 0.01f;

void CompareMixedOps(Pair& p) {
  std::vector<SeqId> cpu_seqs, gpu_seqs;
  CreateSequences(p, 3, &cpu_seqs, &gpu_seqs);
  const int vocab = p.cpu->config().n_vocab;
  const auto tokens = [vocab](int n, int salt) { return PatternTokens(n, salt, vocab); };
  float worst = CompareOpsBoth(p, cpu_seqs, gpu_seqs, {{0, tokens(100, 0)}, {1, tokens(70, 1)}},
                               "prefill", kCodedTolerance);
  worst = std::max(worst, CompareOpsBoth(p, cpu_seqs, gpu_seqs,
                                         {{0, {42}}, {1, tokens(60, 2)}, {2, tokens(90, 3)}},
                                         "history", kCodedTolerance));
  for (int step = 0; step < 3 && !::testing::Test::HasFailure(); ++step) {
    worst = std::max(worst, CompareOpsBoth(p, cpu_seqs, gpu_seqs,
                                           {{0, {static_cast<int32_t>(3 + step)}},
                                            {1, {static_cast<int32_t>(50 + step)}},
                                            {2, {static_cast<int32_t>(400 + step)}}},
                                           "decode " + std::to_string(step), kCodedTolerance));
  }
  std::printf("worst op output %.4f of its largest magnitude\n", worst);
}

TEST_P(CudaModelCompressedTest, EveryOpMatchesTheCpuCompressedCache) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p = OpenCompressed(GetParam());
  ASSERT_NE(p.cuda.model, nullptr);
  CompareMixedOps(p);
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

void OpenTransform(bool pre_rope, Pair* out) {
  Pair& p = *out;
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
}

TEST_P(CudaModelTransformTest, LogitsMatchTheCpuTransformCache) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p;
  OpenTransform(GetParam(), &p);
  ASSERT_NE(p.cuda.model, nullptr);
  CompareMixedSteps(p);
  auto* device_cache = dynamic_cast<DeviceTransformKvCache*>(p.cuda.cache.get());
  ASSERT_NE(device_cache, nullptr);
  EXPECT_GT(device_cache->Detail().blocks_coded, 0);
  // The same blocks are coded on both, in fewer bytes than fp16.
  const KvCacheStats gpu = p.cuda.cache->Stats(), host = p.cpu_cache->Stats();
  EXPECT_EQ(gpu.tokens_cached, host.tokens_cached);
  EXPECT_LT(gpu.bytes_used_full + gpu.bytes_used_compressed, gpu.bytes_full_fp16_equivalent);
}

TEST_P(CudaModelTransformTest, EveryOpMatchesTheCpuTransformCache) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p;
  OpenTransform(GetParam(), &p);
  ASSERT_NE(p.cuda.model, nullptr);
  CompareMixedOps(p);
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

// A sliding-window model (Phi-3 layout, window 56) on the compressed cache (sinks 4, window 32):
// the model's window starts inside the coded blocks, so decode attention masks sink rows and
// coded rows before it, or outlier rows when every coded token is one, and a chunk over the
// history masks the expanded blocks per row.
void CompareWindowedSteps(CoeffDtype coeff_dtype, float outlier_threshold) {
  ::subspace::testing::TinyModelOptions o;
  o.architecture = "phi3";
  o.dim = 256;
  o.heads = 4;
  o.kv_heads = 2;
  o.ffn = 128;
  o.context = 256;
  o.weight_std = 0.15f;
  o.sliding_window = 56;
  absl::StatusOr<std::unique_ptr<GgufFile>> file =
      GgufFile::FromBytes(::subspace::testing::BuildTinyLlamaGguf(o));
  ASSERT_TRUE(file.ok()) << file.status();
  Pair p = OpenCompressed(coeff_dtype, {}, outlier_threshold,
                          CudaCompressedCacheOptions().query_readback_bytes,
                          std::shared_ptr<const GgufFile>(*std::move(file)));
  ASSERT_NE(p.cuda.model, nullptr);
  ASSERT_EQ(p.cpu->config().sliding_window, 56);
  const int vocab = p.cpu->config().n_vocab;
  std::vector<SeqId> cpu_seqs, gpu_seqs;
  CreateSequences(p, 2, &cpu_seqs, &gpu_seqs);
  const auto tokens = [vocab](int n, int salt) { return PatternTokens(n, salt, vocab); };
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, tokens(100, 0)}, {1, tokens(40, 1)}}, "prefill");
  EXPECT_GT(p.cuda.cache->Stats().bytes_used_compressed, 0);
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, {42}}, {1, tokens(50, 2)}}, "history");
  for (int step = 0; step < 30; ++step) {
    StepBoth(p, cpu_seqs, gpu_seqs,
             {{0, {static_cast<int32_t>(3 + step)}}, {1, {static_cast<int32_t>(50 + step)}}},
             "decode " + std::to_string(step));
  }
  auto* device_cache = dynamic_cast<DeviceCompressedKvCache*>(p.cuda.cache.get());
  ASSERT_NE(device_cache, nullptr);
  EXPECT_EQ(device_cache->Detail().outlier_tokens > 0, outlier_threshold < 1.0f);
}

TEST_P(CudaModelCompressedTest, SlidingWindowOverCodedBlocksMatchesTheCpu) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  CompareWindowedSteps(GetParam(), /*outlier_threshold=*/1.0f);
}

TEST_P(CudaModelCompressedTest, SlidingWindowOverOutliersMatchesTheCpu) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  CompareWindowedSteps(GetParam(), /*outlier_threshold=*/1e-3f);
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

}  // namespace
}  // namespace subspace::cuda
