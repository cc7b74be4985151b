// Pre-tokenizers of byte-level BPE vocabularies: the split patterns that `tokenizer.ggml.pre`
// names, applied in sequence as HF tokenizers' Sequence of Split(behavior="isolated") does:
// each pattern cuts every piece left by the previous ones into its matches and the stretches
// between them. The patterns are the ones published in the models' tokenizer.json files;
// tests hold the splits to python3-regex running the same patterns.
#ifndef SUBSPACE_CORE_TOKENIZER_PRETOKENIZER_H_
#define SUBSPACE_CORE_TOKENIZER_PRETOKENIZER_H_

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tokenizer/split_regex.h"

namespace subspace {

// A byte range of the text.
struct ByteSpan {
  size_t offset;
  size_t length;
};

class Pretokenizer {
 public:
  // INVALID_ARGUMENT naming `name` when no pre-tokenizer of that name is known.
  static absl::StatusOr<Pretokenizer> ForName(std::string_view name);
  // Every name ForName accepts.
  static std::vector<std::string> Names();

  // The words of `text` in order; they tile the text (invalid UTF-8 bytes included: each is a
  // unit of its own that patterns see as U+FFFD).
  std::vector<ByteSpan> Split(std::string_view text) const;

  const std::string& name() const { return name_; }
  // llama.cpp's and HF's `ignore_merges`: a word that is itself a vocabulary token is emitted
  // whole, without running the merges (Llama 3, Tekken).
  bool ignore_merges() const { return ignore_merges_; }
  // Whether these models add BOS when the GGUF does not say (llama.cpp's defaults).
  bool add_bos_by_default() const { return add_bos_by_default_; }
  const std::vector<SplitRegex>& patterns() const { return patterns_; }

 private:
  Pretokenizer() = default;

  std::string name_;
  std::vector<SplitRegex> patterns_;
  bool ignore_merges_ = false;
  bool add_bos_by_default_ = false;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_TOKENIZER_PRETOKENIZER_H_
