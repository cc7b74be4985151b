// The decoder described once (core/model/decoder_ops.h): each family's program has the ops
// and parameters its architecture needs, and the CPU backend's traced step records every op's
// outputs without changing what the step computes (the CUDA backend is held to these traces in
// tests/cuda/cuda_model_ops_test.cc).
#include "core/model/decoder_ops.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/gguf/gguf.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/model/model.h"
#include "tests/core/model/tiny_model_util.h"

namespace subspace {
namespace {

std::unique_ptr<LlamaModel> TinyModel(const std::string& architecture, int sliding_window = 0) {
  testing::TinyModelOptions o;
  o.architecture = architecture;
  o.sliding_window = sliding_window;
  absl::StatusOr<std::unique_ptr<GgufFile>> file =
      GgufFile::FromBytes(testing::BuildTinyLlamaGguf(o));
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<LlamaModel>> m =
      LlamaModel::Load(std::shared_ptr<const GgufFile>(*std::move(file)));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

TEST(DecoderOpsTest, EachFamilysProgramCarriesItsParameters) {
  for (const std::string arch : {"llama", "qwen2", "qwen3", "phi3"}) {
    SCOPED_TRACE(arch);
    std::unique_ptr<LlamaModel> m = TinyModel(arch, arch == "phi3" ? 40 : 0);
    ASSERT_NE(m, nullptr);
    const ModelConfig& c = m->config();
    const DecoderProgram& p = m->program();
    ASSERT_EQ(p.ops.size(), static_cast<size_t>(7 * c.n_layers + 4));
    EXPECT_EQ(p.ops.front().kind, OpKind::kEmbed);
    EXPECT_EQ(p.ops.back().kind, OpKind::kLogits);
    EXPECT_EQ(p.rope.layout, c.rope_layout);
    EXPECT_EQ(p.rope.dim, c.rope_dim);
    EXPECT_EQ(p.rms_eps, c.rms_eps);
    int norms = 0, attention = 0;
    for (const DecoderOp& op : p.ops) {
      if (op.kind == OpKind::kQkv) {
        EXPECT_EQ(op.bias, arch == "qwen2");
        EXPECT_EQ(op.qk_norm, arch == "qwen3");
      }
      if (op.kind == OpKind::kAttention) {
        EXPECT_EQ(op.window, arch == "phi3" ? 40 : 0);
        ++attention;
      }
      if (op.kind == OpKind::kNorm) {
        // Every norm but the first adds the previous sub-layer's output into x.
        EXPECT_EQ(op.add_residual, norms > 0) << OpName(op);
        ++norms;
      }
    }
    EXPECT_EQ(attention, c.n_layers);
    EXPECT_EQ(norms, 2 * c.n_layers);
  }
}

TEST(DecoderOpsTest, NamesSayLayerOpAndOutput) {
  EXPECT_EQ(OpName({.kind = OpKind::kEmbed}), "embed");
  EXPECT_EQ(OpName({.kind = OpKind::kQkv, .layer = 3}), "layer 3 qkv");
  EXPECT_EQ(OpName({.kind = OpKind::kNorm, .layer = 0, .norm = NormWeight::kFfn}),
            "layer 0 ffn norm");
  OpTrace trace;
  const float data[4] = {1, 2, 3, 4};
  trace.Record(5, {.kind = OpKind::kQkv, .layer = 1}, {"k", 2}, 2, data);
  ASSERT_EQ(trace.entries.size(), 1u);
  EXPECT_EQ(trace.entries[0].name, "layer 1 qkv: k");
  EXPECT_EQ(trace.entries[0].op, 5);
  EXPECT_EQ(trace.entries[0].values, std::vector<float>(data, data + 4));
}

// A traced step computes what the plain one does, bitwise, and records every op's outputs with
// the widths OpOutputs gives; its last entry is the logits.
TEST(DecoderOpsTest, CpuTraceRecordsEveryOpAndChangesNothing) {
  for (const std::string arch : {"llama", "qwen2", "qwen3", "phi3"}) {
    SCOPED_TRACE(arch);
    std::unique_ptr<LlamaModel> m = TinyModel(arch, arch == "phi3" ? 6 : 0);
    ASSERT_NE(m, nullptr);
    const ModelConfig& c = m->config();
    const auto make_cache = [&] { return *PagedKvCache::Create({c.cache_geometry(), 4, 1 << 20}); };
    std::unique_ptr<PagedKvCache> plain = make_cache(), traced = make_cache();
    const std::vector<int32_t> prompt = {1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49};
    const std::vector<int32_t> other = {1, 50, 51};
    std::vector<float> plain_logits, traced_logits;
    for (int step = 0; step < 3; ++step) {
      std::vector<SequenceChunk> pb, tb;
      const auto add = [&](PagedKvCache& cache, std::vector<SequenceChunk>* batch, SeqId s,
                           std::span<const int32_t> tokens) {
        ASSERT_TRUE(cache.Reserve(s, static_cast<int64_t>(tokens.size())).ok());
        batch->push_back({s, cache.Length(s), tokens});
      };
      if (step == 0) {
        for (PagedKvCache* cache : {plain.get(), traced.get()}) {
          ASSERT_TRUE(cache->CreateSequence().ok());
          ASSERT_TRUE(cache->CreateSequence().ok());
        }
      }
      const std::vector<int32_t> one = {static_cast<int32_t>(60 + step)};
      const std::span<const int32_t> a = step == 0 ? std::span<const int32_t>(prompt) : one;
      const std::span<const int32_t> b = step == 0 ? std::span<const int32_t>(other) : one;
      add(*plain, &pb, 0, a);
      add(*plain, &pb, 1, b);
      add(*traced, &tb, 0, a);
      add(*traced, &tb, 1, b);
      ASSERT_TRUE(m->Forward(pb, *plain, &plain_logits).ok());
      OpTrace trace;
      ASSERT_TRUE(m->ForwardTraced(tb, *traced, &traced_logits, &trace).ok());
      EXPECT_EQ(plain_logits, traced_logits) << "step " << step;

      const int64_t t_rows = static_cast<int64_t>(a.size() + b.size());
      size_t e = 0;
      for (size_t i = 0; i < m->program().ops.size(); ++i) {
        const DecoderOp& op = m->program().ops[i];
        const bool logit_rows = op.kind == OpKind::kOutputNorm || op.kind == OpKind::kLogits;
        for (const OpOutput& out : OpOutputs(op, c)) {
          ASSERT_LT(e, trace.entries.size());
          const OpTrace::Entry& entry = trace.entries[e++];
          EXPECT_EQ(entry.op, static_cast<int>(i));
          EXPECT_EQ(entry.name, OpName(op) + ": " + out.name);
          EXPECT_EQ(entry.rows, logit_rows ? 2 : t_rows) << entry.name;
          EXPECT_EQ(entry.width, out.width) << entry.name;
          EXPECT_EQ(entry.values.size(), static_cast<size_t>(entry.rows * entry.width));
        }
      }
      EXPECT_EQ(e, trace.entries.size());
      EXPECT_EQ(trace.entries.back().values, traced_logits);
    }
  }
}

TEST(DecoderOpsTest, ANullTraceIsRefused) {
  std::unique_ptr<LlamaModel> m = TinyModel("llama");
  ASSERT_NE(m, nullptr);
  std::unique_ptr<PagedKvCache> cache =
      *PagedKvCache::Create({m->config().cache_geometry(), 4, 1 << 20});
  std::vector<float> logits;
  EXPECT_EQ(m->ForwardTraced({}, *cache, &logits, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace subspace
