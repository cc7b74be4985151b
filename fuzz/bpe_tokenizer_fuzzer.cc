// Fuzzes the byte-level BPE tokenizer and its pre-tokenizer split patterns on two real
// vocabularies (tests/data/gguf/): GPT-2's (every byte has a token) and DeepSeek-LLM's (the
// longest pattern sequence: six patterns, a 500-code-point class, \s+$). The first input byte
// picks the vocabulary. Properties: ids in [0, vocab); for GPT-2, Decode(Encode(x)) == x for
// any bytes; for both, the words the pre-tokenizer returns tile the text; the stream decoder's
// output is valid UTF-8 and equals Decode when that is. libFuzzer's -timeout catches inputs on
// which the matcher's time would blow up.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/gguf/gguf.h"
#include "core/tokenizer/tokenizer.h"
#include "fuzz/fuzz_util.h"

namespace subspace::fuzz {
namespace {

const Tokenizer& Vocab(int which) {
  static const Tokenizer* vocabs[2] = {nullptr, nullptr};
  static const char* names[2] = {"gpt-2", "deepseek-llm"};
  if (vocabs[which] == nullptr) {
    const std::string path =
        std::string(SUBSPACE_SOURCE_DIR) + "/tests/data/gguf/ggml-vocab-" + names[which] + ".gguf";
    auto file = GgufFile::Open(path);
    FUZZ_CHECK(file.ok());
    auto tok = Tokenizer::FromGguf(**file);
    FUZZ_CHECK(tok.ok());
    vocabs[which] = tok->release();
  }
  return *vocabs[which];
}

}  // namespace
}  // namespace subspace::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace subspace;
  if (size == 0) return 0;
  const int which = data[0] & 1;
  const Tokenizer& tok = fuzz::Vocab(which);
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);

  const std::vector<int32_t> ids = tok.Encode(text, {.add_bos = false});
  for (int32_t id : ids) FUZZ_CHECK(id >= 0 && id < tok.vocab_size());
  const std::string decoded = tok.Decode(ids);
  if (which == 0) FUZZ_CHECK(decoded == text);

  StreamDecoder stream(tok);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string piece = stream.Push(id);
    FUZZ_CHECK(fuzz::IsValidUtf8(piece));
    streamed += piece;
  }
  streamed += stream.Flush();
  if (fuzz::IsValidUtf8(decoded)) FUZZ_CHECK(streamed == decoded);

  const std::vector<int32_t> special = tok.Encode(text, {.add_bos = true, .parse_special = true});
  for (int32_t id : special) FUZZ_CHECK(id >= 0 && id < tok.vocab_size());
  return 0;
}
