#include "core/tokenizer/bpe.h"

#include <array>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/tokenizer/unicode.h"

namespace subspace {
namespace {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
// (controls, space, DEL, NBSP, soft hyphen) for U+0100.. in byte order.
struct ByteTable {
  std::array<char32_t, 256> to_cp{};
  std::array<std::string, 256> text{};
  std::array<int16_t, 0x144> to_byte{};  // every mapped code point is below U+0144
};

const ByteTable& Bytes() {
  static const ByteTable table = [] {
    ByteTable t;
    t.to_byte.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t.to_cp[b] = printable ? static_cast<char32_t>(b) : next++;
      unicode::AppendUtf8(t.to_cp[b], &t.text[b]);
      t.to_byte[t.to_cp[b]] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return table;
}

absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

struct Symbol {
  int32_t id;  // -1 once merged into its left neighbour
  int32_t prev;
  int32_t next;
  uint32_t begin;  // byte range of the word it spells
  uint32_t end;
};

struct Candidate {
  int32_t rank;
  int32_t left;
  int32_t right;
  int32_t left_id;  // the ids when queued: a mismatch later marks the entry stale
  int32_t right_id;
};

// Lowest rank first; on ties the leftmost pair.
struct CandidateOrder {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  }
};

}  // namespace

absl::StatusOr<ByteLevelBpe> ByteLevelBpe::Build(const std::vector<std::string>& pieces,
                                                 const std::vector<bool>& in_model,
                                                 const std::vector<std::string>& merges) {
  ByteLevelBpe bpe;
  const auto vocab_size = static_cast<int32_t>(pieces.size());
  bpe.vocab_size_ = vocab_size;
  bpe.model_vocab_.reserve(pieces.size());
  for (int32_t id = 0; id < vocab_size; ++id) {
    if (in_model[id]) bpe.model_vocab_.insert_or_assign(pieces[id], id);
  }
  const absl::flat_hash_map<std::string, int32_t>& vocab = bpe.model_vocab_;
  absl::flat_hash_map<std::string, int32_t> extra;
  auto intern = [&](std::string text) {
    auto it = vocab.find(AsAbsl(text));
    if (it != vocab.end()) return it->second;
    const auto next = static_cast<int32_t>(vocab_size + extra.size());
    return extra.try_emplace(std::move(text), next).first->second;
  };
  const ByteTable& bytes = Bytes();
  for (int b = 0; b < 256; ++b) {
    bpe.byte_symbol_[b] = intern(bytes.text[b]);
    bpe.byte_token_[b] = bpe.byte_symbol_[b] < vocab_size ? bpe.byte_symbol_[b] : -1;
  }
  bpe.merges_.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string& m = merges[i];
    // As in llama.cpp: the separator is the first space after the first byte, so a left side
    // may itself start with a space.
    const size_t space = m.size() > 1 ? m.find(' ', 1) : std::string::npos;
    if (space == std::string::npos || space + 1 >= m.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.merges[", i, "] = '", m,
                                                     "' is not two token texts and a space"));
    }
    const int32_t left = intern(m.substr(0, space));
    const int32_t right = intern(m.substr(space + 1));
    const int32_t merged = intern(m.substr(0, space) + m.substr(space + 1));
    // The first occurrence of a pair keeps its rank, as in llama.cpp's bpe_ranks.emplace.
    bpe.merges_.try_emplace(Key(left, right), Merge{static_cast<int32_t>(i), merged});
  }
  return bpe;
}

void ByteLevelBpe::EncodeWord(std::string_view word, bool ignore_merges,
                              std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    auto it = model_vocab_.find(AsAbsl(BytesToText(word)));
    if (it != model_vocab_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  const auto n = static_cast<int32_t>(word.size());
  for (int32_t i = 0; i < n; ++i) {
    symbols.push_back({byte_symbol_[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1,
                       static_cast<uint32_t>(i), static_cast<uint32_t>(i + 1)});
  }
  std::priority_queue<Candidate, std::vector<Candidate>, CandidateOrder> queue;
  auto consider = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    auto it = merges_.find(Key(symbols[left].id, symbols[right].id));
    if (it == merges_.end()) return;
    queue.push({it->second.rank, left, right, symbols[left].id, symbols[right].id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i, i + 1);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = symbols[c.left];
    if (left.id != c.left_id || left.next != c.right || symbols[c.right].id != c.right_id) {
      continue;
    }
    Symbol& right = symbols[c.right];
    left.id = merges_.find(Key(c.left_id, c.right_id))->second.merged;
    left.end = right.end;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = c.left;
    right.id = -1;
    consider(left.prev, c.left);
    consider(c.left, left.next);
  }
  // Symbol 0 is never merged away, so the walk starts there.
  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    if (s.id < vocab_size_) {
      out->push_back(s.id);
      continue;
    }
    // Not a token (a merge result or byte spelling the vocabulary lacks): one token per byte,
    // dropping bytes that have none, as llama.cpp does.
    for (uint32_t b = s.begin; b < s.end; ++b) {
      const int32_t t = byte_token_[static_cast<uint8_t>(word[b])];
      if (t >= 0) out->push_back(t);
    }
  }
}

std::string ByteLevelBpe::TextToBytes(std::string_view text) {
  const ByteTable& bytes = Bytes();
  const std::vector<unicode::CodePoint> cps = unicode::DecodeUtf8(text);
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < cps.size(); ++i) {
    const char32_t cp = cps[i].value;
    if (cp < bytes.to_byte.size() && bytes.to_byte[cp] >= 0) {
      out.push_back(static_cast<char>(bytes.to_byte[cp]));
    } else {
      // Outside the table (added tokens' texts, invalid UTF-8): the bytes as they are.
      const size_t end = i + 1 < cps.size() ? cps[i + 1].offset : text.size();
      out.append(text.substr(cps[i].offset, end - cps[i].offset));
    }
  }
  return out;
}

std::string ByteLevelBpe::BytesToText(std::string_view bytes) {
  const ByteTable& table = Bytes();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char b : bytes) out += table.text[static_cast<uint8_t>(b)];
  return out;
}

}  // namespace subspace
