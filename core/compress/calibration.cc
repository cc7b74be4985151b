// Gram accumulation during calibration and the Gram-only basis methods; see calibration.h.
// KQ-SVD from Gram matrices (seed 002): with G_K = V S^2 V^T, K = A S V^T for some A with
// orthonormal columns, so K Q^T = A M with M = S V^T Q^T and M M^T = S V^T G_Q V S. The best
// rank-r K Q^T is A U'_r U'_r^T M = K (V S^-1 U'_r)(V S U'_r)^T Q^T, i.e. P_k = V S^-1 U'_r and
// P_q = V S U'_r, and its squared error is the tail of M M^T's spectrum.
#include "core/compress/calibration.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/base/pca.h"
#include "core/base/tensor_types.h"
#include "core/kvcache/paged_kv_cache.h"

namespace subspace {
namespace {

// All eigenpairs, descending, eigenvalues clamped at 0 (Gram matrices are PSD; rounding is not).
void FullEigen(int d, const std::vector<double>& sym, std::vector<double>* values,
               std::vector<double>* vecs) {
  values->assign(static_cast<size_t>(d), 0.0);
  vecs->assign(static_cast<size_t>(d) * d, 0.0);
  TopEigenpairs(d, sym.data(), d, EigenSolver::kLapack, values->data(), vecs->data());
  for (double& v : *values) v = std::max(v, 0.0);
}

absl::Status CheckGrams(const std::vector<std::vector<double>>& grams, const KvCacheGeometry& g,
                        const char* what) {
  const size_t per_layer = static_cast<size_t>(g.n_kv_heads) * g.head_dim * g.head_dim;
  if (grams.size() != static_cast<size_t>(g.n_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("calibration statistics: ", what, " has ",
                                                   grams.size(), " layers, expected ", g.n_layers));
  }
  for (const std::vector<double>& layer : grams) {
    if (layer.size() != per_layer) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration statistics: ", what, " has a layer of the wrong size"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* KeyBasisMethodName(KeyBasisMethod m) {
  switch (m) {
    case KeyBasisMethod::kKsvd:
      return "ksvd";
    case KeyBasisMethod::kEigen:
      return "eigen";
    case KeyBasisMethod::kKqsvd:
      return "kqsvd";
  }
  return "?";
}

const char* ValueBasisMethodName(ValueBasisMethod m) {
  return m == ValueBasisMethod::kKsvd ? "ksvd" : "kqsvd";
}

absl::StatusOr<KeyBasisMethod> ParseKeyBasisMethod(std::string_view name) {
  for (KeyBasisMethod m : {KeyBasisMethod::kKsvd, KeyBasisMethod::kEigen, KeyBasisMethod::kKqsvd}) {
    if (name == KeyBasisMethodName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "key basis method must be 'kqsvd', 'ksvd' or 'eigen', got '", std::string(name), "'"));
}

absl::StatusOr<ValueBasisMethod> ParseValueBasisMethod(std::string_view name) {
  for (ValueBasisMethod m : {ValueBasisMethod::kKsvd, ValueBasisMethod::kKqsvd}) {
    if (name == ValueBasisMethodName(m)) return m;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("value basis method must be 'kqsvd' or 'ksvd', got '", std::string(name), "'"));
}

CalibrationStats CalibrationStats::Zeros(const KvCacheGeometry& g, int n_heads) {
  CalibrationStats s;
  s.geometry = g;
  s.n_heads = n_heads;
  const size_t per_layer = static_cast<size_t>(g.n_kv_heads) * g.head_dim * g.head_dim;
  for (auto* grams : {&s.g_k, &s.g_q, &s.g_v, &s.g_o}) {
    grams->assign(static_cast<size_t>(g.n_layers), std::vector<double>(per_layer, 0.0));
  }
  return s;
}

void AccumulateHeadGrams(const float* x, int64_t rows, int n_heads_in, int d, int heads_per_gram,
                         double* grams) {
  if (rows <= 0) return;
  UseSingleThreadedBlas();
  std::vector<double> buf(static_cast<size_t>(rows) * d);  // [rows, d] one head's rows
  for (int h = 0; h < n_heads_in; ++h) {
    for (int64_t t = 0; t < rows; ++t) {
      const float* src = x + (t * n_heads_in + h) * d;
      std::copy(src, src + d, buf.begin() + t * d);
    }
    double* gram = grams + static_cast<size_t>(h / heads_per_gram) * d * d;
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, static_cast<int>(rows), 1.0, buf.data(),
                d, 1.0, gram, d);
  }
}

absl::Status AccumulateOutputGrams(const LlamaModel& model, CalibrationStats* stats) {
  const ModelConfig& c = model.config();
  const KvCacheGeometry& g = stats->geometry;
  if (g.n_layers != c.n_layers || g.n_kv_heads != c.n_kv_heads || g.head_dim != c.head_dim ||
      stats->n_heads != c.n_heads) {
    return absl::InvalidArgumentError("calibration statistics do not match the model");
  }
  const int64_t width = static_cast<int64_t>(c.n_heads) * c.head_dim;
  std::vector<float> w(static_cast<size_t>(c.dim) * width);  // [dim, n_heads, d]
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string name = absl::StrFormat("blk.%d.attn_output.weight", l);
    const GgufTensorInfo* t = model.file().FindTensor(name);
    if (t == nullptr || t->dims.size() != 2 || t->dims[0] != width || t->dims[1] != c.dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("model tensor ", name, " missing or not [", c.dim, ", ", width, "]"));
    }
    const uint64_t row_bytes = TensorRowBytes(t->type, width);
    for (int64_t r = 0; r < c.dim; ++r) {
      DequantizeRow(t->type, t->data + static_cast<uint64_t>(r) * row_bytes, w.data() + r * width,
                    width);
    }
    std::vector<double>& out = stats->g_o[static_cast<size_t>(l)];
    std::fill(out.begin(), out.end(), 0.0);
    AccumulateHeadGrams(w.data(), c.dim, c.n_heads, c.head_dim, c.n_heads / c.n_kv_heads,
                        out.data());
  }
  return absl::OkStatus();
}

CalibratingKvCache::CalibratingKvCache(std::unique_ptr<KvCache> inner, CalibrationStats* stats)
    : ForwardingKvCache(std::move(inner)), stats_(stats) {}

void CalibratingKvCache::Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k,
                               const float* v) {
  inner().Write(layer, seq, pos, n, k, v);
  const KvCacheGeometry& g = stats_->geometry;
  absl::MutexLock lock(&mu_);
  const auto l = static_cast<size_t>(layer);
  AccumulateHeadGrams(k, n, g.n_kv_heads, g.head_dim, 1, stats_->g_k[l].data());
  AccumulateHeadGrams(v, n, g.n_kv_heads, g.head_dim, 1, stats_->g_v[l].data());
  if (layer == 0) stats_->key_tokens += n;
}

void CalibratingKvCache::Attend(int layer, std::span<const AttentionRequest> requests,
                                int n_heads) {
  inner().Attend(layer, requests, n_heads);
  const KvCacheGeometry& g = stats_->geometry;
  absl::MutexLock lock(&mu_);
  const auto l = static_cast<size_t>(layer);
  for (const AttentionRequest& r : requests) {
    AccumulateHeadGrams(r.q, r.n, n_heads, g.head_dim, n_heads / g.n_kv_heads,
                        stats_->g_q[l].data());
    if (layer == 0) stats_->query_tokens += r.n;
  }
}

absl::Status RunCalibrationWindows(LlamaModel& model, std::span<const int32_t> tokens,
                                   const CalibrationRunOptions& o, const CacheWrapper& wrap) {
  const ModelConfig& c = model.config();
  const int prefix = o.bos >= 0 ? 1 : 0;
  const int window = std::min(o.window, c.context_length - prefix);
  if (window < 1)
    return absl::InvalidArgumentError(absl::StrCat("window must be >= 1, got ", window));
  if (tokens.empty()) return absl::InvalidArgumentError("no calibration tokens");
  const int64_t total = o.max_tokens > 0 ? std::min<int64_t>(o.max_tokens, tokens.size())
                                         : static_cast<int64_t>(tokens.size());
  PagedKvCache::Config pc;
  pc.geometry = c.cache_geometry();
  pc.block_size = 16;
  pc.capacity_bytes = int64_t{c.n_layers} *
                      ((window + prefix + pc.block_size - 1) / pc.block_size) *
                      PagedKvCache::BlockBytes(pc.geometry, pc.block_size);
  absl::StatusOr<std::unique_ptr<PagedKvCache>> paged = PagedKvCache::Create(pc);
  if (!paged.ok()) return paged.status();
  std::unique_ptr<KvCache> cache = wrap(*std::move(paged));

  std::vector<int32_t> chunk_tokens;
  std::vector<float> logits;
  for (int64_t begin = 0; begin < total; begin += window) {
    const int64_t end = std::min<int64_t>(begin + window, total);
    chunk_tokens.clear();
    if (prefix) chunk_tokens.push_back(o.bos);
    chunk_tokens.insert(chunk_tokens.end(), tokens.begin() + begin, tokens.begin() + end);
    absl::StatusOr<SeqId> seq = cache->CreateSequence();
    if (!seq.ok()) return seq.status();
    absl::Status st = cache->Reserve(*seq, static_cast<int64_t>(chunk_tokens.size()));
    if (st.ok()) {
      const SequenceChunk chunk{.seq = *seq, .pos = 0, .tokens = chunk_tokens};
      st = model.Forward(std::span<const SequenceChunk>(&chunk, 1), *cache, &logits);
    }
    if (absl::Status f = cache->FreeSequence(*seq); st.ok()) st = f;
    if (!st.ok()) return st;
    if (o.progress) o.progress(end, total);
  }
  return absl::OkStatus();
}

absl::StatusOr<CalibrationStats> CollectCalibrationStats(LlamaModel& model,
                                                         std::span<const int32_t> tokens,
                                                         const CalibrationRunOptions& o) {
  CalibrationStats stats =
      CalibrationStats::Zeros(model.config().cache_geometry(), model.config().n_heads);
  if (absl::Status s = AccumulateOutputGrams(model, &stats); !s.ok()) return s;
  absl::Status st = RunCalibrationWindows(model, tokens, o, [&](std::unique_ptr<KvCache> inner) {
    return std::make_unique<CalibratingKvCache>(std::move(inner), &stats);
  });
  if (!st.ok()) return st;
  return stats;
}

int RankForEnergy(std::span<const double> spectrum, double energy) {
  double total = 0.0;
  for (double s : spectrum) total += s;
  if (!(total > 0.0)) return 1;
  double captured = 0.0;
  for (size_t r = 0; r < spectrum.size(); ++r) {
    captured += spectrum[r];
    // Relative slack so that energy = 1 is reachable despite rounding in the sum.
    if (captured >= energy * total * (1.0 - 1e-12)) return static_cast<int>(r) + 1;
  }
  return static_cast<int>(spectrum.size());
}

HeadFactors FactorHead(int d, const double* a_gram, const double* b_gram, bool kqsvd,
                       double b_weight, double sigma_floor) {
  HeadFactors f;
  std::vector<double> a = SymmetricFromUpper(d, a_gram);
  if (!kqsvd) {
    if (b_weight != 0.0) {
      const std::vector<double> b = SymmetricFromUpper(d, b_gram);
      for (size_t i = 0; i < a.size(); ++i) a[i] += b_weight * b[i];
    }
    FullEigen(d, a, &f.spectrum, &f.left);
    f.right = f.left;
    return f;
  }
  std::vector<double> lambda, v;  // G_A = V S^2 V^T
  FullEigen(d, a, &lambda, &v);
  const double sigma_max = std::sqrt(lambda[0]);
  std::vector<double> s(static_cast<size_t>(d)), s_inv(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) {
    const double sigma = std::sqrt(lambda[static_cast<size_t>(i)]);
    const bool keep = sigma > sigma_floor * sigma_max && sigma > 0.0;
    s[static_cast<size_t>(i)] = keep ? sigma : 0.0;
    s_inv[static_cast<size_t>(i)] = keep ? 1.0 / sigma : 0.0;
  }
  // M M^T = S V^T G_B V S.
  const std::vector<double> b = SymmetricFromUpper(d, b_gram);
  std::vector<double> bv(static_cast<size_t>(d) * d), m(static_cast<size_t>(d) * d);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, d, d, d, 1.0, b.data(), d, v.data(), d,
              0.0, bv.data(), d);
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, d, d, d, 1.0, v.data(), d, bv.data(), d, 0.0,
              m.data(), d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      m[static_cast<size_t>(i) * d + j] *= s[static_cast<size_t>(i)] * s[static_cast<size_t>(j)];
    }
  }
  for (int i = 0; i < d; ++i) {  // exact symmetry for the solver
    for (int j = 0; j < i; ++j) {
      const double x =
          0.5 * (m[static_cast<size_t>(i) * d + j] + m[static_cast<size_t>(j) * d + i]);
      m[static_cast<size_t>(i) * d + j] = m[static_cast<size_t>(j) * d + i] = x;
    }
  }
  std::vector<double> u;  // M M^T = U' S'^2 U'^T
  FullEigen(d, m, &f.spectrum, &u);
  // left = V S^-1 U', right = V S U': scale V's columns, then one product each.
  std::vector<double> vs_inv = v, vs = v;
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      vs_inv[static_cast<size_t>(i) * d + j] *= s_inv[static_cast<size_t>(j)];
      vs[static_cast<size_t>(i) * d + j] *= s[static_cast<size_t>(j)];
    }
  }
  f.left.assign(static_cast<size_t>(d) * d, 0.0);
  f.right.assign(static_cast<size_t>(d) * d, 0.0);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, d, d, d, 1.0, vs_inv.data(), d, u.data(),
              d, 0.0, f.left.data(), d);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, d, d, d, 1.0, vs.data(), d, u.data(), d,
              0.0, f.right.data(), d);
  return f;
}

absl::StatusOr<CalibratedBasis> ComputeCalibratedBasis(const CalibrationStats& stats,
                                                       const BasisMethodOptions& o) {
  const KvCacheGeometry& g = stats.geometry;
  const int d = g.head_dim;
  if (g.n_layers <= 0 || g.n_kv_heads <= 0 || d <= 0) {
    return absl::InvalidArgumentError("calibration statistics have an empty geometry");
  }
  const bool by_rank = o.rank > 0;
  if (by_rank == (o.energy > 0.0)) {
    return absl::InvalidArgumentError("set exactly one of a rank and an energy fraction");
  }
  if (by_rank && o.rank > d) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank must be in [1, ", d, "] (head_dim), got ", o.rank));
  }
  if (!by_rank && !(o.energy <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("energy must be in (0, 1], got ", o.energy));
  }
  for (auto [grams, what] : {std::pair{&stats.g_k, "G_K"}, std::pair{&stats.g_q, "G_Q"},
                             std::pair{&stats.g_v, "G_V"}, std::pair{&stats.g_o, "W_O W_O^T"}}) {
    if (absl::Status s = CheckGrams(*grams, g, what); !s.ok()) return s;
  }

  const size_t dd = static_cast<size_t>(d) * d;
  const int64_t items = static_cast<int64_t>(g.n_layers) * g.n_kv_heads * 2;
  std::vector<HeadFactors> factors(static_cast<size_t>(items));  // [layer][head][k, v]
  UseSingleThreadedBlas();
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const auto l = static_cast<size_t>(item / (2 * g.n_kv_heads));
    const size_t h = static_cast<size_t>(item / 2 % g.n_kv_heads);
    if (item % 2 == 0) {
      factors[static_cast<size_t>(item)] =
          FactorHead(d, stats.g_k[l].data() + h * dd, stats.g_q[l].data() + h * dd,
                     o.method_k == KeyBasisMethod::kKqsvd,
                     o.method_k == KeyBasisMethod::kEigen ? 1.0 : 0.0, o.sigma_floor);
    } else {
      factors[static_cast<size_t>(item)] =
          FactorHead(d, stats.g_v[l].data() + h * dd, stats.g_o[l].data() + h * dd,
                     o.method_v == ValueBasisMethod::kKqsvd, 0.0, o.sigma_floor);
    }
  }
  auto factor = [&](int l, int h, int side) -> const HeadFactors& {
    return factors[(static_cast<size_t>(l) * g.n_kv_heads + static_cast<size_t>(h)) * 2 +
                   static_cast<size_t>(side)];
  };

  std::vector<int> r_k(static_cast<size_t>(g.n_layers)), r_v(static_cast<size_t>(g.n_layers));
  for (int l = 0; l < g.n_layers; ++l) {
    int rk = by_rank ? o.rank : 1, rv = by_rank ? o.rank : 1;
    if (!by_rank) {
      for (int h = 0; h < g.n_kv_heads; ++h) {
        rk = std::max(rk, RankForEnergy(factor(l, h, 0).spectrum, o.energy));
        rv = std::max(rv, RankForEnergy(factor(l, h, 1).spectrum, o.energy));
      }
    }
    r_k[static_cast<size_t>(l)] = rk;
    r_v[static_cast<size_t>(l)] = rv;
  }

  CalibratedBasis out;
  out.basis = Basis::Zeros(g, r_k, r_v);
  out.energy_k.assign(static_cast<size_t>(g.n_layers), 0.0);
  out.energy_v.assign(static_cast<size_t>(g.n_layers), 0.0);
  auto captured = [](const std::vector<double>& spectrum, int r) {
    double total = 0.0, head = 0.0;
    for (size_t i = 0; i < spectrum.size(); ++i) {
      total += spectrum[i];
      if (static_cast<int>(i) < r) head += spectrum[i];
    }
    return total > 0.0 ? head / total : 1.0;
  };
  for (int l = 0; l < g.n_layers; ++l) {
    LayerBasis& lb = out.basis.layers[static_cast<size_t>(l)];
    const int rk = lb.rank_k, rv = lb.rank_v;
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const HeadFactors& fk = factor(l, h, 0);
      const HeadFactors& fv = factor(l, h, 1);
      float* pq = lb.p_q.data() + static_cast<size_t>(h) * d * rk;   // [d, r_k]
      float* pk = lb.p_k.data() + static_cast<size_t>(h) * d * rk;   // [d, r_k]
      float* pv = lb.p_v.data() + static_cast<size_t>(h) * d * rv;   // [d, r_v]
      float* rvm = lb.r_v.data() + static_cast<size_t>(h) * rv * d;  // [r_v, d]
      for (int i = 0; i < d; ++i) {
        for (int j = 0; j < rk; ++j) {
          pk[i * rk + j] = static_cast<float>(fk.left[static_cast<size_t>(i) * d + j]);
          pq[i * rk + j] = static_cast<float>(fk.right[static_cast<size_t>(i) * d + j]);
        }
        for (int j = 0; j < rv; ++j) {
          pv[i * rv + j] = static_cast<float>(fv.left[static_cast<size_t>(i) * d + j]);
          rvm[j * d + i] = static_cast<float>(fv.right[static_cast<size_t>(i) * d + j]);
        }
      }
      out.energy_k[static_cast<size_t>(l)] += captured(fk.spectrum, rk) / g.n_kv_heads;
      out.energy_v[static_cast<size_t>(l)] += captured(fv.spectrum, rv) / g.n_kv_heads;
    }
  }
  return out;
}

}  // namespace subspace
