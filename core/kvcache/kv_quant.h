// Element types of the full-rank paged cache's K/V rows: fp32, or blocks of 32 values with one
// fp16 scale, laid out and rounded as llama.cpp's q8_0 and q4_0 cache types store them
// (`--cache-type-k q8_0`), so a user comparing the two sees the same format at the same bytes.
#ifndef SUBSPACE_CORE_KVCACHE_KV_QUANT_H_
#define SUBSPACE_CORE_KVCACHE_KV_QUANT_H_

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace subspace {

enum class KvDtype : uint8_t { kF32 = 0, kQ8_0 = 1, kQ4_0 = 2 };

inline constexpr int kKvQuantBlock = 32;  // values per q8_0 / q4_0 block

const char* KvDtypeName(KvDtype dtype);  // "f32", "q8_0", "q4_0"
// INVALID_ARGUMENT naming `flag` for anything but the names above.
absl::StatusOr<KvDtype> ParseKvDtype(std::string_view name, std::string_view flag = "kv dtype");

// Bytes of a row of n values: 4n for f32; n / 32 blocks of 34 (fp16 scale + 32 int8) for q8_0
// and of 18 (fp16 scale + 16 bytes of nibbles) for q4_0. 0 when n <= 0, or n is not a
// multiple of 32 for a block type.
int64_t KvRowBytes(KvDtype dtype, int64_t n);

// Stores x[0, n) as one row of `dtype` at dst (KvRowBytes(dtype, n) bytes, any alignment).
// q8_0: d = max|x| / 127, q = round(x / d). q4_0: d = m / -8 for the value m of largest
// magnitude, q = min(15, (int8)(x / d + 8.5)), low nibbles the block's first 16 values and
// high nibbles the last 16. d is stored as fp16 and an all-zero block stores d = 0.
void QuantizeKvRow(KvDtype dtype, const float* x, int64_t n, uint8_t* dst);
// The inverse: `rows` consecutive rows of n values at src into dst [rows, n] fp32.
// q8_0: x = d q; q4_0: x = d (q - 8).
void DequantizeKvRows(KvDtype dtype, const uint8_t* src, int64_t rows, int64_t n, float* dst);

}  // namespace subspace

#endif  // SUBSPACE_CORE_KVCACHE_KV_QUANT_H_
