// Snapshots (docs/semantics.md "Snapshots"): Snapshot, Restore with and without a snapshot,
// MergeSnapshots, SplitSnapshot, DropSnapshot, ListSnapshots and the snapshot pool, per group
// kind, with exact bytes and exact status codes.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::CacheState;
using testutil::CaptureState;
using testutil::FindSequence;
using testutil::Full;
using testutil::Group;
using testutil::Ids;
using testutil::IsError;
using testutil::Range;
using testutil::ReadIs;
using testutil::RecurrentGroup;
using testutil::Rope;
using testutil::RotatingGroup;
using testutil::SameState;
using testutil::Spec;
using testutil::StateId;
using testutil::TestCache;
using testutil::TokenId;

using Positions = std::vector<std::vector<int32_t>>;
using IdLists = std::vector<std::vector<uint64_t>>;
constexpr auto kNoEnd = std::nullopt;
constexpr auto kLive = std::nullopt;  // Restore without a snapshot

// Attention only: 4 sequences, 2 layers, NORMAL rope.
CacheSpec AttentionSpec() {
  return Spec(DType::kF16, 4, 32, 16, {Group(Full(), 2, 1, 4, 4, Rope(RopeType::kNormal, 4))});
}

// Rotating (rings of 4), Recurrent and Attention, in that order.
CacheSpec HybridSpec() {
  return Spec(DType::kF16, 3, 16, 8,
              {RotatingGroup(4, 2, 1, 4, 4), RecurrentGroup(2, 2, 3, 1, 2, 2),
               Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4))});
}

std::vector<uint64_t> Concat(std::vector<uint64_t> a, const std::vector<uint64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Rows of an attention-only cache.
::testing::AssertionResult AttentionHolds(const Cache& cache, int64_t seq,
                                          const std::vector<int32_t>& positions,
                                          const std::vector<uint64_t>& ids) {
  return ReadIs(cache, seq, 0, kNoEnd, {positions}, {ids});
}

// A hybrid sequence whose data is that of `src` appended at [0, n) with salt 0.
::testing::AssertionResult HybridHolds(const Cache& cache, int64_t seq, int64_t src, int32_t n) {
  const std::vector<int32_t> window = Range(std::max(0, n - 4), n);
  return ReadIs(cache, seq, 0, kNoEnd, {window, {}, Range(0, n)},
                {Ids(src, window), {StateId(src, n)}, Ids(src, Range(0, n))});
}

// ---- Snapshot -------------------------------------------------------------------------------

TEST(SnapshotTest, CopiesTheRangeIntoTheSnapshotPool) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  const size_t cache_bytes = tc.device->used_bytes(MemoryPool::kCache);
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 4);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->id, 1u);
  EXPECT_EQ(snap->seq, 0);
  EXPECT_EQ(snap->from, 4);
  EXPECT_EQ(snap->to, 10);
  EXPECT_EQ(snap->bytes, 6 * GroupTokenBytes(spec, 0));
  ASSERT_EQ(snap->groups.size(), 1u);
  EXPECT_EQ(snap->groups[0].stored, 6);
  EXPECT_EQ(snap->groups[0].ring_index, -1);
  EXPECT_EQ(snap->groups[0].state, StateStatus::kNone);
  // Snapshot data lives in the snapshot pool, not the cache pool.
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kCache), cache_bytes);
  EXPECT_GE(tc.device->used_bytes(MemoryPool::kSnapshot), snap->bytes);
  const CacheUsage usage = cache.Usage();
  EXPECT_EQ(usage.snapshots, 1);
  EXPECT_EQ(usage.snapshot_bytes, tc.device->used_bytes(MemoryPool::kSnapshot));
  EXPECT_EQ(usage.bytes_held, CacheBytes(spec));
  // The live sequence is untouched; ids go up.
  EXPECT_TRUE(AttentionHolds(cache, 0, Range(0, 10), Ids(0, Range(0, 10))));
  absl::StatusOr<SnapshotInfo> second = cache.Snapshot(0, 0);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->id, 2u);
  EXPECT_EQ(second->bytes, 10 * GroupTokenBytes(spec, 0));
  const std::vector<SnapshotInfo> list = cache.ListSnapshots();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].id, 1u);
  EXPECT_EQ(list[0].from, 4);
  EXPECT_EQ(list[1].id, 2u);
  EXPECT_EQ(list[1].from, 0);
  EXPECT_EQ(list[1].to, 10);
}

TEST(SnapshotTest, CountsOnlyStoredPositionsInTheRange) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(testutil::AppendTokens(cache, {{0, 0}, {0, 3}, {0, 4}, {0, 9}}).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 2);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->from, 2);
  EXPECT_EQ(snap->to, 10);
  EXPECT_EQ(snap->groups[0].stored, 3);
  EXPECT_EQ(snap->bytes, 3 * GroupTokenBytes(spec, 0));
  // Restored into a new sequence from 0: nothing below 2, then 3, 4 and 9.
  ASSERT_TRUE(cache.Remove(0, 0, kNoEnd).ok());
  ASSERT_TRUE(testutil::AppendTokens(cache, {{0, 1}}).ok());
  ASSERT_TRUE(cache.Restore(0, snap->id, 10).ok());
  EXPECT_TRUE(AttentionHolds(cache, 0, {1, 3, 4, 9}, Ids(0, {1, 3, 4, 9})));
}

TEST(SnapshotTest, RefusalsCreateNothing) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 3).ok());
  ASSERT_TRUE(cache.Remove(1, 2, kNoEnd).ok());  // invalid state
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.Snapshot(5, 0).status(), absl::StatusCode::kNotFound, {"5"}));
  EXPECT_TRUE(IsError(cache.Snapshot(0, 6).status(), absl::StatusCode::kFailedPrecondition, {"6"}));
  EXPECT_TRUE(
      IsError(cache.Snapshot(0, 9).status(), absl::StatusCode::kFailedPrecondition, {"9", "6"}));
  EXPECT_TRUE(IsError(cache.Snapshot(0, -1).status(), absl::StatusCode::kInvalidArgument, {"-1"}));
  EXPECT_TRUE(IsError(cache.Snapshot(1, 0).status(), absl::StatusCode::kFailedPrecondition));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_TRUE(cache.ListSnapshots().empty());
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), 0u);
  // Ids still start at 1.
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 5);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->id, 1u);
}

TEST(SnapshotTest, RotatingAndRecurrentGroupsCopyTheWholeWindowAndState) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 5);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->from, 5);
  EXPECT_EQ(snap->to, 6);
  ASSERT_EQ(snap->groups.size(), 3u);
  EXPECT_EQ(snap->groups[0].stored, 4);  // window [2, 6)
  EXPECT_EQ(snap->groups[0].ring_index, 2);
  EXPECT_EQ(snap->groups[1].state, StateStatus::kValid);
  EXPECT_EQ(snap->groups[1].ring_index, -1);
  EXPECT_EQ(snap->groups[2].stored, 1);
  EXPECT_EQ(snap->groups[2].state, StateStatus::kNone);
  EXPECT_EQ(snap->bytes,
            4 * GroupTokenBytes(spec, 0) + GroupStateBytes(spec, 1) + GroupTokenBytes(spec, 2));
  // Before the wrap the window is [0, to) and the ring index is to.
  ASSERT_TRUE(AppendRange(cache, 1, 0, 3).ok());
  snap = cache.Snapshot(1, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->groups[0].stored, 3);
  EXPECT_EQ(snap->groups[0].ring_index, 3);
  EXPECT_EQ(snap->groups[2].stored, 3);
}

TEST(SnapshotTest, IsIndependentOfLaterChangesToTheSequence) {
  const CacheSpec spec = AttentionSpec();  // NORMAL rope: a middle removal rotates keys
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(cache.Remove(0, 2, 4).ok());  // rotates the keys of 4..9 in place
  ASSERT_TRUE(AppendRange(cache, 0, 8, 12, /*salt=*/3).ok());
  ASSERT_TRUE(cache.Restore(1, snap->id, 10).ok());
  EXPECT_TRUE(AttentionHolds(cache, 1, Range(0, 10), Ids(0, Range(0, 10))));
  // And restoring over the changed sequence itself.
  ASSERT_TRUE(cache.Restore(0, snap->id, 10).ok());
  EXPECT_TRUE(AttentionHolds(cache, 0, Range(0, 10), Ids(0, Range(0, 10))));
}

// ---- Restore from a snapshot: attention --------------------------------------------------------

TEST(RestoreTest, IntoTheSameSequenceAfterItChanged) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 4);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(cache.Remove(0, 4, kNoEnd).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 4, 13, /*salt=*/1).ok());
  ASSERT_TRUE(cache.Restore(0, snap->id, 10).ok());
  EXPECT_TRUE(AttentionHolds(cache, 0, Range(0, 10), Ids(0, Range(0, 10))));
  EXPECT_EQ(FindSequence(cache, 0)->offset, 10);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 10);
  // The snapshot stays and can be restored again, clamped.
  ASSERT_EQ(cache.ListSnapshots().size(), 1u);
  ASSERT_TRUE(cache.Restore(0, snap->id, 7).ok());
  EXPECT_TRUE(AttentionHolds(cache, 0, Range(0, 7), Ids(0, Range(0, 7))));
  // A target below the snapshot's start keeps only the sequence's own positions below it.
  ASSERT_TRUE(cache.Restore(0, snap->id, 2).ok());
  EXPECT_TRUE(AttentionHolds(cache, 0, {0, 1}, Ids(0, {0, 1})));
  EXPECT_EQ(FindSequence(cache, 0)->offset, 2);
}

TEST(RestoreTest, IntoAnotherSequenceKeepsItsOwnPrefix) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 12, /*salt=*/2).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 4);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(cache.Restore(1, snap->id, 10).ok());
  EXPECT_TRUE(
      AttentionHolds(cache, 1, Range(0, 10), Concat(Ids(1, Range(0, 4), 2), Ids(0, Range(4, 10)))));
  EXPECT_TRUE(AttentionHolds(cache, 0, Range(0, 10), Ids(0, Range(0, 10))));
  // Restored cells are the sequence's own: dropping the source changes nothing.
  ASSERT_TRUE(cache.Remove(0, 0, kNoEnd).ok());
  EXPECT_TRUE(
      AttentionHolds(cache, 1, Range(0, 10), Concat(Ids(1, Range(0, 4), 2), Ids(0, Range(4, 10)))));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 10);
}

TEST(RestoreTest, IntoANewSequenceForksFromACheckpoint) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 8).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(cache.Remove(0, 0, kNoEnd).ok());  // the snapshot outlives its sequence
  ASSERT_TRUE(cache.Restore(5, snap->id, 8).ok());
  ASSERT_TRUE(cache.Restore(6, snap->id, 3).ok());
  EXPECT_TRUE(AttentionHolds(cache, 5, Range(0, 8), Ids(0, Range(0, 8))));
  EXPECT_TRUE(AttentionHolds(cache, 6, Range(0, 3), Ids(0, Range(0, 3))));
  EXPECT_EQ(cache.Usage().sequences_live, 2);
  ASSERT_TRUE(AppendRange(cache, 6, 3, 5).ok());
  EXPECT_TRUE(
      AttentionHolds(cache, 6, Range(0, 5), Concat(Ids(0, Range(0, 3)), Ids(6, Range(3, 5)))));
  EXPECT_TRUE(AttentionHolds(cache, 5, Range(0, 8), Ids(0, Range(0, 8))));
}

TEST(RestoreTest, RefusalsLeaveTheCacheAsBefore) {
  const CacheSpec spec = Spec(DType::kF16, 2, 8, 16, {Group(Full())});  // 16 cells
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  absl::StatusOr<SnapshotInfo> whole = cache.Snapshot(0, 0);  // [0, 10)
  absl::StatusOr<SnapshotInfo> tail = cache.Snapshot(0, 5);   // [5, 10)
  ASSERT_TRUE(whole.ok() && tail.ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 3).ok());
  const CacheState before = CaptureState(cache);
  // target past the snapshot's end.
  EXPECT_TRUE(
      IsError(cache.Restore(0, tail->id, 11), absl::StatusCode::kFailedPrecondition, {"11", "10"}));
  // The sequence's offset (3) is below the snapshot's start (5); a new sequence's is 0.
  EXPECT_TRUE(
      IsError(cache.Restore(1, tail->id, 10), absl::StatusCode::kFailedPrecondition, {"3", "5"}));
  EXPECT_TRUE(
      IsError(cache.Restore(3, tail->id, 10), absl::StatusCode::kFailedPrecondition, {"0", "5"}));
  EXPECT_TRUE(IsError(cache.Restore(1, 99, 8), absl::StatusCode::kNotFound, {"99"}));
  // A third sequence exceeds max_sequences.
  EXPECT_TRUE(IsError(cache.Restore(2, whole->id, 2), absl::StatusCode::kResourceExhausted));
  // [0, 10) into seq 1 needs 10 new cells: 3 are free and seq 1's own 3 would be released.
  EXPECT_TRUE(IsError(cache.Restore(1, whole->id, 10), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_EQ(cache.ListSnapshots().size(), 2u);
  ASSERT_TRUE(cache.Remove(1, 0, kNoEnd).ok());
  ASSERT_TRUE(cache.Restore(1, whole->id, 6).ok());
  EXPECT_TRUE(AttentionHolds(cache, 1, Range(0, 6), Ids(0, Range(0, 6))));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 16);
}

// ---- Restore without a snapshot: live rewind ----------------------------------------------------

TEST(LiveRewindTest, AttentionDropsPositionsAtOrAboveTheTarget) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(
      IsError(cache.Restore(0, kLive, 11), absl::StatusCode::kFailedPrecondition, {"11", "10"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(cache.Restore(0, kLive, 10).ok());
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(cache.Restore(0, kLive, 6).ok());
  EXPECT_TRUE(AttentionHolds(cache, 0, Range(0, 6), Ids(0, Range(0, 6))));
  EXPECT_EQ(FindSequence(cache, 0)->offset, 6);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 6);
  // A sequence that stores nothing accepts only target 0.
  ASSERT_TRUE(cache.Restore(3, kLive, 0).ok());
  EXPECT_FALSE(FindSequence(cache, 3).has_value());
  EXPECT_TRUE(IsError(cache.Restore(3, kLive, 1), absl::StatusCode::kFailedPrecondition, {"1"}));
  ASSERT_TRUE(cache.Restore(0, kLive, 0).ok());
  EXPECT_FALSE(FindSequence(cache, 0).has_value());
}

TEST(LiveRewindTest, RotatingRewindsOnlyBeforeTheWrap) {
  const CacheSpec spec = Spec(DType::kF32, 2, 16, 8, {RotatingGroup(4, 1, 1, 4, 4), Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());  // offset == max_size: not wrapped
  ASSERT_TRUE(AppendRange(cache, 1, 0, 5).ok());  // wrapped
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.Restore(1, kLive, 4), absl::StatusCode::kFailedPrecondition, {"4"}));
  EXPECT_TRUE(IsError(cache.Restore(0, kLive, 5), absl::StatusCode::kFailedPrecondition, {"5"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(cache.Restore(1, kLive, 5).ok());
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(cache.Restore(0, kLive, 2).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{0, 1}, {0, 1}}, {Ids(0, {0, 1}), Ids(0, {0, 1})}));
  ASSERT_TRUE(AppendRange(cache, 0, 2, 7, /*salt=*/1).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(3, 7), Range(0, 7)},
                     {Ids(0, Range(3, 7), 1), Concat(Ids(0, {0, 1}), Ids(0, Range(2, 7), 1))}));
}

TEST(LiveRewindTest, RecurrentOnlyAtTheOffset) {
  const CacheSpec spec = Spec(DType::kF16, 2, 16, 8, {RecurrentGroup(2, 2, 3, 1, 2, 2)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(
      IsError(cache.Restore(0, kLive, 3), absl::StatusCode::kFailedPrecondition, {"3", "4"}));
  EXPECT_TRUE(
      IsError(cache.Restore(0, kLive, 0), absl::StatusCode::kFailedPrecondition, {"0", "4"}));
  EXPECT_TRUE(
      IsError(cache.Restore(0, kLive, 5), absl::StatusCode::kFailedPrecondition, {"5", "4"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(cache.Restore(0, kLive, 4).ok());
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
}

// ---- Restore from a snapshot: rotating and recurrent --------------------------------------------

TEST(RestoreTest, HybridRestoreReplacesWindowAndState) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 3);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(AppendRange(cache, 0, 6, 9, /*salt=*/1).ok());
  ASSERT_TRUE(cache.Restore(0, snap->id, 6).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 0, 6));
  std::optional<SequenceInfo> info = FindSequence(cache, 0);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->offset, 6);
  EXPECT_EQ(info->groups[1].state, StateStatus::kValid);
  absl::StatusOr<bool> resume = cache.CanResume(0, 6);
  ASSERT_TRUE(resume.ok());
  EXPECT_TRUE(*resume);
  // The restored ring continues correctly past its index.
  ASSERT_TRUE(AppendRange(cache, 0, 6, 8).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 0, 8));
  // And again, from the sequence's new state.
  ASSERT_TRUE(cache.Restore(0, snap->id, 6).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 0, 6));
}

TEST(RestoreTest, HybridRestoreIntoAnotherAndANewSequence) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 5, /*salt=*/4).ok());
  absl::StatusOr<SnapshotInfo> from0 = cache.Snapshot(0, 0);
  absl::StatusOr<SnapshotInfo> from3 = cache.Snapshot(0, 3);
  ASSERT_TRUE(from0.ok() && from3.ok());
  ASSERT_TRUE(cache.Restore(2, from0->id, 6).ok());
  EXPECT_TRUE(HybridHolds(cache, 2, 0, 6));
  // Seq 1 keeps its attention positions below 3; ring and state are the snapshot's.
  ASSERT_TRUE(cache.Restore(1, from3->id, 6).ok());
  EXPECT_TRUE(ReadIs(
      cache, 1, 0, kNoEnd, {Range(2, 6), {}, Range(0, 6)},
      {Ids(0, Range(2, 6)), {StateId(0, 6)}, Concat(Ids(1, Range(0, 3), 4), Ids(0, Range(3, 6)))}));
  // The restored state is private: appending to seq 2 leaves seq 0 alone.
  ASSERT_TRUE(AppendRange(cache, 2, 6, 7, /*salt=*/7).ok());
  EXPECT_TRUE(HybridHolds(cache, 0, 0, 6));
  EXPECT_TRUE(ReadIs(cache, 2, 6, kNoEnd, {{6}, {}, {6}},
                     {Ids(2, {6}, 7), {StateId(2, 7, 7)}, Ids(2, {6}, 7)}));
}

TEST(RestoreTest, HybridRefusals) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  const CacheState before = CaptureState(cache);
  // Recurrent: target != snapshot end (the ring, wrapped at 6 > 4, would refuse too).
  EXPECT_TRUE(
      IsError(cache.Restore(0, snap->id, 5), absl::StatusCode::kFailedPrecondition, {"5", "6"}));
  EXPECT_TRUE(
      IsError(cache.Restore(1, snap->id, 2), absl::StatusCode::kFailedPrecondition, {"2", "6"}));
  EXPECT_TRUE(
      IsError(cache.Restore(0, snap->id, 7), absl::StatusCode::kFailedPrecondition, {"7", "6"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
}

TEST(RestoreTest, RotatingClampOnlyWhenTheWindowIsComplete) {
  const CacheSpec spec = Spec(DType::kF16, 2, 16, 8, {RotatingGroup(4, 1, 1, 4, 4), Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 3).ok());
  absl::StatusOr<SnapshotInfo> early = cache.Snapshot(0, 0);  // [0, 3), to <= max_size
  ASSERT_TRUE(early.ok());
  ASSERT_TRUE(AppendRange(cache, 0, 3, 6).ok());
  absl::StatusOr<SnapshotInfo> late = cache.Snapshot(0, 0);  // [0, 6), to > max_size
  ASSERT_TRUE(late.ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.Restore(0, late->id, 5), absl::StatusCode::kFailedPrecondition, {"5"}));
  EXPECT_TRUE(IsError(cache.Restore(1, late->id, 2), absl::StatusCode::kFailedPrecondition, {"2"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(cache.Restore(1, early->id, 2).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{0, 1}, {0, 1}}, {Ids(0, {0, 1}), Ids(0, {0, 1})}));
  ASSERT_TRUE(cache.Restore(0, late->id, 6).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(2, 6), Range(0, 6)},
                     {Ids(0, Range(2, 6)), Ids(0, Range(0, 6))}));
  ASSERT_TRUE(cache.Restore(0, early->id, 3).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {Range(0, 3), Range(0, 3)},
                     {Ids(0, Range(0, 3)), Ids(0, Range(0, 3))}));
}

TEST(RestoreTest, RecurrentOnlyCacheRestoresAnySequenceAtTheSnapshotEnd) {
  const CacheSpec spec = Spec(DType::kF32, 2, 16, 8, {RecurrentGroup(2, 2, 3, 1, 2, 2)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 2);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->bytes, GroupStateBytes(spec, 0));
  EXPECT_TRUE(
      IsError(cache.Restore(1, snap->id, 3), absl::StatusCode::kFailedPrecondition, {"3", "4"}));
  ASSERT_TRUE(cache.Restore(1, snap->id, 4).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{}}, {{StateId(0, 4)}}));
  EXPECT_EQ(FindSequence(cache, 1)->offset, 4);
  ASSERT_TRUE(AppendRange(cache, 0, 4, 6).ok());
  ASSERT_TRUE(cache.Remove(0, 1, kNoEnd).ok());  // invalid
  ASSERT_TRUE(cache.Restore(0, snap->id, 4).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{}}, {{StateId(0, 4)}}));
  EXPECT_EQ(FindSequence(cache, 0)->groups[0].state, StateStatus::kValid);
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{}}, {{StateId(0, 4)}}));
  // Both hold their own copy.
  ASSERT_TRUE(AppendRange(cache, 1, 4, 5).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{}}, {{StateId(0, 4)}}));
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{}}, {{StateId(1, 5)}}));
}

TEST(RestoreTest, RecurrentRestoreNeverWritesASharedSlot) {
  const CacheSpec spec = Spec(DType::kF16, 3, 16, 8, {RecurrentGroup(2, 2, 3, 1, 2, 2)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 2, 0, 5).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(2, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(AppendRange(cache, 0, 0, 5, /*salt=*/1).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 5).ok());
  // The destination of the copy is restored: the source keeps the shared state.
  ASSERT_TRUE(cache.Restore(1, snap->id, 5).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{}}, {{StateId(2, 5)}}));
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{}}, {{StateId(0, 5, 1)}}));
  EXPECT_EQ(FindSequence(cache, 0)->groups[0].shared, 0);
  // The source of a copy is restored: the copy keeps the shared state.
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 5).ok());
  ASSERT_TRUE(cache.Restore(0, snap->id, 5).ok());
  EXPECT_TRUE(ReadIs(cache, 0, 0, kNoEnd, {{}}, {{StateId(2, 5)}}));
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{}}, {{StateId(0, 5, 1)}}));
  EXPECT_TRUE(ReadIs(cache, 2, 0, kNoEnd, {{}}, {{StateId(2, 5)}}));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 3);
}

TEST(SnapshotPoolTest, APoolOneByteShortHoldsNothingAfterTheRefusal) {
  const CacheSpec spec = HybridSpec();
  size_t one = 0;
  {
    TestCache probe(spec);
    ASSERT_NE(probe.cache, nullptr);
    ASSERT_TRUE(AppendRange(*probe.cache, 0, 0, 6).ok());
    ASSERT_TRUE(probe.cache->Snapshot(0, 0).ok());
    one = probe.device->used_bytes(MemoryPool::kSnapshot);
  }
  TestCache tc(spec, size_t{1} << 24, one - 1);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.Snapshot(0, 0).status(), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), 0u);
  // A smaller snapshot (fewer attention rows) still fits.
  absl::StatusOr<SnapshotInfo> small = cache.Snapshot(0, 5);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->id, cache.ListSnapshots().back().id);
}

TEST(RestoreTest, HybridRestoreOutOfCellsChangesNoGroup) {
  // Capacity 8: 24 attention cells.
  const CacheSpec spec = Spec(DType::kF16, 3, 8, 8,
                              {RotatingGroup(4, 2, 1, 4, 4), RecurrentGroup(2, 2, 3, 1, 2, 2),
                               Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 8).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 8).ok());  // shares all 8 cells: restoring frees none
  ASSERT_TRUE(AppendRange(cache, 2, 0, 6).ok());
  ASSERT_TRUE(AppendRange(cache, 2, 6, 12).ok());             // 8 + 12 = 20 of 24 cells used
  ASSERT_TRUE(AppendRange(cache, 1, 8, 9, /*salt=*/1).ok());  // 21: seq 1 rewrote ring and state
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.Restore(1, snap->id, 8), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(cache.Remove(2, 0, kNoEnd).ok());
  ASSERT_TRUE(cache.Restore(1, snap->id, 8).ok());
  EXPECT_TRUE(HybridHolds(cache, 1, 0, 8));
}

TEST(SnapshotTest, RingIndexWrapsToZeroAtMaxSize) {
  const CacheSpec spec = Spec(DType::kF16, 2, 16, 8, {RotatingGroup(4, 1, 1, 4, 4)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  absl::StatusOr<SnapshotInfo> four = cache.Snapshot(0, 3);
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_EQ(four->groups[0].ring_index, 0);
  EXPECT_EQ(four->groups[0].stored, 4);
  ASSERT_TRUE(AppendRange(cache, 0, 4, 9).ok());
  absl::StatusOr<SnapshotInfo> nine = cache.Snapshot(0, 8);
  ASSERT_TRUE(nine.ok()) << nine.status();
  EXPECT_EQ(nine->groups[0].ring_index, 1);
  // Restoring [0, 4) with its full ring and clamping it (to == max_size is complete).
  ASSERT_TRUE(cache.Restore(1, four->id, 2).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {{0, 1}}, {Ids(0, {0, 1})}));
  ASSERT_TRUE(cache.Restore(1, nine->id, 9).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {Range(5, 9)}, {Ids(0, Range(5, 9))}));
  ASSERT_TRUE(AppendRange(cache, 1, 9, 11).ok());
  EXPECT_TRUE(ReadIs(cache, 1, 0, kNoEnd, {Range(7, 11)},
                     {{TokenId(0, 7), TokenId(0, 8), TokenId(1, 9), TokenId(1, 10)}}));
}

TEST(RestoreTest, IntoASequenceSharingCellsLeavesTheOtherSequence) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  ASSERT_TRUE(AppendRange(cache, 2, 0, 10, /*salt=*/6).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(2, 4);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 10).ok());
  ASSERT_TRUE(cache.Restore(1, snap->id, 10).ok());
  EXPECT_TRUE(
      AttentionHolds(cache, 1, Range(0, 10), Concat(Ids(0, Range(0, 4)), Ids(2, Range(4, 10), 6))));
  EXPECT_TRUE(AttentionHolds(cache, 0, Range(0, 10), Ids(0, Range(0, 10))));
  EXPECT_EQ(FindSequence(cache, 0)->groups[0].shared, 4);
  EXPECT_EQ(FindSequence(cache, 1)->groups[0].shared, 4);
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 10 + 10 + 6);
}

TEST(SnapshotPoolTest, SplitHalvesReturnTheirBytesOnlyWhenBothAreDropped) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 0);
  ASSERT_TRUE(snap.ok());
  const size_t pool = tc.device->used_bytes(MemoryPool::kSnapshot);
  absl::StatusOr<SplitResult> split = cache.SplitSnapshot(snap->id, 3);
  ASSERT_TRUE(split.ok() && split->parent.has_value() && split->child.has_value());
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), pool);  // Split moves no data
  EXPECT_EQ(cache.Usage().snapshots, 2);
  ASSERT_TRUE(cache.DropSnapshot(split->parent->id).ok());
  // The child still restores exactly (into a sequence that reaches its start, 3).
  EXPECT_TRUE(IsError(cache.Restore(1, split->child->id, 10), absl::StatusCode::kFailedPrecondition,
                      {"0", "3"}));
  ASSERT_TRUE(cache.Remove(0, 3, kNoEnd).ok());
  ASSERT_TRUE(cache.Restore(0, split->child->id, 10).ok());
  EXPECT_TRUE(AttentionHolds(cache, 0, Range(0, 10), Ids(0, Range(0, 10))));
  ASSERT_TRUE(cache.DropSnapshot(split->child->id).ok());
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), 0u);
  EXPECT_EQ(cache.Usage().snapshot_bytes, 0u);
}

// ---- Merge
// ---------------------------------------------------------------------------------------

TEST(MergeTest, AttentionConcatenates) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  absl::StatusOr<SnapshotInfo> parent = cache.Snapshot(0, 0);
  ASSERT_TRUE(AppendRange(cache, 0, 4, 10).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 1, 10).ok());
  absl::StatusOr<SnapshotInfo> child = cache.Snapshot(1, 4);
  ASSERT_TRUE(parent.ok() && child.ok());
  const size_t pool = tc.device->used_bytes(MemoryPool::kSnapshot);
  absl::StatusOr<SnapshotInfo> merged = cache.MergeSnapshots(parent->id, child->id);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->id, 3u);
  EXPECT_EQ(merged->seq, 1);
  EXPECT_EQ(merged->from, 0);
  EXPECT_EQ(merged->to, 10);
  EXPECT_EQ(merged->groups[0].stored, 10);
  EXPECT_EQ(merged->bytes, parent->bytes + child->bytes);
  // Merge moves no data.
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), pool);
  const std::vector<SnapshotInfo> list = cache.ListSnapshots();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].id, 3u);
  EXPECT_TRUE(IsError(cache.DropSnapshot(parent->id), absl::StatusCode::kNotFound, {"1"}));
  EXPECT_TRUE(IsError(cache.DropSnapshot(child->id), absl::StatusCode::kNotFound, {"2"}));
  ASSERT_TRUE(cache.Restore(2, merged->id, 10).ok());
  EXPECT_TRUE(AttentionHolds(cache, 2, Range(0, 10), Ids(0, Range(0, 10))));
  ASSERT_TRUE(cache.DropSnapshot(merged->id).ok());
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), 0u);
  EXPECT_EQ(cache.Usage().snapshot_bytes, 0u);
}

TEST(MergeTest, RefusalsConsumeNothing) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  absl::StatusOr<SnapshotInfo> a = cache.Snapshot(0, 0);  // [0, 10)
  absl::StatusOr<SnapshotInfo> b = cache.Snapshot(0, 6);  // [6, 10)
  ASSERT_TRUE(a.ok() && b.ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.MergeSnapshots(a->id, b->id).status(),
                      absl::StatusCode::kInvalidArgument, {"10", "6"}));
  EXPECT_TRUE(IsError(cache.MergeSnapshots(b->id, a->id).status(),
                      absl::StatusCode::kInvalidArgument, {"10", "0"}));
  EXPECT_TRUE(IsError(cache.MergeSnapshots(a->id, a->id).status(),
                      absl::StatusCode::kInvalidArgument, {"1"}));
  EXPECT_TRUE(
      IsError(cache.MergeSnapshots(a->id, 77).status(), absl::StatusCode::kNotFound, {"77"}));
  EXPECT_TRUE(
      IsError(cache.MergeSnapshots(78, a->id).status(), absl::StatusCode::kNotFound, {"78"}));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_EQ(cache.ListSnapshots().size(), 2u);
}

TEST(MergeTest, RotatingAndRecurrentKeepTheChild) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 3).ok());
  absl::StatusOr<SnapshotInfo> parent = cache.Snapshot(0, 0);  // [0, 3)
  ASSERT_TRUE(AppendRange(cache, 0, 3, 6).ok());
  absl::StatusOr<SnapshotInfo> child = cache.Snapshot(0, 3);  // [3, 6)
  ASSERT_TRUE(parent.ok() && child.ok());
  absl::StatusOr<SnapshotInfo> merged = cache.MergeSnapshots(parent->id, child->id);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->from, 0);
  EXPECT_EQ(merged->to, 6);
  EXPECT_EQ(merged->groups[0].stored, 4);
  EXPECT_EQ(merged->groups[0].ring_index, 2);
  EXPECT_EQ(merged->groups[1].state, StateStatus::kValid);
  EXPECT_EQ(merged->groups[2].stored, 6);
  EXPECT_EQ(merged->bytes,
            4 * GroupTokenBytes(spec, 0) + GroupStateBytes(spec, 1) + 6 * GroupTokenBytes(spec, 2));
  ASSERT_TRUE(cache.Restore(2, merged->id, 6).ok());
  EXPECT_TRUE(HybridHolds(cache, 2, 0, 6));
  // Dropping the merge returns everything, including the parent's ring and state data.
  ASSERT_TRUE(cache.DropSnapshot(merged->id).ok());
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), 0u);
}

TEST(MergeTest, WithoutAttentionTheRangesNeedNotMeet) {
  const CacheSpec spec = Spec(DType::kF16, 2, 16, 8, {RotatingGroup(4), RecurrentGroup()});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  absl::StatusOr<SnapshotInfo> parent = cache.Snapshot(0, 1);  // [1, 4)
  ASSERT_TRUE(AppendRange(cache, 0, 4, 7).ok());
  absl::StatusOr<SnapshotInfo> child = cache.Snapshot(0, 5);  // [5, 7)
  ASSERT_TRUE(parent.ok() && child.ok());
  absl::StatusOr<SnapshotInfo> merged = cache.MergeSnapshots(parent->id, child->id);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->from, 1);
  EXPECT_EQ(merged->to, 7);
  EXPECT_EQ(merged->bytes, 4 * GroupTokenBytes(spec, 0) + GroupStateBytes(spec, 1));
  ASSERT_TRUE(cache.Restore(1, merged->id, 7).ok());
  EXPECT_TRUE(
      ReadIs(cache, 1, 0, kNoEnd, {Range(3, 7), {}}, {Ids(0, Range(3, 7)), {StateId(0, 7)}}));
}

// ---- Split
// ---------------------------------------------------------------------------------------

TEST(SplitTest, AttentionSplitsAtThePosition) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 2);  // [2, 10)
  ASSERT_TRUE(snap.ok());
  absl::StatusOr<SplitResult> split = cache.SplitSnapshot(snap->id, 6);
  ASSERT_TRUE(split.ok()) << split.status();
  ASSERT_TRUE(split->parent.has_value());
  ASSERT_TRUE(split->child.has_value());
  EXPECT_EQ(split->parent->from, 2);
  EXPECT_EQ(split->parent->to, 6);
  EXPECT_EQ(split->parent->groups[0].stored, 4);
  EXPECT_EQ(split->parent->bytes, 4 * GroupTokenBytes(spec, 0));
  EXPECT_EQ(split->child->from, 6);
  EXPECT_EQ(split->child->to, 10);
  EXPECT_EQ(split->child->bytes, 4 * GroupTokenBytes(spec, 0));
  EXPECT_NE(split->parent->id, snap->id);
  EXPECT_NE(split->child->id, snap->id);
  EXPECT_NE(split->parent->id, split->child->id);
  EXPECT_GT(std::min(split->parent->id, split->child->id), snap->id);
  EXPECT_TRUE(IsError(cache.DropSnapshot(snap->id), absl::StatusCode::kNotFound));
  EXPECT_EQ(cache.ListSnapshots().size(), 2u);
  // Each half restores its own range.
  ASSERT_TRUE(cache.Remove(0, 2, kNoEnd).ok());
  ASSERT_TRUE(cache.Restore(0, split->parent->id, 6).ok());
  EXPECT_TRUE(AttentionHolds(cache, 0, Range(0, 6), Ids(0, Range(0, 6))));
  ASSERT_TRUE(cache.Restore(0, split->child->id, 10).ok());
  EXPECT_TRUE(AttentionHolds(cache, 0, Range(0, 10), Ids(0, Range(0, 10))));
  // Merging the halves back gives the original range.
  absl::StatusOr<SnapshotInfo> merged = cache.MergeSnapshots(split->parent->id, split->child->id);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->from, 2);
  EXPECT_EQ(merged->to, 10);
  EXPECT_EQ(merged->bytes, snap->bytes);
  ASSERT_TRUE(cache.DropSnapshot(merged->id).ok());
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), 0u);
}

// A snapshot that stops at `to` is the parent a split at `to` would leave, and the pool holds
// (and is charged) only its positions: a cross-node CopyPrefix of a short prefix from a long
// sequence must not need room for the whole sequence.
TEST(SnapshotTest, StoppingAtAPositionIsTheSplitsParentAndChargesOnlyIt) {
  const CacheSpec spec = AttentionSpec();
  size_t four = 0;
  {
    TestCache probe(spec);
    ASSERT_NE(probe.cache, nullptr);
    ASSERT_TRUE(AppendRange(*probe.cache, 0, 0, 10).ok());
    absl::StatusOr<SnapshotInfo> snap = probe.cache->Snapshot(0, 2, 6);
    ASSERT_TRUE(snap.ok()) << snap.status();
    EXPECT_EQ(snap->from, 2);
    EXPECT_EQ(snap->to, 6);
    EXPECT_EQ(snap->groups[0].stored, 4);
    EXPECT_EQ(snap->bytes, 4 * GroupTokenBytes(spec, 0));
    four = probe.device->used_bytes(MemoryPool::kSnapshot);
  }
  // A pool with room for four positions, not for the ten of the whole sequence.
  TestCache tc(spec, size_t{1} << 24, four);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  EXPECT_TRUE(IsError(cache.Snapshot(0, 0).status(), absl::StatusCode::kResourceExhausted));
  absl::StatusOr<SnapshotInfo> prefix = cache.Snapshot(0, 0, 4);
  ASSERT_TRUE(prefix.ok()) << prefix.status();
  EXPECT_EQ(prefix->to, 4);
  // It restores as the split's parent would: positions [0, 4) of the source.
  ASSERT_TRUE(cache.Restore(1, prefix->id, 4).ok());
  EXPECT_TRUE(AttentionHolds(cache, 1, Range(0, 4), Ids(0, Range(0, 4))));
  ASSERT_TRUE(cache.DropSnapshot(prefix->id).ok());
  // `to` past the offset stops at the offset; the positions of one past the last hold all.
  TestCache big(spec);
  ASSERT_NE(big.cache, nullptr);
  ASSERT_TRUE(AppendRange(*big.cache, 0, 0, 10).ok());
  absl::StatusOr<SnapshotInfo> whole = big.cache->Snapshot(0, 0, INT32_MAX);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->to, 10);
  EXPECT_EQ(whole->groups[0].stored, 10);
  absl::StatusOr<SnapshotInfo> one = big.cache->Snapshot(0, 9, 10);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->groups[0].stored, 1);
}

TEST(SnapshotTest, StoppingAtAPositionRefusals) {
  TestCache tc(AttentionSpec());
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.Snapshot(0, 4, 4).status(), absl::StatusCode::kInvalidArgument,
                      {"to = 4", "from_offset = 4"}));
  EXPECT_TRUE(IsError(cache.Snapshot(0, 4, 0).status(), absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(IsError(cache.Snapshot(0, 0, -1).status(), absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  for (const CacheSpec& spec :
       {HybridSpec(), Spec(DType::kF16, 2, 16, 8, {Group(Full()), RotatingGroup(4)})}) {
    TestCache other(spec);
    ASSERT_NE(other.cache, nullptr);
    ASSERT_TRUE(AppendRange(*other.cache, 0, 0, 6).ok());
    EXPECT_TRUE(IsError(other.cache->Snapshot(0, 0, 3).status(), absl::StatusCode::kInvalidArgument,
                        {"cannot stop at position 3"}));
    EXPECT_TRUE(other.cache->ListSnapshots().empty());
  }
}

TEST(SplitTest, OutsideTheRangeGivesOneSide) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 10).ok());
  absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 2);
  ASSERT_TRUE(snap.ok());
  absl::StatusOr<SplitResult> low = cache.SplitSnapshot(snap->id, 2);
  ASSERT_TRUE(low.ok()) << low.status();
  EXPECT_FALSE(low->parent.has_value());
  ASSERT_TRUE(low->child.has_value());
  EXPECT_NE(low->child->id, snap->id);
  EXPECT_EQ(low->child->from, 2);
  EXPECT_EQ(low->child->to, 10);
  absl::StatusOr<SplitResult> high = cache.SplitSnapshot(low->child->id, 10);
  ASSERT_TRUE(high.ok()) << high.status();
  ASSERT_TRUE(high->parent.has_value());
  EXPECT_FALSE(high->child.has_value());
  EXPECT_EQ(high->parent->from, 2);
  EXPECT_EQ(high->parent->to, 10);
  EXPECT_EQ(high->parent->bytes, snap->bytes);
  absl::StatusOr<SplitResult> below = cache.SplitSnapshot(high->parent->id, 0);
  ASSERT_TRUE(below.ok());
  EXPECT_FALSE(below->parent.has_value());
  ASSERT_TRUE(below->child.has_value());
  absl::StatusOr<SplitResult> above = cache.SplitSnapshot(below->child->id, 50);
  ASSERT_TRUE(above.ok());
  ASSERT_TRUE(above->parent.has_value());
  EXPECT_FALSE(above->child.has_value());
  const std::vector<SnapshotInfo> list = cache.ListSnapshots();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].id, above->parent->id);
  EXPECT_TRUE(IsError(cache.SplitSnapshot(snap->id, 5).status(), absl::StatusCode::kNotFound,
                      {std::to_string(snap->id)}));
}

TEST(SplitTest, RotatingOrRecurrentGroupsCannotSplit) {
  for (const CacheSpec& spec :
       {HybridSpec(), Spec(DType::kF16, 2, 16, 8, {Group(Full()), RotatingGroup(4)}),
        Spec(DType::kF16, 2, 16, 8, {Group(Full()), RecurrentGroup()})}) {
    TestCache tc(spec);
    ASSERT_NE(tc.cache, nullptr);
    Cache& cache = *tc.cache;
    ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
    absl::StatusOr<SnapshotInfo> snap = cache.Snapshot(0, 0);
    ASSERT_TRUE(snap.ok()) << snap.status();
    absl::StatusOr<SplitResult> split = cache.SplitSnapshot(snap->id, 3);
    ASSERT_TRUE(split.ok()) << split.status();
    EXPECT_FALSE(split->parent.has_value());
    ASSERT_TRUE(split->child.has_value());
    EXPECT_NE(split->child->id, snap->id);
    EXPECT_EQ(split->child->from, 0);
    EXPECT_EQ(split->child->to, 6);
    EXPECT_EQ(split->child->bytes, snap->bytes);
    ASSERT_EQ(cache.ListSnapshots().size(), 1u);
    ASSERT_TRUE(cache.Restore(1, split->child->id, 6).ok());
    ASSERT_TRUE(cache.DropSnapshot(split->child->id).ok());
    EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), 0u);
  }
}

// ---- Drop, List, pool ------------------------------------------------------------------------

TEST(SnapshotPoolTest, DropReturnsBytesAndIdsAreNeverReused) {
  const CacheSpec spec = HybridSpec();
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  absl::StatusOr<SnapshotInfo> a = cache.Snapshot(0, 0);
  absl::StatusOr<SnapshotInfo> b = cache.Snapshot(0, 4);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(cache.Usage().snapshots, 2);
  const size_t both = tc.device->used_bytes(MemoryPool::kSnapshot);
  EXPECT_GE(both, a->bytes + b->bytes);
  ASSERT_TRUE(cache.DropSnapshot(a->id).ok());
  EXPECT_LT(tc.device->used_bytes(MemoryPool::kSnapshot), both);
  EXPECT_TRUE(
      IsError(cache.DropSnapshot(a->id), absl::StatusCode::kNotFound, {std::to_string(a->id)}));
  EXPECT_TRUE(IsError(cache.Restore(0, a->id, 6), absl::StatusCode::kNotFound));
  ASSERT_TRUE(cache.DropSnapshot(b->id).ok());
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), 0u);
  EXPECT_EQ(cache.Usage().snapshots, 0);
  EXPECT_EQ(cache.Usage().snapshot_bytes, 0u);
  EXPECT_TRUE(cache.ListSnapshots().empty());
  absl::StatusOr<SnapshotInfo> c = cache.Snapshot(0, 0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->id, 3u);
}

TEST(SnapshotPoolTest, FullPoolIsResourceExhausted) {
  const CacheSpec spec = HybridSpec();
  size_t one = 0;
  {
    TestCache probe(spec);
    ASSERT_NE(probe.cache, nullptr);
    ASSERT_TRUE(AppendRange(*probe.cache, 0, 0, 6).ok());
    ASSERT_TRUE(probe.cache->Snapshot(0, 0).ok());
    one = probe.device->used_bytes(MemoryPool::kSnapshot);
  }
  ASSERT_GT(one, 0u);
  // A pool holding exactly one such snapshot.
  TestCache tc(spec, size_t{1} << 24, one);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  absl::StatusOr<SnapshotInfo> first = cache.Snapshot(0, 0);
  ASSERT_TRUE(first.ok()) << first.status();
  const CacheState before = CaptureState(cache);
  EXPECT_TRUE(IsError(cache.Snapshot(0, 0).status(), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  EXPECT_EQ(tc.device->used_bytes(MemoryPool::kSnapshot), one);
  // The cache pool is unaffected: live sequences still grow.
  ASSERT_TRUE(AppendRange(cache, 1, 0, 2).ok());
  ASSERT_TRUE(cache.DropSnapshot(first->id).ok());
  absl::StatusOr<SnapshotInfo> again = cache.Snapshot(0, 0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_GT(again->id, first->id);
}

TEST(SnapshotPoolTest, ZeroBudgetRefusesEverySnapshot) {
  const CacheSpec spec = AttentionSpec();
  TestCache tc(spec, size_t{1} << 24, 0);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  EXPECT_TRUE(IsError(cache.Snapshot(0, 0).status(), absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(cache.ListSnapshots().empty());
  EXPECT_EQ(cache.Usage().snapshots, 0);
}

TEST(SnapshotPoolTest, DestroyingTheCacheFreesItsSnapshots) {
  const CacheSpec spec = HybridSpec();
  std::unique_ptr<Device> device = testutil::MakeTestDevice(size_t{1} << 24);
  {
    absl::StatusOr<std::unique_ptr<Cache>> cache = Cache::Create(spec, device.get());
    ASSERT_TRUE(cache.ok()) << cache.status();
    ASSERT_TRUE(AppendRange(**cache, 0, 0, 6).ok());
    ASSERT_TRUE((*cache)->Snapshot(0, 0).ok());
    ASSERT_TRUE((*cache)->Snapshot(0, 3).ok());
    absl::StatusOr<SplitResult> split = (*cache)->SplitSnapshot(1, 2);
    ASSERT_TRUE(split.ok());
    EXPECT_GT(device->used_bytes(MemoryPool::kSnapshot), 0u);
  }
  EXPECT_EQ(device->used_bytes(MemoryPool::kSnapshot), 0u);
  EXPECT_EQ(device->used_bytes(MemoryPool::kCache), 0u);
}

}  // namespace
}  // namespace kvmesh
