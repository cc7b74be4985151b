// MatMul y = x·wᵀ for weights in their stored type: ISA selection, the scalar fallback, the
// thread split of both paths and the sgemm-based prefill path. The AVX2 kernels live in
// matmul_avx2.cc.
//
// Design, from bench/matmul_bench.cc on the 2-core EPYC dev box:
// - The float decode kernel streams each weight row once against groups of up to 4 activation
//   rows held in registers. Per core it matches converting + sgemm up to n of 64 (F32) and
//   beats it through n = 128 for F16/BF16 (~100 vs ~80 GFLOP/s), hence DecodeMaxN; much past
//   that, x no longer stays in cache between weight rows.
// - Quantized weights (q4_0 ... q6_K, q8_0) decode as llama.cpp does: the activations are
//   quantized to 8 bits once per call and each weight row is dotted with them in integers
//   (quant_dot_avx2.cc), reading the weights in their stored size.
// - MatMuls runs the weights that read one x (Q/K/V, gate/up) in one parallel region: a decode
//   step on a 1 B model is ~110 matmuls of 0.1-1 ms, and each fork/join, idle tail and
//   quantization of x cost a few percent of that (Q8_0 decode +3 %).
// - Prefill: OpenMP threads claim panels of rows, convert them to fp32 and call a
//   single-threaded sgemm each. With OpenBLAS threading sgemm itself, its pthread pool and
//   the OpenMP pool of the ops between matmuls spun against each other (an RmsNorm before an
//   F32 n=64 sgemm added ~15 ms), and one core idled while the other converted.
#include <cblas.h>
#include <omp.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

#include "absl/types/span.h"
#include "core/base/quant_blocks.h"
#include "core/base/tensor_types.h"
#include "core/cpu/matmul_internal.h"
#include "core/cpu/ops.h"

// OpenBLAS's own API; declared here too because a netlib cblas.h (picked by
// update-alternatives) lacks it. The library linked is always OpenBLAS.
extern "C" void openblas_set_num_threads(int num_threads);

namespace subspace::cpu {
namespace internal {
namespace {

Isa Detect() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  // F16C through CPUID leaf 1: clang before 15 rejects __builtin_cpu_supports("f16c").
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kScalar;
}

std::atomic<int> max_isa{static_cast<int>(Isa::kAvx2)};
std::atomic<int> thread_count{0};  // 0: OpenMP's default
std::atomic<int64_t> panel_rows_override{0};

// Below this many weight bytes per thread, waking a second thread costs more than it saves
// (an OpenMP fork/join is a few microseconds; 128 KiB streams in about 6).
constexpr uint64_t kMinBytesPerThread = 128 * 1024;
// Decode work items hold at least this many weight bytes.
constexpr uint64_t kMinItemBytes = 32 * 1024;
// A converted panel stays within this many bytes per thread.
constexpr int64_t kMaxPanelBytes = 16 << 20;

using DecodeFn = void (*)(const WeightMatrix&, const float*, int64_t, int64_t, int64_t, float*);

int64_t RoundUp(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Rows of fp32 per sgemm call: larger panels repack x fewer times (matters at large n), but
// each costs a per-thread buffer.
int64_t PanelRows(int64_t n, int64_t cols) {
  const int64_t override_rows = panel_rows_override.load();
  if (override_rows > 0) return override_rows;
  const int64_t wanted = n <= 128 ? 256 : 512;
  const int64_t fits = kMaxPanelBytes / (cols * static_cast<int64_t>(sizeof(float)));
  return std::max<int64_t>(16, std::min(wanted, fits));
}

// Rows [begin, end) of y = x·wᵀ on the calling thread.
// x: [n, w.cols], y: [n, w.rows]
void PrefillRows(const WeightMatrix& w, const float* x, int64_t n, int64_t begin, int64_t end,
                 float* y) {
  const int64_t cols = w.cols;
  // sgemm takes fp32 weights in place when they are float-aligned (GGUF allows less).
  if (w.type == TensorType::kF32 && reinterpret_cast<uintptr_t>(w.data) % alignof(float) == 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, end - begin, cols, 1.0f, x, cols,
                reinterpret_cast<const float*>(w.row(begin)), cols, 0.0f, y + begin, w.rows);
    return;
  }
  const int64_t panel = std::min(PanelRows(n, cols), end - begin);
  // Per thread and reused across calls: a fresh buffer per call would page-fault in
  // megabytes each time.
  thread_local std::vector<float> buffer;
  buffer.resize(panel * cols);
  for (int64_t r0 = begin; r0 < end; r0 += panel) {
    const int64_t count = std::min(panel, end - r0);
    ConvertRowsToF32(w, r0, count, buffer.data());
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, count, cols, 1.0f, x, cols,
                buffer.data(), cols, 0.0f, y + r0, w.rows);
  }
}

}  // namespace

Isa DetectedIsa() {
  static const Isa detected = Detect();
  return detected;
}

Isa ActiveIsa() {
  return static_cast<Isa>(std::min(static_cast<int>(DetectedIsa()), max_isa.load()));
}

void SetMaxIsa(Isa isa) { max_isa.store(static_cast<int>(isa)); }

ScopedMaxIsa::ScopedMaxIsa(Isa isa) : previous_(static_cast<Isa>(max_isa.load())) {
  SetMaxIsa(isa);
}
ScopedMaxIsa::~ScopedMaxIsa() { SetMaxIsa(previous_); }

int NumThreads() {
  const int n = thread_count.load();
  return n > 0 ? n : omp_get_max_threads();
}

int64_t DecodeMaxN(TensorType type) {
  switch (type) {
    case TensorType::kF16:
    case TensorType::kBF16:
      return 128;  // converting for sgemm costs more than the kernel's shortfall
    case TensorType::kF32:
      return 64;
    // Quantized types: integer dots against quantized activations (compute-bound at ~90-115
    // GFLOP/s one row at a time, 125-190 for the eight-row kernels) up to the cross-over with
    // dequantized panels + sgemm (~150 GFLOP/s at n = 128), measured with
    // subspace-bench-matmul --paths=both on 8192x2048.
    case TensorType::kQ4_K:
    case TensorType::kQ5_K:
    case TensorType::kQ6_K:
      return 32;
    case TensorType::kQ3_K:
      return 16;
    case TensorType::kQ2_K:
      // Its panels are dequantized by the scalar code; the integer path (~127 GFLOP/s) stays
      // ahead of that at any n.
      return std::numeric_limits<int64_t>::max();
    case TensorType::kQ8_0:
      return 32;  // eight-row kernel from n = 2: ~128 GFLOP/s, sgemm 145 at 64
    case TensorType::kQ4_1:
    case TensorType::kQ5_1:
      // Always the integer path: it multiplies the weights' mins by q8_1's fp16 activation sum,
      // which sgemm on the decoded activations cannot reproduce (2^-10 apart), and a token's
      // logits must not depend on the size of the batch it ran in.
      return std::numeric_limits<int64_t>::max();
    case TensorType::kQ4_0:
      return std::numeric_limits<int64_t>::max();  // eight-row kernel: ~200 GFLOP/s at any n
    case TensorType::kIQ4_NL:
      return 64;  // eight-row kernel: ~145 GFLOP/s; sgemm 148 at 128, 167 at 512
    case TensorType::kQ5_0:
      return 128;
    default:
      break;
  }
  return 8;
}

namespace {

template <TensorType kType>
float ScalarQuantDot(const uint8_t* row, const uint8_t* act, int64_t n) {
  return DotQuantizedRowScalar(kType, row, act, n);
}

QuantDotFn QuantDotKernelScalar(TensorType type) {
  switch (type) {
    case TensorType::kQ4_0:
      return ScalarQuantDot<TensorType::kQ4_0>;
    case TensorType::kQ4_1:
      return ScalarQuantDot<TensorType::kQ4_1>;
    case TensorType::kQ5_0:
      return ScalarQuantDot<TensorType::kQ5_0>;
    case TensorType::kQ5_1:
      return ScalarQuantDot<TensorType::kQ5_1>;
    case TensorType::kQ8_0:
      return ScalarQuantDot<TensorType::kQ8_0>;
    case TensorType::kQ2_K:
      return ScalarQuantDot<TensorType::kQ2_K>;
    case TensorType::kQ3_K:
      return ScalarQuantDot<TensorType::kQ3_K>;
    case TensorType::kQ4_K:
      return ScalarQuantDot<TensorType::kQ4_K>;
    case TensorType::kQ5_K:
      return ScalarQuantDot<TensorType::kQ5_K>;
    case TensorType::kQ6_K:
      return ScalarQuantDot<TensorType::kQ6_K>;
    case TensorType::kIQ4_NL:
      return ScalarQuantDot<TensorType::kIQ4_NL>;
    default:
      return nullptr;
  }
}

}  // namespace

void ActivationBlockSums(const uint8_t* act, int64_t n, int32_t* sums) {
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const auto* q = reinterpret_cast<const int8_t*>(act + b * sizeof(BlockQ8_0) + 2);
    int32_t sum = 0;
    for (int i = 0; i < kQuantBlock; ++i) sum += q[i];
    sums[b] = sum;
  }
}

void QuantizeActivations(TensorType act_type, const float* x, uint8_t* dst, int64_t n) {
  if (ActiveIsa() >= Isa::kAvx2 && QuantizeActivationRowAvx2(act_type, x, dst, n)) return;
  QuantizeActivationRow(act_type, x, dst, n);
}

QuantDotFn QuantDotKernel(TensorType type) {
  if (ActiveIsa() >= Isa::kAvx2) {
    if (const QuantDotFn avx2 = QuantDotKernelAvx2(type)) return avx2;
  }
  return QuantDotKernelScalar(type);
}

void SetPrefillPanelRows(int64_t rows) { panel_rows_override.store(std::max<int64_t>(rows, 0)); }

void DecodeRowsScalar(const WeightMatrix& w, const float* x, int64_t n, int64_t row_begin,
                      int64_t row_end, float* y) {
  std::vector<float> row(w.cols);
  for (int64_t r = row_begin; r < row_end; ++r) {
    DequantizeRow(w.type, w.row(r), row.data(), w.cols);
    for (int64_t j = 0; j < n; ++j) {
      const float* xj = x + j * w.cols;
      double sum = 0.0;  // the fallback favours a simple, nearly exact sum over speed
      for (int64_t k = 0; k < w.cols; ++k) sum += static_cast<double>(row[k]) * xj[k];
      y[j * w.rows + r] = static_cast<float>(sum);
    }
  }
}

void ConvertRowsToF32(const WeightMatrix& w, int64_t first_row, int64_t num_rows, float* dst) {
  if (ActiveIsa() >= Isa::kAvx2) {
    ConvertRowsToF32Avx2(w, first_row, num_rows, dst);
    return;
  }
  for (int64_t i = 0; i < num_rows; ++i) {
    DequantizeRow(w.type, w.row(first_row + i), dst + i * w.cols, w.cols);
  }
}

// Both paths hand out rows in work items claimed dynamically (several per thread) rather than
// one fixed range per thread: when another process takes a core for a while, the other
// threads carry on instead of waiting at the barrier for the one descheduled. Items stay
// large enough (tens of KiB of weights, whole sgemm panels) that the claiming costs nothing.

namespace {

// One weight's part of a decode call: its output and the kernels for its rows, with x
// already in the form they read (quantized once per call and activation type).
struct DecodeJob {
  const WeightMatrix* w = nullptr;
  float* y = nullptr;
  DecodeFn float_kernel = nullptr;  // F32, F16, BF16
  // Quantized weights: each weight row dotted with each activation row while it sits in L1.
  const uint8_t* act = nullptr;
  uint64_t act_bytes = 0;
  QuantDotFn dot = nullptr;
  QuantDot8Fn dot8 = nullptr;  // eight rows at a time, where the type has such a kernel
  const int32_t* sums = nullptr;

  // Output rows [begin, end) for all n activation rows, on the calling thread.
  void Run(const float* x, int64_t n, int64_t begin, int64_t end) const {
    if (float_kernel != nullptr) {
      float_kernel(*w, x, n, begin, end, y);
      return;
    }
    const uint64_t row_bytes = w->row_bytes();
    int64_t r = begin;
    if (dot8 != nullptr) {
      for (const uint8_t* rows = w->row(r); r + 8 <= end; r += 8, rows += 8 * row_bytes) {
        dot8(rows, row_bytes, act, act_bytes, sums, n, w->cols, y + r, w->rows);
      }
    }
    for (const uint8_t* row = w->row(r); r < end; ++r, row += row_bytes) {
      for (int64_t j = 0; j < n; ++j) y[j * w->rows + r] = dot(row, act + j * act_bytes, w->cols);
    }
  }
};

// x quantized to each activation type a call's weights read, per thread and reused across
// calls (a fresh buffer per call would page-fault); `ready` marks what this call filled.
struct ActivationBuffers {
  struct Quantized {
    std::vector<uint8_t> bytes;
    bool ready = false;
  };
  Quantized q8_0, q8_1, q8_k;
  std::vector<int32_t> q8_0_sums;  // block sums of q8_0, for q4_0 and q5_0's eight-row kernels
  bool sums_ready = false;

  Quantized& For(TensorType act_type) {
    return act_type == TensorType::kQ8_1 ? q8_1 : act_type == TensorType::kQ8_K ? q8_k : q8_0;
  }
  void NewCall() { q8_0.ready = q8_1.ready = q8_k.ready = sums_ready = false; }
};

DecodeJob PrepareDecodeJob(const WeightMatrix& w, const float* x, int64_t n, float* y,
                           ActivationBuffers& buffers) {
  DecodeJob job;
  job.w = &w;
  job.y = y;
  if (!IsQuantizedTensorType(w.type)) {
    job.float_kernel = ActiveIsa() >= Isa::kAvx2 ? DecodeRowsAvx2 : DecodeRowsScalar;
    return job;
  }
  const TensorType act_type = DotActivationType(w.type);
  job.act_bytes = TensorRowBytes(act_type, w.cols);
  ActivationBuffers::Quantized& act = buffers.For(act_type);
  if (!act.ready) {
    act.bytes.resize(static_cast<size_t>(n) * job.act_bytes);
    for (int64_t j = 0; j < n; ++j) {
      QuantizeActivations(act_type, x + j * w.cols, act.bytes.data() + j * job.act_bytes, w.cols);
    }
    act.ready = true;
  }
  job.act = act.bytes.data();
  job.dot = QuantDotKernel(w.type);
  // q8_0 reads its rows fastest one at a time (they are dense already); from two activation
  // rows on, sharing the transposed rows wins.
  const bool one_row_faster = w.type == TensorType::kQ8_0 && n < 2;
  job.dot8 = ActiveIsa() >= Isa::kAvx2 && !one_row_faster ? QuantDot8KernelAvx2(w.type) : nullptr;
  // Block sums of the activation codes, for the eight-row kernels of offset types (q4_0, q5_0).
  if (job.dot8 != nullptr && (w.type == TensorType::kQ4_0 || w.type == TensorType::kQ5_0)) {
    const int64_t blocks = w.cols / kQuantBlock;
    if (!buffers.sums_ready) {
      buffers.q8_0_sums.resize(static_cast<size_t>(n * blocks));
      for (int64_t j = 0; j < n; ++j) {
        ActivationBlockSums(job.act + j * job.act_bytes, w.cols,
                            buffers.q8_0_sums.data() + j * blocks);
      }
      buffers.sums_ready = true;
    }
    job.sums = buffers.q8_0_sums.data();
  }
  return job;
}

struct DecodeItem {
  int32_t job;
  int64_t begin, end;
};

// Runs the jobs (weights of one shape of input: all read the same x) in one parallel region,
// their rows split into items over the threads: one fork and join for them all.
void RunDecodeJobs(const DecodeJob* jobs, int64_t num_jobs, const float* x, int64_t n) {
  uint64_t bytes = 0;
  int64_t aligned_rows = 0;
  for (int64_t i = 0; i < num_jobs; ++i) {
    bytes += static_cast<uint64_t>(jobs[i].w->rows) * jobs[i].w->row_bytes();
    aligned_rows += (jobs[i].w->rows + kDecodeRowAlign - 1) / kDecodeRowAlign;
  }
  const int64_t threads = std::min<int64_t>(
      {NumThreads(), static_cast<int64_t>(bytes / kMinBytesPerThread), aligned_rows});
  if (threads <= 1) {
    for (int64_t i = 0; i < num_jobs; ++i) jobs[i].Run(x, n, 0, jobs[i].w->rows);
    return;
  }
  thread_local std::vector<DecodeItem> items;
  items.clear();
  constexpr int64_t kItemsPerThread = 8;
  for (int64_t i = 0; i < num_jobs; ++i) {
    const WeightMatrix& w = *jobs[i].w;
    const int64_t min_rows = static_cast<int64_t>(kMinItemBytes / w.row_bytes()) + 1;
    const int64_t item_rows = RoundUp(
        std::max((w.rows + threads * kItemsPerThread - 1) / (threads * kItemsPerThread), min_rows),
        kDecodeRowAlign);
    for (int64_t r = 0; r < w.rows; r += item_rows) {
      items.push_back({static_cast<int32_t>(i), r, std::min(w.rows, r + item_rows)});
    }
  }
  const DecodeItem* list = items.data();
  const int64_t count = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t k = 0; k < count; ++k) {
    jobs[list[k].job].Run(x, n, list[k].begin, list[k].end);
  }
}

}  // namespace

void MatMulDecode(const WeightMatrix& w, const float* x, int64_t n, float* y) {
  MatMulsDecode({{&w, y}}, x, n);
}

void MatMulsDecode(absl::Span<const MatMulOutput> outputs, const float* x, int64_t n) {
  if (n <= 0) return;
  thread_local ActivationBuffers buffers;
  buffers.NewCall();
  thread_local std::vector<DecodeJob> jobs;
  jobs.clear();
  for (const MatMulOutput& out : outputs) {
    if (out.w->rows > 0) jobs.push_back(PrepareDecodeJob(*out.w, x, n, out.y, buffers));
  }
  RunDecodeJobs(jobs.data(), static_cast<int64_t>(jobs.size()), x, n);
}

void MatMulPrefill(const WeightMatrix& w, const float* x, int64_t n, float* y) {
  if (w.rows <= 0 || n <= 0) return;
  // OpenBLAS's pthread pool is switched off once: OpenMP threads call sgemm themselves.
  static std::once_flag blas_single_threaded;
  std::call_once(blas_single_threaded, [] { openblas_set_num_threads(1); });
  const int64_t threads = std::min<int64_t>(NumThreads(), RoundUp(w.rows, 16) / 16);
  // One item is one converted panel; fp32 weights need no buffer, so their items only stop
  // at two per thread (each sgemm call repacks x, which costs at large n).
  int64_t item_rows = PanelRows(n, w.cols);
  if (w.type == TensorType::kF32) {
    item_rows = std::max(item_rows, RoundUp((w.rows + 2 * threads - 1) / (2 * threads), 16));
  }
  const int64_t items = (w.rows + item_rows - 1) / item_rows;
  // Quantized weights multiply the activations as the decode path's integer dots see them
  // (quantized to q8_0 / q8_K and back), so that a token's logits do not depend on which path
  // its batch took (as in llama.cpp, whose CPU matmuls quantize activations at any batch size).
  if (IsQuantizedTensorType(w.type)) {
    thread_local std::vector<float> rounded_buffer;
    rounded_buffer.resize(static_cast<size_t>(n * w.cols));
    float* rounded = rounded_buffer.data();  // the OpenMP threads share the caller's buffer
    const TensorType act_type = DotActivationType(w.type);
    const uint64_t act_bytes = TensorRowBytes(act_type, w.cols);
#pragma omp parallel num_threads(threads) if (threads > 1 && n > 1)
    {
      thread_local std::vector<uint8_t> quantized;  // one row, per thread
      quantized.resize(act_bytes);
#pragma omp for schedule(static)
      for (int64_t j = 0; j < n; ++j) {
        QuantizeActivations(act_type, x + j * w.cols, quantized.data(), w.cols);
        DecodeActivationRow(act_type, quantized.data(), rounded + j * w.cols, w.cols);
      }
    }
    x = rounded;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && items > 1)
  for (int64_t i = 0; i < items; ++i) {
    PrefillRows(w, x, n, i * item_rows, std::min(w.rows, (i + 1) * item_rows), y);
  }
}

}  // namespace internal

void SetNumThreads(int num_threads) { internal::thread_count.store(std::max(num_threads, 0)); }

void MatMul(const WeightMatrix& w, const float* x, int64_t n, float* y) {
  if (n <= internal::DecodeMaxN(w.type)) {
    internal::MatMulDecode(w, x, n, y);
  } else {
    internal::MatMulPrefill(w, x, n, y);
  }
}

void MatMuls(absl::Span<const MatMulOutput> outputs, const float* x, int64_t n) {
  // One x for all: weights of different widths (a caller's mistake) go one call each.
  bool all_decode = true;
  for (const MatMulOutput& out : outputs) {
    all_decode &= n <= internal::DecodeMaxN(out.w->type) && out.w->cols == outputs[0].w->cols;
  }
  if (all_decode) {
    internal::MatMulsDecode(outputs, x, n);
    return;
  }
  for (const MatMulOutput& out : outputs) MatMul(*out.w, x, n, out.y);
}

}  // namespace subspace::cpu
