// The decoder's forward pass as data: the ops every backend runs, in order, each with the
// parameters the model family decides (Q/K/V biases for Qwen2, per-head Q/K norms for Qwen3, the
// RoPE schedule, a sliding window), worked out once from the ModelConfig. LlamaModel::Forward
// runs the list on the CPU and the CUDA backend's step on the GPU (cuda/cuda_model_step.cc);
// neither reads a family's flags itself, so a new family or op is described here and each
// executor implements the op, not a branch per family.
//
// Given an OpTrace, an executor records every op's outputs as fp32 rows: the op harness
// (tests/cuda/cuda_model_ops_test.cc) runs random models of every family on the CPU and on the
// device, each device op on the CPU's inputs, and names the first op whose outputs disagree.
#ifndef SUBSPACE_CORE_MODEL_DECODER_OPS_H_
#define SUBSPACE_CORE_MODEL_DECODER_OPS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/rope.h"
#include "core/model/model_runner.h"

namespace subspace {

enum class OpKind : uint8_t {
  kEmbed,      // x[T, dim] = token_embd rows of the step's tokens
  kNorm,       // x += proj first when add_residual; xn[T, dim] = RMSNorm(x) * weight
  kQkv,        // q, k, v = xn · [Wq | Wk | Wv]ᵀ (+ biases), per-head RMSNorm of q and k, RoPE
  kAttention,  // k, v appended to the cache; attn[T, q_width] = softmax(q kᵀ / √hd) v, windowed
  kAttnOut,    // proj[T, dim] = attn · Woᵀ
  kFfnUp,      // hidden[T, ffn] = silu(xn · Wgateᵀ) ⊙ (xn · Wupᵀ)
  kFfnDown,    // proj[T, dim] = hidden · Wdownᵀ
  kResidual,   // x += proj (after the last layer; inside, the next norm adds it)
  kOutputNorm,  // xn[R, dim] = RMSNorm(x[logit rows]) * output_norm
  kLogits,      // logits[R, vocab] = xn · outputᵀ
};

// Which of a layer's two norm weights a kNorm applies.
enum class NormWeight : uint8_t { kAttention, kFfn };

struct DecoderOp {
  OpKind kind = OpKind::kEmbed;
  int layer = -1;  // -1: outside the layers (embedding, residual, output norm, logits)
  // kNorm.
  NormWeight norm = NormWeight::kAttention;
  bool add_residual = false;
  // kQkv.
  bool bias = false;     // add the layer's Q/K/V biases after the projection
  bool qk_norm = false;  // RMSNorm each head of q and k (before RoPE)
  // kAttention: attend at most the last `window` positions (0: all).
  int window = 0;
};

// The whole step: the ops in order, and the model-level parameters they share.
struct DecoderProgram {
  std::vector<DecoderOp> ops;
  RopeSchedule rope;      // every kQkv rotates q and k by it
  float rms_eps = 1e-5f;  // every norm's epsilon
};

// The program of `config`'s family. INVALID_ARGUMENT when the RoPE schedule cannot be made
// (ModelConfig::FromGguf has already checked it for a loaded model).
absl::StatusOr<DecoderProgram> DescribeDecoder(const ModelConfig& config);

// "layer 3 qkv", "embed", "logits": for traces and errors.
std::string OpName(const DecoderOp& op);

// Every op's outputs, in order, as an executor produced them (fp32; a device's fp16 buffers
// widened). An op with several outputs (kQkv: q, k, v; kNorm with add_residual: x, xn) has one
// entry per output.
//
// With `inputs` set (another executor's trace of the same step, the CPU's), a device executor
// loads each op's inputs from it before running the op, so that every op is compared alone
// rather than through the rounding of all the ops before it.
struct OpTrace {
  struct Entry {
    int op = 0;          // index in DecoderProgram::ops
    std::string output;  // "k"
    std::string name;    // OpName and the output: "layer 3 qkv: k"
    int64_t rows = 0;    // T, or R for the output norm and logits
    int64_t width = 0;
    std::vector<float> values;  // [rows, width]
  };
  std::vector<Entry> entries;
  const OpTrace* inputs = nullptr;

  // Appends output `out` of op `index` (`op`): `rows` x out.width values copied from `data`.
  void Record(int index, const DecoderOp& op, const struct OpOutput& out, int64_t rows,
              const float* data);
  // The latest entry of output `output` recorded by an op before op `index`: what op `index`
  // reads as that input. Null when none.
  const Entry* LatestBefore(int index, std::string_view output) const;
};

// An op's output as traced: its name and width.
struct OpOutput {
  const char* name;  // "x", "xn", "q", "k", "v", "attn", "proj", "hidden", "logits"
  int64_t width;
};
// The outputs of `op` in trace order, with `config`'s widths.
std::vector<OpOutput> OpOutputs(const DecoderOp& op, const ModelConfig& config);
// The activations `op` reads ("x", "proj", "xn", "q", "k", "v", "attn", "hidden"; the embedding
// reads the step's tokens, the attention also the cache's earlier K/V).
std::vector<const char*> OpInputs(const DecoderOp& op);

}  // namespace subspace

#endif  // SUBSPACE_CORE_MODEL_DECODER_OPS_H_
