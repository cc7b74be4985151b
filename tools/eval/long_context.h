// The long-context evaluation (subspace-longctx): items of a suite written by
// tools/train/longctx_suite.py -- pass keys and key-value lists to retrieve, passages that recur
// far apart, plain text -- run through a KV cache in prefill chunks (so a compressed cache codes
// blocks between chunks, as in serving) and scored at their predicted tokens: exact match of a
// retrieval's answer (every answer token the argmax under teacher forcing: what greedy decoding
// would produce), negative log-likelihood, and against a reference run (the full cache) the KL
// divergence of the next-token distributions and top-1 agreement.
#ifndef SUBSPACE_TOOLS_EVAL_LONG_CONTEXT_H_
#define SUBSPACE_TOOLS_EVAL_LONG_CONTEXT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/kvcache/kv_cache.h"
#include "core/model/model.h"
#include "core/tokenizer/tokenizer.h"

namespace subspace::eval {

struct LongContextItem {
  std::string kind;             // passkey_filler, passkey_natural, kv, recurrence,
                                // continuation, plain
  int64_t length = 0;           // the suite's nominal length in tokens (of the suite's tokenizer)
  double depth = -1.0;          // retrieval: where the answer sits, 0 (start) .. 1 (end)
  int64_t distance = 0;         // recurrence: tokens between the passage's two occurrences
  std::vector<int32_t> tokens;  // BOS + the text (a retrieval's answer included)
  int64_t scored_from = 1;      // tokens[scored_from ..] are predicted and scored
  bool retrieval() const {
    return kind == "passkey_filler" || kind == "passkey_natural" || kind == "kv";
  }
};

// One line of the suite (JSON), tokenized with `tokenizer` (BOS first). INVALID_ARGUMENT for a
// line that is not a suite item or does not fit `context` tokens.
absl::StatusOr<LongContextItem> ParseSuiteLine(std::string_view line, const Tokenizer& tokenizer,
                                               int64_t context);

struct ItemRun {
  std::vector<float> logprobs;  // [scored, vocab] log-softmax of the predictions
  std::vector<int32_t> argmax;  // [scored]
  int64_t bytes_used = 0;       // the cache's bytes in use after the last chunk
};

// Runs `item` through `cache` (a fresh sequence, freed at the end) in chunks of `chunk` tokens.
absl::StatusOr<ItemRun> RunItem(LlamaModel& model, KvCache& cache, const LongContextItem& item,
                                int chunk);

struct ItemScore {
  bool exact = false;  // every scored token is the argmax
  double nll = 0.0;    // summed over the scored tokens
  int64_t scored = 0;
  double kld = 0.0;        // summed KL(reference || run) over the scored positions
  int64_t top1_agree = 0;  // positions whose argmax equals the reference's
  int64_t correct = 0;     // positions whose argmax is the text's next token
};
// `reference` may be null (then kld = 0 and top1_agree = scored).
ItemScore ScoreItem(const LongContextItem& item, const ItemRun& run, const ItemRun* reference,
                    int n_vocab);

}  // namespace subspace::eval

#endif  // SUBSPACE_TOOLS_EVAL_LONG_CONTEXT_H_
