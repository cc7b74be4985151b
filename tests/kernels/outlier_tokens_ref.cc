// Plain loops over the pool bytes: the reference outlier_tokens.cu is tested against.
#include "tests/kernels/outlier_tokens_ref.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

// Where the k-th outlier of block i sits: page and slot in the outlier pool.
struct OutlierSlot {
  int32_t page;
  int32_t slot;
};

OutlierSlot SlotOf(const OutlierTokensParams& p, int32_t i, int k) {
  const int bs = p.layout.block_size;
  const int s = p.first_slot[i] + k;
  return s < bs ? OutlierSlot{p.outlier_page[2 * static_cast<int64_t>(i)], s}
                : OutlierSlot{p.outlier_page[2 * static_cast<int64_t>(i) + 1], s - bs};
}

// The tokens of a mask, lowest first: entry k is the k-th outlier's token.
std::vector<int> Tokens(uint64_t mask, int bs) {
  std::vector<int> tokens;
  for (int t = 0; t < bs; ++t) {
    if ((mask >> t) & 1u) tokens.push_back(t);
  }
  return tokens;
}

absl::Status PageInRange(const char* what, int32_t i, int32_t page, int64_t num_pages) {
  if (page >= 0 && page < num_pages) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "outlier batch, block %d: %s page %d outside [0, %d)", i, what, page, num_pages));
}

}  // namespace

absl::Status CheckOutlierBatch(const OutlierTokensParams& p, int64_t num_block_pages,
                               int64_t num_outlier_pages, bool same_pool) {
  const KvPoolLayout& l = p.layout;
  if (const char* err = KvPoolLayoutError(l)) {
    return absl::InvalidArgumentError(absl::StrFormat("outlier batch: %s", err));
  }
  if (l.head_dim != 64 && l.head_dim != 128) {
    return absl::InvalidArgumentError(
        absl::StrFormat("outlier batch: head_dim %d is not 64 or 128", l.head_dim));
  }
  if (p.n_blocks < 0) return absl::InvalidArgumentError("outlier batch: negative n_blocks");
  const int bs = l.block_size;
  // A token: (pool, page, token in page); pool 0 holds the block pages, 1 the outlier pages
  // (one pool: both 0). Every head's K and V rows move together, so tokens are the unit.
  using Token = std::tuple<int, int32_t, int32_t>;
  const int outlier_pool = same_pool ? 0 : 1;
  std::set<Token> sources, destinations;
  for (int32_t i = 0; i < p.n_blocks; ++i) {
    const uint64_t mask = p.mask[i];
    if (bs < 64 && (mask >> bs) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "outlier batch, block %d: mask %#x has bits past block size %d", i, mask, bs));
    }
    const int32_t first = p.first_slot[i];
    if (first < 0 || first >= bs) {
      return absl::InvalidArgumentError(
          absl::StrFormat("outlier batch, block %d: first slot %d outside [0, %d)", i, first, bs));
    }
    if (absl::Status s = PageInRange("block", i, p.block_page[i], num_block_pages); !s.ok()) {
      return s;
    }
    const int n = std::popcount(mask);
    if (n == 0) continue;
    const int32_t* pages = p.outlier_page + 2 * static_cast<int64_t>(i);
    if (absl::Status s = PageInRange("first outlier", i, pages[0], num_outlier_pages); !s.ok()) {
      return s;
    }
    if (first + n > bs) {
      if (absl::Status s = PageInRange("second outlier", i, pages[1], num_outlier_pages); !s.ok()) {
        return s;
      }
    }
    const std::vector<int> tokens = Tokens(mask, bs);
    for (int k = 0; k < n; ++k) {
      const OutlierSlot o = SlotOf(p, i, k);
      Token block{0, p.block_page[i], tokens[static_cast<size_t>(k)]};
      Token outlier{outlier_pool, o.page, o.slot};
      if (p.direction == OutlierMove::kToBlockPages) std::swap(block, outlier);
      // Now `block` is the source and `outlier` the destination.
      sources.insert(block);
      if (!destinations.insert(outlier).second) {
        return absl::InvalidArgumentError(
            absl::StrFormat("outlier batch: two blocks write token %d of page %d",
                            std::get<2>(outlier), std::get<1>(outlier)));
      }
    }
  }
  // In one buffer a CTA writing a token could overwrite one another CTA still reads.
  if (same_pool) {
    for (const Token& d : destinations) {
      if (sources.count(d) != 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("outlier batch: token %d of page %d is both read and written",
                            std::get<2>(d), std::get<1>(d)));
      }
    }
  }
  return absl::OkStatus();
}

void OutlierTokensRef(const OutlierTokensParams& p) {
  const KvPoolLayout& l = p.layout;
  const int64_t row_bytes = static_cast<int64_t>(l.head_dim) * 2;
  for (int32_t i = 0; i < p.n_blocks; ++i) {
    const std::vector<int> tokens = Tokens(p.mask[i], l.block_size);
    for (size_t k = 0; k < tokens.size(); ++k) {
      const OutlierSlot o = SlotOf(p, i, static_cast<int>(k));
      for (int h = 0; h < l.n_kv_heads; ++h) {
        for (int side = 0; side < 2; ++side) {
          uint8_t* block = p.block_pool +
                           (side == 0 ? l.FullK(p.block_page[i], h) : l.FullV(p.block_page[i], h)) +
                           tokens[k] * row_bytes;
          uint8_t* outlier = p.outlier_pool +
                             (side == 0 ? l.FullK(o.page, h) : l.FullV(o.page, h)) +
                             o.slot * row_bytes;
          if (p.direction == OutlierMove::kToOutlierPages) {
            std::memcpy(outlier, block, static_cast<size_t>(row_bytes));
          } else {
            std::memcpy(block, outlier, static_cast<size_t>(row_bytes));
          }
        }
      }
    }
  }
}

namespace testing {

OutlierTokensParams OutlierCase::HostParams(OutlierMove direction,
                                            const std::vector<int32_t>& pages) {
  OutlierTokensParams p;
  p.layout = layout;
  p.block_pool = block_bytes().data();
  p.outlier_pool = outlier_pool.data();
  p.block_page = pages.data();
  p.mask = mask.data();
  p.first_slot = first_slot.data();
  p.outlier_page = outlier_page.data();
  p.n_blocks = n_blocks();
  p.direction = direction;
  return p;
}

OutlierCase RandomOutlierCase(const KvPoolLayout& l, int n_blocks, bool same_pool, double p_outlier,
                              std::mt19937_64& rng) {
  OutlierCase c;
  c.layout = l;
  c.same_pool = same_pool;
  const int bs = l.block_size;
  std::bernoulli_distribution draw(p_outlier);
  int64_t total = 0;
  for (int i = 0; i < n_blocks; ++i) {
    uint64_t mask = 0;
    for (int t = 0; t < bs; ++t) {
      const bool outlier = i % 4 == 1 ? false : i % 4 == 2 ? true : draw(rng);
      if (outlier) mask |= uint64_t{1} << t;
    }
    c.mask.push_back(mask);
    total += std::popcount(mask);
  }
  const int first = std::uniform_int_distribution<int>(0, bs - 1)(rng);
  const int64_t outlier_pages = (first + total + bs - 1) / bs;
  const int64_t block_pages = 2 * static_cast<int64_t>(n_blocks) + 1;  // blocks, spares, unused
  c.num_block_pages = same_pool ? block_pages + outlier_pages : block_pages;
  c.num_outlier_pages = same_pool ? c.num_block_pages : outlier_pages + 1;
  c.outlier_pool.assign(static_cast<size_t>(c.num_outlier_pages * l.page_bytes), kPoison);
  if (!same_pool)
    c.block_pool.assign(static_cast<size_t>(c.num_block_pages * l.page_bytes), kPoison);

  // Shuffled page ids: block pages and spares first, then (one pool) the outlier pages.
  std::vector<int32_t> ids(static_cast<size_t>(c.num_block_pages));
  for (int64_t i = 0; i < c.num_block_pages; ++i)
    ids[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> outlier_ids;
  if (same_pool) {
    outlier_ids.assign(ids.begin() + block_pages, ids.end());
  } else {
    for (int64_t i = 0; i < c.num_outlier_pages; ++i)
      outlier_ids.push_back(static_cast<int32_t>(i));
    std::shuffle(outlier_ids.begin(), outlier_ids.end(), rng);
  }
  int64_t j = first;  // the next outlier's slot, counted over the whole store
  for (int i = 0; i < n_blocks; ++i) {
    c.block_page.push_back(ids[static_cast<size_t>(i)]);
    c.spare_page.push_back(ids[static_cast<size_t>(n_blocks + i)]);
    FillFullPage(l, c.block_bytes(), c.block_page.back(), rng);
    const int n = std::popcount(c.mask[static_cast<size_t>(i)]);
    c.first_slot.push_back(static_cast<int32_t>(j % bs));
    const bool any = n > 0, straddles = j % bs + n > bs;
    c.outlier_page.push_back(any ? outlier_ids[static_cast<size_t>(j / bs)] : -1);
    c.outlier_page.push_back(straddles ? outlier_ids[static_cast<size_t>(j / bs + 1)] : -1);
    j += n;
  }
  return c;
}

}  // namespace testing
}  // namespace subspace::kernels
