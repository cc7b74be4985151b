// Fuzzes the GGUF reader: any bytes must give a Status or a file whose every metadata value and
// tensor can be walked without reading outside the buffer; the model config, tokenizer and
// basis-file parsers built on top must cope with whatever the reader accepts.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/base/quant_blocks.h"
#include "core/compress/basis_file.h"
#include "core/cpu/matmul_internal.h"
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

void DecodeRows(const GgufTensorInfo& t);

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
    DecodeRows(t);
  }
}

// Dequantizes the tensor's rows (the first 64 KiB of them) and runs the fused dot kernel of
// its type on each: every block layout must stay inside the bytes the header promised,
// whatever codes and scales they hold.
void DecodeRows(const GgufTensorInfo& t) {
  const int64_t cols = t.dims[0];
  const uint64_t row_bytes = TensorRowBytes(t.type, cols);
  if (cols <= 0 || cols > (1 << 16) || row_bytes == 0) return;
  const int64_t rows =
      std::min<int64_t>(t.num_elements / cols, static_cast<int64_t>((64 << 10) / row_bytes) + 1);
  std::vector<float> values(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    FUZZ_CHECK((r + 1) * row_bytes <= t.num_bytes);
    DequantizeRow(t.type, t.data + r * row_bytes, values.data(), cols);
  }
  if (!IsQuantizedTensorType(t.type)) return;
  const TensorType act_type = DotActivationType(t.type);
  std::vector<uint8_t> act(TensorRowBytes(act_type, cols));
  for (int64_t i = 0; i < cols; ++i) values[i] = static_cast<float>(i % 7) - 3.0f;
  QuantizeActivationRow(act_type, values.data(), act.data(), cols);
  const cpu::internal::QuantDotFn dot = cpu::internal::QuantDotKernel(t.type);
  for (int64_t r = 0; r < rows; ++r) {
    volatile float sink = dot(t.data + r * row_bytes, act.data(), cols);
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
