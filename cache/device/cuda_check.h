// Checking CUDA runtime calls where they are made.
//
// KVMESH_CUDA_RETURN_IF_ERROR(expr) evaluates a call that returns cudaError_t; on failure it
// clears CUDA's last-error state (so the error is not reported again by an unrelated later
// call) and returns a Status that names the expression, file and line. Out-of-memory maps to
// RESOURCE_EXHAUSTED (the caller may free something and retry); everything else is INTERNAL.
#ifndef KVMESH_CACHE_DEVICE_CUDA_CHECK_H_
#define KVMESH_CACHE_DEVICE_CUDA_CHECK_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace kvmesh {
namespace cuda {

// The Status for `error` returned by `expr` at file:line.
absl::Status CudaError(cudaError_t error, const char* expr, const char* file, int line);

}  // namespace cuda
}  // namespace kvmesh

#define KVMESH_CUDA_RETURN_IF_ERROR(expr)                                              \
  do {                                                                                 \
    const cudaError_t kvmesh_cuda_error_ = (expr);                                     \
    if (kvmesh_cuda_error_ != cudaSuccess) {                                           \
      (void)cudaGetLastError();                                                        \
      return ::kvmesh::cuda::CudaError(kvmesh_cuda_error_, #expr, __FILE__, __LINE__); \
    }                                                                                  \
  } while (0)

#endif  // KVMESH_CACHE_DEVICE_CUDA_CHECK_H_
