// subspace-calibrate: runs a model over calibration text, accumulates per-head key, query and
// value Gram matrices, turns them into a basis epoch (KQ-SVD, K-SVD or Eigen) and writes the
// basis file the server loads with --bases; or, with --kv-budget, fits the transform codec
// (PCA + bit allocation per layer-head) and writes its codec file. Deterministic for the same
// inputs.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cli/flags.h"
#include "core/compress/basis_file.h"
#include "core/compress/calibration.h"
#include "core/compress/codec_file.h"
#include "core/compress/transform_calibration.h"
#include "core/model/model.h"
#include "core/model/model_file.h"
#include "core/tokenizer/tokenizer.h"
#include "runtime/codec_calibration.h"

ABSL_FLAG(std::string, model, "", "path of the GGUF model");
ABSL_FLAG(std::string, text, "",
          "calibration text: a file, or a directory of files (sorted); empty: text the model "
          "writes itself (--max-tokens of it, 20000 when 0; as the server's --kv-budget does "
          "without --calib-text)");
ABSL_FLAG(std::string, out, "", "path of the basis file to write");
ABSL_FLAG(std::string, method_k, "kqsvd", "key basis: kqsvd | ksvd | eigen");
ABSL_FLAG(std::string, method_v, "kqsvd", "value basis: kqsvd | ksvd");
ABSL_FLAG(int32_t, rank, 0, "fixed rank for every layer (exclusive with --energy)");
ABSL_FLAG(double, energy, 0.0, "per-layer rank capturing this fraction of the spectrum, (0, 1]");
ABSL_FLAG(int64_t, max_tokens, 0, "calibrate on at most this many tokens; 0 = all");
ABSL_FLAG(int32_t, window, 512, "tokens per calibration sequence (capped by the context)");
ABSL_FLAG(double, kv_budget, 0.0,
          "write a transform codec at this many bits per K/V element instead of a low-rank "
          "basis (exclusive with --rank / --energy; keeps every key and value row in memory: "
          "12 x n_layers x n_kv_heads x head_dim bytes per token)");
ABSL_FLAG(double, kv_budget_v, 0.0,
          "--kv-budget: the values' bits per element, when they differ from the keys' "
          "(0: the same)");
ABSL_FLAG(bool, codec_post_rope, false, "--kv-budget: code keys after RoPE (default: before)");
ABSL_FLAG(bool, codec_joint, false,
          "--kv-budget: one budget shared by every layer-head, K and V (default: each its own)");
ABSL_FLAG(bool, codec_weighted, true,
          "--kv-budget: weigh errors by attention (queries on keys, W_O on values); on the "
          "long-context suite KLD 0.0078 -> 0.0054 at 2.5 / 1.5 bits (docs/transform_codec.md)");

namespace subspace {
namespace {

absl::Status Run() {
  const std::string model_path = absl::GetFlag(FLAGS_model), out = absl::GetFlag(FLAGS_out);
  if (model_path.empty() || out.empty()) {
    return absl::InvalidArgumentError("--model and --out are required");
  }
  absl::StatusOr<KeyBasisMethod> method_k = ParseKeyBasisMethod(absl::GetFlag(FLAGS_method_k));
  if (!method_k.ok()) return method_k.status();
  absl::StatusOr<ValueBasisMethod> method_v = ParseValueBasisMethod(absl::GetFlag(FLAGS_method_v));
  if (!method_v.ok()) return method_v.status();
  BasisMethodOptions bo{.method_k = *method_k,
                        .method_v = *method_v,
                        .rank = absl::GetFlag(FLAGS_rank),
                        .energy = absl::GetFlag(FLAGS_energy)};
  const double budget = absl::GetFlag(FLAGS_kv_budget);
  if (static_cast<int>(bo.rank > 0) + static_cast<int>(bo.energy > 0.0) +
              static_cast<int>(budget > 0.0) !=
          1 ||
      bo.rank < 0 || bo.energy < 0.0 || bo.energy > 1.0 || budget < 0.0 || budget > 8.0) {
    return absl::InvalidArgumentError(
        "set exactly one of --rank R (>= 1), --energy E in (0, 1] and --kv-budget B in (0, 8]");
  }

  absl::StatusOr<ModelFile> loaded = OpenModelFile(model_path);
  if (!loaded.ok()) return loaded.status();
  const std::shared_ptr<const GgufFile> gguf = loaded->gguf;
  LlamaModel& model = *loaded->model;
  const Tokenizer& tokenizer = *loaded->tokenizer;
  const ModelConfig& c = model.config();
  if (bo.rank > c.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("--rank must be at most head_dim ", c.head_dim));
  }

  const int64_t max_tokens = absl::GetFlag(FLAGS_max_tokens);
  const std::string text = absl::GetFlag(FLAGS_text);
  absl::StatusOr<std::vector<int32_t>> read =
      runtime::CalibrationTokens(text, model, tokenizer, max_tokens, absl::GetFlag(FLAGS_window));
  if (!read.ok()) return read.status();
  const std::vector<int32_t>& tokens = *read;
  const uint64_t checksum = ModelChecksum(*gguf);
  std::fprintf(stderr,
               "model %s: %d layers, %d heads (%d kv), head_dim %d; calibrating on %zu tokens of "
               "%s\n",
               model_path.c_str(), c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, tokens.size(),
               text.empty() ? "its own text" : "text");

  const auto start = std::chrono::steady_clock::now();
  auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  CalibrationRunOptions ro{.window = absl::GetFlag(FLAGS_window),
                           .max_tokens = max_tokens,
                           .bos = tokenizer.bos_id(),
                           .progress = {}};
  ro.progress = [&](int64_t done, int64_t total) {
    const double s = seconds_since(start);
    const double eta = done > 0 ? s * static_cast<double>(total - done) / done : 0.0;
    std::fprintf(stderr, "\rcalibrating: %lld / %lld tokens (%.0f%%), %.0f tok/s, ETA %.0f s   ",
                 static_cast<long long>(done), static_cast<long long>(total), 100.0 * done / total,
                 done / std::max(s, 1e-9), eta);
    if (done == total) std::fprintf(stderr, "\n");
  };
  if (budget > 0.0) {
    const double value_budget =
        absl::GetFlag(FLAGS_kv_budget_v) > 0.0 ? absl::GetFlag(FLAGS_kv_budget_v) : budget;
    if (value_budget > 8.0) return absl::InvalidArgumentError("--kv-budget-v must be <= 8");
    TransformFitOptions fo{.key_bits = budget,
                           .value_bits = value_budget,
                           .pre_rope_keys = !absl::GetFlag(FLAGS_codec_post_rope),
                           .joint = absl::GetFlag(FLAGS_codec_joint),
                           .attention_weighted = absl::GetFlag(FLAGS_codec_weighted)};
    absl::StatusOr<CodecFile> fitted = runtime::FitCodecFile(model, *gguf, tokens, fo, ro);
    if (!fitted.ok()) return fitted.status();
    const CodecFile& file = *fitted;
    if (absl::Status s = WriteCodecFile(out, file); !s.ok()) return s;
    std::printf(
        "transform codec, %.3g / %.3g bits per key / value element (%s keys%s%s); "
        "%lld tokens\n",
        budget, value_budget, fo.pre_rope_keys ? "pre-RoPE" : "post-RoPE",
        fo.joint ? ", joint" : "", fo.attention_weighted ? ", attention-weighted" : "",
        static_cast<long long>(file.info.calibration_tokens));
    std::printf("%5s %5s %12s %12s\n", "layer", "head", "key bits", "value bits");
    for (size_t at = 0; at < file.keys.size(); ++at) {
      std::printf("%5zu %5zu %12d %12d\n", at / c.n_kv_heads, at % c.n_kv_heads,
                  file.keys[at].BitsPerRow(), file.values[at].BitsPerRow());
    }
    std::printf("forward and fit %.2f s; wrote %s\n", seconds_since(start), out.c_str());
    return absl::OkStatus();
  }
  absl::StatusOr<CalibrationStats> stats = CollectCalibrationStats(model, tokens, ro);
  if (!stats.ok()) return stats.status();
  const double forward_s = seconds_since(start);

  const auto basis_start = std::chrono::steady_clock::now();
  absl::StatusOr<CalibratedBasis> basis = ComputeCalibratedBasis(*stats, bo);
  if (!basis.ok()) return basis.status();
  const double basis_s = seconds_since(basis_start);

  const BasisFileInfo info{.method_k = KeyBasisMethodName(bo.method_k),
                           .method_v = ValueBasisMethodName(bo.method_v),
                           .energy = bo.energy,
                           .calibration_tokens = static_cast<uint64_t>(stats->key_tokens),
                           .model_checksum = checksum};
  if (absl::Status s = WriteBasisFile(out, info, basis->basis); !s.ok()) return s;

  std::printf("method k %s, v %s; %s; %lld tokens (BOS per window included)\n",
              info.method_k.c_str(), info.method_v.c_str(),
              bo.rank > 0 ? absl::StrCat("rank ", bo.rank).c_str()
                          : absl::StrCat("energy ", bo.energy).c_str(),
              static_cast<long long>(stats->key_tokens));
  std::printf("%5s %5s %9s %5s %9s\n", "layer", "r_k", "energy_k", "r_v", "energy_v");
  int64_t coeffs = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerBasis& lb = basis->basis.layers[static_cast<size_t>(l)];
    std::printf("%5d %5d %9.4f %5d %9.4f\n", l, lb.rank_k, basis->energy_k[static_cast<size_t>(l)],
                lb.rank_v, basis->energy_v[static_cast<size_t>(l)]);
    coeffs += lb.rank_k + lb.rank_v;
  }
  std::printf("coefficients per token and KV head, mean over layers: %.1f of %d (%.2fx)\n",
              static_cast<double>(coeffs) / c.n_layers, 2 * c.head_dim,
              2.0 * c.head_dim * c.n_layers / static_cast<double>(coeffs));
  std::printf("forward %.2f s, bases %.3f s; wrote %s\n", forward_s, basis_s, out.c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace subspace

int main(int argc, char** argv) {
  subspace::cli::ParseFlags(
      argc, argv,
      "subspace-calibrate --model M.gguf [--text FILE_OR_DIR] --out bases.gguf "
      "[--method-k kqsvd|ksvd|eigen] [--method-v kqsvd|ksvd] (--rank R | --energy E | "
      "--kv-budget BITS [--codec-post-rope] [--codec-joint] [--codec-weighted]) "
      "[--max-tokens N] [--window 512]");
  absl::Status status = subspace::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "subspace-calibrate: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
