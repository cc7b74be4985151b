// The CUDA backend as a plugin: libsubspace_cuda.so, which the server opens with dlopen only when
// --device asks for a GPU. Linking CUDA into the server instead would put cudart's thread-local
// storage into the static TLS every thread carves from its stack (civetweb's 100 KiB metrics
// threads then overflow, with OpenBLAS's 60 KiB already there), and a CPU server would load
// CUDA for nothing. The plugin exports one C symbol returning this table.
#ifndef SUBSPACE_CUDA_CUDA_PLUGIN_H_
#define SUBSPACE_CUDA_CUDA_PLUGIN_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model/model.h"
#include "cuda/cuda_model.h"
#include "kernels/device_info.h"

namespace subspace::cuda {

// Bumped whenever this table or the types it passes change: plugin and server are built
// together, and a stale plugin must be refused rather than called.
inline constexpr int kCudaPluginAbi = 7;  // 7: CudaModelOptions::transform
inline constexpr char kCudaPluginFile[] = "libsubspace_cuda.so";
inline constexpr char kCudaPluginSymbol[] = "SubspaceCudaPlugin";

// What the server gets: only base types, so it calls nothing of the plugin's but through
// virtual functions and this table (it does not link the plugin's code).
struct CudaPluginBackend {
  std::shared_ptr<ModelRunner> model;
  std::unique_ptr<KvCacheBase> cache;
  std::string description;  // device and how its memory is split, for the start-up log
};

struct CudaPluginApi {
  int abi = 0;
  std::vector<kernels::CudaDeviceInfo> (*list_devices)(std::string* error) = nullptr;
  absl::StatusOr<CudaPluginBackend> (*create_backend)(const LlamaModel& model,
                                                      const CudaModelOptions& options) = nullptr;
};

}  // namespace subspace::cuda

extern "C" const subspace::cuda::CudaPluginApi* SubspaceCudaPlugin();

#endif  // SUBSPACE_CUDA_CUDA_PLUGIN_H_
