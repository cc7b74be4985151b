// CudaLlamaModel's step: host plan into pinned memory (cuda_step_plan.h), one copy to the
// device, then per layer RMSNorm → QKV GEMM → RoPE/split → KV append → attention (decode and
// prefill kernels) → output GEMM → residual → RMSNorm → gate/up GEMM → SwiGLU → down GEMM →
// residual; final norm of the logit rows, vocabulary GEMM, and one copy back of the logits or,
// sampled on the device, of the tokens. The ops and their parameters are the model's
// DecoderProgram (core/model/decoder_ops.h), the list the CPU backend runs too. Decode-only steps
// replay as CUDA graphs (step_graphs.h). Sequences refreshing by kqsvd also get their query rows
// back (gathered after RoPE, copied once at the end of the step) for their refresher.
#include "cuda/cuda_model_impl.h"

namespace subspace::cuda {

absl::Status CudaLlamaModel::Forward(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                                     std::vector<float>* logits) {
  return impl_->Run(batch, cache, logits, {}, nullptr);
}

absl::Status CudaLlamaModel::ForwardTraced(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                                           std::vector<float>* logits, OpTrace* trace) {
  if (trace == nullptr) return absl::InvalidArgumentError("null trace");
  impl_->trace = trace;
  absl::Status st = impl_->Run(batch, cache, logits, {}, nullptr);
  impl_->trace = nullptr;
  return st;
}

absl::Status CudaLlamaModel::ForwardAndSample(std::span<const SequenceChunk> batch,
                                              KvCacheBase& cache, std::span<const RowSampling> rows,
                                              std::vector<TokenLogprob>* sampled) {
  if (rows.size() != batch.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d sampling rows for %d chunks: one per chunk", rows.size(), batch.size()));
  }
  for (const SequenceChunk& ch : batch) {
    if (ch.all_logits) return absl::InvalidArgumentError("device sampling takes one row per chunk");
  }
  if (sampled == nullptr) return absl::InvalidArgumentError("null sampled");
  return impl_->Run(batch, cache, nullptr, rows, sampled);
}

absl::Status CudaLlamaModel::Impl::Run(std::span<const SequenceChunk> batch, KvCacheBase& cache,
                                       std::vector<float>* logits,
                                       std::span<const RowSampling> rows,
                                       std::vector<TokenLogprob>* sampled) {
  int64_t t_rows = 0, logit_rows = 0;
  // ValidateStep wants the logits vector only to tell "none" from "some": the sampled path has
  // its own output.
  std::vector<float> unused;
  if (absl::Status st = ValidateStep(config, batch, cache, logits != nullptr ? logits : &unused,
                                     &seq_scratch, &t_rows, &logit_rows);
      !st.ok()) {
    return st;
  }
  if (&cache != this->cache) {
    return absl::InvalidArgumentError(
        "the CUDA backend runs only on the device KV cache created with it");
  }
  if (t_rows > options.max_batch_tokens ||
      static_cast<int64_t>(batch.size()) > options.max_sequences) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "step of %d tokens in %d chunks exceeds the CUDA backend's %d tokens / %d sequences",
        t_rows, batch.size(), options.max_batch_tokens, options.max_sequences));
  }
  if (absl::Status st = CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"); !st.ok()) {
    return st;
  }
  return Step(batch, t_rows, logit_rows, logits, rows, sampled);
}

absl::Status CudaLlamaModel::Impl::Step(std::span<const SequenceChunk> batch, int64_t t_rows,
                                        int64_t n_logit_rows, std::vector<float>* out_logits,
                                        std::span<const RowSampling> rows,
                                        std::vector<TokenLogprob>* sampled) {
  const ModelConfig& m = config;
  // Work queued outside a step (a Commit by the engine) runs before this step's writes.
  if (absl::Status st = cache->Flush(); !st.ok()) return st;

  // ---- Plan on the host: decodes first, then prefill chunks (cuda_step_plan.h). ------------
  const StepPlanInputs inputs = {.meta = &meta,
                                 .meta_host = meta_host->data(),
                                 .block_size = options.block_size,
                                 .n_kv_heads = m.n_kv_heads,
                                 .target_ctas = target_ctas,
                                 .sliding_window = sliding_window,
                                 .cache = cache,
                                 .scratch_pages = scratch_pages};
  if (absl::Status st = planner.Plan(inputs, batch, &plan); !st.ok()) return st;

  // ---- The forward pass: replayed as a graph for decode-only steps (step_graphs.h). --------
  absl::Status st =
      options.cuda_graphs && plan.n_prefill == 0 && trace == nullptr
          ? graphs.Run(stream, plan.n_decode, [&] { return EnqueueForward(t_rows, n_logit_rows); })
          : EnqueueForward(t_rows, n_logit_rows);

  // ---- Logits of the rows asked for back to the host, or the tokens sampled from them. -------
  const size_t logit_bytes = static_cast<size_t>(n_logit_rows) * m.n_vocab * sizeof(float);
  if (st.ok()) {
    st = !rows.empty() ? EnqueueSampling(rows)
                       : CudaStatus(cudaMemcpyAsync(logits_host->data(), logits, logit_bytes,
                                                    cudaMemcpyDeviceToHost, stream),
                                    "logits copy");
  }
  // Wait even after a failed launch: the host buffers must not be reused while work is queued.
  absl::Status sync = CudaStatus(cudaStreamSynchronize(stream), "step");
  if (!st.ok()) return st;
  if (!sync.ok()) return sync;
  if (!rows.empty()) {
    const int64_t s_cap = options.max_sequences;
    const auto* token = reinterpret_cast<const int32_t*>(meta_host->data() + meta.sample_out);
    const auto* logprob = reinterpret_cast<const float*>(token + s_cap);
    sampled->resize(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) (*sampled)[i] = {token[i], logprob[i]};
  } else {
    out_logits->resize(static_cast<size_t>(n_logit_rows) * m.n_vocab);
    std::memcpy(out_logits->data(), logits_host->data(), logit_bytes);
  }

  // Before the commits, which may install a refreshed epoch: these queries belong to the epoch
  // the step attended with, as on the CPU backend.
  if (absl::Status q = DeliverQueries(); !q.ok()) return q;
  for (const SequenceChunk& ch : batch) {
    if (absl::Status c = cache->Commit(ch.seq, ch.pos + static_cast<int64_t>(ch.tokens.size()));
        !c.ok()) {
      return c;
    }
  }
  // The blocks that left the window, coded in one batch on the stream (ahead of the next step).
  return cache->Flush();
}

absl::Status CudaLlamaModel::Impl::ExpandLowRank(int l, int64_t e0, int64_t n_expand) {
  const KvLayer& kv = kv_layers[static_cast<size_t>(l)];
  kernels::ExpandBlocksParams ep;
  ep.layout = kv.layout;
  ep.src_pool = kv.pool;
  ep.dst_pool = scratch;
  ep.basis_pq = kv.basis_pq;
  ep.basis_rv = kv.basis_rv;
  ep.src_page = MetaDevice<int32_t>(meta.exp_src_page) + e0;
  ep.src_slot = MetaDevice<int32_t>(meta.exp_src_slot) + e0;
  ep.dst_page = MetaDevice<int32_t>(meta.exp_dst) + e0;
  ep.epoch = MetaDevice<int32_t>(meta.exp_epoch) + e0 * config.n_kv_heads;
  ep.n_blocks = static_cast<int32_t>(n_expand);
  absl::Status st = Launch(kernels::LaunchExpandBlocks(ep, stream), "history expansion");
  if (st.ok() && plan.exp_outliers) {
    // The expanded blocks' outliers, exact, from the pool's outlier pages.
    kernels::OutlierTokensParams op;
    op.layout = kv.layout;
    op.block_pool = scratch;
    op.outlier_pool = kv.pool;
    op.block_page = MetaDevice<int32_t>(meta.exp_dst) + e0;
    op.mask = MetaDevice<uint64_t>(meta.exp_outlier_mask) + e0;
    op.first_slot = MetaDevice<int32_t>(meta.exp_outlier_first) + e0;
    op.outlier_page = MetaDevice<int32_t>(meta.exp_outlier_pages) + 2 * e0;
    op.n_blocks = static_cast<int32_t>(n_expand);
    op.direction = kernels::OutlierMove::kToBlockPages;
    st = Launch(kernels::LaunchOutlierTokens(op, stream), "history outliers");
  }
  return st;
}

absl::Status CudaLlamaModel::Impl::ExpandTransform(int l, int64_t e0, int64_t n_expand) {
  return Launch(transform_store->ExpandInto(l, scratch, MetaDevice<int32_t>(meta.exp_src_page) + e0,
                                            MetaDevice<int32_t>(meta.exp_src_slot) + e0,
                                            MetaDevice<int32_t>(meta.exp_dst) + e0,
                                            MetaDevice<int32_t>(meta.exp_first_pos) + e0,
                                            static_cast<int32_t>(n_expand)),
                "history decoding");
}

absl::Status CudaLlamaModel::Impl::EnqueueQueryGather(int layer) {
  const int64_t n = plan.n_query_rows;
  return Launch(kernels::LaunchGatherRowsToHalf({.in = q,
                                                 .rows = MetaDevice<int32_t>(meta.query_rows),
                                                 .out = query_readback + layer * n * QWidth(),
                                                 .n_rows = static_cast<int32_t>(n),
                                                 .width = static_cast<int32_t>(QWidth())},
                                                stream),
                "query gather");
}

absl::Status CudaLlamaModel::Impl::DeliverQueries() {
  const int64_t n = plan.n_query_rows, width = QWidth(), layers = config.n_layers;
  if (n == 0) return absl::OkStatus();
  const auto* host = reinterpret_cast<const uint16_t*>(query_readback_host->data());
  for (const QuerySpan& span : plan.query_spans) {
    HalfQueryObservation o{
        .n_layers = config.n_layers, .n = span.n, .width = width, .weight = span.weight};
    o.q.resize(static_cast<size_t>(layers * span.n * width));
    for (int64_t l = 0; l < layers; ++l) {
      const uint16_t* src = host + (l * n + span.first) * width;
      std::copy(src, src + span.n * width, o.q.begin() + l * span.n * width);
    }
    if (absl::Status st = cache->ObserveQueries(span.seq, std::move(o)); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status CudaLlamaModel::Impl::EnqueueSampling(std::span<const RowSampling> rows) {
  // [5, S] parameters in the pinned metadata, copied whole (S is small), then the kernel over
  // the logits rows (one per chunk) and [2, S] results back into the pinned metadata.
  const int64_t s_cap = options.max_sequences;
  uint8_t* params = meta_host->data() + meta.sample_params;
  auto* temperature = reinterpret_cast<float*>(params);
  auto* top_k = reinterpret_cast<int32_t*>(temperature + s_cap);
  auto* top_p = reinterpret_cast<float*>(top_k + s_cap);
  auto* min_p = top_p + s_cap;
  auto* uniform = min_p + s_cap;
  for (size_t i = 0; i < rows.size(); ++i) {
    temperature[i] = rows[i].temperature;
    top_k[i] = rows[i].top_k;
    top_p[i] = rows[i].top_p;
    min_p[i] = rows[i].min_p;
    uniform[i] = rows[i].uniform;
  }
  if (absl::Status st = CudaStatus(
          cudaMemcpyAsync(meta_device + meta.sample_params, params,
                          static_cast<size_t>(5 * s_cap * 4), cudaMemcpyHostToDevice, stream),
          "sampling parameters copy");
      !st.ok()) {
    return st;
  }
  const auto* d_params = reinterpret_cast<const float*>(meta_device + meta.sample_params);
  auto* d_token = reinterpret_cast<int32_t*>(meta_device + meta.sample_out);
  if (absl::Status st = Launch(
          kernels::LaunchSampleTokens({.logits = logits,
                                       .temperature = d_params,
                                       .top_k = reinterpret_cast<const int32_t*>(d_params + s_cap),
                                       .top_p = d_params + 2 * s_cap,
                                       .min_p = d_params + 3 * s_cap,
                                       .uniform = d_params + 4 * s_cap,
                                       .token = d_token,
                                       .logprob = reinterpret_cast<float*>(d_token + s_cap),
                                       .n_rows = static_cast<int32_t>(rows.size()),
                                       .vocab = config.n_vocab},
                                      stream),
          "sampling");
      !st.ok()) {
    return st;
  }
  return CudaStatus(
      cudaMemcpyAsync(meta_host->data() + meta.sample_out, d_token,
                      static_cast<size_t>(2 * s_cap * 4), cudaMemcpyDeviceToHost, stream),
      "sampled tokens copy");
}

absl::Status CudaLlamaModel::Impl::EnqueueAttention(const DecoderOp& op, int32_t t) {
  const ModelConfig& m = config;
  const int64_t n_decode = plan.n_decode, n_prefill = plan.n_prefill;
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(m.head_dim));
  const KvLayer& kv = kv_layers[static_cast<size_t>(op.layer)];
  absl::Status st =
      Launch(kernels::LaunchAppendKv({.layout = kv.layout,
                                      .pool = kv.pool,
                                      .k = k,
                                      .v = v,
                                      .slot_mapping = MetaDevice<int64_t>(meta.slot_mapping),
                                      .n = t},
                                     stream),
             "kv append");
  // Decodes: the window is in the plan (its rows before the window masked), made for
  // StepPlanInputs::sliding_window, which is every attention op's.
  if (st.ok() && n_decode > 0) {
    kernels::DecodeAttentionParams p;
    p.layout = kv.layout;
    p.plan = plan.decode.DeviceView(meta_device + meta.plan);
    p.pool = kv.pool;
    p.basis_pq = kv.basis_pq;
    p.basis_rv = kv.basis_rv;
    p.transform = kv.transform;
    p.key_rope = kv.key_rope;
    p.q = q;
    p.out = attn;
    p.workspace = decode_workspace;
    p.n_heads = m.n_heads;
    p.sm_scale = sm_scale;
    st = Launch(kernels::LaunchDecodeAttention(p, stream), "decode attention");
  }
  // Prefill chunks, group by group: the group's coded history decoded into the scratch pages
  // (by the cache kind's kernels), then attention over pool and scratch pages.
  for (size_t g = 0; st.ok() && n_prefill > 0 && g < plan.group_end.size(); ++g) {
    const int first = g == 0 ? 0 : plan.group_end[g - 1];
    const int64_t e0 = plan.group_exp[g], n_expand = plan.group_exp[g + 1] - e0;
    if (n_expand > 0) {
      st = (this->*expand_history)(op.layer, e0, n_expand);
      if (!st.ok()) break;
    }
    // q_indptr holds rows from the first prefill row, so a group only moves the pointers.
    const int64_t off = n_decode * QWidth();
    kernels::PrefillAttentionParams pp;
    pp.layout = kv.layout;
    pp.pool = kv.pool;
    pp.scratch = scratch;
    pp.block_table = MetaDevice<int32_t>(meta.block_table) + int64_t{first} * plan.table_stride;
    pp.seq_q_indptr = MetaDevice<int32_t>(meta.q_indptr) + first;
    pp.seq_q_start = MetaDevice<int32_t>(meta.q_start) + first;
    pp.q = q + off;
    pp.out = attn + off;
    pp.num_seqs = plan.group_end[g] - first;
    pp.max_blocks = plan.table_stride;
    pp.max_q_per_seq = plan.max_q;
    pp.n_heads = m.n_heads;
    pp.sm_scale = sm_scale;
    pp.window = op.window;
    st = Launch(kernels::LaunchPrefillAttention(pp, stream), "prefill attention");
  }
  return st;
}

// The device buffer holding activation `name` (fp16 for xn and hidden, else fp32).
void* CudaLlamaModel::Impl::ActivationBuffer(std::string_view name, bool* half) {
  *half = name == "xn" || name == "hidden";
  if (name == "xn") return xn;
  if (name == "hidden") return hidden;
  if (name == "x") return x;
  if (name == "q") return q;
  if (name == "k") return k;
  if (name == "v") return v;
  if (name == "attn") return attn;
  if (name == "proj") return proj;
  return logits;
}

absl::Status CudaLlamaModel::Impl::LoadInputs(int index, int64_t t_rows, int64_t n_logit_rows) {
  const DecoderOp& op = program.ops[static_cast<size_t>(index)];
  if (absl::Status st = CudaStatus(cudaStreamSynchronize(stream), "trace"); !st.ok()) return st;
  const bool logit_rows = op.kind == OpKind::kLogits;  // the output norm's rows
  const int64_t rows = logit_rows ? n_logit_rows : t_rows;
  std::vector<uint16_t> half_values;
  for (const char* input : OpInputs(op)) {
    const OpTrace::Entry* e = trace->inputs->LatestBefore(index, input);
    if (e == nullptr || e->rows != rows) {
      return absl::InvalidArgumentError(
          absl::StrFormat("op trace inputs: no %d rows of %s before %s", rows, input, OpName(op)));
    }
    bool half = false;
    void* dst = ActivationBuffer(input, &half);
    const size_t n = e->values.size();
    absl::Status st;
    if (half) {
      half_values.resize(n);
      for (size_t j = 0; j < n; ++j) half_values[j] = Fp32ToFp16(e->values[j]);
      st = CudaStatus(cudaMemcpy(dst, half_values.data(), n * 2, cudaMemcpyHostToDevice),
                      "trace input copy");
    } else {
      st = CudaStatus(cudaMemcpy(dst, e->values.data(), n * 4, cudaMemcpyHostToDevice),
                      "trace input copy");
    }
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status CudaLlamaModel::Impl::TraceOutputs(int index, int64_t t_rows, int64_t n_logit_rows) {
  const DecoderOp& op = program.ops[static_cast<size_t>(index)];
  if (absl::Status st = CudaStatus(cudaStreamSynchronize(stream), "trace"); !st.ok()) return st;
  const bool logit_rows = op.kind == OpKind::kOutputNorm || op.kind == OpKind::kLogits;
  const int64_t rows = logit_rows ? n_logit_rows : t_rows;
  std::vector<float> host;
  std::vector<uint16_t> half_values;
  for (const OpOutput& out : OpOutputs(op, config)) {
    const size_t n = static_cast<size_t>(rows * out.width);
    host.resize(n);
    bool half = false;
    const void* src = ActivationBuffer(out.name, &half);
    absl::Status st;
    if (half) {
      half_values.resize(n);
      st = CudaStatus(cudaMemcpy(half_values.data(), src, n * 2, cudaMemcpyDeviceToHost),
                      "trace copy");
      for (size_t j = 0; j < n; ++j) host[j] = Fp16ToFp32(half_values[j]);
    } else {
      st = CudaStatus(cudaMemcpy(host.data(), src, n * 4, cudaMemcpyDeviceToHost), "trace copy");
    }
    if (!st.ok()) return st;
    trace->Record(index, op, out, rows, host.data());
  }
  return absl::OkStatus();
}

absl::Status CudaLlamaModel::Impl::EnqueueForward(int64_t t_rows, int64_t n_logit_rows) {
  const ModelConfig& m = config;

  // ---- One copy of the plan to the device. -------------------------------------------------
  if (absl::Status st = CudaStatus(
          cudaMemcpyAsync(meta_device, meta_host->data(), static_cast<size_t>(plan.meta_bytes),
                          cudaMemcpyHostToDevice, stream),
          "plan copy");
      !st.ok()) {
    return st;
  }
  // The expansion lists (after the plan's capacity): the used prefix of each.
  const int64_t n_exp = plan.n_exp;
  // With outliers to put back, their lists too (ints of 4 bytes; the mask is two).
  const int64_t n_exp_outliers = plan.exp_outliers ? n_exp : 0;
  for (const auto& [offset, ints] :
       {std::pair{meta.exp_src_page, n_exp}, std::pair{meta.exp_src_slot, n_exp},
        std::pair{meta.exp_dst, n_exp}, std::pair{meta.exp_epoch, n_exp * m.n_kv_heads},
        std::pair{meta.exp_first_pos, n_exp}, std::pair{meta.exp_outlier_mask, 2 * n_exp_outliers},
        std::pair{meta.exp_outlier_first, n_exp_outliers},
        std::pair{meta.exp_outlier_pages, 2 * n_exp_outliers},
        std::pair{meta.query_rows, plan.n_query_rows}}) {
    if (ints == 0) continue;
    if (absl::Status st = CudaStatus(
            cudaMemcpyAsync(meta_device + offset, meta_host->data() + offset,
                            static_cast<size_t>(ints) * 4, cudaMemcpyHostToDevice, stream),
            "expansion and query list copy");
        !st.ok()) {
      return st;
    }
  }

  // ---- The program's ops (core/model/decoder_ops.h), in order. ----------------------------
  const int32_t t = static_cast<int32_t>(t_rows);
  const int32_t rows = static_cast<int32_t>(n_logit_rows);
  const int64_t dim = m.dim;
  absl::Status st;
  for (size_t i = 0; i < program.ops.size() && st.ok(); ++i) {
    const DecoderOp& op = program.ops[i];
    const DeviceLayer* w = op.layer >= 0 ? &layers[static_cast<size_t>(op.layer)] : nullptr;
    if (trace != nullptr && trace->inputs != nullptr) {
      st = LoadInputs(static_cast<int>(i), t_rows, n_logit_rows);
      if (!st.ok()) break;
    }
    switch (op.kind) {
      case OpKind::kEmbed:
        st = Launch(kernels::LaunchEmbedding({.table = embd,
                                              .tokens = MetaDevice<int32_t>(meta.tokens),
                                              .out = x,
                                              .n = t,
                                              .dim = m.dim,
                                              .n_vocab = m.n_vocab},
                                             stream),
                    "embedding");
        break;
      case OpKind::kNorm:
        // xn = RMSNorm(x += proj): the residual add fused into the norm, one launch and one
        // pass over x fewer than a separate add.
        st = Launch(kernels::LaunchRmsNorm(
                        {.x = x,
                         .weight = op.norm == NormWeight::kAttention ? w->attn_norm : w->ffn_norm,
                         .out = xn,
                         .n = t,
                         .dim = m.dim,
                         .eps = program.rms_eps,
                         .add = op.add_residual ? proj : nullptr},
                        stream),
                    "norm");
        break;
      case OpKind::kQkv:
        st = gemm->Linear(w->wqkv, QkvWidth(), dim, xn, t, qkv);
        if (st.ok()) {
          st = Launch(
              kernels::LaunchRopeSplitQkv({.qkv = qkv,
                                           .positions = MetaDevice<int32_t>(meta.positions),
                                           .cos_sin = rope_table,
                                           .q = q,
                                           .k = k,
                                           .v = v,
                                           .n = t,
                                           .n_heads = m.n_heads,
                                           .n_kv_heads = m.n_kv_heads,
                                           .head_dim = m.head_dim,
                                           .rope_dim = program.rope.dim,
                                           .max_position = m.context_length,
                                           .bias = op.bias ? w->qkv_bias : nullptr,
                                           .halves = program.rope.layout == RopeLayout::kHalves,
                                           .q_norm = op.qk_norm ? w->q_norm : nullptr,
                                           .k_norm = op.qk_norm ? w->k_norm : nullptr,
                                           .norm_eps = program.rms_eps},
                                          stream),
              "rope");
        }
        if (st.ok() && plan.n_query_rows > 0) st = EnqueueQueryGather(op.layer);
        break;
      case OpKind::kAttention:
        st = EnqueueAttention(op, t);
        break;
      case OpKind::kAttnOut:
        st = Launch(
            kernels::LaunchCastToHalf({.in = attn, .out = attn16, .n = t_rows * QWidth()}, stream),
            "attention cast");
        if (st.ok()) st = gemm->Linear(w->wo, dim, QWidth(), attn16, t, proj);
        break;
      case OpKind::kFfnUp:
        st = gemm->Linear(w->w_gate_up, 2 * int64_t{m.ffn_dim}, dim, xn, t, gate_up);
        if (st.ok()) {
          st = Launch(kernels::LaunchSwiGlu(
                          {.gate_up = gate_up, .out = hidden, .n = t, .ffn = m.ffn_dim}, stream),
                      "swiglu");
        }
        break;
      case OpKind::kFfnDown:
        st = gemm->Linear(w->w_down, dim, m.ffn_dim, hidden, t, proj);
        break;
      case OpKind::kResidual:
        st = Launch(kernels::LaunchResidualAdd({.x = x, .y = proj, .n = t_rows * dim}, stream),
                    "residual");
        break;
      case OpKind::kOutputNorm:  // only the rows that get logits
        st = Launch(kernels::LaunchRmsNorm({.x = x,
                                            .weight = output_norm,
                                            .rows = MetaDevice<int32_t>(meta.logit_rows),
                                            .out = xn,
                                            .n = rows,
                                            .dim = m.dim,
                                            .eps = program.rms_eps},
                                           stream),
                    "output norm");
        break;
      case OpKind::kLogits:
        st = gemm->Linear(output, m.n_vocab, dim, xn, rows, logits);
        break;
    }
    if (st.ok() && trace != nullptr) st = TraceOutputs(static_cast<int>(i), t_rows, n_logit_rows);
  }
  // ---- kqsvd: every layer's gathered query rows back to the host, in one copy. ---------------
  if (st.ok() && plan.n_query_rows > 0) {
    st = CudaStatus(
        cudaMemcpyAsync(query_readback_host->data(), query_readback,
                        static_cast<size_t>(plan.n_query_rows * m.n_layers * QWidth() * 2),
                        cudaMemcpyDeviceToHost, stream),
        "query readback");
  }
  return st;
}

}  // namespace subspace::cuda
