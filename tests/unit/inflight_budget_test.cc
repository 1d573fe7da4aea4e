// InflightBudget's tenant shares (--inflight-tenant-share): no tenant holds more than its share,
// so another tenant's request still fits while one holds all it may; and RequestGate's
// FirstNonUtf8Field, which names the field of a request that does not parse for its UTF-8.
#include "service/inflight_budget.h"

#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/request_gate.h"

namespace kvmesh {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;

TEST(InflightBudgetTest, ATenantHoldsAtMostItsShare) {
  InflightBudget budget(100 * kMiB, "--inflight-budget", 0.5);
  EXPECT_EQ(budget.tenant_capacity(), 50 * kMiB);
  // Three slow streams of one tenant, 30 MiB each: the third does not fit its share.
  absl::StatusOr<InflightBudget::Reservation> a = budget.Reserve("mallory", 30 * kMiB, "stream 1");
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<InflightBudget::Reservation> b = budget.Reserve("mallory", 20 * kMiB, "stream 2");
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<InflightBudget::Reservation> c = budget.Reserve("mallory", 30 * kMiB, "stream 3");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(c.status().message(), HasSubstr("tenant 'mallory' holds 52428800"));
  EXPECT_THAT(c.status().message(), HasSubstr("--inflight-tenant-share"));
  EXPECT_EQ(budget.TenantHeld("mallory"), 50 * kMiB);
  EXPECT_EQ(budget.held(), 50 * kMiB);
  // Another tenant's 8 MiB Append still fits.
  absl::StatusOr<InflightBudget::Reservation> d = budget.Reserve("alice", 8 * kMiB, "Append");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(budget.held(), 58 * kMiB);
  // Growing past the share fails and leaves the reservation as it was.
  absl::Status grown = a->Resize(40 * kMiB, "stream 1 grows");
  EXPECT_EQ(grown.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(a->bytes(), 30 * kMiB);
  EXPECT_EQ(budget.TenantHeld("mallory"), 50 * kMiB);
  // Shrinking gives the bytes back to the tenant and the budget.
  ASSERT_TRUE(a->Resize(10 * kMiB, "stream 1 shrinks").ok());
  EXPECT_EQ(budget.TenantHeld("mallory"), 30 * kMiB);
  *a = InflightBudget::Reservation();
  *b = InflightBudget::Reservation();
  *d = InflightBudget::Reservation();
  EXPECT_EQ(budget.held(), 0u);
  EXPECT_EQ(budget.TenantHeld("mallory"), 0u);
  EXPECT_EQ(budget.TenantHeld("alice"), 0u);
}

TEST(InflightBudgetTest, MoreThanAShareIsNeverServed) {
  InflightBudget budget(100 * kMiB, "--inflight-budget", 0.25);
  absl::StatusOr<InflightBudget::Reservation> r = budget.Reserve("t", 26 * kMiB, "Append");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("more than a tenant's share"));
  EXPECT_EQ(budget.held(), 0u);
  EXPECT_EQ(budget.refused(), 1u);
}

// A reservation that grows past a whole share (a buffered AppendStream's payload) can never be
// served: it says so, naming all it would hold, rather than "retry later".
TEST(InflightBudgetTest, GrowingPastAWholeShareIsNeverServed) {
  InflightBudget budget(100 * kMiB, "--inflight-budget", 0.5);
  absl::StatusOr<InflightBudget::Reservation> r = budget.Reserve("t", kMiB, "stream header");
  ASSERT_TRUE(r.ok()) << r.status();
  const absl::Status grown = r->Resize(60 * kMiB, "AppendStream of 62914560 bytes");
  EXPECT_EQ(grown.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(grown.message(), HasSubstr("needs 62914560 bytes in flight, more than a tenant's"));
  EXPECT_THAT(grown.message(), HasSubstr("send it in smaller requests"));
  EXPECT_EQ(r->bytes(), kMiB);
  EXPECT_EQ(budget.TenantHeld("t"), kMiB);
  EXPECT_EQ(budget.held(), kMiB);
}

TEST(InflightBudgetTest, TheBudgetStillBoundsEveryTenantTogether) {
  InflightBudget budget(100 * kMiB, "--inflight-budget", 0.5);
  std::vector<InflightBudget::Reservation> held;
  for (const char* tenant : {"a", "b"}) {
    absl::StatusOr<InflightBudget::Reservation> r = budget.Reserve(tenant, 50 * kMiB, "x");
    ASSERT_TRUE(r.ok()) << r.status();
    held.push_back(*std::move(r));
  }
  absl::StatusOr<InflightBudget::Reservation> r = budget.Reserve("c", kMiB, "x");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("other requests hold"));
  // The refused tenant's share is untouched.
  EXPECT_EQ(budget.TenantHeld("c"), 0u);
  // Without a tenant (node-internal work) only the budget counts.
  held.clear();
  absl::StatusOr<InflightBudget::Reservation> internal = budget.Reserve(80 * kMiB, "internal");
  EXPECT_TRUE(internal.ok()) << internal.status();
}

TEST(InflightBudgetTest, ShareOfOneIsTheWholeBudget) {
  InflightBudget budget(10 * kMiB, "--inflight-budget", 1.0);
  absl::StatusOr<InflightBudget::Reservation> r = budget.Reserve("t", 10 * kMiB, "x");
  EXPECT_TRUE(r.ok()) << r.status();
}

// A string field `number` of `bytes`, as the wire has it.
std::string StringField(int number, const std::string& bytes) {
  std::string out;
  out.push_back(static_cast<char>(number << 3 | 2));
  out.push_back(static_cast<char>(bytes.size()));
  out += bytes;
  return out;
}

TEST(FirstNonUtf8FieldTest, NamesTheField) {
  EXPECT_EQ(FirstNonUtf8Field(v1::GetCacheRequest::descriptor(), StringField(1, "\xff\xfe")),
            "cache");
  EXPECT_EQ(FirstNonUtf8Field(v1::GetCacheRequest::descriptor(), StringField(1, "caf\xc3\xa9")),
            "");
  // Overlong and surrogate forms are not UTF-8 either.
  EXPECT_EQ(FirstNonUtf8Field(v1::GetCacheRequest::descriptor(), StringField(1, "\xc0\xaf")),
            "cache");
  EXPECT_EQ(FirstNonUtf8Field(v1::GetCacheRequest::descriptor(), StringField(1, "\xed\xa0\x80")),
            "cache");
  // A nested one: CreateCacheRequest.spec (field 1) . name (field 1).
  v1::CreateCacheRequest request;
  const int spec_field = v1::CreateCacheRequest::descriptor()->FindFieldByName("spec")->number();
  const int name_field = v1::CacheSpec::descriptor()->FindFieldByName("name")->number();
  EXPECT_EQ(FirstNonUtf8Field(v1::CreateCacheRequest::descriptor(),
                              StringField(spec_field, StringField(name_field, "a\x80z"))),
            "spec.name");
  // Bytes that are not a message at all name nothing.
  EXPECT_EQ(FirstNonUtf8Field(v1::GetCacheRequest::descriptor(), "\x0a\x7f"), "");
}

}  // namespace
}  // namespace kvmesh
