// Runs our CUDA kernels on the CPU so their indexing, barriers, shuffles, shared-memory sizes and
// bounds are tested on every machine, not only where a GPU is lent. Force-included (before
// anything else) into each kernels/*.cu after tests/cuda_emu/rewrite_cu.cmake has turned its
// launches and `extern __shared__` arrays into the calls below; the host compiler then builds it.
//
// A CTA runs as blockDim fibers on the launching thread, one CTA after another: __syncthreads and
// the warp-synchronous intrinsics switch fibers, so barrier and shuffle semantics are exact
// (threads that exited count as arrived, as on sm_70+). What this cannot show: races between
// CTAs or between threads that do not synchronise (everything runs in one order), the device's
// approximate math (__expf is expf here), timing. It is a second check beside the GPU tests,
// never their replacement.
#ifndef SUBSPACE_TESTS_CUDA_EMU_CUDA_EMU_H_
#define SUBSPACE_TESTS_CUDA_EMU_CUDA_EMU_H_

// Shared arrays declared in a kernel body are shared by the CTA's fibers: a function-local static
// (CTAs run one at a time). Must precede the CUDA headers, which define __shared__ otherwise.
#define __shared__ static

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#define __launch_bounds__(...)

namespace subspace::emu {

// The running fiber's built-in variables.
const uint3& ThreadIdx();
const uint3& BlockIdx();
const dim3& BlockDim();
const dim3& GridDim();

void SyncThreads();
void SyncWarp();
// Every lane of the calling warp publishes `bits`; returns lane `src_lane`'s. `mask` must name
// exactly the warp's live lanes (a full mask on a partial warp is a launch failure, as the device
// leaves it undefined).
uint64_t ShuffleBits(unsigned mask, uint64_t bits, int src_lane);
int LaneId();

// The CTA's dynamic shared memory (poisoned with 0xff bytes at each CTA's start).
void* DynamicSharedBytes();
template <typename T>
T* DynamicShared() {
  return static_cast<T*>(DynamicSharedBytes());
}

// False, with the error recorded for cudaGetLastError, when the device would refuse to launch
// `kernel` so (its address keys the shared-memory limit cudaFuncSetAttribute set).
bool CheckLaunch(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem);

// Runs `body` as every thread of a grid<<<grid, block, smem>>>. A kernel that fails (a
// deadlock, a misused intrinsic) records cudaErrorLaunchFailure.
void Execute(dim3 grid, dim3 block, size_t dynamic_smem, const std::function<void()>& body);

// Runs `op` in `stream`'s order: now (the emulated device completes work as it is issued), or,
// while the stream is being captured, as the next node of the graph (`key` names the node's
// kind: cudaGraphExecUpdate accepts a graph whose nodes have the same keys in the same order).
void Submit(cudaStream_t stream, const void* key, std::function<void()> op);

// What `kernel<<<grid, block, smem, stream>>>(args...)` becomes after rewrite_cu.cmake.
class Launcher {
 public:
  Launcher(dim3 grid, dim3 block, size_t dynamic_smem = 0, cudaStream_t stream = nullptr)
      : grid_(grid), block_(block), smem_(dynamic_smem), stream_(stream) {}

  template <typename... Params, typename... Args>
  void Run(void (*kernel)(Params...), Args&&... args) const {
    const void* key = reinterpret_cast<const void*>(kernel);
    if (!CheckLaunch(key, grid_, block_, smem_)) return;
    // Kernel arguments are copied at launch (a captured graph keeps its own copy), as the device
    // copies them into constant memory.
    auto params =
        std::make_shared<std::tuple<std::decay_t<Params>...>>(std::forward<Args>(args)...);
    Submit(stream_, key, [kernel, params, grid = grid_, block = block_, smem = smem_] {
      Execute(grid, block, smem, [&] { std::apply(kernel, *params); });
    });
  }

 private:
  dim3 grid_, block_;
  size_t smem_;
  cudaStream_t stream_;
};

template <typename T>
uint64_t ToBits(T v) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
T FromBits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace subspace::emu

// cuda_runtime.h declares this overload for nvcc only.
template <typename T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}

#define threadIdx (::subspace::emu::ThreadIdx())
#define blockIdx (::subspace::emu::BlockIdx())
#define blockDim (::subspace::emu::BlockDim())
#define gridDim (::subspace::emu::GridDim())

inline void __syncthreads() { ::subspace::emu::SyncThreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::subspace::emu::SyncWarp(); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = ::subspace::emu::LaneId();
  const int src = (lane & ~(width - 1)) | ((lane % width) ^ lane_mask);
  return ::subspace::emu::FromBits<T>(
      ::subspace::emu::ShuffleBits(mask, ::subspace::emu::ToBits(v), src));
}

template <typename T>
T __ldg(const T* p) {
  return *p;
}

// One CTA runs at a time on one thread: a read-modify-write is atomic as written.
template <typename T>
T atomicOr(T* address, T v) {
  const T old = *address;
  *address = old | v;
  return old;
}

inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline float __int_as_float(int x) {
  return ::subspace::emu::FromBits<float>(static_cast<uint32_t>(x));
}
inline unsigned __float_as_uint(float x) {
  return static_cast<unsigned>(::subspace::emu::ToBits(x));
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __expf(float x) { return std::exp(x); }
using std::isfinite;  // device code calls these unqualified
using std::isinf;
using std::isnan;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

#endif  // SUBSPACE_TESTS_CUDA_EMU_CUDA_EMU_H_
