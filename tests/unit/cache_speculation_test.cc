// Speculative decoding (docs/semantics.md "Speculation"): Append(speculative) keeps tokens
// pending, visible to Read, Visible, CanResume and ListSequences; CommitSpeculation keeps a
// prefix in every group, rejected tokens never touch a ring or a state, and sliding-window
// pruning keeps what a rejection needs.
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
using testutil::AppendSpeculative;
using testutil::AppendTokens;
using testutil::CacheState;
using testutil::CaptureState;
using testutil::FindSequence;
using testutil::Full;
using testutil::Group;
using testutil::Ids;
using testutil::IsError;
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

constexpr auto kNoEnd = std::nullopt;

CacheSpec AttentionSpec() {
  return Spec(DType::kF16, 3, 32, 4, {Group(Full(), 2, 1, 4, 4, Rope(RopeType::kNormal, 4))});
}

// Rings of 4, a recurrent state, full attention; at most 4 tokens per Append and 4 pending.
CacheSpec HybridSpec() {
  return Spec(DType::kF16, 3, 32, 4,
              {RotatingGroup(4, 2, 1, 4, 4), RecurrentGroup(2, 2, 3, 1, 2, 2),
               Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4))});
}

// `seq` holds [0, n) of its own rows (salt 0) and the state after n, no pending tokens.
::testing::AssertionResult HybridHolds(const Cache& cache, int64_t seq, int32_t n) {
  const std::vector<int32_t> window = Range(std::max(0, n - 4), n);
  ::testing::AssertionResult read =
      ReadIs(cache, seq, 0, kNoEnd, {window, {}, Range(0, n)},
             {Ids(seq, window), {StateId(seq, n)}, Ids(seq, Range(0, n))});
  if (!read) return read;
  const std::optional<SequenceInfo> info = FindSequence(cache, seq);
  if (!info.has_value()) return ::testing::AssertionFailure() << "seq " << seq << " not listed";
  if (info->offset != n || info->pending != 0) {
    return ::testing::AssertionFailure() << "offset " << info->offset << " pending "
                                         << info->pending << ", expected " << n << " and 0";
  }
  return ::testing::AssertionSuccess();
}

bool Resumes(const Cache& cache, int64_t seq, int32_t pos) {
  absl::StatusOr<bool> resume = cache.CanResume(seq, pos);
  EXPECT_TRUE(resume.ok()) << resume.status();
  return resume.ok() && *resume;
}

// ---- Attention only ------------------------------------------------------------------------

TEST(SpeculationTest, PendingTokensAreVisibleEverywhere) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendSpeculative(cache, 0, 4, 7).ok());
  const std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->offset, 7);
  EXPECT_EQ(info->pending, 3);
  EXPECT_EQ(info->groups[0].stored, 7);
  EXPECT_EQ(info->groups[0].last, 6);
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(0, 7)}, {Ids(0, Range(0, 7))}));
  absl::StatusOr<std::vector<std::vector<int32_t>>> visible =
      cache.Visible(0, std::vector<Query>{{0, 6, false}, {0, 4, false}});
  ASSERT_TRUE(visible.ok()) << visible.status();
  EXPECT_EQ(*visible, (std::vector<std::vector<int32_t>>{Range(0, 7), Range(0, 5)}));
  EXPECT_TRUE(Resumes(cache, 0, 7));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 7);
}

class CommitAttentionTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(CommitAttentionTest, KeepsTheFirstAccepted) {
  const int32_t accepted = GetParam();
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 2).ok());
  ASSERT_TRUE(AppendSpeculative(cache, 0, 4, 6).ok());
  ASSERT_TRUE(AppendSpeculative(cache, 0, 6, 7).ok());  // speculative Appends may follow
  ASSERT_EQ(FindSequence(cache, 0)->pending, 3);
  ASSERT_TRUE(cache.CommitSpeculation(0, accepted).ok());
  EXPECT_TRUE(
      ReadIs(cache, 0, 0, kNoEnd, {Range(0, 4 + accepted)}, {Ids(0, Range(0, 4 + accepted))}));
  const std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->offset, 4 + accepted);
  EXPECT_EQ(info->pending, 0);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 4 + accepted + 2);
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {Range(0, 2)}, {Ids(1, Range(0, 2))}));
  // Committed tokens are ordinary: the next plain Append continues after them.
  ASSERT_TRUE(AppendRange(cache, 0, 4 + accepted, 5 + accepted, /*salt=*/1).ok());
  EXPECT_TRUE(IsError(cache.CommitSpeculation(0, 0), absl::StatusCode::kFailedPrecondition, {"0"}));
}

INSTANTIATE_TEST_SUITE_P(NoneSomeAll, CommitAttentionTest, ::testing::Values(0, 1, 2, 3));

TEST(SpeculationTest, CommitArgumentErrors) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  EXPECT_TRUE(IsError(cache.CommitSpeculation(0, 0), absl::StatusCode::kFailedPrecondition, {"0"}));
  EXPECT_TRUE(IsError(cache.CommitSpeculation(8, 0), absl::StatusCode::kFailedPrecondition, {"8"}));
  ASSERT_TRUE(AppendSpeculative(cache, 0, 4, 7).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.CommitSpeculation(0, -1), absl::StatusCode::kInvalidArgument, {"-1"}));
  EXPECT_TRUE(
      IsError(cache.CommitSpeculation(0, 4), absl::StatusCode::kInvalidArgument, {"4", "3"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
}

TEST(SpeculationTest, PendingSequencesRefuseOtherOperationsWithAborted) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 4).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(1, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(AppendSpeculative(cache, 0, 4, 6).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(AppendRange(cache, 0, 6, 7), absl::StatusCode::kAborted, {"0"}));
  // A plain batch that touches the pending sequence is refused as a whole.
  EXPECT_TRUE(IsError(AppendTokens(cache, {{1, 4}, {0, 6}}), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.Snapshot(0, 0).status(), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.Restore(0, std::nullopt, 4), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.Restore(0, snap->id, 4), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.CopyPrefix(0, 2, 4), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.CopyPrefix(1, 0, 4), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.Remove(0, 5, kNoEnd), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.Remove(0, 0, kNoEnd), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // Other sequences are unaffected.
  ASSERT_TRUE(AppendRange(cache, 1, 4, 5).ok());
  ASSERT_TRUE(cache.CommitSpeculation(0, 2).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 6, 7).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(0, 7)}, {Ids(0, Range(0, 7))}));
}

TEST(SpeculationTest, PositionsMustBePastTheOffset) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(
      IsError(AppendSpeculative(cache, 0, 3, 5), absl::StatusCode::kInvalidArgument, {"3"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // An attention-only cache accepts a gap.
  ASSERT_TRUE(AppendSpeculative(cache, 0, 6, 8).ok());
  EXPECT_TRUE(
      IsError(AppendSpeculative(cache, 0, 5, 6), absl::StatusCode::kInvalidArgument, {"5", "8"}));
  ASSERT_TRUE(cache.CommitSpeculation(0, 1).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{0, 1, 2, 3, 6}}, {Ids(0, {0, 1, 2, 3, 6})}));
  EXPECT_EQ(FindSequence(cache, 0)->offset, 7);
}

TEST(SpeculationTest, PendingTokensPerSequenceAreCappedAtMaxBatch) {
  const CacheSpec spec = AttentionSpec();  // max_batch 4
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 2).ok());
  ASSERT_TRUE(AppendSpeculative(cache, 0, 2, 5).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(
      IsError(AppendSpeculative(cache, 0, 5, 7), absl::StatusCode::kResourceExhausted, {"4"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(AppendSpeculative(cache, 0, 5, 6).ok());  // exactly max_batch pending
  // Another sequence has its own allowance.
  ASSERT_TRUE(AppendSpeculative(cache, 1, 0, 4).ok());
  EXPECT_EQ(FindSequence(cache, 0)->pending, 4);
  EXPECT_EQ(FindSequence(cache, 1)->pending, 4);
  ASSERT_TRUE(cache.CommitSpeculation(0, 4).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(0, 6)}, {Ids(0, Range(0, 6))}));
}

TEST(SpeculationTest, RejectingEverythingOfANewSequenceEndsIt) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendSpeculative(cache, 2, 0, 3).ok());
  EXPECT_EQ(cache.Usage().sequences_live, 1);
  ASSERT_TRUE(cache.CommitSpeculation(2, 0).ok());
  EXPECT_FALSE(FindSequence(cache, 2).has_value());
  EXPECT_EQ(cache.Usage().sequences_live, 0);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 0);
  EXPECT_TRUE(IsError(cache.Read(2, 0, kNoEnd).status(), absl::StatusCode::kNotFound));
}

// memory 2 (one sequence): pool = 2 + max_batch 4 = 6 cells.
TEST(SpeculationTest, SlidingPruningKeepsWhatARejectionNeeds) {
  const CacheSpec spec = Spec(DType::kF32, 1, 64, 4, {Group(Sliding(2))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendSpeculative(cache, 0, 4, 6).ok());  // prunes below 4 - 2: {2..5}
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(2, 6)}, {Ids(0, Range(2, 6))}));
  // A plain Append at 6 would prune below 4; with 4 and 5 pending the bound stays at 2.
  ASSERT_TRUE(AppendSpeculative(cache, 0, 6, 8).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(2, 8)}, {Ids(0, Range(2, 8))}));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 6);
  ASSERT_TRUE(cache.CommitSpeculation(0, 0).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{2, 3}}, {Ids(0, {2, 3})}));
  EXPECT_TRUE(Resumes(cache, 0, 4));
  absl::StatusOr<std::vector<std::vector<int32_t>>> visible =
      cache.Visible(0, std::vector<Query>{{0, 4, false}});
  ASSERT_TRUE(visible.ok());
  EXPECT_EQ(*visible, (std::vector<std::vector<int32_t>>{{2, 3}}));
  ASSERT_TRUE(AppendRange(cache, 0, 4, 5, /*salt=*/1).ok());
  EXPECT_TRUE(
      ReadIs(cache, 0, 0, kNoEnd, {{2, 3, 4}}, {{TokenId(0, 2), TokenId(0, 3), TokenId(0, 4, 1)}}));
}

// Two sequences (memory raised to 3): another sequence's Append must not prune below a
// pending sequence's first pending position - memory.
TEST(SpeculationTest, OtherSequencesAppendsKeepPendingRejectionsResumable) {
  const CacheSpec spec = Spec(DType::kF32, 2, 64, 4, {Group(Sliding(2))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendSpeculative(cache, 0, 4, 8).ok());  // bound 4 - 3 = 1: {1..7}
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(1, 8)}, {Ids(0, Range(1, 8))}));
  // Seq 1's Append prunes seq 0 by last + 1 - memory = 5 unless the pending tokens protect it.
  ASSERT_TRUE(AppendRange(cache, 1, 0, 1).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(1, 8)}, {Ids(0, Range(1, 8))}));
  ASSERT_TRUE(cache.CommitSpeculation(0, 0).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(1, 4)}, {Ids(0, Range(1, 4))}));
  EXPECT_TRUE(Resumes(cache, 0, 4));
}

// ---- Rotating and Recurrent ----------------------------------------------------------------

class CommitHybridTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(CommitHybridTest, EveryGroupKeepsTheAcceptedPrefix) {
  const int32_t accepted = GetParam();
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 4, 6).ok());  // ring [2, 6), wrapped
  ASSERT_TRUE(AppendRange(cache, 1, 0, 3).ok());
  ASSERT_TRUE(AppendSpeculative(cache, 0, 6, 8).ok());
  ASSERT_TRUE(AppendSpeculative(cache, 0, 8, 9).ok());
  // Pending: offset 9, positions from 5 on agree whatever the committed window is.
  const std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->offset, 9);
  EXPECT_EQ(info->pending, 3);
  EXPECT_EQ(info->groups[1].state, StateStatus::kValid);
  EXPECT_TRUE(ReadIs(cache, 0, 5, kNoEnd, {Range(5, 9), {}, Range(5, 9)},
                     {Ids(0, Range(5, 9)), {StateId(0, 9)}, Ids(0, Range(5, 9))}));
  // A range stopping before the offset (pending included) has no state.
  EXPECT_TRUE(ReadIs(cache, 0, 5, 8, {Range(5, 8), {}, Range(5, 8)},
                     {Ids(0, Range(5, 8)), {}, Ids(0, Range(5, 8))}));
  absl::StatusOr<std::vector<std::vector<int32_t>>> visible =
      cache.Visible(0, std::vector<Query>{{0, 8, false}});
  ASSERT_TRUE(visible.ok()) << visible.status();
  EXPECT_EQ(*visible, (std::vector<std::vector<int32_t>>{Range(5, 9)}));
  visible = cache.Visible(2, std::vector<Query>{{0, 7, false}});
  ASSERT_TRUE(visible.ok()) << visible.status();
  EXPECT_EQ(*visible, (std::vector<std::vector<int32_t>>{Range(0, 8)}));
  EXPECT_TRUE(Resumes(cache, 0, 9));
  EXPECT_FALSE(Resumes(cache, 0, 6));
  // Pending ring rows and states come from the cache pool.
  EXPECT_GT(cache.Usage().bytes_held, CacheBytes(spec));

  ASSERT_TRUE(cache.CommitSpeculation(0, accepted).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 6 + accepted));
  EXPECT_TRUE(HybridHolds(cache, 1, 3));
  EXPECT_EQ(cache.Usage().bytes_held, CacheBytes(spec));
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kCache), CacheBytes(spec));
  EXPECT_TRUE(Resumes(cache, 0, 6 + accepted));
  ASSERT_TRUE(AppendRange(cache, 0, 6 + accepted, 7 + accepted).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 7 + accepted));
}

INSTANTIATE_TEST_SUITE_P(NoneSomeAll, CommitHybridTest, ::testing::Values(0, 1, 2, 3));

TEST(HybridSpeculationTest, ContiguityPayloadAndCap) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 4, 6).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(
      IsError(AppendSpeculative(cache, 0, 7, 8), absl::StatusCode::kInvalidArgument, {"7", "6"}));
  EXPECT_TRUE(
      IsError(AppendSpeculative(cache, 1, 1, 2), absl::StatusCode::kInvalidArgument, {"1", "0"}));
  // One state per sequence is the plain layout, the wrong size for a speculative Append.
  const std::vector<Token> tokens = Tokens(0, 6, 8);
  const std::vector<uint8_t> plain = PayloadFor(spec, tokens);
  EXPECT_TRUE(IsError(
      cache.Append(tokens, plain, /*speculative=*/true), absl::StatusCode::kInvalidArgument,
      {std::to_string(plain.size()), std::to_string(AppendPayloadBytes(spec, 2, 1, true))}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(AppendSpeculative(cache, 0, 6, 9).ok());
  const CacheState pending = CaptureState(cache);
  EXPECT_TRUE(IsError(AppendSpeculative(cache, 0, 10, 11), absl::StatusCode::kInvalidArgument,
                      {"10", "9"}));
  EXPECT_TRUE(
      IsError(AppendSpeculative(cache, 0, 9, 11), absl::StatusCode::kResourceExhausted, {"4"}));
  EXPECT_TRUE(IsError(AppendRange(cache, 0, 9, 10), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.Restore(0, std::nullopt, 9), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.Snapshot(0, 0).status(), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.CopyPrefix(0, 1, 9), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(IsError(cache.Remove(0, 0, kNoEnd), absl::StatusCode::kAborted, {"0"}));
  EXPECT_TRUE(SameState(pending, CaptureState(cache)));
  ASSERT_TRUE(AppendSpeculative(cache, 0, 9, 10).ok());
  ASSERT_TRUE(cache.CommitSpeculation(0, 4).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 10));
}

TEST(HybridSpeculationTest, RejectedTokensNeverOverwriteTheRingOrTheState) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());  // ring full, not wrapped
  // Four pending tokens map onto every ring row; rejecting them all must leave [0, 4).
  ASSERT_TRUE(AppendSpeculative(cache, 0, 4, 8, /*salt=*/5).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 4, kNoEnd, {Range(4, 8), {}, Range(4, 8)},
                     {Ids(0, Range(4, 8), 5), {StateId(0, 8, 5)}, Ids(0, Range(4, 8), 5)}));
  ASSERT_TRUE(cache.CommitSpeculation(0, 0).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 4));
  // Not wrapped: a live rewind still works after the rejection.
  EXPECT_TRUE(Resumes(cache, 0, 4));
  ASSERT_TRUE(AppendSpeculative(cache, 0, 4, 6).ok());
  ASSERT_TRUE(cache.CommitSpeculation(0, 1).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 5));
}

TEST(HybridSpeculationTest, NewSequenceAndPerSequenceStates) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 2).ok());
  // One speculative batch over two sequences: one state per token, in batch order.
  const std::vector<Token> tokens = {{1, 0}, {0, 2}, {1, 1}, {0, 3}};
  const std::vector<uint8_t> payload = PayloadFor(spec, tokens, 0, /*speculative=*/true);
  ASSERT_TRUE(cache.Append(tokens, payload, /*speculative=*/true).ok());
  EXPECT_EQ(FindSequence(cache, 0)->pending, 2);
  EXPECT_EQ(FindSequence(cache, 1)->pending, 2);
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{0, 1}, {}, {0, 1}},
                     {Ids(1, {0, 1}), {StateId(1, 2)}, Ids(1, {0, 1})}));
  ASSERT_TRUE(cache.CommitSpeculation(0, 1).ok());
  ASSERT_TRUE(cache.CommitSpeculation(1, 1).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 3));
  EXPECT_TRUE(HybridHolds(cache, 1, 1));
  // A new sequence whose pending tokens are all rejected is gone from every group.
  ASSERT_TRUE(AppendSpeculative(cache, 2, 0, 3).ok());
  ASSERT_TRUE(cache.CommitSpeculation(2, 0).ok());
  EXPECT_FALSE(FindSequence(cache, 2).has_value());
  EXPECT_EQ(cache.Usage().sequences_live, 2);
  EXPECT_EQ(cache.Usage().groups[1].cells_used, 2);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 4);
}

TEST(HybridSpeculationTest, CommittingIntoASharedStateLeavesTheOtherSequence) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 3).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 3).ok());
  ASSERT_TRUE(AppendSpeculative(cache, 1, 3, 5).ok());
  ASSERT_TRUE(cache.CommitSpeculation(1, 2).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 3));
  EXPECT_TRUE(
      ReadIs(cache, 1, 0, kNoEnd, {Range(1, 5), {}, Range(0, 5)},
             {{TokenId(0, 1), TokenId(0, 2), TokenId(1, 3), TokenId(1, 4)},
              {StateId(1, 5)},
              {TokenId(0, 0), TokenId(0, 1), TokenId(0, 2), TokenId(1, 3), TokenId(1, 4)}}));
}

TEST(HybridSpeculationTest, PendingDataComesFromTheCachePool) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec, CacheBytes(spec));  // no room beyond the group arenas
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(AppendSpeculative(cache, 0, 4, 6), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_EQ(tc.device->used_bytes(), CacheBytes(spec));
  ASSERT_TRUE(AppendRange(cache, 0, 4, 6).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 6));
}

TEST(HybridSpeculationTest, CommitOfNothingKeepsAnInvalidStateInvalid) {
  const CacheSpec spec = Spec(DType::kF16, 2, 32, 4, {RecurrentGroup(2, 2, 3, 1, 2, 2)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(cache.Remove(0, 2, kNoEnd).ok());  // invalid at offset 2
  ASSERT_TRUE(AppendSpeculative(cache, 0, 2, 4).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{}}, {{StateId(0, 4)}}));
  ASSERT_TRUE(cache.CommitSpeculation(0, 0).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{}}, {{}}, {StateStatus::kInvalid}));
  EXPECT_EQ(FindSequence(cache, 0)->offset, 2);
  EXPECT_FALSE(Resumes(cache, 0, 2));
  ASSERT_TRUE(AppendSpeculative(cache, 0, 2, 4).ok());
  ASSERT_TRUE(cache.CommitSpeculation(0, 1).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{}}, {{StateId(0, 3)}}));
  EXPECT_EQ(FindSequence(cache, 0)->groups[0].state, StateStatus::kValid);
  EXPECT_TRUE(Resumes(cache, 0, 3));
}

TEST(HybridSpeculationTest, RejectingOnASharedStateKeepsTheShare) {
  const CacheSpec spec = Spec(DType::kF16, 2, 32, 4, {RecurrentGroup(2, 2, 3, 1, 2, 2)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 3).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 3).ok());
  ASSERT_TRUE(AppendSpeculative(cache, 1, 3, 5).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{}}, {{StateId(1, 5)}}));
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{}}, {{StateId(0, 3)}}));
  ASSERT_TRUE(cache.CommitSpeculation(1, 0).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{}}, {{StateId(0, 3)}}));
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{}}, {{StateId(0, 3)}}));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 1);
  EXPECT_EQ(FindSequence(cache, 1)->groups[0].shared, 1);
}

}  // namespace
}  // namespace kvmesh
