// Cache::Append: storage, validation, capacity, max_sequences and the seed's sliding-window
// pruning (updateSlidingWindow), all-or-nothing.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache/shortage.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::AppendTokens;
using testutil::CacheState;
using testutil::CaptureState;
using testutil::Chunked;
using testutil::Full;
using testutil::Group;
using testutil::Ids;
using testutil::PayloadFor;
using testutil::Range;
using testutil::ReadPayload;
using testutil::SameBytes;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;
using testutil::TestCache;
using testutil::Tokens;

using Positions = std::vector<std::vector<int32_t>>;

class AppendByDtypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(AppendByDtypeTest, ReadReturnsTheAppendedBytes) {
  const CacheSpec spec =
      Spec(GetParam(), 2, 16, 8, {Group(Full(), 2, 2, 4, 2), Group(Chunked(4), 1, 1, 8, 8)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 6).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 6, 10).ok());
  absl::StatusOr<ReadResult> read = cache.Read(0, 0, std::nullopt);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->positions, (Positions{Range(0, 10), Range(0, 10)}));
  EXPECT_TRUE(
      SameBytes(ReadPayload(spec, {Ids(0, Range(0, 10)), Ids(0, Range(0, 10))}), read->payload));
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, AppendByDtypeTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16));

TEST(AppendTest, InterleavedBatchStoresEachSequenceInPositionOrder) {
  const CacheSpec spec = Spec(DType::kF16, 3, 16, 8, {Group(Full(), 2, 2, 4, 2)});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  const int64_t big = int64_t{1} << 40;
  const std::vector<Token> batch = {{1, 0}, {big, 0}, {1, 1}, {big, 1}, {1, 2}};
  ASSERT_TRUE(AppendTokens(cache, batch).ok());
  absl::StatusOr<ReadResult> one = cache.Read(1, 0, std::nullopt);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->positions, (Positions{{0, 1, 2}}));
  EXPECT_TRUE(SameBytes(ReadPayload(spec, {Ids(1, {0, 1, 2})}), one->payload));
  absl::StatusOr<ReadResult> two = cache.Read(big, 0, std::nullopt);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->positions, (Positions{{0, 1}}));
  EXPECT_TRUE(SameBytes(ReadPayload(spec, {Ids(big, {0, 1})}), two->payload));

  const std::vector<SequenceInfo> seqs = cache.ListSequences();
  ASSERT_EQ(seqs.size(), 2u);
  EXPECT_EQ(seqs[0].seq, 1);
  EXPECT_EQ(seqs[0].offset, 3);
  EXPECT_EQ(seqs[1].seq, big);
  EXPECT_EQ(seqs[1].offset, 2);
  const CacheUsage usage = cache.Usage();
  EXPECT_EQ(usage.sequences_live, 2);
  EXPECT_EQ(usage.groups[0].cells_used, 5);
}

// Attention-only caches take any positions that are new for the sequence and increasing within
// the batch (only Rotating/Recurrent groups require continuing at the offset).
TEST(AppendTest, GapsAndEarlierPositionsAreStored) {
  const CacheSpec spec = Spec(DType::kF32, 1, 16, 4, {Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendTokens(cache, {{0, 5}, {0, 6}}).ok());
  ASSERT_TRUE(AppendTokens(cache, {{0, 0}, {0, 1}}).ok());
  ASSERT_TRUE(AppendTokens(cache, {{0, 10}}).ok());
  absl::StatusOr<ReadResult> read = cache.Read(0, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions, (Positions{{0, 1, 5, 6, 10}}));
  EXPECT_TRUE(SameBytes(ReadPayload(spec, {Ids(0, {0, 1, 5, 6, 10})}), read->payload));
  const std::vector<SequenceInfo> seqs = cache.ListSequences();
  ASSERT_EQ(seqs.size(), 1u);
  EXPECT_EQ(seqs[0].offset, 11);
  ASSERT_EQ(seqs[0].groups.size(), 1u);
  EXPECT_EQ(seqs[0].groups[0].stored, 5);
  EXPECT_EQ(seqs[0].groups[0].first, 0);
  EXPECT_EQ(seqs[0].groups[0].last, 10);
  EXPECT_EQ(seqs[0].groups[0].shared, 0);
}

TEST(AppendTest, ExactlyMaxBatchTokens) {
  const CacheSpec spec = Spec(DType::kF16, 2, 16, 4, {Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  EXPECT_TRUE(AppendTokens(*tc.cache, {{0, 0}, {1, 0}, {0, 1}, {1, 1}}).ok());
  EXPECT_EQ(tc.cache->Usage().groups[0].cells_used, 4);
}

// Each invalid batch is INVALID_ARGUMENT and leaves the cache exactly as before.
class AppendInvalidTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A full group and a sliding group (window 2, max_sequences 2 -> memory 3).
    spec_ = Spec(DType::kF16, 2, 64, 4, {Group(Full(), 2, 2, 4, 2), Group(Sliding(2), 1, 1, 2, 2)});
    tc_.emplace(spec_);
    ASSERT_NE(tc_->cache, nullptr);
    ASSERT_TRUE(AppendRange(cache(), 0, 0, 4).ok());
    ASSERT_TRUE(AppendRange(cache(), 0, 4, 8).ok());
    ASSERT_TRUE(AppendRange(cache(), 0, 8, 10).ok());  // sliding prunes below 8 - 3 = 5
    ASSERT_EQ(testutil::StoredPositions(cache(), 0), (Positions{Range(0, 10), Range(5, 10)}));
    before_ = CaptureState(cache());
  }

  Cache& cache() { return *tc_->cache; }

  void ExpectInvalid(const std::vector<Token>& tokens, const std::vector<uint8_t>& payload) {
    const absl::Status status = cache().Append(tokens, payload);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(SameState(before_, CaptureState(cache())));
  }
  void ExpectInvalid(const std::vector<Token>& tokens) {
    ExpectInvalid(tokens, PayloadFor(spec_, tokens, 7));
  }

  CacheSpec spec_;
  std::optional<TestCache> tc_;
  CacheState before_;
};

TEST_F(AppendInvalidTest, EmptyBatch) { ExpectInvalid({}, {}); }

TEST_F(AppendInvalidTest, MoreThanMaxBatch) { ExpectInvalid(Tokens(1, 0, 5)); }

TEST_F(AppendInvalidTest, NegativeSequence) { ExpectInvalid({{1, 0}, {-1, 0}}); }

TEST_F(AppendInvalidTest, NegativePosition) { ExpectInvalid({{1, -1}, {1, 0}}); }

TEST_F(AppendInvalidTest, DecreasingPositionsInBatch) { ExpectInvalid({{1, 3}, {1, 2}}); }

TEST_F(AppendInvalidTest, DuplicatePositionInBatch) { ExpectInvalid({{1, 3}, {1, 4}, {1, 3}}); }

TEST_F(AppendInvalidTest, DuplicateAfterAnotherSequence) {
  ExpectInvalid({{1, 3}, {0, 10}, {1, 3}});
}

TEST_F(AppendInvalidTest, PositionAlreadyStored) { ExpectInvalid({{0, 9}, {0, 10}}); }

// Position 2 is gone from the sliding group but still stored in the full group.
TEST_F(AppendInvalidTest, PositionStoredInAnyGroup) { ExpectInvalid({{0, 2}}); }

TEST_F(AppendInvalidTest, PayloadOneByteShort) {
  std::vector<uint8_t> payload = PayloadFor(spec_, Tokens(1, 0, 2));
  payload.pop_back();
  ExpectInvalid(Tokens(1, 0, 2), payload);
}

TEST_F(AppendInvalidTest, PayloadOneByteLong) {
  std::vector<uint8_t> payload = PayloadFor(spec_, Tokens(1, 0, 2));
  payload.push_back(0);
  ExpectInvalid(Tokens(1, 0, 2), payload);
}

TEST_F(AppendInvalidTest, PayloadForOneTokenLess) {
  ExpectInvalid(Tokens(1, 0, 2), PayloadFor(spec_, Tokens(1, 0, 1)));
}

TEST_F(AppendInvalidTest, EmptyPayload) { ExpectInvalid(Tokens(1, 0, 2), {}); }

TEST(AppendCapacityTest, MaxSequences) {
  const CacheSpec spec = Spec(DType::kF16, 2, 16, 4, {Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 2).ok());
  ASSERT_TRUE(AppendRange(cache, 1, 0, 2).ok());
  const CacheState before = CaptureState(cache);
  const absl::Status third = AppendRange(cache, 2, 0, 1);
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  // In numbers too: one new sequence needed, none free of max_sequences = 2.
  const std::optional<Shortage> shortage = GetShortage(third);
  ASSERT_TRUE(shortage.has_value()) << third;
  EXPECT_EQ(shortage->resource, Resource::kSequences);
  EXPECT_EQ(shortage->group, -1);
  EXPECT_EQ(shortage->needed, 1);
  EXPECT_EQ(shortage->free, 0);
  EXPECT_EQ(shortage->total, 2);
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // A batch mixing a live sequence and a third one fails as a whole.
  EXPECT_EQ(AppendTokens(cache, {{0, 2}, {2, 0}}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  // Live sequences keep appending.
  EXPECT_TRUE(AppendTokens(cache, {{0, 2}, {1, 2}}).ok());
  // Once a sequence is gone, another fits.
  ASSERT_TRUE(cache.Remove(1, 0, std::nullopt).ok());
  EXPECT_EQ(cache.Usage().sequences_live, 1);
  EXPECT_TRUE(AppendRange(cache, 2, 0, 1).ok());
  EXPECT_EQ(cache.Usage().sequences_live, 2);
}

// The cell rule is the only limit on how much a sequence stores ("succeeds iff every group has
// >= T free cells"): positions at or beyond `capacity` are accepted while cells last.
TEST(AppendCapacityTest, FullGroupHoldsMaxSequencesTimesCapacityCells) {
  const CacheSpec spec = Spec(DType::kF16, 2, 4, 4, {Group(Full())});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  const absl::Status beyond = AppendRange(cache, 0, 4, 8);
  ASSERT_TRUE(beyond.ok()) << beyond;
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 8);
  const CacheState before = CaptureState(cache);
  EXPECT_EQ(AppendRange(cache, 1, 0, 1).code(), absl::StatusCode::kResourceExhausted);
  const absl::Status full = AppendRange(cache, 0, 8, 9);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  const std::optional<Shortage> shortage = GetShortage(full);
  ASSERT_TRUE(shortage.has_value()) << full;
  EXPECT_EQ(shortage->resource, Resource::kCells);
  EXPECT_EQ(shortage->group, 0);
  EXPECT_EQ(shortage->needed, 1);
  EXPECT_EQ(shortage->free, 0);
  EXPECT_EQ(shortage->total, 8);
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(cache.Remove(0, 7, std::nullopt).ok());
  EXPECT_TRUE(AppendRange(cache, 1, 0, 1).ok());
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 8);
}

// A sequence in the batch drops pos < (lowest batch pos - memory); pos == that bound stays.
TEST(SlidingPruneTest, SequenceInBatchKeepsMemoryBelowItsLowestPosition) {
  // window 4, memory 6, one sequence: 6 + 4 = 10 cells.
  const CacheSpec spec = Spec(DType::kF32, 1, 100, 4, {Group(Full()), Group(Sliding(4, 6))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_EQ(cache.Usage().groups[1].cells_total, 10);
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 4, 8).ok());  // bound 4 - 6 < 0: nothing dropped
  EXPECT_EQ(testutil::StoredPositions(cache, 0), (Positions{Range(0, 8), Range(0, 8)}));
  ASSERT_TRUE(AppendRange(cache, 0, 8, 10).ok());  // bound 8 - 6 = 2: drops 0 and 1
  absl::StatusOr<ReadResult> read = cache.Read(0, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->positions, (Positions{Range(0, 10), Range(2, 10)}));
  EXPECT_TRUE(
      SameBytes(ReadPayload(spec, {Ids(0, Range(0, 10)), Ids(0, Range(2, 10))}), read->payload));
  const CacheUsage usage = cache.Usage();
  EXPECT_EQ(usage.groups[0].cells_used, 10);
  EXPECT_EQ(usage.groups[1].cells_used, 8);
  EXPECT_EQ(usage.groups[1].memory, 6);
  const std::vector<SequenceInfo> seqs = cache.ListSequences();
  ASSERT_EQ(seqs.size(), 1u);
  ASSERT_EQ(seqs[0].groups.size(), 2u);
  EXPECT_EQ(seqs[0].offset, 10);
  EXPECT_EQ(seqs[0].groups[0].stored, 10);
  EXPECT_EQ(seqs[0].groups[0].first, 0);
  EXPECT_EQ(seqs[0].groups[1].stored, 8);
  EXPECT_EQ(seqs[0].groups[1].first, 2);
  EXPECT_EQ(seqs[0].groups[1].last, 9);
}

// Every other sequence drops pos < (last + 1 - memory); pos == that bound stays.
TEST(SlidingPruneTest, OtherSequencesKeepMemoryBelowTheirOffset) {
  // window 2, memory 4 (>= window + 1, kept), two sequences: 2 * 4 + 4 = 12 cells.
  const CacheSpec spec = Spec(DType::kF16, 2, 100, 4, {Group(Sliding(2, 4))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_EQ(cache.Usage().groups[0].cells_total, 12);
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 4, 8).ok());  // in batch, bound 0: keeps 0..7
  EXPECT_EQ(testutil::StoredPositions(cache, 0), (Positions{Range(0, 8)}));
  ASSERT_TRUE(AppendRange(cache, 1, 0, 1).ok());  // seq 0 not in batch: bound 8 - 4 = 4
  EXPECT_EQ(testutil::StoredPositions(cache, 0), (Positions{Range(4, 8)}));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 5);
  ASSERT_TRUE(AppendRange(cache, 0, 8, 9).ok());  // in batch, bound 8 - 4 = 4: 4 stays
  EXPECT_EQ(testutil::StoredPositions(cache, 0), (Positions{Range(4, 9)}));
  EXPECT_EQ(testutil::StoredPositions(cache, 1), (Positions{{0}}));  // bound 1 - 4 < 0
  absl::StatusOr<ReadResult> read = cache.Read(0, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_TRUE(SameBytes(ReadPayload(spec, {Ids(0, Range(4, 9))}), read->payload));
}

// The scenario of the seed's rule plus all-or-nothing: the pruning a failed Append would have
// done is undone. window 2, max_sequences 2 -> memory 3; 2 * 3 + 3 = 9 cells.
class SlidingFailureTest : public ::testing::Test {
 protected:
  static constexpr int64_t kA = 0;
  static constexpr int64_t kB = 1;

  void SetUp() override {
    spec_ =
        Spec(DType::kBF16, 2, 100, 3, {Group(Full(), 1, 1, 2, 2), Group(Sliding(2), 2, 1, 4, 2)});
    tc_.emplace(spec_);
    ASSERT_NE(tc_->cache, nullptr);
    ASSERT_EQ(cache().Usage().groups[1].cells_total, 9);
    ASSERT_EQ(cache().Usage().groups[1].memory, 3);
    ASSERT_TRUE(AppendTokens(cache(), {{kB, 30}, {kB, 31}, {kB, 32}}).ok());
    // Both sequences in the batch: only the lowest-position rule applies, nothing dropped.
    ASSERT_TRUE(AppendTokens(cache(), {{kB, 0}, {kA, 10}, {kA, 11}}).ok());
    ASSERT_TRUE(AppendTokens(cache(), {{kA, 5}, {kA, 12}, {kB, 1}}).ok());
    ASSERT_EQ(cache().Usage().groups[1].cells_used, 9);
    ASSERT_EQ(testutil::StoredPositions(cache(), kA),
              (Positions{{5, 10, 11, 12}, {5, 10, 11, 12}}));
    ASSERT_EQ(testutil::StoredPositions(cache(), kB),
              (Positions{{0, 1, 30, 31, 32}, {0, 1, 30, 31, 32}}));
  }

  Cache& cache() { return *tc_->cache; }

  CacheSpec spec_;
  std::optional<TestCache> tc_;
};

TEST_F(SlidingFailureTest, NoRoomAfterPruningFailsAndRestoresPrunedCells) {
  const CacheState before = CaptureState(cache());
  // B is not in the batch: B drops 0 and 1 (< 33 - 3), two free cells for three tokens.
  EXPECT_EQ(AppendTokens(cache(), Tokens(kA, 0, 3)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
  // Two tokens fit in the cells B's pruning frees.
  ASSERT_TRUE(AppendTokens(cache(), Tokens(kA, 0, 2)).ok());
  EXPECT_EQ(testutil::StoredPositions(cache(), kA),
            (Positions{{0, 1, 5, 10, 11, 12}, {0, 1, 5, 10, 11, 12}}));
  EXPECT_EQ(testutil::StoredPositions(cache(), kB), (Positions{{0, 1, 30, 31, 32}, {30, 31, 32}}));
  EXPECT_EQ(cache().Usage().groups[1].cells_used, 9);
  absl::StatusOr<ReadResult> read = cache().Read(kB, 0, std::nullopt);
  ASSERT_TRUE(read.ok());
  EXPECT_TRUE(SameBytes(ReadPayload(spec_, {Ids(kB, {0, 1, 30, 31, 32}), Ids(kB, {30, 31, 32})}),
                        read->payload));
}

TEST_F(SlidingFailureTest, InvalidPayloadRestoresPrunedCells) {
  const CacheState before = CaptureState(cache());
  std::vector<uint8_t> payload = PayloadFor(spec_, Tokens(kA, 0, 2));
  payload.pop_back();
  const std::vector<Token> tokens = Tokens(kA, 0, 2);
  EXPECT_EQ(cache().Append(tokens, payload).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
}

TEST_F(SlidingFailureTest, TooManySequencesRestoresPrunedCells) {
  const CacheState before = CaptureState(cache());
  // A third sequence: B would be pruned, but max_sequences is 2.
  EXPECT_EQ(AppendTokens(cache(), {{2, 0}}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
}

// Out-of-order appends can exhaust a sliding group; a later in-order batch prunes them away.
TEST(SlidingPruneTest, EarlierPositionsCanExhaustTheGroup) {
  // window 2, memory 2, one sequence, max_batch 2: 4 cells.
  const CacheSpec spec = Spec(DType::kF16, 1, 100, 2, {Group(Sliding(2))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(AppendRange(cache, 0, 10, 12).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 0, 2).ok());  // bound 0 - 2: nothing dropped
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 4);
  const CacheState before = CaptureState(cache);
  EXPECT_EQ(AppendRange(cache, 0, 2, 4).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(SameState(before, CaptureState(cache)));
  ASSERT_TRUE(AppendRange(cache, 0, 12, 14).ok());  // bound 10: drops 0 and 1
  EXPECT_EQ(testutil::StoredPositions(cache, 0), (Positions{{10, 11, 12, 13}}));
  EXPECT_EQ(cache.Usage().groups[0].cells_used, 4);
}

TEST(SlidingPruneTest, UnlimitedMemoryNeverPrunes) {
  // memory >= capacity: unlimited, max_sequences * capacity cells.
  const CacheSpec spec = Spec(DType::kF16, 1, 8, 4, {Group(Sliding(2, 8))});
  TestCache tc(spec);
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  EXPECT_EQ(cache.Usage().groups[0].memory, kUnlimitedMemory);
  EXPECT_EQ(cache.Usage().groups[0].cells_total, 8);
  ASSERT_TRUE(AppendRange(cache, 0, 0, 4).ok());
  ASSERT_TRUE(AppendRange(cache, 0, 4, 8).ok());
  EXPECT_EQ(testutil::StoredPositions(cache, 0), (Positions{Range(0, 8)}));
}

TEST(AppendTest, CreateFailsBeyondTheDeviceBudget) {
  const CacheSpec spec = Spec(DType::kF32, 4, 64, 8, {Group(Full(), 2, 2, 8, 8)});
  const size_t bytes = 4 * 64 * 2 * 2 * 16 * 4;
  {
    std::unique_ptr<Device> device = testutil::MakeTestDevice(bytes - 1);
    absl::StatusOr<std::unique_ptr<Cache>> cache = Cache::Create(spec, device.get());
    EXPECT_EQ(cache.status().code(), absl::StatusCode::kResourceExhausted) << cache.status();
    EXPECT_EQ(device->used_bytes(), 0u);
  }
  std::unique_ptr<Device> device = testutil::MakeTestDevice(bytes);
  absl::StatusOr<std::unique_ptr<Cache>> cache = Cache::Create(spec, device.get());
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(device->used_bytes(), bytes);
  cache->reset();
  EXPECT_EQ(device->used_bytes(), 0u);
}

TEST(AppendTest, CreateRejectsAnInvalidSpec) {
  std::unique_ptr<Device> device = testutil::MakeTestDevice(1 << 20);
  CacheSpec spec = Spec(DType::kF32, 0, 64, 8, {Group(Full())});
  EXPECT_EQ(Cache::Create(spec, device.get()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device->used_bytes(), 0u);
}

}  // namespace
}  // namespace kvmesh
