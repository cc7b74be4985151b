// The emulated device's kernel execution (tests/cuda_emu/cuda_emu.h): a CTA's threads as fibers
// on the launching thread, scheduled round-robin until each blocks at a barrier or returns.
//
// A fiber is entered the first time through makecontext/swapcontext and switched afterwards with
// _setjmp/_longjmp, which skip swapcontext's signal-mask system call: a CTA of 1024 threads
// switches twice per thread at every barrier. Fortified longjmp refuses jumps between stacks.
#undef _FORTIFY_SOURCE
#include <sanitizer/common_interface_defs.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tests/cuda_emu/cuda_emu.h"
#include "tests/cuda_emu/cuda_emu_device.h"

#if defined(__SANITIZE_ADDRESS__)
#define SUBSPACE_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SUBSPACE_EMU_ASAN 1
#endif
#endif

namespace subspace::emu {
namespace {

constexpr size_t kFiberStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t context;  // the first entry
  jmp_buf resume;      // every later one
  bool started = false;
  uint3 thread_idx;
  int warp = 0, lane = 0;
  bool done = false;
  // What the fiber waits for: a generation change of its CTA's or its warp's barrier.
  enum class Wait { kNone, kBlock, kWarp } wait = Wait::kNone;
  uint64_t wait_generation = 0;
};

struct Barrier {
  int arrived = 0, exited = 0, size = 0;
  uint64_t generation = 0;
};

// Shuffles alternate between two slot sets by barrier generation, so one barrier per shuffle
// suffices: a lane rewrites a set only after the next barrier, which every lane reaches after
// reading it.
struct Warp {
  Barrier barrier;
  uint64_t slots[2][kWarpSize] = {};
};

// A fiber stack with a PROT_NONE guard page below it: an overflow faults instead of corrupting
// the next stack.
class Stack {
 public:
  Stack() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    mapping_bytes_ = kFiberStackBytes + page;
    mapping_ =
        mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping_ == MAP_FAILED) {
      std::perror("cuda_emu: mmap of a fiber stack");
      std::abort();
    }
    mprotect(mapping_, page, PROT_NONE);
    base_ = static_cast<char*>(mapping_) + page;
  }
  ~Stack() { munmap(mapping_, mapping_bytes_); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  void* base() const { return base_; }

 private:
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  void* base_ = nullptr;
};

// The state of the CTA being run. One launch at a time per process (launches hold g_mutex).
struct Cta {
  dim3 grid, block;
  uint3 block_idx;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Barrier barrier;
  std::vector<unsigned char> dynamic_smem;
  const std::function<void()>* body = nullptr;
  Fiber* current = nullptr;
  ucontext_t scheduler_context;  // written by a fiber's first entry, never resumed
  jmp_buf scheduler;
  std::string failure;  // set by an intrinsic misused by the kernel; ends the launch
#if SUBSPACE_EMU_ASAN
  void* scheduler_fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
#endif
};

// Guards everything below; launches run one at a time.
std::recursive_mutex g_mutex;
Cta* g_cta = nullptr;                          // the running launch's CTA
std::vector<std::unique_ptr<Stack>> g_stacks;  // grown to the largest block seen, then reused
cudaError_t g_last_error = cudaSuccess;
std::map<const void*, int> g_max_dynamic_smem;

Cta& CurrentCta() {
  if (g_cta == nullptr || g_cta->current == nullptr) {
    std::fprintf(stderr, "cuda_emu: a device intrinsic was called outside a kernel\n");
    std::abort();
  }
  return *g_cta;
}

void SwitchToFiber(Cta& cta, Fiber& f, size_t fiber_index) {
  cta.current = &f;
#if SUBSPACE_EMU_ASAN
  __sanitizer_start_switch_fiber(&cta.scheduler_fake_stack, g_stacks[fiber_index]->base(),
                                 kFiberStackBytes);
#else
  (void)fiber_index;
#endif
  if (_setjmp(cta.scheduler) == 0) {
    if (!f.started) {
      f.started = true;
      swapcontext(&cta.scheduler_context, &f.context);
    } else {
      _longjmp(f.resume, 1);
    }
  }
#if SUBSPACE_EMU_ASAN
  __sanitizer_finish_switch_fiber(cta.scheduler_fake_stack, nullptr, nullptr);
#endif
  cta.current = nullptr;
}

// From a fiber back to the scheduler; returns when the scheduler resumes it.
void Yield(Cta& cta) {
  Fiber& f = *cta.current;
#if SUBSPACE_EMU_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, cta.scheduler_stack_bottom, cta.scheduler_stack_size);
#endif
  if (_setjmp(f.resume) == 0) _longjmp(cta.scheduler, 1);
#if SUBSPACE_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, &cta.scheduler_stack_bottom,
                                  &cta.scheduler_stack_size);
#endif
}

bool Released(const Barrier& b) { return b.size > 0 && b.arrived + b.exited == b.size; }

void Release(Barrier& b) {
  b.arrived = 0;
  ++b.generation;
}

// Arrive at `b` and wait until every live member has: exited members count as arrived.
void ArriveAndWait(Cta& cta, Barrier& b, Fiber::Wait kind) {
  Fiber& f = *cta.current;
  ++b.arrived;
  if (Released(b)) {
    Release(b);
    return;
  }
  f.wait = kind;
  f.wait_generation = b.generation;
  while (b.generation == f.wait_generation && cta.failure.empty()) Yield(cta);
  f.wait = Fiber::Wait::kNone;
}

void FiberMain() {
  Cta& cta = *g_cta;
#if SUBSPACE_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &cta.scheduler_stack_bottom, &cta.scheduler_stack_size);
#endif
  (*cta.body)();
  Fiber& f = *cta.current;
  f.done = true;
  // A thread that returns counts as arrived at every later barrier of its CTA and its warp.
  for (Barrier* b : {&cta.barrier, &cta.warps[static_cast<size_t>(f.warp)].barrier}) {
    ++b->exited;
    if (b->arrived > 0 && Released(*b)) Release(*b);
  }
#if SUBSPACE_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, cta.scheduler_stack_bottom, cta.scheduler_stack_size);
#endif
  _longjmp(cta.scheduler, 1);
}

bool CanRun(const Cta& cta, const Fiber& f) {
  switch (f.wait) {
    case Fiber::Wait::kNone:
      return true;
    case Fiber::Wait::kBlock:
      return cta.barrier.generation != f.wait_generation;
    case Fiber::Wait::kWarp:
      return cta.warps[static_cast<size_t>(f.warp)].barrier.generation != f.wait_generation;
  }
  return false;
}

// Runs one CTA to completion; false (with cta.failure set) when it cannot complete.
bool RunCta(Cta& cta) {
  const int n = static_cast<int>(cta.block.x * cta.block.y * cta.block.z);
  std::fill(cta.dynamic_smem.begin(), cta.dynamic_smem.end(), 0xff);
  cta.barrier = Barrier{0, 0, n, 0};
  for (int w = 0; w < static_cast<int>(cta.warps.size()); ++w) {
    cta.warps[static_cast<size_t>(w)] = Warp{};
    cta.warps[static_cast<size_t>(w)].barrier.size = std::min(kWarpSize, n - w * kWarpSize);
  }
  for (int t = 0; t < n; ++t) {
    Fiber& f = cta.fibers[static_cast<size_t>(t)];
    const auto ut = static_cast<unsigned>(t);
    f.thread_idx = {ut % cta.block.x, ut / cta.block.x % cta.block.y,
                    ut / (cta.block.x * cta.block.y)};
    f.warp = t / kWarpSize;
    f.lane = t % kWarpSize;
    f.done = false;
    f.started = false;
    f.wait = Fiber::Wait::kNone;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = g_stacks[static_cast<size_t>(t)]->base();
    f.context.uc_stack.ss_size = kFiberStackBytes;
    f.context.uc_link = nullptr;  // FiberMain jumps back to the scheduler itself
    makecontext(&f.context, FiberMain, 0);
  }
  int remaining = n;
  while (remaining > 0) {
    bool progressed = false;
    for (int t = 0; t < n; ++t) {
      Fiber& f = cta.fibers[static_cast<size_t>(t)];
      if (f.done || !CanRun(cta, f)) continue;
      SwitchToFiber(cta, f, static_cast<size_t>(t));
      progressed = true;
      if (f.done) --remaining;
      if (!cta.failure.empty()) return false;
    }
    if (!progressed) {
      int at_block = 0, at_warp = 0;
      for (const Fiber& f : cta.fibers) {
        if (f.done) continue;
        (f.wait == Fiber::Wait::kBlock ? at_block : at_warp)++;
      }
      cta.failure = "deadlock: " + std::to_string(at_block) + " threads wait at __syncthreads, " +
                    std::to_string(at_warp) +
                    " at a warp-synchronous intrinsic (divergent barrier)";
      return false;
    }
  }
  return true;
}

cudaError_t ConfigurationError(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem,
                               std::string* why) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    *why = "invalid launch configuration";
    return cudaErrorInvalidConfiguration;
  }
  int limit = kSharedMemoryPerBlock;
  if (auto it = g_max_dynamic_smem.find(kernel); it != g_max_dynamic_smem.end()) limit = it->second;
  if (dynamic_smem > static_cast<size_t>(limit)) {
    *why = std::to_string(dynamic_smem) + " bytes of dynamic shared memory over the kernel's " +
           std::to_string(limit) + " (cudaFuncAttributeMaxDynamicSharedMemorySize)";
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // namespace

void RecordError(cudaError_t err) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  g_last_error = err;
}

cudaError_t PeekError() {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  return g_last_error;
}

cudaError_t TakeError() {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  const cudaError_t err = g_last_error;
  g_last_error = cudaSuccess;
  return err;
}

void SetMaxDynamicSharedMemory(const void* kernel, int bytes) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  g_max_dynamic_smem[kernel] = bytes;
}

bool CheckLaunch(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  std::string why;
  const cudaError_t err = ConfigurationError(kernel, grid, block, dynamic_smem, &why);
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "cuda_emu: launch refused: %s\n", why.c_str());
  g_last_error = err;
  return false;
}

const uint3& ThreadIdx() { return CurrentCta().current->thread_idx; }
const uint3& BlockIdx() { return CurrentCta().block_idx; }
const dim3& BlockDim() { return CurrentCta().block; }
const dim3& GridDim() { return CurrentCta().grid; }
int LaneId() { return CurrentCta().current->lane; }
void* DynamicSharedBytes() { return CurrentCta().dynamic_smem.data(); }

void SyncThreads() {
  Cta& cta = CurrentCta();
  ArriveAndWait(cta, cta.barrier, Fiber::Wait::kBlock);
}

void SyncWarp() {
  Cta& cta = CurrentCta();
  ArriveAndWait(cta, cta.warps[static_cast<size_t>(cta.current->warp)].barrier, Fiber::Wait::kWarp);
}

uint64_t ShuffleBits(unsigned mask, uint64_t bits, int src_lane) {
  Cta& cta = CurrentCta();
  const Fiber& f = *cta.current;
  Warp& w = cta.warps[static_cast<size_t>(f.warp)];
  const int size = w.barrier.size;
  const unsigned live = size == kWarpSize ? 0xffffffffu : (1u << size) - 1u;
  if (mask != live || w.barrier.exited > 0) {
    char why[128];
    std::snprintf(why, sizeof(why),
                  "a warp shuffle with mask 0x%08x in a warp of %d live lanes (undefined on the "
                  "device)",
                  mask, size - w.barrier.exited);
    cta.failure = why;
    Yield(cta);  // the scheduler ends the launch; never resumed
  }
  uint64_t* slots = w.slots[w.barrier.generation & 1];
  slots[f.lane] = bits;
  ArriveAndWait(cta, w.barrier, Fiber::Wait::kWarp);
  return src_lane >= 0 && src_lane < size ? slots[src_lane] : bits;
}

void Execute(dim3 grid, dim3 block, size_t dynamic_smem, const std::function<void()>& body) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  if (g_cta != nullptr) {
    std::fprintf(stderr, "cuda_emu: a kernel launched from inside a kernel\n");
    std::abort();
  }
  const size_t n = size_t{block.x} * block.y * block.z;
  while (g_stacks.size() < n) g_stacks.push_back(std::make_unique<Stack>());
  Cta cta;
  cta.grid = grid;
  cta.block = block;
  cta.fibers.resize(n);
  cta.warps.resize((n + kWarpSize - 1) / kWarpSize);
  cta.dynamic_smem.resize(std::max<size_t>(dynamic_smem, 1));
  cta.body = &body;
  g_cta = &cta;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        cta.block_idx = {x, y, z};
        if (!RunCta(cta)) {
          std::fprintf(stderr, "cuda_emu: kernel failed in block (%u, %u, %u): %s\n", x, y, z,
                       cta.failure.c_str());
          g_last_error = cudaErrorLaunchFailure;
          g_cta = nullptr;
          return;
        }
      }
    }
  }
  g_cta = nullptr;
}

}  // namespace subspace::emu
