// DescribeDecoder: the ops of one step for a model family (decoder_ops.h).
#include "core/model/decoder_ops.h"

#include "absl/strings/str_cat.h"

namespace subspace {

absl::StatusOr<DecoderProgram> DescribeDecoder(const ModelConfig& config) {
  DecoderProgram p;
  absl::StatusOr<RopeSchedule> rope = config.rope();
  if (!rope.ok()) return rope.status();
  p.rope = *std::move(rope);
  p.rms_eps = config.rms_eps;
  p.ops.reserve(static_cast<size_t>(7 * config.n_layers + 4));
  p.ops.push_back({.kind = OpKind::kEmbed});
  for (int l = 0; l < config.n_layers; ++l) {
    // Past the first layer, the previous layer's FFN output joins x in the attention norm.
    p.ops.push_back(
        {.kind = OpKind::kNorm, .layer = l, .norm = NormWeight::kAttention, .add_residual = l > 0});
    p.ops.push_back(
        {.kind = OpKind::kQkv, .layer = l, .bias = config.qkv_bias, .qk_norm = config.qk_norm});
    p.ops.push_back({.kind = OpKind::kAttention, .layer = l, .window = config.sliding_window});
    p.ops.push_back({.kind = OpKind::kAttnOut, .layer = l});
    p.ops.push_back(
        {.kind = OpKind::kNorm, .layer = l, .norm = NormWeight::kFfn, .add_residual = true});
    p.ops.push_back({.kind = OpKind::kFfnUp, .layer = l});
    p.ops.push_back({.kind = OpKind::kFfnDown, .layer = l});
  }
  p.ops.push_back({.kind = OpKind::kResidual});
  p.ops.push_back({.kind = OpKind::kOutputNorm});
  p.ops.push_back({.kind = OpKind::kLogits});
  return p;
}

std::string OpName(const DecoderOp& op) {
  const char* what = "";
  switch (op.kind) {
    case OpKind::kEmbed:
      what = "embed";
      break;
    case OpKind::kNorm:
      what = op.norm == NormWeight::kAttention ? "attention norm" : "ffn norm";
      break;
    case OpKind::kQkv:
      what = "qkv";
      break;
    case OpKind::kAttention:
      what = "attention";
      break;
    case OpKind::kAttnOut:
      what = "attention output";
      break;
    case OpKind::kFfnUp:
      what = "ffn gate-up";
      break;
    case OpKind::kFfnDown:
      what = "ffn down";
      break;
    case OpKind::kResidual:
      what = "residual";
      break;
    case OpKind::kOutputNorm:
      what = "output norm";
      break;
    case OpKind::kLogits:
      what = "logits";
      break;
  }
  return op.layer >= 0 ? absl::StrCat("layer ", op.layer, " ", what) : std::string(what);
}

std::vector<OpOutput> OpOutputs(const DecoderOp& op, const ModelConfig& config) {
  const int64_t dim = config.dim, q_width = config.q_width(), kv_width = config.kv_width();
  switch (op.kind) {
    case OpKind::kEmbed:
    case OpKind::kResidual:
      return {{"x", dim}};
    case OpKind::kNorm:
      if (op.add_residual) return {{"x", dim}, {"xn", dim}};
      return {{"xn", dim}};
    case OpKind::kQkv:
      return {{"q", q_width}, {"k", kv_width}, {"v", kv_width}};
    case OpKind::kAttention:
      return {{"attn", q_width}};
    case OpKind::kAttnOut:
    case OpKind::kFfnDown:
      return {{"proj", dim}};
    case OpKind::kFfnUp:
      return {{"hidden", config.ffn_dim}};
    case OpKind::kOutputNorm:
      return {{"xn", dim}};
    case OpKind::kLogits:
      return {{"logits", config.n_vocab}};
  }
  return {};
}

std::vector<const char*> OpInputs(const DecoderOp& op) {
  switch (op.kind) {
    case OpKind::kEmbed:
      return {};
    case OpKind::kNorm:
      if (op.add_residual) return {"x", "proj"};
      return {"x"};
    case OpKind::kQkv:
    case OpKind::kFfnUp:
    case OpKind::kLogits:
      return {"xn"};
    case OpKind::kAttention:
      return {"q", "k", "v"};
    case OpKind::kAttnOut:
      return {"attn"};
    case OpKind::kFfnDown:
      return {"hidden"};
    case OpKind::kResidual:
      return {"x", "proj"};
    case OpKind::kOutputNorm:
      return {"x"};
  }
  return {};
}

const OpTrace::Entry* OpTrace::LatestBefore(int index, std::string_view output) const {
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (it->op < index && it->output == output) return &*it;
  }
  return nullptr;
}

void OpTrace::Record(int index, const DecoderOp& op, const OpOutput& out, int64_t rows,
                     const float* data) {
  Entry& e = entries.emplace_back();
  e.op = index;
  e.output = out.name;
  e.name = absl::StrCat(OpName(op), ": ", out.name);
  e.rows = rows;
  e.width = out.width;
  e.values.assign(data, data + rows * out.width);
}

}  // namespace subspace
