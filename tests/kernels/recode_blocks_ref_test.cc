// The recode twin (RecodeBlocksRef) against CompressedKvCache's compactor maps written out
// independently: c' = (P_k[to]^T P_q[from]) c and u' = (P_v[to]^T R_v[from]^T) u, the r x r
// matrix formed first, in double, then encoded as EncodeCoeffs does. Also: only the re-coded
// slots' payloads change, and CheckRecodeBatch refuses what the kernel could not run safely.
#include "tests/kernels/recode_blocks_ref.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/base/coeff_codec.h"
#include "tests/kernels/compress_blocks_ref.h"
#include "tests/kernels/kv_test_data.h"

namespace subspace::kernels {
namespace {

using testing::RandomRecodeCase;
using testing::RecodeCase;

// The compactor's maps, matrix first: m[a, b] = sum_x new(x, a) old(x, b), then m c.
void MatrixFirst(const RecodeCase& c, std::vector<uint8_t>& pool) {
  const KvPoolLayout& l = c.coded.layout;
  const int d = l.head_dim;
  const testing::BasisTable& b = c.coded.bases;
  for (int32_t i = 0; i < c.coded.n_blocks(); ++i) {
    uint8_t* slot = pool.data() + l.Slot(c.coded.src_page[i], c.coded.src_slot[i]);
    for (int h = 0; h < l.n_kv_heads; ++h) {
      const int64_t from = c.coded.epoch[static_cast<size_t>(i * l.n_kv_heads + h)];
      const int64_t to = c.to[static_cast<size_t>(i * l.n_kv_heads + h)];
      for (int side = 0; side < 2; ++side) {
        const int r = side == 0 ? l.rank_k : l.rank_v;
        const int64_t at = (from * l.n_kv_heads + h) * d * r,
                      at_to = (to * l.n_kv_heads + h) * d * r;
        std::vector<double> m(static_cast<size_t>(r) * r, 0.0);
        for (int a = 0; a < r; ++a) {
          for (int bb = 0; bb < r; ++bb) {
            double acc = 0.0;
            for (int x = 0; x < d; ++x) {
              const double nw = side == 0 ? b.p_k[at_to + x * r + a] : b.p_v[at_to + x * r + a];
              const double old = side == 0 ? b.p_q[at + x * r + bb] : b.r_v[at + bb * d + x];
              acc += nw * old;
            }
            m[static_cast<size_t>(a) * r + bb] = acc;
          }
        }
        uint8_t* codes = slot + (side == 0 ? l.KCodes(h) : l.VCodes(h));
        auto* scales =
            reinterpret_cast<uint16_t*>(slot + (side == 0 ? l.KScales(h) : l.VScales(h)));
        std::vector<float> cin(static_cast<size_t>(r)), cout(static_cast<size_t>(r));
        for (int t = 0; t < l.block_size; ++t) {
          uint8_t* row = codes + static_cast<int64_t>(t) * r * l.code_bytes;
          DecodeCoeffs(l.coeff_dtype, row, scales + t, r, cin.data());
          for (int a = 0; a < r; ++a) {
            double acc = 0.0;
            for (int bb = 0; bb < r; ++bb) acc += m[static_cast<size_t>(a) * r + bb] * cin[bb];
            cout[static_cast<size_t>(a)] = static_cast<float>(acc);
          }
          EncodeCoeffsRef(l.coeff_dtype, cout.data(), r, row, scales + t);
        }
      }
    }
  }
}

using Shape = std::tuple<int, int, int, CoeffDtype>;  // head_dim, block size, rank, codes
class RecodeBlocksRefTest : public ::testing::TestWithParam<Shape> {};

TEST_P(RecodeBlocksRefTest, TwinIsTheCompactorsMapAndTouchesOnlyItsSlots) {
  const auto [hd, bs, rank, dt] = GetParam();
  const uint64_t seed = testing::FreshSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (SUBSPACE_TEST_SEED pins it)");
  std::mt19937_64 rng(seed);
  const KvPoolLayout l = MakeKvPoolLayout(3, hd, bs, rank, rank * 3 / 4, dt);
  ASSERT_EQ(KvPoolLayoutError(l), nullptr);
  const RecodeCase c = RandomRecodeCase(l, /*n_blocks=*/6, /*n_epochs=*/3, rng);
  std::vector<uint8_t> got = c.coded.src_pool, want = c.coded.src_pool;
  const RecodeBlocksParams p = c.HostParams(got);
  ASSERT_TRUE(CheckRecodeBatch(p, c.coded.num_src_pages, c.coded.bases.n_epochs).ok());
  RecodeBlocksRef(p);
  MatrixFirst(c, want);

  std::vector<bool> payload(got.size(), false);
  int64_t codes = 0, differ = 0;
  for (int32_t i = 0; i < c.coded.n_blocks(); ++i) {
    const int64_t at = l.Slot(c.coded.src_page[i], c.coded.src_slot[i]);
    std::fill(payload.begin() + at, payload.begin() + at + l.CompressedBytes(), true);
    const std::string mismatch =
        testing::SlotMismatch(l, want.data() + at, got.data() + at, &codes, &differ);
    ASSERT_EQ(mismatch, "") << "block " << i;
  }
  // Both in double: a code rounds apart only at a tie.
  EXPECT_LE(differ, codes / 1000) << differ << " of " << codes << " codes differ";
  for (size_t i = 0; i < got.size(); ++i) {
    if (!payload[i]) {
      ASSERT_EQ(got[i], c.coded.src_pool[i]) << "byte " << i;
    }
  }
  // The codes did change (a new epoch is a new basis).
  EXPECT_NE(got, c.coded.src_pool);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RecodeBlocksRefTest,
                         ::testing::Combine(::testing::Values(64, 128),
                                            ::testing::Values(4, 16, 64), ::testing::Values(4, 16),
                                            ::testing::Values(CoeffDtype::kFp16,
                                                              CoeffDtype::kInt8)),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return "d" + std::to_string(std::get<0>(info.param)) + "_b" +
                                  std::to_string(std::get<1>(info.param)) + "_r" +
                                  std::to_string(std::get<2>(info.param)) + "_" +
                                  CoeffDtypeName(std::get<3>(info.param));
                         });

TEST(RecodeBlocksRefTest, CheckRefusesUnsafeBatches) {
  std::mt19937_64 rng(3);
  const KvPoolLayout l = MakeKvPoolLayout(2, 64, 16, 16, 16, CoeffDtype::kFp16);
  RecodeCase c = RandomRecodeCase(l, 4, 2, rng);
  std::vector<uint8_t> pool = c.coded.src_pool;
  const int64_t pages = c.coded.num_src_pages;
  const auto check = [&] {
    return CheckRecodeBatch(c.HostParams(pool), pages, c.coded.bases.n_epochs);
  };
  ASSERT_TRUE(check().ok());
  const auto refused = [&](auto edit, const char* what) {
    RecodeCase saved = c;
    edit();
    EXPECT_TRUE(absl::IsInvalidArgument(check())) << what;
    c = saved;
  };
  refused([&] { c.coded.src_page[1] = static_cast<int32_t>(pages); }, "page past the pool");
  refused([&] { c.coded.src_page[1] = -1; }, "negative page");
  refused([&] { c.coded.src_slot[2] = l.SlotsPerPage(); }, "slot past the page");
  refused([&] { c.to[3] = 2; }, "to-epoch past the table");
  refused([&] { c.coded.epoch[0] = -1; }, "negative from-epoch");
  refused(
      [&] {
        c.coded.src_page[3] = c.coded.src_page[0];
        c.coded.src_slot[3] = c.coded.src_slot[0];
      },
      "two blocks in one slot");
  RecodeBlocksParams bad = c.HostParams(pool);
  bad.layout.block_size = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(CheckRecodeBatch(bad, pages, 2)));
}

}  // namespace
}  // namespace subspace::kernels
