// Plain loops over the pool bytes: the reference compress_blocks.cu is tested against.
#include "tests/kernels/compress_blocks_ref.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"

namespace subspace::kernels {

absl::Status CheckCompressBatch(const CompressBlocksParams& p, int64_t num_pages,
                                int num_basis_epochs) {
  const KvPoolLayout& l = p.layout;
  if (const char* err = KvPoolLayoutError(l)) {
    return absl::InvalidArgumentError(absl::StrFormat("compress batch: %s", err));
  }
  if (p.n_blocks < 0) return absl::InvalidArgumentError("compress batch: negative n_blocks");
  if (p.outlier_masks != nullptr && p.basis_pq == nullptr) {
    return absl::InvalidArgumentError("compress batch: outlier masks without basis_pq");
  }
  std::set<int32_t> sources;
  std::set<std::pair<int32_t, int32_t>> destinations;
  for (int32_t i = 0; i < p.n_blocks; ++i) {
    const int32_t src = p.src_page[i], dst = p.dst_page[i], slot = p.dst_slot[i];
    if (src < 0 || src >= num_pages || dst < 0 || dst >= num_pages) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "compress batch, block %d: page %d or %d outside [0, %d)", i, src, dst, num_pages));
    }
    if (slot < 0 || slot >= l.SlotsPerPage()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "compress batch, block %d: slot %d outside [0, %d)", i, slot, l.SlotsPerPage()));
    }
    for (int h = 0; h < l.n_kv_heads; ++h) {
      const int32_t e = p.epoch[static_cast<int64_t>(i) * l.n_kv_heads + h];
      if (e < 0 || e >= num_basis_epochs) {
        return absl::InvalidArgumentError(
            absl::StrFormat("compress batch, block %d head %d: epoch %d outside [0, %d)", i, h, e,
                            num_basis_epochs));
      }
    }
    sources.insert(src);
    if (!destinations.insert({dst, slot}).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("compress batch: two blocks write slot %d of page %d", slot, dst));
    }
  }
  for (const auto& [dst, slot] : destinations) {
    if (sources.count(dst) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "compress batch: slot %d of page %d lies in a source page of the same batch", slot, dst));
    }
  }
  return absl::OkStatus();
}

void EncodeCoeffsRef(CoeffDtype dtype, const float* x, int r, void* codes, uint16_t* scale) {
  if (dtype == CoeffDtype::kFp16) {
    auto* h = static_cast<uint16_t*>(codes);
    for (int j = 0; j < r; ++j) h[j] = Fp32ToFp16(x[j]);
    return;
  }
  assert(dtype == CoeffDtype::kInt8);
  float amax = 0.0f;
  for (int j = 0; j < r; ++j) amax = std::max(amax, std::fabs(x[j]));
  const uint16_t s16 = Fp32ToFp16(amax / 127.0f);  // the stored scale, and the one decoding uses
  const float s = HalfToFloat(s16);
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  auto* q = static_cast<int8_t*>(codes);
  for (int j = 0; j < r; ++j) {
    q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(x[j] * inv), -127.0f, 127.0f));
  }
  *scale = s16;
}

namespace {

// Whether a key row (fp16 [d]) is an outlier under P_q ([d, r] row-major) given its fp32
// coefficients c [r]: CompressedKvCache::CompressBlock's test, k^ = P_q c and the sums in double.
bool IsOutlierKey(const uint16_t* k, const float* pq, const float* c, int hd, int r, float thr) {
  double err = 0.0, norm = 0.0;
  for (int i = 0; i < hd; ++i) {
    double kr = 0.0;
    for (int j = 0; j < r; ++j)
      kr += static_cast<double>(pq[static_cast<int64_t>(i) * r + j]) * c[j];
    const double x = HalfToFloat(k[i]);
    err += (x - kr) * (x - kr);
    norm += x * x;
  }
  return err > static_cast<double>(thr) * thr * norm;
}

}  // namespace

void CompressBlocksRef(const CompressBlocksParams& p) {
  const KvPoolLayout& l = p.layout;
  const int hd = l.head_dim, bs = l.block_size;
  std::vector<float> coef(static_cast<size_t>(std::max(l.rank_k, l.rank_v)));
  for (int32_t i = 0; i < p.n_blocks; ++i) {
    const int64_t slot = l.Slot(p.dst_page[i], p.dst_slot[i]);
    for (int h = 0; h < l.n_kv_heads; ++h) {
      const int64_t ep = p.epoch[static_cast<int64_t>(i) * l.n_kv_heads + h];
      for (int side = 0; side < 2; ++side) {
        const int r = side == 0 ? l.rank_k : l.rank_v;
        const float* basis = (side == 0 ? p.basis_pk : p.basis_pv) +
                             (ep * l.n_kv_heads + h) * static_cast<int64_t>(hd) * r;  // [d, r]
        const auto* rows = reinterpret_cast<const uint16_t*>(
            p.pool + (side == 0 ? l.FullK(p.src_page[i], h) : l.FullV(p.src_page[i], h)));
        uint8_t* codes = p.pool + slot + (side == 0 ? l.KCodes(h) : l.VCodes(h));
        auto* scales =
            reinterpret_cast<uint16_t*>(p.pool + slot + (side == 0 ? l.KScales(h) : l.VScales(h)));
        for (int t = 0; t < bs; ++t) {
          for (int j = 0; j < r; ++j) {
            double acc = 0.0;
            for (int d = 0; d < hd; ++d) {
              acc += static_cast<double>(HalfToFloat(rows[static_cast<int64_t>(t) * hd + d])) *
                     basis[static_cast<int64_t>(d) * r + j];
            }
            coef[static_cast<size_t>(j)] = static_cast<float>(acc);
          }
          if (side == 0 && p.outlier_masks != nullptr) {
            const float* pq = p.basis_pq + (ep * l.n_kv_heads + h) * static_cast<int64_t>(hd) * r;
            if (IsOutlierKey(rows + static_cast<int64_t>(t) * hd, pq, coef.data(), hd, r,
                             p.outlier_threshold)) {
              p.outlier_masks[i] |= uint64_t{1} << t;
            }
          }
          uint16_t scale = 0;
          EncodeCoeffsRef(l.coeff_dtype, coef.data(), r,
                          codes + static_cast<int64_t>(t) * r * l.code_bytes, &scale);
          if (l.coeff_dtype == CoeffDtype::kInt8) std::memcpy(scales + t, &scale, sizeof(scale));
        }
      }
    }
  }
}

namespace testing {

float ThresholdInAGap(std::vector<double> ratios) {
  assert(ratios.size() >= 2);
  std::sort(ratios.begin(), ratios.end());
  const size_t n = ratios.size();
  const size_t lo = n / 4, hi = std::max(3 * n / 4, lo + 1);  // gaps [i, i + 1], lo <= i < hi
  size_t best = lo;
  for (size_t i = lo; i < hi && i + 1 < n; ++i) {
    if (ratios[i + 1] - ratios[i] > ratios[best + 1] - ratios[best]) best = i;
  }
  return static_cast<float>(std::sqrt(0.5 * (ratios[best] + ratios[best + 1])));
}

}  // namespace testing
}  // namespace subspace::kernels
