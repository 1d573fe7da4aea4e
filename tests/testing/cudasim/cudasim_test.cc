// The simulated CUDA runtime itself (cuda_sim.h): each strictness docs/cuda.md promises, shown
// to catch what it is meant to catch. Kernels here are bodies handed to the launcher directly
// (internal::LaunchKernel), as kernel_prelude.h does for the real ones.
#include <cuda_runtime_api.h>

#include <cstdint>
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

}  // namespace
}  // namespace cudasim
