// LeaseTable (expiry, renewal, release, callbacks) and Reservations (operations against
// migrations of sequences and snapshots): the bookkeeping behind the pull protocol
// (docs/cluster.md), without gRPC.
#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/cluster/leases.h"
#include "service/cluster/reservations.h"

namespace kvmesh {
namespace {

using ::testing::HasSubstr;

class BytesPayload final : public transport::LeasedPayload {
 public:
  explicit BytesPayload(size_t n) : n_(n) {}
  size_t size() const override { return n_; }
  absl::Status ReadAt(size_t, absl::Span<uint8_t> dst) override {
    for (uint8_t& b : dst) b = 7;
    return absl::OkStatus();
  }

 private:
  const size_t n_;
};

TEST(LeaseTableTest, TouchRenewsReleaseEndsAndCallbacksRunOnce) {
  std::atomic<int> ended{0};  // declared first: the table's destructor may still call back
  LeaseTable table(absl::Milliseconds(10));
  const std::string id = *table.Grant(std::make_shared<BytesPayload>(5), "node-b",
                                      absl::Milliseconds(300), [&] { ++ended; });
  EXPECT_EQ(id.size(), 32u);
  EXPECT_EQ(table.size(), 1u);
  // Touching more often than the lease time keeps it alive well past it.
  for (int i = 0; i < 8; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    absl::StatusOr<std::shared_ptr<transport::LeasedPayload>> payload = table.Touch(id);
    ASSERT_TRUE(payload.ok()) << payload.status();
    EXPECT_EQ((*payload)->size(), 5u);
  }
  EXPECT_TRUE(table.Release(id).ok());
  EXPECT_EQ(ended.load(), 1);
  EXPECT_EQ(table.size(), 0u);
  const absl::Status again = table.Release(id);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(again.message(), HasSubstr(id));
  EXPECT_EQ(table.Touch(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ended.load(), 1);
  EXPECT_EQ(table.expired(), 0u);
}

// A payload that counts its own destruction (what its export reader pinned is free then).
class CountedPayload final : public transport::LeasedPayload {
 public:
  explicit CountedPayload(std::atomic<int>* destroyed) : destroyed_(destroyed) {}
  ~CountedPayload() override { ++*destroyed_; }
  size_t size() const override { return 3; }
  absl::Status ReadAt(size_t, absl::Span<uint8_t>) override { return absl::OkStatus(); }

 private:
  std::atomic<int>* const destroyed_;
};

// Release's `freed` runs once the last reference to the payload is gone, not when the lease
// ends: a Fetch stream still holding it (here, the reference Touch gave) delays it, on the
// table's own thread, never the caller's.
TEST(LeaseTableTest, FreedRunsOnceTheLastReferenceIsGone) {
  std::atomic<int> destroyed{0};
  std::atomic<int> freed{0};
  std::atomic<bool> freed_on_caller{false};
  LeaseTable table(absl::Milliseconds(10));
  const std::string id = *table.Grant(std::make_shared<CountedPayload>(&destroyed), "node-b",
                                      absl::Seconds(30), nullptr);
  absl::StatusOr<std::shared_ptr<transport::LeasedPayload>> held = table.Touch(id);
  ASSERT_TRUE(held.ok());
  const std::thread::id caller = std::this_thread::get_id();
  ASSERT_TRUE(table
                  .Release(id,
                           [&] {
                             EXPECT_EQ(destroyed.load(), 1);  // freed before it says so
                             freed_on_caller = std::this_thread::get_id() == caller;
                             ++freed;
                           })
                  .ok());
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(destroyed.load(), 0);
  EXPECT_EQ(freed.load(), 0);  // the stream still holds the payload
  held->reset();               // the stream ends
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (freed.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(freed.load(), 1);
  EXPECT_EQ(destroyed.load(), 1);
  EXPECT_FALSE(freed_on_caller.load());

  // Nothing else holding it: freed at once (on the table's thread).
  const std::string alone = *table.Grant(std::make_shared<CountedPayload>(&destroyed), "node-b",
                                         absl::Seconds(30), nullptr);
  ASSERT_TRUE(table.Release(alone, [&] { ++freed; }).ok());
  while (freed.load() == 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(freed.load(), 2);
  EXPECT_EQ(destroyed.load(), 2);

  // The testing lag keeps a released payload that much longer.
  table.set_testing_release_lag(absl::Milliseconds(200));
  const std::string lagged = *table.Grant(std::make_shared<CountedPayload>(&destroyed), "node-b",
                                          absl::Seconds(30), nullptr);
  const absl::Time released = absl::Now();
  ASSERT_TRUE(table.Release(lagged, [&] { ++freed; }).ok());
  while (freed.load() == 2 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(freed.load(), 3);
  EXPECT_GE(absl::Now() - released, absl::Milliseconds(200));
  EXPECT_EQ(destroyed.load(), 3);
}

// A payload still held when the table goes: its waiter runs where the last reference goes.
TEST(LeaseTableTest, FreedRunsAfterTheTableIsGone) {
  std::atomic<int> destroyed{0};
  std::atomic<int> freed{0};
  std::shared_ptr<transport::LeasedPayload> held;
  {
    LeaseTable table(absl::Milliseconds(10));
    const std::string id = *table.Grant(std::make_shared<CountedPayload>(&destroyed), "node-b",
                                        absl::Seconds(30), nullptr);
    held = *table.Touch(id);
    ASSERT_TRUE(table.Release(id, [&] { ++freed; }).ok());
  }
  EXPECT_EQ(freed.load(), 0);
  held.reset();
  EXPECT_EQ(freed.load(), 1);
  EXPECT_EQ(destroyed.load(), 1);
}

TEST(LeaseTableTest, UntouchedLeaseExpiresOnItsOwn) {
  std::atomic<int> ended{0};  // declared first: the table's destructor may still call back
  LeaseTable table(absl::Milliseconds(10));
  const std::string id = *table.Grant(std::make_shared<BytesPayload>(1), "node-b",
                                      absl::Milliseconds(100), [&] { ++ended; });
  const std::string other = *table.Grant(std::make_shared<BytesPayload>(1), "node-c",
                                         absl::Seconds(60), [&] { ++ended; });
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (ended.load() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(ended.load(), 1);
  EXPECT_EQ(table.expired(), 1u);
  EXPECT_EQ(table.Touch(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Touch(other).ok());
  EXPECT_NE(id, other);
}

TEST(LeaseTableTest, DestructorEndsRemainingLeases) {
  std::atomic<int> ended{0};
  {
    LeaseTable table;
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(
          table.Grant(std::make_shared<BytesPayload>(1), "x", absl::Seconds(60), [&] { ++ended; })
              .ok());
    }
  }
  EXPECT_EQ(ended.load(), 3);
}

TEST(LeaseTableTest, ConcurrentGrantsTouchesAndReleases) {
  std::atomic<int> ended{0};  // declared first: the table's destructor may still call back
  LeaseTable table(absl::Milliseconds(1));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        // A receiver of its own per thread: 1 lease at a time each, under the cap.
        const std::string id = *table.Grant(std::make_shared<BytesPayload>(1), "x",
                                            absl::Milliseconds(i % 3), [&] { ++ended; });
        (void)table.Touch(id);
        (void)table.Release(id);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (ended.load() < 800 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(ended.load(), 800);  // each lease ended exactly once, by release or expiry
  EXPECT_EQ(table.size(), 0u);
}

TEST(LeaseTableTest, IdsAreRandomAndBoundToTheirReceiver) {
  LeaseTable table(absl::Milliseconds(10), /*max_per_receiver=*/1000);
  std::set<std::string> ids;
  std::string previous;
  for (int i = 0; i < 500; ++i) {
    absl::StatusOr<std::string> id =
        table.Grant(std::make_shared<BytesPayload>(1), "node-b", absl::Seconds(60), nullptr);
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_EQ(id->size(), 32u);
    EXPECT_EQ(id->find_first_not_of("0123456789abcdef"), std::string::npos) << *id;
    EXPECT_TRUE(ids.insert(*id).second) << "repeated id " << *id;
    // Not a counter: consecutive ids share no long prefix.
    if (!previous.empty()) {
      EXPECT_NE(id->substr(0, 8), previous.substr(0, 8));
    }
    previous = *id;
  }
  const std::string id = *ids.begin();
  EXPECT_TRUE(table.CheckReceiver(id, "node-b").ok());
  const absl::Status other = table.CheckReceiver(id, "mallory");
  EXPECT_EQ(other.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(other.message(), HasSubstr("never granted to the caller"));
  EXPECT_EQ(table.CheckReceiver("00000000000000000000000000000001", "node-b").code(),
            absl::StatusCode::kNotFound);
}

TEST(LeaseTableTest, LeasesPerReceiverAreCapped) {
  LeaseTable table(absl::Milliseconds(10), /*max_per_receiver=*/2);
  absl::StatusOr<std::string> a =
      table.Grant(std::make_shared<BytesPayload>(1), "node-b", absl::Seconds(60), nullptr);
  absl::StatusOr<std::string> b =
      table.Grant(std::make_shared<BytesPayload>(1), "node-b", absl::Milliseconds(50), nullptr);
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<std::string> c =
      table.Grant(std::make_shared<BytesPayload>(1), "node-b", absl::Seconds(60), nullptr);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(c.status().message(), HasSubstr("node-b holds 2 export leases"));
  // Another receiver is not affected.
  EXPECT_TRUE(
      table.Grant(std::make_shared<BytesPayload>(1), "node-c", absl::Seconds(60), nullptr).ok());
  // A release frees a place, and so does an expiry.
  ASSERT_TRUE(table.Release(*a).ok());
  absl::StatusOr<std::string> d =
      table.Grant(std::make_shared<BytesPayload>(1), "node-b", absl::Seconds(60), nullptr);
  EXPECT_TRUE(d.ok()) << d.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  absl::StatusOr<std::string> e = absl::UnknownError("not yet");
  while (!e.ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    e = table.Grant(std::make_shared<BytesPayload>(1), "node-b", absl::Seconds(60), nullptr);
  }
  EXPECT_TRUE(e.ok()) << "lease b expired, but its place was not freed: " << e.status();
}

using Kind = Reservations::Kind;

TEST(ReservationsTest, OperationsAreAbortedWhileASequenceIsReserved) {
  Reservations r;
  {
    absl::StatusOr<Reservations::Guard> reserved =
        r.Reserve(Kind::kSequence, "llama", 3, "node-c", absl::InfiniteFuture());
    ASSERT_TRUE(reserved.ok()) << reserved.status();
    EXPECT_TRUE(r.IsReserved(Kind::kSequence, "llama", 3));
    const int64_t seqs[] = {1, 3};
    absl::StatusOr<Reservations::Guard> op =
        r.BeginOperation(Kind::kSequence, "llama", seqs, "Append");
    EXPECT_EQ(op.status().code(), absl::StatusCode::kAborted);
    EXPECT_THAT(op.status().message(), HasSubstr("Append"));
    EXPECT_THAT(op.status().message(), HasSubstr("sequence 3"));
    EXPECT_THAT(op.status().message(), HasSubstr("node-c"));
    // Other sequences, other caches and snapshots with the same id are free.
    const int64_t other[] = {1};
    EXPECT_TRUE(r.BeginOperation(Kind::kSequence, "llama", other, "Append").ok());
    const int64_t same[] = {3};
    EXPECT_TRUE(r.BeginOperation(Kind::kSequence, "qwen", same, "Append").ok());
    EXPECT_TRUE(r.BeginOperation(Kind::kSnapshot, "llama", same, "DropSnapshot").ok());
    // A second migration of it is aborted.
    absl::StatusOr<Reservations::Guard> twice =
        r.Reserve(Kind::kSequence, "llama", 3, "node-b", absl::InfiniteFuture());
    EXPECT_EQ(twice.status().code(), absl::StatusCode::kAborted);
    EXPECT_THAT(twice.status().message(), HasSubstr("already under migration to node 'node-c'"));
  }
  EXPECT_FALSE(r.IsReserved(Kind::kSequence, "llama", 3));
  const int64_t seqs[] = {3};
  EXPECT_TRUE(r.BeginOperation(Kind::kSequence, "llama", seqs, "Append").ok());
}

TEST(ReservationsTest, AReservationWaitsForRunningOperationsAndRefusesNewOnes) {
  Reservations r;
  const int64_t seqs[] = {4, 4};  // duplicates count once each, and are released alike
  absl::StatusOr<Reservations::Guard> op = r.BeginOperation(Kind::kSequence, "c", seqs, "Append");
  ASSERT_TRUE(op.ok());
  // With the operation running, a reservation with a short deadline gives up.
  absl::StatusOr<Reservations::Guard> early =
      r.Reserve(Kind::kSequence, "c", 4, "n", absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(r.IsReserved(Kind::kSequence, "c", 4));
  // A patient one waits until the operation ends.
  std::atomic<bool> reserved{false};
  std::thread migrator([&] {
    absl::StatusOr<Reservations::Guard> g =
        r.Reserve(Kind::kSequence, "c", 4, "n", absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(g.ok()) << g.status();
    reserved = true;
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!r.IsReserved(Kind::kSequence, "c", 4) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  // Reserved (new operations refused) but still waiting for the running one.
  const int64_t one[] = {4};
  EXPECT_EQ(r.BeginOperation(Kind::kSequence, "c", one, "Remove").status().code(),
            absl::StatusCode::kAborted);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(reserved.load());
  *op = Reservations::Guard();  // the operation ends
  migrator.join();
  EXPECT_TRUE(reserved.load());
  EXPECT_FALSE(r.IsReserved(Kind::kSequence, "c", 4));  // the migrator's guard went with it
}

}  // namespace
}  // namespace kvmesh
