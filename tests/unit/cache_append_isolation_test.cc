// An Append moves its bytes without the cache's lock (Cache::Append on Attention-only caches):
// a HostDevice whose Scatter can be held shut stops a large Append half-way, with its cells
// taken and its bytes not yet written. Meanwhile other sequences append, fork, read and list;
// the appending sequence is invisible and operations that change it wait; the sequence slot it
// will take counts against max_sequences. When the Append finishes, the cache must be exactly
// what running the same operations one after another gives, in the order they took effect.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "cache/cache.h"
#include "cache/device/host_device.h"
#include "gtest/gtest.h"
#include "tests/unit/cache_test_util.h"

namespace kvmesh {
namespace {

using testutil::AppendRange;
using testutil::CaptureState;
using testutil::Full;
using testutil::Group;
using testutil::IsError;
using testutil::Range;
using testutil::Rope;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;

// A HostDevice whose next Scatter of at least `rows` rows, once armed, waits until Open() and
// then writes (or fails, when told to).
class GatedDevice : public HostDevice {
 public:
  GatedDevice() : HostDevice(size_t{1} << 28) {}

  void Arm(size_t rows, bool fail) {
    std::lock_guard<std::mutex> lock(mu_);
    armed_rows_ = rows;
    fail_ = fail;
  }
  void AwaitHeld() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return held_; });
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

  absl::Status Scatter(const DeviceArena& arena, absl::Span<const Plane> planes,
                       absl::Span<const int32_t> rows, const uint8_t* src) override {
    bool fail = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (armed_rows_ > 0 && rows.size() >= armed_rows_) {
        armed_rows_ = 0;
        held_ = true;
        cv_.notify_all();
        cv_.wait(lock, [this] { return open_; });
        fail = fail_;
      }
    }
    if (fail) return absl::InternalError("gated scatter failed as told");
    return HostDevice::Scatter(arena, planes, rows, src);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t armed_rows_ = 0;
  bool fail_ = false;
  bool held_ = false;
  bool open_ = false;
};

// A full and a sliding-window group (so the held Append's commit prunes), 4 sequences.
CacheSpec IsolationSpec() {
  return Spec(DType::kF16, 4, 256, 64,
              {Group(Full(), 2, 2, 4, 2, Rope(RopeType::kNormal, 4)),
               Group(Sliding(8), 1, 1, 2, 2, Rope(RopeType::kNeox, 2))});
}

std::unique_ptr<Cache> MakeCache(Device* device) {
  absl::StatusOr<std::unique_ptr<Cache>> cache = Cache::Create(IsolationSpec(), device);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? std::move(cache).value() : nullptr;
}

// What the tests start from: sequence 0 holds 16 tokens and, with `seq1`, sequence 1 holds 8.
void StartFrom(Cache& cache, bool seq1) {
  ASSERT_TRUE(AppendRange(cache, 0, 0, 16).ok());
  if (seq1) {
    ASSERT_TRUE(AppendRange(cache, 1, 0, 8).ok());
  }
}

// The operations run while sequence 1's Append of [8, 56) is held (or, with !held, in a
// reference run that has no such Append), each checked.
void WhileHeld(Cache& cache, bool seq1, bool held) {
  // Sequence 1 still shows what it held before, or nothing.
  if (seq1) {
    ASSERT_EQ(testutil::StoredPositions(cache, 1)[0], Range(0, 8));
  } else {
    ASSERT_TRUE(IsError(cache.Read(1, 0, std::nullopt).status(), absl::StatusCode::kNotFound,
                        {"sequence 1"}));
    ASSERT_FALSE(testutil::FindSequence(cache, 1).has_value());
  }
  // Other sequences go on: a decode step, a fork, a new sequence.
  ASSERT_TRUE(AppendRange(cache, 0, 16, 17).ok());
  ASSERT_TRUE(cache.CopyPrefix(0, 2, 12).ok());
  ASSERT_TRUE(AppendRange(cache, 3, 0, 4).ok());
  // Four sequences are live, or three and the one the held Append makes live: a fifth is
  // refused (a refusal changes nothing, so a reference run without the held Append skips it).
  if (held) {
    EXPECT_TRUE(IsError(AppendRange(cache, 5, 0, 1), absl::StatusCode::kResourceExhausted,
                        {"max_sequences = 4"}));
  }
}

TEST(CacheAppendIsolationTest, OtherSequencesGoOnWhileTheBytesMove) {
  GatedDevice device;
  std::unique_ptr<Cache> cache = MakeCache(&device);
  ASSERT_NE(cache, nullptr);
  StartFrom(*cache, true);
  device.Arm(48, /*fail=*/false);
  absl::Status held_status;
  std::thread held([&] { held_status = AppendRange(*cache, 1, 8, 56); });
  device.AwaitHeld();
  WhileHeld(*cache, true, true);
  if (HasFatalFailure()) {
    device.Open();
    held.join();
    return;
  }

  // A change to sequence 1 waits for its Append: this truncation must see 56 positions.
  std::atomic<bool> removed{false};
  absl::Status remove_status;
  std::thread remover([&] {
    remove_status = cache->Remove(1, 32, std::nullopt);
    removed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(removed.load()) << "Remove of a sequence went ahead of its Append";
  // While it waits, the cache still serves others.
  EXPECT_TRUE(AppendRange(*cache, 0, 17, 18).ok());

  device.Open();
  held.join();
  remover.join();
  ASSERT_TRUE(held_status.ok()) << held_status;
  ASSERT_TRUE(remove_status.ok()) << remove_status;

  // The same operations one after another, in the order they took effect.
  HostDevice reference_device(size_t{1} << 28);
  std::unique_ptr<Cache> reference = MakeCache(&reference_device);
  ASSERT_NE(reference, nullptr);
  StartFrom(*reference, true);
  WhileHeld(*reference, true, true);
  ASSERT_TRUE(AppendRange(*reference, 0, 17, 18).ok());
  ASSERT_TRUE(AppendRange(*reference, 1, 8, 56).ok());
  ASSERT_TRUE(reference->Remove(1, 32, std::nullopt).ok());
  EXPECT_TRUE(SameState(CaptureState(*reference), CaptureState(*cache)));
  EXPECT_EQ(testutil::StoredPositions(*cache, 1)[0], Range(0, 32));
}

// The held Append makes sequence 1 live: its slot is claimed while the bytes move, and given
// back with its cells when the write fails.
TEST(CacheAppendIsolationTest, AFailedWriteOfANewSequenceGivesItsSlotAndCellsBack) {
  GatedDevice device;
  std::unique_ptr<Cache> cache = MakeCache(&device);
  ASSERT_NE(cache, nullptr);
  StartFrom(*cache, false);
  device.Arm(48, /*fail=*/true);
  absl::Status held_status;
  std::thread held([&] { held_status = AppendRange(*cache, 1, 8, 56); });
  device.AwaitHeld();
  WhileHeld(*cache, false, true);
  const bool checked = !HasFatalFailure();
  device.Open();
  held.join();
  ASSERT_TRUE(checked);
  EXPECT_TRUE(IsError(held_status, absl::StatusCode::kInternal, {"gated scatter failed"}));

  // As if the failed Append had never been asked for.
  HostDevice reference_device(size_t{1} << 28);
  std::unique_ptr<Cache> reference = MakeCache(&reference_device);
  ASSERT_NE(reference, nullptr);
  StartFrom(*reference, false);
  WhileHeld(*reference, false, false);
  EXPECT_TRUE(SameState(CaptureState(*reference), CaptureState(*cache)));
  // The slot is free again.
  EXPECT_TRUE(AppendRange(*cache, 5, 0, 1).ok());
}

}  // namespace
}  // namespace kvmesh
