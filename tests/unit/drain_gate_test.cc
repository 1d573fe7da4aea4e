// DrainGate (service/cluster/drain_gate.h): tickets while open, UNAVAILABLE naming the node while
// draining, Close waiting for the tickets handed out before it, the tickets of operations that
// pull data into a sequence (AdmitWrite) and their commits (Readmit), and the listener told the
// state.
#include "service/cluster/drain_gate.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/cache.h"
#include "cache/device/host_device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using ::testing::HasSubstr;

TEST(DrainGateTest, AdmitsWhileOpenAndRefusesWhileDraining) {
  DrainGate gate("node-a");
  std::vector<bool> told;
  gate.set_listener([&](bool draining) { told.push_back(draining); });
  EXPECT_FALSE(gate.draining());
  {
    absl::StatusOr<DrainGate::Ticket> ticket = gate.Admit("new cache 'c'");
    ASSERT_TRUE(ticket.ok()) << ticket.status();
  }
  EXPECT_TRUE(gate.Close(absl::Now() + absl::Seconds(5)));
  EXPECT_TRUE(gate.draining());
  absl::StatusOr<DrainGate::Ticket> refused = gate.Admit("new cache 'c'");
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(),
              AllOf(HasSubstr("node 'node-a' is draining"), HasSubstr("new cache 'c'")));
  // Closing again changes nothing and tells nobody.
  EXPECT_TRUE(gate.Close(absl::Now()));
  gate.Open();
  EXPECT_FALSE(gate.draining());
  EXPECT_TRUE(gate.Admit("x").ok());
  gate.Open();
  EXPECT_EQ(told, (std::vector<bool>{true, false}));
}

TEST(DrainGateTest, CloseWaitsForTheTicketsHandedOutBefore) {
  DrainGate gate("node-a");
  absl::StatusOr<DrainGate::Ticket> held = gate.Admit("a new sequence");
  ASSERT_TRUE(held.ok());
  // Not released: Close gives up at its deadline.
  const absl::Time start = absl::Now();
  EXPECT_FALSE(gate.Close(start + absl::Milliseconds(50)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  // Released on another thread: Close returns once it is.
  std::atomic<bool> released{false};
  std::thread releaser([&] {
    absl::SleepFor(absl::Milliseconds(50));
    released = true;
    DrainGate::Ticket gone = *std::move(held);
  });
  EXPECT_TRUE(gate.Close(absl::Now() + absl::Seconds(30)));
  EXPECT_TRUE(released.load());
  releaser.join();
  // A moved-from ticket and a default one release nothing.
  DrainGate::Ticket empty;
  DrainGate::Ticket moved = std::move(empty);
  EXPECT_TRUE(gate.Close(absl::Now()));
}

// A cross-node CopyPrefix: AdmitWrite when it begins, Readmit when it commits.
TEST(DrainGateTest, WritesAdmittedBeforeADrainAreAwaitedAndCommitThrough) {
  HostDevice device(size_t{1} << 24);
  absl::StatusOr<std::unique_ptr<Cache>> made = Cache::Create(
      testutil::Spec(DType::kF16, 4, 64, 16, {testutil::Group(testutil::Full())}), &device);
  ASSERT_TRUE(made.ok()) << made.status();
  Cache& cache = **made;
  ASSERT_TRUE(testutil::AppendRange(cache, 0, 0, 4).ok());  // sequence 0 exists, 1 and 2 not
  const int64_t held_seq[] = {0};
  const int64_t new_seq[] = {1};
  DrainGate gate("node-a");
  // Into a new sequence, and over one that exists: both hold tickets.
  absl::StatusOr<DrainGate::Ticket> into_new = gate.AdmitWrite(cache, new_seq, "CopyPrefix");
  absl::StatusOr<DrainGate::Ticket> over_held = gate.AdmitWrite(cache, held_seq, "CopyPrefix");
  ASSERT_TRUE(into_new.ok() && over_held.ok());
  // A drain waits for both.
  EXPECT_FALSE(gate.Close(absl::Now() + absl::Milliseconds(20)));
  { DrainGate::Ticket done = *std::move(over_held); }
  EXPECT_FALSE(gate.AwaitAdmitted(absl::Now() + absl::Milliseconds(20)));
  // The drain gave up on the copy into a new sequence: its commit is refused.
  absl::StatusOr<DrainGate::Ticket> late = gate.Readmit(*into_new, cache, new_seq, "CopyPrefix");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable) << late.status();
  // While a drain waits again (as the shutdown drain after a Drain call), it goes through;
  // then the drain is done waiting.
  std::thread copy([&] {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    absl::StatusOr<DrainGate::Ticket> commit;
    do {
      absl::SleepFor(absl::Milliseconds(1));
      commit = gate.Readmit(*into_new, cache, new_seq, "CopyPrefix");
    } while (!commit.ok() && absl::Now() < end);
    EXPECT_TRUE(commit.ok()) << commit.status();
    DrainGate::Ticket done = *std::move(into_new);
  });
  EXPECT_TRUE(gate.AwaitAdmitted(absl::Now() + absl::Seconds(30)));
  copy.join();

  // While draining: into a new sequence refused before anything moves; over one that exists
  // admitted, but not awaited by the drain in progress, and refused at its commit when its
  // sequence is gone by then (drained away), as a write of a new sequence is.
  absl::StatusOr<DrainGate::Ticket> refused = gate.AdmitWrite(cache, new_seq, "CopyPrefix");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(), AllOf(HasSubstr("node 'node-a' is draining"),
                                                HasSubstr("CopyPrefix into sequence 1")));
  absl::StatusOr<DrainGate::Ticket> during = gate.AdmitWrite(cache, held_seq, "CopyPrefix");
  ASSERT_TRUE(during.ok()) << during.status();
  EXPECT_TRUE(gate.AwaitAdmitted(absl::Now()));
  EXPECT_TRUE(gate.Readmit(*during, cache, held_seq, "CopyPrefix").ok());
  ASSERT_TRUE(cache.Remove(0, 0, std::nullopt).ok());
  absl::StatusOr<DrainGate::Ticket> gone = gate.Readmit(*during, cache, held_seq, "CopyPrefix");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable) << gone.status();
  // After a resume it belongs to the next drain, which waits for it: its commit goes through
  // until that drain gives up on it.
  gate.Open();
  gate.Close();
  EXPECT_TRUE(gate.Readmit(*during, cache, held_seq, "CopyPrefix").ok());
  EXPECT_FALSE(gate.AwaitAdmitted(absl::Now()));
  EXPECT_FALSE(gate.Readmit(*during, cache, held_seq, "CopyPrefix").ok());
  { DrainGate::Ticket done = *std::move(during); }
  EXPECT_TRUE(gate.AwaitAdmitted(absl::Now()));
}

TEST(DrainGateTest, RacingCloseAndOpenLeaveTheListenerToldTheFinalState) {
  DrainGate gate("node-a");
  std::atomic<int> last{-1};
  gate.set_listener([&](bool draining) { last = draining ? 1 : 0; });
  std::thread closer([&] {
    for (int i = 0; i < 200; ++i) gate.Close(absl::Now());
  });
  std::thread opener([&] {
    for (int i = 0; i < 200; ++i) gate.Open();
  });
  closer.join();
  opener.join();
  gate.Open();
  EXPECT_EQ(last.load(), 0);
  gate.Close(absl::Now());
  EXPECT_EQ(last.load(), 1);
}

}  // namespace
}  // namespace kvmesh
