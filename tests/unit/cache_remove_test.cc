// Cache::Remove: truncation, middle removal with position shift and RoPE re-rotation (checked
// against the float64 reference), copy-before-shift of shared cells, and its errors.
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
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
using testutil::ExpectedRow;
using testutil::Full;
using testutil::Group;
using testutil::Ids;
using testutil::MatchesRows;
using testutil::Range;
using testutil::ReadPayload;
using testutil::Rope;
using testutil::SameBytes;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;
using testutil::StoredPositions;
using testutil::TestCache;
using testutil::TokenId;
using testutil::Unshifted;

using Positions = std::vector<std::vector<int32_t>>;

// Rows of seq at the original positions `from`, shifted by delta through `shifts` shifts.
std::vector<ExpectedRow> Shifted(int64_t seq, const std::vector<int32_t>& from, int64_t delta,
                                 int shifts) {
  std::vector<ExpectedRow> rows;
  for (int32_t p : from) rows.push_back(ExpectedRow{TokenId(seq, p), delta, shifts});
  return rows;
}

std::vector<ExpectedRow> Concat(std::vector<ExpectedRow> a, const std::vector<ExpectedRow>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

::testing::AssertionResult ReadMatches(const Cache& cache, int64_t seq, const Positions& positions,
                                       const std::vector<std::vector<ExpectedRow>>& rows) {
  absl::StatusOr<ReadResult> read = cache.Read(seq, 0, std::nullopt);
  if (!read.ok()) return ::testing::AssertionFailure() << read.status();
  if (read->positions != positions) {
    return ::testing::AssertionFailure()
           << "positions differ, group 0: " << testutil::ToString(read->positions[0]);
  }
  return MatchesRows(cache.spec(), read->payload, rows);
}

TEST(RemoveTest, TruncateDropsTheTail) {
  const CacheSpec spec = Spec(DType::kF16, 2, 32, 16, {Group(Full(), 2, 2, 4, 2)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  ASSERT_TRUE(cache.Remove(0, 5, std::nullopt).ok());
  absl::StatusOr<ReadResult> read = cache.Read(0, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions, (Positions{Range(0, 5)}));
  EXPECT_TRUE(SameBytes(ReadPayload(spec, {Ids(0, Range(0, 5))}), read->payload));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 5);
  ASSERT_EQ(cache.ListSequences().size(), 1u);
  EXPECT_EQ(cache.ListSequences()[0].offset, 5);
  // The freed positions can be appended again.
  ASSERT_TRUE(AppendRange(cache, 0, 5, 7, /*salt=*/3).ok());
  EXPECT_EQ(StoredPositions(cache, 0), (Positions{Range(0, 7)}));
}

TEST(RemoveTest, TruncateFromZeroEndsTheSequence) {
  const CacheSpec spec = Spec(DType::kF16, 2, 32, 16, {Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 2).ok());
  ASSERT_TRUE(cache.Remove(0, 0, std::nullopt).ok());
  EXPECT_EQ(cache.Read(0, 0, std::nullopt).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache.Usage().sequences_live, 1);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 2);
  ASSERT_EQ(cache.ListSequences().size(), 1u);
  EXPECT_EQ(cache.ListSequences()[0].seq, 1);
}

// [begin, end) reaching past the last position moves nothing, so it is a truncation even in a
// group without RoPE (interpretation of "positions would move in a group with rope NONE").
TEST(RemoveTest, RangeCoveringTheTailIsATruncateWithoutRope) {
  const CacheSpec spec = Spec(DType::kF16, 2, 32, 16, {Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  ASSERT_TRUE(cache.Remove(0, 6, 100).ok());
  EXPECT_EQ(StoredPositions(cache, 0), (Positions{Range(0, 6)}));
  ASSERT_TRUE(cache.Remove(0, 4, 6).ok());  // end == offset: nothing at or after 6
  EXPECT_EQ(StoredPositions(cache, 0), (Positions{Range(0, 4)}));
}

using RopeParam = std::tuple<RopeType, DType>;

std::string RopeParamName(const ::testing::TestParamInfo<RopeParam>& info) {
  const auto [type, dtype] = info.param;
  std::string name = type == RopeType::kNormal ? "Normal" : "Neox";
  name += dtype == DType::kF32 ? "F32" : dtype == DType::kF16 ? "F16" : "BF16";
  return name;
}

class RemoveRopeTest : public ::testing::TestWithParam<RopeParam> {
 protected:
  void SetUp() override {
    const auto [type, dtype] = GetParam();
    // 2 layers, 2 heads, head_dim_k 8 with 6 rotated elements, head_dim_v 4.
    spec_ = Spec(dtype, 2, 32, 16, {Group(Full(), 2, 2, 8, 4, Rope(type, 6, 10000.0f, 1.0f))});
    tc_.emplace(spec_);
    ASSERT_NE(tc_->cache, nullptr);
    ASSERT_TRUE(AppendRange(cache(), 0, 0, 10).ok());
  }
  Cache& cache() { return *tc_->cache; }

  CacheSpec spec_;
  std::optional<TestCache> tc_;
};

TEST_P(RemoveRopeTest, MiddleRemovalShiftsAndRotatesLaterKeys) {
  ASSERT_TRUE(cache().Remove(0, 3, 5).ok());
  EXPECT_TRUE(ReadMatches(cache(), 0, {Range(0, 8)},
                          {Concat(Unshifted(0, {0, 1, 2}), Shifted(0, Range(5, 10), -2, 1))}));
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 8);
  ASSERT_EQ(cache().ListSequences().size(), 1u);
  EXPECT_EQ(cache().ListSequences()[0].offset, 8);
  absl::StatusOr<std::vector<std::vector<int32_t>>> v = cache().Visible(0, {Query{0, 4, false}});
  ASSERT_TRUE(v.ok());
  EXPECT_EQ((*v)[0], Range(0, 5));
  // The sequence continues at its new offset.
  ASSERT_TRUE(AppendRange(cache(), 0, 8, 9, /*salt=*/5).ok());
}

TEST_P(RemoveRopeTest, RemovalsAccumulate) {
  ASSERT_TRUE(cache().Remove(0, 3, 5).ok());
  ASSERT_TRUE(cache().Remove(0, 1, 2).ok());
  // 0 <- 0; 1 <- 2 (one shift by -1); 2..6 <- 5..9 (-2 then -1).
  EXPECT_TRUE(ReadMatches(cache(), 0, {Range(0, 7)},
                          {Concat(Concat(Unshifted(0, {0}), Shifted(0, {2}, -1, 1)),
                                  Shifted(0, Range(5, 10), -3, 2))}));
}

TEST_P(RemoveRopeTest, RemovalFromZero) {
  ASSERT_TRUE(cache().Remove(0, 0, 7).ok());
  EXPECT_TRUE(ReadMatches(cache(), 0, {Range(0, 3)}, {Shifted(0, {7, 8, 9}, -7, 1)}));
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 3);
}

TEST_P(RemoveRopeTest, SharedCellsAreCopiedBeforeTheShift) {
  ASSERT_TRUE(cache().CopyPrefix(0, 1, 10).ok());
  ASSERT_TRUE(cache().Remove(0, 2, 4).ok());
  // The other sequence keeps its positions and exact bytes.
  EXPECT_TRUE(ReadMatches(cache(), 1, {Range(0, 10)}, {Unshifted(0, Range(0, 10))}));
  EXPECT_TRUE(ReadMatches(cache(), 0, {Range(0, 8)},
                          {Concat(Unshifted(0, {0, 1}), Shifted(0, Range(4, 10), -2, 1))}));
  // 10 original cells plus 6 private copies.
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 16);
  for (const SequenceInfo& info : cache().ListSequences()) {
    EXPECT_EQ(info.groups[0].shared, 2) << info.seq;  // positions 0 and 1
  }
  ASSERT_TRUE(cache().Remove(1, 0, std::nullopt).ok());
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 8);
  EXPECT_TRUE(ReadMatches(cache(), 0, {Range(0, 8)},
                          {Concat(Unshifted(0, {0, 1}), Shifted(0, Range(4, 10), -2, 1))}));
}

INSTANTIATE_TEST_SUITE_P(AllRopes, RemoveRopeTest,
                         ::testing::Combine(::testing::Values(RopeType::kNormal, RopeType::kNeox),
                                            ::testing::Values(DType::kF32, DType::kF16,
                                                              DType::kBF16)),
                         RopeParamName);

TEST(RemoveTest, FreqScaleAndBaseEnterTheRotation) {
  const CacheSpec spec = Spec(DType::kF32, 1, 64, 16,
                              {Group(Full(), 1, 3, 4, 4, Rope(RopeType::kNeox, 4, 500.0f, 0.25f))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  ASSERT_TRUE(AppendRange(*tc.cache, 0, 0, 16).ok());
  ASSERT_TRUE(tc.cache->Remove(0, 1, 12).ok());
  EXPECT_TRUE(ReadMatches(*tc.cache, 0, {Range(0, 5)},
                          {Concat(Unshifted(0, {0}), Shifted(0, Range(12, 16), -11, 1))}));
}

TEST(RemoveTest, HolesShiftByTheRangeLength) {
  const CacheSpec spec =
      Spec(DType::kF32, 1, 64, 16, {Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  ASSERT_TRUE(AppendTokens(*tc.cache, {{0, 0}, {0, 1}, {0, 5}, {0, 6}}).ok());
  ASSERT_TRUE(tc.cache->Remove(0, 2, 4).ok());  // nothing stored in [2, 4)
  EXPECT_TRUE(ReadMatches(*tc.cache, 0, {{0, 1, 3, 4}},
                          {Concat(Unshifted(0, {0, 1}), Shifted(0, {5, 6}, -2, 1))}));
}

// Every group shifts; each rotates with its own rope, and a sliding group shifts what it keeps.
TEST(RemoveTest, EveryGroupShiftsWithItsOwnRope) {
  // Sliding window 3, one sequence: memory 3, 3 + 8 cells.
  const CacheSpec spec =
      Spec(DType::kF16, 1, 64, 8,
           {Group(Full(), 2, 1, 4, 2, Rope(RopeType::kNormal, 4)),
            Group(Sliding(3), 1, 2, 8, 4, Rope(RopeType::kNeox, 8, 1e6f, 2.0f))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 8).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 8, 10).ok());  // sliding drops < 8 - 3
  ASSERT_EQ(StoredPositions(cache, 0), (Positions{Range(0, 10), Range(5, 10)}));
  ASSERT_TRUE(cache.Remove(0, 2, 6).ok());
  // Full: 0,1 stay; 6..9 -> 2..5. Sliding: 5 removed; 6..9 -> 2..5.
  EXPECT_TRUE(ReadMatches(cache, 0, {Range(0, 6), Range(2, 6)},
                          {Concat(Unshifted(0, {0, 1}), Shifted(0, Range(6, 10), -4, 1)),
                           Shifted(0, Range(6, 10), -4, 1)}));
  EXPECT_EQ(cache.Usage().groups[1].cells_used, 4);
}

class RemoveErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A group with RoPE and one without.
    spec_ = Spec(DType::kF16, 2, 32, 16,
                 {Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4)), Group(Sliding(4, 20))});
    tc_.emplace(spec_);
    ASSERT_NE(tc_->cache, nullptr);
    ASSERT_TRUE(AppendRange(cache(), 0, 0, 10).ok());
    before_ = CaptureState(cache());
  }
  Cache& cache() { return *tc_->cache; }
  CacheSpec spec_;
  std::optional<TestCache> tc_;
  CacheState before_;
};

TEST_F(RemoveErrorsTest, MiddleRemovalWithRopeNoneIsFailedPrecondition) {
  EXPECT_EQ(cache().Remove(0, 3, 5).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(SameState(before_, CaptureState(cache())));
  EXPECT_EQ(cache().Remove(0, 0, 9).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(SameState(before_, CaptureState(cache())));
}

TEST_F(RemoveErrorsTest, TruncateWithRopeNoneIsFine) {
  ASSERT_TRUE(cache().Remove(0, 7, std::nullopt).ok());
  EXPECT_EQ(StoredPositions(cache(), 0), (Positions{Range(0, 7), Range(0, 7)}));
}

TEST_F(RemoveErrorsTest, BadArguments) {
  EXPECT_EQ(cache().Remove(0, 5, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().Remove(0, -1, std::nullopt).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().Remove(0, -3, 2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().Remove(-1, 0, std::nullopt).code(), absl::StatusCode::kInvalidArgument);
  // begin > end even for a sequence that stores nothing.
  EXPECT_EQ(cache().Remove(5, 5, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameState(before_, CaptureState(cache())));
}

TEST_F(RemoveErrorsTest, NoOps) {
  EXPECT_TRUE(cache().Remove(0, 3, 3).ok());             // begin == end
  EXPECT_TRUE(cache().Remove(7, 0, std::nullopt).ok());  // sequence stores nothing
  EXPECT_TRUE(cache().Remove(7, 2, 5).ok());
  EXPECT_TRUE(cache().Remove(0, 20, std::nullopt).ok());  // nothing at or after 20
  EXPECT_TRUE(cache().Remove(0, 20, 30).ok());
  EXPECT_TRUE(SameState(before_, CaptureState(cache())));
}

// Private copies of shared cells need free cells. This cache lets one sequence hold positions
// beyond `capacity` to fill its 2 * 4 cells (the cell rule is the only limit).
class RemoveCopyCapacityTest : public ::testing::Test {
 protected:
  static constexpr int64_t kA = 0;
  static constexpr int64_t kB = 1;
  void SetUp() override {
    spec_ = Spec(DType::kF32, 2, 4, 4, {Group(Full(), 1, 1, 2, 2, Rope(RopeType::kNormal, 2))});
    tc_.emplace(spec_);
    ASSERT_NE(tc_->cache, nullptr);
    const absl::Status appended = AppendRange(cache(), kA, 4, 8);
    ASSERT_TRUE(appended.ok()) << appended;
    ASSERT_TRUE(cache().CopyPrefix(kA, kB, 100).ok());  // B shares A's 4..7
    ASSERT_TRUE(AppendRange(cache(), kA, 0, 4).ok());   // A's 0..3 are private
    ASSERT_EQ(cache().Usage().groups[0].cells_used, 8);
  }
  Cache& cache() { return *tc_->cache; }
  CacheSpec spec_;
  std::optional<TestCache> tc_;
};

TEST_F(RemoveCopyCapacityTest, NoRoomForCopiesIsResourceExhausted) {
  const CacheState before = CaptureState(cache());
  // Frees 3 cells, but 4..7 need 4 private copies.
  EXPECT_EQ(cache().Remove(kA, 0, 3).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
}

// The cells the removal frees count for the copies (the result must fit, and it does).
TEST_F(RemoveCopyCapacityTest, CellsFreedByTheRemovalHoldTheCopies) {
  const absl::Status removed = cache().Remove(kA, 0, 4);
  ASSERT_TRUE(removed.ok()) << removed;
  EXPECT_TRUE(ReadMatches(cache(), kA, {Range(0, 4)}, {Shifted(kA, Range(4, 8), -4, 1)}));
  EXPECT_TRUE(ReadMatches(cache(), kB, {Range(4, 8)}, {Unshifted(kA, Range(4, 8))}));
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 8);
}

TEST_F(RemoveCopyCapacityTest, TruncationNeedsNoCopies) {
  ASSERT_TRUE(cache().Remove(kA, 5, std::nullopt).ok());
  EXPECT_TRUE(ReadMatches(cache(), kA, {Range(0, 5)}, {Unshifted(kA, Range(0, 5))}));
  EXPECT_EQ(cache().Usage().groups[0].cells_used, 8);  // 5..7 still B's
}

}  // namespace
}  // namespace kvmesh
