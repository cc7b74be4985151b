#include "runtime/codec_calibration.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"

namespace subspace::runtime {

absl::StatusOr<std::vector<int32_t>> ReadCalibrationTokens(const std::string& path,
                                                           const Tokenizer& tokenizer,
                                                           int64_t max_tokens) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::string> files;
  if (fs::is_regular_file(path, ec)) {
    files.push_back(path);
  } else if (fs::is_directory(path, ec)) {
    for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
      if (e.is_regular_file()) files.push_back(e.path().string());
    }
    if (ec) return absl::InternalError(absl::StrCat("cannot list ", path, ": ", ec.message()));
    std::sort(files.begin(), files.end());  // deterministic order
    if (files.empty()) return absl::NotFoundError(absl::StrCat("no files in ", path));
  } else {
    return absl::NotFoundError(absl::StrCat("no such file: ", path));
  }
  std::vector<int32_t> tokens;
  for (const std::string& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in) return absl::InternalError(absl::StrCat("cannot read ", f));
    const std::vector<int32_t> t = tokenizer.Encode(ss.str(), {.add_bos = false});
    tokens.insert(tokens.end(), t.begin(), t.end());
    if (max_tokens > 0 && static_cast<int64_t>(tokens.size()) >= max_tokens) {
      tokens.resize(static_cast<size_t>(max_tokens));
      break;
    }
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no text to calibrate on in ", path));
  }
  return tokens;
}

absl::StatusOr<CodecFile> FitCodecFile(LlamaModel& model, const GgufFile& model_file,
                                       std::span<const int32_t> tokens,
                                       const TransformFitOptions& fit,
                                       const CalibrationRunOptions& run) {
  absl::StatusOr<KvRows> rows = CollectKvRows(model, tokens, run);
  if (!rows.ok()) return rows.status();
  absl::StatusOr<TransformCodes> codes = FitTransformCodes(*rows, fit);
  if (!codes.ok()) return codes.status();
  return CodecFile{.info = {.key_bits = fit.key_bits,
                            .value_bits = fit.value_bits,
                            .pre_rope_keys = fit.pre_rope_keys,
                            .attention_weighted = fit.attention_weighted,
                            .joint = fit.joint,
                            .calibration_tokens = static_cast<uint64_t>(rows->tokens),
                            .model_checksum = ModelChecksum(model_file)},
                   .geometry = model.config().cache_geometry(),
                   .keys = *codes->keys,
                   .values = *codes->values};
}

}  // namespace subspace::runtime
