// The KV pool's bytes as the CUDA kernels and their CPU twins address them: the pages and slab
// slots core/compress/compressed_kv_cache.cc fills (fp16 full blocks, fp16 or int8 coefficient
// slots), so a device pool holds exactly the bytes the CPU cache would. C++17 and free of CUDA
// headers: nvcc, the host compiler and the twins all include it.
#ifndef SUBSPACE_KERNELS_KV_LAYOUT_H_
#define SUBSPACE_KERNELS_KV_LAYOUT_H_

#include <cstdint>

#include "core/base/coeff_codec.h"

#if defined(__CUDACC__)
#define SUBSPACE_HOST_DEVICE __host__ __device__
#else
#define SUBSPACE_HOST_DEVICE
#endif

namespace subspace::kernels {

// Outlier masks are one uint64 per block, as in CompressedKvCacheConfig::block_size.
inline constexpr int kMaxBlockSize = 64;

// One layer's pool geometry. A page is one full block [2][n_kv][B][head_dim] fp16 (K half, then
// V half). A compressed block lives in a slab slot of `slot_bytes` at page * page_bytes +
// slot * slot_bytes: codes [n_kv][B][r_k], codes [n_kv][B][r_v], then for int8 the fp16 scales
// [n_kv][B] of the keys and [n_kv][B] of the values (CompressedKvCache::CompressBlock).
// Offsets are int64: page ids times page bytes overflow int32 on real pools.
struct KvPoolLayout {
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 0;  // B
  int32_t rank_k = 0;
  int32_t rank_v = 0;
  CoeffDtype coeff_dtype = CoeffDtype::kFp16;  // kFp16 or kInt8 (kFp32 only on the CPU cache)
  int32_t code_bytes = 2;                      // bytes of one coefficient code: 2 or 1
  int64_t page_bytes = 0;                      // 2 * n_kv * B * head_dim * 2
  int64_t slot_bytes = 0;  // compressed block rounded up to 16 bytes (SlabAllocator::AddClass)

  SUBSPACE_HOST_DEVICE int64_t Page(int32_t page) const {
    return static_cast<int64_t>(page) * page_bytes;
  }
  // Full block: K rows of head h, [B, head_dim] fp16, and V rows of head h.
  SUBSPACE_HOST_DEVICE int64_t FullK(int32_t page, int h) const {
    return Page(page) + static_cast<int64_t>(h) * block_size * head_dim * 2;
  }
  SUBSPACE_HOST_DEVICE int64_t FullV(int32_t page, int h) const {
    return FullK(page, h) + static_cast<int64_t>(n_kv_heads) * block_size * head_dim * 2;
  }
  // Compressed block in slot `slot` of page `page`: its first byte.
  SUBSPACE_HOST_DEVICE int64_t Slot(int32_t page, int32_t slot) const {
    return Page(page) + static_cast<int64_t>(slot) * slot_bytes;
  }
  // Inside a slot: key codes of head h [B, r_k], value codes [B, r_v], int8 scales [B] each.
  SUBSPACE_HOST_DEVICE int64_t KCodes(int h) const {
    return static_cast<int64_t>(h) * block_size * rank_k * code_bytes;
  }
  SUBSPACE_HOST_DEVICE int64_t VCodes(int h) const {
    return Rows() * rank_k * code_bytes +
           static_cast<int64_t>(h) * block_size * rank_v * code_bytes;
  }
  SUBSPACE_HOST_DEVICE int64_t KScales(int h) const {
    return Rows() * (rank_k + rank_v) * code_bytes + static_cast<int64_t>(h) * block_size * 2;
  }
  SUBSPACE_HOST_DEVICE int64_t VScales(int h) const { return KScales(h) + Rows() * 2; }
  SUBSPACE_HOST_DEVICE int64_t Rows() const {
    return static_cast<int64_t>(n_kv_heads) * block_size;
  }
  // Payload of one compressed block before rounding (CompressedKvCache::CompressedBlockBytes).
  SUBSPACE_HOST_DEVICE int64_t CompressedBytes() const {
    return Rows() * (rank_k + rank_v) * code_bytes +
           (coeff_dtype == CoeffDtype::kInt8 ? 2 * Rows() * 2 : 0);
  }
  SUBSPACE_HOST_DEVICE int32_t SlotsPerPage() const {
    const int64_t n = page_bytes / slot_bytes;
    return static_cast<int32_t>(n < 64 ? n : 64);  // SlabAllocator::kMaxSlotsPerPage
  }
};

inline KvPoolLayout MakeKvPoolLayout(int n_kv_heads, int head_dim, int block_size, int rank_k,
                                     int rank_v, CoeffDtype dtype) {
  KvPoolLayout l;
  l.n_kv_heads = n_kv_heads;
  l.head_dim = head_dim;
  l.block_size = block_size;
  l.rank_k = rank_k;
  l.rank_v = rank_v;
  l.coeff_dtype = dtype;
  l.code_bytes = dtype == CoeffDtype::kInt8 ? 1 : dtype == CoeffDtype::kFp16 ? 2 : 4;
  l.page_bytes = 2 * static_cast<int64_t>(n_kv_heads) * block_size * head_dim * 2;
  l.slot_bytes = (l.CompressedBytes() + 15) / 16 * 16;
  return l;
}

// nullptr when kernels and twins can address `l`, else why not. Head-dim support is the
// launchers' business (they dispatch on it); this is the layout alone.
inline const char* KvPoolLayoutError(const KvPoolLayout& l) {
  if (l.n_kv_heads <= 0 || l.head_dim <= 0) return "n_kv_heads and head_dim must be positive";
  if (l.block_size <= 0 || l.block_size > kMaxBlockSize) return "block_size must be in [1, 64]";
  if (l.rank_k < 1 || l.rank_k > l.head_dim || l.rank_v < 1 || l.rank_v > l.head_dim) {
    return "ranks must be in [1, head_dim]";
  }
  if (l.coeff_dtype != CoeffDtype::kFp16 && l.coeff_dtype != CoeffDtype::kInt8) {
    return "coefficients must be fp16 or int8";
  }
  if (l.slot_bytes <= 0 || l.slot_bytes > l.page_bytes) return "a compressed block exceeds a page";
  // fp16 scales and fp16 codes must sit on 2-byte boundaries (true for any even B).
  if (l.coeff_dtype == CoeffDtype::kInt8 && l.Rows() * (l.rank_k + l.rank_v) % 2 != 0) {
    return "int8 scales would be misaligned: n_kv * B * (r_k + r_v) must be even";
  }
  return nullptr;
}

}  // namespace subspace::kernels

#endif  // SUBSPACE_KERNELS_KV_LAYOUT_H_
