#include "server/backend.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

#if defined(SUBSPACE_WITH_CUDA)
#include "kernels/cuda_model.h"
#include "kernels/device_info.h"
#endif

namespace subspace::server {

const char* DeviceName(Device device) {
  switch (device) {
    case Device::kCpu:
      return "cpu";
    case Device::kCuda:
      return "cuda";
    case Device::kAuto:
      return "auto";
  }
  return "?";
}

absl::StatusOr<Device> ParseDevice(std::string_view name) {
  if (name == "cpu") return Device::kCpu;
  if (name == "cuda") return Device::kCuda;
  if (name == "auto") return Device::kAuto;
  return absl::InvalidArgumentError(
      absl::StrCat("--device must be cpu, cuda or auto, got '", std::string(name), "'"));
}

bool CudaBackendBuilt() {
#if defined(SUBSPACE_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

namespace {

absl::StatusOr<Backend> CpuBackend(const BackendOptions& options,
                                   std::shared_ptr<LlamaModel> cpu_model,
                                   const KvCacheOptions& cache_options,
                                   std::shared_ptr<const Basis> bases) {
  if (options.gpu_memory_fraction != 0.0) {
    return absl::InvalidArgumentError("--gpu-memory-fraction needs the CUDA backend");
  }
  const ModelConfig& m = cpu_model->config();
  absl::StatusOr<std::unique_ptr<KvCache>> cache =
      CreateKvCache(cache_options, m.cache_geometry(), options.block_size, options.kv_cache_bytes,
                    std::move(bases), m.n_heads);
  if (!cache.ok()) return cache.status();
  return Backend{std::move(cpu_model), *std::move(cache)};
}

#if defined(SUBSPACE_WITH_CUDA)
absl::StatusOr<Backend> CudaBackend(const BackendOptions& options, const LlamaModel& cpu_model) {
  absl::StatusOr<kernels::CudaBackend> cuda = kernels::CreateCudaBackend(
      cpu_model, {.device = 0,
                  .max_batch_tokens = options.max_batch_tokens,
                  .max_sequences = options.max_running,
                  .block_size = options.block_size,
                  .kv_cache_bytes = options.gpu_memory_fraction > 0.0 ? 0 : options.kv_cache_bytes,
                  .gpu_memory_fraction = options.gpu_memory_fraction});
  if (!cuda.ok()) return cuda.status();
  const kernels::CudaLlamaModel::MemoryUse use = cuda->model->memory_use();
  spdlog::info(
      "CUDA backend on {}: weights {} MiB, activations and workspaces {} MiB, KV pool {} MiB",
      cuda->model->device_name(), use.weights >> 20, use.activations >> 20, use.kv_pool >> 20);
  return Backend{std::move(cuda->model), std::move(cuda->cache)};
}
#endif

}  // namespace

absl::StatusOr<Backend> CreateBackend(const BackendOptions& options,
                                      std::shared_ptr<LlamaModel> cpu_model,
                                      const KvCacheOptions& cache_options,
                                      std::shared_ptr<const Basis> bases) {
  if (!(options.gpu_memory_fraction >= 0.0 && options.gpu_memory_fraction <= 1.0)) {
    return absl::InvalidArgumentError("--gpu-memory-fraction must be in [0, 1]");
  }
  const bool compressed = cache_options.kind == KvCacheKind::kCompressed;
  if (options.device == Device::kCpu) {
    return CpuBackend(options, std::move(cpu_model), cache_options, std::move(bases));
  }
#if defined(SUBSPACE_WITH_CUDA)
  std::string why;
  const bool has_device = !kernels::ListCudaDevices(&why).empty();
  if (options.device == Device::kCuda) {
    if (compressed) {
      return absl::InvalidArgumentError(
          "--device cuda runs --kv-cache full: the compressed cache has CUDA kernels but no "
          "device-resident cache yet");
    }
    if (!has_device) {
      return absl::UnavailableError(absl::StrCat("--device cuda: no CUDA device (", why, ")"));
    }
    return CudaBackend(options, *cpu_model);
  }
  if (has_device && !compressed) return CudaBackend(options, *cpu_model);
  spdlog::info("--device auto: serving on the CPU ({})",
               has_device ? "the compressed KV cache runs on the CPU backend only"
                          : absl::StrCat("no CUDA device: ", why));
#else
  if (options.device == Device::kCuda) {
    return absl::UnavailableError("--device cuda: this binary was built without CUDA");
  }
  spdlog::info("--device auto: serving on the CPU (built without CUDA)");
#endif
  BackendOptions cpu = options;
  cpu.gpu_memory_fraction = 0.0;
  return CpuBackend(cpu, std::move(cpu_model), cache_options, std::move(bases));
}

}  // namespace subspace::server
