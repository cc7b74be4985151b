// The op-by-op harness (issue 31; llama.cpp's test-backend-ops is the model): random tiny models
// of every family, over random shapes (head width, heads and KV heads, layers, FFN width,
// sliding window), run the same steps on the CPU backend and on the CUDA backend with
// ForwardTraced; every op's every output (core/model/decoder_ops.h) is compared with the CPU's,
// and a failure names the first op that disagrees, its layer and output, and the step. It runs
// on the emulated device in CI (cuda_model_ops_test_emu) and on a real GPU in scripts/gpu_run.sh.
//
// Each device op reads the CPU op's inputs (OpTrace::inputs), so an op is compared alone, not
// through the rounding of every op before it (chained, a random model's sharp softmax turns
// 0.4 % differences in q and k into 3 % in a later layer's attention; the end-to-end logits are
// cuda_model_test's). Tolerance: the device keeps weights, GEMM inputs (xn, the attention output,
// hidden) and the KV cache in fp16 with fp32 accumulation, the CPU all in fp32; each output must
// be within kTolerance of its largest CPU magnitude (the worst per shape is printed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/gguf/gguf.h"
#include "core/model/decoder_ops.h"
#include "tests/core/model/tiny_model_util.h"
#include "tests/cuda/cuda_model_pair.h"
#include "tests/kernels/cuda_test_util.h"

namespace subspace::cuda {
namespace {

constexpr float kTolerance = 0.01f;

struct Shape {
  std::string architecture;
  int head_dim = 64;
  int heads = 4;
  int kv_heads = 2;
  int layers = 2;
  int ffn = 128;
  int window = 0;
  uint32_t seed = 1;
  std::string Name() const {
    return absl::StrFormat("%s hd%d h%d/%d L%d ffn%d window%d seed%d", architecture, head_dim,
                           heads, kv_heads, layers, ffn, window, seed);
  }
};

// The shapes: each family once at the kernels' smallest head width, then random draws (fixed
// seed) over widths, GQA groups, depth and windows.
std::vector<Shape> Shapes() {
  std::vector<Shape> shapes;
  for (const char* arch : {"llama", "qwen2", "qwen3", "phi3"})
    shapes.push_back({.architecture = arch});
  std::mt19937 rng(31);
  const auto pick = [&rng](std::initializer_list<int> v) {
    return *(v.begin() + std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng));
  };
  for (int i = 0; i < 4; ++i) {
    Shape s;
    s.architecture = std::vector<std::string>{"llama", "qwen2", "qwen3", "phi3"}[i];
    s.head_dim = pick({64, 128});
    s.heads = pick({2, 4, 8});
    s.kv_heads = std::min(s.heads, pick({1, 2, 4}));
    s.layers = pick({1, 2, 3});
    s.ffn = pick({64, 192, 256});
    s.window = pick({0, 24});
    s.seed = 100 + static_cast<uint32_t>(i);
    shapes.push_back(s);
  }
  return shapes;
}

Pair OpenShape(const Shape& s) {
  ::subspace::testing::TinyModelOptions o;
  o.architecture = s.architecture;
  o.head_dim = s.head_dim;
  o.heads = s.heads;
  o.kv_heads = s.kv_heads;
  // Qwen3 keeps its heads wider than dim / heads (q_width 2 * dim); the others dim = q_width.
  o.dim = s.architecture == "qwen3" ? s.heads * s.head_dim / 2 : s.heads * s.head_dim;
  o.layers = s.layers;
  o.ffn = s.ffn;
  o.context = 256;
  o.weight_std = 0.15f;
  o.seed = s.seed;
  o.sliding_window = s.window;
  absl::StatusOr<std::unique_ptr<GgufFile>> file =
      GgufFile::FromBytes(::subspace::testing::BuildTinyLlamaGguf(o));
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return {};
  return Open(256, 8, std::shared_ptr<const GgufFile>(*std::move(file)));
}

float CompareStep(Pair& p, std::vector<SeqId>& cpu_seqs, std::vector<SeqId>& gpu_seqs,
                  const StepChunks& chunks, const std::string& what) {
  return CompareOpsBoth(p, cpu_seqs, gpu_seqs, chunks, what, kTolerance);
}

TEST(CudaModelOpsTest, EveryOpOfEveryFamilyMatchesTheCpu) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  for (const Shape& shape : Shapes()) {
    SCOPED_TRACE(shape.Name());
    Pair p = OpenShape(shape);
    ASSERT_NE(p.cuda.model, nullptr);
    ASSERT_EQ(p.cpu->program().ops.size(), static_cast<size_t>(7 * shape.layers + 4));
    const int vocab = p.cpu->config().n_vocab;
    const auto tokens = [vocab](int n, int salt) { return PatternTokens(n, salt, vocab); };
    std::vector<SeqId> cpu_seqs, gpu_seqs;
    CreateSequences(p, 3, &cpu_seqs, &gpu_seqs);
    float worst =
        CompareStep(p, cpu_seqs, gpu_seqs, {{0, tokens(37, 0)}, {1, tokens(5, 1)}}, "prefill");
    for (int step = 0; step < 3 && !HasFailure(); ++step) {
      worst = std::max(worst, CompareStep(p, cpu_seqs, gpu_seqs,
                                          {{0, {static_cast<int32_t>(3 + step)}},
                                           {1, {static_cast<int32_t>(50 + step)}}},
                                          "decode " + std::to_string(step)));
    }
    if (!HasFailure()) {
      // Decodes beside a prefill chunk, and a second chunk over a cached prefix.
      worst = std::max(worst, CompareStep(p, cpu_seqs, gpu_seqs,
                                          {{0, {9}}, {1, {8}}, {2, tokens(20, 2)}}, "mixed"));
      worst =
          std::max(worst, CompareStep(p, cpu_seqs, gpu_seqs, {{2, tokens(19, 3)}}, "second chunk"));
    }
    std::printf("%s: worst op output %.4f of its largest magnitude\n", shape.Name().c_str(), worst);
    if (HasFailure()) return;
  }
}

// The trace is a test's view: a traced step leaves the device in the state a plain one does, so
// plain steps after it give the CPU's logits (graphs on or off).
TEST(CudaModelOpsTest, TracedStepsLeaveTheBackendAsPlainOnes) {
  SUBSPACE_REQUIRE_CUDA_DEVICE();
  Pair p = OpenShape({.architecture = "llama"});
  ASSERT_NE(p.cuda.model, nullptr);
  const int vocab = p.cpu->config().n_vocab;
  std::vector<SeqId> cpu_seqs, gpu_seqs;
  CreateSequences(p, 2, &cpu_seqs, &gpu_seqs);
  CompareStep(p, cpu_seqs, gpu_seqs,
              {{0, PatternTokens(20, 0, vocab)}, {1, PatternTokens(3, 1, vocab)}}, "traced");
  for (int step = 0; step < 3; ++step) {
    StepBoth(p, cpu_seqs, gpu_seqs,
             {{0, {static_cast<int32_t>(5 + step)}}, {1, {static_cast<int32_t>(70 + step)}}},
             "plain decode " + std::to_string(step));
  }
  OpTrace trace;
  std::vector<float> logits;
  EXPECT_EQ(p.cuda.model->ForwardTraced({}, *p.cuda.cache, &logits, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace subspace::cuda
