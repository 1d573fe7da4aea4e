// Cache::Reserve: room (cells, a sequence slot) set aside for a sequence's coming positions,
// held back from every other sequence's operations until it expires, is replaced or dropped.
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/cache.h"
#include "cache/shortage.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::CacheState;
using testutil::CaptureState;
using testutil::Full;
using testutil::Group;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;
using testutil::TestCache;

absl::Time Later() { return absl::Now() + absl::Hours(1); }

class ReserveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // One Full group: 3 sequences x 8 = 24 cells.
    tc_.emplace(Spec(DType::kF16, 3, 8, 8, {Group(Full())}));
    ASSERT_NE(tc_->cache, nullptr);
    ASSERT_EQ(cache().Usage().groups[0].cells_total, 24);
  }
  Cache& cache() { return *tc_->cache; }
  std::optional<TestCache> tc_;
};

TEST_F(ReserveTest, HeldBackFromOthersAndUsedByItsSequence) {
  ASSERT_TRUE(cache().Reserve(0, 10, Later()).ok());
  CacheUsage usage = cache().Usage();
  EXPECT_EQ(usage.groups[0].cells_reserved, 10);
  EXPECT_EQ(usage.groups[0].cells_used, 0);  // reserved cells are free, but not for others
  EXPECT_EQ(usage.sequences_reserved, 1);
  // Other sequences get the 14 cells that are not reserved, not one more.
  ASSERT_TRUE(AppendRange(cache(), 1, 0, 8).ok());
  ASSERT_TRUE(AppendRange(cache(), 2, 0, 6).ok());
  const CacheState before = CaptureState(cache());
  const absl::Status full = AppendRange(cache(), 2, 6, 7);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  const std::optional<Shortage> shortage = GetShortage(full);
  ASSERT_TRUE(shortage.has_value());
  EXPECT_EQ(shortage->needed, 1);
  EXPECT_EQ(shortage->free, 0);  // the 10 reserved cells are not free for sequence 2
  EXPECT_TRUE(SameState(before, CaptureState(cache())));
  // Sequence 0 appends into its room, in pieces, and the room shrinks as it grows.
  ASSERT_TRUE(AppendRange(cache(), 0, 0, 4).ok());
  EXPECT_EQ(cache().Usage().groups[0].cells_reserved, 6);
  EXPECT_EQ(cache().Usage().sequences_reserved, 0);  // live now: no slot held back
  ASSERT_TRUE(AppendRange(cache(), 0, 4, 10).ok());
  usage = cache().Usage();
  EXPECT_EQ(usage.groups[0].cells_reserved, 0);
  EXPECT_EQ(usage.groups[0].cells_used, 24);
}

TEST_F(ReserveTest, ARefusedReserveLeavesTheEarlierOne) {
  ASSERT_TRUE(AppendRange(cache(), 1, 0, 8).ok());
  ASSERT_TRUE(cache().Reserve(0, 10, Later()).ok());
  // 16 free, 10 reserved for 0: sequence 2 can reserve 6, not 7.
  const absl::Status refused = cache().Reserve(2, 7, Later());
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  const std::optional<Shortage> shortage = GetShortage(refused);
  ASSERT_TRUE(shortage.has_value());
  EXPECT_EQ(shortage->resource, Resource::kCells);
  EXPECT_EQ(shortage->needed, 7);
  EXPECT_EQ(shortage->free, 6);
  EXPECT_TRUE(cache().Reserve(2, 6, Later()).ok());
  // Growing 0's reservation past what is left is refused and keeps its 10.
  EXPECT_EQ(cache().Reserve(0, 11, Later()).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache().Usage().groups[0].cells_reserved, 16);
  // Shrinking it works; positions 0 drops it.
  ASSERT_TRUE(cache().Reserve(0, 4, Later()).ok());
  EXPECT_EQ(cache().Usage().groups[0].cells_reserved, 10);
  ASSERT_TRUE(cache().Reserve(0, 0, Later()).ok());
  EXPECT_EQ(cache().Usage().groups[0].cells_reserved, 6);
  ASSERT_EQ(cache().Reservations().size(), 1u);
  EXPECT_EQ(cache().Reservations()[0].seq, 2);
}

// Two long prompts on a nearly full cache, each sent in pieces: without reservations both
// could take half the room and neither finish; with them the second is refused up front.
TEST_F(ReserveTest, TwoLongPromptsCannotStarveEachOther) {
  ASSERT_TRUE(AppendRange(cache(), 2, 0, 8).ok());  // 16 cells left
  ASSERT_TRUE(cache().Reserve(0, 12, Later()).ok());
  EXPECT_EQ(cache().Reserve(1, 12, Later()).code(), absl::StatusCode::kResourceExhausted);
  for (int32_t begin = 0; begin < 12; begin += 4) {
    ASSERT_TRUE(AppendRange(cache(), 1, begin, begin + 4).ok() || begin >= 4);
    ASSERT_TRUE(AppendRange(cache(), 0, begin, begin + 4).ok()) << begin;
  }
  // Sequence 1 got the 4 unreserved cells and no more; sequence 0 finished its prompt.
  EXPECT_EQ(cache().GetSequence(0)->offset, 12);
  EXPECT_EQ(cache().GetSequence(1)->offset, 4);
}

TEST_F(ReserveTest, HoldsASequenceSlot) {
  ASSERT_TRUE(AppendRange(cache(), 0, 0, 1).ok());
  ASSERT_TRUE(cache().Reserve(5, 1, Later()).ok());
  ASSERT_TRUE(AppendRange(cache(), 1, 0, 1).ok());
  // Three sequences are allowed: 0, 1 and the reserved 5.
  const absl::Status third = AppendRange(cache(), 2, 0, 1);
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  const std::optional<Shortage> shortage = GetShortage(third);
  ASSERT_TRUE(shortage.has_value());
  EXPECT_EQ(shortage->resource, Resource::kSequences);
  EXPECT_NE(third.message().find("(1 of them reserved, not yet live)"), std::string::npos) << third;
  const absl::Status copy = cache().CopyPrefix(0, 2, 1);
  EXPECT_EQ(copy.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(copy.message().find("(1 of them reserved, not yet live)"), std::string::npos) << copy;
  // Another reservation for a new sequence finds no slot either.
  EXPECT_EQ(cache().Reserve(6, 1, Later()).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(AppendRange(cache(), 5, 0, 1).ok());
}

TEST_F(ReserveTest, ExpiresAfterItsTime) {
  ASSERT_TRUE(AppendRange(cache(), 1, 0, 8).ok());
  ASSERT_TRUE(AppendRange(cache(), 2, 0, 8).ok());
  ASSERT_TRUE(cache().Reserve(0, 8, absl::Now() + absl::Milliseconds(50)).ok());
  EXPECT_EQ(AppendRange(cache(), 1, 8, 9).code(), absl::StatusCode::kResourceExhausted);
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(cache().Reservations().empty());
  EXPECT_EQ(cache().Usage().groups[0].cells_reserved, 0);
  EXPECT_TRUE(AppendRange(cache(), 1, 8, 9).ok());
  // An expiry in the past drops the reservation at once.
  ASSERT_TRUE(cache().Reserve(0, 2, absl::Now() + absl::Hours(1)).ok());
  ASSERT_TRUE(cache().Reserve(0, 2, absl::Now() - absl::Seconds(1)).ok());
  EXPECT_TRUE(cache().Reservations().empty());
}

TEST_F(ReserveTest, BadArgumentsChangeNothing) {
  ASSERT_TRUE(cache().Reserve(0, 3, Later()).ok());
  EXPECT_EQ(cache().Reserve(-1, 3, Later()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache().Reserve(1, -3, Later()).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(cache().Reservations().size(), 1u);
  EXPECT_EQ(cache().Reservations()[0].positions, 3);
}

// The guarantee under concurrency: while three threads fill the cache with other sequences
// (and a fourth reads usage), the reserved sequence's appends, sent in pieces, all succeed.
TEST(ReserveConcurrencyTest, OthersFillingTheCacheNeverStarveTheReservedPrompt) {
  // 8 sequences x 32 = 256 cells; the prompt needs 96 of them.
  TestCache tc(Spec(DType::kF16, 8, 32, 8, {Group(Full(), 2, 2, 8, 8)}));
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(cache.Reserve(0, 96, Later()).ok());
  std::atomic<bool> done{false};
  std::vector<std::thread> others;
  std::atomic<int64_t> refused{0};
  for (int64_t t = 1; t <= 3; ++t) {
    others.emplace_back([&cache, &done, &refused, t] {
      for (int32_t round = 0; !done.load(); ++round) {
        for (int64_t seq = 2 * t; seq < 2 * t + 2; ++seq) {
          const std::optional<SequenceInfo> info = cache.GetSequence(seq);
          const int32_t next = info.has_value() ? info->offset : 0;
          if (!AppendRange(cache, seq, next, next + 4).ok()) {
            refused.fetch_add(1);
            if (round % 4 == 3) (void)cache.Remove(seq, 0, std::nullopt);
          }
        }
      }
    });
  }
  std::thread reader([&cache, &done] {
    while (!done.load()) {
      const CacheUsage usage = cache.Usage();
      EXPECT_LE(usage.groups[0].cells_used, usage.groups[0].cells_total);
    }
  });
  // The prompt starts once the others have filled everything but its room.
  for (int i = 0; i < 3000 && refused.load() == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_GT(refused.load(), 0) << "the other sequences never filled the cache";
  for (int32_t begin = 0; begin < 96; begin += 8) {
    const absl::Status appended = AppendRange(cache, 0, begin, begin + 8);
    EXPECT_TRUE(appended.ok()) << appended;
    absl::SleepFor(absl::Milliseconds(2));
  }
  done = true;
  for (std::thread& t : others) t.join();
  reader.join();
  EXPECT_EQ(cache.GetSequence(0)->offset, 96);
}

// A sliding window never holds more than its memory of one sequence: a reservation holds back
// no more than that.
TEST(ReserveSlidingTest, HoldsBackAtMostTheWindowsMemory) {
  TestCache tc(Spec(DType::kF16, 2, 16, 4, {Group(Sliding(3, 4))}));
  ASSERT_NE(tc.cache, nullptr);
  Cache& cache = *tc.cache;
  ASSERT_TRUE(cache.Reserve(0, 100, Later()).ok());
  EXPECT_EQ(cache.Usage().groups[0].cells_reserved, 4);
  ASSERT_TRUE(AppendRange(cache, 0, 0, 2).ok());
  EXPECT_EQ(cache.Usage().groups[0].cells_reserved, 2);
}

}  // namespace
}  // namespace kvmesh
