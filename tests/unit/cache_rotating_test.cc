// Rotating layer groups (docs/semantics.md "Rotating groups"): the per-sequence ring of
// max_size rows, logical-order Read, Visible, CopyPrefix, Remove, CanResume and contiguity,
// checked with exact bytes and exact status codes.
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
using testutil::FindSequence;
using testutil::Ids;
using testutil::IsError;
using testutil::PayloadFor;
using testutil::Range;
using testutil::ReadIs;
using testutil::RotatingGroup;
using testutil::SameState;
using testutil::Spec;
using testutil::TestCache;
using testutil::TokenId;
using testutil::Tokens;

using Positions = std::vector<std::vector<int32_t>>;
using IdLists = std::vector<std::vector<uint64_t>>;
constexpr auto kNoEnd = std::nullopt;

// 3 rings of 4 rows; 2 layers of 2 heads (head_dim_k 4, head_dim_v 2), so a mixed-up layer or
// K/V plane shows in the bytes.
CacheSpec RingSpec(DType dtype = DType::kF16) {
  return Spec(dtype, 3, 32, 8, {RotatingGroup(4, 2, 2, 4, 2)});
}

// Read of the whole sequence holds exactly `positions`, with the rows `seq` appended there
// (salt 0).
::testing::AssertionResult Window(const Cache& cache, int64_t seq,
                                  const std::vector<int32_t>& positions) {
  return ReadIs(cache, seq, 0, kNoEnd, {positions}, {Ids(seq, positions)});
}

class RotatingByDtypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(RotatingByDtypeTest, PrefillLongerThanMaxSizeKeepsTheLastMaxSize) {
  const CacheSpec spec = RingSpec(GetParam());
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 7).ok());
  EXPECT_TRUE(Window(cache, 0, Range(3, 7)));
  const std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->offset, 7);
  EXPECT_EQ(info->pending, 0);
  ASSERT_EQ(info->groups.size(), 1u);
  EXPECT_EQ(info->groups[0].stored, 4);
  EXPECT_EQ(info->groups[0].first, 3);
  EXPECT_EQ(info->groups[0].last, 6);
  EXPECT_EQ(info->groups[0].shared, 0);
  EXPECT_EQ(info->groups[0].state, StateStatus::kNone);
  const CacheUsage usage = cache.Usage();
  EXPECT_EQ(usage.groups[0].cells_total, 12);
  EXPECT_EQ(usage.groups[0].cells_used, 4);
  EXPECT_EQ(usage.sequences_live, 1);
}

TEST_P(RotatingByDtypeTest, SingleTokenDecodePastTheWrapReadsInLogicalOrder) {
  const CacheSpec spec = RingSpec(GetParam());
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 3).ok());
  EXPECT_TRUE(Window(cache, 0, Range(0, 3)));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 3);
  for (int32_t pos = 3; pos < 11; ++pos) {
    ASSERT_TRUE(AppendRange(cache, 0, pos, pos + 1).ok()) << pos;
    const int32_t offset = pos + 1;
    EXPECT_TRUE(Window(cache, 0, Range(std::max(0, offset - 4), offset))) << "offset " << offset;
    EXPECT_EQ(cache.Usage().groups[0].cells_used, std::min(offset, 4));
  }
  // Offset 11: window [7, 11), ring rows 3,0,1,2. Sub-ranges come back in position order.
  EXPECT_TRUE(ReadIs(cache, 0, 8, 10, {{8, 9}}, {Ids(0, {8, 9})}));
  EXPECT_TRUE(ReadIs(cache, 0, 6, 9, {{7, 8}}, {Ids(0, {7, 8})}));
  EXPECT_TRUE(ReadIs(cache, 0, 9, kNoEnd, {{9, 10}}, {Ids(0, {9, 10})}));
  EXPECT_TRUE(ReadIs(cache, 0, 0, 7, {{}}, {{}}));  // everything there left the window
  EXPECT_TRUE(ReadIs(cache, 0, 11, kNoEnd, {{}}, {{}}));
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, RotatingByDtypeTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16));

TEST(RotatingTest, InterleavedBatchWrapsEachSequenceSeparately) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  const std::vector<Token> batch = {{0, 0}, {1, 0}, {0, 1}, {0, 2}, {0, 3}, {0, 4}, {0, 5}};
  ASSERT_TRUE(AppendTokens(cache, batch).ok());
  EXPECT_TRUE(Window(cache, 0, Range(2, 6)));
  EXPECT_TRUE(Window(cache, 1, {0}));
  ASSERT_TRUE(AppendTokens(cache, {{1, 1}, {0, 6}, {1, 2}}).ok());
  EXPECT_TRUE(Window(cache, 0, Range(3, 7)));
  EXPECT_TRUE(Window(cache, 1, Range(0, 3)));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 7);
}

TEST(RotatingTest, AppendMustContinueAtTheOffset) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  const CacheState before = CaptureState(cache);
  // A gap, a position in the window, a new sequence not starting at 0.
  EXPECT_TRUE(IsError(AppendRange(cache, 0, 7, 8), absl::StatusCode::kInvalidArgument, {"7", "6"}));
  EXPECT_TRUE(IsError(AppendRange(cache, 0, 5, 7), absl::StatusCode::kInvalidArgument, {"5", "6"}));
  EXPECT_TRUE(IsError(AppendRange(cache, 1, 1, 2), absl::StatusCode::kInvalidArgument, {"1", "0"}));
  // The second token of a batch breaks contiguity: nothing of the batch is stored.
  EXPECT_TRUE(IsError(AppendTokens(cache, {{0, 6}, {0, 8}}), absl::StatusCode::kInvalidArgument,
                      {"8", "7"}));
  EXPECT_TRUE(IsError(AppendTokens(cache, {{1, 0}, {0, 6}, {1, 2}}),
                      absl::StatusCode::kInvalidArgument, {"2", "1"}));
  // A payload one byte short.
  const std::vector<Token> next = Tokens(0, 6, 7);
  std::vector<uint8_t> payload = PayloadFor(spec, next);
  payload.pop_back();
  EXPECT_TRUE(IsError(cache.Append(next, payload), absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(AppendRange(cache, 0, 6, 7).ok());
  EXPECT_TRUE(Window(cache, 0, Range(3, 7)));
}

TEST(RotatingTest, RingsAreLimitedByMaxSequencesAndReusedWithoutStaleRows) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  for (int64_t seq = 0; seq < 3; ++seq) ASSERT_TRUE(AppendRange(cache, seq, 0, 6).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(AppendRange(cache, 3, 0, 1), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(cache.Remove(1, 0, kNoEnd).ok());
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 8);
  // The freed ring still holds seq 1's rows; the new sequence sees only its own two.
  ASSERT_TRUE(AppendRange(cache, 3, 0, 2).ok());
  EXPECT_TRUE(Window(cache, 3, {0, 1}));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 10);
  EXPECT_TRUE(Window(cache, 0, Range(2, 6)));
  EXPECT_TRUE(Window(cache, 2, Range(2, 6)));
}

TEST(RotatingTest, VisibleIsTheLastMaxSizePositionsUpToTheQuery) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 5).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 5, 10).ok());  // window [6, 10)
  ASSERT_TRUE(AppendRange(cache, 1, 0, 3).ok());   // not wrapped
  const std::vector<Query> queries = {{0, 9, false}, {0, 10, false}, {0, 7, false},
                                      {0, 7, true},  {0, 12, false}, {0, 3, false},
                                      {1, 1, false}, {1, 2, true},   {5, 0, false}};
  absl::StatusOr<std::vector<std::vector<int32_t>>> visible = cache.Visible(0, queries);
  ASSERT_TRUE(visible.ok()) << visible.status();
  const std::vector<std::vector<int32_t>> expected = {
      {6, 7, 8, 9},                  // the query's own token and max_size - 1 before it
      {7, 8, 9},                     // a query at the offset: p > 10 - 4
      {6, 7},                        // p <= 7 and p > 3
      {6, 7, 8, 9},                  // non-causal: p > 3
      {9},                           // p > 8
      {},                            // everything <= 3 left the window
      {0, 1},       {0, 1, 2}, {}};  // unknown sequence
  EXPECT_EQ(*visible, expected);
  EXPECT_TRUE(
      IsError(cache.Visible(1, queries).status(), absl::StatusCode::kInvalidArgument, {"1"}));
}

TEST(RotatingTest, CopyPrefixBeforeTheWrapCopiesWholeOrPart) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());  // offset == max_size: not wrapped
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 4).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 2, 2).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {Range(0, 4)}, {Ids(0, Range(0, 4))}));
  EXPECT_TRUE(ReadIs(cache, 2, 0, kNoEnd, {Range(0, 2)}, {Ids(0, Range(0, 2))}));
  EXPECT_EQ(FindSequence(cache, 1)->offset, 4);
  EXPECT_EQ(FindSequence(cache, 2)->offset, 2);
  // Rings are copied, not shared: nothing counts as shared and every ring row is used.
  EXPECT_EQ(FindSequence(cache, 1)->groups[0].shared, 0);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 10);
  // The copies continue independently; the source is untouched.
  ASSERT_TRUE(AppendRange(cache, 1, 4, 6).ok());
  ASSERT_TRUE(AppendRange(cache, 2, 2, 7).ok());
  EXPECT_TRUE(Window(cache, 0, Range(0, 4)));
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {Range(2, 6)},
                     {{TokenId(0, 2), TokenId(0, 3), TokenId(1, 4), TokenId(1, 5)}}));
  EXPECT_TRUE(Window(cache, 2, Range(3, 7)));
  // length 0 empties dst; a length past the offset copies the whole window.
  ASSERT_TRUE(cache.CopyPrefix(0, 2, 0).ok());
  EXPECT_FALSE(FindSequence(cache, 2).has_value());
  ASSERT_TRUE(cache.CopyPrefix(0, 2, 100).ok());
  EXPECT_TRUE(ReadIs(cache, 2, 0, kNoEnd, {Range(0, 4)}, {Ids(0, Range(0, 4))}));
}

TEST(RotatingTest, CopyPrefixAfterTheWrapNeedsTheWholeWindow) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());  // window [2, 6), wrapped
  ASSERT_TRUE(AppendRange(cache, 1, 0, 2).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(
      IsError(cache.CopyPrefix(0, 1, 5), absl::StatusCode::kFailedPrecondition, {"5", "6"}));
  EXPECT_TRUE(
      IsError(cache.CopyPrefix(0, 2, 3), absl::StatusCode::kFailedPrecondition, {"3", "6"}));
  EXPECT_TRUE(IsError(cache.CopyPrefix(0, 1, 0), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // length == offset: dst gets the window and the offset.
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 6).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {Range(2, 6)}, {Ids(0, Range(2, 6))}));
  EXPECT_EQ(FindSequence(cache, 1)->offset, 6);
  ASSERT_TRUE(AppendRange(cache, 1, 6, 7).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {Range(3, 7)},
                     {{TokenId(0, 3), TokenId(0, 4), TokenId(0, 5), TokenId(1, 6)}}));
  EXPECT_TRUE(Window(cache, 0, Range(2, 6)));
  ASSERT_TRUE(cache.CopyPrefix(0, 2, 1000).ok());
  EXPECT_TRUE(ReadIs(cache, 2, 0, kNoEnd, {Range(2, 6)}, {Ids(0, Range(2, 6))}));
  EXPECT_TRUE(IsError(cache.CopyPrefix(0, 0, 6), absl::StatusCode::kInvalidArgument, {"0"}));
}

TEST(RotatingTest, TruncationBeforeTheWrap) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(cache.Remove(0, 2, kNoEnd).ok());
  EXPECT_TRUE(Window(cache, 0, {0, 1}));
  EXPECT_EQ(FindSequence(cache, 0)->offset, 2);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 2);
  // Rewritten positions hold the new rows.
  ASSERT_TRUE(AppendRange(cache, 0, 2, 4, /*salt=*/1).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(0, 4)},
                     {{TokenId(0, 0), TokenId(0, 1), TokenId(0, 2, 1), TokenId(0, 3, 1)}}));
  // [1, 4) with end == offset is a truncation too.
  ASSERT_TRUE(cache.Remove(0, 1, 4).ok());
  EXPECT_TRUE(Window(cache, 0, {0}));
  // Beyond the offset: nothing to remove.
  ASSERT_TRUE(cache.Remove(0, 1, kNoEnd).ok());
  ASSERT_TRUE(cache.Remove(0, 5, 9).ok());
  EXPECT_TRUE(Window(cache, 0, {0}));
  EXPECT_TRUE(IsError(cache.Remove(0, -1, kNoEnd), absl::StatusCode::kInvalidArgument, {"-1"}));
  EXPECT_TRUE(IsError(cache.Remove(0, 3, 2), absl::StatusCode::kInvalidArgument, {"3", "2"}));
}

TEST(RotatingTest, MiddleRemovalIsRefusedBeforeAndAfterTheWrap) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 3).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 7).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.Remove(0, 0, 1), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(IsError(cache.Remove(0, 1, 2), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(IsError(cache.Remove(1, 4, 5), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(IsError(cache.Remove(1, 0, 6), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
}

TEST(RotatingTest, AfterTheWrapOnlyRemovalFromZeroTruncates) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 5).ok());  // offset 5 > max_size 4: wrapped
  ASSERT_TRUE(AppendRange(cache, 1, 0, 2).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.Remove(0, 3, kNoEnd), absl::StatusCode::kFailedPrecondition, {"3"}));
  EXPECT_TRUE(IsError(cache.Remove(0, 4, 5), absl::StatusCode::kFailedPrecondition, {"4"}));
  EXPECT_TRUE(IsError(cache.Remove(0, 1, kNoEnd), absl::StatusCode::kFailedPrecondition, {"1"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // begin >= offset removes nothing, even after the wrap.
  ASSERT_TRUE(cache.Remove(0, 5, kNoEnd).ok());
  ASSERT_TRUE(cache.Remove(0, 7, 9).ok());
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // From 0 the whole sequence goes.
  ASSERT_TRUE(cache.Remove(0, 0, kNoEnd).ok());
  EXPECT_TRUE(IsError(cache.Read(0, 0, kNoEnd).status(), absl::StatusCode::kNotFound, {"0"}));
  EXPECT_FALSE(FindSequence(cache, 0).has_value());
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 2);
  EXPECT_EQ(cache.Usage().sequences_live, 1);
  // It starts again at 0 and shows none of its old ring rows.
  EXPECT_TRUE(IsError(AppendRange(cache, 0, 5, 6), absl::StatusCode::kInvalidArgument, {"5", "0"}));
  ASSERT_TRUE(AppendRange(cache, 0, 0, 2, /*salt=*/2).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{0, 1}}, {Ids(0, {0, 1}, 2)}));
  EXPECT_TRUE(Window(cache, 1, {0, 1}));
}

TEST(RotatingTest, RemoveFromZeroToTheOffsetDropsAWrappedSequence) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 8).ok());
  ASSERT_TRUE(cache.Remove(0, 0, 8).ok());
  EXPECT_FALSE(FindSequence(cache, 0).has_value());
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 0);
  // Removing from a sequence that stores nothing is a no-op.
  EXPECT_TRUE(cache.Remove(0, 0, kNoEnd).ok());
}

TEST(RotatingTest, CanResumeAtTheOffsetOrBelowItBeforeTheWrap) {
  const CacheSpec spec = RingSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 3).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 4).ok());  // exactly max_size: not wrapped
  ASSERT_TRUE(AppendRange(cache, 2, 0, 6).ok());  // wrapped
  struct Case {
    int64_t seq;
    int32_t pos;
    bool expected;
  };
  const std::vector<Case> cases = {{0, 0, true},  {0, 2, true},  {0, 3, true},  {0, 4, false},
                                   {1, 0, true},  {1, 4, true},  {1, 5, false}, {2, 6, true},
                                   {2, 5, false}, {2, 2, false}, {2, 0, false}, {2, 7, false},
                                   {7, 0, true},  {7, 1, false}};
  for (const Case& c : cases) {
    absl::StatusOr<bool> resume = cache.CanResume(c.seq, c.pos);
    ASSERT_TRUE(resume.ok()) << resume.status();
    EXPECT_EQ(*resume, c.expected) << "seq " << c.seq << " pos " << c.pos;
  }
}

TEST(RotatingTest, RingOfOneRow) {
  const CacheSpec spec = Spec(DType::kF32, 2, 8, 4, {RotatingGroup(1, 2, 1, 4, 4)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 1).ok());  // offset 1 == max_size: not wrapped
  EXPECT_TRUE(Window(cache, 0, {0}));
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 0).ok());
  EXPECT_FALSE(FindSequence(cache, 1).has_value());
  ASSERT_TRUE(AppendRange(cache, 0, 1, 4).ok());
  EXPECT_TRUE(Window(cache, 0, {3}));
  absl::StatusOr<std::vector<std::vector<int32_t>>> visible =
      cache.Visible(0, std::vector<Query>{{0, 3, false}, {0, 4, false}, {0, 2, true}});
  ASSERT_TRUE(visible.ok()) << visible.status();
  EXPECT_EQ(*visible, (std::vector<std::vector<int32_t>>{{3}, {}, {3}}));
  EXPECT_TRUE(IsError(cache.Remove(0, 3, kNoEnd), absl::StatusCode::kFailedPrecondition, {"3"}));
  EXPECT_TRUE(IsError(cache.CopyPrefix(0, 1, 3), absl::StatusCode::kFailedPrecondition, {"3"}));
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 4).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{3}}, {Ids(0, {3})}));
}

}  // namespace
}  // namespace kvmesh
