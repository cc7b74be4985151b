// subspace-longctx: the long-context evaluation. Runs a suite (tools/train/longctx_suite.py)
// through the full cache and through each cache a user could pick instead -- eviction,
// quantized full-rank K/V, low-rank compression at several ranks and dtypes -- and prints, per
// cache, bytes per token against fp16, retrieval accuracy, long-range and plain perplexity, how
// much of an unseen passage it copies (continuation items), and
// the KL divergence and top-1 agreement of its next-token distributions with the full cache's.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/flags.h"
#include "core/compress/basis_file.h"
#include "core/compress/calibration.h"
#include "core/compress/codec_file.h"
#include "core/compress/compressed_kv_cache.h"
#include "core/compress/transform_calibration.h"
#include "core/kvcache/kv_quant.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/kvcache/refresh_config.h"
#include "core/model/model.h"
#include "core/model/model_file.h"
#include "core/tokenizer/tokenizer.h"
#include "runtime/kv_cache_options.h"
#include "tools/eval/baseline_kv_caches.h"
#include "tools/eval/long_context.h"

ABSL_FLAG(std::string, model, "models/subspace-tiny.gguf", "GGUF model");
ABSL_FLAG(std::string, suite, "", "suite file (JSON lines) from tools/train/longctx_suite.py");
ABSL_FLAG(std::string, caches, "evict,q8_0,q4_0,kivi4,kqsvd:16:fp16,kqsvd:16:int8,kqsvd:8:fp16",
          "caches compared with the full one: evict, q8_0, q4_0, kivi4, kivi2, hq8_0, hq4_0 "
          "(Hadamard-rotated), tq2.5, tq3.5 (TurboQuant), each with :sw for exact sinks and "
          "window as tc keeps them, full, "
          "tc:BITS[:post][:joint][:id][:aw][:fine] (the transform codec at BITS per element, or "
          "KEY_BITS/VALUE_BITS, "
          "calibrated on --calib: keys pre-RoPE unless post, a budget per layer-head unless "
          "joint, PCA basis unless id, errors weighted by attention (aw: queries on keys, W_O on "
          "values), widths {0,2,3,4,8} or with fine {0,1,2,3,4,5,6,8}, konly / vonly: the other "
          "side exact), tcfile:PATH (a codec "
          "file from subspace-calibrate --kv-budget), tccache:PATH[:pca] (the server's --kv-cache "
          "transform on that file: whole blocks coded, bytes measured in its pool; :pca refits "
          "the codes online every --refresh-every-tokens), "
          "METHOD:RANK:DTYPE (METHOD ksvd|eigen|kqsvd calibrated on --calib; DTYPE fp16|int8|int4) "
          "or self:RANK:DTYPE (self-calibrated, as the server without --bases) or "
          "file:PATH:DTYPE (a subspace-calibrate basis file, as the server's --bases); a fourth "
          "part :REFRESH (pca|kqsvd|oja|fd) adds online refresh from that start");
ABSL_FLAG(int64_t, refresh_every_tokens, 256,
          "online refresh: new epoch every T compressed tokens");
ABSL_FLAG(int32_t, refresh_max_epochs, 2,
          "online refresh: epochs a sequence keeps live per layer (older blocks re-coded)");
ABSL_FLAG(double, refresh_half_life_tokens, 1024.0,
          "online refresh: tokens over which the statistics lose half their weight");
ABSL_FLAG(std::string, calib, "models/data/test.txt", "text the low-rank bases are calibrated on");
ABSL_FLAG(int64_t, calib_tokens, 20000, "calibration tokens (0: all)");
ABSL_FLAG(int32_t, sink_tokens, subspace::CompressionPolicy::kDefaultSinkTokens,
          "S: sinks kept full-rank (evict and low-rank)");
ABSL_FLAG(int32_t, window_tokens, subspace::CompressionPolicy::kDefaultWindowTokens,
          "W: recent tokens kept full-rank (evict and low-rank)");
ABSL_FLAG(float, outlier_threshold, 1.0f,
          "low-rank: relative key residual above which a token stays full-rank (>= 1: none), "
          "as the server's --kv-outlier-threshold");
ABSL_FLAG(int32_t, chunk, 64, "prefill chunk: caches compress between chunks");
ABSL_FLAG(int32_t, max_items, 0, "first N items of the suite only (0: all)");
ABSL_FLAG(int32_t, long_items, 1900,
          "items of at least this many tokens are also reported on their own (the @long columns)");
ABSL_FLAG(std::string, json, "",
          "also write the table here as JSON lines, one object per cache (for plots and checks)");

namespace subspace {
namespace {

using Clock = std::chrono::steady_clock;

struct CacheSpec {
  std::string name;
  bool full = false;
  eval::BaselineKind baseline = eval::BaselineKind::kFull;
  bool lowrank = false, self = false;
  KeyBasisMethod method = KeyBasisMethod::kKqsvd;
  int rank = 0;
  CoeffDtype dtype = CoeffDtype::kFp16;
  RefreshMethod refresh = RefreshMethod::kNone;
  std::string basis_path;                     // file:PATH:DTYPE, the ranks per layer are the file's
  bool transform = false;                     // tc:BITS[:post][:joint][:id][:aw][:fine]
  bool transform_cache = false;               // tccache:PATH, the codec file in the real cache
  bool exact_sinks_window = false;            // BASELINE:sw
  bool code_keys = true, code_values = true;  // tc:...:konly / vonly
  TransformFitOptions fit;
};

absl::StatusOr<CacheSpec> ParseSpec(const std::string& s, int head_dim) {
  CacheSpec c;
  c.name = s;
  const std::vector<std::string> parts = absl::StrSplit(s, ':');
  if (parts.size() == 1) {
    if (s == "full") {
      c.full = true;
      return c;
    }
    absl::StatusOr<eval::BaselineKind> k = eval::ParseBaselineKind(s);
    if (!k.ok()) return k.status();
    c.baseline = *k;
    return c;
  }
  if (parts.size() == 2 && parts[1] == "sw") {  // a baseline with exact sinks and window
    absl::StatusOr<eval::BaselineKind> k = eval::ParseBaselineKind(parts[0]);
    if (!k.ok()) return k.status();
    c.baseline = *k;
    c.exact_sinks_window = true;
    return c;
  }
  if (parts[0] == "tccache") {  // tccache:PATH[:pca]: TransformKvCache on a codec file
    if (parts.size() < 2 || parts.size() > 3 || parts[1].empty() ||
        (parts.size() == 3 && parts[2] != "pca")) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad cache spec ", s, " (tccache:PATH or tccache:PATH:pca)"));
    }
    c.transform_cache = true;
    c.basis_path = parts[1];
    if (parts.size() == 3) c.refresh = RefreshMethod::kPca;
    return c;
  }
  if (parts[0] == "tcfile") {  // tcfile:PATH, a codec file from subspace-calibrate
    if (parts.size() != 2 || parts[1].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("bad cache spec ", s, " (tcfile:PATH)"));
    }
    c.transform = true;
    c.baseline = eval::BaselineKind::kTransform;
    c.basis_path = parts[1];
    return c;
  }
  if (parts[0] == "tc") {
    c.transform = true;
    c.baseline = eval::BaselineKind::kTransform;
    // BITS, or KEY_BITS/VALUE_BITS.
    const std::vector<std::string> kv = absl::StrSplit(parts[1], '/');
    double bits[2] = {0, 0};
    for (size_t i = 0; i < 2; ++i) {
      const std::string& b = kv[std::min(i, kv.size() - 1)];
      char* end = nullptr;
      bits[i] = std::strtod(b.c_str(), &end);
      if (kv.size() > 2 || end == b.c_str() || *end != '\0' || !(bits[i] >= 0.0) || bits[i] > 8.0) {
        return absl::InvalidArgumentError(
            absl::StrCat("bits in ", s, " not in [0, 8] (BITS or KEY_BITS/VALUE_BITS)"));
      }
    }
    c.fit.key_bits = bits[0];
    c.fit.value_bits = bits[1];
    for (size_t i = 2; i < parts.size(); ++i) {
      if (parts[i] == "post") {
        c.fit.pre_rope_keys = false;
      } else if (parts[i] == "joint") {
        c.fit.joint = true;
      } else if (parts[i] == "id") {
        c.fit.code.pca = false;
      } else if (parts[i] == "aw") {
        c.fit.attention_weighted = true;
      } else if (parts[i] == "konly") {
        c.code_values = false;
      } else if (parts[i] == "vonly") {
        c.code_keys = false;
      } else if (parts[i] == "fine") {
        c.fit.code.widths = {0, 1, 2, 3, 4, 5, 6, 8};
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("option '", parts[i], "' in ", s, " is not post, joint, id, aw or fine"));
      }
    }
    return c;
  }
  if (parts.size() != 3 && parts.size() != 4) {
    return absl::InvalidArgumentError(absl::StrCat("bad cache spec ", s));
  }
  if (parts.size() == 4) {
    absl::StatusOr<RefreshMethod> r = ParseRefreshMethod(parts[3]);
    if (!r.ok()) return r.status();
    c.refresh = *r;
  }
  c.lowrank = true;
  if (parts[0] == "self") {
    c.self = true;
  } else if (parts[0] == "file") {
    c.basis_path = parts[1];
    if (c.basis_path.empty()) return absl::InvalidArgumentError(absl::StrCat("no path in ", s));
  } else {
    absl::StatusOr<KeyBasisMethod> m = ParseKeyBasisMethod(parts[0]);
    if (!m.ok()) return m.status();
    c.method = *m;
  }
  c.rank = c.basis_path.empty() ? std::atoi(parts[1].c_str()) : head_dim;  // file: per layer
  if (c.rank < 1 || c.rank > head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("rank in ", s, " not in [1, head_dim]"));
  }
  if (parts[2] == "fp16") {
    c.dtype = CoeffDtype::kFp16;
  } else if (parts[2] == "int8") {
    c.dtype = CoeffDtype::kInt8;
  } else if (parts[2] == "int4") {
    c.dtype = CoeffDtype::kInt4;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("dtype in ", s, " must be fp16, int8 or int4"));
  }
  return c;
}

struct Tally {
  int64_t retrieval = 0, retrieved = 0;  // pass keys and key-value items
  double nll_long = 0, nll_plain = 0;    // recurrence / plain
  int64_t n_long = 0, n_plain = 0;
  int64_t copied = 0, n_copy = 0;  // continuation: scored tokens greedy decoding gets right
  double kld = 0;
  int64_t positions = 0, top1 = 0;
  double bytes_ratio_sum = 0;  // bytes per token / fp16's, summed over items
  int64_t items = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> by_kind;  // retrieved, total
  // The same over the items of at least --long-items tokens.
  int64_t long_items = 0, long_retrieval = 0, long_retrieved = 0, long_positions = 0;
  double long_bytes_ratio_sum = 0, long_kld = 0;
  double long_nll = 0;  // recurrence items only, as nll_long
  int64_t long_n = 0;
};

absl::Status Run() {
  const std::string model_path = absl::GetFlag(FLAGS_model);
  absl::StatusOr<ModelFile> files = OpenModelFile(model_path);
  if (!files.ok()) return files.status();
  LlamaModel& model = *files->model;
  const Tokenizer& tokenizer = *files->tokenizer;
  const ModelConfig& mc = model.config();
  const KvCacheGeometry geom = mc.cache_geometry();
  const int S = absl::GetFlag(FLAGS_sink_tokens), W = absl::GetFlag(FLAGS_window_tokens);
  const int chunk = absl::GetFlag(FLAGS_chunk);

  // --- The suite ---
  std::ifstream in(absl::GetFlag(FLAGS_suite));
  if (!in)
    return absl::NotFoundError(absl::StrCat("cannot read --suite ", absl::GetFlag(FLAGS_suite)));
  std::vector<eval::LongContextItem> items;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    absl::StatusOr<eval::LongContextItem> item =
        eval::ParseSuiteLine(line, tokenizer, mc.context_length);
    if (!item.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--suite line ", items.size() + 1, ": ", item.status().message()));
    }
    items.push_back(*std::move(item));
    if (absl::GetFlag(FLAGS_max_items) > 0 &&
        static_cast<int64_t>(items.size()) >= absl::GetFlag(FLAGS_max_items)) {
      break;
    }
  }
  if (items.empty()) return absl::InvalidArgumentError("empty suite");
  int64_t max_len = 0;
  for (const auto& it : items) max_len = std::max<int64_t>(max_len, it.tokens.size());

  std::vector<CacheSpec> specs;
  specs.push_back({.name = "full", .full = true});
  const std::vector<std::string> names =
      absl::StrSplit(absl::GetFlag(FLAGS_caches), ',', absl::SkipEmpty());
  for (const std::string& s : names) {
    absl::StatusOr<CacheSpec> c = ParseSpec(s, mc.head_dim);
    if (!c.ok()) return c.status();
    if (!c->full) specs.push_back(*c);
  }

  // --- Calibration statistics, once, if a calibrated low-rank cache is asked for ---
  // The --calib tokens both calibrations run on, in windows of up to 1,024 tokens.
  auto calib_tokens = [&]() -> absl::StatusOr<std::vector<int32_t>> {
    std::ifstream cf(absl::GetFlag(FLAGS_calib));
    if (!cf)
      return absl::NotFoundError(absl::StrCat("cannot read --calib ", absl::GetFlag(FLAGS_calib)));
    const std::string text((std::istreambuf_iterator<char>(cf)), std::istreambuf_iterator<char>());
    std::vector<int32_t> calib = tokenizer.Encode(text, {.add_bos = false});
    const int64_t limit = absl::GetFlag(FLAGS_calib_tokens);
    if (limit > 0 && static_cast<int64_t>(calib.size()) > limit) calib.resize(limit);
    return calib;
  };
  const CalibrationRunOptions calib_run{.window = std::min(mc.context_length, 1024),
                                        .max_tokens = 0,
                                        .bos = tokenizer.bos_id(),
                                        .progress = {}};
  std::unique_ptr<CalibrationStats> stats;
  if (std::any_of(specs.begin(), specs.end(), [](const CacheSpec& c) {
        return c.lowrank && !c.self && c.basis_path.empty();
      })) {
    absl::StatusOr<std::vector<int32_t>> calib = calib_tokens();
    if (!calib.ok()) return calib.status();
    absl::StatusOr<CalibrationStats> s = CollectCalibrationStats(model, *calib, calib_run);
    if (!s.ok()) return s.status();
    if (absl::Status st = AccumulateOutputGrams(model, &*s); !st.ok()) return st;
    stats = std::make_unique<CalibrationStats>(*std::move(s));
  }

  // --- Key and value rows for the transform codec, once, if a tc cache is asked for ---
  std::unique_ptr<KvRows> kv_rows;
  if (std::any_of(specs.begin(), specs.end(),
                  [](const CacheSpec& c) { return c.transform && c.basis_path.empty(); })) {
    absl::StatusOr<std::vector<int32_t>> calib = calib_tokens();
    if (!calib.ok()) return calib.status();
    absl::StatusOr<KvRows> r = CollectKvRows(model, *calib, calib_run);
    if (!r.ok()) return r.status();
    kv_rows = std::make_unique<KvRows>(*std::move(r));
  }

  std::map<std::string, std::vector<TransformStream>> analysed;  // by analysis options

  const int64_t pages_per_item = (max_len + 15) / 16 + 4;
  const double fp16_per_token = 2.0 * 2 * geom.n_layers * geom.n_kv_heads * geom.head_dim;
  std::vector<eval::ItemRun> reference(items.size());
  std::printf(
      "model %s (%d layers, %d/%d heads, head_dim %d, context %d); %zu items; S %d, W %d, "
      "prefill chunk %d\n\n",
      model_path.c_str(), mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.head_dim, mc.context_length,
      items.size(), S, W, chunk);
  std::printf(
      "| cache | bytes/token vs fp16 | pass key | kv recall | long-range ppl | plain ppl | "
      "copy acc | KLD (nats) | top-1 agree | bytes @long | retrieval @long | "
      "long-range ppl @long | KLD @long | s |\n"
      "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n");
  std::unique_ptr<std::ofstream> json;
  if (!absl::GetFlag(FLAGS_json).empty()) {
    json = std::make_unique<std::ofstream>(absl::GetFlag(FLAGS_json));
    if (!*json) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot write --json ", absl::GetFlag(FLAGS_json)));
    }
  }
  for (const CacheSpec& spec : specs) {
    const auto t0 = Clock::now();
    std::unique_ptr<KvCache> cache;
    // The baselines' and tc's configuration, also for their footprint.
    eval::BaselineKvCacheConfig baseline{
        .geometry = geom, .kind = spec.baseline, .sink_tokens = S, .window_tokens = W};
    baseline.exact_sinks_window = spec.exact_sinks_window;
    baseline.code_keys = spec.code_keys;
    baseline.code_values = spec.code_values;
    bool measured_bytes = false;
    const bool quantized =
        !spec.full && !spec.lowrank && !spec.exact_sinks_window &&
        (spec.baseline == eval::BaselineKind::kQ8_0 || spec.baseline == eval::BaselineKind::kQ4_0);
    if (spec.full || quantized) {
      // The server's paged cache: fp32, or `--kv-cache quantized --kv-dtype q8_0|q4_0`.
      runtime::KvCacheOptions options;
      options.kind = quantized ? runtime::KvCacheKind::kQuantized : runtime::KvCacheKind::kFull;
      options.kv_dtype =
          spec.baseline == eval::BaselineKind::kQ4_0 ? KvDtype::kQ4_0 : KvDtype::kQ8_0;
      const KvDtype dtype = quantized ? options.kv_dtype : KvDtype::kF32;
      absl::StatusOr<std::unique_ptr<PagedKvCache>> c = runtime::CreatePagedKvCache(
          options, geom, 16,
          PagedKvCache::BlockBytes(geom, 16, dtype) * geom.n_layers * pages_per_item);
      if (!c.ok()) return c.status();
      cache = *std::move(c);
    } else if (spec.transform_cache) {
      // The server's `--kv-cache transform --codec PATH`.
      absl::StatusOr<CodecFile> file =
          LoadCodecForModel(spec.basis_path, *files->gguf, geom, spec.basis_path);
      if (!file.ok()) return file.status();
      absl::StatusOr<RopeSchedule> rope = mc.rope();
      if (!rope.ok()) return rope.status();
      runtime::KvCacheOptions options;
      options.kind = runtime::KvCacheKind::kTransform;
      options.sink_tokens = S;
      options.window_tokens = W;
      // Online refresh as the server runs it, but inline: deterministic, same steps every run.
      options.refresh.method = spec.refresh;
      options.refresh.every_tokens = absl::GetFlag(FLAGS_refresh_every_tokens);
      options.refresh.max_epochs = absl::GetFlag(FLAGS_refresh_max_epochs);
      options.refresh.half_life_tokens = absl::GetFlag(FLAGS_refresh_half_life_tokens);
      options.refresh_inline = true;
      absl::StatusOr<std::unique_ptr<TransformKvCache>> c = runtime::CreateTransformKvCache(
          options, geom, 16, TransformKvCache::PageBytes(geom, 16) * geom.n_layers * pages_per_item,
          *file, *rope);
      if (!c.ok()) return c.status();
      cache = *std::move(c);
      measured_bytes = true;
    } else if (!spec.lowrank) {
      baseline.capacity_bytes = PagedKvCache::BlockBytes(geom, 16) * geom.n_layers * pages_per_item;
      if (spec.transform && !spec.basis_path.empty()) {
        absl::StatusOr<CodecFile> file =
            LoadCodecForModel(spec.basis_path, *files->gguf, geom, spec.basis_path);
        if (!file.ok()) return file.status();
        baseline.key_codes = std::make_shared<const std::vector<TransformCode>>(file->keys);
        baseline.value_codes = std::make_shared<const std::vector<TransformCode>>(file->values);
        if (file->info.pre_rope_keys) {
          absl::StatusOr<RopeSchedule> rope = mc.rope();
          if (!rope.ok()) return rope.status();
          baseline.key_rope = *std::move(rope);
        }
      } else if (spec.transform) {
        // Specs that differ only in budget or joint share one analysis.
        const std::string key =
            absl::StrCat(spec.fit.pre_rope_keys, spec.fit.attention_weighted, spec.fit.code.pca,
                         absl::StrJoin(spec.fit.code.widths, ","));
        auto it = analysed.find(key);
        if (it == analysed.end()) {
          absl::StatusOr<std::vector<TransformStream>> s = AnalyzeKvRows(*kv_rows, spec.fit);
          if (!s.ok()) return s.status();
          it = analysed.emplace(key, *std::move(s)).first;
        }
        absl::StatusOr<TransformCodes> codes = AllocateKvCodes(it->second, spec.fit);
        if (!codes.ok()) return codes.status();
        baseline.key_codes = codes->keys;
        baseline.value_codes = codes->values;
        if (spec.fit.pre_rope_keys) {
          absl::StatusOr<RopeSchedule> rope = mc.rope();
          if (!rope.ok()) return rope.status();
          baseline.key_rope = *std::move(rope);
        }
      }
      absl::StatusOr<std::unique_ptr<eval::BaselineKvCache>> c =
          eval::BaselineKvCache::Create(baseline);
      if (!c.ok()) return c.status();
      cache = *std::move(c);
    } else {
      // The server's compressed cache, from the options its flags set; the basis (a file, one
      // calibrated here, or none: self-calibration) installed as the default epoch.
      std::shared_ptr<const Basis> basis;
      if (!spec.basis_path.empty()) {
        absl::StatusOr<std::shared_ptr<const Basis>> b =
            LoadBasisForModel(spec.basis_path, *files->gguf, geom, spec.basis_path);
        if (!b.ok()) return b.status();
        basis = *std::move(b);
      } else if (!spec.self) {
        absl::StatusOr<CalibratedBasis> b = ComputeCalibratedBasis(
            *stats, {.method_k = spec.method,
                     .method_v = spec.method == KeyBasisMethod::kKqsvd ? ValueBasisMethod::kKqsvd
                                                                       : ValueBasisMethod::kKsvd,
                     .rank = spec.rank});
        if (!b.ok()) return b.status();
        basis = std::make_shared<const Basis>(std::move(b->basis));
      }
      runtime::KvCacheOptions options;
      options.kind = runtime::KvCacheKind::kCompressed;
      options.sink_tokens = S;
      options.window_tokens = W;
      options.rank_k = basis == nullptr ? spec.rank : 0;
      options.rank_v = basis == nullptr ? spec.rank : 0;
      options.coeff_dtype = spec.dtype;
      options.full_dtype = CoeffDtype::kFp16;
      options.outlier_threshold = absl::GetFlag(FLAGS_outlier_threshold);
      // Online refresh as the server runs it, but inline: deterministic, same steps every run.
      options.refresh.method = spec.refresh;
      options.refresh.every_tokens = absl::GetFlag(FLAGS_refresh_every_tokens);
      options.refresh.max_epochs = absl::GetFlag(FLAGS_refresh_max_epochs);
      options.refresh.half_life_tokens = absl::GetFlag(FLAGS_refresh_half_life_tokens);
      options.refresh_inline = true;
      absl::StatusOr<std::unique_ptr<CompressedKvCache>> c = runtime::CreateCompressedKvCache(
          options, geom, 16,
          CompressedKvCache::PageBytes(geom, 16, CoeffDtype::kFp16) * geom.n_layers *
              pages_per_item,
          std::move(basis), mc.n_heads);
      if (!c.ok()) return c.status();
      cache = *std::move(c);
      measured_bytes = true;
    }
    Tally t;
    for (size_t i = 0; i < items.size(); ++i) {
      const eval::LongContextItem& item = items[i];
      absl::StatusOr<eval::ItemRun> run = eval::RunItem(model, *cache, item, chunk);
      if (!run.ok()) return run.status();
      const eval::ItemScore sc =
          eval::ScoreItem(item, *run, spec.full ? nullptr : &reference[i], mc.n_vocab);
      const int64_t len = static_cast<int64_t>(item.tokens.size()) - 1;  // tokens cached
      double bytes = 0;
      if (spec.full) {
        bytes = fp16_per_token;
      } else if (measured_bytes) {
        bytes = static_cast<double>(run->bytes_used) / static_cast<double>(len);
      } else {
        bytes = eval::BaselineBytesPerToken(baseline, len);
      }
      t.bytes_ratio_sum += bytes / fp16_per_token;
      ++t.items;
      if (len + 1 >= absl::GetFlag(FLAGS_long_items)) {
        ++t.long_items;
        t.long_bytes_ratio_sum += bytes / fp16_per_token;
        t.long_kld += sc.kld;
        t.long_positions += sc.scored;
        if (item.retrieval()) {
          ++t.long_retrieval;
          t.long_retrieved += sc.exact;
        } else if (item.kind == "recurrence") {
          t.long_nll += sc.nll;
          t.long_n += sc.scored;
        }
      }
      if (item.retrieval()) {
        ++t.retrieval;
        t.retrieved += sc.exact;
        auto& k = t.by_kind[item.kind];
        k.first += sc.exact;
        ++k.second;
      } else if (item.kind == "recurrence") {
        t.nll_long += sc.nll;
        t.n_long += sc.scored;
      } else if (item.kind == "continuation") {
        t.copied += sc.correct;
        t.n_copy += sc.scored;
      } else {
        t.nll_plain += sc.nll;
        t.n_plain += sc.scored;
      }
      t.kld += sc.kld;
      t.top1 += sc.top1_agree;
      t.positions += sc.scored;
      if (spec.full) reference[i] = *std::move(run);
    }
    // Hits and items of the retrieval kinds given.
    auto count = [&](std::initializer_list<const char*> kinds) {
      std::pair<int64_t, int64_t> hn{0, 0};
      for (const char* k : kinds) {
        const auto it = t.by_kind.find(k);
        if (it != t.by_kind.end()) {
          hn.first += it->second.first;
          hn.second += it->second.second;
        }
      }
      return hn;
    };
    const auto passkey = count({"passkey_filler", "passkey_natural"});
    const auto kv = count({"kv"});
    auto acc = [](std::pair<int64_t, int64_t> hn) {
      return hn.second > 0 ? absl::StrFormat("%.3f (%d)", static_cast<double>(hn.first) / hn.second,
                                             hn.second)
                           : std::string("—");
    };
    auto ppl = [](double nll, int64_t n) {
      return n > 0 ? absl::StrFormat("%.3f", std::exp(nll / static_cast<double>(n)))
                   : std::string("—");
    };
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const double bytes_ratio = t.bytes_ratio_sum / static_cast<double>(t.items);
    const double kld = t.positions > 0 ? t.kld / static_cast<double>(t.positions) : 0.0;
    const double top1 =
        t.positions > 0 ? static_cast<double>(t.top1) / static_cast<double>(t.positions) : 0.0;
    const double long_bytes =
        t.long_items > 0 ? t.long_bytes_ratio_sum / static_cast<double>(t.long_items) : 0.0;
    const double long_kld =
        t.long_positions > 0 ? t.long_kld / static_cast<double>(t.long_positions) : 0.0;
    const double copy_acc =
        t.n_copy > 0 ? static_cast<double>(t.copied) / static_cast<double>(t.n_copy) : 0.0;
    if (json) {
      // null for what the suite has no items of; names are the --caches specs (no quotes).
      auto num = [](double x, bool present) {
        return present ? absl::StrFormat("%.6g", x) : std::string("null");
      };
      *json << absl::StrFormat(
          "{\"cache\": \"%s\", \"bytes_ratio\": %.6g, \"passkey_hits\": %d, \"passkey_n\": %d, "
          "\"kv_hits\": %d, \"kv_n\": %d, \"long_ppl\": %s, \"plain_ppl\": %s, "
          "\"kld\": %.6g, \"top1\": %.6g, \"long_items\": %d, \"long_bytes_ratio\": %s, "
          "\"long_retrieval_hits\": %d, \"long_retrieval_n\": %d, \"long_long_ppl\": %s, "
          "\"long_kld\": %s, \"copy_acc\": %s, \"copy_n\": %d, "
          "\"seconds\": %.1f}\n",
          spec.name, bytes_ratio, passkey.first, passkey.second, kv.first, kv.second,
          num(std::exp(t.nll_long / std::max<double>(t.n_long, 1)), t.n_long > 0),
          num(std::exp(t.nll_plain / std::max<double>(t.n_plain, 1)), t.n_plain > 0), kld, top1,
          t.long_items, num(long_bytes, t.long_items > 0), t.long_retrieved, t.long_retrieval,
          num(std::exp(t.long_nll / std::max<double>(t.long_n, 1)), t.long_n > 0),
          num(long_kld, t.long_positions > 0), num(copy_acc, t.n_copy > 0), t.n_copy, seconds);
      json->flush();
    }
    std::printf("| %s | %.3f | %s | %s | %s | %s | %s | %.4f | %.4f | %s | %s | %s | %s | %.0f |\n",
                spec.name.c_str(), bytes_ratio, acc(passkey).c_str(), acc(kv).c_str(),
                ppl(t.nll_long, t.n_long).c_str(), ppl(t.nll_plain, t.n_plain).c_str(),
                t.n_copy > 0 ? absl::StrFormat("%.3f", copy_acc).c_str() : "—", kld, top1,
                t.long_items > 0 ? absl::StrFormat("%.3f", long_bytes).c_str() : "—",
                acc({t.long_retrieved, t.long_retrieval}).c_str(),
                ppl(t.long_nll, t.long_n).c_str(),
                t.long_positions > 0 ? absl::StrFormat("%.4f", long_kld).c_str() : "—", seconds);
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace subspace

int main(int argc, char** argv) {
  subspace::cli::ParseFlags(argc, argv,
                            "subspace-longctx --model M.gguf --suite SUITE.jsonl "
                            "[--caches evict,q8_0,q4_0,kivi4,kqsvd:16:fp16,...]");
  const absl::Status status = subspace::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "subspace-longctx: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
