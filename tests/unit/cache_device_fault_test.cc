// Device failures in the middle of an operation: a HostDevice whose Scatter, CopyRows or
// RopeShift fails on request. Append must leave the cache as it was (all groups are written
// before any is committed); a Remove whose data rewrite failed must leave consistent metadata
// and refuse further data operations instead of serving possibly wrong bytes.
#include <optional>

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
using testutil::Rope;
using testutil::SameState;
using testutil::Sliding;
using testutil::Spec;

class FaultyDevice : public HostDevice {
 public:
  FaultyDevice() : HostDevice(size_t{1} << 28) {}

  // The n-th call (0-based) of the named operation fails; -1 never.
  int fail_scatter_at = -1;
  int fail_copy_at = -1;
  int fail_rope_at = -1;

  absl::Status Scatter(const DeviceArena& arena, absl::Span<const Plane> planes,
                       absl::Span<const int32_t> rows, const uint8_t* src) override {
    if (scatter_calls_++ == fail_scatter_at) return absl::InternalError("injected scatter fault");
    return HostDevice::Scatter(arena, planes, rows, src);
  }
  absl::Status CopyRows(const DeviceArena& arena, absl::Span<const Plane> planes,
                        absl::Span<const int32_t> src, absl::Span<const int32_t> dst) override {
    if (copy_calls_++ == fail_copy_at) return absl::InternalError("injected copy fault");
    return HostDevice::CopyRows(arena, planes, src, dst);
  }
  absl::Status RopeShift(const DeviceArena& arena, absl::Span<const Plane> planes,
                         absl::Span<const int32_t> rows, const RopeShiftParams& p) override {
    if (rope_calls_++ == fail_rope_at) return absl::InternalError("injected rope fault");
    return HostDevice::RopeShift(arena, planes, rows, p);
  }
  void ResetCounts() { scatter_calls_ = copy_calls_ = rope_calls_ = 0; }

 private:
  int scatter_calls_ = 0;
  int copy_calls_ = 0;
  int rope_calls_ = 0;
};

// Group 0 sliding (window 2, memory 3 with two sequences), group 1 full: a batch far ahead
// prunes group 0, and the small pool forces the pruned cells to be reused.
CacheSpec TwoGroupSpec() {
  return Spec(DType::kF32, 2, 100, 4,
              {Group(Sliding(2), 1, 1, 4, 4, Rope(RopeType::kNeox, 4)),
               Group(Full(), 2, 1, 4, 4, Rope(RopeType::kNeox, 4))});
}

TEST(CacheDeviceFaultTest, AppendFailingInSecondGroupLeavesCacheAsBefore) {
  FaultyDevice device;
  auto cache = Cache::Create(TwoGroupSpec(), &device);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(AppendRange(**cache, 0, 0, 2).ok());
  const testutil::CacheState before = CaptureState(**cache);
  device.ResetCounts();
  device.fail_scatter_at = 1;  // group 0 is written, group 1 fails
  const absl::Status s = AppendRange(**cache, 0, 50, 51);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(SameState(before, CaptureState(**cache)));
  // The cache goes on working, for the same sequence and a new one.
  device.fail_scatter_at = -1;
  EXPECT_TRUE(AppendRange(**cache, 1, 0, 2).ok());
  EXPECT_TRUE(AppendRange(**cache, 0, 50, 51).ok());
  auto read = (*cache)->Read(0, 0, std::nullopt);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->positions[0], (std::vector<int32_t>{50}));
  EXPECT_EQ(read->positions[1], (std::vector<int32_t>{0, 1, 50}));
}

TEST(CacheDeviceFaultTest, AppendFailingInFirstGroupLeavesCacheAsBefore) {
  FaultyDevice device;
  auto cache = Cache::Create(TwoGroupSpec(), &device);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(AppendRange(**cache, 0, 0, 3).ok());
  ASSERT_TRUE(AppendRange(**cache, 1, 0, 3).ok());
  const testutil::CacheState before = CaptureState(**cache);
  device.ResetCounts();
  device.fail_scatter_at = 0;
  EXPECT_EQ(AppendRange(**cache, 1, 3, 7).code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(SameState(before, CaptureState(**cache)));
}

// One full group with NORMAL rope: a middle Remove copies shared cells, then rotates keys.
CacheSpec OneGroupSpec() {
  return Spec(DType::kF32, 2, 16, 8, {Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4))});
}

TEST(CacheDeviceFaultTest, RemoveWithFailedRopeShiftRefusesFurtherDataOperations) {
  FaultyDevice device;
  auto cache = Cache::Create(OneGroupSpec(), &device);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(AppendRange(**cache, 0, 0, 8).ok());
  device.fail_rope_at = 0;
  EXPECT_EQ((*cache)->Remove(0, 2, 4).code(), absl::StatusCode::kInternal);
  // Metadata moved consistently; data operations now refuse, naming the original error.
  auto seqs = (*cache)->ListSequences();
  ASSERT_EQ(seqs.size(), 1u);
  EXPECT_EQ(seqs[0].offset, 6);
  EXPECT_EQ(seqs[0].groups[0].stored, 6);
  const auto read = (*cache)->Read(0, 0, std::nullopt);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(read.status().message().find("injected rope fault"), std::string::npos)
      << read.status();
  EXPECT_EQ(AppendRange(**cache, 0, 6, 7).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*cache)->CopyPrefix(0, 1, 4).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*cache)->Remove(0, 0, std::nullopt).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CacheDeviceFaultTest, RemoveWithFailedCopyOfSharedCellsRefusesFurtherDataOperations) {
  FaultyDevice device;
  auto cache = Cache::Create(OneGroupSpec(), &device);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(AppendRange(**cache, 0, 0, 8).ok());
  ASSERT_TRUE((*cache)->CopyPrefix(0, 1, 8).ok());
  device.fail_copy_at = 0;
  EXPECT_EQ((*cache)->Remove(1, 2, 4).code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*cache)->Read(0, 0, std::nullopt).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Cells stay accounted for: 8 shared + 4 private copies of the moved ones.
  EXPECT_EQ((*cache)->Usage().groups[0].cells_used, 12);
}

}  // namespace
}  // namespace kvmesh
