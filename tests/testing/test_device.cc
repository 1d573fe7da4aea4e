#include "tests/testing/test_device.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cache/device/cuda_device.h"
#include "cache/device/host_device.h"

namespace kvmesh {
namespace testutil {

namespace {

const char* EnvOrEmpty(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

}  // namespace

std::string TestDeviceSelection::name() const {
  if (!cuda) return "host";
  return absl::StrCat("cuda:", ordinal, CudaSimulated() ? " (simulated)" : "");
}

absl::StatusOr<TestDeviceSelection> SelectedTestDevice() {
  TestDeviceSelection selection;
  const std::string device = EnvOrEmpty("KVMESH_TEST_DEVICE");
  if (device == "cuda") {
    selection.cuda = true;
  } else if (!device.empty() && device != "host") {
    return absl::InvalidArgumentError(absl::StrCat(
        "KVMESH_TEST_DEVICE=", device, ": expected \"host\" (the default) or \"cuda\""));
  }
  const std::string ordinal = EnvOrEmpty("KVMESH_TEST_CUDA_DEVICE");
  if (!ordinal.empty() &&
      (!absl::SimpleAtoi(ordinal, &selection.ordinal) || selection.ordinal < 0)) {
    return absl::InvalidArgumentError(absl::StrCat("KVMESH_TEST_CUDA_DEVICE=", ordinal,
                                                   ": expected a CUDA device index (0, 1, ...)"));
  }
  return selection;
}

bool TestOnCuda() {
  const absl::StatusOr<TestDeviceSelection> selection = SelectedTestDevice();
  return selection.ok() && selection->cuda;
}

int TestCudaOrdinal() {
  const absl::StatusOr<TestDeviceSelection> selection = SelectedTestDevice();
  return selection.ok() ? selection->ordinal : 0;
}

absl::StatusOr<std::unique_ptr<Device>> CreateTestDevice(size_t budget_bytes,
                                                         size_t snapshot_budget_bytes) {
  const absl::StatusOr<TestDeviceSelection> selection = SelectedTestDevice();
  if (!selection.ok()) return selection.status();
  if (!selection->cuda) {
    return std::unique_ptr<Device>(
        std::make_unique<HostDevice>(budget_bytes, snapshot_budget_bytes));
  }
  CudaDeviceOptions options;
  options.ordinal = selection->ordinal;
  options.budget_bytes = budget_bytes;
  options.snapshot_budget_bytes = snapshot_budget_bytes;
  return CreateCudaDevice(options);
}

std::unique_ptr<Device> MakeTestDevice(size_t budget_bytes, size_t snapshot_budget_bytes) {
  // CUDA selected and no GPU: TestDeviceSkipper has already marked the test SKIPPED, but gtest
  // still constructs its fixture, whose members may build a device. Give them a HostDevice; the
  // test body never runs.
  if (TestOnCuda() && CudaDeviceCount() == 0) {
    return std::make_unique<HostDevice>(budget_bytes, snapshot_budget_bytes);
  }
  absl::StatusOr<std::unique_ptr<Device>> device =
      CreateTestDevice(budget_bytes, snapshot_budget_bytes);
  if (!device.ok()) {
    std::fprintf(stderr, "kvmesh tests: cannot create the test device (budgets %zu and %zu): %s\n",
                 budget_bytes, snapshot_budget_bytes, device.status().ToString().c_str());
    std::fflush(stderr);
    std::abort();
  }
  return std::move(device).value();
}

::testing::AssertionResult WriteArena(Device& device, const DeviceArena& arena,
                                      const std::vector<uint8_t>& bytes) {
  if (bytes.size() > arena.size()) {
    return ::testing::AssertionFailure()
           << "writing " << bytes.size() << " bytes into an arena of " << arena.size();
  }
  if (bytes.empty()) return ::testing::AssertionSuccess();
  const Plane whole[] = {Plane{0, bytes.size()}};
  const int32_t row0[] = {0};
  const absl::Status status = device.Scatter(arena, whole, row0, bytes.data());
  if (!status.ok()) return ::testing::AssertionFailure() << "Scatter: " << status;
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult ReadArena(Device& device, const DeviceArena& arena,
                                     std::vector<uint8_t>* out) {
  out->assign(arena.size(), 0);
  if (arena.size() == 0) return ::testing::AssertionSuccess();
  const Plane whole[] = {Plane{0, arena.size()}};
  const int32_t row0[] = {0};
  const absl::Status status = device.Gather(arena, whole, row0, out->data());
  if (!status.ok()) {
    out->clear();
    return ::testing::AssertionFailure() << "Gather: " << status;
  }
  return ::testing::AssertionSuccess();
}

std::vector<uint8_t> ArenaBytes(Device& device, const DeviceArena& arena) {
  std::vector<uint8_t> bytes;
  ::testing::AssertionResult read = ReadArena(device, arena, &bytes);
  if (!read) ADD_FAILURE() << read.message();
  return bytes;
}

void TestDeviceEnvironment::SetUp() {
  const absl::StatusOr<TestDeviceSelection> selection = SelectedTestDevice();
  if (!selection.ok()) GTEST_FAIL() << selection.status();
  if (!selection->cuda) {
    std::printf("[ kvmesh   ] engine tests run on device \"host\" (HostDevice)\n");
    std::fflush(stdout);
    return;
  }
  const int count = CudaDeviceCount();
  if (count == 0) {
    no_gpu_ = true;
    std::printf(
        "[ kvmesh   ] %s is visible (CudaDeviceCount() == 0; built with CUDA: %s): "
        "every test is skipped\n",
        kNoGpuMessage, CudaBuilt() ? "yes" : "no");
    std::fflush(stdout);
    return;
  }
  if (selection->ordinal >= count) {
    GTEST_FAIL() << "KVMESH_TEST_CUDA_DEVICE=" << selection->ordinal << " but only " << count
                 << " CUDA device(s) are visible";
  }
  std::printf("[ kvmesh   ] engine tests run on device \"%s\" (CudaDevice, %d visible)\n",
              selection->name().c_str(), count);
  std::fflush(stdout);
}

void TestDeviceSkipper::OnTestStart(const ::testing::TestInfo& test_info) {
  // Recorded in the starting test's result: gtest then runs neither SetUp nor the body (it
  // still constructs the fixture; MakeTestDevice allows for that).
  if (environment_->no_gpu()) GTEST_SKIP() << "no CUDA device (see above)";
}

void RegisterTestDevice() {
  auto* environment = new TestDeviceEnvironment;
  ::testing::AddGlobalTestEnvironment(environment);
  ::testing::UnitTest::GetInstance()->listeners().Append(new TestDeviceSkipper(environment));
}

}  // namespace testutil
}  // namespace kvmesh
