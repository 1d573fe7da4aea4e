// Recurrent layer groups (docs/semantics.md "Recurrent groups"): the state from the payload,
// copy-on-write slots, invalidation by Remove, CanResume, slot reuse and exhaustion, with exact
// bytes and exact status codes.
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
using testutil::IsError;
using testutil::PayloadFor;
using testutil::ReadIs;
using testutil::RecurrentGroup;
using testutil::SameState;
using testutil::Spec;
using testutil::StateId;
using testutil::TestCache;
using testutil::Tokens;

constexpr auto kNoEnd = std::nullopt;

// 3 slots; 2 layers of conv [2][3] and delta [1][2][2].
CacheSpec StateSpec(DType dtype = DType::kF16) {
  return Spec(dtype, 3, 32, 8, {RecurrentGroup(2, 2, 3, 1, 2, 2)});
}

// Read(seq) returns exactly the state `id`.
::testing::AssertionResult HoldsState(const Cache& cache, int64_t seq, uint64_t id) {
  return ReadIs(cache, seq, 0, kNoEnd, {{}}, {{id}});
}

::testing::AssertionResult HoldsInvalidState(const Cache& cache, int64_t seq) {
  return ReadIs(cache, seq, 0, kNoEnd, {{}}, {{}}, {StateStatus::kInvalid});
}

class RecurrentByDtypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(RecurrentByDtypeTest, StateComesFromThePayload) {
  const CacheSpec spec = StateSpec(GetParam());
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 4)));
  const std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->offset, 4);
  ASSERT_EQ(info->groups.size(), 1u);
  EXPECT_EQ(info->groups[0].stored, 0);
  EXPECT_EQ(info->groups[0].shared, 0);
  EXPECT_EQ(info->groups[0].first, -1);
  EXPECT_EQ(info->groups[0].last, -1);
  EXPECT_EQ(info->groups[0].state, StateStatus::kValid);
  EXPECT_EQ(cache.Usage().groups[0].cells_total, 3);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 1);
  // The next Append replaces the state.
  ASSERT_TRUE(AppendRange(cache, 0, 4, 5, /*salt=*/1).ok());
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 5, 1)));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 1);
  // An interleaved batch carries one state per sequence in order of first appearance.
  ASSERT_TRUE(AppendTokens(cache, {{1, 0}, {0, 5}, {1, 1}, {0, 6}, {1, 2}}).ok());
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 7)));
  EXPECT_TRUE(HoldsState(cache, 1, StateId(1, 3)));
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, RecurrentByDtypeTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16));

TEST(RecurrentTest, ConvOnlyStates) {
  const CacheSpec spec = Spec(DType::kBF16, 2, 16, 4, {RecurrentGroup(3, 3, 5, 0, 0, 0)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 3).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 1).ok());
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 3)));
  EXPECT_TRUE(HoldsState(cache, 1, StateId(1, 1)));
}

TEST(RecurrentTest, ReadIncludesTheStateOnlyWhenTheRangeReachesTheOffset) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 5).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, 5, {{}}, {{StateId(0, 5)}}));
  EXPECT_TRUE(ReadIs(cache, 0, 3, 9, {{}}, {{StateId(0, 5)}}));
  EXPECT_TRUE(ReadIs(cache, 0, 5, kNoEnd, {{}}, {{StateId(0, 5)}}));
  EXPECT_TRUE(ReadIs(cache, 0, 0, 4, {{}}, {{}}, {StateStatus::kNone}));
  EXPECT_TRUE(ReadIs(cache, 0, 2, 2, {{}}, {{}}, {StateStatus::kNone}));
  EXPECT_TRUE(IsError(cache.Read(1, 0, kNoEnd).status(), absl::StatusCode::kNotFound, {"1"}));
}

TEST(RecurrentTest, AppendMustContinueAtTheOffsetAndCarryOneStatePerSequence) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(AppendRange(cache, 0, 5, 6), absl::StatusCode::kInvalidArgument, {"5", "4"}));
  EXPECT_TRUE(IsError(AppendRange(cache, 0, 3, 5), absl::StatusCode::kInvalidArgument, {"3", "4"}));
  EXPECT_TRUE(IsError(AppendRange(cache, 1, 2, 3), absl::StatusCode::kInvalidArgument, {"2", "0"}));
  // One state per token (the speculative layout) is the wrong size for a plain Append.
  const std::vector<Token> tokens = Tokens(0, 4, 6);
  const std::vector<uint8_t> per_token = PayloadFor(spec, tokens, 0, /*speculative=*/true);
  ASSERT_EQ(per_token.size(), AppendPayloadBytes(spec, 2, 1, true));
  EXPECT_TRUE(
      IsError(cache.Append(tokens, per_token), absl::StatusCode::kInvalidArgument,
              {std::to_string(per_token.size()), std::to_string(AppendPayloadBytes(spec, 2, 1))}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
}

TEST(RecurrentTest, CopyPrefixSharesTheSlotUntilEitherSequenceWrites) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 4).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 2, 100).ok());  // past the offset: the whole state
  for (int64_t seq : {0, 1, 2}) {
    EXPECT_TRUE(HoldsState(cache, seq, StateId(0, 4))) << seq;
    const std::optional<SequenceInfo> info = FindSequence(cache, seq);
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->offset, 4);
    EXPECT_EQ(info->groups[0].shared, 1) << seq;
    EXPECT_EQ(info->groups[0].state, StateStatus::kValid);
  }
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 1);
  EXPECT_EQ(cache.Usage().sequences_live, 3);

  // The destination writes: it gets a private slot, the others keep sharing the old state.
  ASSERT_TRUE(AppendRange(cache, 1, 4, 5).ok());
  EXPECT_TRUE(HoldsState(cache, 1, StateId(1, 5)));
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 4)));
  EXPECT_TRUE(HoldsState(cache, 2, StateId(0, 4)));
  EXPECT_EQ(FindSequence(cache, 1)->groups[0].shared, 0);
  EXPECT_EQ(FindSequence(cache, 0)->groups[0].shared, 1);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 2);

  // The source writes: same, the copy keeps the state it had.
  ASSERT_TRUE(AppendRange(cache, 0, 4, 6, /*salt=*/3).ok());
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 6, 3)));
  EXPECT_TRUE(HoldsState(cache, 2, StateId(0, 4)));
  EXPECT_TRUE(HoldsState(cache, 1, StateId(1, 5)));
  EXPECT_EQ(FindSequence(cache, 0)->groups[0].shared, 0);
  EXPECT_EQ(FindSequence(cache, 2)->groups[0].shared, 0);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 3);
  // The last holder of a once-shared slot writes in place: no extra slot needed.
  ASSERT_TRUE(AppendRange(cache, 2, 4, 5).ok());
  EXPECT_TRUE(HoldsState(cache, 2, StateId(2, 5)));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 3);
}

TEST(RecurrentTest, CopyPrefixOverAnExistingDestinationReleasesItsSlot) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 2).ok());
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 2);
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 4).ok());
  EXPECT_TRUE(HoldsState(cache, 1, StateId(0, 4)));
  EXPECT_EQ(FindSequence(cache, 1)->offset, 4);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 1);
  // From a sequence that stores nothing: dst is emptied.
  ASSERT_TRUE(cache.CopyPrefix(7, 1, 4).ok());
  EXPECT_FALSE(FindSequence(cache, 1).has_value());
  EXPECT_EQ(FindSequence(cache, 0)->groups[0].shared, 0);
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 4)));
}

TEST(RecurrentTest, CopyPrefixBelowTheSourceOffsetIsRefused) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 2).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(
      IsError(cache.CopyPrefix(0, 1, 3), absl::StatusCode::kFailedPrecondition, {"3", "4"}));
  EXPECT_TRUE(
      IsError(cache.CopyPrefix(0, 2, 1), absl::StatusCode::kFailedPrecondition, {"1", "4"}));
  EXPECT_TRUE(
      IsError(cache.CopyPrefix(0, 1, 0), absl::StatusCode::kFailedPrecondition, {"0", "4"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
}

TEST(RecurrentTest, RemoveBelowTheOffsetInvalidatesTheState) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  // At or past the offset nothing changes.
  ASSERT_TRUE(cache.Remove(0, 4, kNoEnd).ok());
  ASSERT_TRUE(cache.Remove(0, 6, 8).ok());
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 4)));
  EXPECT_EQ(FindSequence(cache, 0)->groups[0].state, StateStatus::kValid);

  ASSERT_TRUE(cache.Remove(0, 2, kNoEnd).ok());
  std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());  // still live: it holds an invalid state
  EXPECT_EQ(info->offset, 2);
  EXPECT_EQ(info->groups[0].state, StateStatus::kInvalid);
  EXPECT_TRUE(HoldsInvalidState(cache, 0));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 0);  // the slot was released
  EXPECT_EQ(cache.Usage().sequences_live, 1);
  for (int32_t pos : {0, 2, 4}) {
    absl::StatusOr<bool> resume = cache.CanResume(0, pos);
    ASSERT_TRUE(resume.ok()) << resume.status();
    EXPECT_FALSE(*resume) << pos;
  }
  EXPECT_TRUE(IsError(cache.Snapshot(0, 0).status(), absl::StatusCode::kFailedPrecondition));
  // The next plain Append continues at the new offset and makes the state valid.
  EXPECT_TRUE(IsError(AppendRange(cache, 0, 4, 5), absl::StatusCode::kInvalidArgument, {"4", "2"}));
  ASSERT_TRUE(AppendRange(cache, 0, 2, 3, /*salt=*/5).ok());
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 3, 5)));
  info = FindSequence(cache, 0);
  EXPECT_EQ(info->offset, 3);
  EXPECT_EQ(info->groups[0].state, StateStatus::kValid);
  absl::StatusOr<bool> resume = cache.CanResume(0, 3);
  ASSERT_TRUE(resume.ok());
  EXPECT_TRUE(*resume);
}

TEST(RecurrentTest, MiddleRemovalInvalidatesAndMovesTheOffset) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  ASSERT_TRUE(cache.Remove(0, 1, 3).ok());
  std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->offset, 4);
  EXPECT_EQ(info->groups[0].state, StateStatus::kInvalid);
  EXPECT_TRUE(HoldsInvalidState(cache, 0));
  // Removing more of an invalid state keeps it invalid.
  ASSERT_TRUE(cache.Remove(0, 3, kNoEnd).ok());
  info = FindSequence(cache, 0);
  EXPECT_EQ(info->offset, 3);
  EXPECT_EQ(info->groups[0].state, StateStatus::kInvalid);
  // From 0 the sequence leaves the group entirely.
  ASSERT_TRUE(cache.Remove(0, 0, kNoEnd).ok());
  EXPECT_FALSE(FindSequence(cache, 0).has_value());
  EXPECT_EQ(cache.Usage().sequences_live, 0);
  EXPECT_TRUE(IsError(cache.Read(0, 0, kNoEnd).status(), absl::StatusCode::kNotFound));
}

TEST(RecurrentTest, RemovingFromASharedStateInvalidatesOnlyThatSequence) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 4).ok());
  ASSERT_TRUE(cache.Remove(1, 3, kNoEnd).ok());
  EXPECT_TRUE(HoldsInvalidState(cache, 1));
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 4)));
  EXPECT_EQ(FindSequence(cache, 0)->groups[0].shared, 0);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 1);
  // Copying an invalid state copies its validity and offset.
  ASSERT_TRUE(cache.CopyPrefix(1, 2, 3).ok());
  EXPECT_TRUE(HoldsInvalidState(cache, 2));
  EXPECT_EQ(FindSequence(cache, 2)->offset, 3);
  EXPECT_EQ(FindSequence(cache, 2)->groups[0].state, StateStatus::kInvalid);
}

TEST(RecurrentTest, ReusedSlotsNeverShowStaleData) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  for (int64_t seq = 0; seq < 3; ++seq) ASSERT_TRUE(AppendRange(cache, seq, 0, 2).ok());
  ASSERT_TRUE(cache.Remove(1, 0, kNoEnd).ok());
  ASSERT_TRUE(AppendRange(cache, 5, 0, 1).ok());
  EXPECT_TRUE(HoldsState(cache, 5, StateId(5, 1)));
  ASSERT_TRUE(cache.Remove(0, 1, kNoEnd).ok());  // invalid, slot released
  ASSERT_TRUE(cache.Remove(2, 0, kNoEnd).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 1, 2, /*salt=*/9).ok());
  ASSERT_TRUE(AppendRange(cache, 6, 0, 3).ok());
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 2, 9)));
  EXPECT_TRUE(HoldsState(cache, 5, StateId(5, 1)));
  EXPECT_TRUE(HoldsState(cache, 6, StateId(6, 3)));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 3);
}

TEST(RecurrentTest, SlotsRunOutWithMaxSequences) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  for (int64_t seq = 0; seq < 3; ++seq) ASSERT_TRUE(AppendRange(cache, seq, 0, 2).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(AppendRange(cache, 3, 0, 1), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(IsError(cache.CopyPrefix(0, 3, 2), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // Sharing frees nothing for a new sequence, but a dropped one does.
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 2).ok());
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 2);
  EXPECT_TRUE(IsError(AppendRange(cache, 3, 0, 1), absl::StatusCode::kResourceExhausted));
  ASSERT_TRUE(AppendRange(cache, 1, 2, 3).ok());  // private copy: a third slot
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 3);
  ASSERT_TRUE(cache.Remove(2, 0, kNoEnd).ok());
  ASSERT_TRUE(AppendRange(cache, 3, 0, 1).ok());
  EXPECT_TRUE(HoldsState(cache, 3, StateId(3, 1)));
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 2)));
  EXPECT_TRUE(HoldsState(cache, 1, StateId(1, 3)));
  // An invalid state keeps its sequence live: it still counts against max_sequences.
  ASSERT_TRUE(cache.Remove(0, 1, kNoEnd).ok());
  EXPECT_EQ(cache.Usage().sequences_live, 3);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 2);
  EXPECT_TRUE(IsError(AppendRange(cache, 4, 0, 1), absl::StatusCode::kResourceExhausted));
}

TEST(RecurrentTest, CanResumeOnlyAtTheOffsetOfAValidState) {
  const CacheSpec spec = StateSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  for (int32_t pos : {0, 1, 3, 4, 5}) {
    absl::StatusOr<bool> resume = cache.CanResume(0, pos);
    ASSERT_TRUE(resume.ok()) << resume.status();
    EXPECT_EQ(*resume, pos == 4) << pos;
  }
}

// Slots == max_sequences and a live sequence needs at most one, so an Append within
// max_sequences never runs out of slots, even when every sharer of a slot writes in one batch.
TEST(RecurrentTest, BatchWritingEverySharerOfASlotFits) {
  const CacheSpec spec = StateSpec();  // 3 slots
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 3).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 3).ok());
  ASSERT_TRUE(AppendRange(cache, 2, 0, 1).ok());
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 2);
  ASSERT_TRUE(AppendTokens(cache, {{0, 3}, {1, 3}, {1, 4}}).ok());
  EXPECT_TRUE(HoldsState(cache, 0, StateId(0, 4)));
  EXPECT_TRUE(HoldsState(cache, 1, StateId(1, 5)));
  EXPECT_TRUE(HoldsState(cache, 2, StateId(2, 1)));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 3);
}

}  // namespace
}  // namespace kvmesh
