// The KV caches a user would pick instead of low-rank compression, as evaluation baselines (not
// served): eviction (StreamingLLM: attention sinks + the recent window, the rest dropped),
// full-rank K/V quantized per 32-element block the way llama.cpp's q8_0 and q4_0 cache types
// store them, and KIVI's 2-D int4 (keys per channel over groups of G tokens, values per token
// in groups of 32 channels; the newest, incomplete key group kept in full precision).
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
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/kvcache/forwarding_kv_cache.h"
#include "core/kvcache/kv_cache.h"

namespace subspace::eval {

enum class BaselineKind { kFull, kEvict, kQ8_0, kQ4_0, kKivi4 };
const char* BaselineKindName(BaselineKind kind);  // full, evict, q8_0, q4_0, kivi4
absl::StatusOr<BaselineKind> ParseBaselineKind(std::string_view name);

struct BaselineKvCacheConfig {
  KvCacheGeometry geometry;
  BaselineKind kind = BaselineKind::kFull;
  int sink_tokens = 4;     // kEvict: the first S tokens stay
  int window_tokens = 64;  // kEvict: the last W tokens (the query's own included) stay
  int kivi_group = 32;     // kKivi4: tokens per key group (the residual holds < G tokens)
  int block_size = 16;     // of the wrapped PagedKvCache
  int64_t capacity_bytes = 0;
};

// Bytes one token takes, all layers, averaged over a sequence of `length` tokens: fp16 K/V for
// kFull; kFull's bytes for min(length, S + W) tokens spread over `length` for kEvict; 34 bytes
// per 32 values (fp16 scale + int8) for q8_0; 18 (fp16 scale + 16 nibble bytes) for q4_0; for
// kivi4 nibbles plus an fp16 scale and zero per (channel, G tokens) of keys and per (token, 32
// channels) of values, the newest length mod G keys at fp16.
double BaselineBytesPerToken(const BaselineKvCacheConfig& config, int64_t length);

// Round trips of one row through the formats (n a multiple of 32 for q8_0 / q4_0), as
// llama.cpp's reference quantizers define them: q8_0 d = max|x| / 127, q = round(x / d);
// q4_0 d = m / -8 for the signed m of largest magnitude, q = min(15, (int)(x / d + 8.5)),
// x' = (q - 8) d. Exposed for the tests.
void RoundTripQ8_0(std::span<float> row);
void RoundTripQ4_0(std::span<float> row);
// Asymmetric 4-bit min/max quantization of x[i * stride] for i < n (KIVI's groups).
void RoundTripAsym4(float* x, int64_t n, int64_t stride);

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
    std::vector<float> k, v;   // [tokens, n_kv, d] as the format gives them back
    int64_t keys_grouped = 0;  // kKivi4: keys [0, keys_grouped) are quantized
  };
  struct Sequence {
    std::vector<Layer> layers;
  };

  BaselineKvCache(const BaselineKvCacheConfig& config, std::unique_ptr<KvCache> inner);
  void QuantizeKeyGroups(Layer& l, int64_t length);

  BaselineKvCacheConfig config_;
  std::vector<Sequence> seqs_;  // by SeqId
};

}  // namespace subspace::eval

#endif  // SUBSPACE_TOOLS_EVAL_BASELINE_KV_CACHES_H_
