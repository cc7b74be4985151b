// Random KV pools, basis tables and block tables for the kernel tests: the CPU twins' unit tests
// and the GPU tests beside them draw the same kinds of cases. Every case is fresh (seed from
// random_device, printed; SUBSPACE_TEST_SEED pins it), and pool bytes nothing writes stay
// poisoned (0xff: an fp16 NaN), so a kernel reading the wrong bytes shows up as NaN.
#ifndef SUBSPACE_TESTS_KERNELS_KV_TEST_DATA_H_
#define SUBSPACE_TESTS_KERNELS_KV_TEST_DATA_H_

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/base/coeff_codec.h"
#include "core/base/tensor_types.h"
#include "cuda/decode_plan_builder.h"
#include "kernels/kv_layout.h"

namespace subspace::kernels::testing {

inline uint64_t FreshSeed() {
  if (const char* pinned = std::getenv("SUBSPACE_TEST_SEED")) {
    return std::strtoull(pinned, nullptr, 10);
  }
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

inline constexpr uint8_t kPoison = 0xff;

// Basis tables as the kernels read them, one slice per epoch: [n_epochs, n_kv, d, r] for
// P_q, P_k, P_v and [n_epochs, n_kv, r_v, d] for R_v. Oblique on purpose (P_q != P_k,
// R_v != P_v^T): the kernels must use each matrix where it belongs.
struct BasisTable {
  int n_epochs = 0;
  std::vector<float> p_q, p_k, p_v, r_v;
};

inline BasisTable RandomBases(const KvPoolLayout& l, int n_epochs, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(l.head_dim)));
  const auto fill = [&](std::vector<float>& m, int64_t n) {
    m.resize(static_cast<size_t>(n));
    for (float& x : m) x = normal(rng);
  };
  BasisTable b;
  b.n_epochs = n_epochs;
  const int64_t per_k = static_cast<int64_t>(n_epochs) * l.n_kv_heads * l.head_dim * l.rank_k;
  const int64_t per_v = static_cast<int64_t>(n_epochs) * l.n_kv_heads * l.head_dim * l.rank_v;
  fill(b.p_q, per_k);
  fill(b.p_k, per_k);
  fill(b.p_v, per_v);
  fill(b.r_v, per_v);
  return b;
}

inline uint16_t RandomHalf(std::normal_distribution<float>& normal, std::mt19937_64& rng) {
  return Fp32ToFp16(normal(rng));
}

// Writes a random fp16 full block (all heads, K and V) into `page`; returns nothing, the
// caller reads the rows back from the pool.
inline void FillFullPage(const KvPoolLayout& l, std::vector<uint8_t>& pool, int32_t page,
                         std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto* h = reinterpret_cast<uint16_t*>(pool.data() + l.Page(page));
  for (int64_t i = 0; i < l.page_bytes / 2; ++i) h[i] = RandomHalf(normal, rng);
}

inline double PoolHalf(const std::vector<uint8_t>& pool, int64_t offset) {
  uint16_t h;
  std::memcpy(&h, pool.data() + offset, sizeof(h));
  return HalfToFloat(h);
}

// ---- Decode attention cases ----------------------------------------------------------------

struct DecodeCase {
  KvPoolLayout layout;
  int n_heads = 0;
  int64_t num_pages = 0;
  std::vector<uint8_t> pool;  // [num_pages * page_bytes]
  BasisTable bases;
  std::vector<cuda::DecodeSeqDesc> seqs;
  std::vector<float> q;  // [num_seqs, n_heads, d]
  // What each token presents to a query, per sequence: [n_kv, tokens, d] in double. Full rows
  // as stored; compressed ones reconstructed from the stored codes (k^ = P_q[e] c,
  // v^ = R_v[e]^T u); masked tokens only once, from their outlier page.
  std::vector<std::vector<double>> dense_k, dense_v;
  std::vector<int64_t> dense_tokens;            // [num_seqs]
  std::vector<std::vector<int64_t>> dense_pos;  // [num_seqs][dense_tokens] each row's position
};

struct DecodeCaseOptions {
  int n_kv_heads = 2;
  int group = 4;              // query heads per KV head
  int n_epochs = 4;           // basis-table epochs
  int min_seq_epochs = 1;     // each sequence draws between min_seq_epochs and
  int max_seq_epochs = 3;     //   min(max_seq_epochs, n_epochs) of them
  int max_blocks = 24;        // per sequence
  double p_compressed = 0.8;  // middle blocks: compressed with this probability
  double p_outlier = 0.06;    // tokens of compressed blocks kept full-rank
};

// Codes, scale and the decoded coefficients of r random values with the given spread.
inline void RandomCodes(const KvPoolLayout& l, int r, float sigma, std::mt19937_64& rng,
                        uint8_t* codes, uint8_t* scale, std::vector<double>* decoded) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> x(static_cast<size_t>(r)), y(static_cast<size_t>(r));
  for (float& v : x) v = normal(rng);
  uint16_t s = 0;
  EncodeCoeffs(l.coeff_dtype, x.data(), r, codes, &s);
  if (l.coeff_dtype == CoeffDtype::kInt8) std::memcpy(scale, &s, sizeof(s));
  DecodeCoeffs(l.coeff_dtype, codes, &s, r, y.data());
  decoded->assign(y.begin(), y.end());
}

inline DecodeCase RandomDecodeCase(const KvPoolLayout& l, int batch, const DecodeCaseOptions& o,
                                   std::mt19937_64& rng) {
  DecodeCase c;
  c.layout = l;
  c.n_heads = l.n_kv_heads * o.group;
  c.bases = RandomBases(l, o.n_epochs, rng);
  const int bs = l.block_size, hd = l.head_dim, n_kv = l.n_kv_heads;
  std::uniform_real_distribution<double> uni(0.0, 1.0);

  // Shapes first: lengths, which blocks are compressed, masks; then pages and data.
  struct SeqShape {
    int64_t length;
    std::vector<bool> compressed;
    std::vector<uint64_t> masks;
    int64_t n_outliers = 0;
    std::vector<int32_t> epochs;  // local choice of global epochs
  };
  std::vector<SeqShape> shapes(static_cast<size_t>(batch));
  int64_t full_pages = 0, slots = 0;
  for (SeqShape& sh : shapes) {
    const int nb = std::uniform_int_distribution<int>(1, o.max_blocks)(rng);
    sh.length = static_cast<int64_t>(nb - 1) * bs + std::uniform_int_distribution<int>(1, bs)(rng);
    sh.compressed.assign(static_cast<size_t>(nb), false);
    sh.masks.assign(static_cast<size_t>(nb), 0);
    // Block 0 is a sink and the last two are the window; complete middle blocks compress.
    for (int b = 1; b + 2 < nb; ++b)
      sh.compressed[static_cast<size_t>(b)] = uni(rng) < o.p_compressed;
    for (int b = 0; b < nb; ++b) {
      if (!sh.compressed[static_cast<size_t>(b)]) {
        ++full_pages;
        continue;
      }
      ++slots;
      for (int t = 0; t < bs; ++t) {
        if (uni(rng) < o.p_outlier) sh.masks[static_cast<size_t>(b)] |= uint64_t{1} << t;
      }
      sh.n_outliers += std::popcount(sh.masks[static_cast<size_t>(b)]);
    }
    full_pages += (sh.n_outliers + bs - 1) / bs;
    std::vector<int32_t> all(static_cast<size_t>(o.n_epochs));
    for (int e = 0; e < o.n_epochs; ++e) all[static_cast<size_t>(e)] = e;
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(static_cast<size_t>(std::uniform_int_distribution<int>(
        o.min_seq_epochs, std::min(o.max_seq_epochs, o.n_epochs))(rng)));
    sh.epochs = all;
  }
  const int per_page = l.SlotsPerPage();
  const int64_t slab_pages = (slots + per_page - 1) / per_page;
  c.num_pages = full_pages + slab_pages + 3;  // a few pages nobody uses: poisoned
  c.pool.assign(static_cast<size_t>(c.num_pages * l.page_bytes), kPoison);
  std::vector<int32_t> page_ids(static_cast<size_t>(c.num_pages));
  for (int64_t i = 0; i < c.num_pages; ++i)
    page_ids[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::shuffle(page_ids.begin(), page_ids.end(), rng);
  size_t next_page = 0;
  std::vector<std::pair<int32_t, int32_t>> free_slots;  // scattered over the slab pages
  for (int64_t i = 0; i < slab_pages; ++i) {
    const int32_t p = page_ids[next_page++];
    for (int s = 0; s < per_page; ++s) free_slots.emplace_back(p, s);
  }
  std::shuffle(free_slots.begin(), free_slots.end(), rng);

  const float sigma_k = std::sqrt(static_cast<float>(hd) / l.rank_k);  // |k^| ~ |k|
  const float sigma_v = std::sqrt(static_cast<float>(hd) / l.rank_v);
  for (const SeqShape& sh : shapes) {
    cuda::DecodeSeqDesc d;
    d.length = sh.length;
    const int nb = static_cast<int>(sh.compressed.size());
    std::vector<std::vector<double>> k_rows(static_cast<size_t>(n_kv)), v_rows(k_rows.size());
    int64_t tokens = 0;
    size_t next_epoch = 0;
    // Masked tokens' own rows, in position order: they go to the outlier pages.
    std::vector<std::vector<uint16_t>> out_k, out_v;  // [outlier][n_kv * d]
    std::vector<int64_t> pos, out_pos;  // positions of the dense rows and of the outliers
    for (int b = 0; b < nb; ++b) {
      const int nt =
          static_cast<int>(std::min<int64_t>(bs, sh.length - static_cast<int64_t>(b) * bs));
      if (!sh.compressed[static_cast<size_t>(b)]) {
        const int32_t page = page_ids[next_page++];
        FillFullPage(l, c.pool, page, rng);
        for (int h = 0; h < n_kv; ++h) {  // rows past the sequence's end: never read
          std::memset(c.pool.data() + l.FullK(page, h) + 2 * nt * hd, kPoison, 2 * (bs - nt) * hd);
          std::memset(c.pool.data() + l.FullV(page, h) + 2 * nt * hd, kPoison, 2 * (bs - nt) * hd);
        }
        d.pages.push_back(page);
        d.slots.push_back(kFullBlock);
        d.epochs.insert(d.epochs.end(), static_cast<size_t>(n_kv), -1);
        d.outlier_masks.push_back(0);
        for (int h = 0; h < n_kv; ++h) {
          for (int t = 0; t < nt; ++t) {
            for (int i = 0; i < hd; ++i) {
              k_rows[h].push_back(PoolHalf(c.pool, l.FullK(page, h) + 2 * (t * hd + i)));
              v_rows[h].push_back(PoolHalf(c.pool, l.FullV(page, h) + 2 * (t * hd + i)));
            }
          }
        }
        for (int t = 0; t < nt; ++t) pos.push_back(static_cast<int64_t>(b) * bs + t);
        tokens += nt;
        continue;
      }
      const auto [page, slot] = free_slots.back();
      free_slots.pop_back();
      const uint64_t mask = sh.masks[static_cast<size_t>(b)];
      d.pages.push_back(page);
      d.slots.push_back(slot);
      d.outlier_masks.push_back(mask);
      const int64_t base = l.Slot(page, slot);
      for (int h = 0; h < n_kv; ++h) {
        // Round robin over the sequence's epochs: two compressed block-heads use two epochs.
        const int32_t e = sh.epochs[next_epoch++ % sh.epochs.size()];
        d.epochs.push_back(e);
        const float* pq = c.bases.p_q.data() + (static_cast<int64_t>(e) * n_kv + h) * hd * l.rank_k;
        const float* rvm =
            c.bases.r_v.data() + (static_cast<int64_t>(e) * n_kv + h) * l.rank_v * hd;
        const bool int8 = l.coeff_dtype == CoeffDtype::kInt8;
        uint8_t* slot_bytes = c.pool.data() + base;
        for (int t = 0; t < bs; ++t) {
          std::vector<double> ck, cv;
          RandomCodes(l, l.rank_k, sigma_k, rng,
                      slot_bytes + l.KCodes(h) + static_cast<int64_t>(t) * l.rank_k * l.code_bytes,
                      int8 ? slot_bytes + l.KScales(h) + 2 * t : nullptr, &ck);
          RandomCodes(l, l.rank_v, sigma_v, rng,
                      slot_bytes + l.VCodes(h) + static_cast<int64_t>(t) * l.rank_v * l.code_bytes,
                      int8 ? slot_bytes + l.VScales(h) + 2 * t : nullptr, &cv);
          if ((mask >> t) & 1u) continue;
          for (int i = 0; i < hd; ++i) {
            double k = 0.0, v = 0.0;
            for (int j = 0; j < l.rank_k; ++j)
              k += static_cast<double>(pq[i * l.rank_k + j]) * ck[j];
            for (int j = 0; j < l.rank_v; ++j) v += static_cast<double>(rvm[j * hd + i]) * cv[j];
            k_rows[h].push_back(k);
            v_rows[h].push_back(v);
          }
        }
      }
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (int t = 0; t < bs; ++t) {
        if (!((mask >> t) & 1u)) {
          pos.push_back(static_cast<int64_t>(b) * bs + t);
          ++tokens;
          continue;
        }
        out_pos.push_back(static_cast<int64_t>(b) * bs + t);
        std::vector<uint16_t> kr(static_cast<size_t>(n_kv) * hd), vr(kr.size());
        for (uint16_t& x : kr) x = RandomHalf(normal, rng);
        for (uint16_t& x : vr) x = RandomHalf(normal, rng);
        out_k.push_back(std::move(kr));
        out_v.push_back(std::move(vr));
      }
    }
    // Outlier pages: B tokens each, in position order, the rest of the last page poisoned.
    d.n_outliers = static_cast<int64_t>(out_k.size());
    for (int64_t j0 = 0; j0 < d.n_outliers; j0 += bs) {
      const int32_t page = page_ids[next_page++];
      d.outlier_pages.push_back(page);
      for (int64_t j = j0; j < std::min<int64_t>(j0 + bs, d.n_outliers); ++j) {
        const int t = static_cast<int>(j - j0);
        for (int h = 0; h < n_kv; ++h) {
          std::memcpy(c.pool.data() + l.FullK(page, h) + 2 * t * hd, out_k[j].data() + h * hd,
                      2 * hd);
          std::memcpy(c.pool.data() + l.FullV(page, h) + 2 * t * hd, out_v[j].data() + h * hd,
                      2 * hd);
          for (int i = 0; i < hd; ++i) {
            k_rows[h].push_back(HalfToFloat(out_k[j][h * hd + i]));
            v_rows[h].push_back(HalfToFloat(out_v[j][h * hd + i]));
          }
        }
        ++tokens;
      }
    }
    std::vector<double> dk, dv;
    for (int h = 0; h < n_kv; ++h) {
      dk.insert(dk.end(), k_rows[h].begin(), k_rows[h].end());
      dv.insert(dv.end(), v_rows[h].begin(), v_rows[h].end());
    }
    c.dense_k.push_back(std::move(dk));
    c.dense_v.push_back(std::move(dv));
    c.dense_tokens.push_back(tokens);
    pos.insert(pos.end(), out_pos.begin(), out_pos.end());
    c.dense_pos.push_back(std::move(pos));
    c.seqs.push_back(std::move(d));
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  c.q.resize(static_cast<size_t>(batch) * c.n_heads * hd);
  for (float& x : c.q) x = normal(rng);
  return c;
}

// Softmax attention over the dense rows in double: [num_seqs, n_heads, d]. Rows before a
// sequence's DecodeSeqDesc::window_start are left out.
inline std::vector<double> DenseAttention(const DecodeCase& c) {
  const int hd = c.layout.head_dim, n_kv = c.layout.n_kv_heads, group = c.n_heads / n_kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> out;
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    const int64_t n = c.dense_tokens[s];
    for (int hq = 0; hq < c.n_heads; ++hq) {
      const int h = hq / group;
      const float* q = c.q.data() + (s * c.n_heads + hq) * hd;
      const double* k = c.dense_k[s].data() + h * n * hd;
      const double* v = c.dense_v[s].data() + h * n * hd;
      std::vector<double> logit(static_cast<size_t>(n));
      for (int64_t t = 0; t < n; ++t) {
        if (c.dense_pos[s][static_cast<size_t>(t)] < c.seqs[s].window_start) {
          logit[t] = -std::numeric_limits<double>::infinity();
          continue;
        }
        double dot = 0.0;
        for (int i = 0; i < hd; ++i) dot += q[i] * k[t * hd + i];
        logit[t] = dot * scale;
      }
      const double max = *std::max_element(logit.begin(), logit.end());
      std::vector<double> o(static_cast<size_t>(hd), 0.0);
      double sum = 0.0;
      for (int64_t t = 0; t < n; ++t) {
        const double w = std::exp(logit[t] - max);  // 0 before the window
        if (w == 0.0) continue;
        sum += w;
        for (int i = 0; i < hd; ++i) o[i] += w * v[t * hd + i];
      }
      for (double x : o) out.push_back(x / sum);
    }
  }
  return out;
}

// ||a - b|| / ||b|| over one row of n.
template <typename A, typename B>
double RelError(const A* a, const B* b, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (std::isnan(num)) return std::numeric_limits<double>::infinity();
  return std::sqrt(num / std::max(den, 1e-300));
}

// ---- Comparing compressed slots -------------------------------------------------------------

// Two codings of the same block that differ only by how their projections rounded (float vs
// double, another summation order): per token row, the decoded coefficients may differ by one
// fp16 unit (2e-3 of the row's largest, generous: small coefficients lose relative precision
// to cancellation) or 1.5 int8 steps, and int8 scales by one fp16 unit. Returns "" or the
// first violation; counts every code and every code whose bytes differ.
inline std::string SlotMismatch(const KvPoolLayout& l, const uint8_t* want, const uint8_t* got,
                                int64_t* codes, int64_t* differ) {
  const bool int8 = l.coeff_dtype == CoeffDtype::kInt8;
  std::vector<float> w, g;
  for (int h = 0; h < l.n_kv_heads; ++h) {
    for (int side = 0; side < 2; ++side) {
      const int r = side == 0 ? l.rank_k : l.rank_v;
      w.resize(static_cast<size_t>(r));
      g.resize(static_cast<size_t>(r));
      for (int t = 0; t < l.block_size; ++t) {
        const int64_t code_at =
            (side == 0 ? l.KCodes(h) : l.VCodes(h)) + static_cast<int64_t>(t) * r * l.code_bytes;
        const int64_t scale_at = (side == 0 ? l.KScales(h) : l.VScales(h)) + 2 * t;
        uint16_t ws = 0, gs = 0;
        if (int8) {
          std::memcpy(&ws, want + scale_at, 2);
          std::memcpy(&gs, got + scale_at, 2);
          if (std::abs(static_cast<int>(ws) - static_cast<int>(gs)) > 1) {
            return "int8 scales differ by more than one fp16 unit at head " + std::to_string(h) +
                   " side " + std::to_string(side) + " token " + std::to_string(t);
          }
        }
        DecodeCoeffs(l.coeff_dtype, want + code_at, &ws, r, w.data());
        DecodeCoeffs(l.coeff_dtype, got + code_at, &gs, r, g.data());
        double amax = 0.0;
        for (float x : w) amax = std::max(amax, std::fabs(static_cast<double>(x)));
        const double step = int8 ? 1.5 * HalfToFloat(ws) : 2e-3 * amax;
        for (int j = 0; j < r; ++j) {
          if (!std::isfinite(g[j]) || std::fabs(static_cast<double>(g[j]) - w[j]) > step) {
            return "coefficient " + std::to_string(j) + " of head " + std::to_string(h) + " side " +
                   std::to_string(side) + " token " + std::to_string(t) + ": " +
                   std::to_string(g[j]) + " vs " + std::to_string(w[j]);
          }
          ++*codes;
          *differ +=
              std::memcmp(want + code_at + j * l.code_bytes, got + code_at + j * l.code_bytes,
                          static_cast<size_t>(l.code_bytes)) != 0;
        }
      }
    }
  }
  return "";
}

// ---- Compression cases ---------------------------------------------------------------------

struct CompressCase {
  KvPoolLayout layout;
  int64_t num_pages = 0;
  std::vector<uint8_t> pool;  // [num_pages * page_bytes]: sources random, the rest poisoned
  BasisTable bases;
  std::vector<int32_t> src_page, dst_page, dst_slot;  // [n_blocks]
  std::vector<int32_t> epoch;                         // [n_blocks, n_kv]
};

inline CompressCase RandomCompressCase(const KvPoolLayout& l, int n_blocks, int n_epochs,
                                       std::mt19937_64& rng) {
  CompressCase c;
  c.layout = l;
  c.bases = RandomBases(l, n_epochs, rng);
  const int per_page = l.SlotsPerPage();
  const int64_t dst_pages = (n_blocks + per_page - 1) / per_page + 1;  // one spare: scattered
  c.num_pages = n_blocks + dst_pages;
  c.pool.assign(static_cast<size_t>(c.num_pages * l.page_bytes), kPoison);
  std::vector<int32_t> ids(static_cast<size_t>(c.num_pages));
  for (int64_t i = 0; i < c.num_pages; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::pair<int32_t, int32_t>> slots;
  for (int64_t i = 0; i < dst_pages; ++i) {
    for (int s = 0; s < per_page; ++s)
      slots.emplace_back(ids[static_cast<size_t>(n_blocks + i)], s);
  }
  std::shuffle(slots.begin(), slots.end(), rng);
  std::uniform_int_distribution<int32_t> pick(0, n_epochs - 1);
  for (int i = 0; i < n_blocks; ++i) {
    c.src_page.push_back(ids[static_cast<size_t>(i)]);
    FillFullPage(l, c.pool, ids[static_cast<size_t>(i)], rng);
    c.dst_page.push_back(slots[static_cast<size_t>(i)].first);
    c.dst_slot.push_back(slots[static_cast<size_t>(i)].second);
    for (int h = 0; h < l.n_kv_heads; ++h) c.epoch.push_back(pick(rng));
  }
  return c;
}

// ---- Prefill attention cases ---------------------------------------------------------------

// One sequence of a prefill step: `start` tokens cached by earlier steps, then `n_q` query rows
// whose own keys and values are in the pool too (append_kv runs before attention).
struct PrefillSeqShape {
  int32_t start = 0;
  int32_t n_q = 0;
};

struct PrefillCase {
  KvPoolLayout layout;
  int n_heads = 0;
  int64_t num_pages = 0;
  std::vector<uint8_t> pool;  // [num_pages * page_bytes]; rows past a sequence's end poisoned
  int32_t max_blocks = 0;
  std::vector<int32_t> block_table;  // [num_seqs, max_blocks]; past a sequence's blocks: a
                                     //   page nobody writes (all poison)
  std::vector<int32_t> q_indptr;     // [num_seqs + 1]
  std::vector<int32_t> q_start;      // [num_seqs]
  int32_t max_q_per_seq = 0;
  std::vector<float> q;  // [n_q, n_heads, d]
  // Each sequence's keys and values as drawn, before they went to the pool (fp16 bits):
  // [n_kv, start + n_q, d]. The dense reference reads these, not the pool.
  std::vector<std::vector<uint16_t>> k, v;

  int32_t num_seqs() const { return static_cast<int32_t>(q_start.size()); }
  int32_t total_q() const { return q_indptr.back(); }
};

// Moves a random subset of each sequence's pages (at least one in all) to a scratch buffer, as
// the CUDA backend does with expanded compressed blocks: bytes copied to shuffled scratch pages
// (plus one nobody names, all poison), the pool page poisoned, the table entry replaced by
// -1 - j for scratch page j. Returns the scratch buffer, [num_scratch_pages * page_bytes].
inline std::vector<uint8_t> MovePagesToScratch(PrefillCase* c, std::mt19937_64& rng) {
  const KvPoolLayout& l = c->layout;
  std::vector<int32_t*> moved;  // table entries
  std::bernoulli_distribution coin(0.5);
  for (int32_t s = 0; s < c->num_seqs(); ++s) {
    const int32_t tokens = c->q_start[s] + (c->q_indptr[s + 1] - c->q_indptr[s]);
    const int32_t nb = (tokens + l.block_size - 1) / l.block_size;
    int32_t* row = c->block_table.data() + static_cast<int64_t>(s) * c->max_blocks;
    for (int32_t b = 0; b < nb; ++b) {
      if (coin(rng)) moved.push_back(row + b);
    }
  }
  if (moved.empty()) moved.push_back(c->block_table.data());  // the first sequence has a block
  std::vector<int32_t> slots(moved.size() + 1);
  for (size_t j = 0; j < slots.size(); ++j) slots[j] = static_cast<int32_t>(j);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<uint8_t> scratch(slots.size() * static_cast<size_t>(l.page_bytes), testing::kPoison);
  for (size_t i = 0; i < moved.size(); ++i) {
    int32_t& e = *moved[i];
    uint8_t* page = c->pool.data() + l.Page(e);
    std::memcpy(scratch.data() + l.Page(slots[i]), page, static_cast<size_t>(l.page_bytes));
    std::memset(page, testing::kPoison, static_cast<size_t>(l.page_bytes));
    e = -1 - slots[i];
  }
  return scratch;
}

// Keys and values N(0, 1), queries N(0, q_sigma^2) (larger: peakier softmax). Each sequence's
// blocks sit on shuffled pages.
inline PrefillCase RandomPrefillCase(const KvPoolLayout& l, int n_heads,
                                     const std::vector<PrefillSeqShape>& shapes, float q_sigma,
                                     std::mt19937_64& rng) {
  PrefillCase c;
  c.layout = l;
  c.n_heads = n_heads;
  const int bs = l.block_size, hd = l.head_dim, n_kv = l.n_kv_heads;
  int64_t blocks = 0;
  int32_t most_blocks = 0;
  for (const PrefillSeqShape& sh : shapes) {
    const int32_t nb = (sh.start + sh.n_q + bs - 1) / bs;
    blocks += nb;
    most_blocks = std::max(most_blocks, nb);
  }
  c.num_pages = blocks + 2;        // two pages nobody writes
  c.max_blocks = most_blocks + 1;  // a row stride wider than any sequence needs
  c.pool.assign(static_cast<size_t>(c.num_pages * l.page_bytes), kPoison);
  std::vector<int32_t> page_ids(static_cast<size_t>(c.num_pages));
  for (int64_t i = 0; i < c.num_pages; ++i)
    page_ids[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::shuffle(page_ids.begin(), page_ids.end(), rng);
  const int32_t unused_page = page_ids.back();
  size_t next_page = 0;

  std::normal_distribution<float> normal(0.0f, 1.0f);
  c.q_indptr.push_back(0);
  for (const PrefillSeqShape& sh : shapes) {
    const int32_t tokens = sh.start + sh.n_q;
    const int32_t nb = (tokens + bs - 1) / bs;
    std::vector<int32_t> row(static_cast<size_t>(c.max_blocks), unused_page);
    for (int32_t b = 0; b < nb; ++b) row[static_cast<size_t>(b)] = page_ids[next_page++];
    c.block_table.insert(c.block_table.end(), row.begin(), row.end());
    std::vector<uint16_t> k(static_cast<size_t>(n_kv) * tokens * hd), v(k.size());
    for (int h = 0; h < n_kv; ++h) {
      for (int32_t t = 0; t < tokens; ++t) {
        const int32_t page = row[static_cast<size_t>(t / bs)];
        auto* kp = reinterpret_cast<uint16_t*>(c.pool.data() + l.FullK(page, h)) + (t % bs) * hd;
        auto* vp = reinterpret_cast<uint16_t*>(c.pool.data() + l.FullV(page, h)) + (t % bs) * hd;
        const size_t at = (static_cast<size_t>(h) * tokens + t) * hd;
        for (int i = 0; i < hd; ++i) {
          k[at + i] = kp[i] = RandomHalf(normal, rng);
          v[at + i] = vp[i] = RandomHalf(normal, rng);
        }
      }
    }
    c.k.push_back(std::move(k));
    c.v.push_back(std::move(v));
    c.q_start.push_back(sh.start);
    c.q_indptr.push_back(c.q_indptr.back() + sh.n_q);
    c.max_q_per_seq = std::max(c.max_q_per_seq, sh.n_q);
  }
  std::normal_distribution<float> q_normal(0.0f, q_sigma);
  c.q.resize(static_cast<size_t>(c.total_q()) * n_heads * hd);
  for (float& x : c.q) x = q_normal(rng);
  return c;
}

// Causal softmax attention in double over the drawn rows (not the pool): [n_q, n_heads, d].
// Logits are q.k * sm_scale, sm_scale the float the kernels are given.
// window > 0: the row at position p attends (p - window, p] only.
inline std::vector<double> DensePrefillAttention(const PrefillCase& c, float sm_scale,
                                                 int window = 0) {
  const int hd = c.layout.head_dim, group = c.n_heads / c.layout.n_kv_heads;
  std::vector<double> out(static_cast<size_t>(c.total_q()) * c.n_heads * hd);
  std::vector<double> logit, o;
  for (int32_t s = 0; s < c.num_seqs(); ++s) {
    const int64_t tokens = c.q_start[s] + (c.q_indptr[s + 1] - c.q_indptr[s]);
    for (int32_t row = c.q_indptr[s]; row < c.q_indptr[s + 1]; ++row) {
      const int64_t pos = c.q_start[s] + (row - c.q_indptr[s]);
      for (int hq = 0; hq < c.n_heads; ++hq) {
        const uint16_t* k = c.k[s].data() + hq / group * tokens * hd;  // [tokens, d]
        const uint16_t* v = c.v[s].data() + hq / group * tokens * hd;
        const float* q = c.q.data() + (static_cast<int64_t>(row) * c.n_heads + hq) * hd;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        logit.assign(static_cast<size_t>(pos + 1), -std::numeric_limits<double>::infinity());
        for (int64_t t = lo; t <= pos; ++t) {
          double dot = 0.0;
          for (int i = 0; i < hd; ++i)
            dot += static_cast<double>(q[i]) * HalfToFloat(k[t * hd + i]);
          logit[static_cast<size_t>(t)] = dot * sm_scale;
        }
        const double max = *std::max_element(logit.begin(), logit.end());
        o.assign(static_cast<size_t>(hd), 0.0);
        double sum = 0.0;
        for (int64_t t = lo; t <= pos; ++t) {
          const double w = std::exp(logit[static_cast<size_t>(t)] - max);
          sum += w;
          for (int i = 0; i < hd; ++i) o[i] += w * HalfToFloat(v[t * hd + i]);
        }
        double* dst = out.data() + (static_cast<int64_t>(row) * c.n_heads + hq) * hd;
        for (int i = 0; i < hd; ++i) dst[i] = o[i] / sum;
      }
    }
  }
  return out;
}

}  // namespace subspace::kernels::testing

#endif  // SUBSPACE_TESTS_KERNELS_KV_TEST_DATA_H_
