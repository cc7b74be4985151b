// Fuzzes the GGUF reader: any bytes must give a Status or a file whose every metadata value and
// tensor can be walked without reading outside the buffer; the model config, tokenizer and
// basis-file parsers built on top must cope with whatever the reader accepts.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/compress/basis_file.h"
#include "core/gguf/gguf.h"
#include "core/model/model.h"
#include "core/tokenizer/tokenizer.h"
#include "fuzz/fuzz_util.h"

namespace subspace::fuzz {
namespace {

size_t WalkValue(const GgufValue& v) {
  size_t n = v.s.size() + static_cast<size_t>(v.u & 1);
  for (const GgufValue& e : v.array) n += WalkValue(e);
  return n;
}

void Walk(const GgufFile& f) {
  const std::string_view all = f.bytes();
  for (const auto& [key, value] : f.metadata()) {
    FUZZ_CHECK(f.Find(key) == &value);
    WalkValue(value);
    // Every typed getter must answer with a value or a Status, whatever the stored type.
    (void)f.GetString(key);
    (void)f.GetUint(key);
    (void)f.GetInt(key);
    (void)f.GetFloat(key);
    (void)f.GetBool(key);
    (void)f.GetStringArray(key);
    (void)f.GetFloatArray(key);
    (void)f.GetIntArray(key);
  }
  for (const GgufTensorInfo& t : f.tensors()) {
    FUZZ_CHECK(f.FindTensor(t.name) != nullptr);
    if (t.num_bytes == 0) continue;
    // The header promises [data, data + num_bytes) lies in the file; ASan checks the touch.
    const auto* begin = reinterpret_cast<const uint8_t*>(all.data());
    FUZZ_CHECK(t.data >= begin && t.data + t.num_bytes <= begin + all.size());
    volatile uint8_t sink = t.data[0] ^ t.data[t.num_bytes - 1];
    (void)sink;
  }
}

}  // namespace
}  // namespace subspace::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace subspace;
  auto file = GgufFile::FromBytes(std::string(reinterpret_cast<const char*>(data), size));
  if (!file.ok()) return 0;
  fuzz::Walk(**file);
  (void)ModelConfig::FromGguf(**file);
  auto tokenizer = Tokenizer::FromGguf(**file);
  if (tokenizer.ok()) {
    const std::vector<int32_t> ids =
        (*tokenizer)
            ->Encode("Hello <s> w\xC3\xB6rld\xFF", {.add_bos = true, .parse_special = true});
    for (int32_t id : ids) FUZZ_CHECK(id >= 0 && id < (*tokenizer)->vocab_size());
    (void)(*tokenizer)->Decode(ids);
  }
  (void)ModelChecksum(**file);
  return 0;
}
