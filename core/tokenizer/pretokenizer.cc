#include "core/tokenizer/pretokenizer.h"

#include <initializer_list>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/tokenizer/unicode.h"

namespace subspace {
namespace {

struct Spec {
  std::initializer_list<std::string_view> names;
  std::initializer_list<std::string_view> patterns;
  bool ignore_merges;
  bool add_bos;
};

// The split patterns by `tokenizer.ggml.pre` name, as published in each model family's
// tokenizer.json (the names are llama.cpp's, which writes them into GGUF files; "default" is
// what llama.cpp uses when a file names none).
// clang-format off
const Spec kSpecs[] = {
    {{"default"},
     {R"([\p{P}\$\+<=>\^~\|]+)",
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
      R"(\p{N}+)",
      R"([0-9][0-9][0-9])"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"llama3", "llama-v3", "llama-bpe", "falcon3"},
     {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
     /*ignore_merges=*/true, /*add_bos=*/true},
    {{"dbrx", "smaug-bpe", "chatglm-bpe"},
     {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"deepseek-llm"},
     {R"([\r\n])",
      R"(\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+)",
      R"(\s?[!-/:-~！-／：-～‘-‟　-。]+)",
      R"(\s+$)",
      R"([一-龥ࠀ-一가-퟿]+)",
      R"(\p{N}+)"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"deepseek-coder"},
     {R"([\r\n])",
      R"(\s?\p{L}+)",
      R"(\s?\p{P}+)",
      R"([一-龥ࠀ-一가-퟿]+)",
      R"(\p{N})"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"deepseek-v3"},
     {R"(\p{N}{1,3})",
      R"([一-龥぀-ゟ゠-ヿ]+)",
      R"([!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"falcon"},
     {R"([\p{P}\$\+<=>\^~\|`]+)",
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
      R"([0-9][0-9][0-9])"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"},
     {R"(\p{N})",
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"gpt-2", "phi-2", "roberta-bpe", "jina-es", "jina-de", "gigachat", "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code", "mpt", "olmo", "jais"},
     {R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"},
     {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"poro-chat", "bloom", "gpt3-finnish"},
     {R"( ?[^(\s|.,!?…。，、।۔،)]+)"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"viking"},
     {R"( ?[^(\s|.,!?…。，、।۔،)]+)",
      R"(\p{N})"},
     /*ignore_merges=*/false, /*add_bos=*/false},
    {{"tekken"},
     {R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
     /*ignore_merges=*/true, /*add_bos=*/true},
};
// clang-format on

}  // namespace

absl::StatusOr<Pretokenizer> Pretokenizer::ForName(std::string_view name) {
  for (const Spec& spec : kSpecs) {
    for (std::string_view n : spec.names) {
      if (n != name) continue;
      Pretokenizer pre;
      pre.name_ = std::string(name);
      pre.ignore_merges_ = spec.ignore_merges;
      pre.add_bos_by_default_ = spec.add_bos;
      for (std::string_view pattern : spec.patterns) {
        absl::StatusOr<SplitRegex> regex = SplitRegex::Compile(pattern);
        if (!regex.ok()) {
          // Our own table: a failure here is a bug, reported rather than hidden.
          return absl::InternalError(absl::StrCat("pre-tokenizer '",
                                                  absl::string_view(name.data(), name.size()),
                                                  "': ", regex.status().message()));
        }
        pre.patterns_.push_back(*std::move(regex));
      }
      return pre;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.pre: unknown pre-tokenizer '",
                                                 absl::string_view(name.data(), name.size()), "'"));
}

std::vector<std::string> Pretokenizer::Names() {
  std::vector<std::string> names;
  for (const Spec& spec : kSpecs) {
    for (std::string_view n : spec.names) names.emplace_back(n);
  }
  return names;
}

std::vector<ByteSpan> Pretokenizer::Split(std::string_view text) const {
  const std::vector<unicode::CodePoint> cps = unicode::DecodeUtf8(text);
  const std::vector<RegexUnit> units = ToRegexUnits(cps);
  std::vector<UnitSpan> pieces;
  if (!units.empty()) pieces.push_back({0, units.size()});
  std::vector<UnitSpan> next;
  for (const SplitRegex& regex : patterns_) {
    next.clear();
    for (const UnitSpan& piece : pieces) regex.Split(units, piece, &next);
    pieces.swap(next);
  }
  std::vector<ByteSpan> words;
  words.reserve(pieces.size());
  for (const UnitSpan& piece : pieces) {
    const size_t begin = cps[piece.begin].offset;
    const size_t end = piece.end < cps.size() ? cps[piece.end].offset : text.size();
    words.push_back({begin, end - begin});
  }
  return words;
}

}  // namespace subspace
