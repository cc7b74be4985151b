// The KV caches a user would pick instead of low-rank compression, as evaluation baselines (not
// served): eviction (StreamingLLM: attention sinks + the recent window, the rest dropped),
// full-rank K/V quantized per 32-element block the way llama.cpp's q8_0 and q4_0 cache types
// store them, the same after a randomized Hadamard rotation per head (what llama.cpp now does
// by default), TurboQuant's MSE quantizer (rotation, the row's norm, a Gaussian Lloyd-Max
// codebook per coordinate) at 2.5 and 3.5 bits, and KIVI's 2-D int4 / int2 (keys per channel
// over groups of G tokens, values per token in groups of 32 channels; the newest, incomplete
// key group kept in full precision). Beside them, the transform codec under study
// (core/compress/transform_codec.h) with S sinks and the last W tokens exact, keys coded
// before or after RoPE.
//
// Each keeps every token's K/V exactly as its format would give them back (quantized and
// dequantized when written, KIVI's keys when their group completes) and attends with a plain
// reference attention, so its quality is the format's; its footprint is computed from the
// format (BytesPerToken), not from a packed pool. Sequences, reservation and accounting are
// those of the PagedKvCache it wraps, so the engine and the model drive it like any cache.
#ifndef SUBSPACE_TOOLS_EVAL_BASELINE_KV_CACHES_H_
#define SUBSPACE_TOOLS_EVAL_BASELINE_KV_CACHES_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/base/rope.h"
#include "core/compress/transform_codec.h"
#include "core/kvcache/forwarding_kv_cache.h"
#include "core/kvcache/kv_cache.h"
#include "tools/eval/rotated_quant.h"

namespace subspace::eval {

enum class BaselineKind {
  kFull,
  kEvict,
  kQ8_0,
  kQ4_0,
  kKivi4,
  kHq8_0,     // randomized Hadamard, then q8_0
  kHq4_0,     // randomized Hadamard, then q4_0
  kTurbo2_5,  // TurboQuant MSE, half the coordinates at 3 bits, half at 2, + an fp16 norm
  kTurbo3_5,  // the same at 4 and 3 bits
  kKivi2,
  kTransform,  // the transform codec: needs key_codes / value_codes
};
// full, evict, q8_0, q4_0, kivi4, hq8_0, hq4_0, tq2.5, tq3.5, kivi2, tc
const char* BaselineKindName(BaselineKind kind);
// Every kind but kTransform (whose codes come from calibration).
absl::StatusOr<BaselineKind> ParseBaselineKind(std::string_view name);

struct BaselineKvCacheConfig {
  KvCacheGeometry geometry;
  BaselineKind kind = BaselineKind::kFull;
  int sink_tokens = 4;     // kEvict: the first S tokens stay
  int window_tokens = 64;  // kEvict: the last W tokens (the query's own included) stay
  int kivi_group = 32;     // kKivi4: tokens per key group (the residual holds < G tokens)
  int block_size = 16;     // of the wrapped PagedKvCache
  int64_t capacity_bytes = 0;
  uint32_t rotation_seed = 0x5eed;  // the random signs of the Hadamard rotations
  // Quantizing kinds: the S sinks and the last W tokens are read exact, as tc reads them, so
  // the formats are compared with the same exact tokens (a user's llama.cpp cache quantizes
  // all of them: false).
  bool exact_sinks_window = false;
  // kTransform: the codes of layer l, KV head h at [l * n_kv_heads + h]; tokens [S, p - W]
  // of a query at p read them, the others are exact (as evict keeps them).
  std::shared_ptr<const std::vector<TransformCode>> key_codes, value_codes;
  // kTransform: set, keys are coded before RoPE (rotated back, coded, decoded, rotated again).
  std::optional<RopeSchedule> key_rope;
  // kTransform: false keeps that side exact (at fp16's bytes), for the K-only / V-only ablation.
  bool code_keys = true, code_values = true;
};

// Bytes one token takes, all layers, averaged over a sequence of `length` tokens: fp16 K/V for
// kFull; kFull's bytes for min(length, S + W) tokens spread over `length` for kEvict; 34 bytes
// per 32 values (fp16 scale + int8) for q8_0; 18 (fp16 scale + 16 nibble bytes) for q4_0; for
// kivi4 nibbles plus an fp16 scale and zero per (channel, G tokens) of keys and per (token, 32
// channels) of values, the newest length mod G keys at fp16 (kivi2 the same with 2-bit codes);
// hq8_0 / hq4_0 as q8_0 / q4_0; tq the codes' bits plus an fp16 norm per head row; tc the
// codes' whole bytes per row for the tokens past S + W, fp16 for those; with
// exact_sinks_window the same split for every quantizing kind.
double BaselineBytesPerToken(const BaselineKvCacheConfig& config, int64_t length);

// Round trips of one row through the formats (n a multiple of 32 for q8_0 / q4_0), as
// llama.cpp's reference quantizers define them: q8_0 d = max|x| / 127, q = round(x / d);
// q4_0 d = m / -8 for the signed m of largest magnitude, q = min(15, (int)(x / d + 8.5)),
// x' = (q - 8) d. Exposed for the tests.
void RoundTripQ8_0(std::span<float> row);
void RoundTripQ4_0(std::span<float> row);
// Asymmetric `bits`-bit min/max quantization of x[i * stride] for i < n (KIVI's groups).
void RoundTripAsym(int bits, float* x, int64_t n, int64_t stride);
inline void RoundTripAsym4(float* x, int64_t n, int64_t stride) { RoundTripAsym(4, x, n, stride); }

class BaselineKvCache final : public ForwardingKvCache {
 public:
  static absl::StatusOr<std::unique_ptr<BaselineKvCache>> Create(
      const BaselineKvCacheConfig& config);

  absl::StatusOr<SeqId> CreateSequence() override;
  absl::Status FreeSequence(SeqId seq) override;
  void Write(int layer, SeqId seq, int64_t pos, int64_t n, const float* k, const float* v) override;
  void Attend(int layer, std::span<const AttentionRequest> requests, int n_heads) override;
  absl::Status Truncate(SeqId seq, int64_t length) override;

  const BaselineKvCacheConfig& config() const { return config_; }

 private:
  struct Layer {
    std::vector<float> k, v;    // [tokens, n_kv, d] as the format gives them back
    std::vector<float> kc, vc;  // split_: [tokens, n_kv, d] as the format gives them back
    int64_t keys_grouped = 0;   // kKivi4 / kKivi2: keys [0, keys_grouped) are quantized
  };
  struct Sequence {
    std::vector<Layer> layers;
  };

  BaselineKvCache(const BaselineKvCacheConfig& config, std::unique_ptr<KvCache> inner);
  // KIVI: quantizes complete key groups of `keys` from `grouped` up to `length`.
  void QuantizeKeyGroups(std::vector<float>& keys, int64_t& grouped, int64_t length);
  int KiviBits() const { return config_.kind == BaselineKind::kKivi2 ? 2 : 4; }
  void WriteTransformCodes(int layer, Layer& l, int64_t pos, int64_t n);

  BaselineKvCacheConfig config_;
  bool split_;  // exact rows in k / v, the format's in kc / vc (read between sinks and window)
  RandomizedHadamard rotation_;
  std::optional<RopeSchedule> key_unrope_;  // kTransform pre-RoPE: key_rope's inverse
  std::vector<Sequence> seqs_;              // by SeqId
};

}  // namespace subspace::eval

#endif  // SUBSPACE_TOOLS_EVAL_BASELINE_KV_CACHES_H_
