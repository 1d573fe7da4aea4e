// The simulated CUDA runtime itself (cuda_sim.h): each strictness docs/cuda.md promises, shown
// to catch what it is meant to catch. Kernels here are bodies handed to the launcher directly
// (internal::LaunchKernel), as kernel_prelude.h does for the real ones.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/cudasim/cuda_sim.h"

namespace cudasim {
namespace {

using ::testing::HasSubstr;

// Runs `thread(t)` for every linear thread index t of the grid, in the simulator's order.
void Launch(dim3 grid, dim3 block, cudaStream_t stream, std::vector<const void*> pointers,
            std::function<void(uint64_t)> thread) {
  internal::LaunchKernel("test_kernel", grid, block, 0, stream, pointers.data(), pointers.size(),
                         [thread](const internal::LaunchOrder& order) {
                           for (uint64_t k = 0; k < order.total; ++k) thread(order.At(k));
                         });
}

class CudaSimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    ResetFailures();
    SetImmediateExecution(false);
    SetThreadOrder(ThreadOrder::kForward);
    (void)cudaGetLastError();
    EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
  }
  void* Device(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    return p;
  }
  uint8_t* Pinned(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMallocHost(&p, bytes), cudaSuccess);
    return static_cast<uint8_t*>(p);
  }
  cudaStream_t stream_ = nullptr;
};

TEST_F(CudaSimTest, FreshMemoryIsPoisoned) {
  void* d = Device(64);
  std::vector<uint8_t> back(64);
  ASSERT_EQ(cudaMemcpy(back.data(), d, 64, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, std::vector<uint8_t>(64, 0xA5));
  uint8_t* h = Pinned(16);
  EXPECT_EQ(h[0], 0x5A);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(h), cudaSuccess);
}

TEST_F(CudaSimTest, CopiesAreCheckedAgainstAllocations) {
  void* d = Device(100);
  std::vector<uint8_t> host(200, 1);
  // Past the end.
  EXPECT_EQ(cudaMemcpy(d, host.data(), 101, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_THAT(LastMessage(), HasSubstr("outside the allocation"));
  // A direction that does not match the pointers.
  EXPECT_EQ(cudaMemcpy(host.data(), d, 10, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_THAT(LastMessage(), HasSubstr("cudaMemcpyHostToDevice from device memory to host"));
  // Overlapping ranges.
  EXPECT_EQ(cudaMemcpy(static_cast<uint8_t*>(d) + 1, d, 10, cudaMemcpyDeviceToDevice),
            cudaErrorInvalidValue);
  EXPECT_THAT(LastMessage(), HasSubstr("overlap"));
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // cleared by the first call
  // Use after free.
  ASSERT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), 1, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_THAT(LastMessage(), HasSubstr("use after free"));
  EXPECT_EQ(cudaFree(d), cudaErrorInvalidDevicePointer);
  (void)cudaGetLastError();
}

// What a host thread sees when it reuses a staging buffer before waiting: the deferred copy
// takes the new bytes (immediate execution takes the old ones, as a fast GPU might).
TEST_F(CudaSimTest, WorkRunsOnlyWhenWaitedFor) {
  for (bool immediate : {false, true}) {
    SCOPED_TRACE(immediate ? "immediate" : "deferred");
    SetImmediateExecution(immediate);
    void* d = Device(8);
    uint8_t* h = Pinned(8);
    std::memset(h, 1, 8);
    ASSERT_EQ(cudaMemcpyAsync(d, h, 8, cudaMemcpyHostToDevice, stream_), cudaSuccess);
    std::memset(h, 2, 8);  // too early: nothing waited for the copy
    uint8_t* out = Pinned(8);
    ASSERT_EQ(cudaMemcpyAsync(out, d, 8, cudaMemcpyDeviceToHost, stream_), cudaSuccess);
    // Read before waiting: still the poison of fresh pinned memory, unless already run.
    EXPECT_EQ(out[0], immediate ? 1 : 0x5A);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(out[0], immediate ? 1 : 2);
    EXPECT_EQ(cudaFree(d), cudaSuccess);
    EXPECT_EQ(cudaFreeHost(h), cudaSuccess);
    EXPECT_EQ(cudaFreeHost(out), cudaSuccess);
  }
}

TEST_F(CudaSimTest, QueriesAnswerNotReadyAtLeastOnce) {
  void* d = Device(8);
  cudaEvent_t event;
  ASSERT_EQ(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d, 0, 8, stream_), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(event, stream_), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(event), cudaErrorNotReady);
  EXPECT_EQ(cudaEventQuery(event), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d, 1, 8, stream_), cudaSuccess);
  EXPECT_EQ(cudaStreamQuery(stream_), cudaErrorNotReady);
  EXPECT_EQ(cudaStreamQuery(stream_), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(event), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST_F(CudaSimTest, ThreadOrderIsAKnob) {
  auto order_of = [this](ThreadOrder order, uint64_t seed) {
    SetThreadOrder(order, seed);
    std::vector<uint64_t> seen;
    Launch(dim3(2), dim3(64), stream_, {}, [&seen](uint64_t t) { seen.push_back(t); });
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return seen;
  };
  std::vector<uint64_t> forward(128);
  for (uint64_t t = 0; t < 128; ++t) forward[t] = t;
  EXPECT_EQ(order_of(ThreadOrder::kForward, 0), forward);
  std::vector<uint64_t> reverse(forward.rbegin(), forward.rend());
  EXPECT_EQ(order_of(ThreadOrder::kReverse, 0), reverse);
  const std::vector<uint64_t> shuffled = order_of(ThreadOrder::kShuffle, 7);
  EXPECT_NE(shuffled, forward);
  EXPECT_NE(shuffled, reverse);
  EXPECT_THAT(shuffled, ::testing::UnorderedElementsAreArray(forward));
}

TEST_F(CudaSimTest, InvalidLaunchConfigurationsAreRefused) {
  const uint64_t ran = GetStats().kernels_run;
  Launch(dim3(1), dim3(2048), stream_, {}, [](uint64_t) {});
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  Launch(dim3(0), dim3(32), stream_, {}, [](uint64_t) {});
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(GetStats().kernels_run, ran);  // nothing was queued to run
}

// A kernel handed host memory faults when it runs, and the context is dead until a reset.
TEST_F(CudaSimTest, KernelWithAHostPointerFaultsStickily) {
  std::vector<uint8_t> host(16);
  Launch(dim3(1), dim3(32), stream_, {host.data()}, [](uint64_t) {});
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // the launch itself succeeds
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaErrorIllegalAddress);
  void* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, 8), cudaErrorIllegalAddress);
  ResetFailures();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d, 8), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST_F(CudaSimTest, InjectedFailuresFireOnTheNthCall) {
  InjectFailure("cudaMalloc", 2, cudaErrorMemoryAllocation);
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(cudaMalloc(&a, 8), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&b, 8), cudaErrorMemoryAllocation);
  EXPECT_EQ(PendingFailures(), 0);
  InjectFailure("kernel", 1, cudaErrorLaunchFailure);
  Launch(dim3(1), dim3(32), stream_, {a}, [](uint64_t) {});
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaMemset(a, 0, 8), cudaErrorLaunchFailure);  // sticky: the context is dead
  ResetFailures();
  EXPECT_EQ(cudaFree(a), cudaSuccess);
}

TEST_F(CudaSimTest, DestroyingAStreamWithQueuedWorkReturnsAtOnce) {
  void* d = Device(8);
  cudaStream_t other;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  uint8_t* h = Pinned(8);
  std::memset(h, 7, 8);
  ASSERT_EQ(cudaMemcpyAsync(d, h, 8, cudaMemcpyHostToDevice, other), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(other), cudaSuccess);
  std::vector<uint8_t> back(8);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data(), d, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, std::vector<uint8_t>(8, 7));
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(h), cudaSuccess);
}

using CudaSimDeathTest = CudaSimTest;

TEST_F(CudaSimDeathTest, AKernelWritingPastAnAllocationIsCaught) {
  EXPECT_DEATH(
      {
        uint8_t* d = static_cast<uint8_t*>(Device(100));
        Launch(dim3(1), dim3(1), stream_, {d}, [d](uint64_t) { d[100] = 1; });  // the slack
        (void)cudaStreamSynchronize(stream_);
      },
      "written 1 bytes past its end");
  EXPECT_DEATH(
      {
        uint8_t* d = static_cast<uint8_t*>(Device(256));
        Launch(dim3(1), dim3(1), stream_, {d}, [d](uint64_t) { d[256] = 1; });  // guard page
        (void)cudaStreamSynchronize(stream_);
      },
      "past the end of device allocation|SEGV");
  EXPECT_DEATH(
      {
        uint8_t* d = static_cast<uint8_t*>(Device(64));
        Launch(dim3(1), dim3(1), stream_, {d}, [d](uint64_t) { d[-1] = 1; });  // before it
        (void)cudaStreamSynchronize(stream_);
      },
      "written 1 bytes before its start");
}

TEST_F(CudaSimDeathTest, AnAccessAfterFreeIsCaught) {
  EXPECT_DEATH(
      {
        uint8_t* d = static_cast<uint8_t*>(Device(64));
        (void)cudaFree(d);
        d[0] = 1;
      },
      "use after free|SEGV");
}

// ---- Virtual memory management (the driver API, vmm.cc) ------------------------------------

constexpr size_t kGranularity = size_t{2} << 20;

// Byte i of the fill pattern `seed`.
uint8_t PatternByte(uint64_t seed, size_t i) {
  const uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t{i} * 0xBF58476D1CE4E5B9ull);
  return static_cast<uint8_t>((x >> 32) ^ (x >> 56));
}
std::vector<uint8_t> Pattern(uint64_t seed, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  for (size_t i = 0; i < bytes; ++i) out[i] = PatternByte(seed, i);
  return out;
}

CUmemAllocationProp DeviceProp(bool exportable) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes =
      exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

CUmemAccessDesc ReadWrite(int device = 0) {
  CUmemAccessDesc desc;
  std::memset(&desc, 0, sizeof(desc));
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return desc;
}

// The first device ordinal the simulator does not have (KVMESH_CUDASIM_DEVICES).
int MissingDevice() {
  int count = 0;
  EXPECT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  return count;
}

void* Ptr(CUdeviceptr p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }

std::vector<uint8_t> ReadBack(CUdeviceptr p, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), Ptr(p), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// Runs CudaSimVmmChild.DISABLED_<test> in a fresh process of this binary: fork, then exec, so
// that the child holds none of this process's CUDA state, only `fd` (inherited) and `env` (ahead
// of this process's environment, less gtest's variables: sharding and output files are the
// parent's). Returns the child's exit status: 0 when its test passed.
int RunChild(const std::string& test, std::vector<std::string> env, int fd = -1) {
  std::vector<std::string> args = {"/proc/self/exe",
                                   "--gtest_filter=CudaSimVmmChild.DISABLED_" + test,
                                   "--gtest_also_run_disabled_tests", "--gtest_brief=1"};
  env.push_back("KVMESH_CUDASIM_VMM_CHILD=1");
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "GTEST_", 6) != 0) env.push_back(*e);
  }
  std::vector<char*> argv, envp;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    if (fd >= 0) fcntl(fd, F_SETFD, 0);  // exported descriptors are close-on-exec
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  if (pid < 0) return -1;
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A device allocation mapped read-write in an address range of its own, as a node maps what it
// exports.
struct Mapped {
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr ptr = 0;
  size_t size = 0;
};

void MapNew(size_t size, bool exportable, Mapped* out) {
  const CUmemAllocationProp prop = DeviceProp(exportable);
  ASSERT_EQ(cuMemCreate(&out->handle, size, &prop, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuMemAddressReserve(&out->ptr, size, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuMemMap(out->ptr, size, 0, out->handle, 0), CUDA_SUCCESS);
  const CUmemAccessDesc access = ReadWrite();
  ASSERT_EQ(cuMemSetAccess(out->ptr, size, &access, 1), CUDA_SUCCESS);
  out->size = size;
}

void UnmapAndRelease(const Mapped& m) {
  EXPECT_EQ(cuMemUnmap(m.ptr, m.size), CUDA_SUCCESS);
  EXPECT_EQ(cuMemAddressFree(m.ptr, m.size), CUDA_SUCCESS);
  EXPECT_EQ(cuMemRelease(m.handle), CUDA_SUCCESS);
}

class CudaSimVmmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cuInit(0), CUDA_SUCCESS);
    before_ = GetStats();
  }
  void TearDown() override {
    ResetFailures();
    (void)cudaGetLastError();
    // Every test gives back what it made.
    const Stats after = GetStats();
    EXPECT_EQ(after.vmm_handles, before_.vmm_handles);
    EXPECT_EQ(after.vmm_reservations, before_.vmm_reservations);
    EXPECT_EQ(after.vmm_mappings, before_.vmm_mappings);
  }
  static size_t FreeDeviceBytes() {
    size_t free_bytes = 0, total = 0;
    EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
    return free_bytes;
  }
  Stats before_;
};

TEST_F(CudaSimVmmTest, DevicesErrorNamesAndGranularity) {
  CUdevice device = -1;
  EXPECT_EQ(cuDeviceGet(&device, 0), CUDA_SUCCESS);
  EXPECT_EQ(device, 0);
  EXPECT_EQ(cuDeviceGet(&device, MissingDevice()), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_EQ(cuDeviceGet(&device, -1), CUDA_ERROR_INVALID_DEVICE);
  EXPECT_EQ(cuDeviceGet(nullptr, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuInit(1), CUDA_ERROR_INVALID_VALUE);

  const char* text = nullptr;
  ASSERT_EQ(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &text), CUDA_SUCCESS);
  EXPECT_STREQ(text, "CUDA_ERROR_OUT_OF_MEMORY");
  ASSERT_EQ(cuGetErrorString(CUDA_ERROR_INVALID_VALUE, &text), CUDA_SUCCESS);
  EXPECT_STREQ(text, "invalid argument");
  EXPECT_EQ(cuGetErrorName(static_cast<CUresult>(123456), &text), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(text, nullptr);

  const CUmemAllocationProp prop = DeviceProp(true);
  size_t granularity = 0;
  ASSERT_EQ(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            CUDA_SUCCESS);
  EXPECT_EQ(granularity, kGranularity);
  ASSERT_EQ(
      cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
      CUDA_SUCCESS);
  EXPECT_EQ(granularity, kGranularity);
  CUmemAllocationProp elsewhere = prop;
  elsewhere.location.id = MissingDevice();
  EXPECT_EQ(
      cuMemGetAllocationGranularity(&granularity, &elsewhere, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      CUDA_ERROR_INVALID_DEVICE);
}

// Mapped memory with access is device memory to copies, memsets and kernels, bounds checked;
// without access (before cuMemSetAccess, after cuMemUnmap) it is refused. Unmapping does not free
// the memory while its handle lives: mapped again, it still holds its bytes.
TEST_F(CudaSimVmmTest, MappedMemoryIsCheckedDeviceMemory) {
  const CUmemAllocationProp prop = DeviceProp(false);
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_EQ(cuMemCreate(&handle, kGranularity, &prop, 0), CUDA_SUCCESS);
  CUdeviceptr range = 0;
  ASSERT_EQ(cuMemAddressReserve(&range, 2 * kGranularity, 0, 0, 0), CUDA_SUCCESS);
  EXPECT_EQ(range % kGranularity, 0u);
  const CUdeviceptr p = range + kGranularity;  // the second half of the range
  ASSERT_EQ(cuMemMap(p, kGranularity, 0, handle, 0), CUDA_SUCCESS);
  std::vector<uint8_t> host = Pattern(1, kGranularity);
  EXPECT_EQ(cudaMemcpy(Ptr(p), host.data(), 64, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_THAT(LastMessage(), HasSubstr("mapped without access"));

  const CUmemAccessDesc access = ReadWrite();
  ASSERT_EQ(cuMemSetAccess(p, kGranularity, &access, 1), CUDA_SUCCESS);
  EXPECT_EQ(GetStats().vmm_mappings, before_.vmm_mappings + 1);
  EXPECT_EQ(GetStats().device_allocations, before_.device_allocations);
  EXPECT_EQ(ReadBack(p, 64), std::vector<uint8_t>(64, 0xA5));  // fresh memory is poisoned
  ASSERT_EQ(cudaMemcpy(Ptr(p), host.data(), kGranularity, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(ReadBack(p, kGranularity), host);
  ASSERT_EQ(cudaMemset(Ptr(p + 16), 7, 16), cudaSuccess);
  EXPECT_EQ(ReadBack(p + 16, 16), std::vector<uint8_t>(16, 7));

  // Past the end, and across into the unmapped half before it.
  EXPECT_EQ(cudaMemcpy(Ptr(p + kGranularity - 8), host.data(), 9, cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_THAT(LastMessage(), HasSubstr("outside the allocation"));
  EXPECT_EQ(cudaMemcpy(Ptr(range), host.data(), 8, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(Ptr(p)), cudaErrorInvalidDevicePointer);
  EXPECT_THAT(LastMessage(), HasSubstr("cuMemUnmap"));

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  uint8_t* d = static_cast<uint8_t*>(Ptr(p));
  Launch(dim3(1), dim3(32), stream, {d}, [d](uint64_t t) { d[t] = static_cast<uint8_t>(t); });
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<uint8_t> threads(32);
  for (size_t t = 0; t < 32; ++t) threads[t] = static_cast<uint8_t>(t);
  EXPECT_EQ(ReadBack(p, 32), threads);

  // A copy still queued when the range is unmapped runs first: cuMemUnmap synchronizes.
  std::vector<uint8_t> late(8);
  ASSERT_EQ(cudaMemcpyAsync(Ptr(p + 100), host.data(), 8, cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  ASSERT_EQ(cuMemUnmap(p, kGranularity), CUDA_SUCCESS);
  EXPECT_EQ(cudaMemcpy(late.data(), Ptr(p), 8, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_THAT(LastMessage(), HasSubstr("use after free"));
  EXPECT_THAT(LastMessage(), HasSubstr("unmapped cuMemMap device allocation"));
  Launch(dim3(1), dim3(1), stream, {d}, [](uint64_t) {});
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaErrorIllegalAddress);
  ResetFailures();

  // Mapped again (the handle still holds the memory): the same bytes, once access is set.
  ASSERT_EQ(cuMemMap(p, kGranularity, 0, handle, 0), CUDA_SUCCESS);
  EXPECT_EQ(cudaMemcpy(late.data(), Ptr(p), 8, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_THAT(LastMessage(), HasSubstr("mapped without access"));
  ASSERT_EQ(cuMemSetAccess(p, kGranularity, &access, 1), CUDA_SUCCESS);
  EXPECT_EQ(ReadBack(p, 32), threads);
  EXPECT_EQ(ReadBack(p + 100, 8), std::vector<uint8_t>(host.begin(), host.begin() + 8));
  // Access can be taken away again.
  CUmemAccessDesc none = access;
  none.flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
  ASSERT_EQ(cuMemSetAccess(p, kGranularity, &none, 1), CUDA_SUCCESS);
  EXPECT_EQ(cudaMemcpy(late.data(), Ptr(p), 8, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);

  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cuMemUnmap(p, kGranularity), CUDA_SUCCESS);
  EXPECT_EQ(cuMemAddressFree(range, 2 * kGranularity), CUDA_SUCCESS);
  EXPECT_EQ(cuMemRelease(handle), CUDA_SUCCESS);
}

TEST_F(CudaSimVmmTest, MisuseIsRefusedWithCudasErrors) {
  const uint64_t misuses = GetStats().misuses;
  const CUmemAllocationProp prop = DeviceProp(false);
  CUmemGenericAllocationHandle handle = 0;
  // cuMemCreate: sizes, flags, properties.
  EXPECT_EQ(cuMemCreate(&handle, 0, &prop, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemCreate(&handle, kGranularity + 4096, &prop, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_THAT(LastMessage(), HasSubstr("granularity"));
  EXPECT_EQ(cuMemCreate(&handle, kGranularity, &prop, 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemCreate(nullptr, kGranularity, &prop, 0), CUDA_ERROR_INVALID_VALUE);
  CUmemAllocationProp bad = prop;
  bad.type = CU_MEM_ALLOCATION_TYPE_INVALID;
  EXPECT_EQ(cuMemCreate(&handle, kGranularity, &bad, 0), CUDA_ERROR_INVALID_VALUE);
  bad = prop;
  bad.location.id = MissingDevice();
  EXPECT_EQ(cuMemCreate(&handle, kGranularity, &bad, 0), CUDA_ERROR_INVALID_DEVICE);
  bad = prop;
  bad.requestedHandleTypes = CU_MEM_HANDLE_TYPE_WIN32;
  EXPECT_EQ(cuMemCreate(&handle, kGranularity, &bad, 0), CUDA_ERROR_INVALID_VALUE);
  bad.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  EXPECT_EQ(cuMemCreate(&handle, kGranularity, &bad, 0), CUDA_ERROR_NOT_SUPPORTED);

  // cuMemAddressReserve: sizes, alignment, flags.
  CUdeviceptr range = 0;
  EXPECT_EQ(cuMemAddressReserve(&range, kGranularity / 2, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAddressReserve(&range, kGranularity, 3, 0, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAddressReserve(&range, kGranularity, 0, 0, 1), CUDA_ERROR_INVALID_VALUE);

  ASSERT_EQ(cuMemCreate(&handle, kGranularity, &prop, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuMemAddressReserve(&range, 2 * kGranularity, 0, 0, 0), CUDA_SUCCESS);
  // cuMemMap: offsets, sizes, places, handles.
  EXPECT_EQ(cuMemMap(range, kGranularity, kGranularity, handle, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemMap(range, 2 * kGranularity, 0, handle, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemMap(range, kGranularity, 0, handle, 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemMap(range + 4096, kGranularity, 0, handle, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemMap(range + 2 * kGranularity, kGranularity, 0, handle, 0),
            CUDA_ERROR_INVALID_VALUE);  // past the reservation
  std::vector<uint8_t> host(kGranularity);
  EXPECT_EQ(cuMemMap(reinterpret_cast<uintptr_t>(host.data()), kGranularity, 0, handle, 0),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_THAT(LastMessage(), HasSubstr("cuMemAddressReserve"));
  EXPECT_EQ(cuMemMap(range, kGranularity, 0, handle + 1, 0), CUDA_ERROR_INVALID_VALUE);
  ASSERT_EQ(cuMemMap(range, kGranularity, 0, handle, 0), CUDA_SUCCESS);
  EXPECT_EQ(cuMemMap(range, kGranularity, 0, handle, 0), CUDA_ERROR_INVALID_VALUE);
  EXPECT_THAT(LastMessage(), HasSubstr("overlaps"));

  // cuMemSetAccess: ranges, devices, flags.
  const CUmemAccessDesc access = ReadWrite();
  EXPECT_EQ(cuMemSetAccess(range, 2 * kGranularity, &access, 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemSetAccess(range, kGranularity / 2, &access, 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemSetAccess(range, kGranularity, &access, 0), CUDA_ERROR_INVALID_VALUE);
  const CUmemAccessDesc elsewhere = ReadWrite(MissingDevice());
  EXPECT_EQ(cuMemSetAccess(range, kGranularity, &elsewhere, 1), CUDA_ERROR_INVALID_DEVICE);

  // Export and import: handle types, exportability, descriptors that are not exports.
  int fd = -1;
  EXPECT_EQ(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            CUDA_ERROR_INVALID_VALUE);
  EXPECT_THAT(LastMessage(), HasSubstr("requestedHandleTypes"));
  EXPECT_EQ(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_FABRIC, 0),
            CUDA_ERROR_INVALID_VALUE);
  CUmemGenericAllocationHandle imported = 0;
  int pipe_fds[2] = {-1, -1};
  ASSERT_EQ(pipe(pipe_fds), 0);
  EXPECT_EQ(cuMemImportFromShareableHandle(
                &imported, reinterpret_cast<void*>(static_cast<uintptr_t>(pipe_fds[0])),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            CUDA_ERROR_INVALID_VALUE);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  EXPECT_EQ(cuMemImportFromShareableHandle(&imported, reinterpret_cast<void*>(uintptr_t{9999}),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            CUDA_ERROR_INVALID_VALUE);  // not open

  // Unmapping and freeing: whole mappings, whole ranges, in order.
  EXPECT_EQ(cuMemUnmap(range, kGranularity / 2), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAddressFree(range, kGranularity), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAddressFree(range, 2 * kGranularity), CUDA_ERROR_INVALID_VALUE);
  EXPECT_THAT(LastMessage(), HasSubstr("still mapped"));
  ASSERT_EQ(cuMemUnmap(range, kGranularity), CUDA_SUCCESS);
  EXPECT_EQ(cuMemUnmap(range, kGranularity), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cuMemAddressFree(range, 2 * kGranularity), CUDA_SUCCESS);
  EXPECT_EQ(cuMemAddressFree(range, 2 * kGranularity), CUDA_ERROR_INVALID_VALUE);
  ASSERT_EQ(cuMemRelease(handle), CUDA_SUCCESS);
  EXPECT_EQ(cuMemRelease(handle), CUDA_ERROR_INVALID_VALUE);
  EXPECT_THAT(LastMessage(), HasSubstr("not a live handle"));
  EXPECT_GE(GetStats().misuses, misuses + 30);
}

// Physical memory counts against the device from cuMemCreate until its last handle and mapping
// are gone, as cudaMalloc memory counts until cudaFree.
TEST_F(CudaSimVmmTest, PhysicalMemoryIsCountedUntilItsLastUse) {
  const size_t free_before = FreeDeviceBytes();
  const CUmemAllocationProp prop = DeviceProp(true);
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_EQ(cuMemCreate(&handle, kGranularity, &prop, 0), CUDA_SUCCESS);
  EXPECT_EQ(FreeDeviceBytes(), free_before - kGranularity);
  const size_t too_much = (FreeDeviceBytes() / kGranularity + 1) * kGranularity;
  CUmemGenericAllocationHandle refused = 0;
  EXPECT_EQ(cuMemCreate(&refused, too_much, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_THAT(LastMessage(), HasSubstr("bytes free on simulated device 0"));

  CUdeviceptr range = 0;
  ASSERT_EQ(cuMemAddressReserve(&range, kGranularity, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuMemMap(range, kGranularity, 0, handle, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuMemRelease(handle), CUDA_SUCCESS);  // the mapping still holds it
  EXPECT_EQ(FreeDeviceBytes(), free_before - kGranularity);
  const CUmemAccessDesc access = ReadWrite();
  ASSERT_EQ(cuMemSetAccess(range, kGranularity, &access, 1), CUDA_SUCCESS);
  EXPECT_EQ(ReadBack(range, 8), std::vector<uint8_t>(8, 0xA5));
  ASSERT_EQ(cuMemUnmap(range, kGranularity), CUDA_SUCCESS);
  EXPECT_EQ(FreeDeviceBytes(), free_before);
  EXPECT_EQ(cuMemAddressFree(range, kGranularity), CUDA_SUCCESS);
}

TEST_F(CudaSimVmmTest, InjectedFailuresReachDriverCalls) {
  InjectFailure("cuMemCreate", 1, static_cast<cudaError_t>(CUDA_ERROR_OUT_OF_MEMORY));
  const CUmemAllocationProp prop = DeviceProp(false);
  CUmemGenericAllocationHandle handle = 0;
  EXPECT_EQ(cuMemCreate(&handle, kGranularity, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(PendingFailures(), 0);
  Mapped m;
  ASSERT_NO_FATAL_FAILURE(MapNew(kGranularity, false, &m));
  // An injected failure stops an unmap; the mapping stays usable.
  InjectFailure("cuMemUnmap", 1, cudaErrorUnknown);
  EXPECT_EQ(cuMemUnmap(m.ptr, m.size), CUDA_ERROR_UNKNOWN);
  EXPECT_EQ(ReadBack(m.ptr, 4), std::vector<uint8_t>(4, 0xA5));
  UnmapAndRelease(m);
}

// A fresh process: every call but cuInit and cuGetError* wants cuInit first.
TEST_F(CudaSimVmmTest, DriverCallsNeedCuInit) {
  EXPECT_EQ(RunChild("RefusesCallsBeforeCuInit", {}), 0);
}

TEST_F(CudaSimVmmTest, DriverAllocationsShareTheDeviceWithCudaMalloc) {
  EXPECT_EQ(RunChild("SharesTheDeviceWithCudaMalloc",
                     {"KVMESH_CUDASIM_MEMORY=4MiB",
                      "KVMESH_CUDASIM_FAIL=cuMemMap:1:CUDA_ERROR_OUT_OF_MEMORY"}),
            0);
}

// What a node does for a worker on its machine: export the descriptor of mapped device memory;
// the worker (another process, holding only the descriptor) maps it, reads what the node wrote,
// and writes back where the node sees it.
TEST_F(CudaSimVmmTest, AnotherProcessMapsExportedMemory) {
  const size_t size = 2 * kGranularity;
  Mapped m;
  ASSERT_NO_FATAL_FAILURE(MapNew(size, true, &m));
  const std::vector<uint8_t> mine = Pattern(1, size);
  ASSERT_EQ(cudaMemcpy(Ptr(m.ptr), mine.data(), size, cudaMemcpyHostToDevice), cudaSuccess);
  int fd = -1;
  ASSERT_EQ(
      cuMemExportToShareableHandle(&fd, m.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      CUDA_SUCCESS);
  EXPECT_NE(fcntl(fd, F_GETFD) & FD_CLOEXEC, 0);
  EXPECT_EQ(
      RunChild("MapsAnInheritedDescriptor",
               {"KVMESH_VMM_FD=" + std::to_string(fd), "KVMESH_VMM_SIZE=" + std::to_string(size),
                "KVMESH_VMM_EXPECT=1", "KVMESH_VMM_WRITE=2"},
               fd),
      0);
  EXPECT_EQ(close(fd), 0);
  EXPECT_EQ(ReadBack(m.ptr, size), Pattern(2, size));
  UnmapAndRelease(m);
}

// The exporter lets go of everything before the importer maps: the descriptor alone keeps the
// memory. This process then imports its own descriptor and sees what the other one wrote.
TEST_F(CudaSimVmmTest, ExportedMemoryOutlivesItsExporter) {
  const size_t free_before = FreeDeviceBytes();
  Mapped m;
  ASSERT_NO_FATAL_FAILURE(MapNew(kGranularity, true, &m));
  ASSERT_EQ(
      cudaMemcpy(Ptr(m.ptr), Pattern(3, kGranularity).data(), kGranularity, cudaMemcpyHostToDevice),
      cudaSuccess);
  int fd = -1;
  ASSERT_EQ(
      cuMemExportToShareableHandle(&fd, m.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      CUDA_SUCCESS);
  UnmapAndRelease(m);
  EXPECT_EQ(FreeDeviceBytes(), free_before);  // counted by its creator until then only
  EXPECT_EQ(RunChild("MapsAnInheritedDescriptor",
                     {"KVMESH_VMM_FD=" + std::to_string(fd),
                      "KVMESH_VMM_SIZE=" + std::to_string(kGranularity), "KVMESH_VMM_EXPECT=3",
                      "KVMESH_VMM_WRITE=4"},
                     fd),
            0);
  Mapped again;
  ASSERT_EQ(cuMemImportFromShareableHandle(&again.handle,
                                           reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            CUDA_SUCCESS);
  EXPECT_EQ(close(fd), 0);  // the imported handle holds the memory
  again.size = kGranularity;
  ASSERT_EQ(cuMemAddressReserve(&again.ptr, again.size, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuMemMap(again.ptr, again.size, 0, again.handle, 0), CUDA_SUCCESS);
  const CUmemAccessDesc access = ReadWrite();
  ASSERT_EQ(cuMemSetAccess(again.ptr, again.size, &access, 1), CUDA_SUCCESS);
  EXPECT_EQ(ReadBack(again.ptr, kGranularity), Pattern(4, kGranularity));
  UnmapAndRelease(again);
}

using CudaSimVmmDeathTest = CudaSimVmmTest;

TEST_F(CudaSimVmmDeathTest, AnAccessWithoutAccessFaults) {
  EXPECT_DEATH(
      {
        Mapped m;
        MapNew(kGranularity, false, &m);
        (void)cuMemUnmap(m.ptr, m.size);
        static_cast<volatile uint8_t*>(Ptr(m.ptr))[0] = 1;
      },
      "use after free of cuMemMap device allocation|SEGV");
  EXPECT_DEATH(
      {
        const CUmemAllocationProp prop = DeviceProp(false);
        CUmemGenericAllocationHandle handle = 0;
        CUdeviceptr p = 0;
        (void)cuMemCreate(&handle, kGranularity, &prop, 0);
        (void)cuMemAddressReserve(&p, kGranularity, 0, 0, 0);
        (void)cuMemMap(p, kGranularity, 0, handle, 0);
        static_cast<volatile uint8_t*>(Ptr(p))[5] = 1;
      },
      "mapped without access|SEGV");
}

// ---- Run by RunChild, each in a process of its own ----

class CudaSimVmmChild : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::getenv("KVMESH_CUDASIM_VMM_CHILD") == nullptr) GTEST_SKIP() << "run by RunChild";
  }
  static uint64_t Env(const char* name) {
    const char* v = std::getenv(name);
    EXPECT_NE(v, nullptr) << name;
    return v == nullptr ? 0 : std::strtoull(v, nullptr, 10);
  }
};

TEST_F(CudaSimVmmChild, DISABLED_RefusesCallsBeforeCuInit) {
  const CUmemAllocationProp prop = DeviceProp(true);
  CUdevice device = -1;
  size_t granularity = 0;
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr p = 0;
  const CUmemAccessDesc access = ReadWrite();
  int fd = -1;
  EXPECT_EQ(cuDeviceGet(&device, 0), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuMemCreate(&handle, kGranularity, &prop, 0), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_THAT(LastMessage(), HasSubstr("cuInit"));
  EXPECT_EQ(cuMemRelease(1), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuMemAddressReserve(&p, kGranularity, 0, 0, 0), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuMemAddressFree(kGranularity, kGranularity), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuMemMap(kGranularity, kGranularity, 0, 1, 0), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuMemSetAccess(kGranularity, kGranularity, &access, 1), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuMemUnmap(kGranularity, kGranularity), CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(cuMemExportToShareableHandle(&fd, 1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_EQ(
      cuMemImportFromShareableHandle(&handle, nullptr, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      CUDA_ERROR_NOT_INITIALIZED);
  const char* name = nullptr;
  EXPECT_EQ(cuGetErrorName(CUDA_ERROR_NOT_INITIALIZED, &name), CUDA_SUCCESS);
  EXPECT_STREQ(name, "CUDA_ERROR_NOT_INITIALIZED");
  ASSERT_EQ(cuInit(0), CUDA_SUCCESS);
  EXPECT_EQ(cuDeviceGet(&device, 0), CUDA_SUCCESS);
}

// KVMESH_CUDASIM_MEMORY=4MiB, KVMESH_CUDASIM_FAIL=cuMemMap:1:CUDA_ERROR_OUT_OF_MEMORY.
TEST_F(CudaSimVmmChild, DISABLED_SharesTheDeviceWithCudaMalloc) {
  ASSERT_EQ(cuInit(0), CUDA_SUCCESS);
  const CUmemAllocationProp prop = DeviceProp(false);
  CUmemGenericAllocationHandle handle = 0, refused = 0;
  ASSERT_EQ(cuMemCreate(&handle, kGranularity, &prop, 0), CUDA_SUCCESS);
  void* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, kGranularity), cudaSuccess);  // the other half
  EXPECT_EQ(cuMemCreate(&refused, kGranularity, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
  void* more = nullptr;
  EXPECT_EQ(cudaMalloc(&more, 1), cudaErrorMemoryAllocation);

  CUdeviceptr p = 0;
  ASSERT_EQ(cuMemAddressReserve(&p, kGranularity, 0, 0, 0), CUDA_SUCCESS);
  EXPECT_EQ(cuMemMap(p, kGranularity, 0, handle, 0), CUDA_ERROR_OUT_OF_MEMORY);  // injected
  EXPECT_EQ(PendingFailures(), 0);
  ASSERT_EQ(cuMemMap(p, kGranularity, 0, handle, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuMemRelease(handle), CUDA_SUCCESS);
  EXPECT_EQ(cudaMalloc(&more, 1), cudaErrorMemoryAllocation);  // still mapped
  ASSERT_EQ(cuMemUnmap(p, kGranularity), CUDA_SUCCESS);
  ASSERT_EQ(cudaMalloc(&more, 1), cudaSuccess);
  EXPECT_EQ(cudaFree(more), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cuMemAddressFree(p, kGranularity), CUDA_SUCCESS);
}

// KVMESH_VMM_FD: an exported descriptor of KVMESH_VMM_SIZE bytes that hold Pattern(EXPECT);
// leaves Pattern(WRITE) in them.
TEST_F(CudaSimVmmChild, DISABLED_MapsAnInheritedDescriptor) {
  const int fd = static_cast<int>(Env("KVMESH_VMM_FD"));
  const size_t size = Env("KVMESH_VMM_SIZE");
  ASSERT_EQ(cuInit(0), CUDA_SUCCESS);
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_EQ(
      cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      CUDA_SUCCESS);
  EXPECT_EQ(close(fd), 0);
  CUdeviceptr p = 0;
  ASSERT_EQ(cuMemAddressReserve(&p, size, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuMemMap(p, size, 0, handle, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuMemRelease(handle), CUDA_SUCCESS);  // the mapping holds the memory
  const CUmemAccessDesc access = ReadWrite();
  ASSERT_EQ(cuMemSetAccess(p, size, &access, 1), CUDA_SUCCESS);
  EXPECT_EQ(ReadBack(p, size), Pattern(Env("KVMESH_VMM_EXPECT"), size));
  EXPECT_EQ(cudaMemcpy(Ptr(p), Pattern(Env("KVMESH_VMM_WRITE"), size).data(), size,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  EXPECT_EQ(cuMemUnmap(p, size), CUDA_SUCCESS);
  EXPECT_EQ(cuMemAddressFree(p, size), CUDA_SUCCESS);
}

}  // namespace
}  // namespace cudasim
