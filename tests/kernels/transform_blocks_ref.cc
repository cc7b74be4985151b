// CPU twins of transform_blocks.cu (transform_blocks_ref.h).
#include "tests/kernels/transform_blocks_ref.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/base/tensor_types.h"
#include "core/cpu/ops.h"
#include "cuda/rope_table.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

using F = TransformField;

// The two dims of rotary pair p and whether the pair is rotated (PairDims of the kernel).
void PairDims(int p, const TransformKeyRope& r, int* i0, int* i1, bool* rotated) {
  const int rp = r.cos_sin != nullptr ? r.rope_dim / 2 : 0;
  *rotated = p < rp;
  if (r.halves && p < rp) {
    *i0 = p;
    *i1 = p + rp;
  } else if (r.halves) {
    *i0 = 2 * rp + 2 * (p - rp);
    *i1 = *i0 + 1;
  } else {
    *i0 = 2 * p;
    *i1 = 2 * p + 1;
  }
}

float Half(const uint8_t* pool, int64_t offset) {
  uint16_t h;
  std::memcpy(&h, pool + offset, 2);
  return HalfToFloat(h);
}

absl::Status CheckCommon(const KvPoolLayout& l, const TransformKeyRope& rope, int32_t n_blocks,
                         const int32_t* first_pos) {
  if (const char* e = TransformLayoutError(l); e != nullptr) return absl::InvalidArgumentError(e);
  if (n_blocks < 0) return absl::InvalidArgumentError("negative block count");
  if (rope.cos_sin == nullptr) return absl::OkStatus();
  if (rope.rope_dim < 2 || rope.rope_dim % 2 != 0 || rope.rope_dim > l.head_dim) {
    return absl::InvalidArgumentError("rope_dim must be even and in [2, head_dim]");
  }
  for (int32_t i = 0; i < n_blocks; ++i) {
    if (first_pos[i] < 0 || int64_t{first_pos[i]} + l.block_size > rope.max_position) {
      return absl::InvalidArgumentError(absl::StrFormat("block %d: positions past the table", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTransformCodeBatch(const TransformCodeParams& p, int64_t num_src_pages,
                                     int64_t num_dst_pages) {
  const KvPoolLayout& l = p.layout;
  if (absl::Status st = CheckCommon(l, p.key_rope, p.n_blocks, p.first_pos); !st.ok()) return st;
  std::set<std::pair<int32_t, int32_t>> slots;
  std::set<int32_t> sources(p.src_page, p.src_page + p.n_blocks);
  for (int32_t i = 0; i < p.n_blocks; ++i) {
    if (p.src_page[i] < 0 || p.src_page[i] >= num_src_pages || p.dst_page[i] < 0 ||
        p.dst_page[i] >= num_dst_pages || p.dst_slot[i] < 0 ||
        int64_t{p.dst_slot[i] + 1} * l.slot_bytes > l.page_bytes) {
      return absl::InvalidArgumentError(absl::StrFormat("block %d: page or slot out of range", i));
    }
    if (!slots.insert({p.dst_page[i], p.dst_slot[i]}).second) {
      return absl::InvalidArgumentError(absl::StrFormat("block %d: slot coded twice", i));
    }
    if (p.src_pool == p.dst_pool && sources.count(p.dst_page[i]) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat("block %d: slot in a source page", i));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTransformExpandBatch(const TransformExpandParams& p, int64_t num_src_pages,
                                       int64_t num_dst_pages) {
  const KvPoolLayout& l = p.layout;
  if (absl::Status st = CheckCommon(l, p.key_rope, p.n_blocks, p.first_pos); !st.ok()) return st;
  std::set<int32_t> dsts;
  std::set<int32_t> sources(p.src_page, p.src_page + p.n_blocks);
  for (int32_t i = 0; i < p.n_blocks; ++i) {
    if (p.src_page[i] < 0 || p.src_page[i] >= num_src_pages || p.src_slot[i] < 0 ||
        int64_t{p.src_slot[i] + 1} * l.slot_bytes > l.page_bytes || p.dst_page[i] < 0 ||
        p.dst_page[i] >= num_dst_pages) {
      return absl::InvalidArgumentError(absl::StrFormat("block %d: page or slot out of range", i));
    }
    if (!dsts.insert(p.dst_page[i]).second) {
      return absl::InvalidArgumentError(absl::StrFormat("block %d: page written twice", i));
    }
    if (p.src_pool == p.dst_pool && sources.count(p.dst_page[i]) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat("block %d: writes a source page", i));
    }
  }
  return absl::OkStatus();
}

void TransformCodeRef(const TransformCodeParams& p) {
  const KvPoolLayout& l = p.layout;
  const int d = l.head_dim, bs = l.block_size;
  std::vector<float> rows(static_cast<size_t>(bs * d));
  for (int32_t blk = 0; blk < p.n_blocks; ++blk) {
    uint8_t* slot = p.dst_pool + l.Slot(p.dst_page[blk], p.dst_slot[blk]);
    for (int h = 0; h < l.n_kv_heads; ++h) {
      for (int side = 0; side < 2; ++side) {
        const int64_t rec = int64_t{side} * l.n_kv_heads + h;
        const float* f = p.tables.floats + rec * TransformFloats(d);
        const int32_t* n = p.tables.ints + rec * TransformInts(d);
        const int64_t base = side == 0 ? l.FullK(p.src_page[blk], h) : l.FullV(p.src_page[blk], h);
        for (int t = 0; t < bs; ++t) {
          for (int pair = 0; pair < d / 2; ++pair) {
            int i0, i1;
            bool rotated;
            PairDims(pair, p.key_rope, &i0, &i1, &rotated);
            double x0 = Half(p.src_pool, base + 2 * (int64_t{t} * d + i0));
            double x1 = Half(p.src_pool, base + 2 * (int64_t{t} * d + i1));
            if (side == 0 && rotated) {
              const float* cs =
                  p.key_rope.cos_sin +
                  ((int64_t{p.first_pos[blk]} + t) * (p.key_rope.rope_dim / 2) + pair) * 2;
              const double y0 = (cs[0] * x0 + cs[1] * x1) * p.key_rope.unscale;
              const double y1 = (cs[0] * x1 - cs[1] * x0) * p.key_rope.unscale;
              x0 = y0;
              x1 = y1;
            }
            rows[static_cast<size_t>(t * d + i0)] =
                static_cast<float>((x0 - f[F::kMean * d + i0]) * f[F::kScale * d + i0]);
            rows[static_cast<size_t>(t * d + i1)] =
                static_cast<float>((x1 - f[F::kMean * d + i1]) * f[F::kScale * d + i1]);
          }
        }
        uint8_t* run = slot + n[F::kRunOffset];
        const int active = n[F::kActive];
        for (int a = 0; a < active; ++a) {
          const int bits = n[F::kBits + a];
          uint8_t* out = run + n[F::kBits + d + a];
          std::fill(out, out + (bs * bits + 7) / 8, uint8_t{0});
          const ComponentQuantizer q{
              .bits = bits, .offset = f[F::kOffset * d + a], .step = f[F::kStep * d + a]};
          const float* u = f + F::kBasis * d + int64_t{a} * d;
          for (int t = 0; t < bs; ++t) {
            double c = 0.0;
            for (int i = 0; i < d; ++i) c += double{u[i]} * rows[static_cast<size_t>(t * d + i)];
            const uint32_t code = q.Encode(static_cast<float>(c));
            for (int k = 0; k < bits; ++k) {
              const int bit = t * bits + k;
              if ((code >> k) & 1u) out[bit >> 3] |= static_cast<uint8_t>(1u << (bit & 7));
            }
          }
        }
      }
    }
  }
}

void TransformDecodeRowRef(const KvPoolLayout& l, const TransformTables& tables,
                           const TransformKeyRope& key_rope, const uint8_t* slot, int h, int side,
                           int t, int64_t position, double* row) {
  const int d = l.head_dim;
  const int64_t rec = int64_t{side} * l.n_kv_heads + h;
  const float* f = tables.floats + rec * TransformFloats(d);
  const int32_t* n = tables.ints + rec * TransformInts(d);
  const uint8_t* run = slot + n[F::kRunOffset];
  std::vector<double> x(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) x[static_cast<size_t>(i)] = f[F::kExt * d + i];
  for (int a = 0; a < n[F::kActive]; ++a) {
    const int bits = n[F::kBits + a];
    const uint8_t* codes = run + n[F::kBits + d + a];
    uint32_t code = 0;
    for (int k = 0; k < bits; ++k) {
      const int bit = t * bits + k;
      code |= static_cast<uint32_t>((codes[bit >> 3] >> (bit & 7)) & 1u) << k;
    }
    const float c = f[F::kOffset * d + a] + static_cast<float>(code) * f[F::kStep * d + a];
    const float* u = f + F::kBasis * d + int64_t{a} * d;
    for (int i = 0; i < d; ++i) x[static_cast<size_t>(i)] += double{c} * u[i];
  }
  for (int i = 0; i < d; ++i) x[static_cast<size_t>(i)] *= f[F::kInvScale * d + i];
  for (int pair = 0; pair < d / 2; ++pair) {
    int i0, i1;
    bool rotated;
    PairDims(pair, key_rope, &i0, &i1, &rotated);
    double x0 = x[static_cast<size_t>(i0)], x1 = x[static_cast<size_t>(i1)];
    if (side == 0 && rotated) {
      const float* cs = key_rope.cos_sin + (position * (key_rope.rope_dim / 2) + pair) * 2;
      const double y0 = cs[0] * x0 - cs[1] * x1, y1 = cs[1] * x0 + cs[0] * x1;
      x0 = y0;
      x1 = y1;
    }
    row[i0] = x0;
    row[i1] = x1;
  }
}

void TransformExpandRef(const TransformExpandParams& p) {
  const KvPoolLayout& l = p.layout;
  const int d = l.head_dim;
  std::vector<double> row(static_cast<size_t>(d));
  for (int32_t blk = 0; blk < p.n_blocks; ++blk) {
    const uint8_t* slot = p.src_pool + l.Slot(p.src_page[blk], p.src_slot[blk]);
    for (int h = 0; h < l.n_kv_heads; ++h) {
      for (int side = 0; side < 2; ++side) {
        const int64_t base = side == 0 ? l.FullK(p.dst_page[blk], h) : l.FullV(p.dst_page[blk], h);
        for (int t = 0; t < l.block_size; ++t) {
          TransformDecodeRowRef(l, p.tables, p.key_rope, slot, h, side, t,
                                int64_t{p.first_pos[blk]} + t, row.data());
          auto* out = reinterpret_cast<uint16_t*>(p.dst_pool + base) + int64_t{t} * d;
          for (int i = 0; i < d; ++i)
            out[i] = Fp32ToFp16(static_cast<float>(row[static_cast<size_t>(i)]));
        }
      }
    }
  }
}

namespace testing {

TransformKeyRope TransformCase::HostRope() const {
  if (!rope.has_value()) return {};
  return {.cos_sin = cos_sin.data(),
          .rope_dim = rope->dim,
          .max_position = max_position,
          .halves = rope->layout == RopeLayout::kHalves,
          .unscale = static_cast<float>(1.0 / (rope->mscale * rope->mscale))};
}

TransformCodeParams TransformCase::CodeParams() {
  return {.layout = layout,
          .tables = HostTables(),
          .key_rope = HostRope(),
          .src_pool = pool.data(),
          .dst_pool = pool.data(),
          .src_page = full_page.data(),
          .dst_page = slab_page.data(),
          .dst_slot = slot.data(),
          .first_pos = first_pos.data(),
          .n_blocks = n_blocks()};
}

TransformExpandParams TransformCase::ExpandParams(std::vector<uint8_t>* dst_pool,
                                                  const std::vector<int32_t>& dst_page) {
  return {.layout = layout,
          .tables = HostTables(),
          .key_rope = HostRope(),
          .src_pool = pool.data(),
          .dst_pool = dst_pool->data(),
          .src_page = slab_page.data(),
          .src_slot = slot.data(),
          .dst_page = dst_page.data(),
          .first_pos = first_pos.data(),
          .n_blocks = n_blocks()};
}

TransformCase RandomTransformCase(const TransformCaseOptions& o, std::mt19937_64& rng) {
  TransformCase c;
  const int d = o.head_dim, bs = o.block_size, n_kv = o.n_kv;
  c.layout = MakeKvPoolLayout(n_kv, d, bs, 1, 1, CoeffDtype::kFp16);
  if (o.pre_rope) {
    absl::StatusOr<RopeSchedule> rope =
        RopeSchedule::Make({.dim = o.rope_dim > 0 ? o.rope_dim : d,
                            .theta = 10000.0,
                            .layout = o.halves ? RopeLayout::kHalves : RopeLayout::kAdjacentPairs,
                            .attn_factor = o.mscale});
    c.rope = *rope;
  }
  // Rows: a few strong directions (decaying scales) plus noise, a mean per dim; per stream.
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int kFitRows = 512;
  struct Source {
    std::vector<float> mean, dirs;  // [d], [d/4, d]
  };
  const auto make_source = [&] {
    Source s;
    for (int i = 0; i < d; ++i) s.mean.push_back(0.3f * normal(rng));
    for (int k = 0; k < d / 4 * d; ++k) s.dirs.push_back(normal(rng) / std::sqrt(float(d)));
    return s;
  };
  const auto draw = [&](const Source& s, float* row) {
    for (int i = 0; i < d; ++i) row[i] = s.mean[static_cast<size_t>(i)] + 0.05f * normal(rng);
    for (int k = 0; k < d / 4; ++k) {
      const float z = normal(rng) * 2.0f / (1.0f + 0.3f * k);
      for (int i = 0; i < d; ++i) row[i] += z * s.dirs[static_cast<size_t>(k * d + i)];
    }
  };
  std::vector<Source> sources;  // [2][n_kv]
  std::vector<TransformStream> streams;
  for (int side = 0; side < 2; ++side) {
    for (int h = 0; h < n_kv; ++h) {
      sources.push_back(make_source());
      std::vector<float> rows(static_cast<size_t>(kFitRows * d));
      for (int r = 0; r < kFitRows; ++r) draw(sources.back(), rows.data() + int64_t{r} * d);
      absl::StatusOr<TransformStream> st = AnalyzeStream(rows.data(), kFitRows, d, {});
      streams.push_back(*std::move(st));
    }
  }
  absl::StatusOr<std::vector<TransformCode>> codes =
      AllocateTransformCodes(streams, std::vector<int>{0, 2, 3, 4, 8}, o.bits, false);
  c.key_codes.assign(codes->begin(), codes->begin() + n_kv);
  c.value_codes.assign(codes->begin() + n_kv, codes->end());
  c.tables = cuda::BuildTransformTables(c.key_codes, c.value_codes, 0, n_kv, d, bs);
  c.layout.slot_bytes = (c.tables.coded_bytes + 15) / 16 * 16;

  // Pages: the full ones first, then slab pages, slots shuffled over them; all poisoned.
  const int nb = o.n_blocks;
  const int64_t per_page = std::min<int64_t>(c.layout.page_bytes / c.layout.slot_bytes, 64);
  const int64_t slab_pages = (nb + per_page - 1) / per_page + 1;
  c.num_pages = nb + slab_pages;
  c.pool.assign(static_cast<size_t>(c.num_pages * c.layout.page_bytes), kPoison);
  std::vector<int64_t> slots(static_cast<size_t>(slab_pages * per_page));
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int64_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  c.max_position = (nb + 3) * bs;
  if (c.rope.has_value()) c.cos_sin = cuda::RopeCosSinTable(c.max_position, *c.rope);
  std::uniform_int_distribution<int> block_at(0, 2);
  std::vector<float> row(static_cast<size_t>(d));
  for (int b = 0; b < nb; ++b) {
    c.full_page.push_back(b);
    c.slab_page.push_back(static_cast<int32_t>(nb + slots[static_cast<size_t>(b)] / per_page));
    c.slot.push_back(static_cast<int32_t>(slots[static_cast<size_t>(b)] % per_page));
    c.first_pos.push_back((b + block_at(rng)) * bs);
    for (int side = 0; side < 2; ++side) {
      for (int h = 0; h < n_kv; ++h) {
        const Source& s = sources[static_cast<size_t>(side * n_kv + h)];
        for (int t = 0; t < bs; ++t) {
          draw(s, row.data());
          if (side == 0 && c.rope.has_value()) {  // the page holds keys after RoPE
            const int64_t pos = c.first_pos.back() + t;
            cpu::Rope(row.data(), 1, 1, d, *c.rope, &pos);
          }
          const int64_t at =
              (side == 0 ? c.layout.FullK(b, h) : c.layout.FullV(b, h)) + int64_t{t} * d * 2;
          auto* out = reinterpret_cast<uint16_t*>(c.pool.data() + at);
          for (int i = 0; i < d; ++i) out[i] = Fp32ToFp16(row[static_cast<size_t>(i)]);
        }
      }
    }
  }
  return c;
}

}  // namespace testing
}  // namespace subspace::kernels
