#include "runtime/backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_capabilities.h"
#include "cuda/cuda_plugin.h"
#include "spdlog/spdlog.h"

namespace subspace::runtime {

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

namespace {

// Where the plugin may be: $SUBSPACE_CUDA_PLUGIN, else beside the executable, in ../bin (tests
// run from build/tests) or in ../lib (an installed layout).
std::vector<std::string> PluginCandidates() {
  if (const char* env = std::getenv("SUBSPACE_CUDA_PLUGIN"); env != nullptr && *env != 0) {
    return {env};
  }
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return {cuda::kCudaPluginFile};  // the loader's own search path
  const std::filesystem::path dir = exe.parent_path();
  return {(dir / cuda::kCudaPluginFile).string(),
          (dir / ".." / "bin" / cuda::kCudaPluginFile).string(),
          (dir / ".." / "lib" / cuda::kCudaPluginFile).string()};
}

// The plugin's table, loaded once (never unloaded: device memory and CUDA's state outlive any
// one backend), or why it is not there.
const absl::StatusOr<const cuda::CudaPluginApi*>& CudaPlugin() {
  static const absl::StatusOr<const cuda::CudaPluginApi*> plugin =
      []() -> absl::StatusOr<const cuda::CudaPluginApi*> {
    std::string tried;
    for (const std::string& path : PluginCandidates()) {
      if (path.find('/') != std::string::npos && !std::filesystem::exists(path)) continue;
      void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib == nullptr) {
        absl::StrAppend(&tried, tried.empty() ? "" : "; ", dlerror());
        continue;
      }
      using Entry = const cuda::CudaPluginApi* (*)();
      auto entry = reinterpret_cast<Entry>(dlsym(lib, cuda::kCudaPluginSymbol));
      if (entry == nullptr || entry()->abi != cuda::kCudaPluginAbi) {
        return absl::FailedPreconditionError(absl::StrCat(
            path, " is not a CUDA plugin of this build (missing symbol or other ABI version)"));
      }
      return entry();
    }
    return absl::UnavailableError(
        absl::StrCat("the CUDA backend plugin (", cuda::kCudaPluginFile, ") is not installed",
                     tried.empty() ? " (this build has no CUDA)" : absl::StrCat(": ", tried)));
  }();
  return plugin;
}

absl::StatusOr<Backend> CpuBackend(const BackendOptions& options,
                                   std::shared_ptr<LlamaModel> cpu_model,
                                   const KvCacheOptions& cache_options,
                                   const KvCacheInputs& inputs) {
  if (options.gpu_memory_fraction != 0.0) {
    return absl::InvalidArgumentError("--gpu-memory-fraction needs the CUDA backend");
  }
  const ModelConfig& m = cpu_model->config();
  absl::StatusOr<std::unique_ptr<KvCache>> cache =
      CreateKvCache(cache_options, m, options.block_size, options.kv_cache_bytes, inputs);
  if (!cache.ok()) return cache.status();
  return Backend{std::move(cpu_model), *std::move(cache)};
}

// Why the cache as configured cannot run on the GPU, or "" when it can, by what the CUDA backend
// declares it holds (cuda/cuda_capabilities.h).
std::string CpuOnlyCompressedFeature(const KvCacheOptions& o) {
  const cuda::CudaCacheCapabilities& caps = cuda::kCudaCacheCapabilities;
  if (o.kind == KvCacheKind::kQuantized && !caps.quantized_paged) return "--kv-cache quantized";
  if (o.kind == KvCacheKind::kTransform && !caps.transform_coded) return "--kv-cache transform";
  if (o.kind == KvCacheKind::kTransform && o.refresh.method != RefreshMethod::kNone &&
      !caps.transform_refresh) {
    return absl::StrCat("--refresh-method ", RefreshMethodName(o.refresh.method),
                        " with --kv-cache transform");
  }
  if (o.kind != KvCacheKind::kCompressed) return "";
  if (!caps.HoldsFullDtype(o.full_dtype)) {
    return absl::StrCat("--kv-full-dtype ", CoeffDtypeName(o.full_dtype));
  }
  if (!caps.HoldsCoeffDtype(o.coeff_dtype)) {
    return absl::StrCat("--kv-coeff-dtype ", CoeffDtypeName(o.coeff_dtype));
  }
  return "";
}

absl::StatusOr<Backend> CudaBackend(const cuda::CudaPluginApi& plugin,
                                    const BackendOptions& options, const LlamaModel& cpu_model,
                                    const KvCacheOptions& cache_options,
                                    const KvCacheInputs& inputs) {
  std::shared_ptr<const Basis> bases = inputs.bases;
  std::optional<cuda::CudaCompressedCacheOptions> compressed;
  std::optional<cuda::CudaTransformCacheOptions> transform;
  if (cache_options.kind == KvCacheKind::kTransform) {
    if (inputs.codec == nullptr) {
      return absl::InvalidArgumentError("--kv-cache transform needs the --codec file loaded");
    }
    // The CPU cache's codes and policy (CreateTransformKvCache); keys before RoPE are rotated
    // with the model's own schedule on both backends.
    transform = cuda::CudaTransformCacheOptions{
        .sink_tokens = cache_options.sink_tokens,
        .window_tokens = cache_options.window_tokens,
        .key_codes = std::make_shared<const std::vector<TransformCode>>(inputs.codec->keys),
        .value_codes = std::make_shared<const std::vector<TransformCode>>(inputs.codec->values),
        .pre_rope_keys = inputs.codec->info.pre_rope_keys};
  }
  if (cache_options.kind == KvCacheKind::kCompressed) {
    const KvCacheGeometry g = cpu_model.config().cache_geometry();
    const KvCacheOptions o = ResolveKvCacheOptions(cache_options, g, bases.get());
    // The CPU cache's policy, per-layer ranks of --bases included.
    absl::StatusOr<CompressionPolicy> policy = CompressionPolicyFor(o, g, bases.get());
    if (!policy.ok()) return policy.status();
    cuda::CudaCompressedCacheOptions c;
    c.policy = *std::move(policy);
    c.basis = std::move(bases);
    c.refresh = o.refresh;
    compressed = std::move(c);
  }
  absl::StatusOr<cuda::CudaPluginBackend> cuda = plugin.create_backend(
      cpu_model, {.device = 0,
                  .max_batch_tokens = options.max_batch_tokens,
                  .max_sequences = options.max_running,
                  .block_size = options.block_size,
                  .kv_cache_bytes = options.gpu_memory_fraction > 0.0 ? 0 : options.kv_cache_bytes,
                  .gpu_memory_fraction = options.gpu_memory_fraction,
                  .compressed = std::move(compressed),
                  .transform = std::move(transform),
                  .cuda_graphs = options.cuda_graphs});
  if (!cuda.ok()) return cuda.status();
  spdlog::info("CUDA backend on {}", cuda->description);
  return Backend{std::move(cuda->model), std::move(cuda->cache)};
}

}  // namespace

bool CudaBackendBuilt() { return CudaPlugin().ok(); }

absl::Status CheckCacheRunsOn(Device device, const KvCacheOptions& cache_options) {
  const std::string cpu_only = CpuOnlyCompressedFeature(cache_options);
  if (device == Device::kCuda && !cpu_only.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device cuda: ", cpu_only, " runs on the CPU backend only"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Backend> CreateBackend(const BackendOptions& options,
                                      std::shared_ptr<LlamaModel> cpu_model,
                                      const KvCacheOptions& cache_options,
                                      const KvCacheInputs& inputs) {
  if (!(options.gpu_memory_fraction >= 0.0 && options.gpu_memory_fraction <= 1.0)) {
    return absl::InvalidArgumentError("--gpu-memory-fraction must be in [0, 1]");
  }
  if (options.device == Device::kCpu) {
    return CpuBackend(options, std::move(cpu_model), cache_options, inputs);
  }
  const absl::StatusOr<const cuda::CudaPluginApi*>& plugin = CudaPlugin();
  const std::string cpu_only = CpuOnlyCompressedFeature(cache_options);
  if (absl::Status s = CheckCacheRunsOn(options.device, cache_options); !s.ok()) return s;
  if (options.device == Device::kCuda) {
    if (!plugin.ok()) {
      return absl::UnavailableError(
          absl::StrCat("--device cuda: ", std::string(plugin.status().message())));
    }
  }
  std::string why;
  const bool has_device = plugin.ok() && !(*plugin)->list_devices(&why).empty();
  if (options.device == Device::kCuda) {
    if (!has_device) {
      return absl::UnavailableError(absl::StrCat("--device cuda: no CUDA device (", why, ")"));
    }
    return CudaBackend(**plugin, options, *cpu_model, cache_options, inputs);
  }
  if (has_device && cpu_only.empty()) {
    return CudaBackend(**plugin, options, *cpu_model, cache_options, inputs);
  }
  spdlog::info("--device auto: serving on the CPU ({})",
               !plugin.ok() ? std::string(plugin.status().message())
               : has_device ? absl::StrCat(cpu_only, " runs on the CPU backend only")
                            : absl::StrCat("no CUDA device: ", why));
  BackendOptions cpu = options;
  cpu.gpu_memory_fraction = 0.0;
  return CpuBackend(cpu, std::move(cpu_model), cache_options, inputs);
}

}  // namespace subspace::runtime
