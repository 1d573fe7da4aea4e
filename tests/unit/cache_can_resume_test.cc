// Cache::CanResume: the seed's rule, AND over groups.
#include <cstdint>
#include <optional>
#include <vector>

#include "cache/cache.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::Full;
using testutil::Group;
using testutil::Range;
using testutil::Sliding;
using testutil::Spec;
using testutil::StoredPositions;
using testutil::TestCache;

using Positions = std::vector<std::vector<int32_t>>;

bool Resume(const Cache& cache, int64_t seq, int32_t pos) {
  absl::StatusOr<bool> r = cache.CanResume(seq, pos);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() && *r;
}

// Appends 0..9 in batches [0,4), [4,8), [8,10).
void AppendTen(Cache& cache, int64_t seq) {
  ASSERT_TRUE(AppendRange(cache, seq, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, seq, 4, 8).ok());
  ASSERT_TRUE(AppendRange(cache, seq, 8, 10).ok());
}

TEST(CanResumeTest, SlidingWindowEdges) {
  // window 4, one sequence: memory 4.
  TestCache tc(Spec(DType::kF16, 1, 100, 4, {Group(Sliding(4))}));
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  AppendTen(cache, 0);
  ASSERT_EQ(StoredPositions(cache, 0), (Positions{Range(4, 10)}));  // first 4, last 9
  // true iff max(0, pos - 4) >= 4 and pos <= 10.
  EXPECT_FALSE(Resume(cache, 0, 0));
  EXPECT_FALSE(Resume(cache, 0, 7));
  EXPECT_TRUE(Resume(cache, 0, 8));
  EXPECT_TRUE(Resume(cache, 0, 9));
  EXPECT_TRUE(Resume(cache, 0, 10));
  EXPECT_FALSE(Resume(cache, 0, 11));
}

TEST(CanResumeTest, ShortSequenceWindowStartClampsAtZero) {
  TestCache tc(Spec(DType::kF16, 1, 100, 4, {Group(Sliding(4))}));
  ASSERT_NE(tc.cache, nullptr);
  ASSERT_TRUE(AppendRange(*tc.cache, 0, 0, 3).ok());
  for (int32_t pos = 0; pos <= 3; ++pos) EXPECT_TRUE(Resume(*tc.cache, 0, pos)) << pos;
  EXPECT_FALSE(Resume(*tc.cache, 0, 4));
}

TEST(CanResumeTest, SequenceWithNothingStoredCannotResumeInASlidingGroup) {
  TestCache tc(Spec(DType::kF16, 2, 100, 4, {Group(Sliding(4))}));
  ASSERT_NE(tc.cache, nullptr);
  EXPECT_FALSE(Resume(*tc.cache, 3, 0));
  ASSERT_TRUE(AppendRange(*tc.cache, 0, 0, 2).ok());
  EXPECT_FALSE(Resume(*tc.cache, 3, 0));
}

// With parallel sequences memory is window + 1, so one more position is kept and a resume one
// position earlier is possible.
TEST(CanResumeTest, ParallelSequencesKeepWindowPlusOne) {
  TestCache tc(Spec(DType::kF16, 2, 100, 4, {Group(Sliding(4))}));
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_EQ(cache.Usage().groups[0].memory, 5);
  AppendTen(cache, 0);
  ASSERT_EQ(StoredPositions(cache, 0), (Positions{Range(3, 10)}));
  EXPECT_FALSE(Resume(cache, 0, 6));
  EXPECT_TRUE(Resume(cache, 0, 7));
  EXPECT_TRUE(Resume(cache, 0, 10));
  EXPECT_FALSE(Resume(cache, 0, 11));
}

TEST(CanResumeTest, UnlimitedMemoryAlwaysResumes) {
  for (const CacheSpec& spec :
       {Spec(DType::kF16, 2, 16, 4, {Group(Full())}),
        Spec(DType::kF16, 2, 16, 4, {Group(Sliding(4, 16))}),  // memory >= capacity
        Spec(DType::kF16, 2, 16, 4, {Group(Sliding(15))})}) {  // raised to 16 >= capacity
    TestCache tc(spec);
    ASSERT_NE(tc.cache, nullptr);
    ASSERT_EQ(tc.cache->Usage().groups[0].memory, kUnlimitedMemory);
    EXPECT_TRUE(Resume(*tc.cache, 5, 0));
    EXPECT_TRUE(Resume(*tc.cache, 5, 1000));
    ASSERT_TRUE(AppendRange(*tc.cache, 0, 0, 4).ok());
    ASSERT_TRUE(AppendRange(*tc.cache, 0, 4, 8).ok());
    ASSERT_TRUE(AppendRange(*tc.cache, 0, 8, 12).ok());
    EXPECT_TRUE(Resume(*tc.cache, 0, 0));
    EXPECT_TRUE(Resume(*tc.cache, 0, 12));
    EXPECT_TRUE(Resume(*tc.cache, 0, 500));
  }
}

TEST(CanResumeTest, AndOverGroups) {
  TestCache tc(Spec(DType::kF16, 1, 100, 4, {Group(Full()), Group(Sliding(4))}));
  ASSERT_NE(tc.cache, nullptr);
  AppendTen(*tc.cache, 0);
  EXPECT_FALSE(Resume(*tc.cache, 0, 7));
  EXPECT_TRUE(Resume(*tc.cache, 0, 8));
  EXPECT_FALSE(Resume(*tc.cache, 0, 11));
  EXPECT_FALSE(Resume(*tc.cache, 1, 0));
}

TEST(CanResumeTest, NegativeArguments) {
  TestCache tc(Spec(DType::kF16, 1, 100, 4, {Group(Sliding(4))}));
  ASSERT_NE(tc.cache, nullptr);
  EXPECT_EQ(tc.cache->CanResume(-1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tc.cache->CanResume(0, -1).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvmesh
