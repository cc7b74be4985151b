// Tokenizer read from GGUF metadata. `tokenizer.ggml.model = llama`: SentencePiece-style BPE
// that merges by piece score, with byte fallback (<0xHH>), the dummy-prefix space and
// special/control tokens. Decoding is byte-exact; StreamDecoder never emits a partial UTF-8
// code point.
#ifndef SUBSPACE_CORE_TOKENIZER_H_
#define SUBSPACE_CORE_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "core/gguf.h"

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
  bool add_bos = true;
  // Recognise control/user-defined token texts (e.g. "<s>") inside the input as single tokens.
  bool parse_special = false;
};

class Tokenizer {
 public:
  // INVALID_ARGUMENT when the metadata is missing, inconsistent or of an unsupported model.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& file);

  std::vector<int32_t> Encode(std::string_view text, const EncodeOptions& options = {}) const;

  // The bytes a token stands for: "▁" becomes " ", <0xHH> becomes that byte, control tokens
  // become "" (they are not text). Out-of-range ids become "".
  std::string TokenToBytes(int32_t id) const;
  // Concatenated bytes of `ids`; drops the leading space the dummy prefix added when
  // `strip_leading_space` (the first text token after BOS / at the start).
  std::string Decode(std::span<const int32_t> ids, bool strip_leading_space = true) const;

  int32_t vocab_size() const { return static_cast<int32_t>(pieces_.size()); }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  int32_t unk_id() const { return unk_id_; }
  bool add_bos() const { return add_bos_; }
  bool add_space_prefix() const { return add_space_prefix_; }
  const std::string& model_name() const { return model_name_; }
  const std::string& piece(int32_t id) const { return pieces_[id]; }
  TokenType type(int32_t id) const { return types_[id]; }
  bool IsControl(int32_t id) const;
  // End of generation: EOS (and EOT where present).
  bool IsEndOfGeneration(int32_t id) const;

 private:
  Tokenizer() = default;
  void EncodeSegment(std::string_view text, std::vector<int32_t>* out) const;

  std::string model_name_;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<TokenType> types_;
  std::unordered_map<std::string, int32_t> piece_to_id_;
  int32_t byte_to_id_[256];
  std::vector<int32_t> special_ids_;  // control/user-defined tokens, longest text first
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  int32_t eot_id_ = -1;
  int32_t unk_id_ = -1;
  bool add_bos_ = true;
  bool add_space_prefix_ = true;
};

// Turns a stream of token ids into text pieces that are always whole UTF-8 code points:
// bytes of an incomplete code point are held back until the next token completes it.
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
  bool emitted_any_ = false;
  std::string pending_;
};

}  // namespace subspace

#endif  // SUBSPACE_CORE_TOKENIZER_H_
