// Tokenizer read from GGUF metadata. `tokenizer.ggml.model = llama`: SentencePiece-style BPE
// that merges by piece score, with byte fallback (<0xHH>) and the dummy-prefix space;
// `tokenizer.ggml.model = gpt2`: byte-level BPE with ranked merges after the pre-tokenizer that
// `tokenizer.ggml.pre` names (bpe.h, pretokenizer.h). Both cut special/control tokens out first.
// Decoding is byte-exact; StreamDecoder never emits a partial UTF-8 code point.
#ifndef SUBSPACE_CORE_TOKENIZER_TOKENIZER_H_
#define SUBSPACE_CORE_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "core/gguf/gguf.h"
#include "core/tokenizer/bpe.h"
#include "core/tokenizer/pretokenizer.h"

namespace subspace {

// Token types as stored in tokenizer.ggml.token_type.
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

struct EncodeOptions {
  // Prepend BOS (when the vocabulary has one). Pass Tokenizer::add_bos() to follow the model's
  // own tokenizer.ggml.add_bos_token instead.
  bool add_bos = true;
  // Append EOS (when the vocabulary has one); Tokenizer::add_eos() is the model's own choice.
  bool add_eos = false;
  // Recognise control/unknown token texts (e.g. "<s>") inside the input as single tokens.
  // User-defined tokens are always recognised, as in llama.cpp and HF tokenizers. Like
  // llama.cpp, the text right after a special token gets the dummy-prefix space again.
  bool parse_special = false;
};

class Tokenizer {
 public:
  // INVALID_ARGUMENT when the metadata is missing, inconsistent or of an unsupported model.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& file);

  std::vector<int32_t> Encode(std::string_view text, const EncodeOptions& options = {}) const;

  // The bytes a token stands for: "▁" becomes " " (SentencePiece), the byte-level spelling
  // is undone (gpt2), <0xHH> becomes that byte, user-defined tokens are their text verbatim;
  // control, unknown and unused tokens become "" (llama.cpp's token_to_piece with
  // special=false). Out-of-range ids become "".
  const std::string& TokenToBytes(int32_t id) const;
  // Concatenated bytes of `ids`; drops the leading space the dummy prefix added when
  // `strip_leading_space` and the model uses a space prefix (the first token that yields any
  // bytes, so a leading BOS does not use it up -- unlike llama.cpp's detokenize, which keeps
  // the space after a BOS). Byte fallback makes Decode(Encode(text)) == text for any bytes
  // without a literal "▁" (U+2581, which decodes as a space) when parse_special is off.
  std::string Decode(std::span<const int32_t> ids, bool strip_leading_space = true) const;

  int32_t vocab_size() const { return static_cast<int32_t>(pieces_.size()); }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  int32_t unk_id() const { return unk_id_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  bool add_space_prefix() const { return add_space_prefix_; }
  // "llama" or "gpt2" (tokenizer.ggml.model).
  const std::string& model_name() const { return model_name_; }
  // The pre-tokenizer's name for gpt2 vocabularies ("default" when the file names none), ""
  // for SentencePiece.
  std::string pre_name() const { return pretokenizer_ ? pretokenizer_->name() : ""; }
  const std::string& piece(int32_t id) const { return pieces_[id]; }
  TokenType type(int32_t id) const { return types_[id]; }
  bool IsControl(int32_t id) const;
  // End of generation: EOS, EOT and EOM where present, and tokens whose text marks the end of
  // a turn in the common chat formats (<|eot_id|>, <|im_end|>, <|end|>, <end_of_turn>,
  // <|endoftext|>, <|eom_id|>, <EOT>), as llama.cpp decides it.
  bool IsEndOfGeneration(int32_t id) const;
  const std::vector<int32_t>& end_of_generation_ids() const { return eog_ids_; }

 private:
  Tokenizer() = default;
  void EncodeText(std::string_view text, bool parse_special, std::vector<int32_t>* out) const;
  std::string ComputeTokenBytes(int32_t id) const;
  // One stretch of text free of special tokens.
  void EncodeSegment(std::string_view text, bool add_space_prefix, std::vector<int32_t>* out) const;
  // SentencePiece BPE (merges by piece score).
  void EncodeSentencePiece(std::string_view text, bool add_space_prefix,
                           std::vector<int32_t>* out) const;
  int32_t LookupPiece(std::string_view piece) const;

  std::string model_name_;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<TokenType> types_;
  std::vector<std::string> token_bytes_;                   // TokenToBytes of every id
  absl::flat_hash_map<std::string, int32_t> piece_to_id_;  // string_view lookups, no copies
  int32_t byte_to_id_[256] = {};      // <0xHH> token (or the 1-byte piece) per byte; -1 if none
  std::vector<int32_t> special_ids_;  // control/user-defined/unknown tokens, longest text first
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t eot_id_ = -1;
  int32_t unk_id_ = -1;
  int32_t eom_id_ = -1;
  std::vector<int32_t> eog_ids_;  // sorted
  bool add_bos_ = true;
  bool add_eos_ = false;
  bool add_space_prefix_ = true;
  // gpt2 only.
  std::optional<Pretokenizer> pretokenizer_;
  std::optional<ByteLevelBpe> bpe_;
};

// Turns a stream of token ids into text pieces that are always whole UTF-8 code points:
// bytes of an incomplete code point are held back until the next token completes it, and bytes
// that no later token can make valid come out as U+FFFD. For ids that decode to valid UTF-8,
// the Push outputs plus Flush() equal Tokenizer::Decode of all ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool strip_leading_space = true)
      : tokenizer_(tokenizer), strip_leading_space_(strip_leading_space) {}

  // Returns the newly completed text (possibly empty).
  std::string Push(int32_t id);
  // Returns whatever is held back; invalid trailing bytes become U+FFFD.
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  bool strip_leading_space_;
  bool emitted_any_ = false;  // a token with bytes was seen, so no more space stripping
  std::string pending_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_TOKENIZER_TOKENIZER_H_
