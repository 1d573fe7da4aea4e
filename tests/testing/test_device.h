// The Device the engine tests run on, and helpers that touch device memory only through the
// Device interface.
//
// Every engine test builds its device with MakeTestDevice. By default that is a HostDevice; with
// KVMESH_TEST_DEVICE=cuda it is a CudaDevice on the GPU named by KVMESH_TEST_CUDA_DEVICE (default
// 0), so the same test binary checks both implementations (ctest registers each engine test a
// second time as <name>_cuda, label `gpu`). Test binaries linked with kvmesh_test_main call
// RegisterTestDevice, which prints the device and skips every test when CUDA is selected but no
// GPU is visible.
//
// CUDA arena memory is a device pointer: tests never dereference DeviceArena::data(). They fill
// arenas with WriteArena (a Scatter) and inspect them with ReadArena (a Gather).
//
// Thread safety: the functions read the environment and are safe from any thread; the returned
// devices follow Device's contract.
#ifndef KVMESH_TESTS_TESTING_TEST_DEVICE_H_
#define KVMESH_TESTS_TESTING_TEST_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cache/device/device.h"
#include "gtest/gtest.h"

namespace kvmesh {
namespace testutil {

// What KVMESH_TEST_DEVICE and KVMESH_TEST_CUDA_DEVICE select.
struct TestDeviceSelection {
  bool cuda = false;  // false: HostDevice
  int ordinal = 0;    // CUDA device index when cuda
  // What Device::name() of the selected device returns: "host" or "cuda:N" ("cuda:N
  // (simulated)" in a -DKVMESH_CUDA=SIM build).
  std::string name() const;
};

// The selection of the environment. INVALID_ARGUMENT when KVMESH_TEST_DEVICE is set to anything
// but "host", "cuda" or "" or KVMESH_TEST_CUDA_DEVICE is not a non-negative integer.
absl::StatusOr<TestDeviceSelection> SelectedTestDevice();

// Whether the tests run on CUDA (an invalid selection counts as host: the environment reports
// it as a failure before any test runs).
bool TestOnCuda();

// The CUDA ordinal of the selection (KVMESH_TEST_CUDA_DEVICE, default 0), also when the tests
// otherwise run on the host (the parity test compares both devices).
int TestCudaOrdinal();

// Creates the selected device with the two budgets (MemoryPool::kCache, kSnapshot). Errors are
// CreateCudaDevice's (FAILED_PRECONDITION without CUDA support, INVALID_ARGUMENT for an ordinal
// that names no GPU, ...) or the selection's.
absl::StatusOr<std::unique_ptr<Device>> CreateTestDevice(size_t budget_bytes,
                                                         size_t snapshot_budget_bytes);

// As CreateTestDevice, for tests: a device that cannot be created is a broken test machine, not a
// test outcome, so this prints why and aborts the binary. Where no GPU is visible
// TestDeviceSkipper skips every test before it gets here, so this fires only on a real CUDA
// error (say, budgets beyond the GPU's free memory).
std::unique_ptr<Device> MakeTestDevice(size_t budget_bytes, size_t snapshot_budget_bytes);
// The snapshot pool as large as the cache pool (as HostDevice's one-budget constructor).
inline std::unique_ptr<Device> MakeTestDevice(size_t budget_bytes) {
  return MakeTestDevice(budget_bytes, budget_bytes);
}

// Writes `bytes` to the start of `arena` (one Scatter of a single row). REQUIRES: bytes.size()
// <= arena.size().
::testing::AssertionResult WriteArena(Device& device, const DeviceArena& arena,
                                      const std::vector<uint8_t>& bytes);

// Reads the whole arena into *out (one Gather of a single row).
::testing::AssertionResult ReadArena(Device& device, const DeviceArena& arena,
                                     std::vector<uint8_t>* out);

// The arena's bytes, or an empty vector after recording a test failure.
std::vector<uint8_t> ArenaBytes(Device& device, const DeviceArena& arena);

// Prints the selected device before the first test; an invalid selection is a fatal failure.
// With CUDA selected and no GPU visible it prints kNoGpuMessage once and every test of the
// binary is reported SKIPPED (by TestDeviceSkipper) and the binary exits 0; ctest reports the
// whole test as skipped by matching kNoGpuMessage (SKIP_REGULAR_EXPRESSION).
//
// Why not GTEST_SKIP() in SetUp alone: gtest 1.12 then runs no test but counts every one of
// them as PASSED ("[  PASSED  ] 12 tests."), which would read as GPU coverage that never ran.
class TestDeviceEnvironment : public ::testing::Environment {
 public:
  // Part of the skip message; tests/CMakeLists.txt matches it.
  static constexpr const char* kNoGpuMessage = "KVMESH_TEST_DEVICE=cuda but no CUDA device";

  void SetUp() override;

  // Whether SetUp found CUDA selected and no GPU.
  bool no_gpu() const { return no_gpu_; }

 private:
  bool no_gpu_ = false;
};

// Skips each test as it starts (before its fixture is even constructed) when `environment`
// found no GPU, so that gtest lists every test as SKIPPED. `environment` must outlive it.
class TestDeviceSkipper : public ::testing::EmptyTestEventListener {
 public:
  explicit TestDeviceSkipper(const TestDeviceEnvironment* environment)
      : environment_(environment) {}
  void OnTestStart(const ::testing::TestInfo& test_info) override;

 private:
  const TestDeviceEnvironment* const environment_;
};

// Registers TestDeviceEnvironment and TestDeviceSkipper with gtest (which owns them). Call
// between InitGoogleTest and RUN_ALL_TESTS (kvmesh_test_main does).
void RegisterTestDevice();

}  // namespace testutil
}  // namespace kvmesh

#endif  // KVMESH_TESTS_TESTING_TEST_DEVICE_H_
