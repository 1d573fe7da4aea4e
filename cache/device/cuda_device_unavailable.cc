// CudaDevice entry points of a build without a CUDA compiler: no GPU can be opened.
#include "cache/device/cuda_device.h"

namespace kvmesh {

bool CudaBuilt() { return false; }

bool CudaSimulated() { return false; }

int CudaDeviceCount() { return 0; }

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(const CudaDeviceOptions& options) {
  return absl::FailedPreconditionError(
      "this kvmesh was built without CUDA (no nvcc found at configure time); rebuild with "
      "-DKVMESH_CUDA=ON to use --backend=cuda");
}

}  // namespace kvmesh
