// Which backend serves (--device cpu|cuda|auto) and building it: the model runner and the KV
// cache it runs on. Both backends run both cache kinds; the CUDA backend's compressed cache takes
// fp16 full blocks and fp16 or int8 codes (--kv-full-dtype fp32 and fp32 codes stay on the CPU).
#ifndef SUBSPACE_RUNTIME_BACKEND_H_
#define SUBSPACE_RUNTIME_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "core/compress/basis.h"
#include "core/kvcache/kv_cache.h"
#include "core/model/model.h"
#include "core/model/model_runner.h"
#include "runtime/kv_cache_options.h"

namespace subspace::runtime {

enum class Device : uint8_t { kCpu, kCuda, kAuto };
const char* DeviceName(Device device);                      // "cpu", "cuda", "auto"
absl::StatusOr<Device> ParseDevice(std::string_view name);  // INVALID_ARGUMENT naming the choices

struct BackendOptions {
  Device device = Device::kCpu;
  int block_size = 16;
  int64_t kv_cache_bytes = 0;        // the KV pool, host or device
  double gpu_memory_fraction = 0.0;  // CUDA: > 0 sizes the pool from device memory instead
  int max_batch_tokens = 512;        // the engine's, so the CUDA activations fit every step
  int max_running = 16;
  bool cuda_graphs = false;  // CUDA: decode steps replayed as graphs
};

struct Backend {
  std::shared_ptr<ModelRunner> model;
  std::unique_ptr<KvCacheBase> cache;
};

// Whether the CUDA backend plugin (libsubspace_cuda.so, cuda/cuda_plugin.h) loads: beside the
// executable, in ../bin or ../lib, or at $SUBSPACE_CUDA_PLUGIN. It is built whenever nvcc is.
bool CudaBackendBuilt();

// INVALID_ARGUMENT when `device` is kCuda and the cache as configured runs on the CPU backend
// only (--kv-cache quantized or transform, a CPU-only dtype): CreateBackend's first refusal,
// which a server asks before its start-up work (fitting a codec) rather than after.
absl::Status CheckCacheRunsOn(Device device, const KvCacheOptions& cache_options);

// kCpu: `cpu_model` with the cache CreateKvCache builds. kCuda: UNAVAILABLE when the CUDA plugin
// is missing or the machine has no device, INVALID_ARGUMENT for a compressed cache with a
// CPU-only feature. kAuto: CUDA when it is built, a device is present and the cache configuration
// runs there; otherwise the CPU.
// `cpu_model` must outlive nothing: the CUDA backend copies the weights it needs.
absl::StatusOr<Backend> CreateBackend(const BackendOptions& options,
                                      std::shared_ptr<LlamaModel> cpu_model,
                                      const KvCacheOptions& cache_options,
                                      const KvCacheInputs& inputs = {});

}  // namespace subspace::runtime

#endif  // SUBSPACE_RUNTIME_BACKEND_H_
