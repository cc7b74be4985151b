// The CUDA backend end to end against the CPU backend on the default model: the same steps
// (prefills, a chunked prefill over a cached prefix, decodes of several sequences in one batch)
// through CudaLlamaModel + DevicePagedKvCache and LlamaModel + PagedKvCache, logits compared
// after every step; then the engine generating greedily on each, and sessions moving between
// CUDA engines. Skips without a device. The compressed and transform-coded caches are compared
// in cuda_model_cache_test.cc; the tolerance is cuda_model_pair.h's.
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
#include "core/engine/engine.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/model/model.h"
#include "core/model/sampler.h"
#include "core/tokenizer/tokenizer.h"
#include "cuda/step_graphs.h"
#include "tests/core/compress/compressed_kv_cache_test_util.h"
#include "tests/core/model/tiny_model_util.h"
#include "tests/cuda/cuda_model_pair.h"
#include "tests/kernels/cuda_test_util.h"

namespace subspace::cuda {
namespace {

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
  CreateSequences(p, 2, &cpu_seqs, &gpu_seqs);
  const auto tokens = [vocab](int n, int salt) { return PatternTokens(n, salt, vocab); };
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, tokens(37, 0)}, {1, tokens(5, 1)}}, "prefill");
  for (int step = 0; step < 20; ++step) {
    StepBoth(p, cpu_seqs, gpu_seqs,
             {{0, {static_cast<int32_t>(3 + step)}}, {1, {static_cast<int32_t>(50 + step)}}},
             "decode " + std::to_string(step));
  }
}

// A sliding-window model keeps its trained context on the GPU: prefill and decode mask the
// window as the CPU caches do, so the logits agree past it (prompts longer than the window, a
// chunk over a history the window has left behind, decodes far past it, several windows at
// once).
TEST(CudaModelTest, SlidingWindowMatchesTheCpuPastItsWindow) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p = OpenFamilyModel("phi3", 0, /*sliding_window=*/40);
  ASSERT_NE(p.cuda.model, nullptr);
  EXPECT_EQ(p.cpu->config().sliding_window, 40);
  EXPECT_EQ(p.cuda.model->config().context_length, 256);
  EXPECT_EQ(p.cuda.model->config().sliding_window, 40);
  const int vocab = p.cpu->config().n_vocab;
  std::vector<SeqId> cpu_seqs, gpu_seqs;
  CreateSequences(p, 3, &cpu_seqs, &gpu_seqs);
  const auto tokens = [vocab](int n, int salt) { return PatternTokens(n, salt, vocab); };
  StepBoth(p, cpu_seqs, gpu_seqs, {{0, tokens(70, 0)}, {1, tokens(30, 1)}, {2, tokens(3, 2)}},
           "prefill");
  for (int step = 0; step < 24; ++step) {
    StepBoth(p, cpu_seqs, gpu_seqs,
             {{0, {static_cast<int32_t>(3 + step)}},
              {1, {static_cast<int32_t>(50 + step)}},
              {2, {static_cast<int32_t>(90 + step)}}},
             "decode " + std::to_string(step));
  }
  // A chunk over a history the window left behind, beside decodes.
  StepBoth(p, cpu_seqs, gpu_seqs, {{1, {7}}, {2, {8}}, {0, tokens(45, 3)}}, "chunk after decodes");
  for (int step = 0; step < 4; ++step) {
    StepBoth(p, cpu_seqs, gpu_seqs,
             {{0, {static_cast<int32_t>(11 + step)}}, {1, {static_cast<int32_t>(60 + step)}}},
             "decode after the chunk " + std::to_string(step));
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CudaModelFamilyTest, ::testing::Values("qwen2", "qwen3", "phi3"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
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
// does: on the full-rank cache; on the transform-coded one (codes fitted on the model's own
// rows, sinks 4, window 16); on the compressed one (int8 codes, a self-calibrated basis the
// image carries to an engine without one, outliers flagged); the coded caches with a prompt
// long enough to have coded blocks.
enum class MovedCache { kFull, kTransform, kCompressed };
void ExpectSessionMovesBetweenCudaEnginesBitwise(MovedCache kind) {
  const bool transform = kind == MovedCache::kTransform;
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
  }
  std::optional<CudaCompressedCacheOptions> compressed;
  if (kind == MovedCache::kCompressed) {
    compressed = CudaCompressedCacheOptions{};
    compressed->policy.sink_tokens = 4;
    compressed->policy.window_tokens = 16;
    compressed->policy.coeff_dtype = CoeffDtype::kInt8;
    compressed->policy.outlier_threshold = 0.5f;
  }
  if (kind != MovedCache::kFull) {
    for (int i = 0; i < 4; ++i) text += " a small cat sat on a warm mat near the old door,";
  }
  const auto make_engine = [&]() -> std::unique_ptr<Engine> {
    absl::StatusOr<CudaBackend> cuda = CreateCudaBackend(*cpu, {.max_batch_tokens = 256,
                                                                .max_sequences = 8,
                                                                .block_size = 16,
                                                                .kv_cache_bytes = int64_t{16} << 20,
                                                                .compressed = compressed,
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
  if (kind != MovedCache::kFull) {
    EXPECT_GT(a->Stats().cache.bytes_used_compressed, 0);
  }
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
  ExpectSessionMovesBetweenCudaEnginesBitwise(MovedCache::kFull);
}

TEST(CudaModelTest, TransformCodedSessionMovesBetweenCudaEnginesBitwise) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  ExpectSessionMovesBetweenCudaEnginesBitwise(MovedCache::kTransform);
}

TEST(CudaModelTest, CompressedSessionMovesBetweenCudaEnginesBitwise) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  ExpectSessionMovesBetweenCudaEnginesBitwise(MovedCache::kCompressed);
}

}  // namespace
}  // namespace subspace::cuda
