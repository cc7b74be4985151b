// Byte-level BPE (GPT-2 style, `tokenizer.ggml.model = gpt2`): the bytes of a pre-tokenized
// word are spelled with GPT-2's byte-to-character table, then the ranked merges of
// `tokenizer.ggml.merges` are applied, lowest rank first and leftmost on ties, as llama.cpp and
// HF tokenizers do. A symbol that ends up outside the vocabulary falls back to one token per
// byte.
#ifndef SUBSPACE_CORE_TOKENIZER_BPE_H_
#define SUBSPACE_CORE_TOKENIZER_BPE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace subspace {

class ByteLevelBpe {
 public:
  // `pieces` are all token texts; `in_model[id]` says which belong to the BPE model itself
  // (GGUF lists added tokens -- user-defined and control -- in the same array). Merges and
  // byte spellings resolve to model tokens only, as in HF tokenizers, where added tokens are
  // matched in the raw text before BPE: so an added token "ü" (DeepSeek has some) does not
  // shadow the byte-level token spelled "ü" (byte 0xFC). Later duplicates win, as in
  // llama.cpp. INVALID_ARGUMENT naming the entry when a merge is not two texts and a space.
  static absl::StatusOr<ByteLevelBpe> Build(const std::vector<std::string>& pieces,
                                            const std::vector<bool>& in_model,
                                            const std::vector<std::string>& merges);

  // Appends the ids of one word (raw bytes). With `ignore_merges`, a word whose spelling is a
  // token comes out as that token.
  void EncodeWord(std::string_view word, bool ignore_merges, std::vector<int32_t>* out) const;

  // The bytes a byte-level token text stands for; characters outside GPT-2's table (which only
  // added tokens use) are kept as their own UTF-8 bytes.
  static std::string TextToBytes(std::string_view text);
  // The byte-level spelling of raw bytes.
  static std::string BytesToText(std::string_view bytes);

  int32_t merge_count() const { return static_cast<int32_t>(merges_.size()); }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged;  // symbol id of the result
  };
  static uint64_t Key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }

  // Symbol ids are token ids below vocab_size_; texts that merges name but the vocabulary lacks
  // get ids from vocab_size_ up, so merging works on integers and still follows the strings.
  absl::flat_hash_map<std::string, int32_t> model_vocab_;
  int32_t vocab_size_ = 0;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  int32_t byte_symbol_[256] = {};  // symbol of each byte's one-character spelling
  int32_t byte_token_[256] = {};   // its token id, or -1
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_TOKENIZER_BPE_H_
