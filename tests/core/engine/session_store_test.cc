// SessionStore's access rules and its ids: a session is found and listed only for its owner,
// and made ids are 128 bits from the CSPRNG (32 lowercase hex digits, every bit in play).
#include "core/engine/session_store.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/base/random_id.h"
#include "gtest/gtest.h"

namespace subspace {
namespace {

TEST(SessionStoreTest, OnlyTheOwnerFindsOrListsASession) {
  SessionStore store(/*max_sessions=*/8, absl::Minutes(1));
  const absl::Time now = absl::Now();
  absl::StatusOr<Session*> a = store.Create(absl::ZeroDuration(), now, {}, "owner-a");
  absl::StatusOr<Session*> anonymous = store.Create(absl::ZeroDuration(), now);
  ASSERT_TRUE(a.ok() && anonymous.ok());
  const std::string a_id = (*a)->id;
  const std::string anonymous_id = (*anonymous)->id;

  EXPECT_EQ(store.FindOwned(a_id, "owner-a", now), *a);
  EXPECT_EQ(store.FindOwned(a_id, "owner-b", now), nullptr);
  EXPECT_EQ(store.FindOwned(a_id, "", now), nullptr);
  EXPECT_EQ(store.FindOwned(anonymous_id, "", now), *anonymous);
  EXPECT_EQ(store.FindOwned(anonymous_id, "owner-a", now), nullptr);
  // The engine's own bookkeeping sees every session.
  EXPECT_EQ(store.Find(a_id, now), *a);

  const std::vector<SessionInfo> listed = store.List("owner-a", now);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].id, a_id);
  EXPECT_EQ(store.List("", now).size(), 1u);
  EXPECT_TRUE(store.List("owner-b", now).empty());

  // An id is one namespace: a proposed id taken by anyone is taken.
  EXPECT_EQ(store.Create(absl::ZeroDuration(), now, a_id, "owner-b").status().code(),
            absl::StatusCode::kAlreadyExists);
  // Expired sessions are found by nobody.
  EXPECT_EQ(store.FindOwned(a_id, "owner-a", now + absl::Minutes(2)), nullptr);
}

TEST(SessionStoreTest, IdsAre128RandomBits) {
  constexpr int kIds = 4096;
  absl::flat_hash_set<std::string> seen;
  std::array<int, 128> ones{};  // per bit position, how many ids have it set
  for (int i = 0; i < kIds; ++i) {
    absl::StatusOr<std::string> id = NewSessionId();
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_EQ(id->size(), 32u) << *id;
    for (size_t c = 0; c < id->size(); ++c) {
      const char ch = (*id)[c];
      ASSERT_TRUE((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f')) << *id;
      const int nibble = ch <= '9' ? ch - '0' : ch - 'a' + 10;
      for (int b = 0; b < 4; ++b) ones[4 * c + b] += (nibble >> b) & 1;
    }
    EXPECT_TRUE(seen.insert(*id).second) << "repeated id " << *id;
  }
  // Each bit is a fair coin: over 4096 ids its count has a standard deviation of 32, so the
  // bounds below are 12 deviations out -- a stuck or biased bit fails, chance never does.
  for (int b = 0; b < 128; ++b) {
    EXPECT_GT(ones[b], kIds / 2 - 400) << "bit " << b;
    EXPECT_LT(ones[b], kIds / 2 + 400) << "bit " << b;
  }
  // The store uses the same generator when no id is proposed.
  SessionStore store(/*max_sessions=*/1, absl::Minutes(1));
  absl::StatusOr<Session*> made = store.Create(absl::ZeroDuration(), absl::Now());
  ASSERT_TRUE(made.ok());
  EXPECT_EQ((*made)->id.size(), 32u);
}

}  // namespace
}  // namespace subspace
