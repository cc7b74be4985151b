// Fuzzes what a restarting server reads from its session directory. The first byte picks the
// reader: 0, DecodeSessionSnapshot (a snapshot it accepts re-encodes to one it reads back the
// same, and its cache image goes to the cache of its layout); 1, the paged cache's
// ImportSequence; 2, the compressed cache's; 3, the transform-coded cache's
// (fuzz/snapshot_setup.h). An import fails with
// DATA_LOSS, FAILED_PRECONDITION or RESOURCE_EXHAUSTED and takes nothing from the pool, or gives
// a sequence that attends, exports, imports again and frees every block.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/engine/session_snapshot.h"
#include "fuzz/fuzz_util.h"
#include "fuzz/snapshot_setup.h"

namespace subspace::fuzz {
namespace {

void ImportInto(KvCache& cache, std::string_view image) {
  const int64_t free = cache.Stats().blocks_free;
  absl::StatusOr<SeqId> seq = cache.ImportSequence(image);
  if (!seq.ok()) {
    const absl::StatusCode code = seq.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kDataLoss ||
               code == absl::StatusCode::kFailedPrecondition ||
               code == absl::StatusCode::kResourceExhausted);
    FUZZ_CHECK(cache.Stats().blocks_free == free);
    FUZZ_CHECK(cache.Stats().sequences == 0);
    return;
  }
  const int64_t length = cache.Length(*seq);
  if (length > 0) {
    // Every index attention follows (blocks, slots, epochs, outliers) must be in range.
    const KvCacheGeometry& g = cache.geometry();
    const int n_heads = 2 * g.n_kv_heads;
    std::vector<float> q(static_cast<size_t>(n_heads * g.head_dim), 0.5f), out(q.size());
    const AttentionRequest req{*seq, length - 1, 1, q.data(), out.data(), 0};
    cache.Attend(0, std::span<const AttentionRequest>(&req, 1), n_heads);
  }
  absl::StatusOr<std::string> again = cache.ExportSequence(*seq);
  FUZZ_CHECK(again.ok());
  absl::StatusOr<SeqId> copy = cache.ImportSequence(*again);
  FUZZ_CHECK(copy.ok() || copy.status().code() == absl::StatusCode::kResourceExhausted);
  if (copy.ok()) {
    FUZZ_CHECK(cache.Length(*copy) == length);
    FUZZ_CHECK(cache.FreeSequence(*copy).ok());
  }
  FUZZ_CHECK(cache.FreeSequence(*seq).ok());
  FUZZ_CHECK(cache.Stats().blocks_free == free);
}

}  // namespace
}  // namespace subspace::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace subspace;
  using namespace subspace::fuzz;
  static PagedKvCache* const paged = SnapshotPagedCache().release();
  static CompressedKvCache* const compressed = SnapshotCompressedCache().release();
  static TransformKvCache* const transform = SnapshotTransformCache().release();
  if (size == 0) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0: {
      absl::StatusOr<SessionImage> image =
          DecodeSessionSnapshot(bytes, kSnapshotIdentity, uint64_t{1} << 20);
      if (!image.ok()) return 0;
      FUZZ_CHECK(image->cached >= 0 && image->cached <= static_cast<int64_t>(image->tokens.size()));
      const std::string encoded = EncodeSessionSnapshot(*image, kSnapshotIdentity);
      absl::StatusOr<SessionImage> back =
          DecodeSessionSnapshot(encoded, kSnapshotIdentity, uint64_t{1} << 20);
      FUZZ_CHECK(back.ok());
      FUZZ_CHECK(back->id == image->id && back->tokens == image->tokens &&
                 back->cache == image->cache && back->cache_layout == image->cache_layout);
      if (image->cache_layout == paged->ImageLayout()) ImportInto(*paged, image->cache);
      if (image->cache_layout == compressed->ImageLayout()) ImportInto(*compressed, image->cache);
      if (image->cache_layout == transform->ImageLayout()) ImportInto(*transform, image->cache);
      break;
    }
    case 1:
      ImportInto(*paged, bytes);
      break;
    case 2:
      ImportInto(*compressed, bytes);
      break;
    default:
      ImportInto(*transform, bytes);
      break;
  }
  return 0;
}
