// Hybrid caches (docs/semantics.md "Hybrid caches"): Rotating, Recurrent and Attention groups
// in one cache. Every operation plans over all groups before changing any, so a refusal by one
// group leaves every group exactly as before.
#include <algorithm>
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
using testutil::ExpectedRow;
using testutil::FindSequence;
using testutil::Full;
using testutil::Group;
using testutil::Ids;
using testutil::IsError;
using testutil::MatchesRows;
using testutil::PayloadFor;
using testutil::Range;
using testutil::ReadIs;
using testutil::RecurrentGroup;
using testutil::Rope;
using testutil::RotatingGroup;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;
using testutil::StateId;
using testutil::TestCache;
using testutil::TokenId;
using testutil::Tokens;
using testutil::Unshifted;

constexpr auto kNoEnd = std::nullopt;

// The Rotating and Recurrent groups come first so that a refusal by the Attention group (last)
// shows whether the others were written before it was asked.
// Capacity 8: 3 x 8 = 24 attention cells; rings of 4.
CacheSpec HybridSpec() {
  return Spec(DType::kF16, 3, 8, 8,
              {RotatingGroup(4, 2, 1, 4, 4), RecurrentGroup(2, 2, 3, 1, 2, 2),
               Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4))});
}

// `seq` holds positions [0, n) appended with salt 0 in one go or several.
::testing::AssertionResult Holds(const Cache& cache, int64_t seq, int32_t n) {
  const std::vector<int32_t> window = Range(std::max(0, n - 4), n);
  return ReadIs(cache, seq, 0, kNoEnd, {window, {}, Range(0, n)},
                {Ids(seq, window), {StateId(seq, n)}, Ids(seq, Range(0, n))});
}

TEST(HybridTest, AppendStoresEveryGroup) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  ASSERT_TRUE(AppendTokens(cache, {{1, 0}, {0, 6}, {1, 1}}).ok());
  EXPECT_TRUE(Holds(cache, 0, 7));
  EXPECT_TRUE(Holds(cache, 1, 2));
  const std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->offset, 7);
  ASSERT_EQ(info->groups.size(), 3u);
  EXPECT_EQ(info->groups[0].stored, 4);
  EXPECT_EQ(info->groups[0].first, 3);
  EXPECT_EQ(info->groups[1].state, StateStatus::kValid);
  EXPECT_EQ(info->groups[1].stored, 0);
  EXPECT_EQ(info->groups[2].stored, 7);
  EXPECT_EQ(info->groups[2].first, 0);
  EXPECT_EQ(info->groups[2].last, 6);
  const CacheUsage usage = cache.Usage();
  EXPECT_EQ(usage.groups[0].cells_used, 6);
  EXPECT_EQ(usage.groups[1].cells_used, 2);
  EXPECT_EQ(usage.groups[2].cells_used, 9);
  EXPECT_EQ(usage.sequences_live, 2);
  // A sub-range lists each group's own positions; the state only when it reaches the offset.
  EXPECT_TRUE(
      ReadIs(cache, 0, 2, 5, {{3, 4}, {}, {2, 3, 4}}, {Ids(0, {3, 4}), {}, Ids(0, {2, 3, 4})}));
  EXPECT_TRUE(ReadIs(cache, 0, 5, kNoEnd, {{5, 6}, {}, {5, 6}},
                     {Ids(0, {5, 6}), {StateId(0, 7)}, Ids(0, {5, 6})}));
}

TEST(HybridTest, RefusedAppendsChangeNoGroup) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  for (int64_t seq = 0; seq < 3; ++seq) ASSERT_TRUE(AppendRange(cache, seq, 0, 8).ok());
  EXPECT_EQ(cache.Usage().groups[2].cells_used, 24);
  const CacheState before = CaptureState(cache);
  // The attention pool is full: the ring and the state must not have been written.
  EXPECT_TRUE(
      IsError(AppendRange(cache, 0, 8, 9, /*salt=*/1), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_TRUE(IsError(AppendRange(cache, 3, 0, 1), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(
      IsError(AppendRange(cache, 1, 9, 10), absl::StatusCode::kInvalidArgument, {"9", "8"}));
  EXPECT_TRUE(IsError(AppendTokens(cache, {{1, 8}, {2, 8}, {2, 10}}),
                      absl::StatusCode::kInvalidArgument, {"10", "9"}));
  const std::vector<Token> tokens = Tokens(0, 8, 9);
  std::vector<uint8_t> payload = PayloadFor(spec, tokens);
  payload.push_back(0);
  EXPECT_TRUE(IsError(cache.Append(tokens, payload), absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  for (int64_t seq = 0; seq < 3; ++seq) EXPECT_TRUE(Holds(cache, seq, 8)) << seq;
  // Freeing cells lets the same Append through.
  ASSERT_TRUE(cache.Remove(2, 0, kNoEnd).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 8, 9).ok());
  EXPECT_TRUE(Holds(cache, 0, 9));
}

TEST(HybridTest, RefusedRemovesChangeNoGroup) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());  // ring wrapped
  ASSERT_TRUE(AppendRange(cache, 1, 0, 3).ok());  // not wrapped
  const CacheState before = CaptureState(cache);
  // Attention and Recurrent would accept these; the wrapped ring refuses them.
  EXPECT_TRUE(IsError(cache.Remove(0, 3, kNoEnd), absl::StatusCode::kFailedPrecondition, {"3"}));
  EXPECT_TRUE(IsError(cache.Remove(0, 5, 6), absl::StatusCode::kFailedPrecondition, {"5"}));
  // A middle removal: the ring refuses it whether or not it wrapped.
  EXPECT_TRUE(IsError(cache.Remove(0, 1, 2), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(IsError(cache.Remove(1, 0, 1), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_TRUE(Holds(cache, 0, 6));
  EXPECT_TRUE(Holds(cache, 1, 3));
}

TEST(HybridTest, TruncationBeforeTheWrapMovesEveryGroup) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(cache.Remove(0, 2, kNoEnd).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{0, 1}, {}, {0, 1}},
                     {Ids(0, {0, 1}), {}, Ids(0, {0, 1})},
                     {StateStatus::kNone, StateStatus::kInvalid, StateStatus::kNone}));
  const std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->offset, 2);
  EXPECT_EQ(info->groups[1].state, StateStatus::kInvalid);
  absl::StatusOr<bool> resume = cache.CanResume(0, 2);
  ASSERT_TRUE(resume.ok());
  EXPECT_FALSE(*resume);  // the recurrent group cannot
  ASSERT_TRUE(AppendRange(cache, 0, 2, 6).ok());
  EXPECT_TRUE(Holds(cache, 0, 6));
  resume = cache.CanResume(0, 6);
  ASSERT_TRUE(resume.ok());
  EXPECT_TRUE(*resume);
  // From 0 the sequence leaves every group.
  ASSERT_TRUE(cache.Remove(0, 0, kNoEnd).ok());
  EXPECT_FALSE(FindSequence(cache, 0).has_value());
  const CacheUsage usage = cache.Usage();
  for (const GroupUsage& g : usage.groups) EXPECT_EQ(g.cells_used, 0);
  EXPECT_EQ(usage.sequences_live, 0);
}

TEST(HybridTest, RefusedCopyPrefixChangesNoGroup) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 3).ok());
  ASSERT_TRUE(AppendRange(cache, 2, 0, 2).ok());
  const CacheState before = CaptureState(cache);
  // Before the wrap the ring accepts a partial copy, the recurrent state does not.
  EXPECT_TRUE(
      IsError(cache.CopyPrefix(1, 2, 2), absl::StatusCode::kFailedPrecondition, {"2", "3"}));
  EXPECT_TRUE(
      IsError(cache.CopyPrefix(0, 2, 5), absl::StatusCode::kFailedPrecondition, {"5", "6"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // The whole sequence copies: attention cells shared, state shared, ring copied.
  ASSERT_TRUE(cache.CopyPrefix(0, 2, 6).ok());
  const std::vector<int32_t> window = Range(2, 6);
  EXPECT_TRUE(ReadIs(cache, 2, 0, kNoEnd, {window, {}, Range(0, 6)},
                     {Ids(0, window), {StateId(0, 6)}, Ids(0, Range(0, 6))}));
  const std::optional<SequenceInfo> info = FindSequence(cache, 2);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->groups[0].shared, 0);
  EXPECT_EQ(info->groups[1].shared, 1);
  EXPECT_EQ(info->groups[2].shared, 6);
  ASSERT_TRUE(AppendRange(cache, 2, 6, 7).ok());
  EXPECT_TRUE(Holds(cache, 0, 6));
  EXPECT_TRUE(ReadIs(cache, 2, 0, kNoEnd, {Range(3, 7), {}, Range(0, 7)},
                     {{TokenId(0, 3), TokenId(0, 4), TokenId(0, 5), TokenId(2, 6)},
                      {StateId(2, 7)},
                      {TokenId(0, 0), TokenId(0, 1), TokenId(0, 2), TokenId(0, 3), TokenId(0, 4),
                       TokenId(0, 5), TokenId(2, 6)}}));
}

TEST(HybridTest, RefusedLiveRewindChangesNoGroup) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 3).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(
      IsError(cache.Restore(0, std::nullopt, 4), absl::StatusCode::kFailedPrecondition, {"4"}));
  // Before the wrap the ring could rewind, the recurrent state cannot.
  EXPECT_TRUE(
      IsError(cache.Restore(1, std::nullopt, 1), absl::StatusCode::kFailedPrecondition, {"1"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // target == offset is accepted by every group and changes nothing.
  ASSERT_TRUE(cache.Restore(0, std::nullopt, 6).ok());
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
}

// Attention (with RoPE) plus Recurrent: a middle removal shifts the keys and invalidates the
// state; the offset moves with the attention positions.
TEST(HybridTest, MiddleRemovalShiftsAttentionAndInvalidatesTheState) {
  const CacheSpec spec = Spec(
      DType::kF32, 2, 16, 8,
      {Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4)), RecurrentGroup(1, 2, 3, 1, 2, 2)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  ASSERT_TRUE(cache.Remove(0, 1, 3).ok());
  absl::StatusOr<ReadResult> read = cache.Read(0, 0, kNoEnd);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->positions, (std::vector<std::vector<int32_t>>{Range(0, 4), {}}));
  EXPECT_EQ(read->states, (std::vector<StateStatus>{StateStatus::kNone, StateStatus::kInvalid}));
  std::vector<ExpectedRow> rows = Unshifted(0, {0});
  for (int32_t p : {3, 4, 5}) rows.push_back(ExpectedRow{TokenId(0, p), -2, 1});
  EXPECT_TRUE(MatchesRows(spec, read->payload, {rows, {}}));
  EXPECT_EQ(FindSequence(cache, 0)->offset, 4);
  ASSERT_TRUE(AppendRange(cache, 0, 4, 5).ok());
  EXPECT_EQ(FindSequence(cache, 0)->groups[1].state, StateStatus::kValid);
  EXPECT_TRUE(ReadIs(cache, 0, 4, kNoEnd, {{4}, {}}, {Ids(0, {4}), {StateId(0, 5)}}));
}

TEST(HybridTest, MiddleRemovalWithoutRopeKeepsTheStateValid) {
  const CacheSpec spec =
      Spec(DType::kF16, 2, 16, 8, {Group(Full()), RecurrentGroup(1, 2, 3, 1, 2, 2)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.Remove(0, 1, 3), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_EQ(FindSequence(cache, 0)->groups[1].state, StateStatus::kValid);
}

// A sliding attention group next to a ring: each keeps its own window of the same sequence.
TEST(HybridTest, SlidingAttentionAndRingKeepTheirOwnWindows) {
  const CacheSpec spec =
      Spec(DType::kBF16, 1, 32, 4, {Group(Sliding(2)), RotatingGroup(3), RecurrentGroup()});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  for (int32_t p = 0; p < 9; p += 3) ASSERT_TRUE(AppendRange(cache, 0, p, p + 3).ok());
  // Sliding memory 2 (one sequence): the last batch started at 6, so >= 4 stays.
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(4, 9), Range(6, 9), {}},
                     {Ids(0, Range(4, 9)), Ids(0, Range(6, 9)), {StateId(0, 9)}}));
  absl::StatusOr<std::vector<std::vector<int32_t>>> visible =
      cache.Visible(1, std::vector<Query>{{0, 8, false}, {0, 9, false}});
  ASSERT_TRUE(visible.ok()) << visible.status();
  EXPECT_EQ(*visible, (std::vector<std::vector<int32_t>>{{6, 7, 8}, {7, 8}}));
  visible = cache.Visible(0, std::vector<Query>{{0, 8, false}});
  ASSERT_TRUE(visible.ok()) << visible.status();
  EXPECT_EQ(*visible, (std::vector<std::vector<int32_t>>{{6, 7, 8}}));
}

}  // namespace
}  // namespace kvmesh
