// CudaDevice: the Device on one NVIDIA GPU.
//
// Memory: every arena is one cudaMalloc (a cache group's cells, a snapshot chunk, a speculative
// batch), or for a cache group's cells with `shareable` one allocation of CudaSharedMemory,
// sub-allocated by the engine;
// nothing is allocated per token. Both budgets of Device
// apply, and a cudaMalloc that fails for lack of device memory is RESOURCE_EXHAUSTED too.
//
// Work: each cache gets its own CUDA stream (CreateStream); an operation enqueues its copies
// and kernels on the stream of the arena it writes and waits on an event before it returns, so
// operations are synchronous for the caller while different caches overlap on the GPU. Payloads
// cross the PCIe bus through pinned host staging buffers (a small pool shared by all streams,
// double-buffered so the host copy of one chunk overlaps the transfer of the previous one).
//
// Errors: every CUDA call is checked where it is made (cuda_check.h). A failed operation
// returns INTERNAL (or RESOURCE_EXHAUSTED for memory) naming the call, file and line; the
// engine then marks the affected cache unusable.
//
// Teardown: ~CudaDevice waits for every stream, then frees staging buffers and scratch memory.
// REQUIRES: every DeviceArena and DeviceStream it handed out has been destroyed first.
//
// Thread safety: as Device.
#ifndef KVMESH_CACHE_DEVICE_CUDA_DEVICE_H_
#define KVMESH_CACHE_DEVICE_CUDA_DEVICE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cache/device/device.h"

namespace kvmesh {

struct CudaDeviceOptions {
  int ordinal = 0;                   // CUDA device index (cudaSetDevice)
  size_t budget_bytes = 0;           // MemoryPool::kCache
  size_t snapshot_budget_bytes = 0;  // MemoryPool::kSnapshot
  // Size of one pinned staging buffer and of its device-side twin. A payload larger than this
  // moves in several rounds.
  size_t staging_bytes = size_t{32} << 20;
  // Arenas allocated shareable (a cache group's cells) are GPU memory that a worker on this
  // machine may map (the local data path, cuda_shared_memory.h): whole granules of the driver
  // (2 MiB), zeroed when allocated and when freed, and Share answers them. Creation fails
  // (FAILED_PRECONDITION) when the driver lacks the calls.
  bool shareable = false;
};

// Whether this binary was built with CUDA support.
bool CudaBuilt();

// Whether its CUDA runtime is the simulated GPU of the tests (a -DKVMESH_CUDA=SIM build,
// docs/cuda.md): then the device names itself "cuda:N (simulated)" and kvmesh-node says so at
// start-up, so that a simulated node is never taken for one on a GPU.
bool CudaSimulated();

// How many CUDA devices this process can use: 0 when the binary was built without CUDA, when
// no driver is installed, or when no GPU is visible. Never fails.
int CudaDeviceCount();

// Opens GPU `options.ordinal`. INVALID_ARGUMENT when the ordinal does not name a visible GPU,
// RESOURCE_EXHAUSTED when the two budgets together exceed the GPU's free memory,
// FAILED_PRECONDITION when the binary was built without CUDA, INTERNAL for other CUDA errors.
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options);

}  // namespace kvmesh

#endif  // KVMESH_CACHE_DEVICE_CUDA_DEVICE_H_
