// Basis quality metrics and chunked perplexity (see eval_metrics.h). Plain loops in double:
// the evaluation runs them on one window per layer and head, a few hundred tokens.
#include "tools/eval/eval_metrics.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tools/eval/perplexity.h"

namespace subspace::eval {
namespace {

// y[r] = P^T x for P [d, r] row-major.
void ProjectT(int d, int r, const float* p, const float* x, double* y) {
  for (int j = 0; j < r; ++j) y[j] = 0.0;
  for (int i = 0; i < d; ++i) {
    const double xi = x[i];
    const float* row = p + static_cast<int64_t>(i) * r;
    for (int j = 0; j < r; ++j) y[j] += static_cast<double>(row[j]) * xi;
  }
}

// Causal softmax attention of query i over rows 0..i: out[d] = sum_j a_j vals[j].
// logits[j] given (already scaled); vals [n, dv] double.
void SoftmaxCombine(const std::vector<double>& logits, int64_t count,
                    const std::vector<double>& vals, int dv, double* out) {
  double m = logits[0];
  for (int64_t j = 1; j < count; ++j) m = std::max(m, logits[j]);
  double sum = 0.0;
  for (int c = 0; c < dv; ++c) out[c] = 0.0;
  for (int64_t j = 0; j < count; ++j) {
    const double w = std::exp(logits[j] - m);
    sum += w;
    const double* vj = vals.data() + j * dv;
    for (int c = 0; c < dv; ++c) out[c] += w * vj[c];
  }
  for (int c = 0; c < dv; ++c) out[c] /= sum;
}

}  // namespace

double ErrorSums::Relative() const { return ref2 > 0.0 ? std::sqrt(err2 / ref2) : 0.0; }
double ErrorSums::EnergyRatio() const { return ref2 > 0.0 ? err2 / ref2 : 0.0; }

ErrorSums KeyReconstructionError(int d, int r, const float* p_q, const float* p_k, const float* k,
                                 int64_t n, int64_t stride) {
  ErrorSums s;
  std::vector<double> c(static_cast<size_t>(r));
  for (int64_t t = 0; t < n; ++t) {
    const float* kt = k + t * stride;
    ProjectT(d, r, p_k, kt, c.data());
    for (int i = 0; i < d; ++i) {
      double hat = 0.0;
      const float* row = p_q + static_cast<int64_t>(i) * r;
      for (int j = 0; j < r; ++j) hat += static_cast<double>(row[j]) * c[j];
      const double e = static_cast<double>(kt[i]) - hat;
      s.err2 += e * e;
      s.ref2 += static_cast<double>(kt[i]) * kt[i];
    }
  }
  return s;
}

ErrorSums ResidualEnergy(int d, int r, const float* p, const float* x, int64_t n, int64_t stride) {
  // Orthonormal basis of span(p) by modified Gram-Schmidt; columns that vanish are dropped.
  std::vector<std::vector<double>> basis;
  double max_norm = 0.0;
  for (int j = 0; j < r; ++j) {
    double nn = 0.0;
    for (int i = 0; i < d; ++i) nn += static_cast<double>(p[i * r + j]) * p[i * r + j];
    max_norm = std::max(max_norm, std::sqrt(nn));
  }
  for (int j = 0; j < r; ++j) {
    std::vector<double> col(static_cast<size_t>(d));
    for (int i = 0; i < d; ++i) col[i] = p[static_cast<int64_t>(i) * r + j];
    for (int pass = 0; pass < 2; ++pass) {  // twice is enough (Kahan)
      for (const std::vector<double>& b : basis) {
        double dot = 0.0;
        for (int i = 0; i < d; ++i) dot += b[i] * col[i];
        for (int i = 0; i < d; ++i) col[i] -= dot * b[i];
      }
    }
    double nn = 0.0;
    for (int i = 0; i < d; ++i) nn += col[i] * col[i];
    nn = std::sqrt(nn);
    if (nn <= 1e-9 * std::max(max_norm, 1e-300)) continue;
    for (double& v : col) v /= nn;
    basis.push_back(std::move(col));
  }
  ErrorSums s;
  std::vector<double> res(static_cast<size_t>(d));
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * stride;
    for (int i = 0; i < d; ++i) {
      res[i] = xt[i];
      s.ref2 += res[i] * res[i];
    }
    for (const std::vector<double>& b : basis) {
      double dot = 0.0;
      for (int i = 0; i < d; ++i) dot += b[i] * xt[i];
      for (int i = 0; i < d; ++i) res[i] -= dot * b[i];
    }
    for (int i = 0; i < d; ++i) s.err2 += res[i] * res[i];
  }
  return s;
}

ErrorSums LogitError(int d, int r, const float* p_q, const float* p_k, const float* q,
                     int64_t q_stride, const float* k, int64_t k_stride, int64_t n) {
  std::vector<double> qt(static_cast<size_t>(n) * r), kc(static_cast<size_t>(n) * r);
  for (int64_t t = 0; t < n; ++t) {
    ProjectT(d, r, p_q, q + t * q_stride, qt.data() + t * r);
    ProjectT(d, r, p_k, k + t * k_stride, kc.data() + t * r);
  }
  ErrorSums s;
  for (int64_t i = 0; i < n; ++i) {
    const float* qi = q + i * q_stride;
    for (int64_t j = 0; j <= i; ++j) {
      const float* kj = k + j * k_stride;
      double exact = 0.0, approx = 0.0;
      for (int c = 0; c < d; ++c) exact += static_cast<double>(qi[c]) * kj[c];
      for (int c = 0; c < r; ++c) approx += qt[i * r + c] * kc[j * r + c];
      s.err2 += (exact - approx) * (exact - approx);
      s.ref2 += exact * exact;
    }
  }
  return s;
}

ErrorSums AttentionOutputError(int d, int r_k, int r_v, const float* p_q, const float* p_k,
                               const float* p_v, const float* r_v_mat, const float* q,
                               int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                               int64_t v_stride, int64_t n) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> qt(static_cast<size_t>(n) * r_k), kc(static_cast<size_t>(n) * r_k);
  std::vector<double> vals(static_cast<size_t>(n) * d), vals_hat(static_cast<size_t>(n) * d);
  std::vector<double> u(static_cast<size_t>(r_v));
  for (int64_t t = 0; t < n; ++t) {
    ProjectT(d, r_k, p_q, q + t * q_stride, qt.data() + t * r_k);
    ProjectT(d, r_k, p_k, k + t * k_stride, kc.data() + t * r_k);
    const float* vt = v + t * v_stride;
    ProjectT(d, r_v, p_v, vt, u.data());
    for (int c = 0; c < d; ++c) {
      vals[t * d + c] = vt[c];
      double h = 0.0;  // R_v^T u: R_v is [r_v, d]
      for (int j = 0; j < r_v; ++j) h += static_cast<double>(r_v_mat[j * d + c]) * u[j];
      vals_hat[t * d + c] = h;
    }
  }
  ErrorSums s;
  std::vector<double> logits(static_cast<size_t>(n)), logits_hat(static_cast<size_t>(n));
  std::vector<double> o(static_cast<size_t>(d)), o_hat(static_cast<size_t>(d));
  for (int64_t i = 0; i < n; ++i) {
    const float* qi = q + i * q_stride;
    for (int64_t j = 0; j <= i; ++j) {
      const float* kj = k + j * k_stride;
      double exact = 0.0, approx = 0.0;
      for (int c = 0; c < d; ++c) exact += static_cast<double>(qi[c]) * kj[c];
      for (int c = 0; c < r_k; ++c) approx += qt[i * r_k + c] * kc[j * r_k + c];
      logits[j] = exact * scale;
      logits_hat[j] = approx * scale;
    }
    SoftmaxCombine(logits, i + 1, vals, d, o.data());
    SoftmaxCombine(logits_hat, i + 1, vals_hat, d, o_hat.data());
    for (int c = 0; c < d; ++c) {
      s.err2 += (o[c] - o_hat[c]) * (o[c] - o_hat[c]);
      s.ref2 += o[c] * o[c];
    }
  }
  return s;
}

CapturingKvCache::CapturingKvCache(std::unique_ptr<KvCache> inner, int n_heads)
    : ForwardingKvCache(std::move(inner)), n_heads_(n_heads) {
  layers_.resize(static_cast<size_t>(geometry().n_layers));
}

int64_t CapturingKvCache::tokens() const {
  const KvCacheGeometry& g = geometry();
  if (layers_.empty()) return 0;
  return static_cast<int64_t>(layers_[0].k.size()) /
         (static_cast<int64_t>(g.n_kv_heads) * g.head_dim);
}

void CapturingKvCache::Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k,
                             const float* v) {
  {
    absl::MutexLock lock(&mu_);
    const KvCacheGeometry& g = geometry();
    const int64_t row = static_cast<int64_t>(g.n_kv_heads) * g.head_dim;
    Layer& l = layers_[static_cast<size_t>(layer)];
    const size_t need = static_cast<size_t>((pos + n) * row);
    if (l.k.size() < need) {
      l.k.resize(need);
      l.v.resize(need);
    }
    std::copy(k, k + n * row, l.k.begin() + pos * row);
    std::copy(v, v + n * row, l.v.begin() + pos * row);
  }
  inner().Write(layer, seq, pos, n, k, v);
}

void CapturingKvCache::Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) {
  {
    absl::MutexLock lock(&mu_);
    const int64_t row = static_cast<int64_t>(n_heads) * geometry().head_dim;
    Layer& l = layers_[static_cast<size_t>(layer)];
    for (const AttentionRequest& r : requests) {
      const size_t need = static_cast<size_t>((r.pos + r.n) * row);
      if (l.q.size() < need) l.q.resize(need);
      std::copy(r.q, r.q + r.n * row, l.q.begin() + r.pos * row);
    }
  }
  inner().Attend(layer, requests, n_heads);
}

absl::StatusOr<ChunkedPerplexityResult> ComputeChunkedPerplexity(
    LlamaModel& model, KvCache& cache, std::span<const int32_t> tokens,
    const ChunkedPerplexityOptions& options) {
  const ModelConfig& config = model.config();
  const int window = options.window;
  if (window < 2 || window > config.context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("perplexity window ", window, " must be in [2, ", config.context_length, "]"));
  }
  if (options.chunk < 1) return absl::InvalidArgumentError("chunk must be >= 1");
  if (tokens.empty()) return absl::InvalidArgumentError("perplexity needs at least one token");
  if (options.bos < 0 || options.bos >= config.n_vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("perplexity needs a BOS token, got id ", options.bos));
  }
  const int64_t total = static_cast<int64_t>(tokens.size());
  const int64_t span_len = window - 1;
  const int64_t n_windows = (total + span_len - 1) / span_len;
  ChunkedPerplexityResult result;
  double nll_sum = 0.0;
  std::vector<float> logits;
  std::vector<int32_t> wt;
  for (int64_t w = 0; w < n_windows; ++w) {
    const int64_t begin = w * span_len;
    const int64_t n_span = std::min<int64_t>(span_len, total - begin);
    wt.assign(1, options.bos);
    wt.insert(wt.end(), tokens.begin() + begin, tokens.begin() + begin + n_span);
    const int64_t len = n_span + 1;
    absl::StatusOr<SeqId> seq = cache.CreateSequence();
    if (!seq.ok()) return seq.status();
    absl::Status status;
    for (int64_t pos = 0; pos < len && status.ok(); pos += options.chunk) {
      const int64_t n = std::min<int64_t>(options.chunk, len - pos);
      status = cache.Reserve(*seq, n);
      if (!status.ok()) break;
      SequenceChunk step{*seq, pos, std::span<const int32_t>(wt).subspan(pos, n),
                         /*all_logits=*/true};
      status = model.Forward({&step, 1}, cache, &logits);
      if (!status.ok()) break;
      for (int64_t i = 0; i < n; ++i) {
        if (pos + i + 1 >= len) break;
        nll_sum += NegLogLikelihood(&logits[i * config.n_vocab], config.n_vocab, wt[pos + i + 1]);
      }
    }
    if (status.ok()) {
      const KvCacheStats st = cache.Stats();
      result.bytes_used += st.bytes_used_full + st.bytes_used_compressed + st.bytes_used_outlier;
      result.bytes_compressed += st.bytes_used_compressed;
      result.bytes_fp16_equivalent += st.bytes_full_fp16_equivalent;
    }
    cache.FreeSequence(*seq).IgnoreError();
    if (!status.ok()) return status;
    result.ppl.tokens_scored += len - 1;
    ++result.ppl.windows;
    if (options.progress) options.progress(w + 1, n_windows);
  }
  result.ppl.mean_nll = nll_sum / static_cast<double>(result.ppl.tokens_scored);
  result.ppl.perplexity = std::exp(result.ppl.mean_nll);
  return result;
}

}  // namespace subspace::eval
