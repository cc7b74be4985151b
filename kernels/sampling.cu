// SampleTokensKernel: one CTA of 1024 threads per logits row; greedy argmax, or
// core/model/sampler.h's stochastic policy (top-k, temperature, min-p, top-p, one draw) without
// sorting the row.
//
// Every token has a 64-bit sort key, (order-preserving bits of its logit) << 32 | ~id, distinct
// per token, whose descending order is the host's strict order (logit descending, then id).
// Each truncation and the draw are then one search, SelectByWeight: walk the members of a set in
// descending key order and stop at the first whose running weight reaches a target. top-k is
// that search with weight 1 and target k; top-p with the candidates' weights and target
// top_p * total; the draw with target uniform * total and a strict crossing. Where the host
// walks its candidates by id (no top-k, no top-p) the draw's key is vocab - 1 - id instead.
//
// The search is a radix descent, 3 key bits a pass: a pass over the row sums the weights of the
// members in the current key range per digit (cumulatively, in registers, then across the CTA
// in double), keeps the digit where the running sum crosses the target and narrows the range to
// it, until one member is left: a handful of passes for distinct logits, at most 23 when ties
// leave the ids to decide (by id: ceil(log2(vocab) / 3) + 1, 7 at 128k). The row stays in global
// memory and is re-read each pass (from L2); no atomics, no sort, no workspace.
//
// Numbers follow the host: NaN is -inf and +inf the largest float; weights are float
// exp((logit - max) / T), here from double exp() rounded to float, within a float ulp of the
// host's std::exp (glibc's expf errs by 0.502 ulp at most); sums are double. Only the order of
// the double sums differs from the host, so a draw can go the other way only when it lands
// within a few float ulps of a cumulative boundary.
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "kernels/cuda_util.cuh"
#include "kernels/sampling.h"

namespace subspace::kernels {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / device::kWarpSize;
// 3 bits a pass: at 1024 threads (64 registers) 16 digits' double sums spill ~200 bytes, 8
// spill none on sm_80 and 28 bytes on sm_90.
constexpr int kDigitBits = 3;
constexpr int kDigits = 1 << kDigitBits;
// A search pass's per-thread sums: [0, kDigits) the weight of the range's members whose digit
// is >= d, then the member count and the sum of their ids (the id when the count is 1).
constexpr int kCount = kDigits;
constexpr int kIdSum = kDigits + 1;
constexpr int kSlots = kDigits + 2;

struct Scratch {
  double partial[kWarps * kSlots];  // [kWarps, n] per-warp sums of a BlockSum
  double total[kSlots];
  uint64_t key_partial[kWarps];
  uint64_t key_total;
};

// The host sampler's view of a logit: NaN is -inf, +inf the largest float. -0 becomes +0: the
// two compare equal (a tie, broken by id) but their bits would order them.
__device__ __forceinline__ float Sanitize(float x) {
  if (isnan(x)) return -INFINITY;
  if (x > FLT_MAX) return FLT_MAX;
  return x == 0.0f ? 0.0f : x;
}

// Descending key order = logit descending, then id ascending. Never 0 (-inf maps to 0x007fffff
// in the high half), so 0 works as "below every key".
__device__ __forceinline__ uint64_t SortKey(float x, int32_t id) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t ordered = (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
  return (static_cast<uint64_t>(ordered) << 32) | (0xffffffffu - static_cast<uint32_t>(id));
}

// Descending key order = id ascending (the host's walk when it never sorts), in as few bits as
// the vocabulary needs: IdKeyBits(vocab).
__device__ __forceinline__ uint64_t IdKey(int32_t id, int32_t vocab) {
  return static_cast<uint32_t>(vocab - 1 - id);
}
__device__ __forceinline__ int IdKeyBits(int32_t vocab) { return 32 - __clz(vocab - 1); }

__device__ __forceinline__ int32_t KeyId(uint64_t key) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(key));
}

// exp rounded to float, as the host's std::exp(float) within a float ulp.
__device__ __forceinline__ float ExpF(float a) {
  return static_cast<float>(exp(static_cast<double>(a)));
}

// Sums v[0..n) over the CTA in place: every thread gets the same totals (a fixed tree, so the
// same bits every run). Two barriers: call from uniform control flow.
template <int kN>
__device__ void BlockSum(double (&v)[kN], Scratch& s) {
  static_assert(kN <= kSlots);
  const int warp = threadIdx.x / device::kWarpSize, lane = threadIdx.x % device::kWarpSize;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
#pragma unroll
    for (int off = device::kWarpSize / 2; off > 0; off /= 2)
      v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kN; ++k) s.partial[warp * kN + k] = v[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      double x = s.partial[lane * kN + k];  // kWarps == kWarpSize: one warp's sums per lane
#pragma unroll
      for (int off = device::kWarpSize / 2; off > 0; off /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, off);
      if (lane == 0) s.total[k] = x;
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kN; ++k) v[k] = s.total[k];
}
static_assert(kWarps == device::kWarpSize);

// Largest key over the CTA, to every thread. Two barriers.
__device__ uint64_t BlockMax(uint64_t v, Scratch& s) {
  const int warp = threadIdx.x / device::kWarpSize, lane = threadIdx.x % device::kWarpSize;
#pragma unroll
  for (int off = device::kWarpSize / 2; off > 0; off /= 2) {
    const uint64_t o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  if (lane == 0) s.key_partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    uint64_t x = s.key_partial[lane];
#pragma unroll
    for (int off = device::kWarpSize / 2; off > 0; off /= 2) {
      const uint64_t o = __shfl_xor_sync(0xffffffffu, x, off);
      x = o > x ? o : x;
    }
    if (lane == 0) s.key_total = x;
  }
  __syncthreads();
  return s.key_total;
}

// Membership for the top-k search: every token, weight 1.
struct AllTokens {
  __device__ bool operator()(float, uint64_t, double* w) const {
    *w = 1.0;
    return true;
  }
};

// The candidates as the host holds them after its truncations so far: finite, sort key at least
// `floor_key` (the last token top-k, later top-p, kept; 0 = no cut), and min-p's test on the
// float weight.
struct Candidates {
  float max_logit;
  float temperature;
  float min_p;
  uint64_t floor_key;
  __device__ bool operator()(float x, uint64_t sort_key, double* w) const {
    if (!(x > -INFINITY) || sort_key < floor_key) return false;
    const float wf = ExpF((x - max_logit) / temperature);
    if (min_p > 0.0f && !(wf >= min_p)) return false;
    *w = wf;
    return true;
  }
};

// Walks the members (`member(x, sort_key, &w)`) in descending key order — sort keys, or id keys
// when `by_id` — and returns the id of the first one whose running weight reaches the target:
// >= target, or > target when `strict`. The target is `target` itself, or `target` times the
// members' total weight when `of_total` (the total comes out of the first pass). Only members
// with weight count as answers: if target <= 0 it is the first member with weight; if rounding
// leaves the target out of reach it is the last. -1 if no member has weight (callers never ask).
//
// A pass narrows the key range (the keys whose bits above `shift` are `prefix`) to the digit of
// the next kDigitBits bits in which the running sum crosses the target; `above` is the weight of
// the members above the range. A digit holds weight iff its sum differs from the next digit's: the
// two are the same sequence of double additions apart from that digit's members, and adding 0
// changes nothing.
template <typename Member>
__device__ int32_t SelectByWeight(const float* logits, int32_t vocab, bool by_id, Member member,
                                  double target, bool of_total, bool strict, Scratch& s) {
  uint64_t prefix = 0;
  int shift = by_id ? IdKeyBits(vocab) : 64;
  double above = 0.0;
  for (int pass = 0;; ++pass) {
    // The last digit is narrower when kDigitBits does not divide the key width.
    const int digit_shift = shift >= kDigitBits ? shift - kDigitBits : 0;
    const uint32_t digit_mask = (1u << (shift - digit_shift)) - 1u;
    double acc[kSlots];
#pragma unroll
    for (int k = 0; k < kSlots; ++k) acc[k] = 0.0;
    uint32_t count = 0;
    int32_t last_id = 0;
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
      const float x = Sanitize(__ldg(logits + i));
      const uint64_t sort_key = SortKey(x, i);
      const uint64_t key = by_id ? IdKey(i, vocab) : sort_key;
      if (shift < 64 && (key >> shift) != prefix) continue;
      double w;
      if (!member(x, sort_key, &w)) continue;
      const uint32_t digit = static_cast<uint32_t>(key >> digit_shift) & digit_mask;
#pragma unroll
      for (int d = 0; d < kDigits; ++d) acc[d] += digit >= static_cast<uint32_t>(d) ? w : 0.0;
      ++count;
      last_id = i;
    }
    // Summed over the CTA, last_id is the member's id when there is just one.
    acc[kCount] = count;
    acc[kIdSum] = count > 0 ? last_id : 0;
    BlockSum(acc, s);
    // Keys are distinct, so the range holds one member at the latest when shift reaches 0.
    if (acc[kCount] <= 1.0 || shift == 0) {
      return acc[kCount] == 1.0 ? static_cast<int32_t>(acc[kIdSum]) : -1;
    }
    if (pass == 0 && of_total) target *= acc[0];

    // The highest digit with weight whose running sum reaches the target; else (rounding) the
    // lowest digit with weight. Fully unrolled so acc stays in registers.
    int chosen = -1, lowest = -1;
#pragma unroll
    for (int d = 0; d < kDigits; ++d) {
      const double below = d + 1 < kDigits ? acc[d + 1] : 0.0;
      const double running = above + acc[d];
      if (acc[d] > below) {
        if (lowest < 0) lowest = d;
        if (strict ? running > target : running >= target) chosen = d;
      }
    }
    if (chosen < 0) chosen = lowest;
    if (chosen < 0) return -1;
    double above_digit = 0.0;  // weight of the digits above the chosen one
#pragma unroll
    for (int d = 1; d < kDigits; ++d) above_digit = d == chosen + 1 ? acc[d] : above_digit;
    above += above_digit;
    prefix = (prefix << (shift - digit_shift)) | static_cast<uint64_t>(chosen);
    shift = digit_shift;
  }
}

// The host's SampleStochastic for a row with a finite maximum (so the best token, weight 1, is
// always a candidate and every search below has an answer).
__device__ int32_t SampleStochastic(const SampleTokensParams& p, int64_t row, const float* logits,
                                    float max_logit, int32_t argmax, Scratch& s) {
  const int32_t vocab = p.vocab;
  const int32_t top_k = p.top_k[row];
  const float top_p = p.top_p[row];
  const bool use_top_k = top_k > 0 && top_k < vocab;
  const bool use_top_p = top_p < 1.0f;
  Candidates cand{max_logit, p.temperature[row], p.min_p[row], 0};
  if (use_top_k) {
    const int32_t kth = SelectByWeight(logits, vocab, false, AllTokens{}, top_k, false, false, s);
    if (kth >= 0) cand.floor_key = SortKey(Sanitize(__ldg(logits + kth)), kth);
  }
  if (use_top_p) {
    const int32_t last = SelectByWeight(logits, vocab, false, cand, top_p, true, false, s);
    if (last >= 0) cand.floor_key = SortKey(Sanitize(__ldg(logits + last)), last);
  }
  // Strict: a draw never lands on a weightless token.
  const int32_t token = SelectByWeight(logits, vocab, !(use_top_k || use_top_p), cand,
                                       static_cast<double>(p.uniform[row]), true, true, s);
  return token >= 0 ? token : argmax;
}

__global__ void __launch_bounds__(kThreads)
    SampleTokensKernel(const __grid_constant__ SampleTokensParams p) {
  __shared__ Scratch s;
  const int64_t row = blockIdx.x;
  const int32_t vocab = p.vocab;
  const float* logits = p.logits + row * vocab;  // [vocab]

  // Argmax as the largest sort key: ties go to the lowest id, and all -inf gives token 0.
  uint64_t best = 0;
  for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
    const uint64_t key = SortKey(Sanitize(__ldg(logits + i)), i);
    best = key > best ? key : best;
  }
  const int32_t argmax = KeyId(BlockMax(best, s));
  const float max_logit = Sanitize(__ldg(logits + argmax));

  // The raw log-softmax normaliser: float terms, double sum (the host's expressions).
  double log_z = -INFINITY;
  if (max_logit > -INFINITY) {
    double sum[1] = {0.0};
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
      sum[0] += ExpF(Sanitize(__ldg(logits + i)) - max_logit);
    }
    BlockSum(sum, s);
    log_z = static_cast<double>(max_logit) + log(sum[0]);
  }

  // Everything below branches on values every thread holds alike, so barriers stay uniform.
  int32_t token = argmax;
  if (p.temperature[row] > 0.0f && max_logit > -INFINITY) {
    token = SampleStochastic(p, row, logits, max_logit, argmax, s);
  }
  if (threadIdx.x == 0) {
    p.token[row] = token;
    p.logprob[row] = max_logit > -INFINITY
                         ? static_cast<float>(static_cast<double>(Sanitize(logits[token])) - log_z)
                         : -INFINITY;
  }
}

}  // namespace

cudaError_t LaunchSampleTokens(const SampleTokensParams& p, cudaStream_t stream) {
  // Row loops step an int32 index by kThreads past the end.
  if (p.n_rows <= 0 || p.vocab <= 0 || p.vocab > INT32_MAX - kThreads) {
    return cudaErrorInvalidValue;
  }
  if (p.logits == nullptr || p.temperature == nullptr || p.top_k == nullptr || p.top_p == nullptr ||
      p.min_p == nullptr || p.uniform == nullptr || p.token == nullptr || p.logprob == nullptr) {
    return cudaErrorInvalidValue;
  }
  SampleTokensKernel<<<p.n_rows, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace subspace::kernels
