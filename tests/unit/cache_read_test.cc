// Cache::Read: byte-exact ranges, per-group headers when a sliding group keeps fewer positions,
// and its errors.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::AppendTokens;
using testutil::CacheState;
using testutil::CaptureState;
using testutil::Full;
using testutil::Group;
using testutil::Ids;
using testutil::Range;
using testutil::ReadPayload;
using testutil::SameBytes;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;
using testutil::TestCache;

using Positions = std::vector<std::vector<int32_t>>;

class ReadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = Spec(DType::kF16, 2, 32, 8, {Group(Full(), 2, 3, 4, 2)});
    tc_.emplace(spec_);
    ASSERT_NE(tc_->cache, nullptr);
    ASSERT_TRUE(AppendRange(cache(), 0, 0, 8).ok());
    ASSERT_TRUE(AppendRange(cache(), 0, 8, 10).ok());
    ASSERT_TRUE(AppendRange(cache(), 1, 0, 3).ok());
  }
  Cache& cache() { return *tc_->cache; }

  void ExpectRead(int64_t seq, int32_t begin, std::optional<int32_t> end,
                  const std::vector<int32_t>& positions) {
    absl::StatusOr<ReadResult> read = cache().Read(seq, begin, end);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->positions, (Positions{positions}));
    EXPECT_TRUE(SameBytes(ReadPayload(spec_, {Ids(seq, positions)}), read->payload));
  }

  CacheSpec spec_;
  std::optional<TestCache> tc_;
};

TEST_F(ReadTest, WholeSequence) {
  ExpectRead(0, 0, std::nullopt, Range(0, 10));
  ExpectRead(1, 0, std::nullopt, Range(0, 3));
}

TEST_F(ReadTest, HalfOpenRanges) {
  ExpectRead(0, 3, 7, Range(3, 7));
  ExpectRead(0, 8, std::nullopt, {8, 9});
  ExpectRead(0, 0, 100, Range(0, 10));
  ExpectRead(0, 9, 10, {9});
}

// The admission check sees the payload's size before it is allocated; its error is the Read's.
TEST_F(ReadTest, AdmitSeesThePayloadSizeFirst) {
  size_t admitted = 0;
  absl::StatusOr<ReadResult> read = cache().Read(0, 3, 7, [&](size_t bytes) {
    admitted = bytes;
    return absl::OkStatus();
  });
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(admitted, read->payload.size());
  EXPECT_GT(admitted, 0u);
  read = cache().Read(0, 0, std::nullopt, [](size_t bytes) {
    return absl::ResourceExhaustedError(std::to_string(bytes));
  });
  EXPECT_EQ(read.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(read.status().message(), std::to_string(10 * admitted / 4));
}

// A live sequence with nothing in the range reads as an empty result, not an error.
TEST_F(ReadTest, EmptyRangeOfALiveSequence) {
  ExpectRead(0, 20, std::nullopt, {});
  ExpectRead(0, 5, 5, {});
}

TEST_F(ReadTest, Errors) {
  const CacheState before = CaptureState(cache());
  EXPECT_EQ(cache().Read(2, 0, std::nullopt).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache().Read(0, -1, std::nullopt).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().Read(0, 5, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().Read(-1, 0, std::nullopt).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
}

TEST_F(ReadTest, SequenceEmptiedByRemoveIsNotFound) {
  ASSERT_TRUE(cache().Remove(1, 0, std::nullopt).ok());
  EXPECT_EQ(cache().Read(1, 0, std::nullopt).status().code(), absl::StatusCode::kNotFound);
  ExpectRead(0, 0, std::nullopt, Range(0, 10));
}

// A sliding group keeps only its memory, so the header lists positions per group and the payload
// holds each group's own number of rows.
TEST(ReadGroupsTest, SlidingGroupReturnsFewerPositions) {
  // window 2, one sequence: memory 2, 2 + 4 cells.
  const CacheSpec spec =
      Spec(DType::kF32, 1, 64, 4, {Group(Full(), 2, 1, 4, 2), Group(Sliding(2), 3, 2, 2, 4)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 4, 6).ok());  // sliding drops < 4 - 2
  absl::StatusOr<ReadResult> read = cache.Read(0, 0, std::nullopt);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->positions, (Positions{Range(0, 6), Range(2, 6)}));
  EXPECT_TRUE(
      SameBytes(ReadPayload(spec, {Ids(0, Range(0, 6)), Ids(0, Range(2, 6))}), read->payload));

  read = cache.Read(0, 1, 4);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->positions, (Positions{{1, 2, 3}, {2, 3}}));
  EXPECT_TRUE(SameBytes(ReadPayload(spec, {Ids(0, {1, 2, 3}), Ids(0, {2, 3})}), read->payload));

  // A range only the full group still holds: the sliding group returns no rows.
  read = cache.Read(0, 0, 2);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->positions, (Positions{{0, 1}, {}}));
  EXPECT_TRUE(SameBytes(ReadPayload(spec, {Ids(0, {0, 1}), {}}), read->payload));
}

TEST(ReadGroupsTest, HolesAreSkipped) {
  const CacheSpec spec = Spec(DType::kBF16, 1, 64, 4, {Group(Full(), 1, 2, 2, 2)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  ASSERT_TRUE(AppendTokens(*tc.cache, {{0, 1}, {0, 5}, {0, 9}}).ok());
  absl::StatusOr<ReadResult> read = tc.cache->Read(0, 2, 9);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions, (Positions{{5}}));
  EXPECT_TRUE(SameBytes(ReadPayload(spec, {Ids(0, {5})}), read->payload));
}

}  // namespace
}  // namespace kvmesh
