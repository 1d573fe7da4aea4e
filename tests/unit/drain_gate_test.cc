// DrainGate (service/cluster/drain_gate.h): tickets while open, UNAVAILABLE naming the node while
// draining, Close waiting for the tickets handed out before it, and the listener told the state.
#include "service/cluster/drain_gate.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

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
