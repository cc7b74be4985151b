// Times cpu::MatMul per weight type, shape and batch size n, and prints a table of time,
// GFLOP/s and GB/s of weight bytes read, next to the machine's read bandwidth and OpenBLAS's
// fp32 sgemm as yardsticks. Weights cycle through >= 256 MiB of copies so decode reads them
// from DRAM, as it does across the layers of a real model.
//
//   subspace-bench-matmul                      # default table, ~30 s on 2 cores
//   subspace-bench-matmul --paths=both --ns=4,8,16,32   # decode vs prefill cross-over
//   subspace-bench-matmul --panel_rows=64,128,256,512 --ns=512   # prefill panel sweep
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "cli/flags.h"
#include "core/base/quant_blocks.h"
#include "core/base/tensor_types.h"
#include "core/base/weight.h"
#include "core/cpu/matmul_internal.h"
#include "core/cpu/ops.h"
#include "core/cpu/simd.h"

ABSL_FLAG(std::string, types, "f32,f16,bf16,q8_0",
          "weight types to time (any the engine reads: q4_0, q4_K, q6_K ...)");
ABSL_FLAG(std::string, shapes, "256x256,768x256,4096x4096,4096x11008",
          "weight shapes, rows x cols");
ABSL_FLAG(std::string, ns, "1,8,64,512", "activation rows (batch) to time");
ABSL_FLAG(std::string, paths, "auto", "auto (what MatMul picks), or both (decode and prefill)");
ABSL_FLAG(std::string, panel_rows, "", "prefill panel sizes to sweep (default: the built-in)");
ABSL_FLAG(double, min_time, 0.15, "seconds spent timing each cell (at least 2 calls)");
ABSL_FLAG(bool, cpu_clock, false,
          "time with the process CPU clock instead of the wall clock: on a loaded machine, "
          "with OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1, this still measures a core's compute "
          "rate (not bandwidth: memory stalls count, time spent preempted does not)");
ABSL_FLAG(bool, hot, false,
          "reuse one copy of the weights, so they stay in cache "
          "(isolates the kernels' compute rate from DRAM)");
ABSL_FLAG(bool, scalar, false, "force the scalar fallback kernels");
ABSL_FLAG(bool, with_rmsnorm, false,
          "run an RmsNorm (an OpenMP region) on x before each timed MatMul, as a forward pass "
          "does; shows what OpenMP threads still spinning cost an sgemm that follows");

namespace subspace::cpu {
namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  int64_t rows;
  int64_t cols;
};

std::vector<int64_t> ParseInts(const std::string& list) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    int64_t v;
    if (absl::SimpleAtoi(part, &v)) out.push_back(v);
  }
  return out;
}

std::vector<Shape> ParseShapes(const std::string& list) {
  std::vector<Shape> out;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> dims = absl::StrSplit(part, 'x');
    Shape s;
    if (dims.size() == 2 && absl::SimpleAtoi(dims[0], &s.rows) &&
        absl::SimpleAtoi(dims[1], &s.cols)) {
      out.push_back(s);
    }
  }
  return out;
}

bool ParseType(absl::string_view name, TensorType* type) {
  for (uint32_t id = 0; id < 64; ++id) {
    const auto t = static_cast<TensorType>(id);
    if (IsSupportedTensorType(id) && name == TensorTypeName(t)) {
      *type = t;
      return true;
    }
  }
  return false;
}

// Copies of one random matrix laid end to end, at least `min_bytes` in all.
class WeightPool {
 public:
  WeightPool(TensorType type, Shape shape, uint64_t min_bytes) {
    const uint64_t row_bytes = TensorRowBytes(type, shape.cols);
    matrix_bytes_ = row_bytes * shape.rows;
    copies_ = std::max<uint64_t>(1, (min_bytes + matrix_bytes_ - 1) / matrix_bytes_);
    storage_.resize(matrix_bytes_ * copies_);
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    uint8_t* first = storage_.data();
    for (int64_t r = 0; r < shape.rows; ++r) {
      uint8_t* row = first + r * row_bytes;
      if (type == TensorType::kQ8_0) {
        for (int64_t b = 0; b < shape.cols / kQ8BlockSize; ++b) {
          BlockQ8_0 block;
          block.scale_f16 = Fp32ToFp16(0.01f * (1.0f + dist(rng)));
          for (int8_t& q : block.q) q = static_cast<int8_t>(127 * dist(rng));
          std::memcpy(row + b * sizeof(block), &block, sizeof(block));
        }
        continue;
      }
      if (IsQuantizedTensorType(type)) {
        // Random codes; every fp16 field of each block set to a modest scale. Speed does not
        // depend on the values.
        for (uint64_t i = 0; i < row_bytes; ++i) row[i] = static_cast<uint8_t>(rng());
        const uint64_t block_bytes = TensorBlockBytes(type);
        const uint16_t scale = Fp32ToFp16(0.01f);
        uint64_t fields[2];
        const int num_fields = BlockHalfFields(type, fields);
        for (uint64_t off = 0; off < row_bytes; off += block_bytes) {
          for (int f = 0; f < num_fields; ++f) std::memcpy(row + off + fields[f], &scale, 2);
        }
        continue;
      }
      for (int64_t k = 0; k < shape.cols; ++k) {
        const float v = dist(rng);
        if (type == TensorType::kF32) {
          std::memcpy(row + 4 * k, &v, 4);
        } else {
          const uint16_t h = type == TensorType::kF16 ? Fp32ToFp16(v) : Fp32ToBf16(v);
          std::memcpy(row + 2 * k, &h, 2);
        }
      }
    }
    for (uint64_t c = 1; c < copies_; ++c) {
      std::memcpy(first + c * matrix_bytes_, first, matrix_bytes_);
    }
    matrix_.type = type;
    matrix_.rows = shape.rows;
    matrix_.cols = shape.cols;
  }

  // The next copy, round robin.
  const WeightMatrix& Next() {
    matrix_.data = storage_.data() + (next_++ % copies_) * matrix_bytes_;
    return matrix_;
  }
  uint64_t matrix_bytes() const { return matrix_bytes_; }

 private:
  std::vector<uint8_t> storage_;
  uint64_t matrix_bytes_ = 0;
  uint64_t copies_ = 1;
  uint64_t next_ = 0;
  WeightMatrix matrix_;
};

struct Timing {
  double best_s;
  double median_s;
};

bool use_cpu_clock = false;

double Now() {
  timespec ts;
  clock_gettime(use_cpu_clock ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

template <typename Fn>
Timing TimeIt(Fn&& fn, double min_time) {
  fn();  // warm-up: thread pools, buffers
  std::vector<double> times;
  const Clock::time_point start = Clock::now();
  while (times.size() < 2 ||
         (std::chrono::duration<double>(Clock::now() - start).count() < min_time &&
          times.size() < 1000)) {
    const double t0 = Now();
    fn();
    times.push_back(Now() - t0);
  }
  std::sort(times.begin(), times.end());
  return {times.front(), times[times.size() / 2]};
}

#ifdef SUBSPACE_HAVE_X86
// data: [n]
SUBSPACE_AVX2 float SumAvx2(const float* data, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (int64_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(data + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(data + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(data + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(data + i + 24));
  }
  return simd::HorizontalSum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}
#endif

// GB/s of a plain multi-threaded read, the ceiling for decode: {median, best} over calls that
// each read a whole 512 MiB buffer, 16 times the L3 cache (reading 32 MiB slices of it in turn,
// as this did until 2026-11-26, let a best-of find calls served partly from the L3). The median
// is the sustained rate a decode of many steps can be held to: on this shared machine single
// calls swing between ~36 and ~47 GB/s from minute to minute.
std::pair<double, double> ReadBandwidth(double min_time) {
#ifdef SUBSPACE_HAVE_X86
  if (internal::DetectedIsa() < internal::Isa::kAvx2) return {0.0, 0.0};
  const int64_t count = (512ll << 20) / 4;
  std::vector<float> data(count, 1.0f);
  volatile float sink = 0.0f;
  const Timing t = TimeIt(
      [&] {
        float total = 0.0f;
#pragma omp parallel reduction(+ : total)
        {
          const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
          const int64_t begin = count / nt * id;
          const int64_t end = id == nt - 1 ? count : count / nt * (id + 1);
          total += SumAvx2(data.data() + begin, end - begin);
        }
        sink = total;
      },
      std::max(min_time, 0.5));
  (void)sink;
  return {count * 4.0 / t.median_s / 1e9, count * 4.0 / t.best_s / 1e9};
#else
  return {0.0, 0.0};
#endif
}

void PrintRow(const char* type, Shape shape, int64_t n, const char* path, int64_t panel,
              const Timing& t, uint64_t weight_bytes) {
  const double flops = 2.0 * n * shape.rows * shape.cols;
  std::printf("%-5s %6lldx%-6lld %5lld  %-8s %6s %10.3f %10.3f %9.1f %8.1f\n", type,
              static_cast<long long>(shape.rows), static_cast<long long>(shape.cols),
              static_cast<long long>(n), path, panel > 0 ? std::to_string(panel).c_str() : "-",
              t.best_s * 1e3, t.median_s * 1e3, flops / t.best_s / 1e9,
              weight_bytes / t.best_s / 1e9);
}

int Main() {
  const double min_time = absl::GetFlag(FLAGS_min_time);
  use_cpu_clock = absl::GetFlag(FLAGS_cpu_clock);
  if (absl::GetFlag(FLAGS_scalar)) internal::SetMaxIsa(internal::Isa::kScalar);
  const bool both = absl::GetFlag(FLAGS_paths) == "both";
  const bool with_rmsnorm = absl::GetFlag(FLAGS_with_rmsnorm);
  std::vector<int64_t> panels = ParseInts(absl::GetFlag(FLAGS_panel_rows));
  if (panels.empty()) panels.push_back(0);

  double load[3] = {0, 0, 0};
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = -1;
    std::fclose(f);
  }
  const auto [read_median, read_best] = ReadBandwidth(min_time);
  std::printf(
      "# threads %d (OpenMP), ISA %s, read bandwidth %.1f GB/s (median of 512 MiB reads; best "
      "%.1f), load average %.2f\n",
      omp_get_max_threads(), internal::ActiveIsa() == internal::Isa::kAvx2 ? "avx2" : "scalar",
      read_median, read_best, load[0]);
  std::printf(
      "# best and median of repeated calls (%s clock); GFLOP/s and GB/s (weight bytes) "
      "from best\n",
      use_cpu_clock ? "process CPU" : "wall");
  std::printf("%-5s %13s %5s  %-8s %6s %10s %10s %9s %8s\n", "type", "rows x cols", "n", "path",
              "panel", "best ms", "median ms", "GFLOP/s", "GB/s");

  for (absl::string_view type_name : absl::StrSplit(absl::GetFlag(FLAGS_types), ',')) {
    TensorType type;
    if (!ParseType(type_name, &type)) {
      std::fprintf(stderr, "unknown type %s\n", std::string(type_name).c_str());
      return 1;
    }
    for (const Shape& shape : ParseShapes(absl::GetFlag(FLAGS_shapes))) {
      if (type == TensorType::kQ8_0 && shape.cols % kQ8BlockSize != 0) continue;
      WeightPool pool(type, shape, absl::GetFlag(FLAGS_hot) ? 0 : 256ull << 20);
      for (int64_t n : ParseInts(absl::GetFlag(FLAGS_ns))) {
        std::vector<float> x(n * shape.cols), y(n * shape.rows);
        std::mt19937 rng(2);
        std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
        for (float& v : x) v = dist(rng);
        std::vector<float> norm(shape.cols, 1.0f), x_normed(n * shape.cols);
        struct Run {
          const char* name;
          void (*fn)(const WeightMatrix&, const float*, int64_t, float*);
        };
        std::vector<Run> runs;
        if (both) {
          runs = {{"decode", internal::MatMulDecode}, {"prefill", internal::MatMulPrefill}};
        } else {
          runs = {{n <= internal::DecodeMaxN(type) ? "decode" : "prefill", MatMul}};
        }
        for (const Run& run : runs) {
          const bool prefill = std::strcmp(run.name, "prefill") == 0;
          // Panel size only matters where prefill converts weights.
          const std::vector<int64_t> run_panels =
              prefill && type != TensorType::kF32 ? panels : std::vector<int64_t>{0};
          for (int64_t panel : run_panels) {
            internal::SetPrefillPanelRows(panel);
            const Timing t = TimeIt(
                [&] {
                  if (with_rmsnorm) {
                    RmsNorm(x.data(), norm.data(), n, shape.cols, 1e-5f, x_normed.data());
                  }
                  run.fn(pool.Next(), x.data(), n, y.data());
                },
                min_time);
            PrintRow(TensorTypeName(type), shape, n, run.name, panel, t, pool.matrix_bytes());
          }
          internal::SetPrefillPanelRows(0);
        }
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace subspace::cpu

int main(int argc, char** argv) {
  subspace::cli::ParseFlags(argc, argv, "subspace-bench-matmul [flags]");
  return subspace::cpu::Main();
}
