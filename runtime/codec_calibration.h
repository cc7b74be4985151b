// The transform codec fitted from calibration text, for subspace-calibrate --kv-budget and for
// the server's --kv-budget (a codec fitted at start-up instead of read from --codec): the text
// read and tokenized -- or written by the model itself when there is none -- the model run over
// it, the codes fitted and stamped with the model.
#ifndef SUBSPACE_RUNTIME_CODEC_CALIBRATION_H_
#define SUBSPACE_RUNTIME_CODEC_CALIBRATION_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/compress/basis_file.h"
#include "core/compress/calibration.h"
#include "core/compress/codec_file.h"
#include "core/compress/transform_calibration.h"
#include "core/gguf/gguf.h"
#include "core/model/model.h"
#include "core/tokenizer/tokenizer.h"

namespace subspace::runtime {

// A file, or every regular file of a directory in name order, tokenized without BOS and joined,
// until max_tokens are read (0: all). NOT_FOUND for a missing path or an empty directory;
// INVALID_ARGUMENT when the text holds no token.
absl::StatusOr<std::vector<int32_t>> ReadCalibrationTokens(const std::string& path,
                                                           const Tokenizer& tokenizer,
                                                           int64_t max_tokens);

// Text the model writes itself, for a codec fitted without calibration text: n_tokens tokens
// in streams of up to `window` (and the context) sampled at temperature 1 from BOS, sixteen
// streams at a time, end-of-sequence never drawn. On the long-context suite a codec fitted on
// 20,000 of them scores as one fitted on held-out text (docs/transform_codec.md). The same seed
// gives the same tokens. INVALID_ARGUMENT for n_tokens < 1, a window < 1 or no BOS.
absl::StatusOr<std::vector<int32_t>> SampleCalibrationTokens(LlamaModel& model, int32_t bos,
                                                             int32_t eos, int64_t n_tokens,
                                                             int window, uint64_t seed);

// The calibration text of a codec fit: `path`'s (ReadCalibrationTokens, at most max_tokens; 0:
// all of it) or, with no path, the model's own (SampleCalibrationTokens: max_tokens, or
// kDefaultSampledCalibrationTokens when 0, in streams of `window`, seed 1). The one choice the
// server's --kv-budget and subspace-calibrate both make.
inline constexpr int64_t kDefaultSampledCalibrationTokens = 20000;
absl::StatusOr<std::vector<int32_t>> CalibrationTokens(const std::string& path, LlamaModel& model,
                                                       const Tokenizer& tokenizer,
                                                       int64_t max_tokens, int window);

// Runs `model` over `tokens` (CollectKvRows), fits the codes (FitTransformCodes) and returns
// them as a codec file for `model_file` (its geometry and checksum).
absl::StatusOr<CodecFile> FitCodecFile(LlamaModel& model, const GgufFile& model_file,
                                       std::span<const int32_t> tokens,
                                       const TransformFitOptions& fit,
                                       const CalibrationRunOptions& run);

}  // namespace subspace::runtime

#endif  // SUBSPACE_RUNTIME_CODEC_CALIBRATION_H_
