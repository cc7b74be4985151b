// Coefficient encode/decode. int8 and int4 are symmetric per row: scale = max|x| / 127 (int4:
// / 7) rounded to fp16, codes = round(x / scale) in [-127, 127] ([-7, 7]); the scale is rounded
// before the codes are made so decode sees the exact scale the codes were computed with.
#include "core/base/coeff_codec.h"

#include <algorithm>
#include <cmath>

#include "core/base/tensor_types.h"

namespace subspace {

const char* CoeffDtypeName(CoeffDtype dtype) {
  switch (dtype) {
    case CoeffDtype::kFp32:
      return "fp32";
    case CoeffDtype::kFp16:
      return "fp16";
    case CoeffDtype::kInt8:
      return "int8";
    case CoeffDtype::kInt4:
      return "int4";
  }
  return "?";
}

void EncodeCoeffs(CoeffDtype dtype, const float* x, int r, void* codes, uint16_t* scale) {
  switch (dtype) {
    case CoeffDtype::kFp32:
      std::memcpy(codes, x, static_cast<size_t>(r) * sizeof(float));
      return;
    case CoeffDtype::kFp16: {
      auto* h = static_cast<uint16_t*>(codes);
      for (int j = 0; j < r; ++j) h[j] = Fp32ToFp16(x[j]);
      return;
    }
    case CoeffDtype::kInt8:
    case CoeffDtype::kInt4: {
      const float qmax = dtype == CoeffDtype::kInt8 ? 127.0f : 7.0f;
      float amax = 0.0f;
      for (int j = 0; j < r; ++j) amax = std::max(amax, std::fabs(x[j]));
      const uint16_t s16 = Fp32ToFp16(amax / qmax);
      const float s = HalfToFloat(s16);
      const float inv = s > 0.0f ? 1.0f / s : 0.0f;
      auto code = [&](int j) { return std::clamp(std::nearbyint(x[j] * inv), -qmax, qmax); };
      if (dtype == CoeffDtype::kInt8) {
        auto* q = static_cast<int8_t*>(codes);
        for (int j = 0; j < r; ++j) q[j] = static_cast<int8_t>(code(j));
      } else {
        auto* q = static_cast<uint8_t*>(codes);
        for (int j = 0; j + 1 < r; j += 2) {
          q[j / 2] = static_cast<uint8_t>(static_cast<int>(code(j)) + 8) |
                     static_cast<uint8_t>((static_cast<int>(code(j + 1)) + 8) << 4);
        }
      }
      *scale = s16;
      return;
    }
  }
}

void DecodeCoeffs(CoeffDtype dtype, const void* codes, const uint16_t* scale, int r, float* out) {
  switch (dtype) {
    case CoeffDtype::kFp32:
      std::memcpy(out, codes, static_cast<size_t>(r) * sizeof(float));
      return;
    case CoeffDtype::kFp16: {
      const auto* h = static_cast<const uint16_t*>(codes);
      for (int j = 0; j < r; ++j) out[j] = HalfToFloat(h[j]);
      return;
    }
    case CoeffDtype::kInt8: {
      const auto* q = static_cast<const int8_t*>(codes);
      const float s = HalfToFloat(*scale);
#pragma omp simd
      for (int j = 0; j < r; ++j) out[j] = s * static_cast<float>(q[j]);
      return;
    }
    case CoeffDtype::kInt4: {
      const auto* q = static_cast<const uint8_t*>(codes);
      const float s = HalfToFloat(*scale);
      for (int j = 0; j < r; ++j) out[j] = s * static_cast<float>(Int4Code(q, j));
      return;
    }
  }
}

}  // namespace subspace
