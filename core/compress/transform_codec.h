// Transform coding of one KV head's rows (KVTC, ICLR 2026): subtract a mean, project on an
// orthonormal basis over ALL head dimensions, and code each component with its own uniform
// scalar quantizer -- a static offset and step fitted on calibration data, and a width chosen by
// a rate-distortion allocation under a bits-per-row budget (0 bits: the component is its mean).
// Identity basis + equal widths is plain scalar quantization; a PCA basis + a 0-bit tail is a
// truncated low-rank code; the allocation picks what lies between. Stored by TransformKvCache
// (transform_kv_cache.h, the server's --kv-cache transform) and emulated by the long-context
// evaluation (tools/eval).
#ifndef SUBSPACE_CORE_COMPRESS_TRANSFORM_CODEC_H_
#define SUBSPACE_CORE_COMPRESS_TRANSFORM_CODEC_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace subspace {

// Code c in [0, 2^bits) stands for offset + c * step; 0 bits store nothing and give offset.
struct ComponentQuantizer {
  static constexpr int kMaxBits = 8;
  int bits = 0;
  float offset = 0.0f;
  float step = 0.0f;

  // Round to the nearest code, clamped to the range.
  uint32_t Encode(float x) const;
  float Decode(uint32_t code) const { return offset + static_cast<float>(code) * step; }
};

struct TransformCode {
  int dim = 0;
  std::vector<float> mean;  // [dim]
  // [dim] or empty (all 1): the square root of a diagonal error metric. Rows are coded as
  // (x - mean) * scale, so the basis and the widths minimise sum_i m_i (x_i - x'_i)^2: dims an
  // attention weighs more (a query's energy on a key dim, W_O's on a value dim) get more bits.
  std::vector<float> scale;
  std::vector<float> basis;                    // [dim, dim] row j = component j (orthonormal)
  std::vector<ComponentQuantizer> components;  // [dim]

  int BitsPerRow() const;
  int64_t BytesPerRow() const { return (BitsPerRow() + 7) / 8; }
  // Codes packed least significant bit first, component 0 first.
  //   x: [dim]; codes: [BytesPerRow()]
  void Encode(const float* x, uint8_t* codes) const;
  void Decode(const uint8_t* codes, float* x) const;
  // Decode(Encode(x)) in place, without packing. x: [dim]
  void RoundTrip(float* x) const;
};

// The key and value codes of every layer and KV head of a model, [n_layers * n_kv_heads] each,
// layer-major: what a codec file holds, a calibration fits and an online refresh renews.
struct TransformCodes {
  std::shared_ptr<const std::vector<TransformCode>> keys, values;
};

// How a block of B rows coded with one TransformCode is stored by the transform-coded caches
// (TransformKvCache on the CPU, the CUDA backend's kernels): component-major, the components
// with bits widest first (stable in component order), each holding its B codes packed least
// significant bit first in ceil(B x bits / 8) bytes, one component after the other. One
// definition for every cache and kernel that reads or writes these runs.
struct CodedRunLayout {
  std::vector<int> components;   // [active] component index, widest first
  std::vector<int64_t> byte_at;  // [active] first byte of each component's codes in the run
  int64_t run_bytes = 0;         // the run of one KV head's B rows
  int active() const { return static_cast<int>(components.size()); }
};
CodedRunLayout LayOutCodedRun(const TransformCode& code, int block_size);
// One component's codes in a run: B codes of `bits` bits packed LSB-first from `codes` (the
// run plus the component's byte_at). ORs code t in (the run starts zeroed), or reads it.
inline void PutRunCode(uint8_t* codes, int bits, int t, uint32_t code) {
  const int at = t * bits;
  const uint32_t shifted = code << (at & 7);  // at most 15 bits: two bytes
  codes[at >> 3] |= static_cast<uint8_t>(shifted);
  if ((at & 7) + bits > 8) codes[(at >> 3) + 1] |= static_cast<uint8_t>(shifted >> 8);
}
inline uint32_t RunCode(const uint8_t* codes, int bits, int t) {
  const int at = t * bits;
  uint32_t v = codes[at >> 3] >> (at & 7);
  if ((at & 7) + bits > 8) v |= static_cast<uint32_t>(codes[(at >> 3) + 1]) << (8 - (at & 7));
  return v & ((1u << bits) - 1u);
}

struct FittedQuantizer {
  ComponentQuantizer quantizer;
  double mse = 0.0;  // mean squared error over the samples it was fitted on
};

// The uniform quantizer of `bits` bits (0..8) with the least squared error over `samples`:
// ranges mean +- a * stddev over a grid of a (clipping the tails trades their error for a finer
// step), and the samples' [min, max]. 0 bits: offset = the mean, mse = the variance.
FittedQuantizer FitComponentQuantizer(std::span<const float> samples, int bits);

// Exact multiple-choice allocation: component i takes option o (widths[o] bits, distortion
// distortion[i][o]) so that the summed distortion is least with at most `budget_bits` bits in
// all (dynamic programming over the bit count). Returns the option index per component.
// INVALID_ARGUMENT for a negative width, a distortion row of the wrong length, or a budget
// that the narrowest options already exceed.
absl::StatusOr<std::vector<int>> AllocateWidths(std::span<const std::vector<double>> distortion,
                                                std::span<const int> widths, int budget_bits);

// The same allocation with any cost per option (0..255), not its width: e.g. the bytes a
// component of each width takes in a block's run of B codes, ceil(B w / 8).
absl::StatusOr<std::vector<int>> AllocateByCost(std::span<const std::vector<double>> distortion,
                                                std::span<const int> costs, int budget);

struct TransformCodeOptions {
  std::vector<int> widths = {0, 2, 3, 4, 8};  // the widths a component may take
  bool pca = true;                            // false: identity basis (scalar quantization)
  int64_t max_fit_samples = 4096;             // rows used to fit each quantizer (evenly spaced)
};

// One stream's rows (a KV head's keys or values) ready for allocation: the mean, the basis
// (PCA of the centred rows, components by descending variance) and, per component and width,
// the fitted quantizer and its distortion.
struct TransformStream {
  int dim = 0;
  std::vector<float> mean;                             // [dim]
  std::vector<float> scale;                            // [dim] or empty
  std::vector<float> basis;                            // [dim, dim]
  std::vector<std::vector<FittedQuantizer>> by_width;  // [dim][widths]
  std::vector<std::vector<double>> distortion;         // [dim][widths] (mse)
  double variance = 0.0;                               // total, summed over dims
};
// rows: [n, dim]; metric: [dim] positive weights of the squared error per dim, or empty for
// plain squared error. INVALID_ARGUMENT for n < 2, dim < 1, widths outside 0..8 or a metric of
// the wrong size or with a weight that is not positive and finite.
absl::StatusOr<TransformStream> AnalyzeStream(const float* rows, int64_t n, int dim,
                                              const TransformCodeOptions& options,
                                              std::span<const float> metric = {});
// The same from moments instead of rows (online refresh: statistics that forget): `mean`
// [dim] and `covariance` [dim, dim] (row-major, centred, unweighted, any positive multiple) give
// the basis; the quantizers are fitted on `samples` ([n, dim], n >= 2). INVALID_ARGUMENT as
// AnalyzeStream's, and for moments of the wrong size or not finite.
absl::StatusOr<TransformStream> AnalyzeMoments(std::span<const double> mean,
                                               std::span<const double> covariance,
                                               const float* samples, int64_t n, int dim,
                                               const TransformCodeOptions& options,
                                               std::span<const float> metric = {});
// The code of a stream with option index choice[j] for component j.
TransformCode MakeTransformCode(const TransformStream& stream, std::span<const int> choice);

// Fits codes for several streams under one budget of `bits_per_row` * dim bits per stream.
// joint = false: each stream is allocated its own budget. joint = true: the streams share the
// sum of their budgets, each component's distortion divided by its stream's total variance, so
// the streams that need bits more (relative to their own energy) take them from the others.
absl::StatusOr<std::vector<TransformCode>> AllocateTransformCodes(
    std::span<const TransformStream> streams, std::span<const int> widths, double bits_per_row,
    bool joint);

}  // namespace subspace

#endif  // SUBSPACE_CORE_COMPRESS_TRANSFORM_CODEC_H_
