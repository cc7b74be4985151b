// LlamaModel: maps a GGUF file's tensors into WeightMatrix views (checking every shape and
// type up front) and runs the batched forward pass, the model's DecoderProgram
// (decoder_ops.h) op by op: all T tokens of a step through each matmul at once, attention per
// sequence through the KvCache.
#include "core/model/model.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/tensor_types.h"
#include "core/cpu/ops.h"

namespace subspace {

// Activations of one step, grown only when a step has more tokens than any before it.
struct LlamaModel::Workspace {
  int64_t rows = 0;                  // tokens T the buffers hold
  std::vector<float> x;              // [T, dim] residual stream
  std::vector<float> xn;             // [T, dim] normed input of a sub-layer
  std::vector<float> proj;           // [T, dim] sub-layer output before the residual add
  std::vector<float> q;              // [T, n_heads, head_dim]
  std::vector<float> k;              // [T, n_kv_heads, head_dim]
  std::vector<float> v;              // [T, n_kv_heads, head_dim]
  std::vector<float> attn;           // [T, n_heads, head_dim]
  std::vector<float> gate;           // [T, ffn_dim]
  std::vector<float> up;             // [T, ffn_dim]
  std::vector<float> hidden;         // [T, ffn_dim]
  std::vector<int32_t> tokens;       // [T]
  std::vector<int64_t> positions;    // [T]
  std::vector<int64_t> logit_rows;   // [R] rows of x that get logits
  std::vector<int64_t> chunk_first;  // [chunks] first row of each chunk
  std::vector<AttentionRequest> requests;
  std::vector<SeqId> seq_sorted;

  void Reserve(const ModelConfig& c, int64_t t) {
    if (t <= rows) return;
    const auto n = [t](int64_t width) { return static_cast<size_t>(t * width); };
    const int64_t q_width = static_cast<int64_t>(c.n_heads) * c.head_dim;
    const int64_t kv_width = static_cast<int64_t>(c.n_kv_heads) * c.head_dim;
    x.resize(n(c.dim));
    xn.resize(n(c.dim));
    proj.resize(n(c.dim));
    q.resize(n(q_width));
    k.resize(n(kv_width));
    v.resize(n(kv_width));
    attn.resize(n(q_width));
    gate.resize(n(c.ffn_dim));
    up.resize(n(c.ffn_dim));
    hidden.resize(n(c.ffn_dim));
    tokens.resize(n(1));
    positions.resize(n(1));
    logit_rows.resize(n(1));
    rows = t;
  }
};

namespace {

// A 2-D weight [rows, cols] (GGUF dims {cols, rows}) in a type the matmul kernels read.
absl::StatusOr<WeightMatrix> MapMatrix(const GgufFile& file, const std::string& name, int64_t rows,
                                       int64_t cols) {
  const GgufTensorInfo* t = file.FindTensor(name);
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name));
  if (t->dims.size() != 2 || t->dims[0] != cols || t->dims[1] != rows) {
    std::string dims;
    for (int64_t d : t->dims) absl::StrAppend(&dims, dims.empty() ? "" : ", ", d);
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor %s has dims {%s}, expected {%d, %d} (cols, rows)", name, dims, cols, rows));
  }
  if (!IsSupportedTensorType(static_cast<uint32_t>(t->type))) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor %s has type %s, which the matmul kernels do not read", name,
                        TensorTypeName(t->type)));
  }
  WeightMatrix w;
  w.type = t->type;
  w.rows = rows;
  w.cols = cols;
  w.data = t->data;
  if (w.row_bytes() == 0 || t->num_bytes != static_cast<uint64_t>(rows) * w.row_bytes() ||
      t->data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor %s: %d bytes do not hold %d rows of %d %s values", name,
                        t->num_bytes, rows, cols, TensorTypeName(t->type)));
  }
  return w;
}

}  // namespace

LlamaModel::~LlamaModel() = default;

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Open(const std::string& path) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  return Load(std::shared_ptr<const GgufFile>(*std::move(file)));
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(std::shared_ptr<const GgufFile> file) {
  if (file == nullptr) return absl::InvalidArgumentError("null GGUF file");
  absl::StatusOr<ModelConfig> config = ModelConfig::FromGguf(*file);
  if (!config.ok()) return config.status();
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->file_ = std::move(file);
  m->config_ = *std::move(config);
  m->ws_ = std::make_unique<Workspace>();
  const GgufFile& f = *m->file_;
  const ModelConfig& c = m->config_;

  // A vector weight (norm, bias) of `n` values as fp32: in place when stored F32 (and
  // aligned), else a copy.
  const auto map_vector = [&](const std::string& name, int64_t n) -> absl::StatusOr<const float*> {
    const GgufTensorInfo* t = f.FindTensor(name);
    if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name));
    if (t->dims.size() != 1 || t->dims[0] != n) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor %s must be 1-D of %d elements", name, n));
    }
    if (t->type != TensorType::kF32 && t->type != TensorType::kF16 &&
        t->type != TensorType::kBF16) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor %s has type %s; norms and biases must be F32, F16 or BF16", name,
                          TensorTypeName(t->type)));
    }
    if (t->data == nullptr || t->num_bytes != TensorRowBytes(t->type, n)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has the wrong size"));
    }
    if (t->type == TensorType::kF32 && reinterpret_cast<uintptr_t>(t->data) % alignof(float) == 0) {
      return reinterpret_cast<const float*>(t->data);
    }
    std::vector<float>& copy = m->f32_copies_.emplace_back(static_cast<size_t>(n));
    DequantizeRow(t->type, t->data, copy.data(), n);
    return copy.data();
  };

  const int64_t q_width = c.q_width();
  const int64_t kv_width = c.kv_width();
  absl::Status status;
  const auto take_matrix = [&](const std::string& name, int64_t rows, int64_t cols,
                               WeightMatrix* out) {
    if (!status.ok()) return;
    absl::StatusOr<WeightMatrix> w = MapMatrix(f, name, rows, cols);
    if (w.ok()) {
      *out = *w;
    } else {
      status = w.status();
    }
  };
  const auto take_vector = [&](const std::string& name, int64_t n, const float** out) {
    if (!status.ok()) return;
    absl::StatusOr<const float*> p = map_vector(name, n);
    if (p.ok()) {
      *out = *p;
    } else {
      status = p.status();
    }
  };
  // Rows [first, first + rows) of a fused matrix, as a view.
  const auto slice = [](const WeightMatrix& fused, int64_t first, int64_t rows) {
    WeightMatrix w = fused;
    w.rows = rows;
    w.data = static_cast<const uint8_t*>(fused.data) + first * fused.row_bytes();
    return w;
  };

  // Norms, biases and copies: reserve so the pointers handed out stay put.
  m->f32_copies_.reserve(static_cast<size_t>(7 * c.n_layers + 1));
  take_matrix("token_embd.weight", c.n_vocab, c.dim, &m->token_embd_);
  m->layers_.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    Layer& layer = m->layers_[static_cast<size_t>(l)];
    const std::string p = absl::StrCat("blk.", l, ".");
    take_vector(p + "attn_norm.weight", c.dim, &layer.attn_norm);
    if (f.FindTensor(p + "attn_qkv.weight") != nullptr) {  // Phi-3: [q | k | v] rows
      WeightMatrix qkv;
      take_matrix(p + "attn_qkv.weight", q_width + 2 * kv_width, c.dim, &qkv);
      if (status.ok()) {
        layer.wq = slice(qkv, 0, q_width);
        layer.wk = slice(qkv, q_width, kv_width);
        layer.wv = slice(qkv, q_width + kv_width, kv_width);
      }
    } else {
      take_matrix(p + "attn_q.weight", q_width, c.dim, &layer.wq);
      take_matrix(p + "attn_k.weight", kv_width, c.dim, &layer.wk);
      take_matrix(p + "attn_v.weight", kv_width, c.dim, &layer.wv);
    }
    if (c.qkv_bias) {
      take_vector(p + "attn_q.bias", q_width, &layer.bq);
      take_vector(p + "attn_k.bias", kv_width, &layer.bk);
      take_vector(p + "attn_v.bias", kv_width, &layer.bv);
    }
    if (c.qk_norm) {
      take_vector(p + "attn_q_norm.weight", c.head_dim, &layer.q_norm);
      take_vector(p + "attn_k_norm.weight", c.head_dim, &layer.k_norm);
    }
    take_matrix(p + "attn_output.weight", c.dim, q_width, &layer.wo);
    take_vector(p + "ffn_norm.weight", c.dim, &layer.ffn_norm);
    if (f.FindTensor(p + "ffn_gate.weight") == nullptr && c.architecture == "phi3") {
      // Phi-3: ffn_up holds [gate | up] rows.
      WeightMatrix gate_up;
      take_matrix(p + "ffn_up.weight", 2 * static_cast<int64_t>(c.ffn_dim), c.dim, &gate_up);
      if (status.ok()) {
        layer.w_gate = slice(gate_up, 0, c.ffn_dim);
        layer.w_up = slice(gate_up, c.ffn_dim, c.ffn_dim);
      }
    } else {
      take_matrix(p + "ffn_gate.weight", c.ffn_dim, c.dim, &layer.w_gate);
      take_matrix(p + "ffn_up.weight", c.ffn_dim, c.dim, &layer.w_up);
    }
    take_matrix(p + "ffn_down.weight", c.dim, c.ffn_dim, &layer.w_down);
  }
  take_vector("output_norm.weight", c.dim, &m->output_norm_);
  if (c.tied_output) {
    m->output_ = m->token_embd_;
  } else {
    take_matrix("output.weight", c.n_vocab, c.dim, &m->output_);
  }
  if (!status.ok()) return status;
  absl::StatusOr<DecoderProgram> program = DescribeDecoder(c);
  if (!program.ok()) return program.status();
  m->program_ = *std::move(program);
  return m;
}

absl::Status LlamaModel::Forward(std::span<const SequenceChunk> batch, KvCacheBase& cache_base,
                                 std::vector<float>* logits) {
  return Run(batch, cache_base, logits, nullptr);
}

absl::Status LlamaModel::ForwardTraced(std::span<const SequenceChunk> batch,
                                       KvCacheBase& cache_base, std::vector<float>* logits,
                                       OpTrace* trace) {
  if (trace == nullptr) return absl::InvalidArgumentError("null trace");
  if (trace->inputs != nullptr) {
    return absl::InvalidArgumentError(
        "the CPU backend is the reference: it computes every op's inputs itself");
  }
  return Run(batch, cache_base, logits, trace);
}

absl::Status LlamaModel::Run(std::span<const SequenceChunk> batch, KvCacheBase& cache_base,
                             std::vector<float>* logits, OpTrace* trace) {
  const ModelConfig& c = config_;
  Workspace& ws = *ws_;
  // ---- Validation: nothing is written before every chunk has been checked. ----------------
  KvCache* host_cache = cache_base.AsHostCache();
  if (host_cache == nullptr) {
    return absl::InvalidArgumentError(
        "the CPU backend needs a KV cache in host memory; this one lives on a device");
  }
  KvCache& cache = *host_cache;
  int64_t total = 0;
  int64_t logit_rows = 0;
  if (absl::Status st = ValidateStep(c, batch, cache, logits, &ws.seq_sorted, &total, &logit_rows);
      !st.ok()) {
    return st;
  }

  // ---- Gather the step's tokens into one [T, dim] activation matrix. ------------------------
  const int64_t t_rows = total;
  ws.Reserve(c, t_rows);
  ws.chunk_first.clear();
  ws.requests.clear();
  int64_t row = 0;
  int64_t out_row = 0;
  for (const SequenceChunk& ch : batch) {
    ws.chunk_first.push_back(row);
    const int64_t n = static_cast<int64_t>(ch.tokens.size());
    for (int64_t i = 0; i < n; ++i) {
      ws.tokens[static_cast<size_t>(row + i)] = ch.tokens[i];
      ws.positions[static_cast<size_t>(row + i)] = ch.pos + i;
    }
    if (ch.all_logits) {
      for (int64_t i = 0; i < n; ++i) ws.logit_rows[static_cast<size_t>(out_row++)] = row + i;
    } else {
      ws.logit_rows[static_cast<size_t>(out_row++)] = row + n - 1;
    }
    row += n;
  }
  const int64_t dim = c.dim;
  const int64_t q_width = c.q_width();
  const int64_t kv_width = c.kv_width();
  for (size_t ci = 0; ci < batch.size(); ++ci) {
    const int64_t first = ws.chunk_first[ci];
    ws.requests.push_back({batch[ci].seq, batch[ci].pos,
                           static_cast<int64_t>(batch[ci].tokens.size()),
                           ws.q.data() + first * q_width, ws.attn.data() + first * q_width});
  }

  float* x = ws.x.data();
  float* xn = ws.xn.data();
  float* proj = ws.proj.data();
  const float eps = program_.rms_eps;
  // ---- The program's ops (core/model/decoder_ops.h), in order. ----------------------------
  for (size_t i = 0; i < program_.ops.size(); ++i) {
    const DecoderOp& op = program_.ops[i];
    const Layer* layer = op.layer >= 0 ? &layers_[static_cast<size_t>(op.layer)] : nullptr;
    int64_t rows = t_rows;  // of the op's outputs
    switch (op.kind) {
      case OpKind::kEmbed:
        cpu::Embed(token_embd_, ws.tokens.data(), t_rows, x);
        break;
      case OpKind::kNorm:
        if (op.add_residual) cpu::AddInPlace(x, proj, t_rows * dim);
        cpu::RmsNorm(x, op.norm == NormWeight::kAttention ? layer->attn_norm : layer->ffn_norm,
                     t_rows, dim, eps, xn);
        break;
      case OpKind::kQkv:
        cpu::MatMuls(
            {{&layer->wq, ws.q.data()}, {&layer->wk, ws.k.data()}, {&layer->wv, ws.v.data()}}, xn,
            t_rows);
        if (op.bias) {
          cpu::AddBias(ws.q.data(), layer->bq, t_rows, q_width);
          cpu::AddBias(ws.k.data(), layer->bk, t_rows, kv_width);
          cpu::AddBias(ws.v.data(), layer->bv, t_rows, kv_width);
        }
        if (op.qk_norm) {  // per head, in place
          cpu::RmsNorm(ws.q.data(), layer->q_norm, t_rows * c.n_heads, c.head_dim, eps,
                       ws.q.data());
          cpu::RmsNorm(ws.k.data(), layer->k_norm, t_rows * c.n_kv_heads, c.head_dim, eps,
                       ws.k.data());
        }
        // GGUF "llama" files store Q/K rows permuted for adjacent-pair RoPE, the other families
        // rotate halves: the schedule knows which.
        cpu::Rope(ws.q.data(), t_rows, c.n_heads, c.head_dim, program_.rope, ws.positions.data());
        cpu::Rope(ws.k.data(), t_rows, c.n_kv_heads, c.head_dim, program_.rope,
                  ws.positions.data());
        break;
      case OpKind::kAttention:
        for (size_t ci = 0; ci < batch.size(); ++ci) {
          const int64_t first = ws.chunk_first[ci];
          cache.Write(op.layer, batch[ci].seq, batch[ci].pos,
                      static_cast<int64_t>(batch[ci].tokens.size()), ws.k.data() + first * kv_width,
                      ws.v.data() + first * kv_width);
          ws.requests[ci].window = op.window;
        }
        cache.Attend(op.layer, ws.requests, c.n_heads);
        break;
      case OpKind::kAttnOut:
        cpu::MatMul(layer->wo, ws.attn.data(), t_rows, proj);
        break;
      case OpKind::kFfnUp:
        cpu::MatMuls({{&layer->w_gate, ws.gate.data()}, {&layer->w_up, ws.up.data()}}, xn, t_rows);
        cpu::SwiGlu(ws.gate.data(), ws.up.data(), t_rows * c.ffn_dim, ws.hidden.data());
        break;
      case OpKind::kFfnDown:
        cpu::MatMul(layer->w_down, ws.hidden.data(), t_rows, proj);
        break;
      case OpKind::kResidual:
        cpu::AddInPlace(x, proj, t_rows * dim);
        break;
      case OpKind::kOutputNorm: {
        // Only the rows that get logits (usually one per sequence).
        const float* in = x;
        if (logit_rows != t_rows) {
          for (int64_t r = 0; r < logit_rows; ++r) {
            std::memcpy(proj + r * dim, x + ws.logit_rows[static_cast<size_t>(r)] * dim,
                        static_cast<size_t>(dim) * sizeof(float));
          }
          in = proj;
        }
        cpu::RmsNorm(in, output_norm_, logit_rows, dim, eps, xn);
        rows = logit_rows;
        break;
      }
      case OpKind::kLogits:
        logits->resize(static_cast<size_t>(logit_rows * c.n_vocab));
        cpu::MatMul(output_, xn, logit_rows, logits->data());
        rows = logit_rows;
        break;
    }
    if (trace != nullptr) {
      for (const OpOutput& out : OpOutputs(op, c)) {
        const std::string_view name = out.name;
        const float* data = name == "x"        ? x
                            : name == "xn"     ? xn
                            : name == "q"      ? ws.q.data()
                            : name == "k"      ? ws.k.data()
                            : name == "v"      ? ws.v.data()
                            : name == "attn"   ? ws.attn.data()
                            : name == "proj"   ? proj
                            : name == "hidden" ? ws.hidden.data()
                                               : logits->data();
        trace->Record(static_cast<int>(i), op, out, rows, data);
      }
    }
  }

  for (const SequenceChunk& ch : batch) {
    absl::Status st = cache.Commit(ch.seq, ch.pos + static_cast<int64_t>(ch.tokens.size()));
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace subspace
