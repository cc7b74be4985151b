// The transform-coded cache's sequence images: a sequence restored bitwise in both forms (as
// stored, range-coded), damaged and foreign images refused with nothing taken, and a refreshing
// sequence's epochs carried with it; the format refusing epochs that could not be placed.
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/compress/transform_kv_cache.h"
#include "gtest/gtest.h"
#include "tests/core/compress/transform_kv_cache_test_util.h"

namespace subspace {
namespace {

using namespace transform_cache_test;  // NOLINT(build/namespaces): this test family's helpers

class TransformKvCacheImageTest : public ::testing::TestWithParam<Variant> {};

// An exported sequence imported into another cache with the same codes: the same blocks coded,
// bitwise the same attention, and after more tokens on both, the same image again.
TEST_P(TransformKvCacheImageTest, ImageRestoresTheSequenceBitwise) {
  Fixture f = Make(60, 11, GetParam());
  const SeqId seq = *f.cache->CreateSequence();
  std::mt19937 rng(5);
  ASSERT_TRUE(f.cache->Reserve(seq, 37).ok());
  WriteTokens(f, seq, 0, 20, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 20).ok());
  WriteTokens(f, seq, 20, 17, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 37).ok());  // sinks, coded blocks, the window, a partial block
  absl::StatusOr<std::string> image = f.cache->ExportSequence(seq);
  ASSERT_TRUE(image.ok()) << image.status();

  Fixture g = Make(60, 11, GetParam());
  const int64_t free_before = g.cache->pool().num_free();
  absl::StatusOr<SeqId> copy = g.cache->ImportSequence(*image);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(g.cache->Length(*copy), 37);
  for (int l = 0; l < kLayers; ++l) {
    for (int64_t b = 0; b < 10; ++b) {
      EXPECT_EQ(g.cache->IsCoded(*copy, l, b), f.cache->IsCoded(seq, l, b)) << l << " " << b;
    }
  }
  EXPECT_EQ(g.cache->Stats().bytes_used_compressed, f.cache->Stats().bytes_used_compressed);
  ExpectSameAttention(f, seq, g, *copy, 36, 1, 21);
  // The storage form (codes range-coded) restores the same sequence: its image is the stored
  // form's, byte for byte.
  absl::StatusOr<std::string> compact = f.cache->CompactImage(*image);
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_NE(*compact, *image);
  EXPECT_EQ(*g.cache->CompactImage(*compact), *compact);  // already compact: as it is
  absl::StatusOr<SeqId> from_compact = g.cache->ImportSequence(*compact);
  ASSERT_TRUE(from_compact.ok()) << from_compact.status();
  EXPECT_EQ(*g.cache->ExportSequence(*from_compact), *image);
  ASSERT_TRUE(g.cache->FreeSequence(*from_compact).ok());

  // The same tokens on both: coding continues where it was.
  std::mt19937 rng_f(9), rng_g(9);
  for (auto [fx, s, r] : {std::tuple{&f, seq, &rng_f}, std::tuple{&g, *copy, &rng_g}}) {
    ASSERT_TRUE(fx->cache->Reserve(s, 12).ok());
    WriteTokens(*fx, s, 37, 12, *r);
    ASSERT_TRUE(fx->cache->Commit(s, 49).ok());
  }
  ExpectSameAttention(f, seq, g, *copy, 40, 9, 22);
  EXPECT_EQ(*g.cache->ExportSequence(*copy), *f.cache->ExportSequence(seq));
  ASSERT_TRUE(g.cache->FreeSequence(*copy).ok());
  EXPECT_EQ(g.cache->pool().num_free(), free_before);
}

TEST(TransformKvCacheTest, ImportRefusesDamagedOrForeignImagesAndLeaksNothing) {
  Fixture f = Make(40, 11);
  const SeqId seq = *f.cache->CreateSequence();
  std::mt19937 rng(5);
  ASSERT_TRUE(f.cache->Reserve(seq, 30).ok());
  WriteTokens(f, seq, 0, 30, rng);
  ASSERT_TRUE(f.cache->Commit(seq, 30).ok());
  const std::string image = *f.cache->ExportSequence(seq);

  Fixture g = Make(40, 11);
  const int64_t free_before = g.cache->pool().num_free();
  for (size_t cut : {size_t{0}, size_t{10}, image.size() / 2, image.size() - 1}) {
    EXPECT_EQ(g.cache->ImportSequence(image.substr(0, cut)).status().code(),
              absl::StatusCode::kDataLoss)
        << cut;
  }
  EXPECT_EQ(g.cache->ImportSequence(image + "x").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(g.cache->CompactImage(image.substr(0, image.size() / 2)).status().code(),
            absl::StatusCode::kDataLoss);
  const std::string compact = *f.cache->CompactImage(image);
  for (size_t cut : {size_t{50}, compact.size() / 2, compact.size() - 1}) {
    EXPECT_EQ(g.cache->ImportSequence(compact.substr(0, cut)).status().code(),
              absl::StatusCode::kDataLoss)
        << cut;
  }
  EXPECT_EQ(g.cache->ImportSequence(compact + "x").status().code(), absl::StatusCode::kDataLoss);
  // Another codec (fitted on other rows): its codes mean other numbers here.
  Fixture other = Make(40, 12);
  EXPECT_EQ(other.cache->ImportSequence(image).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.cache->ImageLayout(), f.cache->ImageLayout());
  // A pool too small for the sequence's pages.
  Fixture small = Make(40, 11, {}, /*pages=*/kLayers * 3);
  EXPECT_EQ(small.cache->ImportSequence(image).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small.cache->ImportSequence(compact).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small.cache->pool().num_free(), small.cache->pool().num_blocks());
  EXPECT_EQ(g.cache->pool().num_free(), free_before);
}

// Two sets of codes hold the same numbers.
void ExpectSameCodes(const TransformCodes& a, const TransformCodes& b) {
  for (auto [x, y] : {std::pair{a.keys, b.keys}, std::pair{a.values, b.values}}) {
    ASSERT_EQ(x->size(), y->size());
    for (size_t i = 0; i < x->size(); ++i) {
      const TransformCode &p = (*x)[i], &q = (*y)[i];
      EXPECT_EQ(p.mean, q.mean);
      EXPECT_EQ(p.scale, q.scale);
      EXPECT_EQ(p.basis, q.basis);
      ASSERT_EQ(p.components.size(), q.components.size());
      for (size_t j = 0; j < p.components.size(); ++j) {
        EXPECT_EQ(p.components[j].bits, q.components[j].bits);
        EXPECT_EQ(p.components[j].offset, q.components[j].offset);
        EXPECT_EQ(p.components[j].step, q.components[j].step);
      }
    }
  }
}

// A sequence with online refresh moves with its epochs: every block is read with the codes that
// coded it, bitwise as on the source, in both forms of the image; the epoch it codes new blocks
// with comes too, so the same tokens on both code the same blocks.
TEST_P(TransformKvCacheImageTest, RefreshedEpochsGoWithTheImage) {
  std::mt19937 rng(29);
  Fixture f = Make(140, 11, GetParam(), 200, Refresh(/*max_epochs=*/16));
  const SeqId seq = *f.cache->CreateSequence();
  ASSERT_TRUE(f.cache->Reserve(seq, 140).ok());
  for (int64_t pos = 0; pos < 100; pos += 8) {
    WriteTokens(f, seq, pos, 8, rng);
    ASSERT_TRUE(f.cache->Commit(seq, pos + 8).ok());
  }
  std::set<int32_t> epochs;
  for (int l = 0; l < kLayers; ++l) {
    for (int64_t b = 0; b < 25; ++b) epochs.insert(f.cache->BlockEpoch(seq, l, b));
  }
  ASSERT_GE(epochs.size(), 4u);  // -1 (full blocks), the codec file's and refreshed ones
  absl::StatusOr<std::string> image = f.cache->ExportSequence(seq);
  ASSERT_TRUE(image.ok()) << image.status();

  Fixture g = Make(140, 11, GetParam());  // no refresh of its own
  const int64_t free_before = g.cache->pool().num_free();
  absl::StatusOr<SeqId> copy = g.cache->ImportSequence(*image);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(g.cache->Length(*copy), 104);
  for (int l = 0; l < kLayers; ++l) {
    for (int64_t b = 0; b < 26; ++b) {
      const int32_t fe = f.cache->BlockEpoch(seq, l, b), ge = g.cache->BlockEpoch(*copy, l, b);
      ASSERT_EQ(fe < 0, ge < 0) << l << " " << b;
      if (fe < 0) continue;
      EXPECT_EQ(fe == 0, ge == 0) << l << " " << b;
      ExpectSameCodes(*f.cache->EpochCodes(fe), *g.cache->EpochCodes(ge));
    }
  }
  EXPECT_EQ(g.cache->Stats().bytes_used_compressed, f.cache->Stats().bytes_used_compressed);
  ExpectSameAttention(f, seq, g, *copy, 103, 1, 31);
  ExpectSameAttention(f, seq, g, *copy, 90, 14, 32);
  EXPECT_EQ(*g.cache->ExportSequence(*copy), *image);
  // The storage form: the same sequence, its image byte for byte.
  absl::StatusOr<std::string> compact = f.cache->CompactImage(*image);
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_NE(*compact, *image);
  absl::StatusOr<SeqId> from_compact = g.cache->ImportSequence(*compact);
  ASSERT_TRUE(from_compact.ok()) << from_compact.status();
  EXPECT_EQ(*g.cache->ExportSequence(*from_compact), *image);
  ASSERT_TRUE(g.cache->FreeSequence(*from_compact).ok());

  // The same tokens on both, the source no longer refreshing: coded with the same epoch.
  ASSERT_TRUE(f.cache->SetSequenceRefresh(seq, {}).ok());
  std::mt19937 rng_f(9), rng_g(9);
  for (auto [fx, s, r] : {std::tuple{&f, seq, &rng_f}, std::tuple{&g, *copy, &rng_g}}) {
    ASSERT_TRUE(fx->cache->Reserve(s, 36).ok());
    WriteTokens(*fx, s, 104, 36, *r);
    ASSERT_TRUE(fx->cache->Commit(s, 140).ok());
  }
  EXPECT_GT(g.cache->BlockEpoch(*copy, 0, 26), 0);
  ExpectSameAttention(f, seq, g, *copy, 139, 1, 33);
  EXPECT_EQ(*g.cache->ExportSequence(*copy), *f.cache->ExportSequence(seq));
  // Freed, its epochs go with it.
  ASSERT_TRUE(g.cache->FreeSequence(*copy).ok());
  EXPECT_EQ(g.cache->Stats().epochs_live, 1);
  EXPECT_EQ(g.cache->pool().num_free(), free_before);
}

// Images with epochs, damaged or short of room: refused, and nothing taken (pages or epochs).
TEST(TransformKvCacheTest, ImportOfRefreshedEpochsRefusesDamageAndLeaksNothing) {
  std::mt19937 rng(37);
  Fixture f = Make(100, 11, {}, 200, Refresh(/*max_epochs=*/16));
  const SeqId seq = *f.cache->CreateSequence();
  ASSERT_TRUE(f.cache->Reserve(seq, 100).ok());
  WriteTokens(f, seq, 0, 100, rng);
  for (int64_t pos = 8; pos <= 100; pos += 8) ASSERT_TRUE(f.cache->Commit(seq, pos).ok());
  ASSERT_GE(f.cache->Stats().refresh.installed, 2);
  const std::string image = *f.cache->ExportSequence(seq);
  const std::string compact = *f.cache->CompactImage(image);

  Fixture g = Make(100, 11);
  for (const std::string* im : {&image, &compact}) {
    for (size_t cut : {size_t{60}, im->size() / 3, im->size() / 2, im->size() - 1}) {
      EXPECT_EQ(g.cache->ImportSequence(im->substr(0, cut)).status().code(),
                absl::StatusCode::kDataLoss)
          << cut;
    }
  }
  // Where the first epoch's first code starts: after the layout line, length, next_compress,
  // the form byte, the epoch count and the code's scale flag.
  const size_t mean_at = 8 + f.cache->ImageLayout().size() + 8 + 8 + 1 + 8 + 1;
  std::string nan = image;
  const float q = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan.data() + mean_at, &q, sizeof(q));
  absl::Status st = g.cache->ImportSequence(nan).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("non-finite"), std::string::npos) << st.message();
  std::string form = image;
  form[mean_at - 10] = 6;  // an unknown bit of the codes' form
  EXPECT_EQ(g.cache->ImportSequence(form).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(g.cache->Stats().epochs_live, 1);
  EXPECT_EQ(g.cache->pool().num_free(), g.cache->pool().num_blocks());
  // Room for the full pages but not every slot: the installed epochs are retired again.
  for (int64_t pages = kLayers * 2; pages <= kLayers * 12; pages += 2) {
    Fixture small = Make(100, 11, {}, pages);
    absl::StatusOr<SeqId> got = small.cache->ImportSequence(image);
    if (got.ok()) {
      ASSERT_TRUE(small.cache->FreeSequence(*got).ok());
    } else {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << pages;
    }
    EXPECT_EQ(small.cache->Stats().epochs_live, 1) << pages;
    EXPECT_EQ(small.cache->pool().num_free(), small.cache->pool().num_blocks()) << pages;
  }
}

// The format itself refuses epochs it could not place: blocks an epoch's codes make larger than
// the cache's slot, block epochs out of range, epochs nothing uses.
TEST(TransformImageTest, RefusesEpochsThatDoNotFit) {
  Fixture f = Make(40, 11);
  const TransformImageFormat format(Geometry(), kBlock, kSinks, kWindow, /*pre_rope_keys=*/true,
                                    *f.kc, *f.vc);
  auto wide_codes = std::make_shared<std::vector<TransformCode>>(*f.kc);
  for (TransformCode& c : *wide_codes) {
    for (ComponentQuantizer& cq : c.components) cq.bits = 8;
  }
  const std::shared_ptr<const std::vector<TransformCode>> wide = wide_codes;
  const std::string rows(static_cast<size_t>(2 * kKv * kBlock * kDim * 2), '\0');
  const std::string codes0(static_cast<size_t>(format.coded_bytes(0)), '\1');
  const std::string codes1(static_cast<size_t>(format.coded_bytes(1)), '\2');
  const auto image = [&](std::shared_ptr<const std::vector<TransformCode>> keys, int64_t epoch,
                         int64_t current) {
    TransformImage im;
    im.length = 2 * kBlock;
    im.next_compress = 2;
    im.blocks = 2;
    im.epochs = {{.keys = std::move(keys), .values = f.vc}};
    im.current_epoch = current;
    const TransformImage::Part full{.coded = false, .bytes = rows};
    im.parts = {{.coded = true, .epoch = epoch, .bytes = codes0},
                full,
                {.coded = true, .epoch = epoch, .bytes = codes1},
                full};
    return im;
  };
  for (bool entropy_coded : {false, true}) {
    // The file's own codes as epoch 1: read back.
    // A read image's stored-form parts are views of the image: it outlives them.
    const std::string written = format.Write(image(f.kc, 1, 1), entropy_coded);
    absl::StatusOr<TransformImage> ok = format.Read(written, 100);
    ASSERT_TRUE(ok.ok()) << ok.status() << " " << entropy_coded;
    EXPECT_EQ(ok->epochs.size(), 1u);
    EXPECT_EQ(ok->parts[0].epoch, 1);
    EXPECT_EQ(ok->parts[0].bytes, codes0);
    EXPECT_EQ(ok->parts[2].bytes, codes1);
    for (auto [keys, epoch, current, why] :
         {std::tuple{wide, 0, 1, "more than the cache's"}, std::tuple{f.kc, 2, 1, "epoch 2 of 1"},
          std::tuple{f.kc, 0, 0, "used by no block"}}) {
      absl::StatusOr<TransformImage> read =
          format.Read(format.Write(image(keys, epoch, current), entropy_coded), 100);
      EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << why;
      EXPECT_NE(read.status().message().find(why), std::string::npos) << read.status();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KeysAndMetric, TransformKvCacheImageTest, Variants(), VariantName);

}  // namespace
}  // namespace subspace
