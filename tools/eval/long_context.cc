#include "tools/eval/long_context.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace subspace::eval {
namespace {

const google::protobuf::Value* Field(const google::protobuf::Struct& s, const char* name) {
  const auto it = s.fields().find(name);
  return it == s.fields().end() ? nullptr : &it->second;
}

}  // namespace

absl::StatusOr<LongContextItem> ParseSuiteLine(std::string_view line, const Tokenizer& tokenizer,
                                               int64_t context) {
  google::protobuf::Struct s;
  if (!google::protobuf::util::JsonStringToMessage(std::string(line), &s).ok()) {
    return absl::InvalidArgumentError("suite line is not a JSON object");
  }
  const google::protobuf::Value* kind = Field(s, "kind");
  if (kind == nullptr || !kind->has_string_value()) {
    return absl::InvalidArgumentError("suite line without a \"kind\"");
  }
  LongContextItem item;
  item.kind = kind->string_value();
  auto number = [&](const char* name, double fallback) {
    const google::protobuf::Value* v = Field(s, name);
    return v != nullptr && v->has_number_value() ? v->number_value() : fallback;
  };
  auto text = [&](const char* name) -> absl::StatusOr<std::string> {
    const google::protobuf::Value* v = Field(s, name);
    if (v == nullptr || !v->has_string_value()) {
      return absl::InvalidArgumentError(absl::StrCat(item.kind, " item without \"", name, "\""));
    }
    return v->string_value();
  };
  item.length = static_cast<int64_t>(number("length", 0));
  item.depth = number("depth", -1.0);
  item.distance = static_cast<int64_t>(number("distance", 0));
  const EncodeOptions with_bos{.add_bos = true};
  if (item.retrieval()) {
    absl::StatusOr<std::string> prompt = text("prompt"), answer = text("answer");
    if (!prompt.ok()) return prompt.status();
    if (!answer.ok()) return answer.status();
    // The answer's tokens as they follow the prompt: the whole text tokenized, scored past the
    // prompt's own tokens (SentencePiece pieces never cross the space that starts the answer).
    const std::vector<int32_t> head = tokenizer.Encode(*prompt, with_bos);
    item.tokens = tokenizer.Encode(*prompt + *answer, with_bos);
    item.scored_from = static_cast<int64_t>(head.size());
    if (!std::equal(head.begin(), head.end(), item.tokens.begin())) {
      return absl::InvalidArgumentError("the prompt's tokens are no prefix of prompt + answer's");
    }
  } else if (item.kind == "recurrence" || item.kind == "continuation" || item.kind == "plain") {
    absl::StatusOr<std::string> body = text("text");
    if (!body.ok()) return body.status();
    item.tokens = tokenizer.Encode(*body, with_bos);
    item.scored_from = 1;
    if (item.kind != "plain") {
      const double from = number("scored_from", -1);
      if (from < 0 || from > static_cast<double>(body->size())) {
        return absl::InvalidArgumentError(
            absl::StrCat(item.kind, " item without a valid \"scored_from\""));
      }
      // body[:from] ends before the space that starts the passage (a trailing space would be
      // a token of its own).
      const std::vector<int32_t> head =
          tokenizer.Encode(body->substr(0, static_cast<size_t>(from)), with_bos);
      if (!std::equal(head.begin(), head.end(), item.tokens.begin())) {
        return absl::InvalidArgumentError("the text before scored_from tokenizes differently");
      }
      item.scored_from = static_cast<int64_t>(head.size());
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown suite item kind \"", item.kind, "\""));
  }
  if (item.scored_from < 1 || item.scored_from >= static_cast<int64_t>(item.tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat(item.kind, " item scores no token"));
  }
  if (static_cast<int64_t>(item.tokens.size()) > context) {
    return absl::InvalidArgumentError(absl::StrCat(item.kind, " item of ", item.tokens.size(),
                                                   " tokens exceeds the context of ", context));
  }
  return item;
}

absl::StatusOr<ItemRun> RunItem(LlamaModel& model, KvCache& cache, const LongContextItem& item,
                                int chunk) {
  if (chunk < 1) return absl::InvalidArgumentError("chunk must be >= 1");
  const int n_vocab = model.config().n_vocab;
  const int64_t len = static_cast<int64_t>(item.tokens.size());
  absl::StatusOr<SeqId> seq = cache.CreateSequence();
  if (!seq.ok()) return seq.status();
  ItemRun run;
  const int64_t scored = len - item.scored_from;
  run.logprobs.resize(static_cast<size_t>(scored * n_vocab));
  run.argmax.resize(static_cast<size_t>(scored));
  std::vector<float> logits;
  absl::Status status;
  for (int64_t pos = 0; pos < len - 1 && status.ok(); pos += chunk) {
    // The last token is never fed: nothing predicts past it.
    const int64_t n = std::min<int64_t>(chunk, len - 1 - pos);
    status = cache.Reserve(*seq, n);
    if (!status.ok()) break;
    SequenceChunk step{*seq, pos, std::span<const int32_t>(item.tokens).subspan(pos, n),
                       /*all_logits=*/true};
    status = model.Forward({&step, 1}, cache, &logits);
    if (!status.ok()) break;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t target = pos + i + 1;  // the token this row predicts
      if (target < item.scored_from) continue;
      const float* row = &logits[static_cast<size_t>(i * n_vocab)];
      float* out = &run.logprobs[static_cast<size_t>((target - item.scored_from) * n_vocab)];
      const float m = *std::max_element(row, row + n_vocab);
      double z = 0.0;
      for (int v = 0; v < n_vocab; ++v) z += std::exp(static_cast<double>(row[v] - m));
      const float lz = m + static_cast<float>(std::log(z));
      for (int v = 0; v < n_vocab; ++v) out[v] = row[v] - lz;
      run.argmax[static_cast<size_t>(target - item.scored_from)] =
          static_cast<int32_t>(std::max_element(row, row + n_vocab) - row);
    }
  }
  if (status.ok()) {
    const KvCacheStats st = cache.Stats();
    run.bytes_used = st.bytes_used_full + st.bytes_used_compressed + st.bytes_used_outlier;
  }
  cache.FreeSequence(*seq).IgnoreError();
  if (!status.ok()) return status;
  return run;
}

ItemScore ScoreItem(const LongContextItem& item, const ItemRun& run, const ItemRun* reference,
                    int n_vocab) {
  ItemScore s;
  s.scored = static_cast<int64_t>(run.argmax.size());
  s.exact = true;
  for (int64_t j = 0; j < s.scored; ++j) {
    const int32_t target = item.tokens[static_cast<size_t>(item.scored_from + j)];
    const float* lp = &run.logprobs[static_cast<size_t>(j * n_vocab)];
    s.nll -= lp[target];
    if (run.argmax[static_cast<size_t>(j)] != target) {
      s.exact = false;
    } else {
      ++s.correct;
    }
    if (reference == nullptr) {
      ++s.top1_agree;
      continue;
    }
    const float* ref = &reference->logprobs[static_cast<size_t>(j * n_vocab)];
    double kl = 0.0;
    for (int v = 0; v < n_vocab; ++v) {
      kl += std::exp(static_cast<double>(ref[v])) * (static_cast<double>(ref[v]) - lp[v]);
    }
    s.kld += std::max(0.0, kl);
    if (run.argmax[static_cast<size_t>(j)] == reference->argmax[static_cast<size_t>(j)]) {
      ++s.top1_agree;
    }
  }
  return s;
}

}  // namespace subspace::eval
