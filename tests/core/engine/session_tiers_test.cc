// The session tiers: images kept in host memory within its cap, the least recently stored moved
// to the disk tier (one snapshot file each, written in the background) or dropped when there is
// none, the disk tier's least recent dropped at its cap, images taken back bitwise from either
// tier, damaged files refused, and nothing left on disk when the tiers go.
#include "core/engine/session_tiers.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace subspace {
namespace {

using ::subspace::testing::FilesIn;
using ::subspace::testing::TempDir;

const SnapshotIdentity kModel{.model_checksum = 0xfeedull, .model_name = "tiny"};

// An image of `kib` KiB of incompressible cache bytes, a function of `id`.
SessionImage Image(const std::string& id, int kib) {
  SessionImage s;
  s.id = id;
  s.owner = "alice";
  s.tokens = {1, 2, 3, 4};
  s.cached = 3;
  s.idle_ttl = absl::Seconds(60);
  s.created = absl::FromUnixSeconds(1'700'000'000);
  s.last_used = s.created;
  s.cache.resize(static_cast<size_t>(kib) << 10);
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(id)));
  for (char& c : s.cache) c = static_cast<char>(rng());
  s.cache_layout = "paged test";
  return s;
}

void ExpectSame(const SessionImage& a, const SessionImage& b) {
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(a.owner, b.owner);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.cached, b.cached);
  EXPECT_EQ(a.cache, b.cache);
  EXPECT_EQ(a.cache_layout, b.cache_layout);
}

std::unique_ptr<SessionTiers> MakeTiers(int64_t host_kib, const std::string& dir = "",
                                        int64_t disk_kib = 0) {
  absl::StatusOr<std::unique_ptr<SessionTiers>> t =
      SessionTiers::Create({.host_bytes = host_kib << 10,
                            .disk_dir = dir,
                            .disk_bytes = disk_kib << 10,
                            .identity = kModel});
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

TEST(SessionTiersTest, HostTierKeepsWithinItsCapDroppingTheLeastRecent) {
  auto tiers = MakeTiers(/*host_kib=*/100);
  ASSERT_NE(tiers, nullptr);
  EXPECT_TRUE(tiers->Put(Image("a", 40)));
  EXPECT_TRUE(tiers->Put(Image("b", 40)));
  EXPECT_EQ(tiers->Where("a"), CacheLocation::kHost);
  EXPECT_TRUE(tiers->Put(Image("c", 40)));  // a goes
  EXPECT_EQ(tiers->Where("a"), CacheLocation::kNone);
  EXPECT_EQ(tiers->Where("b"), CacheLocation::kHost);
  SessionTierStats st = tiers->Stats();
  EXPECT_EQ(st.host_sessions, 2);
  EXPECT_LE(st.host_bytes, 100 << 10);
  EXPECT_EQ(st.dropped_total, 1);
  EXPECT_EQ(st.stored_total, 3);

  absl::StatusOr<SessionImage> b = tiers->Take("b");
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectSame(*b, Image("b", 40));
  EXPECT_EQ(tiers->Take("b").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tiers->Take("a").status().code(), absl::StatusCode::kNotFound);
  // Larger than every tier: nothing kept.
  EXPECT_FALSE(tiers->Put(Image("huge", 200)));
  EXPECT_EQ(tiers->Where("huge"), CacheLocation::kNone);
  st = tiers->Stats();
  EXPECT_EQ(st.host_sessions, 1);
  EXPECT_EQ(st.restored_host_total, 1);
}

TEST(SessionTiersTest, PutReplacesAndEraseForgets) {
  auto tiers = MakeTiers(100);
  ASSERT_NE(tiers, nullptr);
  EXPECT_TRUE(tiers->Put(Image("a", 10)));
  SessionImage newer = Image("a", 20);
  newer.cached = 4;
  EXPECT_TRUE(tiers->Put(newer));
  EXPECT_EQ(tiers->Stats().host_sessions, 1);
  EXPECT_EQ(tiers->Stats().dropped_total, 0);
  absl::StatusOr<SessionImage> got = tiers->Get("a");
  ASSERT_TRUE(got.ok());
  ExpectSame(*got, newer);
  tiers->Erase("a");
  tiers->Erase("never");
  EXPECT_EQ(tiers->Where("a"), CacheLocation::kNone);
  const SessionTierStats st = tiers->Stats();
  EXPECT_EQ(st.host_sessions, 0);
  EXPECT_EQ(st.host_bytes, 0);
  EXPECT_EQ(st.dropped_total, 0);
}

TEST(SessionTiersTest, LeastRecentSpillToDiskAndComeBackBitwise) {
  TempDir tmp("tiers");
  const std::string dir = tmp.path() + "/tier";
  {
    auto tiers = MakeTiers(/*host_kib=*/100, dir, /*disk_kib=*/10'000);
    ASSERT_NE(tiers, nullptr);
    for (const char* id : {"a", "b", "c", "d"}) EXPECT_TRUE(tiers->Put(Image(id, 40)));
    tiers->Flush();
    // The two least recent went to disk, one file each.
    EXPECT_EQ(tiers->Where("a"), CacheLocation::kDisk);
    EXPECT_EQ(tiers->Where("b"), CacheLocation::kDisk);
    EXPECT_EQ(tiers->Where("c"), CacheLocation::kHost);
    EXPECT_EQ(FilesIn(dir), (std::vector<std::string>{"a.session", "b.session"}));
    SessionTierStats st = tiers->Stats();
    EXPECT_EQ(st.host_sessions, 2);
    EXPECT_EQ(st.disk_sessions, 2);
    EXPECT_EQ(st.spilled_total, 2);
    EXPECT_GT(st.disk_bytes, 0);
    EXPECT_EQ(st.dropped_total, 0);

    absl::StatusOr<SessionImage> copy = tiers->Get("a");  // an export: the entry stays
    ASSERT_TRUE(copy.ok()) << copy.status();
    ExpectSame(*copy, Image("a", 40));
    EXPECT_EQ(tiers->Where("a"), CacheLocation::kDisk);

    absl::StatusOr<SessionImage> a = tiers->Take("a");
    ASSERT_TRUE(a.ok()) << a.status();
    ExpectSame(*a, Image("a", 40));
    EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"b.session"});
    tiers->Erase("b");
    tiers->Flush();
    EXPECT_TRUE(FilesIn(dir).empty());
    st = tiers->Stats();
    EXPECT_EQ(st.disk_sessions, 0);
    EXPECT_EQ(st.disk_bytes, 0);
    EXPECT_EQ(st.restored_disk_total, 1);

    EXPECT_TRUE(tiers->Put(Image("e", 40)));
    EXPECT_TRUE(tiers->Put(Image("f", 40)));
    tiers->Flush();
    EXPECT_FALSE(FilesIn(dir).empty());
  }
  // The tiers took their files with them.
  EXPECT_TRUE(FilesIn(tmp.path()).empty());
}

TEST(SessionTiersTest, DiskTierDropsItsLeastRecentAtItsCap) {
  TempDir tmp("tiers");
  const std::string dir = tmp.path() + "/tier";
  // No host tier: every image goes straight to disk; the cap holds one 4 KiB file, not two.
  auto tiers = MakeTiers(/*host_kib=*/0, dir, /*disk_kib=*/6);
  ASSERT_NE(tiers, nullptr);
  EXPECT_TRUE(tiers->Put(Image("a", 4)));
  tiers->Flush();
  EXPECT_EQ(tiers->Where("a"), CacheLocation::kDisk);
  EXPECT_TRUE(tiers->Put(Image("b", 4)));
  tiers->Flush();
  EXPECT_EQ(tiers->Where("a"), CacheLocation::kNone);
  EXPECT_EQ(tiers->Where("b"), CacheLocation::kDisk);
  const SessionTierStats st = tiers->Stats();
  EXPECT_EQ(st.dropped_total, 1);
  EXPECT_EQ(st.disk_sessions, 1);
  EXPECT_LE(st.disk_bytes, 6 << 10);
  EXPECT_EQ(st.host_bytes, 0);
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"b.session"});
  // Larger than the disk tier: written, then given up.
  EXPECT_TRUE(tiers->Put(Image("c", 8)));
  tiers->Flush();
  EXPECT_EQ(tiers->Where("c"), CacheLocation::kNone);
  EXPECT_EQ(tiers->Where("b"), CacheLocation::kNone);
  EXPECT_TRUE(FilesIn(dir).empty());
}

TEST(SessionTiersTest, DamagedFileIsRefusedAndForgotten) {
  TempDir tmp("tiers");
  const std::string dir = tmp.path() + "/tier";
  auto tiers = MakeTiers(0, dir, 10'000);
  ASSERT_NE(tiers, nullptr);
  EXPECT_TRUE(tiers->Put(Image("a", 40)));
  tiers->Flush();
  ASSERT_EQ(tiers->Where("a"), CacheLocation::kDisk);
  {
    std::fstream f(dir + "/a.session", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  absl::StatusOr<SessionImage> a = tiers->Take("a");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kDataLoss) << a.status();
  EXPECT_EQ(tiers->Where("a"), CacheLocation::kNone);
  EXPECT_EQ(tiers->Stats().errors_total, 1);
  EXPECT_TRUE(FilesIn(dir).empty());
}

TEST(SessionTiersTest, StartEmptiesTheDirectoryAndRefusesBadOptions) {
  TempDir tmp("tiers");
  const std::string dir = tmp.path() + "/tier";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/stale.session") << "left by a crash";
  std::ofstream(dir + "/other.txt") << "not ours";
  auto tiers = MakeTiers(0, dir, 10'000);
  ASSERT_NE(tiers, nullptr);
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"other.txt"});

  EXPECT_EQ(SessionTiers::Create({.host_bytes = -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(SessionTiers::Create({.disk_dir = "/proc/no/such", .disk_bytes = 1}).ok());
}

}  // namespace
}  // namespace subspace
