// Positions at the int32 limits: arithmetic near INT32_MAX in every operation.
#include <climits>
#include <cstdint>
#include <optional>
#include <vector>

#include "cache/cache.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendTokens;
using testutil::Chunked;
using testutil::Full;
using testutil::Group;
using testutil::Ids;
using testutil::ReadPayload;
using testutil::SameBytes;
using testutil::Sliding;
using testutil::Spec;
using testutil::TestCache;

using Lists = std::vector<std::vector<int32_t>>;
constexpr int32_t kMax = INT32_MAX;

class LimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Full, sliding (window 5, memory 5) and chunked (chunk 7) groups; one sequence.
    spec_ = Spec(DType::kF32, 1, 64, 4, {Group(Full()), Group(Sliding(5)), Group(Chunked(7))});
    tc_.emplace(spec_);
    ASSERT_NE(tc_->cache, nullptr);
    ASSERT_TRUE(AppendTokens(cache(), {{0, 3}, {0, kMax - 9}, {0, kMax - 2}, {0, kMax - 1}}).ok());
  }
  Cache& cache() { return *tc_->cache; }
  CacheSpec spec_;
  std::optional<TestCache> tc_;
};

TEST_F(LimitsTest, StoredAndRead) {
  // The in-batch pruning bound 3 - 5 drops nothing.
  const std::vector<int32_t> all = {3, kMax - 9, kMax - 2, kMax - 1};
  absl::StatusOr<ReadResult> read = cache().Read(0, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions, (Lists{all, all, all}));
  EXPECT_TRUE(
      SameBytes(ReadPayload(spec_, {Ids(0, all), Ids(0, all), Ids(0, all)}), read->payload));
  read = cache().Read(0, kMax - 1, kMax);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions, (Lists{{kMax - 1}, {kMax - 1}, {kMax - 1}}));
  read = cache().Read(0, kMax, kMax);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions, (Lists{{}, {}, {}}));
  ASSERT_EQ(cache().ListSequences().size(), 1u);
  EXPECT_EQ(cache().ListSequences()[0].offset, kMax);
}

TEST_F(LimitsTest, VisibleAtTheLargestPosition) {
  const std::vector<Query> q = {Query{0, kMax, false}, Query{0, kMax - 2, false},
                                Query{0, 4, true}};
  absl::StatusOr<Lists> full = cache().Visible(0, q);
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(*full, (Lists{{3, kMax - 9, kMax - 2, kMax - 1},
                          {3, kMax - 9, kMax - 2},
                          {3, kMax - 9, kMax - 2, kMax - 1}}));
  absl::StatusOr<Lists> sliding = cache().Visible(1, q);
  ASSERT_TRUE(sliding.ok());
  EXPECT_EQ(*sliding, (Lists{{kMax - 2, kMax - 1}, {kMax - 2}, {3, kMax - 9, kMax - 2, kMax - 1}}));
  // INT32_MAX = 7 * 306783378 + 1: the last chunk starts at INT32_MAX - 1.
  absl::StatusOr<Lists> chunked = cache().Visible(2, q);
  ASSERT_TRUE(chunked.ok());
  // INT32_MAX - 2 is in the chunk starting at INT32_MAX - 8, which INT32_MAX - 9 is not.
  EXPECT_EQ(*chunked, (Lists{{kMax - 1}, {kMax - 2}, {3, kMax - 9, kMax - 2, kMax - 1}}));
}

TEST_F(LimitsTest, CanResumeAtTheLargestPosition) {
  // Sliding: first = 3, last = INT32_MAX - 1; max(0, pos - 5) >= 3 and pos <= INT32_MAX.
  absl::StatusOr<bool> r = cache().CanResume(0, kMax);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(*r);
  r = cache().CanResume(0, 7);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(*r);
  r = cache().CanResume(0, 8);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(*r);
}

TEST_F(LimitsTest, RemoveNearTheLimit) {
  ASSERT_TRUE(cache().Remove(0, kMax - 2, kMax).ok());  // nothing moves: a truncation
  EXPECT_EQ(testutil::StoredPositions(cache(), 0),
            (Lists{{3, kMax - 9}, {3, kMax - 9}, {3, kMax - 9}}));
  ASSERT_TRUE(cache().Remove(0, kMax, std::nullopt).ok());
  ASSERT_TRUE(cache().Remove(0, 4, std::nullopt).ok());
  EXPECT_EQ(testutil::StoredPositions(cache(), 0), (Lists{{3}, {3}, {3}}));
}

// A sequence's offset (one past its largest position) is an int32, so the largest position a
// sequence can store is INT32_MAX - 1 (interpretation: storing INT32_MAX would leave
// ListSequences an offset it cannot represent).
TEST(LimitsOffsetTest, PositionInt32MaxIsRejected) {
  const CacheSpec spec = Spec(DType::kF16, 1, 16, 4, {Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  EXPECT_EQ(AppendTokens(cache, {{0, kMax}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Usage().sequences_live, 0);
}

}  // namespace
}  // namespace kvmesh
