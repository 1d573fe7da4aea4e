// cudasim: a strict CPU implementation of the part of the CUDA runtime kvmesh uses, for the
// -DKVMESH_CUDA=SIM build (docs/cuda.md, "The simulated GPU"). Test tree only: no production
// binary links it.
//
// The runtime functions themselves (cudaMalloc, cudaMemcpyAsync, cudaEventQuery, ...) are
// defined with the signatures of CUDA's own cuda_runtime_api.h, so CudaDevice, cuda_resources.cc
// and the nccl transport compile unchanged against it. This header is the simulator's own API on
// top of that: knobs for tests, and the hooks a simulated library (the simulated NCCL,
// tests/testing/ncclsim/) needs to put work on a stream and to touch device memory.
//
// The model, in short:
// - Device memory and pinned host memory are host memory with guard pages on both sides, filled
//   with a poison pattern when allocated; freed ranges stay inaccessible (quarantine) for a while.
//   Every copy is checked against the allocations (bounds, direction, use after free); every
//   pointer argument of a kernel must be null or device memory.
// - Work on a stream is deferred: it runs only when something waits for it (a stream, event or
//   device synchronize, a query after the first, cudaFree), in the waiting thread. With
//   KVMESH_CUDASIM_EXEC=immediate it runs when enqueued instead.
// - A kernel launch runs every (block, thread) of the grid one after another, in the order the
//   thread-order knob says.
//
// Virtual memory management (vmm.cc): the driver API calls that make device memory another
// process can map through a file descriptor, with cuda.h's signatures: cuInit, cuDeviceGet,
// cuGetErrorName/String, cuMemGetAllocationGranularity (2 MiB), cuMemCreate, cuMemRelease,
// cuMemAddressReserve/Free, cuMemMap/Unmap, cuMemSetAccess, cuMemExportToShareableHandle and
// cuMemImportFromShareableHandle (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR only). A physical
// allocation is a memfd, poisoned and counted against the device as cudaMalloc memory is; the
// exported descriptor is a duplicate of it, so an importer in any process maps the same bytes, and
// the memory lives while any handle, descriptor or mapping of it does. cuMemMap maps whole
// allocations only (offset 0), still inaccessible; cuMemSetAccess (read-write) makes the range
// device memory for copies and kernels; after cuMemUnmap it is quarantined as freed memory. Every
// call but cuInit and cuGetError* needs cuInit first (CUDA_ERROR_NOT_INITIALIZED).
//
// Environment (read at the first CUDA call):
//   KVMESH_CUDASIM_EXEC     deferred (default) | immediate
//   KVMESH_CUDASIM_ORDER    forward (default) | reverse | shuffle[:SEED]
//   KVMESH_CUDASIM_DEVICES  number of simulated GPUs (default 1; 0: none visible)
//   KVMESH_CUDASIM_MEMORY   bytes of each simulated GPU (default 16GiB; suffixes KiB MiB GiB)
//   KVMESH_CUDASIM_FAIL     CALL:N:ERROR[,CALL:N:ERROR...]: the Nth call (1-based, counted from
//                           the first CUDA call of the process) of CALL fails with ERROR, e.g.
//                           cudaMalloc:3:cudaErrorMemoryAllocation. CALL "kernel" makes the Nth
//                           kernel fail when it runs (a sticky error, as a fault on a GPU). A
//                           driver call fails with the CUresult of ERROR's number; CUresult
//                           names are accepted too (cuMemCreate:1:CUDA_ERROR_OUT_OF_MEMORY).
//   KVMESH_CUDASIM_TRACE    1: print every failing call and every misuse to stderr (misuses are
//                           always printed)
//
// Thread safety: every function here and every runtime function is thread-safe.
#ifndef KVMESH_TESTS_TESTING_CUDASIM_CUDA_SIM_H_
#define KVMESH_TESTS_TESTING_CUDASIM_CUDA_SIM_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace cudasim {

// ---- Knobs -----------------------------------------------------------------------------------

enum class ThreadOrder { kForward, kReverse, kShuffle };
// Overrides KVMESH_CUDASIM_ORDER for later launches.
void SetThreadOrder(ThreadOrder order, uint64_t seed = 0);
// Overrides KVMESH_CUDASIM_EXEC for later enqueues.
void SetImmediateExecution(bool immediate);
// Adds a failure as KVMESH_CUDASIM_FAIL does, counting from now: the nth call of `call` from now
// on fails with `error`. "kernel" counts kernel executions. A driver call (cuMemCreate) fails
// with the CUresult of the same number: static_cast<cudaError_t>(CUDA_ERROR_OUT_OF_MEMORY).
void InjectFailure(const std::string& call, int nth, cudaError_t error);
// Drops every pending injected failure, clears the sticky error and discards the work still
// queued on every stream (what a device reset does), so that a test can go on after it planted a
// fault.
void ResetFailures();
// How many injected failures have not fired yet.
int PendingFailures();
// The explanation of the last misuse or failure the simulator reported on this thread ("" when
// none): which call, which pointer, which allocation.
std::string LastMessage();
// Counters, for tests of the simulator itself.
struct Stats {
  uint64_t device_allocations = 0;  // live cudaMalloc allocations
  uint64_t pinned_allocations = 0;  // live cudaMallocHost allocations
  uint64_t device_bytes = 0;        // live device bytes (as asked for)
  uint64_t kernels_run = 0;         // kernel launches executed so far
  uint64_t misuses = 0;             // errors the simulator reported for misuse so far
  uint64_t not_ready_answers = 0;   // cudaEventQuery / cudaStreamQuery answers of NotReady
  uint64_t vmm_handles = 0;         // live cuMemCreate / cuMemImportFromShareableHandle handles
  uint64_t vmm_reservations = 0;    // live cuMemAddressReserve ranges
  uint64_t vmm_mappings = 0;        // live cuMemMap mappings (not in device_allocations)
};
Stats GetStats();

// ---- Hooks for simulated libraries ----------------------------------------------------------

// An operation on a stream that completes on its own time (a simulated NCCL send or receive).
// When the stream reaches it (every operation enqueued before it has run), the stream calls
// Start() once, then Poll() until it returns true; operations after it wait until then.
// Poll(false) must not block (it is called from cudaEventQuery and cudaStreamQuery); Poll(true)
// comes from a synchronizing call and may block until the operation is done. Both are called on
// whatever thread drives the stream, never concurrently for one stream.
class AsyncOp {
 public:
  virtual ~AsyncOp() = default;
  virtual void Start() = 0;
  virtual bool Poll(bool blocking) = 0;
};

// Puts `op` on `stream` (nullptr: the legacy default stream). cudaErrorInvalidResourceHandle for
// a stream that does not exist. `what` names the operation in messages.
cudaError_t Enqueue(cudaStream_t stream, std::unique_ptr<AsyncOp> op, const char* what);

// Whether [p, p + bytes) lies inside one live device allocation. When it does not, records and
// prints why (naming `what`), counts a misuse, and returns false.
bool CheckDeviceRange(const void* p, size_t bytes, const char* what);

// Whether the simulator is what this process runs on (always true where this is linked; the
// nccl simulator asks, to refuse to run on a real CUDA runtime).
bool Active();

// ---- Kernels (used by kernel_prelude.h, not by tests) ---------------------------------------

namespace internal {

// The coordinates of one simulated GPU thread.
struct ThreadCoords {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The threads of one launch in the order they run: thread k of the order is At(k), a linear index
// (block * threads per block + thread) that Coords turns into coordinates.
struct LaunchOrder {
  ThreadOrder order;
  const uint64_t* shuffled;  // kShuffle: the permutation
  uint64_t total;            // threads in the grid
  dim3 grid;
  dim3 block;

  uint64_t At(uint64_t k) const {
    return order == ThreadOrder::kForward   ? k
           : order == ThreadOrder::kReverse ? total - 1 - k
                                            : shuffled[k];
  }
  ThreadCoords Coords(uint64_t t) const {
    const uint64_t threads = uint64_t(block.x) * block.y * block.z;
    const uint64_t b = t / threads, th = t % threads;
    ThreadCoords c;
    c.block_idx.x = unsigned(b % grid.x);
    c.block_idx.y = unsigned(b / grid.x % grid.y);
    c.block_idx.z = unsigned(b / grid.x / grid.y);
    c.thread_idx.x = unsigned(th % block.x);
    c.thread_idx.y = unsigned(th / block.x % block.y);
    c.thread_idx.z = unsigned(th / block.x / block.y);
    c.block_dim = block;
    c.grid_dim = grid;
    return c;
  }
};

// Checks the launch configuration and the pointer arguments (each null or device memory), then
// enqueues the launch: when the stream reaches it, `run` is called once with the order of the
// grid's threads and runs each of them (kernel_prelude.h). Errors are reported as for a launch on
// a GPU: through cudaGetLastError.
void LaunchKernel(const char* name, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                  const void* const* pointers, size_t num_pointers,
                  std::function<void(const LaunchOrder&)> run);

}  // namespace internal
}  // namespace cudasim

#endif  // KVMESH_TESTS_TESTING_CUDASIM_CUDA_SIM_H_
