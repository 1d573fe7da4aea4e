// Device failures in the middle of an operation: the device under test (HostDevice, or
// CudaDevice with KVMESH_TEST_DEVICE=cuda) wrapped so that its Scatter, CopyRows, CopyRowsBetween
// or RopeShift fails on request. Append must leave the cache as it was (all groups are written
// before any is committed); a Remove whose data rewrite failed must leave consistent metadata
// and refuse further data operations instead of serving possibly wrong bytes.
//
// On the simulated GPU (KVMESH_CUDA=SIM, run as _cuda) the fault sweeps go one level further
// down: the n-th call of a CUDA runtime function inside CudaDevice fails (a copy, a launch, a
// kernel fault that kills the context, an event), so the error paths of CudaDevice itself are
// held to the same promise.
#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "cache/cache.h"
#include "cache/device/device.h"
#include "cache/mutex.h"
#include "cache/status_macros.h"
#include "gtest/gtest.h"
#include "tests/testing/test_device.h"
#include "tests/unit/cache_test_util.h"

#if defined(KVMESH_TEST_CUDASIM)
#include "tests/testing/cudasim/cuda_sim.h"
#endif

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

// The device under test (MakeTestDevice), with faults injected on request.
//
// Memory and streams come from the wrapped device: every arena of this device owns an arena of
// the wrapped one with the same address (kept in inner_arenas_), and each operation forwards a
// non-owning view of its arenas (same address, size and stream, no owner) to the wrapped device,
// so a CudaDevice runs it on the cache's own stream as without the wrapper. Budgets and their
// accounting are this device's; the wrapped device gets room for both pools in its cache pool,
// where every arena goes.
class FaultyDevice : public Device {
 public:
  static constexpr size_t kBudget = size_t{1} << 28;

  FaultyDevice() : Device(kBudget, kBudget), inner_(testutil::MakeTestDevice(2 * kBudget, 0)) {}

  // The n-th call (0-based) of the named operation fails; -1 never.
  int fail_scatter_at = -1;
  int fail_copy_at = -1;
  int fail_rope_at = -1;
  int fail_copy_between_at = -1;
  int fail_gather_at = -1;
  bool triggered = false;  // whether an injected fault fired since ResetCounts

  std::string name() const override { return "faulty " + inner_->name(); }
  absl::StatusOr<std::shared_ptr<DeviceStream>> CreateStream() override {
    return inner_->CreateStream();
  }

  absl::Status Scatter(const DeviceArena& arena, absl::Span<const Plane> planes,
                       absl::Span<const int32_t> rows, const uint8_t* src) override {
    if (scatter_calls_++ == fail_scatter_at) return Fault("injected scatter fault");
    return inner_->Scatter(View(arena), planes, rows, src);
  }
  absl::Status Gather(const DeviceArena& arena, absl::Span<const Plane> planes,
                      absl::Span<const int32_t> rows, uint8_t* dst) override {
    if (gather_calls_++ == fail_gather_at) return Fault("injected gather fault");
    return inner_->Gather(View(arena), planes, rows, dst);
  }
  absl::Status CopyRows(const DeviceArena& arena, absl::Span<const Plane> planes,
                        absl::Span<const int32_t> src, absl::Span<const int32_t> dst) override {
    if (copy_calls_++ == fail_copy_at) return Fault("injected copy fault");
    return inner_->CopyRows(View(arena), planes, src, dst);
  }
  absl::Status RopeShift(const DeviceArena& arena, absl::Span<const Plane> planes,
                         absl::Span<const int32_t> rows, const RopeShiftParams& p) override {
    if (rope_calls_++ == fail_rope_at) return Fault("injected rope fault");
    return inner_->RopeShift(View(arena), planes, rows, p);
  }
  absl::Status CopyRowsBetween(const DeviceArena& src, absl::Span<const Plane> src_planes,
                               absl::Span<const int32_t> src_rows, const DeviceArena& dst,
                               absl::Span<const Plane> dst_planes,
                               absl::Span<const int32_t> dst_rows) override {
    if (copy_between_calls_++ == fail_copy_between_at) {
      return Fault("injected copy-between fault");
    }
    return inner_->CopyRowsBetween(View(src), src_planes, src_rows, View(dst), dst_planes,
                                   dst_rows);
  }
  void ResetCounts() {
    scatter_calls_ = copy_calls_ = rope_calls_ = copy_between_calls_ = gather_calls_ = 0;
    triggered = false;
  }
  void NoFaults() {
    fail_scatter_at = fail_copy_at = fail_rope_at = fail_copy_between_at = fail_gather_at = -1;
  }

 protected:
  absl::StatusOr<uint8_t*> RawAllocate(size_t bytes, MemoryPool pool, bool shareable) override {
    (void)pool;
    absl::StatusOr<DeviceArena> arena =
        inner_->Allocate(bytes, MemoryPool::kCache, nullptr, shareable);
    if (!arena.ok()) return arena.status();
    uint8_t* data = arena->data();
    MutexLock lock(&mu_);
    inner_arenas_[data] = std::move(arena).value();
    return data;
  }
  void RawFree(uint8_t* data, size_t bytes, MemoryPool pool) override {
    (void)pool;
    DeviceArena freed;  // returned to the wrapped device outside the lock
    MutexLock lock(&mu_);
    auto it = inner_arenas_.find(data);
    if (it == inner_arenas_.end()) return;
    freed = std::move(it->second);
    inner_arenas_.erase(it);
  }

 private:
  // The wrapped device's view of one of our arenas. No owner (null device): destroying it frees
  // nothing; the arena in inner_arenas_ does that.
  static DeviceArena View(const DeviceArena& arena) {
    return DeviceArena(nullptr, MemoryPool::kCache, arena.data(), arena.size(), arena.stream());
  }
  absl::Status Fault(const char* what) {
    triggered = true;
    return absl::InternalError(what);
  }

  const std::unique_ptr<Device> inner_;  // outlives inner_arenas_
  Mutex mu_;
  std::map<uint8_t*, DeviceArena> inner_arenas_ ABSL_GUARDED_BY(mu_);
  int scatter_calls_ = 0;
  int copy_calls_ = 0;
  int rope_calls_ = 0;
  int copy_between_calls_ = 0;
  int gather_calls_ = 0;
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

// ---- Rotating, Recurrent, Restore, commit: fault sweeps -------------------------------------
//
// Each scenario sets up a cache, then runs one operation with the n-th call of one device
// operation failing, for every n until the operation completes without reaching the fault.
// Whenever the fault fires, the operation must fail with the device's error and then either the
// cache is exactly as before (nothing stored was overwritten yet) or it refuses data operations
// with FAILED_PRECONDITION naming the device error: it never serves wrong bytes.

enum class FaultKind { kScatter, kCopy, kCopyBetween, kRope };

const char* FaultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kScatter:
      return "Scatter";
    case FaultKind::kCopy:
      return "CopyRows";
    case FaultKind::kCopyBetween:
      return "CopyRowsBetween";
    case FaultKind::kRope:
      return "RopeShift";
  }
  return "?";
}

void Arm(FaultyDevice& device, FaultKind kind, int n) {
  device.NoFaults();
  switch (kind) {
    case FaultKind::kScatter:
      device.fail_scatter_at = n;
      break;
    case FaultKind::kCopy:
      device.fail_copy_at = n;
      break;
    case FaultKind::kCopyBetween:
      device.fail_copy_between_at = n;
      break;
    case FaultKind::kRope:
      device.fail_rope_at = n;
      break;
  }
}

// Read, Append (of a new sequence 2), CopyPrefix and Remove refuse with FAILED_PRECONDITION; Read
// names the error (`cause`).
::testing::AssertionResult RefusesDataOperations(Cache& cache, int64_t seq,
                                                 absl::string_view cause = "injected") {
  const absl::Status read = cache.Read(seq, 0, std::nullopt).status();
  if (read.code() != absl::StatusCode::kFailedPrecondition ||
      read.message().find(cause) == absl::string_view::npos) {
    return ::testing::AssertionFailure() << "Read: " << read;
  }
  const absl::Status append = AppendRange(cache, 2, 0, 1);
  if (append.code() != absl::StatusCode::kFailedPrecondition) {
    return ::testing::AssertionFailure() << "Append: " << append;
  }
  const absl::Status copy = cache.CopyPrefix(seq, 2, 1000);
  if (copy.code() != absl::StatusCode::kFailedPrecondition) {
    return ::testing::AssertionFailure() << "CopyPrefix: " << copy;
  }
  const absl::Status remove = cache.Remove(seq, 0, std::nullopt);
  if (remove.code() != absl::StatusCode::kFailedPrecondition) {
    return ::testing::AssertionFailure() << "Remove: " << remove;
  }
  return ::testing::AssertionSuccess();
}

struct FaultScenario {
  std::string name;
  CacheSpec spec;
  std::function<void(Cache&)> setup;          // runs without faults
  std::function<absl::Status(Cache&)> op;     // runs with one fault armed
  std::function<void(const Cache&)> success;  // checks the result when no fault fired
  // Set instead of `op` for an operation that needs the cache shared (a sequence import).
  std::function<absl::Status(const std::shared_ptr<Cache>&)> shared_op = nullptr;
};

// One kind of fault of a sweep: `arm` makes the n-th call (from `first` on) fail, `disarm`
// says whether it fired and disarms it; `cause` is what the failed operation's status and the
// refusals afterwards name. `must_fire`: every scenario makes such a call.
struct SweepFault {
  std::string name;
  int first;
  std::function<void(FaultyDevice&, int)> arm;
  std::function<bool(FaultyDevice&)> disarm;
  std::string cause;
  bool must_fire = false;
};

// How far apart the calls a sweep fails are: 1 (every call) unless KVMESH_FAULT_SWEEP_STRIDE
// says otherwise (the TSan build: tests/unit/CMakeLists.txt).
int SweepStride() {
  const char* env = std::getenv("KVMESH_FAULT_SWEEP_STRIDE");
  int stride = 1;
  if (env != nullptr && (!absl::SimpleAtoi(env, &stride) || stride < 1)) {
    ADD_FAILURE() << "KVMESH_FAULT_SWEEP_STRIDE=" << env << " is not a positive integer";
    stride = 1;
  }
  return stride;
}

// Runs the scenario once for every n (every SweepStride()-th) until the armed fault no longer
// fires.
void Sweep(const FaultScenario& scenario, const SweepFault& fault, int* fired_runs) {
  const int stride = SweepStride();
  for (int n = fault.first;; n += stride) {
    SCOPED_TRACE(::testing::Message()
                 << scenario.name << ": " << fault.name << " call " << n << " fails");
    ASSERT_LT(n, 200) << "the operation never completes";
    FaultyDevice device;
    absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(scenario.spec, &device);
    ASSERT_TRUE(created.ok()) << created.status();
    const std::shared_ptr<Cache> shared = *std::move(created);
    Cache& cache = *shared;
    scenario.setup(cache);
    if (::testing::Test::HasFatalFailure()) return;
    const testutil::CacheState before = CaptureState(cache);
    fault.arm(device, n);
    const absl::Status status =
        scenario.shared_op ? scenario.shared_op(shared) : scenario.op(cache);
    if (!fault.disarm(device)) {
      ASSERT_TRUE(status.ok()) << status;
      scenario.success(cache);
      return;  // every later n is past the operation's calls
    }
    ++*fired_runs;
    ASSERT_FALSE(status.ok()) << "the device error was swallowed";
    EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
    EXPECT_NE(status.message().find(fault.cause), absl::string_view::npos) << status;
    const testutil::CacheState after = CaptureState(cache);
    // Either nothing changed, or every data operation refuses.
    if (!SameState(before, after)) {
      EXPECT_TRUE(RefusesDataOperations(cache, 0, fault.cause));
    }
  }
}

// The faults of a sweep: each Device operation of FaultyDevice; on the simulated GPU also the
// CUDA runtime calls inside CudaDevice (a copy, a launch, a kernel fault that kills the context
// and is then cleared as a device reset would, an event).
std::vector<SweepFault> SweepFaults() {
  std::vector<SweepFault> faults;
  for (FaultKind kind :
       {FaultKind::kScatter, FaultKind::kCopy, FaultKind::kCopyBetween, FaultKind::kRope}) {
    faults.push_back(SweepFault{FaultKindName(kind), 0,
                                [kind](FaultyDevice& device, int n) {
                                  device.ResetCounts();
                                  Arm(device, kind, n);
                                },
                                [](FaultyDevice& device) {
                                  const bool fired = device.triggered;
                                  device.NoFaults();
                                  return fired;
                                },
                                "injected"});
  }
#if defined(KVMESH_TEST_CUDASIM)
  if (testutil::TestOnCuda()) {
    const std::pair<const char*, cudaError_t> calls[] = {
        {"cudaMemcpyAsync", cudaErrorInvalidValue},
        {"cudaLaunchKernel", cudaErrorLaunchOutOfResources},
        {"kernel", cudaErrorIllegalAddress},
        {"cudaEventRecord", cudaErrorInvalidResourceHandle},
        {"cudaEventSynchronize", cudaErrorUnknown},
    };
    for (const auto& [call, error] : calls) {
      faults.push_back(SweepFault{absl::StrCat(call, " (", cudaGetErrorName(error), ")"), 1,
                                  [call = std::string(call), error = error](FaultyDevice&, int n) {
                                    cudasim::InjectFailure(call, n, error);
                                  },
                                  [](FaultyDevice&) {
                                    const bool fired = cudasim::PendingFailures() == 0;
                                    cudasim::ResetFailures();
                                    return fired;
                                  },
                                  cudaGetErrorName(error), /*must_fire=*/true});
    }
  }
#endif
  return faults;
}

void RunFaultSweep(const FaultScenario& scenario) {
  int fired_runs = 0;
  for (const SweepFault& fault : SweepFaults()) {
    int fired = 0;
    Sweep(scenario, fault, &fired);
    if (::testing::Test::HasFatalFailure()) return;
    if (fault.must_fire) {
      EXPECT_GT(fired, 0) << scenario.name << ": " << fault.name << " never fired";
    }
    fired_runs += fired;
  }
  EXPECT_GT(fired_runs, 0) << scenario.name << ": no device call to fail";
}

// Rings of 4 rows, 2 layers, so a wrapped Append overwrites rows in place.
CacheSpec RingSpec() {
  return Spec(DType::kF16, 3, 32, 8, {testutil::RotatingGroup(4, 2, 1, 4, 4)});
}

CacheSpec StateSpec() {
  return Spec(DType::kF16, 3, 32, 8, {testutil::RecurrentGroup(2, 2, 3, 1, 2, 2)});
}

CacheSpec HybridSpec() {
  return Spec(DType::kF16, 3, 32, 4,
              {testutil::RotatingGroup(4, 2, 1, 4, 4), testutil::RecurrentGroup(2, 2, 3, 1, 2, 2),
               Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4))});
}

::testing::AssertionResult HybridHolds(const Cache& cache, int64_t seq, int32_t n) {
  const std::vector<int32_t> window = testutil::Range(std::max(0, n - 4), n);
  return testutil::ReadIs(cache, seq, 0, std::nullopt, {window, {}, testutil::Range(0, n)},
                          {testutil::Ids(seq, window),
                           {testutil::StateId(seq, n)},
                           testutil::Ids(seq, testutil::Range(0, n))});
}

TEST(CacheDeviceFaultTest, RotatingWrappedDecode) {
  RunFaultSweep({"rotating decode", RingSpec(),
                 [](Cache& c) {
                   const absl::Status s = AppendRange(c, 0, 0, 6);
                   ASSERT_TRUE(s.ok()) << s;
                 },
                 [](Cache& c) { return AppendRange(c, 0, 6, 7, /*salt=*/1); },
                 [](const Cache& c) {
                   EXPECT_TRUE(
                       testutil::ReadIs(c, 0, 0, std::nullopt, {testutil::Range(3, 7)},
                                        {{testutil::TokenId(0, 3), testutil::TokenId(0, 4),
                                          testutil::TokenId(0, 5), testutil::TokenId(0, 6, 1)}}));
                 }});
}

TEST(CacheDeviceFaultTest, RotatingPrefillAroundTheRing) {
  RunFaultSweep(
      {"rotating prefill", RingSpec(),
       [](Cache& c) {
         ASSERT_TRUE(AppendRange(c, 0, 0, 3).ok());
         ASSERT_TRUE(AppendRange(c, 1, 0, 2).ok());
       },
       [](Cache& c) { return AppendRange(c, 0, 3, 9, /*salt=*/1); },
       [](const Cache& c) {
         EXPECT_TRUE(testutil::ReadIs(c, 0, 0, std::nullopt, {testutil::Range(5, 9)},
                                      {testutil::Ids(0, testutil::Range(5, 9), 1)}));
         EXPECT_TRUE(testutil::ReadIs(c, 1, 0, std::nullopt, {{0, 1}}, {testutil::Ids(1, {0, 1})}));
       }});
}

TEST(CacheDeviceFaultTest, RecurrentStateOverwrittenInPlace) {
  RunFaultSweep(
      {"recurrent in place", StateSpec(),
       [](Cache& c) { ASSERT_TRUE(AppendRange(c, 0, 0, 3).ok()); },
       [](Cache& c) { return AppendRange(c, 0, 3, 4, /*salt=*/1); },
       [](const Cache& c) {
         EXPECT_TRUE(testutil::ReadIs(c, 0, 0, std::nullopt, {{}}, {{testutil::StateId(0, 4, 1)}}));
       }});
}

TEST(CacheDeviceFaultTest, RecurrentCopyOnWrite) {
  RunFaultSweep(
      {"recurrent copy-on-write", StateSpec(),
       [](Cache& c) {
         ASSERT_TRUE(AppendRange(c, 0, 0, 3).ok());
         ASSERT_TRUE(c.CopyPrefix(0, 1, 3).ok());
       },
       [](Cache& c) { return AppendRange(c, 1, 3, 4); },
       [](const Cache& c) {
         EXPECT_TRUE(testutil::ReadIs(c, 0, 0, std::nullopt, {{}}, {{testutil::StateId(0, 3)}}));
         EXPECT_TRUE(testutil::ReadIs(c, 1, 0, std::nullopt, {{}}, {{testutil::StateId(1, 4)}}));
       }});
}

TEST(CacheDeviceFaultTest, HybridAppend) {
  RunFaultSweep({"hybrid append", HybridSpec(),
                 [](Cache& c) {
                   ASSERT_TRUE(AppendRange(c, 0, 0, 4).ok());
                   ASSERT_TRUE(AppendRange(c, 0, 4, 6).ok());
                 },
                 [](Cache& c) { return AppendRange(c, 0, 6, 8); },
                 [](const Cache& c) { EXPECT_TRUE(HybridHolds(c, 0, 8)); }});
}

TEST(CacheDeviceFaultTest, HybridRestoreFromSnapshot) {
  RunFaultSweep({"hybrid restore", HybridSpec(),
                 [](Cache& c) {
                   ASSERT_TRUE(AppendRange(c, 0, 0, 4).ok());
                   ASSERT_TRUE(AppendRange(c, 0, 4, 6).ok());
                   ASSERT_TRUE(c.Snapshot(0, 3).ok());
                   ASSERT_TRUE(AppendRange(c, 0, 6, 9, /*salt=*/1).ok());
                 },
                 [](Cache& c) { return c.Restore(0, 1, 6); },
                 [](const Cache& c) { EXPECT_TRUE(HybridHolds(c, 0, 6)); }});
}

TEST(CacheDeviceFaultTest, HybridRestoreIntoANewSequence) {
  RunFaultSweep({"hybrid restore new", HybridSpec(),
                 [](Cache& c) {
                   ASSERT_TRUE(AppendRange(c, 0, 0, 4).ok());
                   ASSERT_TRUE(AppendRange(c, 0, 4, 6).ok());
                   ASSERT_TRUE(c.Snapshot(0, 0).ok());
                 },
                 [](Cache& c) { return c.Restore(1, 1, 6); },
                 [](const Cache& c) {
                   const std::vector<int32_t> window = testutil::Range(2, 6);
                   EXPECT_TRUE(testutil::ReadIs(c, 1, 0, std::nullopt,
                                                {window, {}, testutil::Range(0, 6)},
                                                {testutil::Ids(0, window),
                                                 {testutil::StateId(0, 6)},
                                                 testutil::Ids(0, testutil::Range(0, 6))}));
                 }});
}

TEST(CacheDeviceFaultTest, HybridCommitSpeculation) {
  RunFaultSweep({"hybrid commit", HybridSpec(),
                 [](Cache& c) {
                   ASSERT_TRUE(AppendRange(c, 0, 0, 4).ok());
                   ASSERT_TRUE(AppendRange(c, 0, 4, 6).ok());
                   ASSERT_TRUE(testutil::AppendSpeculative(c, 0, 6, 9).ok());
                 },
                 [](Cache& c) { return c.CommitSpeculation(0, 2); },
                 [](const Cache& c) { EXPECT_TRUE(HybridHolds(c, 0, 8)); }});
}

TEST(CacheDeviceFaultTest, HybridSnapshotLeavesLiveDataAlone) {
  RunFaultSweep({"hybrid snapshot", HybridSpec(),
                 [](Cache& c) {
                   ASSERT_TRUE(AppendRange(c, 0, 0, 4).ok());
                   ASSERT_TRUE(AppendRange(c, 0, 4, 6).ok());
                 },
                 [](Cache& c) { return c.Snapshot(0, 2).status(); },
                 [](const Cache& c) {
                   EXPECT_TRUE(HybridHolds(c, 0, 6));
                   EXPECT_EQ(c.ListSnapshots().size(), 1u);
                 }});
}

TEST(CacheDeviceFaultTest, SnapshotFailureCreatesNoSnapshot) {
  FaultyDevice device;
  auto cache = Cache::Create(HybridSpec(), &device);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(AppendRange(**cache, 0, 0, 4).ok());
  device.ResetCounts();
  device.fail_copy_between_at = 0;
  device.fail_copy_at = 0;
  device.fail_scatter_at = 0;
  const absl::Status s = (*cache)->Snapshot(0, 0).status();
  if (device.triggered) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_TRUE((*cache)->ListSnapshots().empty());
    EXPECT_EQ(device.used_bytes(MemoryPool::kSnapshot), 0u);
    EXPECT_TRUE(HybridHolds(**cache, 0, 4));
  }
  device.NoFaults();
  absl::StatusOr<SnapshotInfo> snap = (*cache)->Snapshot(0, 0);
  ASSERT_TRUE(snap.ok()) << snap.status();
}

// A pinned Read (Cache::OpenRead of an Attention-only cache) whose gather fails: ReadAt
// returns the device's error, the cache is as before (a read changes nothing), the cursor still
// reads once the device works again, and dropping it releases the cells it pinned. The wrapped
// device shows no host addresses, so every byte goes through Gather, as on a GPU.
TEST(CacheDeviceFaultTest, PinnedReadWithAFailingGatherReportsItAndReleasesItsCells) {
  FaultyDevice device;
  const CacheSpec spec = Spec(DType::kF32, 2, 64, 16, {Group(Full(), 2, 1, 4, 4)});
  absl::StatusOr<std::unique_ptr<Cache>> created = Cache::Create(spec, &device);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::shared_ptr<Cache> cache = *std::move(created);
  ASSERT_TRUE(AppendRange(*cache, 0, 0, 16).ok());
  std::string whole;
  {
    absl::StatusOr<ReadResult> read = cache->Read(0, 0, std::nullopt);
    ASSERT_TRUE(read.ok()) << read.status();
    whole = read->payload;
  }
  const auto before = CaptureState(*cache);
  absl::StatusOr<std::unique_ptr<ReadCursor>> cursor = Cache::OpenRead(cache, 0, 0, std::nullopt);
  ASSERT_TRUE(cursor.ok()) << cursor.status();
  ASSERT_EQ((*cursor)->size(), whole.size());
  EXPECT_TRUE((*cursor)->View(0, whole.size()).empty());  // no host addresses here
  const size_t half = whole.size() / 2;
  std::string got(whole.size(), '\0');
  uint8_t* out = reinterpret_cast<uint8_t*>(got.data());
  device.ResetCounts();
  device.fail_gather_at = 0;
  const absl::Status failed = (*cursor)->ReadAt(0, absl::MakeSpan(out, half));
  ASSERT_TRUE(device.triggered);
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_TRUE(SameState(before, CaptureState(*cache)));
  device.NoFaults();
  ASSERT_TRUE((*cursor)->ReadAt(0, absl::MakeSpan(out, half)).ok());
  ASSERT_TRUE((*cursor)->ReadAt(half, absl::MakeSpan(out + half, whole.size() - half)).ok());
  EXPECT_TRUE(got == whole);
  // The sequence goes while the cursor pins its cells; they are freed when it goes.
  ASSERT_TRUE(cache->Remove(0, 0, std::nullopt).ok());
  EXPECT_EQ(cache->Usage().groups[0].cells_used, 16);
  cursor->reset();
  EXPECT_EQ(cache->Usage().groups[0].cells_used, 0);
  ASSERT_TRUE(AppendRange(*cache, 1, 0, 16).ok());  // the cache is usable
}

// A sequence received from another node (Cache::BeginSequenceImport, then RestoreImport into
// sequence 2 at target 8) with a device fault anywhere: while its bytes are written into the
// cells it pinned, or into the snapshot pool and then copied into the cells.
void SequenceImportSweep(const std::string& name, int32_t held_by_destination) {
  // 16 cells. The image: 8 positions of another cache's sequence, on a healthy device.
  const CacheSpec spec = Spec(DType::kF16, 1, 16, 16, {Group(Full(), 1, 1, 4, 4)});
  auto host = testutil::MakeTestDevice(size_t{1} << 26, size_t{1} << 26);
  absl::StatusOr<std::unique_ptr<Cache>> made = Cache::Create(spec, host.get());
  ASSERT_TRUE(made.ok()) << made.status();
  const std::shared_ptr<Cache> source = *std::move(made);
  ASSERT_TRUE(AppendRange(*source, 0, 0, 8, /*salt=*/7).ok());
  std::string image;
  std::string payload;
  {
    absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader =
        Cache::OpenSequenceExport(source, 0, 0, std::nullopt);
    ASSERT_TRUE(reader.ok()) << reader.status();
    image.resize((*reader)->size());
    ASSERT_TRUE(
        (*reader)
            ->ReadAt(0, absl::MakeSpan(reinterpret_cast<uint8_t*>(image.data()), image.size()))
            .ok());
    absl::StatusOr<ReadResult> read = source->Read(0, 0, std::nullopt);
    ASSERT_TRUE(read.ok()) << read.status();
    payload = read->payload;
  }
  RunFaultSweep({name, spec,
                 [held_by_destination](Cache& c) {
                   ASSERT_TRUE(AppendRange(c, 2, 0, held_by_destination).ok());
                 },
                 nullptr,
                 [payload](const Cache& c) {
                   absl::StatusOr<ReadResult> read = c.Read(2, 0, std::nullopt);
                   ASSERT_TRUE(read.ok()) << read.status();
                   EXPECT_TRUE(read->payload == payload);
                 },
                 [image, held_by_destination](const std::shared_ptr<Cache>& c) -> absl::Status {
                   absl::StatusOr<std::unique_ptr<SequenceImport>> import =
                       Cache::BeginSequenceImport(c, image.size());
                   if (!import.ok()) return import.status();
                   RETURN_IF_ERROR((*import)->Write(absl::MakeConstSpan(
                       reinterpret_cast<const uint8_t*>(image.data()), image.size())));
                   RETURN_IF_ERROR((*import)->Commit().status());
                   // 12 cells held by the destination leave 4 free, too few for the 8 rows: they
                   // went through the snapshot pool.
                   EXPECT_EQ((*import)->in_cells(), held_by_destination < 8);
                   return c->RestoreImport(2, **import, 8);
                 }});
}

TEST(CacheDeviceFaultTest, SequenceImportIntoPinnedCells) {
  SequenceImportSweep("sequence import into free cells", 4);
}

TEST(CacheDeviceFaultTest, SequenceImportThroughTheSnapshotPool) {
  SequenceImportSweep("sequence import through the snapshot pool", 12);
}

TEST(CacheDeviceFaultTest, HybridMiddleRemoval) {
  // Attention with RoPE plus Recurrent: the removal shifts keys and invalidates the state.
  const CacheSpec spec = Spec(DType::kF32, 3, 32, 8,
                              {Group(Full(), 1, 1, 4, 4, Rope(RopeType::kNormal, 4)),
                               testutil::RecurrentGroup(1, 2, 3, 1, 2, 2)});
  RunFaultSweep({"hybrid middle removal", spec,
                 [](Cache& c) {
                   ASSERT_TRUE(AppendRange(c, 0, 0, 6).ok());
                   ASSERT_TRUE(c.CopyPrefix(0, 1, 6).ok());
                 },
                 [](Cache& c) { return c.Remove(1, 1, 3); },
                 [](const Cache& c) {
                   const std::optional<SequenceInfo> info = testutil::FindSequence(c, 1);
                   ASSERT_TRUE(info.has_value());
                   EXPECT_EQ(info->offset, 4);
                   EXPECT_EQ(info->groups[1].state, StateStatus::kInvalid);
                   EXPECT_TRUE(testutil::ReadIs(
                       c, 0, 0, std::nullopt, {testutil::Range(0, 6), {}},
                       {testutil::Ids(0, testutil::Range(0, 6)), {testutil::StateId(0, 6)}}));
                 }});
}

TEST(CacheDeviceFaultTest, RotatingCopyPrefixOverAnExistingRing) {
  RunFaultSweep({"rotating copy over ring", RingSpec(),
                 [](Cache& c) {
                   ASSERT_TRUE(AppendRange(c, 0, 0, 6).ok());
                   ASSERT_TRUE(AppendRange(c, 1, 0, 3).ok());
                 },
                 [](Cache& c) { return c.CopyPrefix(1, 0, 3); },
                 [](const Cache& c) {
                   EXPECT_TRUE(testutil::ReadIs(c, 0, 0, std::nullopt, {{0, 1, 2}},
                                                {testutil::Ids(1, {0, 1, 2})}));
                 }});
}

TEST(CacheDeviceFaultTest, RecurrentRestoreIntoASharedState) {
  RunFaultSweep(
      {"recurrent restore shared", StateSpec(),
       [](Cache& c) {
         ASSERT_TRUE(AppendRange(c, 1, 0, 4).ok());
         ASSERT_TRUE(c.Snapshot(1, 0).ok());
         ASSERT_TRUE(c.Remove(1, 0, std::nullopt).ok());
         ASSERT_TRUE(AppendRange(c, 0, 0, 4, /*salt=*/1).ok());
         ASSERT_TRUE(c.CopyPrefix(0, 1, 4).ok());
       },
       [](Cache& c) { return c.Restore(1, 1, 4); },
       [](const Cache& c) {
         EXPECT_TRUE(testutil::ReadIs(c, 1, 0, std::nullopt, {{}}, {{testutil::StateId(1, 4)}}));
         EXPECT_TRUE(testutil::ReadIs(c, 0, 0, std::nullopt, {{}}, {{testutil::StateId(0, 4, 1)}}));
       }});
}

TEST(CacheDeviceFaultTest, HybridSpeculativeAppend) {
  RunFaultSweep({"hybrid speculative append", HybridSpec(),
                 [](Cache& c) {
                   ASSERT_TRUE(AppendRange(c, 0, 0, 4).ok());
                   ASSERT_TRUE(AppendRange(c, 0, 4, 6).ok());
                   ASSERT_TRUE(testutil::AppendSpeculative(c, 0, 6, 7).ok());
                 },
                 [](Cache& c) { return testutil::AppendSpeculative(c, 0, 7, 9); },
                 [](const Cache& c) {
                   EXPECT_TRUE(testutil::ReadIs(c, 0, 5, std::nullopt,
                                                {testutil::Range(5, 9), {}, testutil::Range(5, 9)},
                                                {testutil::Ids(0, testutil::Range(5, 9)),
                                                 {testutil::StateId(0, 9)},
                                                 testutil::Ids(0, testutil::Range(5, 9))}));
                 }});
}

// Writes that overwrite nothing stored (a new sequence's ring or state slot, the private copy of
// a shared state) fall under the all-or-nothing rule: a failed Append leaves the cache exactly
// as before and usable, as in the foundation.
TEST(CacheDeviceFaultTest, AppendOfANewSequenceFailingLeavesCacheAsBefore) {
  for (const CacheSpec& spec : {RingSpec(), StateSpec(), HybridSpec()}) {
    SCOPED_TRACE(GroupKindName(spec.groups[0].kind) + std::string(" first, ") +
                 std::to_string(spec.groups.size()) + " groups");
    FaultyDevice device;
    auto cache = Cache::Create(spec, &device);
    ASSERT_TRUE(cache.ok()) << cache.status();
    ASSERT_TRUE(AppendRange(**cache, 0, 0, 3).ok());
    const testutil::CacheState before = CaptureState(**cache);
    bool appended = false;
    for (int n = 0; n < 3 && !appended; ++n) {
      device.ResetCounts();
      device.fail_scatter_at = n;
      const absl::Status s = AppendRange(**cache, 1, 0, 2);
      device.NoFaults();
      if (!device.triggered) {
        // Fewer Scatter calls than n + 1: this Append went through untouched.
        ASSERT_TRUE(s.ok()) << s;
        appended = true;
        break;
      }
      EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
      EXPECT_TRUE(SameState(before, CaptureState(**cache))) << "scatter call " << n;
    }
    if (!appended) {
      ASSERT_TRUE(AppendRange(**cache, 1, 0, 2).ok());
    }
    EXPECT_TRUE((*cache)->Read(0, 0, std::nullopt).ok());
  }
}

TEST(CacheDeviceFaultTest, CopyOnWriteAppendFailingLeavesCacheAsBefore) {
  FaultyDevice device;
  auto cache = Cache::Create(StateSpec(), &device);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(AppendRange(**cache, 0, 0, 3).ok());
  ASSERT_TRUE((*cache)->CopyPrefix(0, 1, 3).ok());
  const testutil::CacheState before = CaptureState(**cache);
  device.ResetCounts();
  device.fail_scatter_at = 0;  // the new state into seq 1's private slot
  const absl::Status s = AppendRange(**cache, 1, 3, 4);
  device.NoFaults();
  ASSERT_TRUE(device.triggered);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(SameState(before, CaptureState(**cache)));
  ASSERT_TRUE(AppendRange(**cache, 1, 3, 4).ok());
  EXPECT_TRUE(testutil::ReadIs(**cache, 1, 0, std::nullopt, {{}}, {{testutil::StateId(1, 4)}}));
  EXPECT_TRUE(testutil::ReadIs(**cache, 0, 0, std::nullopt, {{}}, {{testutil::StateId(0, 3)}}));
}

}  // namespace
}  // namespace kvmesh
