// subspace-eval: quality of static (offline-calibrated) bases on a model. Calibrates per-head
// Gram statistics once, then for each key/value method x rank x coefficient dtype measures the
// perplexity with the compressed cache (calibrated basis as its default epoch, prefill fed in
// small chunks so compressed blocks are attended), the cache footprint against full fp16, and per
// layer the errors of K (as the query sees it), of the causal logits QK^T and of the attention
// output, plus the residual energy of K outside the basis, on one captured evaluation window.
// Table on stdout, optional CSV, progress on stderr. See docs/quality.md.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cli/flags.h"
#include "core/compress/calibration.h"
#include "core/compress/compressed_kv_cache.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/kvcache/refresh_config.h"
#include "core/model/model.h"
#include "core/model/model_file.h"
#include "core/tokenizer/tokenizer.h"
#include "runtime/kv_cache_options.h"
#include "tools/eval/eval_metrics.h"

ABSL_FLAG(std::string, model, "models/subspace-tiny.gguf", "path of the GGUF model");
ABSL_FLAG(std::string, text, "models/data/test.txt", "evaluation text file");
ABSL_FLAG(std::string, calib, "",
          "calibration text file; empty: the first half of --text's tokens calibrates and the "
          "second half is evaluated");
ABSL_FLAG(int64_t, max_tokens, 4096, "evaluate on at most this many tokens (0 = all)");
ABSL_FLAG(int64_t, calib_tokens, 4096, "calibrate on at most this many tokens (0 = all)");
ABSL_FLAG(std::string, methods, "ksvd,eigen,kqsvd",
          "key methods; values use kqsvd with kqsvd keys, ksvd otherwise");
ABSL_FLAG(std::string, ranks, "8,16,32", "fixed ranks (keys and values), comma-separated");
ABSL_FLAG(std::string, energies, "", "energy thresholds for per-layer ranks, e.g. 0.9,0.99");
ABSL_FLAG(std::string, dtypes, "fp16,int8", "coefficient dtypes: fp16,int8,int4,fp32");
ABSL_FLAG(int32_t, sink_tokens, subspace::CompressionPolicy::kDefaultSinkTokens,
          "S: attention sinks kept full-rank");
ABSL_FLAG(int32_t, window_tokens, subspace::CompressionPolicy::kDefaultWindowTokens,
          "W: recent window kept full-rank");
ABSL_FLAG(int32_t, window, 512, "perplexity window (capped by the context)");
ABSL_FLAG(int32_t, chunk, 16, "tokens per forward step inside a perplexity window");
ABSL_FLAG(int32_t, error_tokens, 256, "tokens of the captured window for the error metrics");
ABSL_FLAG(std::string, refresh, "none",
          "online refresh methods per configuration (none = static basis): none,pca,kqsvd,oja,fd");
ABSL_FLAG(int64_t, refresh_every_tokens, 64, "online rows: refresh every T compressed tokens");
ABSL_FLAG(double, refresh_half_life_tokens, 256, "online rows: pca/kqsvd/fd statistics half-life");
ABSL_FLAG(double, refresh_oja_lr, 1.0, "online rows: Oja learning rate");
ABSL_FLAG(std::string, csv, "", "write the results as CSV here");
ABSL_FLAG(std::string, label, "", "free-form label copied into the CSV (e.g. in-domain)");

namespace subspace {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else if (c != ' ') {
      cur.push_back(c);
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

absl::StatusOr<std::vector<int32_t>> ReadTokens(const Tokenizer& tok, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return tok.Encode(ss.str(), {.add_bos = false});
}

struct Config {
  KeyBasisMethod mk;
  ValueBasisMethod mv;
  int rank = 0;
  double energy = 0.0;
  CoeffDtype dtype = CoeffDtype::kFp16;
  RefreshMethod refresh = RefreshMethod::kNone;  // online rows start from the calibrated basis
};

struct LayerErrors {
  eval::ErrorSums key, logit, attn, rer;
};

// Per-layer errors of `basis` on the captured window (all heads pooled per layer).
std::vector<LayerErrors> BasisErrors(const Basis& basis, const eval::CapturingKvCache& cap,
                                     int64_t n) {
  const KvCacheGeometry& g = basis.geometry;
  const int d = g.head_dim, n_kv = g.n_kv_heads, n_heads = cap.n_heads();
  const int group = n_heads / n_kv;
  std::vector<LayerErrors> out(static_cast<size_t>(g.n_layers));
#pragma omp parallel for schedule(dynamic)
  for (int l = 0; l < g.n_layers; ++l) {
    const LayerBasis& lb = basis.layers[static_cast<size_t>(l)];
    const eval::CapturingKvCache::Layer& cl = cap.layers()[static_cast<size_t>(l)];
    const int rk = lb.rank_k, rv = lb.rank_v;
    LayerErrors e;
    for (int h = 0; h < n_kv; ++h) {
      const float* pq = lb.p_q.data() + static_cast<int64_t>(h) * d * rk;
      const float* pk = lb.p_k.data() + static_cast<int64_t>(h) * d * rk;
      const float* pv = lb.p_v.data() + static_cast<int64_t>(h) * d * rv;
      const float* rvm = lb.r_v.data() + static_cast<int64_t>(h) * rv * d;
      const float* k = cl.k.data() + static_cast<int64_t>(h) * d;
      const float* v = cl.v.data() + static_cast<int64_t>(h) * d;
      const int64_t kv_stride = static_cast<int64_t>(n_kv) * d;
      e.key += eval::KeyReconstructionError(d, rk, pq, pk, k, n, kv_stride);
      e.rer += eval::ResidualEnergy(d, rk, pq, k, n, kv_stride);
      for (int j = h * group; j < (h + 1) * group; ++j) {
        const float* q = cl.q.data() + static_cast<int64_t>(j) * d;
        const int64_t q_stride = static_cast<int64_t>(n_heads) * d;
        e.logit += eval::LogitError(d, rk, pq, pk, q, q_stride, k, kv_stride, n);
        e.attn += eval::AttentionOutputError(d, rk, rv, pq, pk, pv, rvm, q, q_stride, k, kv_stride,
                                             v, kv_stride, n);
      }
    }
    out[static_cast<size_t>(l)] = e;
  }
  return out;
}

absl::Status Run() {
  const auto start = Clock::now();
  const std::string model_path = absl::GetFlag(FLAGS_model);
  absl::StatusOr<ModelFile> files = OpenModelFile(model_path);
  if (!files.ok()) return files.status();
  LlamaModel& model = *files->model;
  const Tokenizer& tokenizer = *files->tokenizer;
  const ModelConfig& mc = model.config();
  const KvCacheGeometry geom = mc.cache_geometry();
  const int32_t bos = tokenizer.bos_id();

  // --- Texts ---
  absl::StatusOr<std::vector<int32_t>> text = ReadTokens(tokenizer, absl::GetFlag(FLAGS_text));
  if (!text.ok()) return text.status();
  std::vector<int32_t> calib, eval;
  const std::string calib_path = absl::GetFlag(FLAGS_calib);
  std::string calib_desc, eval_desc;
  if (calib_path.empty()) {
    const size_t half = text->size() / 2;
    calib.assign(text->begin(), text->begin() + static_cast<int64_t>(half));
    eval.assign(text->begin() + static_cast<int64_t>(half), text->end());
    calib_desc = absl::StrCat(absl::GetFlag(FLAGS_text), " first half");
    eval_desc = absl::StrCat(absl::GetFlag(FLAGS_text), " second half");
  } else {
    absl::StatusOr<std::vector<int32_t>> c = ReadTokens(tokenizer, calib_path);
    if (!c.ok()) return c.status();
    calib = *std::move(c);
    eval = *std::move(text);
    calib_desc = calib_path;
    eval_desc = absl::GetFlag(FLAGS_text);
  }
  const int64_t max_eval = absl::GetFlag(FLAGS_max_tokens);
  const int64_t max_calib = absl::GetFlag(FLAGS_calib_tokens);
  if (max_eval > 0 && static_cast<int64_t>(eval.size()) > max_eval) eval.resize(max_eval);
  if (max_calib > 0 && static_cast<int64_t>(calib.size()) > max_calib) calib.resize(max_calib);
  if (eval.empty() || calib.empty()) return absl::InvalidArgumentError("empty text");
  const int window = std::min<int>(absl::GetFlag(FLAGS_window), mc.context_length);
  std::fprintf(stderr, "model %s: %d layers, %d heads (%d kv), head_dim %d\n", model_path.c_str(),
               mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.head_dim);
  std::fprintf(stderr, "calibration: %zu tokens of %s; evaluation: %zu tokens of %s\n",
               calib.size(), calib_desc.c_str(), eval.size(), eval_desc.c_str());

  // --- Configurations ---
  std::vector<KeyBasisMethod> methods;
  for (const std::string& m : SplitList(absl::GetFlag(FLAGS_methods))) {
    absl::StatusOr<KeyBasisMethod> k = ParseKeyBasisMethod(m);
    if (!k.ok()) return k.status();
    methods.push_back(*k);
  }
  std::vector<int> ranks;
  for (const std::string& r : SplitList(absl::GetFlag(FLAGS_ranks))) {
    const int v = std::atoi(r.c_str());
    if (v < 1 || v > mc.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", r, " not in [1, head_dim]"));
    }
    ranks.push_back(v);
  }
  std::vector<double> energies;
  for (const std::string& e : SplitList(absl::GetFlag(FLAGS_energies))) {
    const double v = std::atof(e.c_str());
    if (!(v > 0.0 && v <= 1.0)) return absl::InvalidArgumentError("energy must be in (0, 1]");
    energies.push_back(v);
  }
  std::vector<CoeffDtype> dtypes;
  for (const std::string& d : SplitList(absl::GetFlag(FLAGS_dtypes))) {
    if (d == "fp16")
      dtypes.push_back(CoeffDtype::kFp16);
    else if (d == "int8")
      dtypes.push_back(CoeffDtype::kInt8);
    else if (d == "int4")
      dtypes.push_back(CoeffDtype::kInt4);
    else if (d == "fp32")
      dtypes.push_back(CoeffDtype::kFp32);
    else
      return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", d));
  }
  std::vector<RefreshMethod> refreshes;
  for (const std::string& m : SplitList(absl::GetFlag(FLAGS_refresh))) {
    absl::StatusOr<RefreshMethod> r = ParseRefreshMethod(m);
    if (!r.ok()) return r.status();
    refreshes.push_back(*r);
  }
  if (refreshes.empty()) refreshes.push_back(RefreshMethod::kNone);
  RefreshConfig refresh_base;
  refresh_base.every_tokens = absl::GetFlag(FLAGS_refresh_every_tokens);
  refresh_base.half_life_tokens = absl::GetFlag(FLAGS_refresh_half_life_tokens);
  refresh_base.oja_learning_rate = absl::GetFlag(FLAGS_refresh_oja_lr);
  std::vector<Config> configs;
  for (KeyBasisMethod mk : methods) {
    const ValueBasisMethod mv =
        mk == KeyBasisMethod::kKqsvd ? ValueBasisMethod::kKqsvd : ValueBasisMethod::kKsvd;
    for (RefreshMethod rm : refreshes) {
      for (int r : ranks)
        for (CoeffDtype dt : dtypes) configs.push_back({mk, mv, r, 0.0, dt, rm});
      for (double e : energies)
        for (CoeffDtype dt : dtypes) configs.push_back({mk, mv, 0, e, dt, rm});
    }
  }

  // --- Calibration ---
  auto progress = [](const char* what) {
    const auto t0 = Clock::now();
    return [what, t0](int64_t done, int64_t total) {
      std::fprintf(stderr, "\r%s: %lld / %lld (%.0f s)   ", what, static_cast<long long>(done),
                   static_cast<long long>(total), Since(t0));
      if (done == total) std::fprintf(stderr, "\n");
    };
  };
  CalibrationRunOptions ro{
      .window = window, .max_tokens = 0, .bos = bos, .progress = progress("calibrating (tokens)")};
  absl::StatusOr<CalibrationStats> stats = CollectCalibrationStats(model, calib, ro);
  if (!stats.ok()) return stats.status();

  // --- Captured window for the error metrics: the first error_tokens of the evaluation ---
  const int64_t n_err = std::min<int64_t>({static_cast<int64_t>(absl::GetFlag(FLAGS_error_tokens)),
                                           window - 1, static_cast<int64_t>(eval.size())});
  const int64_t page_fp32 = PagedKvCache::BlockBytes(geom, 16);
  const int64_t blocks_per_window = (window + 15) / 16 + 2;
  auto make_full = [&]() {
    return PagedKvCache::Create({.geometry = geom,
                                 .block_size = 16,
                                 .capacity_bytes = page_fp32 * geom.n_layers * blocks_per_window});
  };
  absl::StatusOr<std::unique_ptr<PagedKvCache>> cap_inner = make_full();
  if (!cap_inner.ok()) return cap_inner.status();
  eval::CapturingKvCache capture(*std::move(cap_inner), mc.n_heads);
  {
    std::vector<int32_t> wt(1, bos);
    wt.insert(wt.end(), eval.begin(), eval.begin() + n_err);
    absl::StatusOr<SeqId> seq = capture.CreateSequence();
    if (!seq.ok()) return seq.status();
    if (absl::Status s = capture.Reserve(*seq, static_cast<int64_t>(wt.size())); !s.ok()) return s;
    SequenceChunk step{*seq, 0, wt, false};
    std::vector<float> logits;
    if (absl::Status s = model.Forward({&step, 1}, capture, &logits); !s.ok()) return s;
    capture.FreeSequence(*seq).IgnoreError();
  }
  const int64_t n_cap = capture.tokens();

  // --- Full-rank baseline ---
  eval::ChunkedPerplexityOptions po{
      .window = window, .chunk = absl::GetFlag(FLAGS_chunk), .bos = bos, .progress = {}};
  absl::StatusOr<std::unique_ptr<PagedKvCache>> full = make_full();
  if (!full.ok()) return full.status();
  po.progress = progress("full cache perplexity (windows)");
  absl::StatusOr<eval::ChunkedPerplexityResult> base =
      eval::ComputeChunkedPerplexity(model, **full, eval, po);
  if (!base.ok()) return base.status();
  const double base_ppl = base->ppl.perplexity;

  // --- Static configurations ---
  struct Row {
    Config c;
    std::vector<int> rk, rv;
    eval::ChunkedPerplexityResult ppl;
    double block_ratio = 0.0;  // compressed-block bytes per token / full fp16 (asymptotic)
    std::vector<LayerErrors> errors;
    double rer_compressed = 0.0;  // RER of the keys as the cache compressed them (all windows)
    int64_t refreshes = 0;        // epochs the online refresh installed (all windows)
  };
  std::vector<Row> rows;
  std::vector<LayerErrors> last_errors;
  std::string last_key;
  for (size_t i = 0; i < configs.size(); ++i) {
    const Config& c = configs[i];
    BasisMethodOptions bo{.method_k = c.mk, .method_v = c.mv, .rank = c.rank, .energy = c.energy};
    absl::StatusOr<CalibratedBasis> cb = ComputeCalibratedBasis(*stats, bo);
    if (!cb.ok()) return cb.status();
    Row row{.c = c};
    for (const LayerBasis& lb : cb->basis.layers) {
      row.rk.push_back(lb.rank_k);
      row.rv.push_back(lb.rank_v);
    }
    // Errors do not depend on the coefficient dtype: computed once per basis.
    const std::string key = absl::StrCat(KeyBasisMethodName(c.mk), "/", c.rank, "/", c.energy);
    if (key != last_key) {
      last_errors = BasisErrors(cb->basis, capture, n_cap);
      last_key = key;
    }
    row.errors = last_errors;
    // Options as the server takes them; the basis installed as the default epoch gives the
    // per-layer ranks.
    runtime::KvCacheOptions options;
    options.kind = runtime::KvCacheKind::kCompressed;
    options.sink_tokens = absl::GetFlag(FLAGS_sink_tokens);
    options.window_tokens = absl::GetFlag(FLAGS_window_tokens);
    options.coeff_dtype = c.dtype;
    options.full_dtype = CoeffDtype::kFp16;
    options.refresh = refresh_base;
    options.refresh.method = c.refresh;
    options.refresh_inline = true;  // deterministic: refreshes land at the same steps every run
    absl::StatusOr<std::unique_ptr<CompressedKvCache>> cache =
        runtime::CreateCompressedKvCache(options, geom, 16,
                                         CompressedKvCache::PageBytes(geom, 16, CoeffDtype::kFp16) *
                                             geom.n_layers * blocks_per_window * 2,
                                         std::make_shared<const Basis>(cb->basis), mc.n_heads);
    if (!cache.ok()) return cache.status();
    const std::string what =
        absl::StrCat("[", i + 1, "/", configs.size(), "] ", KeyBasisMethodName(c.mk),
                     c.rank > 0 ? absl::StrCat(" r", c.rank) : absl::StrCat(" e", c.energy), " ",
                     CoeffDtypeName(c.dtype), " refresh ", RefreshMethodName(c.refresh),
                     " perplexity (windows)");
    po.progress = progress(what.c_str());
    absl::StatusOr<eval::ChunkedPerplexityResult> r =
        eval::ComputeChunkedPerplexity(model, **cache, eval, po);
    if (!r.ok()) return r.status();
    if (r->bytes_compressed == 0) {
      return absl::InternalError(
          "no compressed blocks were used: the evaluation is not exercising "
          "the compressed cache (window too short?)");
    }
    row.ppl = *r;
    const CompressedKvCacheDetail detail = (*cache)->Detail();
    row.rer_compressed = detail.key_energy > 0 ? detail.key_residual_energy / detail.key_energy : 0;
    row.refreshes = (*cache)->Stats().refresh.installed;
    double block_bytes = 0.0;
    for (int l = 0; l < geom.n_layers; ++l) {
      block_bytes += static_cast<double>(CompressedKvCache::CompressedBlockBytes(
          geom, 16, row.rk[static_cast<size_t>(l)], row.rv[static_cast<size_t>(l)], c.dtype));
    }
    const double full_fp16_block = 16.0 * geom.n_layers * 2 * geom.n_kv_heads * geom.head_dim * 2;
    row.block_ratio = block_bytes / full_fp16_block;
    rows.push_back(std::move(row));
  }

  // --- Output ---
  auto mean = [](const std::vector<LayerErrors>& e, auto f) {
    eval::ErrorSums s;
    for (const LayerErrors& x : e) s += f(x);
    return s;
  };
  auto rank_str = [](const std::vector<int>& r) {
    int lo = r.empty() ? 0 : r[0], hi = lo;
    for (int x : r) lo = std::min(lo, x), hi = std::max(hi, x);
    return lo == hi ? absl::StrCat(lo) : absl::StrCat(lo, "-", hi);
  };
  std::printf(
      "calibration: %zu tokens of %s; evaluation: %zu tokens of %s; error metrics on the "
      "first %lld evaluation tokens\n",
      calib.size(), calib_desc.c_str(), eval.size(), eval_desc.c_str(),
      static_cast<long long>(n_cap));
  std::printf(
      "compressed cache: S=%d, W=%d, block 16, fp16 full blocks; perplexity window %d in "
      "chunks of %d\n\n",
      absl::GetFlag(FLAGS_sink_tokens), absl::GetFlag(FLAGS_window_tokens), window,
      absl::GetFlag(FLAGS_chunk));
  std::printf(
      "| keys | values | refresh | r_k | r_v | coeff | ppl | dppl %% | bytes/tok vs fp16 "
      "(window) | compressed blocks vs fp16 | K err | logit err | attn-out err | RER | "
      "RER as compressed | epochs installed |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::printf(
      "| full | full | - | %d | %d | fp32 | %.3f | 0.00 | %.3f | - | 0 | 0 | 0 | 0 | 0 | 0 |\n",
      mc.head_dim, mc.head_dim, base_ppl, base->Ratio());
  for (const Row& r : rows) {
    std::printf(
        "| %s | %s | %s | %s | %s | %s | %.3f | %+.2f | %.3f | %.3f | %.4f | %.4f | %.4f | "
        "%.4f | %.4f | %lld |\n",
        KeyBasisMethodName(r.c.mk), ValueBasisMethodName(r.c.mv), RefreshMethodName(r.c.refresh),
        (r.c.energy > 0 ? absl::StrCat(rank_str(r.rk), " (e", r.c.energy, ")") : rank_str(r.rk))
            .c_str(),
        rank_str(r.rv).c_str(), CoeffDtypeName(r.c.dtype), r.ppl.ppl.perplexity,
        100.0 * (r.ppl.ppl.perplexity / base_ppl - 1.0), r.ppl.Ratio(), r.block_ratio,
        mean(r.errors, [](const LayerErrors& x) { return x.key; }).Relative(),
        mean(r.errors, [](const LayerErrors& x) { return x.logit; }).Relative(),
        mean(r.errors, [](const LayerErrors& x) { return x.attn; }).Relative(),
        mean(r.errors, [](const LayerErrors& x) { return x.rer; }).EnergyRatio(), r.rer_compressed,
        static_cast<long long>(r.refreshes));
  }
  // Per-layer attention-output error.
  std::printf(
      "\nPer-layer attention-output relative error (fp32 coefficients, all keys "
      "compressed):\n\n| keys | r_k |");
  for (int l = 0; l < geom.n_layers; ++l) std::printf(" L%d |", l);
  std::printf("\n|---|---|");
  for (int l = 0; l < geom.n_layers; ++l) std::printf("---|");
  std::printf("\n");
  for (const Row& r : rows) {
    if (r.c.dtype != dtypes[0] || r.c.refresh != RefreshMethod::kNone) continue;
    std::printf("| %s | %s |", KeyBasisMethodName(r.c.mk), rank_str(r.rk).c_str());
    for (const LayerErrors& e : r.errors) std::printf(" %.4f |", e.attn.Relative());
    std::printf("\n");
  }
  // Smallest footprint within 1% perplexity.
  const Row* best = nullptr;
  for (const Row& r : rows) {
    if (r.ppl.ppl.perplexity <= base_ppl * 1.01 && (!best || r.ppl.Ratio() < best->ppl.Ratio())) {
      best = &r;
    }
  }
  if (best) {
    std::printf(
        "\nsmallest footprint at <= 1%% perplexity increase: %s/%s r_k %s r_v %s %s: "
        "%.3f of full fp16 per token (window %d; compressed blocks alone %.3f), ppl %.3f "
        "(%+.2f%%)\n",
        KeyBasisMethodName(best->c.mk), ValueBasisMethodName(best->c.mv),
        rank_str(best->rk).c_str(), rank_str(best->rv).c_str(), CoeffDtypeName(best->c.dtype),
        best->ppl.Ratio(), window, best->block_ratio, best->ppl.ppl.perplexity,
        100.0 * (best->ppl.ppl.perplexity / base_ppl - 1.0));
  } else {
    std::printf("\nno configuration within 1%% of the full-cache perplexity\n");
  }
  std::printf("total %.1f s\n", Since(start));

  const std::string csv_path = absl::GetFlag(FLAGS_csv);
  if (!csv_path.empty()) {
    std::ofstream csv(csv_path);
    if (!csv) return absl::InternalError(absl::StrCat("cannot write ", csv_path));
    const std::string label = absl::GetFlag(FLAGS_label);
    csv << "label,method_k,method_v,rank,energy,dtype,layer,r_k,r_v,ppl,ppl_full,bytes_ratio,"
           "block_ratio,key_err,logit_err,attn_err,rer,refresh,rer_compressed\n";
    csv << label << ",full,full,0,0,fp32,all," << mc.head_dim << "," << mc.head_dim << ","
        << base_ppl << "," << base_ppl << "," << base->Ratio() << ",,0,0,0,0,none,0\n";
    for (const Row& r : rows) {
      const std::string head =
          absl::StrCat(label, ",", KeyBasisMethodName(r.c.mk), ",", ValueBasisMethodName(r.c.mv),
                       ",", r.c.rank, ",", r.c.energy, ",", CoeffDtypeName(r.c.dtype), ",");
      for (int l = -1; l < geom.n_layers; ++l) {
        const eval::ErrorSums k = l < 0 ? mean(r.errors, [](const LayerErrors& x) { return x.key; })
                                        : r.errors[static_cast<size_t>(l)].key;
        const eval::ErrorSums lg =
            l < 0 ? mean(r.errors, [](const LayerErrors& x) { return x.logit; })
                  : r.errors[static_cast<size_t>(l)].logit;
        const eval::ErrorSums at = l < 0
                                       ? mean(r.errors, [](const LayerErrors& x) { return x.attn; })
                                       : r.errors[static_cast<size_t>(l)].attn;
        const eval::ErrorSums re = l < 0
                                       ? mean(r.errors, [](const LayerErrors& x) { return x.rer; })
                                       : r.errors[static_cast<size_t>(l)].rer;
        csv << head << (l < 0 ? std::string("all") : std::to_string(l)) << ","
            << (l < 0 ? rank_str(r.rk) : std::to_string(r.rk[static_cast<size_t>(l)])) << ","
            << (l < 0 ? rank_str(r.rv) : std::to_string(r.rv[static_cast<size_t>(l)])) << ",";
        if (l < 0) {
          csv << r.ppl.ppl.perplexity << "," << base_ppl << "," << r.ppl.Ratio() << ","
              << r.block_ratio;
        } else {
          csv << ",,,";
        }
        csv << "," << k.Relative() << "," << lg.Relative() << "," << at.Relative() << ","
            << re.EnergyRatio() << "," << RefreshMethodName(r.c.refresh) << ",";
        if (l < 0) csv << r.rer_compressed;
        csv << "\n";
      }
    }
    std::fprintf(stderr, "wrote %s\n", csv_path.c_str());
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace subspace

int main(int argc, char** argv) {
  subspace::cli::ParseFlags(
      argc, argv,
      "subspace-eval --model M.gguf --text FILE [--calib FILE] [--max-tokens N] "
      "[--calib-tokens N] [--methods ksvd,eigen,kqsvd] [--ranks 8,16,32] [--energies 0.9,0.99] "
      "[--dtypes fp16,int8] [--csv OUT]");
  absl::Status status = subspace::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "subspace-eval: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
