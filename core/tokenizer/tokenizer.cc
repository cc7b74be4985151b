// Tokenizers built from GGUF metadata. SentencePiece encoding reproduces llama.cpp's
// llm_tokenizer_spm and byte-level BPE its llm_tokenizer_bpe token for token (the fixture tests
// hold both to llama.cpp's vocab test vectors); decoding is byte-exact and the stream decoder
// only ever emits whole UTF-8 code points.
#include "core/tokenizer/tokenizer.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <queue>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace subspace {
namespace {

constexpr std::string_view kSpaceMarker = "\xe2\x96\x81";  // U+2581, SentencePiece's space
constexpr std::string_view kReplacement = "\xef\xbf\xbd";  // U+FFFD
constexpr std::string_view kModelKey = "tokenizer.ggml.model";
constexpr std::string_view kTokensKey = "tokenizer.ggml.tokens";
constexpr std::string_view kScoresKey = "tokenizer.ggml.scores";
constexpr std::string_view kTypesKey = "tokenizer.ggml.token_type";
constexpr std::string_view kMergesKey = "tokenizer.ggml.merges";
constexpr std::string_view kPreKey = "tokenizer.ggml.pre";

// Token texts that end a turn in the common chat formats; llama.cpp treats them as
// end-of-generation (and as control tokens) whatever the metadata says.
constexpr std::string_view kEndOfGenerationTexts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>"};

// The system Abseil is built with its own absl::string_view (ABSL_OPTION_USE_STD_STRING_VIEW
// is 0), which does not convert from std::string_view.
absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status Invalid(std::string_view key, const absl::Status& status) {
  return absl::InvalidArgumentError(absl::StrCat(AsAbsl(key), ": ", status.message()));
}

// Reads an optional token id. Absent keys take `fallback` (llama.cpp's SPM defaults) when it is
// in range; -1 (or its uint32 spelling) means "no such token".
absl::Status ReadTokenId(const GgufFile& file, std::string_view key, int64_t fallback,
                         int64_t vocab_size, int32_t* id) {
  absl::StatusOr<int64_t> value = file.GetInt(key);
  if (absl::IsNotFound(value.status())) {
    *id = fallback < vocab_size ? static_cast<int32_t>(fallback) : -1;
    return absl::OkStatus();
  }
  if (!value.ok()) return Invalid(key, value.status());
  if (*value == -1 || *value == 0xFFFFFFFFll) {
    *id = -1;
    return absl::OkStatus();
  }
  if (*value < 0 || *value >= vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(AsAbsl(key), " = ", *value,
                                                   " is out of range for a vocabulary of ",
                                                   vocab_size, " tokens"));
  }
  *id = static_cast<int32_t>(*value);
  return absl::OkStatus();
}

absl::Status ReadFlag(const GgufFile& file, std::string_view key, bool fallback, bool* flag) {
  absl::StatusOr<bool> value = file.GetBool(key);
  if (absl::IsNotFound(value.status())) {
    *flag = fallback;
    return absl::OkStatus();
  }
  if (!value.ok()) return Invalid(key, value.status());
  *flag = *value;
  return absl::OkStatus();
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// The byte of a "<0xHH>" piece, or -1 when the piece has another shape.
int ParseBytePiece(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
  const int hi = HexDigit(piece[3]);
  const int lo = HexDigit(piece[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

bool IsContinuation(uint8_t byte) { return (byte & 0xC0) == 0x80; }

// Bytes of the character starting at text[pos] for the merge symbols. The lead byte's high bits
// give the length, as in llama.cpp's unicode_len_utf8; unlike llama.cpp, a sequence whose
// continuation bytes are missing or wrong is split into single-byte symbols, so one stray lead
// byte cannot swallow the ASCII characters after it into byte tokens.
size_t SymbolLength(std::string_view text, size_t pos) {
  const auto lead = static_cast<uint8_t>(text[pos]);
  size_t length = 1;
  if (lead >= 0xF0) {
    length = 4;
  } else if (lead >= 0xE0) {
    length = 3;
  } else if (lead >= 0xC0) {
    length = 2;
  }
  if (pos + length > text.size()) return 1;
  for (size_t k = 1; k < length; ++k) {
    if (!IsContinuation(static_cast<uint8_t>(text[pos + k]))) return 1;
  }
  return length;
}

enum class Utf8Scan { kComplete, kIncomplete, kInvalid };

// Strict UTF-8 (Unicode table 3-7) at text[pos]: a complete code point, a valid but unfinished
// prefix (`*length` bytes, all there is), or an invalid maximal subpart of `*length` bytes that
// no later byte can repair.
Utf8Scan ScanCodePoint(std::string_view text, size_t pos, size_t* length) {
  const auto lead = static_cast<uint8_t>(text[pos]);
  size_t need = 0;
  uint8_t lo = 0x80;  // range of the first continuation byte
  uint8_t hi = 0xBF;
  if (lead < 0x80) {
    *length = 1;
    return Utf8Scan::kComplete;
  } else if (lead >= 0xC2 && lead <= 0xDF) {
    need = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 3;
    if (lead == 0xE0) lo = 0xA0;  // no overlong forms
    if (lead == 0xED) hi = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 4;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    *length = 1;
    return Utf8Scan::kInvalid;
  }
  for (size_t k = 1; k < need; ++k) {
    if (pos + k >= text.size()) {
      *length = k;
      return Utf8Scan::kIncomplete;
    }
    const auto byte = static_cast<uint8_t>(text[pos + k]);
    const bool ok = k == 1 ? (byte >= lo && byte <= hi) : IsContinuation(byte);
    if (!ok) {
      *length = k;
      return Utf8Scan::kInvalid;
    }
  }
  *length = need;
  return Utf8Scan::kComplete;
}

// Moves the complete code points at the front of `pending` into the result; invalid bytes
// become U+FFFD. An unfinished trailing sequence stays in `pending` unless `at_end`.
std::string DrainUtf8(std::string* pending, bool at_end) {
  std::string out;
  size_t pos = 0;
  while (pos < pending->size()) {
    size_t length = 0;
    const Utf8Scan scan = ScanCodePoint(*pending, pos, &length);
    if (scan == Utf8Scan::kComplete) {
      out.append(*pending, pos, length);
    } else if (scan == Utf8Scan::kInvalid || at_end) {
      out.append(kReplacement);
    } else {
      break;
    }
    pos += length;
  }
  pending->erase(0, pos);
  return out;
}

// A run of bytes of the escaped text that merges act on; a linked list so a merge is O(1).
struct Symbol {
  ptrdiff_t prev;
  ptrdiff_t next;
  size_t offset;
  size_t length;  // 0 once merged into its left neighbour
  int32_t id;     // vocab id when formed by a merge (always a vocab piece), else -1
};

struct Bigram {
  float score;
  ptrdiff_t left;
  ptrdiff_t right;
  size_t length;  // of the pair when queued: a mismatch later marks the entry stale
  int32_t id;
};

// Highest score first; on ties the leftmost pair, as in llama.cpp.
struct BigramOrder {
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& file) {
  auto tok = absl::WrapUnique(new Tokenizer());

  absl::StatusOr<std::string> model = file.GetString(kModelKey);
  if (!model.ok()) return Invalid(kModelKey, model.status());
  if (*model != "llama" && *model != "gpt2") {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.ggml.model: unsupported tokenizer model '", *model,
                     "': 'llama' (SentencePiece BPE) and 'gpt2' (byte-level BPE) are implemented"));
  }
  tok->model_name_ = *model;
  const bool spm = *model == "llama";
  if (!spm) {
    absl::StatusOr<std::string> pre = file.GetString(kPreKey);
    if (absl::IsNotFound(pre.status())) {
      pre = std::string("default");  // llama.cpp's choice for files that name none
    } else if (!pre.ok()) {
      return Invalid(kPreKey, pre.status());
    }
    absl::StatusOr<Pretokenizer> pretokenizer = Pretokenizer::ForName(*pre);
    if (!pretokenizer.ok()) return pretokenizer.status();
    tok->pretokenizer_ = *std::move(pretokenizer);
  }

  absl::StatusOr<std::vector<std::string>> pieces = file.GetStringArray(kTokensKey);
  if (!pieces.ok()) return Invalid(kTokensKey, pieces.status());
  if (pieces->empty()) return absl::InvalidArgumentError("tokenizer.ggml.tokens is empty");
  if (pieces->size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError("tokenizer.ggml.tokens has more entries than int32 ids");
  }
  tok->pieces_ = *std::move(pieces);
  const size_t n = tok->pieces_.size();

  // Scores and types are optional in llama.cpp too (0.0 and NORMAL); present, they must match.
  absl::StatusOr<std::vector<float>> scores = file.GetFloatArray(kScoresKey);
  if (absl::IsNotFound(scores.status())) {
    tok->scores_.assign(n, 0.0f);
  } else if (!scores.ok()) {
    return Invalid(kScoresKey, scores.status());
  } else {
    tok->scores_ = *std::move(scores);
  }
  if (tok->scores_.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer.ggml.scores has ", tok->scores_.size(), " entries for ", n, " tokens"));
  }
  for (size_t i = 0; i < n; ++i) {
    // NaN would break the merge queue's ordering.
    if (std::isnan(tok->scores_[i])) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.scores[", i, "] is NaN"));
    }
  }

  absl::StatusOr<std::vector<int64_t>> types = file.GetIntArray(kTypesKey);
  if (absl::IsNotFound(types.status())) {
    tok->types_.assign(n, TokenType::kNormal);
  } else if (!types.ok()) {
    return Invalid(kTypesKey, types.status());
  } else {
    if (types->size() != n) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.token_type has ",
                                                     types->size(), " entries for ", n, " tokens"));
    }
    tok->types_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t t = (*types)[i];
      if (t < 0 || t > static_cast<int64_t>(TokenType::kByte)) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer.ggml.token_type[", i, "] = ", t, " is not a token type"));
      }
      tok->types_.push_back(static_cast<TokenType>(t));
    }
  }

  const auto vocab = static_cast<int64_t>(n);
  // Absent ids take llama.cpp's SentencePiece defaults; a gpt2 vocabulary has no such
  // convention (llama.cpp's 11 is a leftover), so there an absent id means none.
  absl::Status status =
      ReadTokenId(file, "tokenizer.ggml.bos_token_id", spm ? 1 : -1, vocab, &tok->bos_id_);
  if (status.ok()) {
    status = ReadTokenId(file, "tokenizer.ggml.eos_token_id", spm ? 2 : -1, vocab, &tok->eos_id_);
  }
  if (status.ok()) {
    status =
        ReadTokenId(file, "tokenizer.ggml.unknown_token_id", spm ? 0 : -1, vocab, &tok->unk_id_);
  }
  if (status.ok()) {
    status = ReadTokenId(file, "tokenizer.ggml.eot_token_id", -1, vocab, &tok->eot_id_);
  }
  if (status.ok()) {
    status = ReadTokenId(file, "tokenizer.ggml.eom_token_id", -1, vocab, &tok->eom_id_);
  }
  if (status.ok()) {
    // A family's default asks for BOS only where the vocabulary has one; the key itself must.
    const bool bos_default = spm || (tok->pretokenizer_->add_bos_by_default() && tok->bos_id_ >= 0);
    status = ReadFlag(file, "tokenizer.ggml.add_bos_token", bos_default, &tok->add_bos_);
  }
  if (status.ok()) status = ReadFlag(file, "tokenizer.ggml.add_eos_token", false, &tok->add_eos_);
  if (status.ok()) {
    status = ReadFlag(file, "tokenizer.ggml.add_space_prefix", true, &tok->add_space_prefix_);
  }
  if (!status.ok()) return status;
  // Only SentencePiece adds the dummy prefix (llama.cpp reads the key for every model but its
  // BPE tokenizer ignores it).
  if (!spm) tok->add_space_prefix_ = false;
  if (tok->add_bos_ && tok->bos_id_ < 0) {
    return absl::InvalidArgumentError("tokenizer.ggml.add_bos_token is set but there is no BOS");
  }
  if (tok->add_eos_ && tok->eos_id_ < 0) {
    return absl::InvalidArgumentError("tokenizer.ggml.add_eos_token is set but there is no EOS");
  }

  // Later duplicates win, as in llama.cpp's token_to_id.
  tok->piece_to_id_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    tok->piece_to_id_.insert_or_assign(tok->pieces_[i], static_cast<int32_t>(i));
    if (tok->types_[i] == TokenType::kByte && ParseBytePiece(tok->pieces_[i]) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("byte token ", i, " is '", tok->pieces_[i], "', not <0xHH>"));
    }
  }
  for (int b = 0; b < 256; ++b) {
    int32_t id = tok->LookupPiece(absl::StrFormat("<0x%02X>", b));
    if (id < 0) id = tok->LookupPiece(std::string(1, static_cast<char>(b)));
    tok->byte_to_id_[b] = id;
  }
  for (std::string_view text : kEndOfGenerationTexts) {
    const int32_t id = tok->LookupPiece(text);
    if (id < 0) continue;
    tok->eog_ids_.push_back(id);
    tok->types_[id] = TokenType::kControl;
  }
  for (int32_t id : {tok->eos_id_, tok->eot_id_, tok->eom_id_}) {
    if (id >= 0) tok->eog_ids_.push_back(id);
  }
  std::sort(tok->eog_ids_.begin(), tok->eog_ids_.end());
  tok->eog_ids_.erase(std::unique(tok->eog_ids_.begin(), tok->eog_ids_.end()), tok->eog_ids_.end());

  if (!spm) {
    absl::StatusOr<std::vector<std::string>> merges = file.GetStringArray(kMergesKey);
    if (absl::IsNotFound(merges.status())) {
      return absl::InvalidArgumentError(
          "tokenizer.ggml.merges is missing: a gpt2 (byte-level BPE) tokenizer needs its merges");
    }
    if (!merges.ok()) return Invalid(kMergesKey, merges.status());
    std::vector<bool> in_model(n);
    for (size_t i = 0; i < n; ++i) {
      in_model[i] =
          tok->types_[i] != TokenType::kUserDefined && tok->types_[i] != TokenType::kControl;
    }
    absl::StatusOr<ByteLevelBpe> bpe = ByteLevelBpe::Build(tok->pieces_, in_model, *merges);
    if (!bpe.ok()) return bpe.status();
    tok->bpe_ = *std::move(bpe);
  }

  tok->token_bytes_.resize(n);
  for (size_t i = 0; i < n; ++i)
    tok->token_bytes_[i] = tok->ComputeTokenBytes(static_cast<int32_t>(i));

  for (size_t i = 0; i < n; ++i) {
    const TokenType t = tok->types_[i];
    if ((t == TokenType::kControl || t == TokenType::kUserDefined || t == TokenType::kUnknown) &&
        !tok->pieces_[i].empty()) {
      tok->special_ids_.push_back(static_cast<int32_t>(i));
    }
  }
  std::stable_sort(tok->special_ids_.begin(), tok->special_ids_.end(), [&](int32_t a, int32_t b) {
    return tok->pieces_[a].size() > tok->pieces_[b].size();
  });
  return tok;
}

int32_t Tokenizer::LookupPiece(std::string_view piece) const {
  auto it = piece_to_id_.find(AsAbsl(piece));
  return it == piece_to_id_.end() ? -1 : it->second;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, const EncodeOptions& options) const {
  std::vector<int32_t> out;
  if (options.add_bos && bos_id_ >= 0) out.push_back(bos_id_);
  EncodeText(text, options.parse_special, &out);
  if (options.add_eos && eos_id_ >= 0) out.push_back(eos_id_);
  return out;
}

void Tokenizer::EncodeText(std::string_view text, bool parse_special,
                           std::vector<int32_t>* out_ids) const {
  std::vector<int32_t>& out = *out_ids;
  if (text.empty()) return;

  // Cut the text around special-token texts the way llama.cpp's tokenizer_st_partition does:
  // longest token text first over the whole input, each occurrence left to right.
  struct Fragment {
    int32_t token;  // -1 for a stretch of text
    size_t offset;
    size_t length;
  };
  std::vector<Fragment> fragments = {{-1, 0, text.size()}};
  std::vector<Fragment> next;
  for (int32_t id : special_ids_) {
    if (!parse_special && types_[id] != TokenType::kUserDefined) continue;
    const std::string& special = pieces_[id];
    if (text.find(special) == std::string_view::npos) continue;
    next.clear();
    for (const Fragment& f : fragments) {
      if (f.token >= 0) {
        next.push_back(f);
        continue;
      }
      const std::string_view chunk = text.substr(f.offset, f.length);
      size_t start = 0;
      for (size_t match = chunk.find(special); match != std::string_view::npos;
           match = chunk.find(special, start)) {
        if (match > start) next.push_back({-1, f.offset + start, match - start});
        next.push_back({id, 0, 0});
        start = match + special.size();
      }
      if (start < chunk.size()) next.push_back({-1, f.offset + start, chunk.size() - start});
    }
    fragments.swap(next);
  }

  // llama.cpp re-adds the dummy prefix to every stretch that follows a special token (and to the
  // first one), which is also what HF's legacy Llama tokenizer does.
  bool after_special = true;
  for (const Fragment& f : fragments) {
    if (f.token >= 0) {
      out.push_back(f.token);
      after_special = true;
    } else {
      EncodeSegment(text.substr(f.offset, f.length), add_space_prefix_ && after_special, &out);
      after_special = false;
    }
  }
}

void Tokenizer::EncodeSegment(std::string_view text, bool add_space_prefix,
                              std::vector<int32_t>* out) const {
  if (!bpe_) {
    EncodeSentencePiece(text, add_space_prefix, out);
    return;
  }
  for (const ByteSpan& word : pretokenizer_->Split(text)) {
    bpe_->EncodeWord(text.substr(word.offset, word.length), pretokenizer_->ignore_merges(), out);
  }
}

void Tokenizer::EncodeSentencePiece(std::string_view raw, bool add_space_prefix,
                                    std::vector<int32_t>* out) const {
  std::string text;
  text.reserve(raw.size() + raw.size() / 2 + kSpaceMarker.size());
  if (add_space_prefix) text.append(kSpaceMarker);
  for (char c : raw) {
    if (c == ' ') {
      text.append(kSpaceMarker);
    } else {
      text.push_back(c);
    }
  }
  if (text.empty()) return;

  std::vector<Symbol> symbols;
  symbols.reserve(text.size());
  for (size_t offset = 0; offset < text.size();) {
    const size_t length = SymbolLength(text, offset);
    const auto index = static_cast<ptrdiff_t>(symbols.size());
    offset += length;
    symbols.push_back(
        {index - 1, offset == text.size() ? -1 : index + 1, offset - length, length, -1});
  }

  std::priority_queue<Bigram, std::vector<Bigram>, BigramOrder> queue;
  auto try_add = [&](ptrdiff_t left, ptrdiff_t right) {
    if (left < 0 || right < 0) return;
    const std::string_view pair(text.data() + symbols[left].offset,
                                symbols[left].length + symbols[right].length);
    const int32_t id = LookupPiece(pair);
    if (id >= 0) queue.push({scores_[id], left, right, pair.size(), id});
  };
  for (size_t i = 1; i < symbols.size(); ++i) {
    try_add(static_cast<ptrdiff_t>(i) - 1, static_cast<ptrdiff_t>(i));
  }

  // Merge the best pair until none is left. An entry is stale when either side was merged
  // since it was queued; the lengths only grow, so comparing them detects that.
  while (!queue.empty()) {
    const Bigram bigram = queue.top();
    queue.pop();
    Symbol& left = symbols[bigram.left];
    Symbol& right = symbols[bigram.right];
    if (left.length == 0 || right.length == 0 || left.length + right.length != bigram.length) {
      continue;
    }
    left.length += right.length;
    left.id = bigram.id;
    right.length = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = bigram.left;
    try_add(left.prev, bigram.left);
    try_add(bigram.left, left.next);
  }

  // Every merged symbol is a vocab piece, so llama.cpp's "resegment" recursion through the merge
  // history never fires for it: only an unmerged character can miss the vocab, and it falls back
  // to byte tokens (or UNK). Symbol 0 is never merged away, so the walk starts there.
  for (ptrdiff_t i = 0; i >= 0; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    const std::string_view piece(text.data() + s.offset, s.length);
    const int32_t id = s.id >= 0 ? s.id : LookupPiece(piece);
    if (id >= 0) {
      out->push_back(id);
      continue;
    }
    for (char c : piece) {
      const int32_t byte_id = byte_to_id_[static_cast<uint8_t>(c)];
      // Without byte tokens or UNK the byte cannot be represented at all and is dropped.
      if (byte_id >= 0) {
        out->push_back(byte_id);
      } else if (unk_id_ >= 0) {
        out->push_back(unk_id_);
      }
    }
  }
}

const std::string& Tokenizer::TokenToBytes(int32_t id) const {
  static const std::string kEmpty;
  return id < 0 || id >= vocab_size() ? kEmpty : token_bytes_[id];
}

std::string Tokenizer::ComputeTokenBytes(int32_t id) const {
  const std::string& piece = pieces_[id];
  switch (types_[id]) {
    case TokenType::kNormal: {
      if (bpe_) return ByteLevelBpe::TextToBytes(piece);
      std::string bytes;
      bytes.reserve(piece.size());
      for (size_t pos = 0; pos < piece.size();) {
        if (piece.compare(pos, kSpaceMarker.size(), kSpaceMarker) == 0) {
          bytes.push_back(' ');
          pos += kSpaceMarker.size();
        } else {
          bytes.push_back(piece[pos++]);
        }
      }
      return bytes;
    }
    case TokenType::kByte:
      return std::string(1, static_cast<char>(ParseBytePiece(piece)));
    case TokenType::kUserDefined:
      return piece;
    default:
      return "";
  }
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool strip_leading_space) const {
  std::string text;
  bool strip = strip_leading_space && add_space_prefix_;
  for (int32_t id : ids) {
    std::string bytes = TokenToBytes(id);
    if (bytes.empty()) continue;
    if (strip && bytes[0] == ' ') bytes.erase(0, 1);
    strip = false;
    text += bytes;
  }
  return text;
}

bool Tokenizer::IsControl(int32_t id) const {
  return id >= 0 && id < vocab_size() && types_[id] == TokenType::kControl;
}

bool Tokenizer::IsEndOfGeneration(int32_t id) const {
  return std::binary_search(eog_ids_.begin(), eog_ids_.end(), id);
}

std::string StreamDecoder::Push(int32_t id) {
  std::string bytes = tokenizer_.TokenToBytes(id);
  if (bytes.empty()) return "";
  // Same rule as Tokenizer::Decode, so the stream concatenates to the same text.
  if (!emitted_any_ && strip_leading_space_ && tokenizer_.add_space_prefix() && bytes[0] == ' ') {
    bytes.erase(0, 1);
  }
  emitted_any_ = true;
  pending_ += bytes;
  return DrainUtf8(&pending_, /*at_end=*/false);
}

std::string StreamDecoder::Flush() { return DrainUtf8(&pending_, /*at_end=*/true); }

}  // namespace subspace
