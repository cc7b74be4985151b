// ModelConfig::FromGguf and LlamaModel::Load on small GGUFs built in memory (defaults, every
// validation error), and Forward's input validation, which must reject a bad batch before it
// touches the cache.
#include "core/model/model.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/base/tensor_types.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/paged_kv_cache.h"
#include "gtest/gtest.h"
#include "tests/core/gguf/gguf_test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::GgufBuilder;
using ::subspace::testing::GgufBytesOf;

// What the in-memory model looks like; tests change a field or two.
struct Spec {
  std::string arch = "llama";
  int vocab = 32;
  int dim = 16;
  int heads = 4;
  int kv_heads = 2;
  int layers = 2;
  int ffn = 24;
  int ctx = 16;
  bool tied = false;
  TensorType norm_type = TensorType::kF32;
  std::set<std::string> skip_keys;     // metadata left out
  std::set<std::string> skip_tensors;  // tensors left out
  std::map<std::string, std::vector<uint64_t>> dims_override;
  std::function<void(GgufBuilder&)> extra;  // additional keys
};

std::string TensorBytes(const std::vector<float>& v, TensorType type) {
  if (type == TensorType::kF32) return GgufBytesOf(v);
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    h[i] = type == TensorType::kF16 ? Fp32ToFp16(v[i]) : Fp32ToBf16(v[i]);
  }
  return GgufBytesOf(h);
}

std::string BuildModel(const Spec& s) {
  GgufBuilder b;
  const auto key = [&s](const std::string& k) { return s.skip_keys.count(k) == 0; };
  if (key("general.architecture")) b.AddString("general.architecture", s.arch);
  b.AddString("general.name", "tiny");
  if (key("llama.embedding_length")) b.AddUint32("llama.embedding_length", s.dim);
  if (key("llama.block_count")) b.AddUint32("llama.block_count", s.layers);
  if (key("llama.feed_forward_length")) b.AddUint32("llama.feed_forward_length", s.ffn);
  if (key("llama.attention.head_count")) b.AddUint32("llama.attention.head_count", s.heads);
  if (key("llama.attention.head_count_kv")) {
    b.AddUint32("llama.attention.head_count_kv", s.kv_heads);
  }
  if (key("llama.context_length")) b.AddUint32("llama.context_length", s.ctx);
  if (s.extra) s.extra(b);

  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  const auto add = [&](const std::string& name, std::vector<uint64_t> dims, TensorType type) {
    if (s.skip_tensors.count(name) != 0) return;
    if (auto it = s.dims_override.find(name); it != s.dims_override.end()) dims = it->second;
    uint64_t count = 1;
    for (uint64_t d : dims) count *= d;
    std::vector<float> values(count);
    // Norm weights are small dyadic numbers, exact in F16 and BF16, so the stored type does
    // not change the model.
    for (size_t i = 0; i < count; ++i) {
      values[i] = dims.size() == 1 ? 0.5f + 0.25f * static_cast<float>(i % 5) : normal(rng);
    }
    b.AddTensor(name, dims, type, TensorBytes(values, type));
  };
  const uint64_t dim = s.dim, hd = s.dim / s.heads, ffn = s.ffn;
  add("token_embd.weight", {dim, static_cast<uint64_t>(s.vocab)}, TensorType::kF32);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", {dim}, s.norm_type);
    add(p + "attn_q.weight", {dim, s.heads * hd}, TensorType::kF32);
    add(p + "attn_k.weight", {dim, s.kv_heads * hd}, TensorType::kF32);
    add(p + "attn_v.weight", {dim, s.kv_heads * hd}, TensorType::kF32);
    add(p + "attn_output.weight", {s.heads * hd, dim}, TensorType::kF32);
    add(p + "ffn_norm.weight", {dim}, s.norm_type);
    add(p + "ffn_gate.weight", {dim, ffn}, TensorType::kF32);
    add(p + "ffn_up.weight", {dim, ffn}, TensorType::kF32);
    add(p + "ffn_down.weight", {ffn, dim}, TensorType::kF32);
  }
  add("output_norm.weight", {dim}, s.norm_type);
  if (!s.tied) add("output.weight", {dim, static_cast<uint64_t>(s.vocab)}, TensorType::kF32);
  return b.Build();
}

std::shared_ptr<const GgufFile> Parse(const Spec& s) {
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::FromBytes(BuildModel(s));
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? std::shared_ptr<const GgufFile>(*std::move(f)) : nullptr;
}

absl::Status ConfigStatus(const Spec& s) {
  auto f = Parse(s);
  return f == nullptr ? absl::InternalError("parse") : ModelConfig::FromGguf(*f).status();
}

absl::Status LoadStatus(const Spec& s) {
  auto f = Parse(s);
  return f == nullptr ? absl::InternalError("parse") : LlamaModel::Load(f).status();
}

// INVALID_ARGUMENT whose message mentions `needle`.
void ExpectInvalid(const absl::Status& st, const std::string& needle) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(needle), std::string::npos) << st;
}

TEST(ModelConfigTest, ReadsMetadataAndDefaults) {
  Spec s;
  s.skip_keys = {"llama.attention.head_count_kv"};
  s.kv_heads = s.heads;  // the default the tensors must then match
  auto f = Parse(s);
  ASSERT_NE(f, nullptr);
  absl::StatusOr<ModelConfig> c = ModelConfig::FromGguf(*f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "llama");
  EXPECT_EQ(c->name, "tiny");
  EXPECT_EQ(c->n_vocab, 32);
  EXPECT_EQ(c->dim, 16);
  EXPECT_EQ(c->n_layers, 2);
  EXPECT_EQ(c->n_heads, 4);
  EXPECT_EQ(c->n_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 4);
  EXPECT_EQ(c->ffn_dim, 24);
  EXPECT_EQ(c->context_length, 16);
  EXPECT_EQ(c->rope_dim, 4);
  EXPECT_FLOAT_EQ(c->rope_theta, 10000.0f);
  EXPECT_FLOAT_EQ(c->rms_eps, 1e-5f);
  EXPECT_FALSE(c->tied_output);
  const KvCacheGeometry g = c->cache_geometry();
  EXPECT_EQ(g.n_layers, 2);
  EXPECT_EQ(g.n_kv_heads, 4);
  EXPECT_EQ(g.head_dim, 4);
}

TEST(ModelConfigTest, ReadsOptionalKeys) {
  Spec s;
  s.tied = true;
  s.extra = [](GgufBuilder& b) {
    b.AddUint32("llama.rope.dimension_count", 2);
    b.AddFloat32("llama.rope.freq_base", 500000.0f);
    b.AddFloat32("llama.attention.layer_norm_rms_epsilon", 1e-6f);
    b.AddUint32("llama.vocab_size", 32);
  };
  auto f = Parse(s);
  ASSERT_NE(f, nullptr);
  absl::StatusOr<ModelConfig> c = ModelConfig::FromGguf(*f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->n_kv_heads, 2);
  EXPECT_EQ(c->rope_dim, 2);
  EXPECT_FLOAT_EQ(c->rope_theta, 500000.0f);
  EXPECT_FLOAT_EQ(c->rms_eps, 1e-6f);
  EXPECT_TRUE(c->tied_output);
}

TEST(ModelConfigTest, VocabFromMetadataWithoutEmbedding) {
  Spec s;
  s.skip_tensors = {"token_embd.weight"};
  s.extra = [](GgufBuilder& b) { b.AddUint32("llama.vocab_size", 50); };
  auto f = Parse(s);
  ASSERT_NE(f, nullptr);
  absl::StatusOr<ModelConfig> c = ModelConfig::FromGguf(*f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->n_vocab, 50);
  // ...but the model itself cannot load without the embedding.
  ExpectInvalid(LlamaModel::Load(f).status(), "token_embd.weight");
}

TEST(ModelConfigTest, RejectsBadMetadata) {
  Spec s;
  s.arch = "gpt2";
  ExpectInvalid(ConfigStatus(s), "general.architecture");
  s = Spec();
  s.skip_keys = {"general.architecture"};
  ExpectInvalid(ConfigStatus(s), "general.architecture");
  for (const char* k : {"llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
                        "llama.attention.head_count", "llama.context_length"}) {
    s = Spec();
    s.skip_keys = {k};
    ExpectInvalid(ConfigStatus(s), k);
  }
  s = Spec();
  s.heads = 3;  // 16 % 3 != 0
  s.kv_heads = 1;
  ExpectInvalid(ConfigStatus(s), "does not divide llama.embedding_length");
  s = Spec();
  s.kv_heads = 3;  // 4 % 3 != 0
  ExpectInvalid(ConfigStatus(s), "does not divide llama.attention.head_count");
  s = Spec();
  s.layers = 0;
  ExpectInvalid(ConfigStatus(s), "llama.block_count");
  s = Spec();
  s.skip_keys = {"llama.context_length"};
  s.extra = [](GgufBuilder& b) { b.AddInt32("llama.context_length", -4); };
  ExpectInvalid(ConfigStatus(s), "llama.context_length");
  s = Spec();
  s.skip_keys = {"llama.block_count"};
  s.extra = [](GgufBuilder& b) { b.AddString("llama.block_count", "two"); };
  ExpectInvalid(ConfigStatus(s), "llama.block_count");
  s = Spec();
  s.extra = [](GgufBuilder& b) { b.AddUint32("llama.rope.dimension_count", 3); };
  ExpectInvalid(ConfigStatus(s), "llama.rope.dimension_count");
  s.extra = [](GgufBuilder& b) { b.AddUint32("llama.rope.dimension_count", 8); };  // > 4
  ExpectInvalid(ConfigStatus(s), "llama.rope.dimension_count");
  s.extra = [](GgufBuilder& b) { b.AddFloat32("llama.rope.freq_base", 0.0f); };
  ExpectInvalid(ConfigStatus(s), "llama.rope.freq_base");
  s.extra = [](GgufBuilder& b) {
    b.AddFloat32("llama.attention.layer_norm_rms_epsilon", std::nanf(""));
  };
  ExpectInvalid(ConfigStatus(s), "layer_norm_rms_epsilon");
  s.extra = [](GgufBuilder& b) { b.AddUint32("llama.vocab_size", 33); };
  ExpectInvalid(ConfigStatus(s), "llama.vocab_size");
  // Heads wider than embedding_length / head_count (Qwen3) are fine; K and V of different
  // widths are not.
  s.extra = [](GgufBuilder& b) { b.AddUint32("llama.attention.key_length", 8); };
  EXPECT_TRUE(ConfigStatus(s).ok()) << ConfigStatus(s);
  s.extra = [](GgufBuilder& b) {
    b.AddUint32("llama.attention.key_length", 8);
    b.AddUint32("llama.attention.value_length", 4);
  };
  EXPECT_EQ(ConfigStatus(s).code(), absl::StatusCode::kUnimplemented);
  s.extra = [](GgufBuilder& b) {
    b.AddString("llama.rope.scaling.type", "longrope");
    b.AddFloat32("llama.rope.scaling.factor", 4.0f);
  };
  EXPECT_EQ(ConfigStatus(s).code(), absl::StatusCode::kUnimplemented);
  s.extra = [](GgufBuilder& b) {
    b.AddString("llama.rope.scaling.type", "yarn");
    b.AddFloat32("llama.rope.scaling.factor", 4.0f);
    b.AddUint32("llama.rope.scaling.original_context_length", 8);
  };
  EXPECT_TRUE(ConfigStatus(s).ok()) << ConfigStatus(s);
  s.extra = [](GgufBuilder& b) {
    b.AddString("llama.rope.scaling.type", "linear");
    b.AddFloat32("llama.rope.scaling.factor", 4.0f);
  };
  EXPECT_TRUE(ConfigStatus(s).ok()) << ConfigStatus(s);
  s.extra = [](GgufBuilder& b) { b.AddString("general.architecture", "gpt-j"); };
  s.skip_keys = {"general.architecture"};
  ExpectInvalid(ConfigStatus(s), "gpt-j");
  s.skip_keys = {};
  s = Spec();
  s.skip_tensors = {"token_embd.weight"};
  ExpectInvalid(ConfigStatus(s), "vocabulary size unknown");
}

TEST(LlamaModelLoadTest, RejectsMissingOrMisshapenTensors) {
  Spec s;
  ASSERT_TRUE(LoadStatus(s).ok()) << LoadStatus(s);
  s.skip_tensors = {"blk.1.ffn_up.weight"};
  ExpectInvalid(LoadStatus(s), "missing tensor blk.1.ffn_up.weight");
  s = Spec();
  s.skip_tensors = {"output_norm.weight"};
  ExpectInvalid(LoadStatus(s), "output_norm.weight");
  s = Spec();
  s.dims_override["blk.0.attn_k.weight"] = {16, 16};  // kv width is 8
  ExpectInvalid(LoadStatus(s), "blk.0.attn_k.weight has dims {16, 16}, expected {16, 8}");
  s = Spec();
  s.dims_override["blk.0.attn_output.weight"] = {16, 16, 1};
  ExpectInvalid(LoadStatus(s), "blk.0.attn_output.weight");
  s = Spec();
  s.dims_override["blk.1.ffn_norm.weight"] = {8};
  ExpectInvalid(LoadStatus(s), "blk.1.ffn_norm.weight must be 1-D of 16");
  s = Spec();
  s.dims_override["output.weight"] = {16, 31};
  ExpectInvalid(LoadStatus(s), "output.weight");
}

TEST(LlamaModelLoadTest, RejectsUnsupportedNormType) {
  // Q8_0 is a weight format; a norm stored that way is refused rather than dequantised.
  Spec s;
  s.dim = 32;
  s.skip_tensors = {"blk.0.attn_norm.weight"};
  s.extra = [](GgufBuilder& b) {
    b.AddTensor("blk.0.attn_norm.weight", {32}, TensorType::kQ8_0, std::string(34, '\0'));
  };
  ASSERT_NE(Parse(s), nullptr);
  ExpectInvalid(LoadStatus(s), "blk.0.attn_norm.weight has type");
}

TEST(LlamaModelLoadTest, NormsStoredAsHalfGiveTheSameLogits) {
  std::vector<std::vector<float>> logits;
  for (TensorType t : {TensorType::kF32, TensorType::kF16, TensorType::kBF16}) {
    Spec s;
    s.norm_type = t;
    absl::StatusOr<std::unique_ptr<LlamaModel>> m = LlamaModel::Load(Parse(s));
    ASSERT_TRUE(m.ok()) << m.status();
    auto cache = PagedKvCache::Create({(*m)->config().cache_geometry(), 4, 1 << 20});
    ASSERT_TRUE(cache.ok());
    SeqId seq = *(*cache)->CreateSequence();
    ASSERT_TRUE((*cache)->Reserve(seq, 5).ok());
    const std::vector<int32_t> tokens = {1, 7, 3, 31, 0};
    SequenceChunk chunk{seq, 0, tokens, true};
    std::vector<float> out;
    ASSERT_TRUE((*m)->Forward({&chunk, 1}, **cache, &out).ok());
    ASSERT_EQ(out.size(), 5u * 32u);
    for (float x : out) ASSERT_TRUE(std::isfinite(x));
    logits.push_back(out);
  }
  EXPECT_EQ(logits[0], logits[1]);
  EXPECT_EQ(logits[0], logits[2]);
}

// ---- Forward input validation ------------------------------------------------------------

class ForwardValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<LlamaModel>> m = LlamaModel::Load(Parse(Spec()));
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *std::move(m);
    auto cache = PagedKvCache::Create({model_->config().cache_geometry(), 4, 1 << 20});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = *std::move(cache);
    a_ = *cache_->CreateSequence();
    b_ = *cache_->CreateSequence();
    ASSERT_TRUE(cache_->Reserve(a_, 16).ok());
    ASSERT_TRUE(cache_->Reserve(b_, 16).ok());
  }

  absl::Status Run(std::vector<SequenceChunk> batch) {
    return model_->Forward(batch, *cache_, &logits_);
  }
  // The failed step must leave the cache as it was.
  void ExpectUntouched() {
    EXPECT_EQ(cache_->Length(a_), 0);
    EXPECT_EQ(cache_->Length(b_), 0);
  }

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<PagedKvCache> cache_;
  SeqId a_ = -1, b_ = -1;
  std::vector<float> logits_;
  const std::vector<int32_t> ok_tokens_ = {1, 2, 3};
};

TEST_F(ForwardValidationTest, RejectsEmptyBatchAndChunks) {
  ExpectInvalid(Run({}), "empty batch");
  ExpectInvalid(Run({{a_, 0, ok_tokens_}, {b_, 0, {}}}), "chunk 1 is empty");
  ExpectUntouched();
}

TEST_F(ForwardValidationTest, RejectsTokensOutOfRange) {
  const std::vector<int32_t> high = {1, 32}, negative = {-1};
  ExpectInvalid(Run({{a_, 0, high}}), "token 32 at index 1 is outside [0, 32)");
  ExpectInvalid(Run({{a_, 0, ok_tokens_}, {b_, 0, negative}}), "token -1");
  ExpectUntouched();
}

TEST_F(ForwardValidationTest, RejectsWrongPositionsAndContextOverflow) {
  ExpectInvalid(Run({{a_, 2, ok_tokens_}}), "not its cached length 0");
  ASSERT_TRUE(Run({{a_, 0, ok_tokens_}}).ok());
  EXPECT_EQ(cache_->Length(a_), 3);
  ExpectInvalid(Run({{a_, 0, ok_tokens_}}), "not its cached length 3");
  const std::vector<int32_t> long_prompt(14, 5);  // 3 + 14 > context 16
  ExpectInvalid(Run({{a_, 3, long_prompt}}), "past the context length 16");
  const std::vector<int32_t> fill(13, 5);  // exactly reaches 16: allowed
  EXPECT_TRUE(Run({{a_, 3, fill}}).ok());
  EXPECT_EQ(cache_->Length(a_), 16);
}

TEST_F(ForwardValidationTest, RejectsDuplicateSequencesAndMissingReservation) {
  ExpectInvalid(Run({{a_, 0, ok_tokens_}, {b_, 0, ok_tokens_}, {a_, 0, ok_tokens_}}),
                "appears in more than one chunk");
  ExpectUntouched();
  SeqId c = *cache_->CreateSequence();  // nothing reserved
  EXPECT_EQ(Run({{c, 0, ok_tokens_}}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Run({{99, 0, ok_tokens_}}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache_->Length(c), 0);
}

TEST_F(ForwardValidationTest, RejectsNullLogitsAndMismatchedCache) {
  std::vector<SequenceChunk> batch = {{a_, 0, ok_tokens_}};
  ExpectInvalid(model_->Forward(batch, *cache_, nullptr), "logits");
  auto other = PagedKvCache::Create({{2, 1, 4}, 4, 1 << 16});  // one KV head, model has two
  ASSERT_TRUE(other.ok());
  ExpectInvalid(model_->Forward(batch, **other, &logits_), "geometry");
  ExpectUntouched();
}

TEST_F(ForwardValidationTest, LogitRowsFollowAllLogits) {
  const std::vector<int32_t> two = {4, 5};
  ASSERT_TRUE(Run({{a_, 0, ok_tokens_, true}, {b_, 0, two, false}}).ok());
  EXPECT_EQ(logits_.size(), 4u * 32u);  // 3 rows for a, 1 for b
  EXPECT_EQ(cache_->Length(a_), 3);
  EXPECT_EQ(cache_->Length(b_), 2);
  // The same call again continues both sequences (a decode step).
  const std::vector<int32_t> one = {6};
  ASSERT_TRUE(Run({{b_, 2, one}, {a_, 3, one}}).ok());
  EXPECT_EQ(logits_.size(), 2u * 32u);
  EXPECT_EQ(cache_->Length(a_), 4);
  EXPECT_EQ(cache_->Length(b_), 3);
}

}  // namespace
}  // namespace subspace
