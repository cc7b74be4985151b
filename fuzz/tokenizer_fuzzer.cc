// Fuzzes the tokenizer of the committed default model. Properties: Encode gives ids in
// [0, vocab); Decode(Encode(x)) == x for any bytes x without a literal "▁" (byte fallback);
// StreamDecoder output over any ids (the input read as int32s, out-of-range ones included) is
// valid UTF-8 and, when Decode of those ids is valid UTF-8, equals it.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "core/tokenizer/tokenizer.h"
#include "fuzz/fuzz_util.h"

namespace subspace::fuzz {
namespace {

void CheckStream(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  StreamDecoder stream(tok);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string piece = stream.Push(id);
    FUZZ_CHECK(IsValidUtf8(piece));
    streamed += piece;
  }
  const std::string tail = stream.Flush();
  FUZZ_CHECK(IsValidUtf8(tail));
  streamed += tail;
  const std::string whole = tok.Decode(ids);
  if (IsValidUtf8(whole)) FUZZ_CHECK(streamed == whole);
}

}  // namespace
}  // namespace subspace::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace subspace;
  const Tokenizer& tok = *fuzz::DefaultModel().tokenizer;
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  const std::vector<int32_t> ids = tok.Encode(text, {.add_bos = false});
  for (int32_t id : ids) FUZZ_CHECK(id >= 0 && id < tok.vocab_size());
  if (text.find("\xE2\x96\x81") == std::string_view::npos) FUZZ_CHECK(tok.Decode(ids) == text);
  fuzz::CheckStream(tok, ids);

  const std::vector<int32_t> special = tok.Encode(text, {.add_bos = true, .parse_special = true});
  for (int32_t id : special) FUZZ_CHECK(id >= 0 && id < tok.vocab_size());
  fuzz::CheckStream(tok, special);

  std::vector<int32_t> raw(size / sizeof(int32_t));
  if (!raw.empty()) std::memcpy(raw.data(), data, raw.size() * sizeof(int32_t));
  // Mostly in-range ids, so multi-byte pieces and byte tokens meet; a few raw ones stay wild.
  for (size_t i = 0; i < raw.size(); ++i) {
    if (i % 4 != 3) raw[i] = static_cast<int32_t>(static_cast<uint32_t>(raw[i]) % tok.vocab_size());
  }
  fuzz::CheckStream(tok, raw);
  return 0;
}
