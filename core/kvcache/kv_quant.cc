// Row quantizers of the paged cache's K/V (see kv_quant.h). Quantization runs once per row
// written; dequantization per block inside attention, so it is the CPU kernels' (scalar twin
// and AVX2, core/cpu/attention_kernels.h).
#include "core/kvcache/kv_quant.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/base/tensor_types.h"
#include "core/cpu/attention_kernels.h"

namespace subspace {
namespace {

constexpr int64_t kQ8BlockBytes = 2 + kKvQuantBlock;      // fp16 d, int8 q[32]
constexpr int64_t kQ4BlockBytes = 2 + kKvQuantBlock / 2;  // fp16 d, uint8 qs[16]

void StoreScale(float d, uint8_t* dst) {
  const uint16_t h = Fp32ToFp16(d);
  std::memcpy(dst, &h, sizeof(h));
}

}  // namespace

const char* KvDtypeName(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kF32:
      return "f32";
    case KvDtype::kQ8_0:
      return "q8_0";
    case KvDtype::kQ4_0:
      return "q4_0";
  }
  return "unknown";
}

absl::StatusOr<KvDtype> ParseKvDtype(std::string_view name, std::string_view flag) {
  for (KvDtype dtype : {KvDtype::kF32, KvDtype::kQ8_0, KvDtype::kQ4_0}) {
    if (name == KvDtypeName(dtype)) return dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      std::string(flag), " must be 'f32', 'q8_0' or 'q4_0', got '", std::string(name), "'"));
}

int64_t KvRowBytes(KvDtype dtype, int64_t n) {
  if (n <= 0) return 0;
  switch (dtype) {
    case KvDtype::kF32:
      return 4 * n;
    case KvDtype::kQ8_0:
      return n % kKvQuantBlock == 0 ? n / kKvQuantBlock * kQ8BlockBytes : 0;
    case KvDtype::kQ4_0:
      return n % kKvQuantBlock == 0 ? n / kKvQuantBlock * kQ4BlockBytes : 0;
  }
  return 0;
}

void QuantizeKvRow(KvDtype dtype, const float* x, int64_t n, uint8_t* dst) {
  assert(KvRowBytes(dtype, n) > 0);
  switch (dtype) {
    case KvDtype::kF32:
      std::memcpy(dst, x, static_cast<size_t>(n) * sizeof(float));
      return;
    case KvDtype::kQ8_0:
      for (int64_t b = 0; b < n; b += kKvQuantBlock, dst += kQ8BlockBytes) {
        float amax = 0.0f;
        for (int j = 0; j < kKvQuantBlock; ++j) amax = std::max(amax, std::fabs(x[b + j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        StoreScale(d, dst);
        auto* q = reinterpret_cast<int8_t*>(dst + 2);
        for (int j = 0; j < kKvQuantBlock; ++j) {
          q[j] = static_cast<int8_t>(std::lround(x[b + j] * id));
        }
      }
      return;
    case KvDtype::kQ4_0:
      for (int64_t b = 0; b < n; b += kKvQuantBlock, dst += kQ4BlockBytes) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < kKvQuantBlock; ++j) {
          if (amax < std::fabs(x[b + j])) {
            amax = std::fabs(x[b + j]);
            max = x[b + j];
          }
        }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        StoreScale(d, dst);
        constexpr int kHalf = kKvQuantBlock / 2;
        for (int j = 0; j < kHalf; ++j) {
          const int lo = std::min(15, static_cast<int>(static_cast<int8_t>(x[b + j] * id + 8.5f)));
          const int hi =
              std::min(15, static_cast<int>(static_cast<int8_t>(x[b + kHalf + j] * id + 8.5f)));
          dst[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
        }
      }
      return;
  }
}

void DequantizeKvRows(KvDtype dtype, const uint8_t* src, int64_t rows, int64_t n, float* dst) {
  assert(KvRowBytes(dtype, n) > 0);
  const int64_t blocks = rows * (n / kKvQuantBlock);
  switch (dtype) {
    case KvDtype::kF32:
      std::memcpy(dst, src, static_cast<size_t>(rows * n) * sizeof(float));
      return;
    case KvDtype::kQ8_0:
      cpu::ActiveAttentionKernels().dequantize_q8_0(src, blocks, dst);
      return;
    case KvDtype::kQ4_0:
      cpu::ActiveAttentionKernels().dequantize_q4_0(src, blocks, dst);
      return;
  }
}

}  // namespace subspace
