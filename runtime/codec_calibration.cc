#include "runtime/codec_calibration.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/int_math.h"
#include "core/kvcache/paged_kv_cache.h"
#include "core/model/model_runner.h"
#include "core/model/sampler.h"

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

absl::StatusOr<std::vector<int32_t>> SampleCalibrationTokens(LlamaModel& model, int32_t bos,
                                                             int32_t eos, int64_t n_tokens,
                                                             int window, uint64_t seed) {
  const ModelConfig& c = model.config();
  const int length = std::min(window, c.context_length - 1);  // sampled tokens per stream
  if (n_tokens < 1 || length < 1 || bos < 0 || bos >= c.n_vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling calibration text needs tokens >= 1, a window >= 1 and a BOS token; got ",
        n_tokens, ", ", length, " and ", bos));
  }
  constexpr int kStreams = 16;
  constexpr int kBlock = 16;
  PagedKvCache::Config pc;
  pc.geometry = c.cache_geometry();
  pc.block_size = kBlock;
  pc.capacity_bytes = int64_t{c.n_layers} * kStreams *
                      CeilDiv(int64_t{length} + 1, int64_t{kBlock}) *
                      PagedKvCache::BlockBytes(pc.geometry, kBlock);
  absl::StatusOr<std::unique_ptr<PagedKvCache>> cache = PagedKvCache::Create(pc);
  if (!cache.ok()) return cache.status();

  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n_tokens));
  std::vector<float> logits;
  uint64_t stream_index = 0;
  while (static_cast<int64_t>(out.size()) < n_tokens) {
    const int64_t left = n_tokens - static_cast<int64_t>(out.size());
    const int streams =
        static_cast<int>(std::min<int64_t>(kStreams, CeilDiv(left, int64_t{length})));
    std::vector<SeqId> seqs;
    std::vector<Sampler> samplers;
    std::vector<std::vector<int32_t>> text(static_cast<size_t>(streams), {bos});
    for (int i = 0; i < streams; ++i) {
      absl::StatusOr<SeqId> seq = (*cache)->CreateSequence();
      if (!seq.ok()) return seq.status();
      seqs.push_back(*seq);
      samplers.emplace_back(SamplingParams{.temperature = 1.0f, .seed = seed + stream_index++});
    }
    absl::Status st;
    std::vector<SequenceChunk> batch(static_cast<size_t>(streams));
    for (int t = 0; t < length && st.ok(); ++t) {
      for (int i = 0; i < streams && st.ok(); ++i) {
        st = (*cache)->Reserve(seqs[static_cast<size_t>(i)], 1);
        const std::vector<int32_t>& s = text[static_cast<size_t>(i)];
        batch[static_cast<size_t>(i)] = {.seq = seqs[static_cast<size_t>(i)],
                                         .pos = t,
                                         .tokens = std::span<const int32_t>(&s.back(), 1)};
      }
      if (st.ok()) st = model.Forward(batch, **cache, &logits);
      for (int i = 0; i < streams && st.ok(); ++i) {
        std::span<float> row(logits.data() + static_cast<size_t>(i) * c.n_vocab,
                             static_cast<size_t>(c.n_vocab));
        if (eos >= 0 && eos < c.n_vocab)
          row[static_cast<size_t>(eos)] = -std::numeric_limits<float>::infinity();
        std::vector<int32_t>& s = text[static_cast<size_t>(i)];
        s.push_back(samplers[static_cast<size_t>(i)].Sample(row, s).token);
      }
    }
    for (SeqId seq : seqs) {
      if (absl::Status f = (*cache)->FreeSequence(seq); st.ok()) st = f;
    }
    if (!st.ok()) return st;
    for (const std::vector<int32_t>& s : text) out.insert(out.end(), s.begin() + 1, s.end());
  }
  out.resize(static_cast<size_t>(n_tokens));
  return out;
}

absl::StatusOr<std::vector<int32_t>> CalibrationTokens(const std::string& path, LlamaModel& model,
                                                       const Tokenizer& tokenizer,
                                                       int64_t max_tokens, int window) {
  if (!path.empty()) return ReadCalibrationTokens(path, tokenizer, max_tokens);
  return SampleCalibrationTokens(model, tokenizer.bos_id(), tokenizer.eos_id(),
                                 max_tokens > 0 ? max_tokens : kDefaultSampledCalibrationTokens,
                                 window, /*seed=*/1);
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
