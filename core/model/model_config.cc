// ModelConfig::FromGguf: the llama.* hyper-parameters of a GGUF file, with the defaults
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
    lhs = *std::move(status_or_);                     \
  } while (0)

absl::StatusOr<ModelConfig> ModelConfig::FromGguf(const GgufFile& file) {
  ModelConfig c;
  absl::StatusOr<std::string> arch = file.GetString("general.architecture");
  if (!arch.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("general.architecture: ", arch.status().message()));
  }
  if (*arch != "llama") {
    return absl::InvalidArgumentError(
        absl::StrCat("general.architecture is \"", *arch, "\"; only \"llama\" is supported"));
  }
  c.architecture = *arch;
  if (absl::StatusOr<std::string> name = file.GetString("general.name"); name.ok()) {
    c.name = *name;
  }

  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.dim, PositiveInt(file, "llama.embedding_length"));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.n_layers, PositiveInt(file, "llama.block_count"));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.ffn_dim, PositiveInt(file, "llama.feed_forward_length"));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.n_heads, PositiveInt(file, "llama.attention.head_count"));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.n_kv_heads,
                                PositiveInt(file, "llama.attention.head_count_kv", c.n_heads));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.context_length, PositiveInt(file, "llama.context_length"));
  if (c.dim % c.n_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "llama.attention.head_count = %d does not divide llama.embedding_length = %d", c.n_heads,
        c.dim));
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "llama.attention.head_count_kv = %d does not divide llama.attention.head_count = %d",
        c.n_kv_heads, c.n_heads));
  }
  c.head_dim = c.dim / c.n_heads;
  // Models whose head width is not dim / n_heads (Gemma-style) need a different layout.
  for (const char* key : {"llama.attention.key_length", "llama.attention.value_length"}) {
    int width = 0;
    SUBSPACE_ASSIGN_OR_RETURN_CFG(width, PositiveInt(file, key, c.head_dim));
    if (width != c.head_dim) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s = %d differs from embedding_length / head_count = %d", key, width, c.head_dim));
    }
  }
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.rope_dim,
                                PositiveInt(file, "llama.rope.dimension_count", c.head_dim));
  if (c.rope_dim > c.head_dim || c.rope_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("llama.rope.dimension_count = %d must be even and at most head_dim = %d",
                        c.rope_dim, c.head_dim));
  }
  SUBSPACE_ASSIGN_OR_RETURN_CFG(c.rope_theta, PositiveFloat(file, "llama.rope.freq_base", 1e4f));
  SUBSPACE_ASSIGN_OR_RETURN_CFG(
      c.rms_eps, PositiveFloat(file, "llama.attention.layer_norm_rms_epsilon", 1e-5f));

  // Position scaling (linear, YaRN, Llama-3 frequency factors) changes the rotation angles;
  // the CPU Rope implements the plain schedule only, so refuse rather than mis-rotate.
  if (absl::StatusOr<std::string> scaling = file.GetString("llama.rope.scaling.type");
      scaling.ok() && *scaling != "none") {
    float factor = 1.0f;
    SUBSPACE_ASSIGN_OR_RETURN_CFG(factor, PositiveFloat(file, "llama.rope.scaling.factor", 1.0f));
    if (factor != 1.0f) {
      return absl::UnimplementedError(absl::StrFormat(
          "llama.rope.scaling.type = %s (factor %g) is not supported", *scaling, factor));
    }
  }
  if (file.FindTensor("rope_freqs.weight") != nullptr) {
    return absl::UnimplementedError("rope_freqs.weight (RoPE frequency factors) is not supported");
  }

  // The vocabulary is the embedding's row count; llama.vocab_size, when present, must agree.
  const GgufTensorInfo* embd = file.FindTensor("token_embd.weight");
  int vocab_key = 0;
  SUBSPACE_ASSIGN_OR_RETURN_CFG(vocab_key, PositiveInt(file, "llama.vocab_size", 0));
  if (embd != nullptr) {
    if (embd->dims.size() != 2 || embd->dims[1] <= 0 ||
        embd->dims[1] > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError("token_embd.weight must be 2-D [dim, n_vocab]");
    }
    c.n_vocab = static_cast<int>(embd->dims[1]);
    if (vocab_key != 0 && vocab_key != c.n_vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "llama.vocab_size = %d differs from token_embd.weight rows = %d", vocab_key, c.n_vocab));
    }
  } else {
    c.n_vocab = vocab_key;
  }
  if (c.n_vocab <= 0) {
    return absl::InvalidArgumentError(
        "vocabulary size unknown: no token_embd.weight and no llama.vocab_size");
  }
  c.tied_output = file.FindTensor("output.weight") == nullptr;
  return c;
}

#undef SUBSPACE_ASSIGN_OR_RETURN_CFG

}  // namespace subspace
