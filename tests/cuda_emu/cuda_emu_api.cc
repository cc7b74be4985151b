// The CUDA runtime API of the emulated device, as far as the kernels, the CUDA backend and their
// tests call it; linked instead of libcudart. Device and pinned memory are host memory; work
// completes as it is issued (streams are in order, events are always reached), except on a
// stream being captured, where it becomes a graph's nodes, replayed by cudaGraphLaunch. Calls
// the device forbids during a capture (a synchronisation, an allocation) fail and invalidate it
// as they do there, so the backend's graph path is held to the device's rules.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tests/cuda_emu/cuda_emu.h"
#include "tests/cuda_emu/cuda_emu_device.h"

struct GraphNode {
  const void* key;
  std::function<void()> op;
};
// The opaque handles of cuda_runtime_api.h, defined here.
struct CUstream_st {
  std::vector<GraphNode>* capture = nullptr;  // the nodes captured so far, while capturing
  bool capture_invalidated = false;
};
struct CUevent_st {};
struct CUgraph_st {
  std::vector<GraphNode> nodes;
};
struct CUgraphExec_st {
  std::vector<GraphNode> nodes;
};

namespace subspace::emu {
namespace {

std::recursive_mutex g_api_mutex;
std::map<void*, size_t> g_device_allocations;  // 256-byte aligned, as cudaMalloc's are
size_t g_device_bytes = 0;
std::map<void*, size_t> g_host_allocations;
thread_local CUstream_st* t_capturing = nullptr;  // this thread's capture (ThreadLocal mode)

// Node keys of the copies and event records a graph holds.
const char kMemcpyNode = 0, kMemsetNode = 0, kEventNode = 0;

// A call the device forbids while this thread captures: fails and invalidates the capture.
bool RefusedDuringCapture() {
  if (t_capturing == nullptr) return false;
  t_capturing->capture_invalidated = true;
  return true;
}

}  // namespace

void Submit(cudaStream_t stream, const void* key, std::function<void()> op) {
  {
    std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
    if (stream != nullptr && stream->capture != nullptr) {
      stream->capture->push_back({key, std::move(op)});
      return;
    }
  }
  op();
}

}  // namespace subspace::emu

using subspace::emu::g_api_mutex;
using subspace::emu::RefusedDuringCapture;
using subspace::emu::Submit;

extern "C" {

cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  *ptr = nullptr;
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  if (RefusedDuringCapture()) return cudaErrorStreamCaptureUnsupported;
  if (size == 0) return cudaSuccess;
  if (size > subspace::emu::kEmulatedMemoryBytes - subspace::emu::g_device_bytes) {
    return cudaErrorMemoryAllocation;
  }
  void* p = std::aligned_alloc(256, (size + 255) / 256 * 256);
  if (p == nullptr) return cudaErrorMemoryAllocation;
  subspace::emu::g_device_allocations[p] = size;
  subspace::emu::g_device_bytes += size;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  auto it = subspace::emu::g_device_allocations.find(ptr);
  if (it == subspace::emu::g_device_allocations.end()) return cudaErrorInvalidValue;
  subspace::emu::g_device_bytes -= it->second;
  subspace::emu::g_device_allocations.erase(it);
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  *ptr = nullptr;
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  if (RefusedDuringCapture()) return cudaErrorStreamCaptureUnsupported;
  void* p = std::aligned_alloc(4096, (std::max<size_t>(size, 1) + 4095) / 4096 * 4096);
  if (p == nullptr) return cudaErrorMemoryAllocation;
  subspace::emu::g_host_allocations[p] = size;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  if (subspace::emu::g_host_allocations.erase(ptr) != 1) return cudaErrorInvalidValue;
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  if (free_bytes == nullptr || total_bytes == nullptr) return cudaErrorInvalidValue;
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  *total_bytes = subspace::emu::kEmulatedMemoryBytes;
  *free_bytes = subspace::emu::kEmulatedMemoryBytes - subspace::emu::g_device_bytes;
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind,
                            cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  Submit(stream, &subspace::emu::kMemcpyNode, [=] { std::memmove(dst, src, count); });
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  {
    std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
    if (RefusedDuringCapture()) return cudaErrorStreamCaptureImplicit;
  }
  return cudaMemcpyAsync(dst, src, count, kind, nullptr);
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind, cudaStream_t stream) {
  if (width > dpitch || width > spitch) return cudaErrorInvalidPitchValue;
  if (width == 0 || height == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  Submit(stream, &subspace::emu::kMemcpyNode, [=] {
    for (size_t row = 0; row < height; ++row) {
      std::memmove(static_cast<char*>(dst) + row * dpitch,
                   static_cast<const char*>(src) + row * spitch, width);
    }
  });
  return cudaSuccess;
}

cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                         size_t height, cudaMemcpyKind kind) {
  {
    std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
    if (RefusedDuringCapture()) return cudaErrorStreamCaptureImplicit;
  }
  return cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, nullptr);
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (ptr == nullptr) return cudaErrorInvalidValue;
  Submit(stream, &subspace::emu::kMemsetNode, [=] { std::memset(ptr, value, count); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  {
    std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
    if (RefusedDuringCapture()) return cudaErrorStreamCaptureImplicit;
  }
  return cudaMemsetAsync(ptr, value, count, nullptr);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  if (stream == nullptr) return cudaErrorInvalidValue;
  *stream = new CUstream_st;
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, 0); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  if (stream->capture != nullptr) return cudaErrorStreamCaptureUnsupported;
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) {
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  if (RefusedDuringCapture()) return cudaErrorStreamCaptureUnsupported;
  return subspace::emu::PeekError();
}

cudaError_t cudaDeviceSynchronize() {
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  if (RefusedDuringCapture()) return cudaErrorStreamCaptureUnsupported;
  return subspace::emu::PeekError();
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode) {
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  // The legacy default stream cannot be captured; one capture per thread.
  if (stream == nullptr || stream->capture != nullptr || subspace::emu::t_capturing != nullptr) {
    return cudaErrorStreamCaptureUnsupported;
  }
  stream->capture = new std::vector<GraphNode>;
  stream->capture_invalidated = false;
  subspace::emu::t_capturing = stream;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (graph == nullptr) return cudaErrorInvalidValue;
  *graph = nullptr;
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  if (stream == nullptr || stream->capture == nullptr) return cudaErrorIllegalState;
  std::unique_ptr<std::vector<GraphNode>> nodes(stream->capture);
  stream->capture = nullptr;
  subspace::emu::t_capturing = nullptr;
  if (stream->capture_invalidated) return cudaErrorStreamCaptureInvalidated;
  *graph = new CUgraph_st{std::move(*nodes)};
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (exec == nullptr || graph == nullptr) return cudaErrorInvalidValue;
  *exec = new CUgraphExec_st{graph->nodes};
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}

// Accepted when the graph has the instantiated one's topology (here: the same node kinds and
// kernels in the same order), as the device requires; the parameters are then replaced.
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph,
                                cudaGraphExecUpdateResultInfo* info) {
  if (exec == nullptr || graph == nullptr) return cudaErrorInvalidValue;
  if (info != nullptr) *info = cudaGraphExecUpdateResultInfo{};
  bool same = exec->nodes.size() == graph->nodes.size();
  for (size_t i = 0; same && i < graph->nodes.size(); ++i) {
    same = exec->nodes[i].key == graph->nodes[i].key;
  }
  if (!same) {
    if (info != nullptr) info->result = cudaGraphExecUpdateErrorTopologyChanged;
    subspace::emu::RecordError(cudaErrorGraphExecUpdateFailure);
    return cudaErrorGraphExecUpdateFailure;
  }
  exec->nodes = graph->nodes;
  if (info != nullptr) info->result = cudaGraphExecUpdateSuccess;
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) return cudaErrorInvalidValue;
  for (const GraphNode& node : exec->nodes) Submit(stream, node.key, node.op);
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  if (event == nullptr) return cudaErrorInvalidValue;
  *event = new CUevent_st;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  Submit(stream, &subspace::emu::kEventNode, [] {});
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  if (RefusedDuringCapture()) return cudaErrorStreamCaptureUnsupported;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::recursive_mutex> lock(g_api_mutex);
  if (RefusedDuringCapture()) return cudaErrorStreamCaptureUnsupported;
  return subspace::emu::PeekError();
}

cudaError_t cudaPeekAtLastError() { return subspace::emu::PeekError(); }
cudaError_t cudaGetLastError() { return subspace::emu::TakeError(); }

const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureImplicit:
      return "cudaErrorStreamCaptureImplicit";
    case cudaErrorGraphExecUpdateFailure:
      return "cudaErrorGraphExecUpdateFailure";
    default:
      return "cudaErrorUnknown (emulated)";
  }
}

const char* cudaGetErrorString(cudaError_t err) { return cudaGetErrorName(err); }

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return cudaErrorInvalidValue;
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return cudaErrorInvalidValue;
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return cudaErrorInvalidValue;
  if (device != 0) return cudaErrorInvalidDevice;
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name), "subspace CUDA emulator (CPU)");
  prop->major = 9;
  prop->minor = 0;
  prop->totalGlobalMem = subspace::emu::kEmulatedMemoryBytes;
  prop->multiProcessorCount = 1;
  prop->warpSize = subspace::emu::kWarpSize;
  prop->maxThreadsPerBlock = subspace::emu::kMaxThreadsPerBlock;
  prop->sharedMemPerBlock = subspace::emu::kSharedMemoryPerBlock;
  prop->sharedMemPerBlockOptin = subspace::emu::kSharedMemoryPerBlockOptin;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr) return cudaErrorInvalidValue;
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = subspace::emu::kSharedMemoryPerBlockOptin;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = subspace::emu::kSharedMemoryPerBlock;
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = 1;
      return cudaSuccess;
    case cudaDevAttrMaxPitch:
      *value = 0x7fffffff;
      return cudaSuccess;
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (func == nullptr) return cudaErrorInvalidDeviceFunction;
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  if (value < 0 || value > subspace::emu::kSharedMemoryPerBlockOptin) return cudaErrorInvalidValue;
  subspace::emu::SetMaxDynamicSharedMemory(func, value);
  return cudaSuccess;
}

}  // extern "C"
