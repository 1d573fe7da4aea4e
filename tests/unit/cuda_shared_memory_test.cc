// CudaDevice with `shareable` (cache/device/cuda_shared_memory.h): every arena is GPU memory of
// the driver's virtual memory management that a worker imports through a file descriptor. The
// test plays the worker in this process with the driver calls a worker makes (found as the
// device finds them, through cudaGetDriverEntryPointByVersion), on the simulated GPU in the SIM
// build and on a real one where a GPU is visible.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cache/device/cuda_device.h"
#include "cache/device/device.h"
#include "gtest/gtest.h"
#include "tests/testing/test_device.h"

#if defined(KVMESH_TEST_CUDASIM)
#include "tests/testing/cudasim/cuda_sim.h"
#endif

namespace kvmesh {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

template <typename F>
F Driver(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  EXPECT_EQ(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found),
            cudaSuccess);
  EXPECT_EQ(found, cudaDriverEntryPointSuccess) << name;
  return reinterpret_cast<F>(fn);
}

// What a worker does with an arena's descriptor: import, reserve, map, allow read-write.
struct Imported {
  CUdeviceptr address = 0;
  size_t size = 0;
};
Imported Import(const SharedArena& shared) {
  auto import = Driver<decltype(&cuMemImportFromShareableHandle)>("cuMemImportFromShareableHandle");
  auto reserve = Driver<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
  auto map = Driver<decltype(&cuMemMap)>("cuMemMap");
  auto set_access = Driver<decltype(&cuMemSetAccess)>("cuMemSetAccess");
  auto release = Driver<decltype(&cuMemRelease)>("cuMemRelease");
  Imported out;
  CUmemGenericAllocationHandle handle = 0;
  // A copy of the descriptor, as SCM_RIGHTS would give the worker.
  const int copy = dup(shared.fd);
  EXPECT_GE(copy, 0);
  EXPECT_EQ(import(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(copy)),
                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            CUDA_SUCCESS);
  close(copy);
  EXPECT_EQ(reserve(&out.address, shared.size, 0, 0, 0), CUDA_SUCCESS);
  EXPECT_EQ(map(out.address, shared.size, 0, handle, 0), CUDA_SUCCESS);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = shared.device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  EXPECT_EQ(set_access(out.address, shared.size, &access, 1), CUDA_SUCCESS);
  EXPECT_EQ(release(handle), CUDA_SUCCESS);  // the mapping keeps the memory
  out.size = shared.size;
  return out;
}

void Unimport(const Imported& imported) {
  EXPECT_EQ(Driver<decltype(&cuMemUnmap)>("cuMemUnmap")(imported.address, imported.size),
            CUDA_SUCCESS);
  EXPECT_EQ(
      Driver<decltype(&cuMemAddressFree)>("cuMemAddressFree")(imported.address, imported.size),
      CUDA_SUCCESS);
}

std::vector<uint8_t> DeviceBytes(CUdeviceptr address, size_t offset, size_t n) {
  std::vector<uint8_t> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), reinterpret_cast<const uint8_t*>(address) + offset, n,
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  return out;
}

std::unique_ptr<Device> SharedDevice() {
  CudaDeviceOptions options;
  options.ordinal = testutil::TestCudaOrdinal();
  options.budget_bytes = 64 * kMiB;
  options.snapshot_budget_bytes = 16 * kMiB;
  options.staging_bytes = 4 * kMiB;
  options.shareable = true;
  absl::StatusOr<std::unique_ptr<Device>> device = CreateCudaDevice(options);
  EXPECT_TRUE(device.ok()) << device.status();
  return device.ok() ? *std::move(device) : nullptr;
}

// An arena is zeroed GPU memory in whole granules; a worker that imports its descriptor sees the
// rows the device scatters and the device gathers the rows the worker writes. Once freed, the
// worker's mapping reads zeros, and a new arena is other memory.
TEST(CudaSharedMemoryTest, AWorkerMapsAnArenaAndSeesTheSameBytes) {
  std::unique_ptr<Device> device = SharedDevice();
  ASSERT_NE(device, nullptr);
  Imported imported;
  ino_t first = 0;
  {
    absl::StatusOr<DeviceArena> arena =
        device->Allocate(3 * kMiB + 5, MemoryPool::kCache, nullptr, /*shareable=*/true);
    ASSERT_TRUE(arena.ok()) << arena.status();
    absl::StatusOr<SharedArena> shared = device->Share(*arena);
    ASSERT_TRUE(shared.ok()) << shared.status();
    EXPECT_EQ(shared->kind, SharedArena::Kind::kCudaMemory);
    EXPECT_EQ(shared->device, testutil::TestCudaOrdinal());
    EXPECT_EQ(shared->size, 4 * kMiB);  // two 2 MiB granules
    absl::StatusOr<SharedArena> borrowed = device->Share(DeviceArena::Borrow(*arena));
    ASSERT_TRUE(borrowed.ok()) << borrowed.status();
    EXPECT_EQ(borrowed->fd, shared->fd);
    struct stat st;
    ASSERT_EQ(fstat(shared->fd, &st), 0);
    first = st.st_ino;
    imported = Import(*shared);
    EXPECT_EQ(DeviceBytes(imported.address, 0, 64), std::vector<uint8_t>(64, 0));
    EXPECT_EQ(DeviceBytes(imported.address, shared->size - 64, 64), std::vector<uint8_t>(64, 0));
    const Plane plane{0, 64};
    std::vector<uint8_t> row(64, 0xab);
    ASSERT_TRUE(device->Scatter(*arena, {&plane, 1}, std::vector<int32_t>{7}, row.data()).ok());
    EXPECT_EQ(DeviceBytes(imported.address, 7 * 64, 64), row);
    std::vector<uint8_t> written(64, 0x17);
    ASSERT_EQ(cudaMemcpy(reinterpret_cast<uint8_t*>(imported.address) + 2 * 64, written.data(), 64,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    std::vector<uint8_t> out(64);
    ASSERT_TRUE(device->Gather(*arena, {&plane, 1}, std::vector<int32_t>{2}, out.data()).ok());
    EXPECT_EQ(out, written);
  }
  EXPECT_EQ(device->used_bytes(), 0u);
  // Freed: the worker still maps it, and reads zeros.
  EXPECT_EQ(DeviceBytes(imported.address, 7 * 64, 64), std::vector<uint8_t>(64, 0));
  EXPECT_EQ(DeviceBytes(imported.address, 2 * 64, 64), std::vector<uint8_t>(64, 0));
  absl::StatusOr<DeviceArena> again =
      device->Allocate(3 * kMiB + 5, MemoryPool::kCache, nullptr, /*shareable=*/true);
  ASSERT_TRUE(again.ok()) << again.status();
  absl::StatusOr<SharedArena> shared = device->Share(*again);
  ASSERT_TRUE(shared.ok()) << shared.status();
  struct stat st;
  ASSERT_EQ(fstat(shared->fd, &st), 0);
  EXPECT_NE(st.st_ino, first);
  Unimport(imported);
}

// Without `shareable`, arenas are plain cudaMalloc memory that is not shared.
TEST(CudaSharedMemoryTest, ArenasOfADeviceThatDoesNotShareAreNotShared) {
  CudaDeviceOptions options;
  options.ordinal = testutil::TestCudaOrdinal();
  options.budget_bytes = 8 * kMiB;
  options.snapshot_budget_bytes = 8 * kMiB;
  options.staging_bytes = kMiB;
  absl::StatusOr<std::unique_ptr<Device>> device = CreateCudaDevice(options);
  ASSERT_TRUE(device.ok()) << device.status();
  absl::StatusOr<DeviceArena> arena =
      (*device)->Allocate(4096, MemoryPool::kCache, nullptr, /*shareable=*/true);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ((*device)->Share(*arena).status().code(), absl::StatusCode::kFailedPrecondition);
}

// On a sharing device only arenas allocated shareable are shared memory: a speculative or
// snapshot chunk is plain device memory (no 2 MiB granule, no exported descriptor).
TEST(CudaSharedMemoryTest, OnlyShareableArenasAreShared) {
  std::unique_ptr<Device> device = SharedDevice();
  ASSERT_NE(device, nullptr);
  for (const MemoryPool pool : {MemoryPool::kCache, MemoryPool::kSnapshot}) {
    absl::StatusOr<DeviceArena> chunk = device->Allocate(4096, pool);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    EXPECT_EQ(device->Share(*chunk).status().code(), absl::StatusCode::kFailedPrecondition);
  }
}

#if defined(KVMESH_TEST_CUDASIM)
// A driver call that fails half-way leaves nothing behind: the error names the call, the budget
// is back where it was, and the next allocation works.
TEST(CudaSharedMemoryTest, AFailedAllocationLeavesNothingBehind) {
  std::unique_ptr<Device> device = SharedDevice();
  ASSERT_NE(device, nullptr);
  struct Case {
    const char* call;
    absl::StatusCode code;
  };
  for (const Case& c : {Case{"cuMemCreate", absl::StatusCode::kResourceExhausted},
                        Case{"cuMemMap", absl::StatusCode::kInternal},
                        Case{"cuMemExportToShareableHandle", absl::StatusCode::kInternal}}) {
    // CUDA numbers its runtime and driver errors alike: 2 is CUDA_ERROR_OUT_OF_MEMORY.
    cudasim::InjectFailure(c.call, 1,
                           c.code == absl::StatusCode::kResourceExhausted
                               ? cudaErrorMemoryAllocation
                               : cudaErrorInvalidValue);
    absl::StatusOr<DeviceArena> arena =
        device->Allocate(kMiB, MemoryPool::kCache, nullptr, /*shareable=*/true);
    EXPECT_EQ(arena.status().code(), c.code) << c.call << ": " << arena.status();
    EXPECT_NE(arena.status().message().find(c.call), absl::string_view::npos) << arena.status();
    EXPECT_EQ(device->used_bytes(), 0u) << c.call;
    cudasim::ResetFailures();
    absl::StatusOr<DeviceArena> next =
        device->Allocate(kMiB, MemoryPool::kCache, nullptr, /*shareable=*/true);
    EXPECT_TRUE(next.ok()) << c.call << ": " << next.status();
  }
}
#endif

}  // namespace
}  // namespace kvmesh
