// Plain loops over the pool bytes: the reference recode_blocks.cu is tested against.
#include "tests/kernels/recode_blocks_ref.h"

#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/base/coeff_codec.h"
#include "tests/kernels/compress_blocks_ref.h"

namespace subspace::kernels {

absl::Status CheckRecodeBatch(const RecodeBlocksParams& p, int64_t num_pages,
                              int num_basis_epochs) {
  const KvPoolLayout& l = p.layout;
  if (const char* err = KvPoolLayoutError(l)) {
    return absl::InvalidArgumentError(absl::StrFormat("recode batch: %s", err));
  }
  if (p.n_blocks < 0) return absl::InvalidArgumentError("recode batch: negative n_blocks");
  std::set<std::pair<int32_t, int32_t>> slots;
  for (int32_t i = 0; i < p.n_blocks; ++i) {
    const int32_t page = p.page[i], slot = p.slot[i];
    if (page < 0 || page >= num_pages) {
      return absl::InvalidArgumentError(
          absl::StrFormat("recode batch, block %d: page %d outside [0, %d)", i, page, num_pages));
    }
    if (slot < 0 || slot >= l.SlotsPerPage()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "recode batch, block %d: slot %d outside [0, %d)", i, slot, l.SlotsPerPage()));
    }
    for (int h = 0; h < l.n_kv_heads; ++h) {
      const int64_t at = static_cast<int64_t>(i) * l.n_kv_heads + h;
      for (const int32_t e : {p.from_epoch[at], p.to_epoch[at]}) {
        if (e < 0 || e >= num_basis_epochs) {
          return absl::InvalidArgumentError(
              absl::StrFormat("recode batch, block %d head %d: epoch %d outside [0, %d)", i, h, e,
                              num_basis_epochs));
        }
      }
    }
    if (!slots.insert({page, slot}).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("recode batch: two blocks in slot %d of page %d", slot, page));
    }
  }
  return absl::OkStatus();
}

void RecodeBlocksRef(const RecodeBlocksParams& p) {
  const KvPoolLayout& l = p.layout;
  const int d = l.head_dim, bs = l.block_size;
  std::vector<float> c, out;
  std::vector<double> row(static_cast<size_t>(d));
  for (int32_t i = 0; i < p.n_blocks; ++i) {
    uint8_t* slot = p.pool + l.Slot(p.page[i], p.slot[i]);
    for (int h = 0; h < l.n_kv_heads; ++h) {
      const int64_t from = p.from_epoch[static_cast<int64_t>(i) * l.n_kv_heads + h];
      const int64_t to = p.to_epoch[static_cast<int64_t>(i) * l.n_kv_heads + h];
      for (int side = 0; side < 2; ++side) {
        const int r = side == 0 ? l.rank_k : l.rank_v;
        const int64_t code_bytes = CodeBytes(l.coeff_dtype, 1);
        uint8_t* codes = slot + (side == 0 ? l.KCodes(h) : l.VCodes(h));
        auto* scales =
            reinterpret_cast<uint16_t*>(slot + (side == 0 ? l.KScales(h) : l.VScales(h)));
        const float* old_basis =
            (side == 0 ? p.basis_pq : p.basis_rv) + (from * l.n_kv_heads + h) * d * r;
        const float* new_basis =
            (side == 0 ? p.basis_pk : p.basis_pv) + (to * l.n_kv_heads + h) * d * r;
        c.resize(static_cast<size_t>(r));
        out.resize(static_cast<size_t>(r));
        for (int t = 0; t < bs; ++t) {
          uint8_t* row_codes = codes + static_cast<int64_t>(t) * r * code_bytes;
          DecodeCoeffs(l.coeff_dtype, row_codes, scales + t, r, c.data());
          for (int x = 0; x < d; ++x) {
            double acc = 0.0;
            for (int j = 0; j < r; ++j) {
              const float b = side == 0 ? old_basis[x * r + j] : old_basis[j * d + x];
              acc += static_cast<double>(b) * c[static_cast<size_t>(j)];
            }
            row[static_cast<size_t>(x)] = acc;
          }
          for (int j = 0; j < r; ++j) {
            double acc = 0.0;
            for (int x = 0; x < d; ++x) acc += row[static_cast<size_t>(x)] * new_basis[x * r + j];
            out[static_cast<size_t>(j)] = static_cast<float>(acc);
          }
          EncodeCoeffsRef(l.coeff_dtype, out.data(), r, row_codes, scales + t);
        }
      }
    }
  }
}

namespace testing {

RecodeBlocksParams RecodeCase::HostParams(std::vector<uint8_t>& pool) const {
  RecodeBlocksParams p;
  p.layout = coded.layout;
  p.pool = pool.data();
  p.basis_pq = coded.bases.p_q.data();
  p.basis_rv = coded.bases.r_v.data();
  p.basis_pk = coded.bases.p_k.data();
  p.basis_pv = coded.bases.p_v.data();
  p.page = coded.src_page.data();
  p.slot = coded.src_slot.data();
  p.from_epoch = coded.epoch.data();
  p.to_epoch = to.data();
  p.n_blocks = coded.n_blocks();
  return p;
}

RecodeCase RandomRecodeCase(const KvPoolLayout& l, int n_blocks, int n_epochs,
                            std::mt19937_64& rng) {
  RecodeCase c{RandomExpandCase(l, n_blocks, n_epochs, /*one_pool=*/true, rng), {}};
  std::uniform_int_distribution<int32_t> pick(0, n_epochs - 1);
  c.to.resize(c.coded.epoch.size());
  for (int32_t& e : c.to) e = pick(rng);
  return c;
}

}  // namespace testing
}  // namespace subspace::kernels
