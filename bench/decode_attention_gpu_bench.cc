// GPU decode attention (kernels/decode_attention.h, one layer) over a full-rank fp16 pool and
// over the compressed layout (sink and window blocks full, the rest rank-r coefficient slots),
// set against the device's copy bandwidth. Prints a markdown table for bench/RESULTS.md; without
// a CUDA device it says so and exits 0, so it can be run blind.
//
// Bytes per launch are the bytes the kernel must read: the tokens present in each full block
// (K and V rows, all KV heads), the payload of each compressed slot (codes, int8 scales; not the
// slot's rounding), q, the basis matrices of the live epochs (P_q and R_v) and the whole plan.
// Not counted: the split-K partials the split kernel writes and the merge kernel reads back, and
// the output. Each rep reads its own copy of the pool (up to 256 copies, rotated so that the
// others' reads between two uses of one exceed 2x L2), so the bytes come from HBM as they do in
// a model whose other layers went through L2 between two steps of this one.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "cli/flags.h"
#include "core/base/int_math.h"
#include "core/base/tensor_types.h"
#include "cuda/decode_plan_builder.h"
#include "kernels/decode_attention.h"

ABSL_FLAG(std::string, contexts, "1024,4096,16384,32768", "tokens each sequence attends");
ABSL_FLAG(std::string, batches, "1,8,16,64", "sequences per decode step");
ABSL_FLAG(int, n_heads, 32, "query heads");
ABSL_FLAG(int, n_kv, 8, "KV heads");
ABSL_FLAG(int, head_dim, 128, "head dimension (the kernel supports 64 and 128)");
ABSL_FLAG(int, block_size, 16, "tokens per block (B)");
ABSL_FLAG(int, rank, 32, "r_k = r_v of the compressed blocks");
ABSL_FLAG(std::string, coeff, "fp16", "coefficient codes of the compressed blocks: fp16 or int8");
ABSL_FLAG(int, epochs, 1,
          "basis epochs live in each sequence (1..8); the compressed blocks are split evenly "
          "between them, oldest blocks in epoch 0");
ABSL_FLAG(int, sink_tokens, 4, "leading tokens kept full-rank (their blocks stay full)");
ABSL_FLAG(int, window_tokens, 64, "trailing tokens kept full-rank (their blocks stay full)");
ABSL_FLAG(int, warmup, 3, "untimed launches per cell and layout (at least 1)");
ABSL_FLAG(int, reps, 20, "timed launches per cell and layout (median)");
ABSL_FLAG(int, copy_mib, 1024, "MiB per device-to-device copy");
ABSL_FLAG(int, copy_reps, 10, "timed copies (median)");
ABSL_FLAG(int, device, 0, "CUDA device index");
ABSL_FLAG(
    int, ctas_per_sm, 8,
    "split-K plan: target CTAs (work items x KV heads) per multiprocessor; the server's is 8");
ABSL_FLAG(bool, cold, true,
          "rotate over copies of the pool so that every launch reads HBM, not L2");
ABSL_FLAG(uint64_t, seed, 1, "seed of the data and of the page shuffle");

namespace subspace::kernels {
namespace {

void CheckCuda(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "%s:%d: %s: %s (%s)\n", file, line, what, cudaGetErrorName(err),
               cudaGetErrorString(err));
  std::exit(1);
}
#define BENCH_CUDA(expr) ::subspace::kernels::CheckCuda((expr), #expr, __FILE__, __LINE__)

[[noreturn]] void Fail(const std::string& why) {
  std::fprintf(stderr, "subspace-bench-decode-attention: %s\n", why.c_str());
  std::exit(1);
}

std::vector<int> ParseList(const std::string& flag, const std::string& s) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1)
      Fail("--" + flag + ": bad entry '" + std::string(part) + "'");
    out.push_back(v);
  }
  return out;
}

// Owns device bytes. An out-of-memory allocation is an answer (the cell is skipped), any other
// failure ends the program.
class DeviceBytes {
 public:
  DeviceBytes() = default;
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() { Reset(); }

  bool TryAlloc(size_t bytes) {
    Reset();
    if (bytes == 0) return true;
    const cudaError_t err = cudaMalloc(&ptr_, bytes);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky; clear it so later checks start clean
      ptr_ = nullptr;
      return false;
    }
    BENCH_CUDA(err);
    bytes_ = bytes;
    return true;
  }
  void Alloc(size_t bytes) {
    if (!TryAlloc(bytes)) Fail("out of device memory for " + std::to_string(bytes) + " bytes");
  }
  void Reset() {
    if (ptr_ != nullptr) BENCH_CUDA(cudaFree(ptr_));
    ptr_ = nullptr;
    bytes_ = 0;
  }
  template <typename T = uint8_t>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

template <typename T>
void Upload(DeviceBytes& dst, const std::vector<T>& host) {
  dst.Alloc(host.size() * sizeof(T));
  BENCH_CUDA(cudaMemcpy(dst.get(), host.data(), dst.bytes(), cudaMemcpyHostToDevice));
  // From pageable memory cudaMemcpy may return before the device has the bytes.
  BENCH_CUDA(cudaDeviceSynchronize());
}

// N(0, 1) fp16 values, uploaded once and tiled over every pool by device copies (this file is
// plain C++, no fill kernel of its own). They serve as fp16 rows, fp16 codes and int8 scales; the
// same bytes read as int8 codes are finite too, so every layout gives finite outputs.
class PoolFiller {
 public:
  explicit PoolFiller(std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> halves(kBytes / 2);
    for (uint16_t& h : halves) h = Fp32ToFp16(normal(rng));
    Upload(pattern_, halves);
  }
  void Fill(uint8_t* dst, size_t bytes, cudaStream_t stream) const {
    for (size_t at = 0; at < bytes; at += kBytes) {
      BENCH_CUDA(cudaMemcpyAsync(dst + at, pattern_.get(), std::min(kBytes, bytes - at),
                                 cudaMemcpyDeviceToDevice, stream));
    }
  }

 private:
  static constexpr size_t kBytes = size_t{16} << 20;
  DeviceBytes pattern_;
};

// Holds a stream at a host function until Open(): a batch of reps is queued whole before any of
// it runs, so the launcher's host work (device queries, two launches) and the event records never
// leave the GPU idle between a rep's two events. Batches stay far below the launch queue's depth
// (a full queue would block the host behind a closed gate). The timeout is a second guard, for
// a launch that waits on the stream itself (lazy module loading may synchronize the context:
// hence at least one warmup launch); it is reported, as those reps then include host time.
class StreamGate {
 public:
  void Close(cudaStream_t stream) {
    open_.store(false, std::memory_order_release);
    BENCH_CUDA(cudaLaunchHostFunc(stream, &Wait, this));
  }
  void Open() { open_.store(true, std::memory_order_release); }
  bool timed_out() const { return timed_out_.load(std::memory_order_acquire); }

 private:
  static void CUDART_CB Wait(void* self) {
    auto* gate = static_cast<StreamGate*>(self);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!gate->open_.load(std::memory_order_acquire)) {
      if (std::chrono::steady_clock::now() > deadline) {
        gate->timed_out_.store(true, std::memory_order_release);
        return;
      }
      std::this_thread::yield();
    }
  }
  std::atomic<bool> open_{true};
  std::atomic<bool> timed_out_{false};
};

constexpr int kRepsPerGate = 32;

struct Timer {
  cudaStream_t stream = nullptr;
  StreamGate gate;
  cudaEvent_t events[2 * kRepsPerGate] = {};
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median microseconds of `reps` launches, rep i on params[i % params.size()], after `warmup`.
double TimeDecode(const std::vector<DecodeAttentionParams>& params, int warmup, int reps,
                  Timer& t) {
  const size_t n_par = params.size();
  for (int i = 0; i < warmup; ++i) BENCH_CUDA(LaunchDecodeAttention(params[i % n_par], t.stream));
  BENCH_CUDA(cudaStreamSynchronize(t.stream));
  std::vector<double> us;
  for (int r0 = 0; r0 < reps; r0 += kRepsPerGate) {
    const int n = std::min(kRepsPerGate, reps - r0);
    t.gate.Close(t.stream);
    for (int i = 0; i < n; ++i) {
      BENCH_CUDA(cudaEventRecord(t.events[2 * i], t.stream));
      BENCH_CUDA(LaunchDecodeAttention(params[(r0 + i) % n_par], t.stream));
      BENCH_CUDA(cudaEventRecord(t.events[2 * i + 1], t.stream));
    }
    t.gate.Open();
    BENCH_CUDA(cudaStreamSynchronize(t.stream));
    for (int i = 0; i < n; ++i) {
      float ms = 0.0f;
      BENCH_CUDA(cudaEventElapsedTime(&ms, t.events[2 * i], t.events[2 * i + 1]));
      us.push_back(1e3 * ms);
    }
  }
  if (t.gate.timed_out()) {
    std::fprintf(stderr, "warning: the stream gate timed out; times include host work\n");
  }
  return Median(us);
}

// Device-to-device copy bandwidth, counting read + write bytes (2 x size), as memcpy bandwidth
// is usually quoted. The attention kernel's GB/s counts bytes read only (its writes are tiny),
// and its "% of copy" columns are judged against this read + write figure: a copy streams reads
// and writes at once, so read + write is the rate the memory system sustains. Returns 0 when the
// two buffers do not fit.
double CopyBandwidthGBps(size_t bytes, int reps, Timer& t) {
  DeviceBytes src, dst;
  if (!src.TryAlloc(bytes) || !dst.TryAlloc(bytes)) return 0.0;
  BENCH_CUDA(cudaMemsetAsync(src.get(), 0x3c, bytes, t.stream));
  BENCH_CUDA(cudaMemsetAsync(dst.get(), 0, bytes, t.stream));
  BENCH_CUDA(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, t.stream));
  std::vector<double> s;
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaEventRecord(t.events[0], t.stream));
    BENCH_CUDA(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, t.stream));
    BENCH_CUDA(cudaEventRecord(t.events[1], t.stream));
    BENCH_CUDA(cudaEventSynchronize(t.events[1]));
    float ms = 0.0f;
    BENCH_CUDA(cudaEventElapsedTime(&ms, t.events[0], t.events[1]));
    s.push_back(1e-3 * ms);
  }
  return 2.0 * static_cast<double>(bytes) / Median(s) / 1e9;
}

struct BenchConfig {
  KvPoolLayout layout;
  int n_heads = 0;
  int n_epochs = 1;
  int sink_tokens = 0;
  int window_tokens = 0;
  int target_ctas = 0;
  int warmup = 0;
  int reps = 0;
  bool cold = true;
  int64_t l2_bytes = 0;
};

// One replica's block tables: pages shuffled over the pool (a pool that has served a while),
// full pages first in the shuffled order, then slab pages filled slot by slot.
struct CellLayout {
  std::vector<cuda::DecodeSeqDesc> seqs;
  int64_t num_pages = 0;  // of one replica
  int64_t kv_bytes = 0;   // pool bytes one launch reads
  int live_epochs = 0;
};

CellLayout LayOutCell(const BenchConfig& c, int ctx, int batch, bool compressed,
                      std::mt19937_64& rng) {
  const KvPoolLayout& l = c.layout;
  const int bs = l.block_size, n_kv = l.n_kv_heads;
  const int64_t nb = CeilDiv(ctx, bs);
  // As CompressedKvCache::Commit: a block compresses when it holds no sink token and ends at or
  // before the window's first token.
  const int64_t first = CeilDiv(c.sink_tokens, bs);
  const int64_t last = (static_cast<int64_t>(ctx) - c.window_tokens) / bs;  // one past
  const int64_t n_comp = compressed ? std::max<int64_t>(0, last - first) : 0;
  const int64_t full_pages = batch * (nb - n_comp);
  const int64_t slots = batch * n_comp;
  const int per_page = l.SlotsPerPage();
  CellLayout cell;
  cell.num_pages = full_pages + CeilDiv(slots, per_page);
  std::vector<int32_t> ids(static_cast<size_t>(cell.num_pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  int64_t next_full = 0, next_slot = 0;
  const int64_t row_bytes = static_cast<int64_t>(n_kv) * l.head_dim * 2 * 2;  // K and V, fp16
  std::vector<bool> used(static_cast<size_t>(c.n_epochs), false);
  for (int s = 0; s < batch; ++s) {
    cuda::DecodeSeqDesc d;
    d.length = ctx;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k = b - first;  // index among the compressed blocks
      if (k < 0 || k >= n_comp) {
        d.pages.push_back(ids[static_cast<size_t>(next_full++)]);
        d.slots.push_back(kFullBlock);
        d.epochs.insert(d.epochs.end(), static_cast<size_t>(n_kv), -1);
        cell.kv_bytes += std::min<int64_t>(bs, ctx - b * bs) * row_bytes;
        continue;
      }
      d.pages.push_back(ids[static_cast<size_t>(full_pages + next_slot / per_page)]);
      d.slots.push_back(static_cast<int32_t>(next_slot % per_page));
      ++next_slot;
      const int32_t e = static_cast<int32_t>(k * c.n_epochs / n_comp);
      used[static_cast<size_t>(e)] = true;
      d.epochs.insert(d.epochs.end(), static_cast<size_t>(n_kv), e);
      cell.kv_bytes += l.CompressedBytes();
    }
    cell.seqs.push_back(std::move(d));
  }
  cell.live_epochs = static_cast<int>(std::count(used.begin(), used.end(), true));
  return cell;
}

struct Shared {
  DeviceBytes q, basis_pq, basis_rv, out;  // q and out sized for the largest batch
  const PoolFiller* filler = nullptr;
};

struct Result {
  bool skipped = false;  // out of device memory
  double us = 0.0;
  int64_t bytes = 0;      // read per launch
  int64_t nonfinite = 0;  // output elements that are not finite
};

// Lays out, fills, plans and times one layout of one cell.
Result RunLayout(const BenchConfig& c, int ctx, int batch, bool compressed, Shared& sh, Timer& t,
                 std::mt19937_64& rng) {
  const KvPoolLayout& l = c.layout;
  const CellLayout cell = LayOutCell(c, ctx, batch, compressed, rng);
  int64_t replicas = 1;
  if (c.cold) {  // the other replicas' reads between two uses of one replica exceed 2x L2
    replicas = std::clamp<int64_t>(CeilDiv(2 * c.l2_bytes, std::max<int64_t>(cell.kv_bytes, 1)) + 1,
                                   1, 256);
  }
  Result r;
  DeviceBytes pool;
  if (!pool.TryAlloc(static_cast<size_t>(replicas * cell.num_pages * l.page_bytes))) {
    r.skipped = true;
    return r;
  }
  sh.filler->Fill(pool.get(), pool.bytes(), t.stream);

  // One plan for every copy: page ids are relative to p.pool, so copy i is the same block
  // tables over the pool base moved by i copies.
  absl::StatusOr<cuda::DecodePlan> plan = cuda::BuildDecodePlan(
      l, cell.num_pages, c.n_epochs, cell.seqs, {.target_ctas = c.target_ctas});
  if (!plan.ok()) Fail(std::string(plan.status().message()));
  DeviceBytes plan_d, workspace;
  if (!plan_d.TryAlloc(static_cast<size_t>(plan->bytes())) ||
      !workspace.TryAlloc(static_cast<size_t>(
          DecodeWorkspaceFloats(plan->HostView(), l, c.n_heads, false) * sizeof(float)))) {
    r.skipped = true;
    return r;
  }
  BENCH_CUDA(cudaMemcpy(plan_d.get(), plan->data(), static_cast<size_t>(plan->bytes()),
                        cudaMemcpyHostToDevice));
  std::vector<DecodeAttentionParams> params;
  for (int64_t i = 0; i < replicas; ++i) {
    DecodeAttentionParams p;
    p.layout = l;
    p.plan = plan->DeviceView(plan_d.get());
    p.pool = pool.get() + i * cell.num_pages * l.page_bytes;
    p.basis_pq = sh.basis_pq.get<float>();
    p.basis_rv = sh.basis_rv.get<float>();
    p.q = sh.q.get<float>();
    p.out = sh.out.get<float>();
    p.workspace = workspace.get<float>();
    p.n_heads = c.n_heads;
    p.sm_scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));
    params.push_back(p);
  }
  BENCH_CUDA(cudaStreamSynchronize(t.stream));  // the pool's fill

  const int64_t q_bytes = static_cast<int64_t>(batch) * c.n_heads * l.head_dim * 4;
  const int64_t basis_bytes = static_cast<int64_t>(cell.live_epochs) * l.n_kv_heads * l.head_dim *
                              (l.rank_k + l.rank_v) * 4;
  r.bytes = cell.kv_bytes + q_bytes + basis_bytes + plan->bytes();
  r.us = TimeDecode(params, c.warmup, c.reps, t);

  std::vector<float> out(static_cast<size_t>(batch) * c.n_heads * l.head_dim);
  BENCH_CUDA(
      cudaMemcpy(out.data(), sh.out.get(), out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  r.nonfinite = std::count_if(out.begin(), out.end(), [](float x) { return !std::isfinite(x); });
  return r;
}

std::string Now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M UTC", &tm);
  return buf;
}

int Main(int argc, char** argv) {
  std::string command;
  for (int i = 0; i < argc; ++i) {
    if (i > 0) command += ' ';
    command += argv[i];
  }
  subspace::cli::ParseFlags(argc, argv, "subspace-bench-decode-attention [flags]");

  BenchConfig c;
  const std::string coeff = absl::GetFlag(FLAGS_coeff);
  if (coeff != "fp16" && coeff != "int8") Fail("--coeff must be fp16 or int8");
  const int rank = absl::GetFlag(FLAGS_rank);
  c.layout = MakeKvPoolLayout(absl::GetFlag(FLAGS_n_kv), absl::GetFlag(FLAGS_head_dim),
                              absl::GetFlag(FLAGS_block_size), rank, rank,
                              coeff == "int8" ? CoeffDtype::kInt8 : CoeffDtype::kFp16);
  if (const char* err = KvPoolLayoutError(c.layout)) Fail(err);
  if (c.layout.head_dim != 64 && c.layout.head_dim != 128) {
    Fail("--head_dim: the kernel supports 64 and 128");
  }
  c.n_heads = absl::GetFlag(FLAGS_n_heads);
  if (c.n_heads < 1 || c.n_heads % c.layout.n_kv_heads != 0)
    Fail("--n_heads: a multiple of --n_kv");
  c.n_epochs = absl::GetFlag(FLAGS_epochs);
  if (c.n_epochs < 1 || c.n_epochs > kMaxSeqEpochs) Fail("--epochs outside [1, 8]");
  c.sink_tokens = std::max(0, absl::GetFlag(FLAGS_sink_tokens));
  c.window_tokens = std::max(0, absl::GetFlag(FLAGS_window_tokens));
  c.warmup = std::max(1, absl::GetFlag(FLAGS_warmup));  // loads the kernels (StreamGate)
  c.reps = std::max(1, absl::GetFlag(FLAGS_reps));
  c.cold = absl::GetFlag(FLAGS_cold);
  const int ctas_per_sm = absl::GetFlag(FLAGS_ctas_per_sm);
  if (ctas_per_sm < 1) Fail("--ctas_per_sm must be at least 1");
  const std::vector<int> contexts = ParseList("contexts", absl::GetFlag(FLAGS_contexts));
  const std::vector<int> batches = ParseList("batches", absl::GetFlag(FLAGS_batches));

  // Flags are checked before the device so that a blind run catches their mistakes too.
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess || count == 0) {
    std::printf("no CUDA device: %s\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "the driver lists none");
    return 0;
  }
  const int device = absl::GetFlag(FLAGS_device);
  if (device < 0 || device >= count) Fail("--device outside [0, " + std::to_string(count) + ")");
  BENCH_CUDA(cudaSetDevice(device));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, device));
  int driver = 0, runtime = 0;
  BENCH_CUDA(cudaDriverGetVersion(&driver));
  BENCH_CUDA(cudaRuntimeGetVersion(&runtime));

  c.target_ctas = ctas_per_sm * prop.multiProcessorCount;
  c.l2_bytes = prop.l2CacheSize;
  const KvPoolLayout& l = c.layout;

  Timer t;
  BENCH_CUDA(cudaStreamCreate(&t.stream));
  for (cudaEvent_t& e : t.events) BENCH_CUDA(cudaEventCreate(&e));

  std::printf(
      "### Decode attention on %s (sm_%d%d, %d SMs, %.1f GiB, L2 %.0f MiB; driver %d, "
      "runtime %d) — %s\n\n",
      prop.name, prop.major, prop.minor, prop.multiProcessorCount,
      static_cast<double>(prop.totalGlobalMem) / (1 << 30),
      static_cast<double>(prop.l2CacheSize) / (1 << 20), driver, runtime, Now().c_str());
  std::printf("`%s`\n\n", command.c_str());
  std::fflush(stdout);

  const size_t copy_bytes = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_copy_mib))) << 20;
  const double copy_gbps =
      CopyBandwidthGBps(copy_bytes, std::max(1, absl::GetFlag(FLAGS_copy_reps)), t);
  if (copy_gbps > 0.0) {
    std::printf(
        "Device-to-device copy of %zu MiB, median of %d: %.0f GB/s read + write (%.0f GB/s "
        "each way). The %% columns compare the kernel's bytes read per second with the "
        "read + write figure.\n\n",
        copy_bytes >> 20, absl::GetFlag(FLAGS_copy_reps), copy_gbps, copy_gbps / 2);
  } else {
    std::printf("Device-to-device copy of %zu MiB: skipped (memory).\n\n", copy_bytes >> 20);
  }

  std::printf(
      "One layer: %d query heads, %d KV heads, head_dim %d, B %d. Compressed: r_k = r_v = "
      "%d %s, %d epoch%s, sinks %d and window %d tokens full. Plan: target_ctas = %d x SMs "
      "= %d. %s, warmup %d, median of %d. GB/s = bytes read (full blocks' tokens, slot "
      "payloads, q, live bases, plan) / time.\n\n",
      c.n_heads, l.n_kv_heads, l.head_dim, l.block_size, rank, coeff.c_str(), c.n_epochs,
      c.n_epochs > 1 ? "s" : "", c.sink_tokens, c.window_tokens, ctas_per_sm, c.target_ctas,
      c.cold ? "Cold (pool copies rotated past 2x L2)" : "Warm (one pool, L2 may hold it)",
      c.warmup, c.reps);
  std::printf(
      "| context | batch | full us | full GB/s | full %% copy | compressed us | "
      "compressed GB/s | compressed %% copy | byte ratio | speedup | speedup / byte "
      "ratio |\n");
  std::printf("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n");
  std::fflush(stdout);

  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const PoolFiller filler(rng);
  Shared sh;
  sh.filler = &filler;
  {
    const int max_batch = *std::max_element(batches.begin(), batches.end());
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(max_batch) * c.n_heads * l.head_dim);
    for (float& x : q) x = normal(rng);
    Upload(sh.q, q);
    sh.out.Alloc(q.size() * sizeof(float));
    // Basis entries N(0, 1/d): projections keep the scale of q and of the values.
    std::normal_distribution<float> basis(0.0f, 1.0f / std::sqrt(static_cast<float>(l.head_dim)));
    std::vector<float> pq(static_cast<size_t>(c.n_epochs) * l.n_kv_heads * l.head_dim * l.rank_k);
    std::vector<float> rv(static_cast<size_t>(c.n_epochs) * l.n_kv_heads * l.rank_v * l.head_dim);
    for (float& x : pq) x = basis(rng);
    for (float& x : rv) x = basis(rng);
    Upload(sh.basis_pq, pq);
    Upload(sh.basis_rv, rv);
  }

  const auto gbps = [](const Result& r) { return static_cast<double>(r.bytes) / r.us / 1e3; };
  const auto cells = [&](const Result& r) {
    if (r.skipped) return std::string("skipped (memory) | — | —");
    char buf[96];
    const double g = gbps(r);
    if (copy_gbps > 0.0) {
      std::snprintf(buf, sizeof(buf), "%.1f | %.0f | %.0f %%", r.us, g, 100.0 * g / copy_gbps);
    } else {
      std::snprintf(buf, sizeof(buf), "%.1f | %.0f | —", r.us, g);
    }
    return std::string(buf);
  };
  for (int ctx : contexts) {
    for (int batch : batches) {
      const Result full = RunLayout(c, ctx, batch, /*compressed=*/false, sh, t, rng);
      const Result comp = RunLayout(c, ctx, batch, /*compressed=*/true, sh, t, rng);
      std::string ratios = "— | — | —";
      if (!full.skipped && !comp.skipped) {
        char buf[96];
        const double bytes_ratio = static_cast<double>(full.bytes) / comp.bytes;
        const double speedup = full.us / comp.us;
        std::snprintf(buf, sizeof(buf), "%.2f | %.2f | %.2f", bytes_ratio, speedup,
                      speedup / bytes_ratio);
        ratios = buf;
      }
      std::printf("| %d | %d | %s | %s | %s |\n", ctx, batch, cells(full).c_str(),
                  cells(comp).c_str(), ratios.c_str());
      std::fflush(stdout);
      for (const Result* r : {&full, &comp}) {
        if (r->nonfinite > 0) {
          std::fprintf(stderr, "warning: context %d batch %d %s: %lld non-finite outputs\n", ctx,
                       batch, r == &full ? "full" : "compressed",
                       static_cast<long long>(r->nonfinite));
        }
      }
    }
  }
  for (cudaEvent_t e : t.events) BENCH_CUDA(cudaEventDestroy(e));
  BENCH_CUDA(cudaStreamDestroy(t.stream));
  return 0;
}

}  // namespace
}  // namespace subspace::kernels

int main(int argc, char** argv) { return subspace::kernels::Main(argc, argv); }
