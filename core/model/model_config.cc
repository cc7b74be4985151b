// ModelConfig::FromGguf: the <arch>.* hyper-parameters of a GGUF file, with the defaults
// llama.cpp applies and the consistency checks the forward pass relies on (so a bad file is
// an INVALID_ARGUMENT naming the key, never an out-of-bounds read later).
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/tensor_types.h"
#include "core/gguf/gguf.h"
#include "core/model/model.h"

namespace subspace {

namespace {

// An integer key as an int in [1, INT32_MAX]; `fallback` when absent and not negative.
absl::StatusOr<int> PositiveInt(const GgufFile& file, const std::string& key, int fallback = -1) {
  if (file.Find(key) == nullptr) {
    if (fallback >= 0) return fallback;
    return absl::InvalidArgumentError(absl::StrCat("GGUF metadata lacks ", key));
  }
  absl::StatusOr<int64_t> v = file.GetInt(key);
  if (!v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": ", v.status().message()));
  }
  if (*v <= 0 || *v > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s = %d is out of range", key, *v));
  }
  return static_cast<int>(*v);
}

absl::StatusOr<float> PositiveFloat(const GgufFile& file, const std::string& key, float fallback) {
  if (file.Find(key) == nullptr) return fallback;
  absl::StatusOr<double> v = file.GetFloat(key);
  if (!v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": ", v.status().message()));
  }
  if (!std::isfinite(*v) || *v <= 0.0 || *v > std::numeric_limits<float>::max()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s = %g must be positive", key, *v));
  }
  return static_cast<float>(*v);
}

}  // namespace

#define SUBSPACE_ASSIGN_OR_RETURN_CFG(lhs, expr)      \
  do {                                                \
    auto status_or_ = (expr);                         \
    if (!status_or_.ok()) return status_or_.status(); \
    (lhs) = *std::move(status_or_);                   \
  } while (0)

absl::StatusOr<ModelConfig> ModelConfig::FromGguf(const GgufFile& file) {
  ModelConfig c;
  absl::StatusOr<std::string> arch = file.GetString("general.architecture");
  if (!arch.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("general.architecture: ", arch.status().message()));
  }
  // The decoder families the forward pass runs: the Llama block, plus Qwen2's Q/K/V biases,
  // Qwen3's per-head Q/K norms and Phi-3's fused tensors (model.cc), all but Llama's with the
  // halves RoPE layout (their converters do not permute Q/K for adjacent pairs).
  if (*arch == "llama") {
    c.rope_layout = RopeLayout::kAdjacentPairs;
  } else if (*arch == "qwen2") {
    c.rope_layout = RopeLayout::kHalves;
    c.qkv_bias = true;
  } else if (*arch == "qwen3") {
    c.rope_layout = RopeLayout::kHalves;
    c.qk_norm = true;
  } else if (*arch == "phi3") {
    c.rope_layout = RopeLayout::kHalves;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "general.architecture is \"", *arch,
        "\"; supported: \"llama\" (Llama 1-3, Mistral), \"qwen2\", \"qwen3\", \"phi3\""));
  }
  c.architecture = *arch;
  const std::string k = *arch + ".";
  // Q/K/V biases: Qwen2 always has them; any other Llama-style file may.
  c.qkv_bias = c.qkv_bias || file.FindTensor("blk.0.attn_q.bias") != nullptr;
  if (absl::StatusOr<std::string> name = file.GetString("general.name"); name.ok()) {
    c.name = *name;
  }

  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.dim, PositiveInt(file, k + "embedding_length"));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.n_layers, PositiveInt(file, k + "block_count"));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.ffn_dim, PositiveInt(file, k + "feed_forward_length"));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.n_heads, PositiveInt(file, k + "attention.head_count"));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.n_kv_heads,
                                PositiveInt(file, k + "attention.head_count_kv", c.n_heads));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.context_length, PositiveInt(file, k + "context_length"));
  // Sliding-window attention (Mistral v0.1, Phi-3): position p attends (p - window, p], in
  // every layer; the CPU caches (AttentionRequest::window) and the CUDA kernels mask it. Old
  // Phi-3 4k files lack the key; llama.cpp's default for them is 2047.
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.sliding_window,
                                PositiveInt(file, k + "attention.sliding_window", 0));
  if (*arch == "phi3" && c.sliding_window == 0 && c.context_length == 4096) {
    int layers = c.n_layers;
    if (layers == 32 || layers == 40) c.sliding_window = 2047;
  }
  const int trained_context = c.context_length;
  if (c.n_heads % c.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%sattention.head_count_kv = %d does not divide %sattention.head_count = %d", k,
        c.n_kv_heads, k, c.n_heads));
  }
  // The head width: key_length where given (Qwen3's 128 with 1024 / 16 = 64), else
  // embedding_length / head_count, which must then divide evenly.
  const bool has_key_length = file.Find(k + "attention.key_length") != nullptr;
  if (!has_key_length && c.dim % c.n_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%sattention.head_count = %d does not divide %sembedding_length = %d", k,
                        c.n_heads, k, c.dim));
  }
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.head_dim, PositiveInt(file, k + "attention.key_length",
                                                        has_key_length ? -1 : c.dim / c.n_heads));
  int value_length = 0;
  SUBSPACE_ASSIGN_OR_RETURN_CFG(value_length,
                                PositiveInt(file, k + "attention.value_length", c.head_dim));
  if (value_length != c.head_dim) {
    return absl::UnimplementedError(absl::StrFormat(
        "%sattention.value_length = %d differs from key_length = %d (MLA-style heads are not "
        "supported)",
        k, value_length, c.head_dim));
  }
  if (static_cast<int64_t>(c.n_heads) * c.head_dim > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("attention width overflows");
  }
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.rope_dim,
                                PositiveInt(file, k + "rope.dimension_count", c.head_dim));
  if (c.rope_dim > c.head_dim || c.rope_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%srope.dimension_count = %d must be even and at most head_dim = %d", k,
                        c.rope_dim, c.head_dim));
  }
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.rope_theta, PositiveFloat(file, k + "rope.freq_base", 1e4f));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.rms_eps,
                                PositiveFloat(file, k + "attention.layer_norm_rms_epsilon", 1e-5f));

  // Position scaling: linear interpolation divides every angle by the factor; YaRN blends
  // that with the unscaled angles per frequency (core/base/rope.h). LongRoPE is refused below.
  if (absl::StatusOr<std::string> scaling = file.GetString(k + "rope.scaling.type");
      scaling.ok() && *scaling != "none") {
    float factor = 1.0f;
    SUBSPACE_ASSIGN_OR_RETURN_CFG(factor, PositiveFloat(file, k + "rope.scaling.factor", 1.0f));
    if (*scaling == "linear") {
      c.rope_freq_scale = 1.0f / factor;
    } else if (*scaling == "yarn") {
      c.rope_freq_scale = 1.0f / factor;
      c.rope_yarn = true;
      SUBSPACE_ASSIGN_OR_RETURN_CFG(
          c.rope_yarn_original_context,
          PositiveInt(file, k + "rope.scaling.original_context_length", trained_context));
    } else if (factor != 1.0f) {
      return absl::UnimplementedError(absl::StrFormat(
          "%srope.scaling.type = %s (factor %g) is not supported; linear and yarn are", k, *scaling,
          factor));
    }
  }
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.rope_attn_factor,
                                PositiveFloat(file, k + "rope.scaling.attn_factor", 1.0f));
  for (const char* longrope : {"rope_factors_long.weight", "rope_factors_short.weight"}) {
    if (file.FindTensor(longrope) != nullptr) {
      return absl::UnimplementedError(
          absl::StrCat(longrope, ": LongRoPE (Phi-3 128k) is not supported"));
    }
  }
  // Llama 3.x: per-pair frequency divisors in a tensor of rope_dim / 2 values.
  if (const GgufTensorInfo* t = file.FindTensor("rope_freqs.weight"); t != nullptr) {
    if (t->dims.size() != 1 || t->dims[0] != c.rope_dim / 2 ||
        (t->type != TensorType::kF32 && t->type != TensorType::kF16) || t->data == nullptr ||
        t->num_bytes != TensorRowBytes(t->type, c.rope_dim / 2)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rope_freqs.weight must be F32 or F16 with rope.dimension_count / 2 = %d values",
          c.rope_dim / 2));
    }
    c.rope_freq_factors.resize(static_cast<size_t>(c.rope_dim / 2));
    DequantizeRow(t->type, t->data, c.rope_freq_factors.data(), c.rope_dim / 2);
  }
  if (absl::StatusOr<RopeSchedule> rope = c.rope(); !rope.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(k, "rope: ", rope.status().message()));
  }

  // The vocabulary is the embedding's row count; <arch>.vocab_size, when present, must agree.
  const GgufTensorInfo* embd = file.FindTensor("token_embd.weight");
  int vocab_key = 0;
  SUBSPACE_ASSIGN_OR_RETURN_CFG(vocab_key, PositiveInt(file, k + "vocab_size", 0));
  if (embd != nullptr) {
    if (embd->dims.size() != 2 || embd->dims[1] <= 0 ||
        embd->dims[1] > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError("token_embd.weight must be 2-D [dim, n_vocab]");
    }
    c.n_vocab = static_cast<int>(embd->dims[1]);
    if (vocab_key != 0 && vocab_key != c.n_vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%svocab_size = %d differs from token_embd.weight rows = %d", k, vocab_key, c.n_vocab));
    }
  } else {
    c.n_vocab = vocab_key;
  }
  if (c.n_vocab <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocabulary size unknown: no token_embd.weight and no ", k, "vocab_size"));
  }
  c.tied_output = file.FindTensor("output.weight") == nullptr;
  return c;
}

absl::StatusOr<RopeSchedule> ModelConfig::rope() const {
  return RopeSchedule::Make({.dim = rope_dim,
                             .theta = rope_theta,
                             .layout = rope_layout,
                             .freq_scale = rope_freq_scale,
                             .freq_factors = rope_freq_factors,
                             .yarn = rope_yarn,
                             .yarn_original_context = rope_yarn_original_context,
                             .attn_factor = rope_attn_factor});
}

#undef SUBSPACE_ASSIGN_OR_RETURN_CFG

}  // namespace subspace
