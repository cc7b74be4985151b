// Online refresh of transform codes: moments give the stream rows give, a refit follows rows
// unlike the calibration's within the same bytes per block, the decay forgets, and what cannot
// be fitted is not published.
#include "core/compress/transform_refresh.h"

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace subspace {
namespace {

constexpr int kDim = 16, kBlock = 16;
const KvCacheGeometry kGeom{.n_layers = 1, .n_kv_heads = 1, .head_dim = kDim};

// n rows whose variance sits in dims [strong, strong + 4) (x9 the others'), around `mean`.
std::vector<float> Rows(int64_t n, int strong, float mean, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n) * kDim);
  for (int64_t r = 0; r < n; ++r) {
    for (int i = 0; i < kDim; ++i) {
      const bool big = i >= strong && i < strong + 4;
      x[static_cast<size_t>(r * kDim + i)] = mean + n01(rng) * (big ? 3.0f : 1.0f);
    }
  }
  return x;
}

TransformCode Fit(const std::vector<float>& rows, int bits_per_row) {
  const TransformCodeOptions o;
  absl::StatusOr<TransformStream> s =
      AnalyzeStream(rows.data(), static_cast<int64_t>(rows.size() / kDim), kDim, o);
  EXPECT_TRUE(s.ok()) << s.status();
  absl::StatusOr<std::vector<int>> choice = AllocateWidths(s->distortion, o.widths, bits_per_row);
  EXPECT_TRUE(choice.ok()) << choice.status();
  return MakeTransformCode(*s, *choice);
}

TransformCodes Codes(const TransformCode& key, const TransformCode& value) {
  return {std::make_shared<const std::vector<TransformCode>>(1, key),
          std::make_shared<const std::vector<TransformCode>>(1, value)};
}

double Mse(const TransformCode& c, const std::vector<float>& rows) {
  double err = 0.0;
  std::vector<float> x(kDim);
  for (size_t r = 0; r < rows.size() / kDim; ++r) {
    std::copy_n(rows.data() + r * kDim, kDim, x.data());
    c.RoundTrip(x.data());
    for (int i = 0; i < kDim; ++i) err += std::pow(x[i] - rows[r * kDim + i], 2);
  }
  return err / static_cast<double>(rows.size());
}

void Observe(TransformStatistics& s, const std::vector<float>& rows) {
  for (size_t at = 0; at + kBlock * kDim <= rows.size(); at += kBlock * kDim) {
    s.ObserveBlock(0, rows.data() + at, rows.data() + at, kBlock);
  }
}

RefreshConfig Pca(double half_life) {
  return {.method = RefreshMethod::kPca, .half_life_tokens = half_life};
}

TEST(AnalyzeMomentsTest, GivesTheStreamItsRowsGive) {
  const std::vector<float> rows = Rows(600, 3, 0.5f, 1);
  const int64_t n = 600;
  std::vector<float> metric(kDim);
  for (int i = 0; i < kDim; ++i) metric[i] = 0.5f + 0.25f * static_cast<float>(i % 3);
  std::vector<double> mean(kDim, 0.0), cov(kDim * kDim, 0.0);
  for (int64_t r = 0; r < n; ++r) {
    for (int i = 0; i < kDim; ++i) mean[i] += rows[r * kDim + i] / static_cast<double>(n);
  }
  for (int64_t r = 0; r < n; ++r) {
    for (int i = 0; i < kDim; ++i) {
      for (int j = 0; j < kDim; ++j) {
        cov[i * kDim + j] += (rows[r * kDim + i] - mean[i]) * (rows[r * kDim + j] - mean[j]);
      }
    }
  }
  const TransformCodeOptions o;
  absl::StatusOr<TransformStream> want = AnalyzeStream(rows.data(), n, kDim, o, metric);
  absl::StatusOr<TransformStream> got = AnalyzeMoments(mean, cov, rows.data(), n, kDim, o, metric);
  ASSERT_TRUE(want.ok() && got.ok()) << got.status();
  for (int i = 0; i < kDim; ++i) EXPECT_NEAR(got->mean[i], want->mean[i], 1e-5);
  EXPECT_EQ(got->scale, want->scale);
  for (int j = 0; j < kDim; ++j) {
    double dot = 0.0;  // the same component, up to its sign
    for (int i = 0; i < kDim; ++i)
      dot += double{got->basis[j * kDim + i]} * want->basis[j * kDim + i];
    EXPECT_NEAR(std::abs(dot), 1.0, 1e-6) << "component " << j;
    for (size_t w = 0; w < o.widths.size(); ++w) {
      EXPECT_NEAR(got->distortion[j][w], want->distortion[j][w],
                  1e-4 * (1.0 + want->distortion[j][w]))
          << "component " << j << " width " << o.widths[w];
    }
  }
  EXPECT_NEAR(got->variance, want->variance, 1e-4 * want->variance);

  std::vector<double> bad = cov;
  bad[5] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(AnalyzeMoments(mean, bad, rows.data(), n, kDim, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AnalyzeMoments(mean, std::span<const double>(cov).first(kDim), rows.data(), n, kDim, o)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// Calibrated on rows whose energy sits in dims 0-3, a session whose rows put it in dims 8-11
// around another mean: the refit's codes code the session's rows with far less error, and a
// block of them takes no more bytes than the calibration's did.
TEST(TransformStatisticsTest, RefitFollowsRowsUnlikeTheCalibrationsWithinTheSameBytes) {
  const TransformCode calibrated = Fit(Rows(800, 0, 0.0f, 2), 3 * kDim);
  TransformStatistics stats(kGeom, kBlock, Pca(1024.0), Codes(calibrated, calibrated));
  Observe(stats, Rows(512, 8, 3.0f, 3));
  absl::StatusOr<RefreshedEpoch> epoch = stats.RefreshEpoch();
  ASSERT_TRUE(epoch.ok()) << epoch.status();
  ASSERT_NE(epoch->codes.keys, nullptr);
  EXPECT_EQ(epoch->basis, nullptr);
  const TransformCode& key = (*epoch->codes.keys)[0];
  const std::vector<float> held_out = Rows(400, 8, 3.0f, 4);
  EXPECT_LT(Mse(key, held_out), 0.5 * Mse(calibrated, held_out))
      << Mse(key, held_out) << " vs " << Mse(calibrated, held_out);
  EXPECT_LE(LayOutCodedRun(key, kBlock).run_bytes, LayOutCodedRun(calibrated, kBlock).run_bytes);
  EXPECT_EQ(key.BitsPerRow(), calibrated.BitsPerRow());  // B = 16: bytes are 2 x bits
}

TEST(TransformStatisticsTest, TheDecayForgetsWhatTheSessionLeftBehind) {
  const TransformCode calibrated = Fit(Rows(800, 0, 0.0f, 2), 3 * kDim);
  double means[2];
  for (int i = 0; i < 2; ++i) {
    TransformStatistics stats(kGeom, kBlock, Pca(i == 0 ? 0.0 : 32.0),
                              Codes(calibrated, calibrated));
    Observe(stats, Rows(512, 0, 0.0f, 5));
    Observe(stats, Rows(512, 0, 4.0f, 6));
    absl::StatusOr<RefreshedEpoch> epoch = stats.RefreshEpoch();
    ASSERT_TRUE(epoch.ok() && epoch->codes.values != nullptr);
    means[i] = 0.0;
    for (float m : (*epoch->codes.values)[0].mean) means[i] += m / kDim;
  }
  EXPECT_NEAR(means[0], 2.0, 0.2);  // no decay: both halves weigh the same
  EXPECT_NEAR(means[1], 4.0, 0.2);  // 512 rows are 16 half-lives: the first half is gone
}

// A pass key in filler: a few rows far from the rest, early in the session and long out of the
// recent rows. The refit's ranges still reach them (the farthest rows are kept for fitting), so
// their round trip keeps most of what sets them apart.
TEST(TransformStatisticsTest, RareRowsLongPastStillFitInTheRanges) {
  const TransformCode calibrated = Fit(Rows(800, 0, 0.0f, 2), 3 * kDim);
  TransformStatistics stats(kGeom, kBlock, Pca(4096.0), Codes(calibrated, calibrated));
  std::vector<float> rare = Rows(16, 12, 0.0f, 9);
  for (size_t i = 0; i < rare.size(); ++i) rare[i] = 8.0f * rare[i] + (i % kDim == 13 ? 20 : 0);
  Observe(stats, rare);
  Observe(stats, Rows(1024, 0, 0.0f, 10));  // filler, four times the recent rows kept
  absl::StatusOr<RefreshedEpoch> epoch = stats.RefreshEpoch();
  ASSERT_TRUE(epoch.ok() && epoch->codes.keys != nullptr);
  const TransformCode& key = (*epoch->codes.keys)[0];
  double energy = 0.0;  // of the rare rows about the filler's mean (0)
  for (float x : rare) energy += double{x} * x;
  energy /= static_cast<double>(rare.size());
  EXPECT_LT(Mse(key, rare), 0.1 * energy) << Mse(key, rare) << " of " << energy;
}

TEST(TransformStatisticsTest, TooFewRowsPublishNothingAndNonFiniteRowsFail) {
  const TransformCode calibrated = Fit(Rows(800, 0, 0.0f, 2), 3 * kDim);
  TransformStatistics few(kGeom, kBlock, Pca(64.0), Codes(calibrated, calibrated));
  Observe(few, Rows(16, 0, 0.0f, 7));
  absl::StatusOr<RefreshedEpoch> none = few.RefreshEpoch();
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->codes.keys, nullptr);

  TransformStatistics broken(kGeom, kBlock, Pca(64.0), Codes(calibrated, calibrated));
  std::vector<float> rows = Rows(64, 0, 0.0f, 8);
  rows[37] = std::numeric_limits<float>::infinity();
  Observe(broken, rows);
  EXPECT_EQ(broken.RefreshEpoch().status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace subspace
