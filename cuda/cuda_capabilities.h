// What the CUDA backend's KV caches can hold, declared once by the backend: its device caches
// refuse anything else, and the runtime (runtime/backend.h) checks a configuration against it
// before it loads the plugin, so that --device auto falls back to the CPU and --device cuda says
// which setting keeps it there. Plain C++, no CUDA: the runtime includes it without the toolkit.
#ifndef SUBSPACE_CUDA_CUDA_CAPABILITIES_H_
#define SUBSPACE_CUDA_CUDA_CAPABILITIES_H_

#include "core/base/coeff_codec.h"

namespace subspace::cuda {

struct CudaCacheCapabilities {
  // Paged rows quantized per 32 values (q8_0 / q4_0): no device kernels for them yet.
  bool quantized_paged = false;
  // The transform codec's mixed-width codes (DeviceTransformKvCache, held to the CPU cache).
  bool transform_coded = true;
  // Online refresh of those codes (the CPU cache's --refresh-method pca): not on the device yet.
  bool transform_refresh = false;
  // The compressed cache's full-rank blocks (sinks, window, outliers): fp16 pages only.
  constexpr bool HoldsFullDtype(CoeffDtype dtype) const { return dtype == CoeffDtype::kFp16; }
  // Its coefficient codes: fp16 or int8 (no fp32 or int4 kernels).
  constexpr bool HoldsCoeffDtype(CoeffDtype dtype) const {
    return dtype == CoeffDtype::kFp16 || dtype == CoeffDtype::kInt8;
  }
};

inline constexpr CudaCacheCapabilities kCudaCacheCapabilities{};

}  // namespace subspace::cuda

#endif  // SUBSPACE_CUDA_CUDA_CAPABILITIES_H_
