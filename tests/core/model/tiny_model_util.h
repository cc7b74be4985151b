// Header-only tiny random-weight Llama model with a working SentencePiece vocabulary, built in
// memory with GgufBuilder, for engine and server tests that need real forward passes in
// microseconds: <unk> <s> </s>, the 256 byte tokens and a few dozen word pieces.
#ifndef SUBSPACE_TESTS_CORE_MODEL_TINY_MODEL_UTIL_H_
#define SUBSPACE_TESTS_CORE_MODEL_TINY_MODEL_UTIL_H_

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "core/base/tensor_types.h"
#include "core/gguf/gguf.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/model/model.h"
#include "core/tokenizer/tokenizer.h"
#include "tests/core/gguf/gguf_test_util.h"

namespace subspace::testing {

struct TinyModelOptions {
  int dim = 32;
  int heads = 4;
  int kv_heads = 2;
  int layers = 2;
  int ffn = 48;
  int context = 128;
  uint32_t seed = 1;        // weights; the vocabulary is fixed
  float weight_std = 0.4f;  // large enough that greedy argmax has clear margins
  int32_t eos_id = 2;       // another id turns an ordinary token into EOS (same weights)
  // "llama"; "qwen2": the same block with Q/K/V biases and the halves RoPE layout; "qwen3":
  // halves RoPE and per-head Q/K norms; "phi3": halves RoPE, fused attn_qkv and
  // ffn_up = [gate | up].
  std::string architecture = "llama";
  int head_dim = 0;        // attention.key_length; 0: dim / heads
  int sliding_window = 0;  // attention.sliding_window; 0: none written
};

inline constexpr int32_t kTinyUnk = 0;
inline constexpr int32_t kTinyBos = 1;
inline constexpr int32_t kTinyEos = 2;
inline constexpr int32_t kTinyFirstByte = 3;  // <0xHH> is kTinyFirstByte + 0xHH

// <unk>, <s>, </s>, <0x00>..<0xFF>, then word pieces ("▁" is U+2581, SentencePiece's space).
inline std::vector<std::string> TinyVocabPieces() {
  std::vector<std::string> pieces = {"<unk>", "<s>", "</s>"};
  for (int b = 0; b < 256; ++b) pieces.push_back(absl::StrFormat("<0x%02X>", b));
  const std::string sp = "\xe2\x96\x81";
  for (char c = 'a'; c <= 'z'; ++c) pieces.push_back(std::string(1, c));
  for (const char* w : {"", "the", "a", "and", "of", "to", "in", "is", "hello", "world", "h", "w",
                        "t", "s", "o", "i"}) {
    pieces.push_back(sp + w);
  }
  for (const char* w : {"he", "ll", "llo", "or", "ld", "in", "er", "an", "th", "en", "on", "at",
                        "es", "is", "it"}) {
    pieces.push_back(w);
  }
  return pieces;
}

// The GGUF bytes of the tiny model and its vocabulary.
inline std::string BuildTinyLlamaGguf(const TinyModelOptions& o = {}) {
  const std::vector<std::string> pieces = TinyVocabPieces();
  const auto vocab = static_cast<uint64_t>(pieces.size());
  GgufBuilder b;
  const std::string k = o.architecture + ".";
  b.AddString("general.architecture", o.architecture);
  b.AddString("general.name", "tiny-random");
  b.AddUint32(k + "embedding_length", o.dim);
  b.AddUint32(k + "block_count", o.layers);
  b.AddUint32(k + "feed_forward_length", o.ffn);
  b.AddUint32(k + "attention.head_count", o.heads);
  b.AddUint32(k + "attention.head_count_kv", o.kv_heads);
  b.AddUint32(k + "context_length", o.context);
  if (o.sliding_window > 0) b.AddUint32(k + "attention.sliding_window", o.sliding_window);
  if (o.head_dim > 0) {
    b.AddUint32(k + "attention.key_length", o.head_dim);
    b.AddUint32(k + "attention.value_length", o.head_dim);
  }
  b.AddString("tokenizer.ggml.model", "llama");
  b.AddStringArray("tokenizer.ggml.tokens", pieces);
  std::vector<float> scores(pieces.size(), 0.0f);
  std::vector<int32_t> types(pieces.size(), static_cast<int32_t>(TokenType::kNormal));
  types[kTinyUnk] = static_cast<int32_t>(TokenType::kUnknown);
  types[kTinyBos] = static_cast<int32_t>(TokenType::kControl);
  types[kTinyEos] = static_cast<int32_t>(TokenType::kControl);
  for (int i = 0; i < 256; ++i) types[kTinyFirstByte + i] = static_cast<int32_t>(TokenType::kByte);
  // Longer pieces merge first (SentencePiece BPE merges the highest-scoring pair).
  for (size_t i = kTinyFirstByte + 256; i < pieces.size(); ++i) {
    scores[i] = static_cast<float>(pieces[i].size()) - 0.001f * static_cast<float>(i);
  }
  b.AddFloatArray("tokenizer.ggml.scores", scores);
  b.AddInt32Array("tokenizer.ggml.token_type", types);
  b.AddUint32("tokenizer.ggml.bos_token_id", kTinyBos);
  b.AddUint32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(o.eos_id));
  b.AddUint32("tokenizer.ggml.unknown_token_id", kTinyUnk);

  std::mt19937 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, o.weight_std);
  const auto add = [&](const std::string& name, std::vector<uint64_t> dims) {
    uint64_t count = 1;
    for (uint64_t d : dims) count *= d;
    std::vector<float> values(count);
    for (size_t i = 0; i < count; ++i) {
      values[i] = dims.size() == 1 ? 0.75f + 0.125f * static_cast<float>(i % 5) : normal(rng);
    }
    b.AddTensor(name, dims, TensorType::kF32, GgufBytesOf(values));
  };
  const uint64_t dim = o.dim, hd = o.head_dim > 0 ? o.head_dim : o.dim / o.heads, ffn = o.ffn;
  const uint64_t q_width = o.heads * hd, kv_width = o.kv_heads * hd;
  add("token_embd.weight", {dim, vocab});
  for (int l = 0; l < o.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", {dim});
    if (o.architecture == "phi3") {
      add(p + "attn_qkv.weight", {dim, q_width + 2 * kv_width});
    } else {
      add(p + "attn_q.weight", {dim, q_width});
      add(p + "attn_k.weight", {dim, kv_width});
      add(p + "attn_v.weight", {dim, kv_width});
    }
    if (o.architecture == "qwen2") {
      add(p + "attn_q.bias", {q_width});
      add(p + "attn_k.bias", {kv_width});
      add(p + "attn_v.bias", {kv_width});
    }
    if (o.architecture == "qwen3") {
      add(p + "attn_q_norm.weight", {hd});
      add(p + "attn_k_norm.weight", {hd});
    }
    add(p + "attn_output.weight", {q_width, dim});
    add(p + "ffn_norm.weight", {dim});
    if (o.architecture == "phi3") {
      add(p + "ffn_up.weight", {dim, 2 * ffn});
    } else {
      add(p + "ffn_gate.weight", {dim, ffn});
      add(p + "ffn_up.weight", {dim, ffn});
    }
    add(p + "ffn_down.weight", {ffn, dim});
  }
  add("output_norm.weight", {dim});
  add("output.weight", {dim, vocab});
  return b.Build();
}

struct TinyModel {
  std::shared_ptr<const GgufFile> file;
  std::shared_ptr<LlamaModel> model;
  std::shared_ptr<const Tokenizer> tokenizer;
};

// A fresh model instance each call (LlamaModel is single-threaded: give each user its own).
inline absl::StatusOr<TinyModel> LoadTinyModel(const TinyModelOptions& o = {}) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::FromBytes(BuildTinyLlamaGguf(o));
  if (!file.ok()) return file.status();
  TinyModel m;
  m.file = std::shared_ptr<const GgufFile>(*std::move(file));
  absl::StatusOr<std::unique_ptr<LlamaModel>> model = LlamaModel::Load(m.file);
  if (!model.ok()) return model.status();
  m.model = std::shared_ptr<LlamaModel>(*std::move(model));
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromGguf(*m.file);
  if (!tok.ok()) return tok.status();
  m.tokenizer = std::shared_ptr<const Tokenizer>(*std::move(tok));
  return m;
}

// A full-rank paged cache for `config` holding `blocks` blocks of `block_size` tokens (a token
// takes one block slot per layer).
inline absl::StatusOr<std::unique_ptr<PagedKvCache>> MakeTinyCache(const ModelConfig& config,
                                                                   int block_size, int64_t blocks) {
  PagedKvCache::Config c;
  c.geometry = config.cache_geometry();
  c.block_size = block_size;
  c.capacity_bytes = blocks * PagedKvCache::BlockBytes(c.geometry, block_size);
  return PagedKvCache::Create(c);
}

}  // namespace subspace::testing

#endif  // SUBSPACE_TESTS_CORE_MODEL_TINY_MODEL_UTIL_H_
