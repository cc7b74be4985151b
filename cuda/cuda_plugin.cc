// The plugin's one export: the table server/backend.cc resolves after dlopen.
#include "cuda/cuda_plugin.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace subspace::cuda {
namespace {

absl::StatusOr<CudaPluginBackend> Create(const LlamaModel& model, const CudaModelOptions& options) {
  absl::StatusOr<CudaBackend> cuda = CreateCudaBackend(model, options);
  if (!cuda.ok()) return cuda.status();
  const CudaLlamaModel::MemoryUse use = cuda->model->memory_use();
  CudaPluginBackend out;
  out.description = absl::StrFormat(
      "%s: weights %d MiB, activations and workspaces %d MiB, KV pool %d MiB",
      cuda->model->device_name(), use.weights >> 20, use.activations >> 20, use.kv_pool >> 20);
  out.model = std::move(cuda->model);
  out.cache = std::move(cuda->cache);
  return out;
}

}  // namespace
}  // namespace subspace::cuda

extern "C" __attribute__((visibility("default"))) const subspace::cuda::CudaPluginApi*
SubspaceCudaPlugin() {
  static const subspace::cuda::CudaPluginApi api{
      .abi = subspace::cuda::kCudaPluginAbi,
      .list_devices = &subspace::kernels::ListCudaDevices,
      .create_backend = &subspace::cuda::Create,
  };
  return &api;
}
