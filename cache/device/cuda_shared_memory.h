// CudaSharedMemory: GPU memory that another process on the machine maps, for the local data path
// on --backend=cuda (docs/api.md#local-data-path).
//
// Each allocation is physical memory of the CUDA driver's virtual memory management (cuMemCreate)
// mapped into this process and exported once as a POSIX file descriptor, which a worker imports
// (cuMemImportFromShareableHandle), maps and sets access to. Unlike cudaIpcGetMemHandle's
// handles, whose memory is undefined in the importer once the exporter frees it, the physical
// memory lives until the last process that maps it or holds its descriptor lets go. So that a
// worker never reads bytes it should not: an allocation is zeroed before it is handed out (no
// bytes of an earlier allocation, another tenant's perhaps) and before it is let go (a worker
// still mapping a deleted cache reads zeros, as with the host backend's memfds).
//
// The driver functions are found through cudaGetDriverEntryPointByVersion: the binary does not
// link libcuda, and so starts on machines without a driver as the runtime alone allows.
//
// Thread safety: every method may be called from any thread.
#ifndef KVMESH_CACHE_DEVICE_CUDA_SHARED_MEMORY_H_
#define KVMESH_CACHE_DEVICE_CUDA_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "cache/device/device.h"

namespace kvmesh {

class CudaSharedMemory {
 public:
  // For GPU `ordinal`. FAILED_PRECONDITION when the driver lacks the calls or has no granularity
  // for memory exported as POSIX file descriptors, INTERNAL for other errors. (A GPU that cannot
  // export such memory although its driver has the calls fails at its first Allocate, naming
  // cuMemCreate.)
  static absl::StatusOr<std::unique_ptr<CudaSharedMemory>> Create(int ordinal);
  virtual ~CudaSharedMemory() = default;

  // At least `bytes` of zeroed device memory (whole granules of the driver, 2 MiB on current
  // GPUs). RESOURCE_EXHAUSTED when the GPU has no room, INTERNAL for other errors.
  virtual absl::StatusOr<uint8_t*> Allocate(size_t bytes) = 0;
  // Whether `data` is an allocation of this object.
  virtual bool Owns(const uint8_t* data) const = 0;
  // Zeroes and lets go of the allocation at `data` (REQUIRES: Owns(data)); errors are ignored.
  virtual void Free(uint8_t* data) = 0;
  // The allocation at `data` as another process imports it. FAILED_PRECONDITION when `data` is
  // not one of this object's allocations.
  virtual absl::StatusOr<SharedArena> Share(const uint8_t* data) const = 0;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_DEVICE_CUDA_SHARED_MEMORY_H_
