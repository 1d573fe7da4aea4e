#include "cache/device/cuda_shared_memory.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/mutex.h"

namespace kvmesh {
namespace {

// The driver ABI these functions have had since CUDA 10.2.
constexpr unsigned kDriverVersion = 12000;

// The driver functions this file uses, found at run time (see the header).
struct Driver {
  decltype(&cuInit) init = nullptr;
  decltype(&cuGetErrorName) get_error_name = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
};

// Device memory of GPU `ordinal` that can be exported as a POSIX file descriptor.
CUmemAllocationProp SharedProp(int ordinal) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

template <typename F>
absl::Status Find(const char* name, F* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t error =
      cudaGetDriverEntryPointByVersion(name, &fn, kDriverVersion, cudaEnableDefault, &found);
  if (error != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA driver has no ", name, " (", cudaGetErrorString(error),
                     "): GPU memory cannot be shared with workers"));
  }
  *out = reinterpret_cast<F>(fn);
  return absl::OkStatus();
}

class VmmSharedMemory final : public CudaSharedMemory {
 public:
  VmmSharedMemory(int ordinal, const Driver& driver, size_t granularity)
      : ordinal_(ordinal), driver_(driver), granularity_(granularity) {}

  ~VmmSharedMemory() override {
    MutexLock lock(&mu_);
    while (!allocations_.empty()) {
      uint8_t* data = allocations_.begin()->first;
      const Allocation a = allocations_.begin()->second;
      allocations_.erase(allocations_.begin());
      LetGo(data, a);
    }
  }

  absl::StatusOr<uint8_t*> Allocate(size_t bytes) override {
    const size_t size =
        std::max<size_t>(1, (bytes + granularity_ - 1) / granularity_) * granularity_;
    if (cudaSetDevice(ordinal_) != cudaSuccess) return RuntimeError("cudaSetDevice");
    const CUmemAllocationProp prop = SharedProp(ordinal_);
    CUmemGenericAllocationHandle handle = 0;
    if (const CUresult r = driver_.create(&handle, size, &prop, 0); r != CUDA_SUCCESS) {
      return DriverError("cuMemCreate", size, r);
    }
    CUdeviceptr address = 0;
    int fd = -1;
    const absl::Status status = MapAndExport(handle, size, &address, &fd);
    // The mapping (and the exported descriptor) keep the physical memory.
    driver_.release(handle);
    if (!status.ok()) return status;
    uint8_t* data = reinterpret_cast<uint8_t*>(address);
    MutexLock lock(&mu_);
    allocations_.emplace(data, Allocation{fd, size});
    return data;
  }

  bool Owns(const uint8_t* data) const override {
    ReaderMutexLock lock(&mu_);
    return allocations_.count(const_cast<uint8_t*>(data)) != 0;
  }

  void Free(uint8_t* data) override {
    Allocation a;
    {
      MutexLock lock(&mu_);
      auto it = allocations_.find(data);
      if (it == allocations_.end()) return;
      a = it->second;
      allocations_.erase(it);
    }
    LetGo(data, a);
  }

  absl::StatusOr<SharedArena> Share(const uint8_t* data) const override {
    ReaderMutexLock lock(&mu_);
    auto it = allocations_.find(const_cast<uint8_t*>(data));
    if (it == allocations_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("cuda:", ordinal_, ": the arena is not shared GPU memory"));
    }
    SharedArena shared;
    shared.kind = SharedArena::Kind::kCudaMemory;
    shared.fd = it->second.fd;
    shared.size = it->second.size;
    shared.device = ordinal_;
    return shared;
  }

 private:
  struct Allocation {
    int fd = -1;
    size_t size = 0;
  };

  // Reserves an address range for `handle`, maps it read-write for this GPU, exports it as a
  // descriptor (*fd) and zeroes it. On error nothing of it is left.
  absl::Status MapAndExport(CUmemGenericAllocationHandle handle, size_t size, CUdeviceptr* address,
                            int* fd) {
    CUresult r = driver_.reserve(address, size, granularity_, 0, 0);
    if (r != CUDA_SUCCESS) return DriverError("cuMemAddressReserve", size, r);
    r = driver_.map(*address, size, 0, handle, 0);
    if (r != CUDA_SUCCESS) {
      driver_.address_free(*address, size);
      return DriverError("cuMemMap", size, r);
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = ordinal_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    absl::Status status;
    r = driver_.set_access(*address, size, &access, 1);
    if (r != CUDA_SUCCESS) status = DriverError("cuMemSetAccess", size, r);
    if (status.ok()) {
      r = driver_.export_handle(fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (r != CUDA_SUCCESS) status = DriverError("cuMemExportToShareableHandle", size, r);
    }
    if (status.ok()) status = Zero(reinterpret_cast<uint8_t*>(*address), size);
    if (!status.ok()) {
      driver_.unmap(*address, size);
      driver_.address_free(*address, size);
      if (*fd >= 0) close(*fd);
      *fd = -1;
    }
    return status;
  }

  absl::Status Zero(uint8_t* data, size_t size) {
    if (cudaMemset(data, 0, size) != cudaSuccess) return RuntimeError("cudaMemset");
    if (cudaDeviceSynchronize() != cudaSuccess) return RuntimeError("cudaDeviceSynchronize");
    return absl::OkStatus();
  }

  // Zeroes, unmaps and frees the range and closes the descriptor; the driver frees the physical
  // memory once no importer maps it. Errors are cleared, not returned: nothing can be done.
  void LetGo(uint8_t* data, const Allocation& a) {
    if (cudaSetDevice(ordinal_) != cudaSuccess || !Zero(data, a.size).ok()) {
      (void)cudaGetLastError();
    }
    const CUdeviceptr address = reinterpret_cast<CUdeviceptr>(data);
    driver_.unmap(address, a.size);
    driver_.address_free(address, a.size);
    if (a.fd >= 0) close(a.fd);
  }

  absl::Status DriverError(const char* call, size_t size, CUresult r) const {
    const char* name = nullptr;
    if (driver_.get_error_name(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown";
    const std::string message =
        absl::StrCat("cuda:", ordinal_, ": ", call, " of ", size, " shared bytes failed: ", name);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return absl::ResourceExhaustedError(message);
    return absl::InternalError(message);
  }

  absl::Status RuntimeError(const char* call) const {
    const cudaError_t error = cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("cuda:", ordinal_, ": ", call, " failed: ", cudaGetErrorString(error)));
  }

  const int ordinal_;
  const Driver driver_;
  const size_t granularity_;
  mutable Mutex mu_;
  std::map<uint8_t*, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaSharedMemory>> CudaSharedMemory::Create(int ordinal) {
  Driver d;
  absl::Status s = Find("cuInit", &d.init);
  if (s.ok()) s = Find("cuGetErrorName", &d.get_error_name);
  if (s.ok()) s = Find("cuMemGetAllocationGranularity", &d.granularity);
  if (s.ok()) s = Find("cuMemCreate", &d.create);
  if (s.ok()) s = Find("cuMemRelease", &d.release);
  if (s.ok()) s = Find("cuMemAddressReserve", &d.reserve);
  if (s.ok()) s = Find("cuMemAddressFree", &d.address_free);
  if (s.ok()) s = Find("cuMemMap", &d.map);
  if (s.ok()) s = Find("cuMemUnmap", &d.unmap);
  if (s.ok()) s = Find("cuMemSetAccess", &d.set_access);
  if (s.ok()) s = Find("cuMemExportToShareableHandle", &d.export_handle);
  if (!s.ok()) return s;
  // The runtime has initialized the driver already; a second cuInit is a no-op.
  if (const CUresult r = d.init(0); r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuda:", ordinal, ": cuInit failed: ", r));
  }
  const CUmemAllocationProp prop = SharedProp(ordinal);
  size_t granularity = 0;
  if (const CUresult r = d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      r != CUDA_SUCCESS || granularity == 0) {
    const char* name = nullptr;
    if (d.get_error_name(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown";
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", ordinal,
                     ": no GPU memory that can be shared through a file "
                     "descriptor (cuMemGetAllocationGranularity: ",
                     name, ")"));
  }
  return std::make_unique<VmmSharedMemory>(ordinal, d, granularity);
}

}  // namespace kvmesh
