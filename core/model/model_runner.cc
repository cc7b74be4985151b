// ValidateStep: the checks every backend's Forward makes before it writes anything.
#include "core/model/model_runner.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace subspace {

absl::Status ValidateStep(const ModelConfig& config, std::span<const SequenceChunk> batch,
                          const KvCacheBase& cache, const std::vector<float>* logits,
                          std::vector<SeqId>* seq_scratch, int64_t* total_tokens,
                          int64_t* total_logit_rows) {
  if (logits == nullptr) return absl::InvalidArgumentError("logits output is null");
  if (batch.empty()) return absl::InvalidArgumentError("empty batch");
  const KvCacheGeometry& g = cache.geometry();
  if (g.n_layers != config.n_layers || g.n_kv_heads != config.n_kv_heads ||
      g.head_dim != config.head_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV cache geometry (layers %d, kv heads %d, head_dim %d) does not match the model "
        "(%d, %d, %d)",
        g.n_layers, g.n_kv_heads, g.head_dim, config.n_layers, config.n_kv_heads, config.head_dim));
  }
  int64_t total = 0;
  int64_t logit_rows = 0;
  seq_scratch->clear();
  for (size_t ci = 0; ci < batch.size(); ++ci) {
    const SequenceChunk& ch = batch[ci];
    const int64_t n = static_cast<int64_t>(ch.tokens.size());
    if (n == 0) return absl::InvalidArgumentError(absl::StrFormat("chunk %d is empty", ci));
    for (int64_t i = 0; i < n; ++i) {
      if (ch.tokens[i] < 0 || ch.tokens[i] >= config.n_vocab) {
        return absl::InvalidArgumentError(
            absl::StrFormat("chunk %d (sequence %d): token %d at index %d is outside [0, %d)", ci,
                            ch.seq, ch.tokens[i], i, config.n_vocab));
      }
    }
    const int64_t length = cache.Length(ch.seq);
    if (ch.pos != length) {
      return absl::InvalidArgumentError(
          absl::StrFormat("chunk %d: position %d of sequence %d is not its cached length %d", ci,
                          ch.pos, ch.seq, length));
    }
    if (ch.pos + n > config.context_length) {
      return absl::InvalidArgumentError(
          absl::StrFormat("chunk %d: sequence %d would reach %d tokens, past the context length %d",
                          ci, ch.seq, ch.pos + n, config.context_length));
    }
    if (const int64_t missing = cache.BlocksNeeded(ch.seq, n); missing != 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "chunk %d: sequence %d has not reserved tokens [%d, %d) (%d blocks short)", ci, ch.seq,
          ch.pos, ch.pos + n, missing));
    }
    seq_scratch->push_back(ch.seq);
    total += n;
    logit_rows += ch.all_logits ? n : 1;
  }
  std::sort(seq_scratch->begin(), seq_scratch->end());
  if (auto dup = std::adjacent_find(seq_scratch->begin(), seq_scratch->end());
      dup != seq_scratch->end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sequence %d appears in more than one chunk of the batch", *dup));
  }

  *total_tokens = total;
  *total_logit_rows = logit_rows;
  return absl::OkStatus();
}

}  // namespace subspace

namespace subspace {

absl::Status ModelRunner::ForwardAndSample(std::span<const SequenceChunk> /*batch*/,
                                           KvCacheBase& /*cache*/,
                                           std::span<const RowSampling> /*rows*/,
                                           std::vector<TokenLogprob>* /*sampled*/) {
  return absl::UnimplementedError("this backend returns logits; sample them on the host");
}

absl::Status ModelRunner::ForwardTraced(std::span<const SequenceChunk> /*batch*/,
                                        KvCacheBase& /*cache*/, std::vector<float>* /*logits*/,
                                        OpTrace* /*trace*/) {
  return absl::UnimplementedError(absl::StrCat(device_name(), ": no op trace on this backend"));
}

}  // namespace subspace
