// Plain loops over the pool bytes: the reference expand_blocks.cu is tested against.
#include "tests/kernels/expand_blocks_ref.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"

namespace subspace::kernels {

absl::Status CheckExpandBatch(const ExpandBlocksParams& p, int64_t num_src_pages,
                              int64_t num_dst_pages, int num_basis_epochs) {
  const KvPoolLayout& l = p.layout;
  if (const char* err = KvPoolLayoutError(l)) {
    return absl::InvalidArgumentError(absl::StrFormat("expand batch: %s", err));
  }
  if (p.n_blocks < 0) return absl::InvalidArgumentError("expand batch: negative n_blocks");
  std::set<int32_t> sources, destinations;
  for (int32_t i = 0; i < p.n_blocks; ++i) {
    const int32_t src = p.src_page[i], slot = p.src_slot[i], dst = p.dst_page[i];
    if (src < 0 || src >= num_src_pages) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "expand batch, block %d: source page %d outside [0, %d)", i, src, num_src_pages));
    }
    if (slot < 0 || slot >= l.SlotsPerPage()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "expand batch, block %d: slot %d outside [0, %d)", i, slot, l.SlotsPerPage()));
    }
    if (dst < 0 || dst >= num_dst_pages) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "expand batch, block %d: destination page %d outside [0, %d)", i, dst, num_dst_pages));
    }
    for (int h = 0; h < l.n_kv_heads; ++h) {
      const int32_t e = p.epoch[static_cast<int64_t>(i) * l.n_kv_heads + h];
      if (e < 0 || e >= num_basis_epochs) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "expand batch, block %d head %d: epoch %d outside [0, %d)", i, h, e, num_basis_epochs));
      }
    }
    sources.insert(src);
    if (!destinations.insert(dst).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("expand batch: two blocks write page %d", dst));
    }
  }
  // In one buffer a CTA writing its page could overwrite slots another CTA still reads.
  if (p.src_pool == p.dst_pool) {
    for (int32_t dst : destinations) {
      if (sources.count(dst) != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "expand batch: destination page %d is a source page of the same batch", dst));
      }
    }
  }
  return absl::OkStatus();
}

void ExpandBlocksRef(const ExpandBlocksParams& p) {
  const KvPoolLayout& l = p.layout;
  const int hd = l.head_dim, bs = l.block_size;
  std::vector<float> coef(static_cast<size_t>(std::max(l.rank_k, l.rank_v)));
  for (int32_t b = 0; b < p.n_blocks; ++b) {
    const uint8_t* slot = p.src_pool + l.Slot(p.src_page[b], p.src_slot[b]);
    for (int h = 0; h < l.n_kv_heads; ++h) {
      const int64_t ep = p.epoch[static_cast<int64_t>(b) * l.n_kv_heads + h];
      for (int side = 0; side < 2; ++side) {
        const int r = side == 0 ? l.rank_k : l.rank_v;
        const float* basis = (side == 0 ? p.basis_pq : p.basis_rv) +
                             (ep * l.n_kv_heads + h) * static_cast<int64_t>(hd) * r;
        const uint8_t* codes = slot + (side == 0 ? l.KCodes(h) : l.VCodes(h));     // [B, r]
        const uint8_t* scales = slot + (side == 0 ? l.KScales(h) : l.VScales(h));  // [B] int8
        auto* out = reinterpret_cast<uint16_t*>(
            p.dst_pool + (side == 0 ? l.FullK(p.dst_page[b], h) : l.FullV(p.dst_page[b], h)));
        for (int t = 0; t < bs; ++t) {
          // As DecodeCoeffs: fp16 codes, or int8 codes times the row's fp16 scale in float.
          const uint8_t* row = codes + static_cast<int64_t>(t) * r * l.code_bytes;
          float s = 0.0f;
          if (l.coeff_dtype == CoeffDtype::kInt8) {
            uint16_t s16;
            std::memcpy(&s16, scales + 2 * t, sizeof(s16));
            s = HalfToFloat(s16);
          }
          for (int j = 0; j < r; ++j) {
            if (l.coeff_dtype == CoeffDtype::kFp16) {
              uint16_t c16;
              std::memcpy(&c16, row + 2 * j, sizeof(c16));
              coef[static_cast<size_t>(j)] = HalfToFloat(c16);
            } else {
              coef[static_cast<size_t>(j)] = s * static_cast<float>(static_cast<int8_t>(row[j]));
            }
          }
          for (int i = 0; i < hd; ++i) {
            double acc = 0.0;
            for (int j = 0; j < r; ++j) {
              // P_q is [d, r_k] (row i), R_v is [r_v, d] (column i).
              const float m = side == 0 ? basis[static_cast<int64_t>(i) * r + j]
                                        : basis[static_cast<int64_t>(j) * hd + i];
              acc += static_cast<double>(m) * coef[static_cast<size_t>(j)];
            }
            out[static_cast<int64_t>(t) * hd + i] = Fp32ToFp16(static_cast<float>(acc));
          }
        }
      }
    }
  }
}

namespace testing {

ExpandBlocksParams ExpandCase::HostParams() {
  ExpandBlocksParams p;
  p.layout = layout;
  p.src_pool = src_pool.data();
  p.dst_pool = dst_bytes().data();
  p.basis_pq = bases.p_q.data();
  p.basis_rv = bases.r_v.data();
  p.src_page = src_page.data();
  p.src_slot = src_slot.data();
  p.dst_page = dst_page.data();
  p.epoch = epoch.data();
  p.n_blocks = n_blocks();
  return p;
}

ExpandCase RandomExpandCase(const KvPoolLayout& l, int n_blocks, int n_epochs, bool one_pool,
                            std::mt19937_64& rng) {
  ExpandCase c;
  c.layout = l;
  c.one_pool = one_pool;
  c.bases = RandomBases(l, n_epochs, rng);
  const int per_page = l.SlotsPerPage();
  const int64_t slab_pages = (n_blocks + per_page - 1) / per_page + 1;  // one spare: scattered
  const int64_t dst_pages = n_blocks + 2;                               // two nobody names
  c.num_src_pages = one_pool ? slab_pages + dst_pages : slab_pages + 1;
  c.num_dst_pages = one_pool ? c.num_src_pages : dst_pages;
  c.src_pool.assign(static_cast<size_t>(c.num_src_pages * l.page_bytes), kPoison);
  if (!one_pool) c.dst_pool.assign(static_cast<size_t>(c.num_dst_pages * l.page_bytes), kPoison);

  std::vector<int32_t> src_ids(static_cast<size_t>(c.num_src_pages));
  for (int64_t i = 0; i < c.num_src_pages; ++i) src_ids[i] = static_cast<int32_t>(i);
  std::shuffle(src_ids.begin(), src_ids.end(), rng);
  std::vector<int32_t> dst_ids;  // with one_pool: the source pool's pages past the slabs
  if (one_pool) {
    dst_ids.assign(src_ids.begin() + slab_pages, src_ids.end());
  } else {
    for (int64_t i = 0; i < c.num_dst_pages; ++i) dst_ids.push_back(static_cast<int32_t>(i));
    std::shuffle(dst_ids.begin(), dst_ids.end(), rng);
  }
  std::vector<std::pair<int32_t, int32_t>> slots;
  for (int64_t i = 0; i < slab_pages; ++i) {
    for (int s = 0; s < per_page; ++s) slots.emplace_back(src_ids[i], s);
  }
  std::shuffle(slots.begin(), slots.end(), rng);

  const float sigma_k = std::sqrt(static_cast<float>(l.head_dim) / l.rank_k);
  const float sigma_v = std::sqrt(static_cast<float>(l.head_dim) / l.rank_v);
  const bool int8 = l.coeff_dtype == CoeffDtype::kInt8;
  std::uniform_int_distribution<int32_t> pick(0, n_epochs - 1);
  std::vector<double> decoded;
  for (int i = 0; i < n_blocks; ++i) {
    const auto [page, slot] = slots[static_cast<size_t>(i)];
    c.src_page.push_back(page);
    c.src_slot.push_back(slot);
    c.dst_page.push_back(dst_ids[static_cast<size_t>(i)]);
    uint8_t* at = c.src_pool.data() + l.Slot(page, slot);
    for (int h = 0; h < l.n_kv_heads; ++h) {
      c.epoch.push_back(pick(rng));
      for (int t = 0; t < l.block_size; ++t) {
        RandomCodes(l, l.rank_k, sigma_k, rng,
                    at + l.KCodes(h) + static_cast<int64_t>(t) * l.rank_k * l.code_bytes,
                    int8 ? at + l.KScales(h) + 2 * t : nullptr, &decoded);
        RandomCodes(l, l.rank_v, sigma_v, rng,
                    at + l.VCodes(h) + static_cast<int64_t>(t) * l.rank_v * l.code_bytes,
                    int8 ? at + l.VScales(h) + 2 * t : nullptr, &decoded);
      }
    }
  }
  return c;
}

}  // namespace testing
}  // namespace subspace::kernels
