// The CUDA driver API's virtual memory management on the simulator (cuda_sim.h, "Virtual memory
// management"). A physical allocation is a memfd; a reservation is an inaccessible address range
// with guard pages; cuMemMap maps the memfd into a reservation, still inaccessible, and
// cuMemSetAccess opens it and lets runtime.cc's copies and kernels use it (sim_internal.h).
// Exporting hands out a duplicate of the memfd, which another process imports and maps as its
// own: the kernel's reference count on the memfd keeps the memory alive while any process holds
// a descriptor or a mapping of it, in whatever order they let go.
//
// Locking: mu_ guards the handles and reservations. It comes before runtime.cc's registry lock
// (the hooks take that one), and it is never held while streams run (SynchronizeAll).
#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "tests/testing/cudasim/cuda_sim.h"
#include "tests/testing/cudasim/sim_internal.h"

namespace cudasim {
namespace {

// cuMemGetAllocationGranularity's answer, minimum and recommended (a GPU's large page).
constexpr size_t kGranularity = size_t{2} << 20;
// The name of every memfd behind a physical allocation is this and the device ordinal: an
// importer learns the device from it, and refuses a descriptor that is not one.
constexpr char kMemfdPrefix[] = "kvmesh-cudasim-device-";

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

std::string Hex(uint64_t v) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(v));
  return text;
}

// ---- Errors ----------------------------------------------------------------------------------

struct DriverError {
  CUresult code;
  const char* name;
  const char* text;
};
// What these calls return, and the sticky errors of runtime.cc (a dead context fails driver
// calls too, with the CUresult of the same number).
constexpr DriverError kDriverErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_ECC_UNCORRECTABLE, "CUDA_ERROR_ECC_UNCORRECTABLE",
     "uncorrectable ECC error encountered"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
     "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_TIMEOUT, "CUDA_ERROR_LAUNCH_TIMEOUT",
     "the launch timed out and was terminated"},
    {CUDA_ERROR_ASSERT, "CUDA_ERROR_ASSERT", "device-side assert triggered"},
    {CUDA_ERROR_HARDWARE_STACK_ERROR, "CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"},
    {CUDA_ERROR_ILLEGAL_INSTRUCTION, "CUDA_ERROR_ILLEGAL_INSTRUCTION",
     "an illegal instruction was encountered"},
    {CUDA_ERROR_MISALIGNED_ADDRESS, "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

const DriverError* FindDriverError(int code) {
  for (const DriverError& e : kDriverErrors) {
    if (static_cast<int>(e.code) == code) return &e;
  }
  return nullptr;
}

// A CUresult argument as a number, read without loading it as the enum: callers may pass any
// value (the driver answers CUDA_ERROR_INVALID_VALUE for unknown ones), and loading an enum
// outside its values is undefined behaviour (UBSan's -fsanitize=enum reports it).
int CodeOf(const CUresult& code) {
  int value = 0;
  static_assert(sizeof(value) == sizeof(code));
  std::memcpy(&value, &code, sizeof(value));
  return value;
}

// Records a failed call (LastMessage, the misuse count, the trace) and returns `e`.
CUresult Fail(CUresult e, const std::string& why, bool misuse) {
  const DriverError* known = FindDriverError(CodeOf(e));
  internal::ReportFailure(known != nullptr ? known->name : "CUresult", why, misuse);
  return e;
}

std::atomic<bool> initialized{false};

// The start of every driver call but cuInit and cuGetError*: cuInit first, then the sticky error
// and injected failures.
CUresult Enter(const char* call) {
  if (!initialized.load(std::memory_order_acquire)) {
    return Fail(CUDA_ERROR_NOT_INITIALIZED, std::string(call) + ": cuInit has not been called",
                true);
  }
  if (const cudaError_t e = internal::EnterCall(call); e != cudaSuccess) {
    return Fail(static_cast<CUresult>(e),
                std::string(call) + " failed (injected or after an earlier device fault)", false);
  }
  return CUDA_SUCCESS;
}

// The start of a call that releases something: after a device fault it still releases (and then
// returns the fault, *dead), as cudaFree does; an injected failure stops it.
CUresult EnterRelease(const char* call, CUresult* dead) {
  if (!initialized.load(std::memory_order_acquire)) {
    return Fail(CUDA_ERROR_NOT_INITIALIZED, std::string(call) + ": cuInit has not been called",
                true);
  }
  *dead = static_cast<CUresult>(internal::StickyError());
  if (*dead == CUDA_SUCCESS) {
    if (const cudaError_t e = internal::InjectedFailure(call); e != cudaSuccess) {
      return Fail(static_cast<CUresult>(e), std::string(call) + " failed (injected)", false);
    }
  }
  return CUDA_SUCCESS;
}

CUresult Finish(CUresult dead, const char* call) {
  return dead == CUDA_SUCCESS
             ? CUDA_SUCCESS
             : Fail(dead, std::string(call) + ": the device failed earlier", false);
}

bool ValidDevice(int device) { return device >= 0 && device < internal::DeviceCount(); }

// Checks what cuMemCreate and cuMemGetAllocationGranularity accept: pinned memory on a device of
// the simulator, exportable as a file descriptor or not at all.
CUresult CheckProp(const CUmemAllocationProp& prop, const std::string& call) {
  if (prop.type != CU_MEM_ALLOCATION_TYPE_PINNED) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                call + ": allocation type " + std::to_string(int(prop.type)) +
                    " (only CU_MEM_ALLOCATION_TYPE_PINNED is valid)",
                true);
  }
  if (prop.location.type == CU_MEM_LOCATION_TYPE_HOST ||
      prop.location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
    return Fail(CUDA_ERROR_NOT_SUPPORTED, call + ": host locations are not simulated", true);
  }
  if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                call + ": location type " + std::to_string(int(prop.location.type)) +
                    " (expected CU_MEM_LOCATION_TYPE_DEVICE)",
                true);
  }
  if (!ValidDevice(prop.location.id)) {
    return Fail(CUDA_ERROR_INVALID_DEVICE,
                call + ": device " + std::to_string(prop.location.id) + " of " +
                    std::to_string(internal::DeviceCount()) + " simulated devices",
                true);
  }
  const unsigned types = static_cast<unsigned>(prop.requestedHandleTypes);
  if ((types & CU_MEM_HANDLE_TYPE_FABRIC) != 0) {
    return Fail(CUDA_ERROR_NOT_SUPPORTED, call + ": fabric handles (IMEX) are not simulated", true);
  }
  if ((types & ~static_cast<unsigned>(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) != 0) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                call + ": requested handle types " + Hex(types) +
                    " (on Linux: CU_MEM_HANDLE_TYPE_NONE or POSIX_FILE_DESCRIPTOR)",
                true);
  }
  if (prop.win32HandleMetaData != nullptr) {
    return Fail(CUDA_ERROR_INVALID_VALUE, call + ": win32HandleMetaData must be null on Linux",
                true);
  }
  if (prop.allocFlags.compressionType != CU_MEM_ALLOCATION_COMP_NONE ||
      prop.allocFlags.usage != 0) {
    return Fail(CUDA_ERROR_NOT_SUPPORTED,
                call + ": compressible or tile-pool memory (allocFlags) is not simulated", true);
  }
  return CUDA_SUCCESS;
}

// ---- Objects ---------------------------------------------------------------------------------

// Physical memory as this process holds it: alive while a handle or a mapping of this process
// refers to it. One this process created counts against its device until then; an imported one
// was counted by the process that created it.
class Physical {
 public:
  Physical(int device, size_t size, bool exportable, bool charged)
      : device_(device), size_(size), exportable_(exportable), charged_(charged) {}
  ~Physical() {
    if (charged_) internal::UnchargeDevice(device_, size_);
  }
  Physical(const Physical&) = delete;
  Physical& operator=(const Physical&) = delete;

  int device() const { return device_; }
  size_t size() const { return size_; }
  bool exportable() const { return exportable_; }

 private:
  const int device_;
  const size_t size_;
  const bool exportable_;  // created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
  const bool charged_;
};

// A CUmemGenericAllocationHandle: its own descriptor of the memfd (what cuMemMap maps and
// cuMemExportToShareableHandle duplicates), closed by cuMemRelease.
struct Handle {
  int fd = -1;
  std::shared_ptr<Physical> physical;
};

struct Mapping {
  size_t size = 0;
  std::shared_ptr<Physical> physical;
};

// An address range of cuMemAddressReserve: [base, base + size) inside an inaccessible mapping
// that has at least a guard page on either side.
struct Reservation {
  uint8_t* map = nullptr;
  size_t map_bytes = 0;
  size_t size = 0;
  std::map<uintptr_t, Mapping> mappings;  // by address
};

class Vmm {
 public:
  static Vmm& Get() {
    // Immortal, as the runtime's simulator is.
    static Vmm* const vmm = new Vmm();
    return *vmm;
  }

  CUresult Create(CUmemGenericAllocationHandle* out, size_t size, int device, bool exportable) {
    std::string why;
    if (!internal::ChargeDevice(device, size, "cuMemCreate", &why)) {
      return Fail(CUDA_ERROR_OUT_OF_MEMORY, why, false);
    }
    auto physical = std::make_shared<Physical>(device, size, exportable, /*charged=*/true);
    const std::string name = kMemfdPrefix + std::to_string(device);
    const int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
    if (fd < 0) {
      return Fail(CUDA_ERROR_OUT_OF_MEMORY,
                  std::string("cuMemCreate: memfd_create failed: ") + std::strerror(errno), false);
    }
    void* fill = MAP_FAILED;
    if (ftruncate(fd, static_cast<off_t>(size)) == 0) {
      fill = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    if (fill == MAP_FAILED) {
      const int error = errno;
      close(fd);
      return Fail(CUDA_ERROR_OUT_OF_MEMORY,
                  "cuMemCreate of " + std::to_string(size) + " bytes: " + std::strerror(error),
                  false);
    }
    std::memset(fill, internal::kDevicePoison, size);
    munmap(fill, size);
    std::lock_guard<std::mutex> lock(mu_);
    *out = NewHandle(fd, std::move(physical));
    return CUDA_SUCCESS;
  }

  CUresult Import(CUmemGenericAllocationHandle* out, int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  "cuMemImportFromShareableHandle: descriptor " + std::to_string(fd) + ": " +
                      std::strerror(errno),
                  true);
    }
    // A memfd's link reads "/memfd:NAME (deleted)".
    char link[256] = {};
    const std::string proc = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t n = readlink(proc.c_str(), link, sizeof(link) - 1);
    const std::string prefix = std::string("/memfd:") + kMemfdPrefix;
    char* end = nullptr;
    long device = -1;
    if (n > 0 && std::strncmp(link, prefix.c_str(), prefix.size()) == 0) {
      device = std::strtol(link + prefix.size(), &end, 10);
    }
    if (device < 0 || end == link + prefix.size() || !S_ISREG(st.st_mode) || st.st_size <= 0 ||
        st.st_size % static_cast<off_t>(kGranularity) != 0) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  "cuMemImportFromShareableHandle: descriptor " + std::to_string(fd) + " (" +
                      std::string(link, n > 0 ? static_cast<size_t>(n) : 0) +
                      ") is not one that cuMemExportToShareableHandle made",
                  true);
    }
    if (!ValidDevice(static_cast<int>(device))) {
      return Fail(CUDA_ERROR_NOT_SUPPORTED,
                  "cuMemImportFromShareableHandle: the memory is on device " +
                      std::to_string(device) + ", which this process does not see (" +
                      std::to_string(internal::DeviceCount()) + " simulated devices)",
                  false);
    }
    const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) {
      return Fail(CUDA_ERROR_OPERATING_SYSTEM,
                  std::string("cuMemImportFromShareableHandle: dup: ") + std::strerror(errno),
                  false);
    }
    auto physical =
        std::make_shared<Physical>(static_cast<int>(device), static_cast<size_t>(st.st_size),
                                   /*exportable=*/true, /*charged=*/false);
    std::lock_guard<std::mutex> lock(mu_);
    *out = NewHandle(own, std::move(physical));
    return CUDA_SUCCESS;
  }

  CUresult Release(CUmemGenericAllocationHandle handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handles_.find(handle);
    if (it == handles_.end()) return UnknownHandle("cuMemRelease", handle);
    close(it->second.fd);
    handles_.erase(it);  // the memory itself stays while a mapping holds it
    return CUDA_SUCCESS;
  }

  CUresult Export(int* out, CUmemGenericAllocationHandle handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handles_.find(handle);
    if (it == handles_.end()) return UnknownHandle("cuMemExportToShareableHandle", handle);
    if (!it->second.physical->exportable()) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  "cuMemExportToShareableHandle(" + Hex(handle) +
                      "): created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in "
                      "requestedHandleTypes",
                  true);
    }
    const int fd = fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
      return Fail(CUDA_ERROR_OPERATING_SYSTEM,
                  std::string("cuMemExportToShareableHandle: dup: ") + std::strerror(errno), false);
    }
    *out = fd;
    return CUDA_SUCCESS;
  }

  CUresult Reserve(CUdeviceptr* out, size_t size, size_t alignment) {
    const size_t page = PageSize();
    const size_t align = std::max(kGranularity, alignment);
    if (size > (size_t{1} << 46) || align > (size_t{1} << 46)) {
      return Fail(CUDA_ERROR_OUT_OF_MEMORY,
                  "cuMemAddressReserve of " + std::to_string(size) + " bytes aligned to " +
                      std::to_string(align) + ": more than the simulator reserves",
                  false);
    }
    // Room for the alignment, and a guard page either side of the range.
    const size_t map_bytes = size + align + 2 * page;
    void* map =
        mmap(nullptr, map_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map == MAP_FAILED) {
      return Fail(CUDA_ERROR_OUT_OF_MEMORY,
                  "cuMemAddressReserve of " + std::to_string(size) +
                      " bytes: mmap failed: " + std::strerror(errno),
                  false);
    }
    const uintptr_t base = (reinterpret_cast<uintptr_t>(map) + page + align - 1) / align * align;
    Reservation r;
    r.map = static_cast<uint8_t*>(map);
    r.map_bytes = map_bytes;
    r.size = size;
    std::lock_guard<std::mutex> lock(mu_);
    reservations_[base] = std::move(r);
    *out = static_cast<CUdeviceptr>(base);
    return CUDA_SUCCESS;
  }

  CUresult Free(CUdeviceptr ptr, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = reservations_.find(static_cast<uintptr_t>(ptr));
    if (it == reservations_.end() || it->second.size != size) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  "cuMemAddressFree(" + Hex(ptr) + ", " + std::to_string(size) +
                      "): not an address range that cuMemAddressReserve returned, with its size",
                  true);
    }
    if (!it->second.mappings.empty()) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  "cuMemAddressFree(" + Hex(ptr) +
                      "): " + std::to_string(it->second.mappings.size()) +
                      " allocations are still mapped in it (cuMemUnmap them first)",
                  true);
    }
    internal::ForgetUnmapped(reinterpret_cast<void*>(ptr), size);
    munmap(it->second.map, it->second.map_bytes);
    reservations_.erase(it);
    return CUDA_SUCCESS;
  }

  CUresult Map(CUdeviceptr ptr, size_t size, CUmemGenericAllocationHandle handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto h = handles_.find(handle);
    if (h == handles_.end()) return UnknownHandle("cuMemMap", handle);
    const std::shared_ptr<Physical>& physical = h->second.physical;
    const std::string call = "cuMemMap(" + Hex(ptr) + ", " + std::to_string(size) + ")";
    if (size != physical->size()) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  call + ": the allocation has " + std::to_string(physical->size()) +
                      " bytes (the simulator maps whole allocations)",
                  true);
    }
    Reservation* r = ReservationOf(ptr, size);
    if (r == nullptr) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  call + ": not inside an address range of cuMemAddressReserve", true);
    }
    if (ptr % kGranularity != 0) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  call + ": the address is not a multiple of the granularity (" +
                      std::to_string(kGranularity) + ")",
                  true);
    }
    auto next = r->mappings.lower_bound(ptr + size);
    if (next != r->mappings.begin()) {
      auto before = std::prev(next);
      if (before->first + before->second.size > ptr) {
        return Fail(
            CUDA_ERROR_INVALID_VALUE,
            call + ": overlaps the mapping at " + Hex(before->first) + " (cuMemUnmap it first)",
            true);
      }
    }
    void* at = reinterpret_cast<void*>(ptr);
    // Inaccessible until cuMemSetAccess, as on a GPU.
    if (mmap(at, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->second.fd, 0) == MAP_FAILED) {
      return Fail(CUDA_ERROR_OUT_OF_MEMORY, call + ": mmap failed: " + std::strerror(errno), false);
    }
    internal::ForgetUnmapped(at, size);
    internal::RegisterMapped(at, size, physical->device());
    r->mappings[ptr] = Mapping{size, physical};
    return CUDA_SUCCESS;
  }

  CUresult Unmap(CUdeviceptr ptr, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    Reservation* r = nullptr;
    if (!Covered(ptr, size, &r)) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  "cuMemUnmap(" + Hex(ptr) + ", " + std::to_string(size) +
                      "): not whole mappings of cuMemMap, back to back",
                  true);
    }
    for (auto it = r->mappings.find(ptr); it != r->mappings.end() && it->first < ptr + size;) {
      void* at = reinterpret_cast<void*>(it->first);
      internal::UnregisterMapped(at);
      if (mmap(at, it->second.size, PROT_NONE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED) {
        std::fprintf(stderr, "cudasim: cuMemUnmap: remapping %p without access failed: %s\n", at,
                     std::strerror(errno));
        std::abort();
      }
      it = r->mappings.erase(it);  // the memory goes with its last handle and mapping
    }
    return CUDA_SUCCESS;
  }

  CUresult SetAccess(CUdeviceptr ptr, size_t size, bool accessible) {
    std::lock_guard<std::mutex> lock(mu_);
    Reservation* r = nullptr;
    if (!Covered(ptr, size, &r)) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  "cuMemSetAccess(" + Hex(ptr) + ", " + std::to_string(size) +
                      "): not whole mappings of cuMemMap, back to back",
                  true);
    }
    for (auto it = r->mappings.find(ptr); it != r->mappings.end() && it->first < ptr + size; ++it) {
      void* at = reinterpret_cast<void*>(it->first);
      // Copies see the access only while the pages have it.
      if (!accessible) internal::SetMappedAccess(at, false);
      if (mprotect(at, it->second.size, accessible ? PROT_READ | PROT_WRITE : PROT_NONE) != 0) {
        std::fprintf(stderr, "cudasim: cuMemSetAccess: mprotect of %p failed: %s\n", at,
                     std::strerror(errno));
        std::abort();
      }
      if (accessible) internal::SetMappedAccess(at, true);
    }
    return CUDA_SUCCESS;
  }

  void AddStats(Stats* stats) {
    std::lock_guard<std::mutex> lock(mu_);
    stats->vmm_handles += handles_.size();
    stats->vmm_reservations += reservations_.size();
    for (const auto& entry : reservations_) stats->vmm_mappings += entry.second.mappings.size();
  }

 private:
  Vmm() = default;

  // REQUIRES: mu_ held.
  CUmemGenericAllocationHandle NewHandle(int fd, std::shared_ptr<Physical> physical) {
    // Never reused, and unlike a pointer or a small integer: a stale or made-up handle is caught.
    const CUmemGenericAllocationHandle handle = (uint64_t{0xC5} << 56) | ++handles_made_;
    handles_[handle] = Handle{fd, std::move(physical)};
    return handle;
  }

  CUresult UnknownHandle(const char* call, CUmemGenericAllocationHandle handle) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                std::string(call) + "(" + Hex(handle) +
                    "): not a live handle of cuMemCreate or cuMemImportFromShareableHandle",
                true);
  }

  // The reservation that holds [ptr, ptr + size), or null. REQUIRES: mu_ held.
  Reservation* ReservationOf(CUdeviceptr ptr, size_t size) {
    auto it = reservations_.upper_bound(static_cast<uintptr_t>(ptr));
    if (it == reservations_.begin()) return nullptr;
    --it;
    const uintptr_t base = it->first;
    if (size == 0 || ptr < base || ptr - base > it->second.size ||
        size > it->second.size - (ptr - base)) {
      return nullptr;
    }
    return &it->second;
  }

  // Whether [ptr, ptr + size) is exactly a run of adjacent mappings of one reservation (*r).
  // REQUIRES: mu_ held.
  bool Covered(CUdeviceptr ptr, size_t size, Reservation** r) {
    *r = ReservationOf(ptr, size);
    if (*r == nullptr) return false;
    uintptr_t at = static_cast<uintptr_t>(ptr);
    const uintptr_t end = at + size;
    for (auto it = (*r)->mappings.find(at); it != (*r)->mappings.end() && it->first == at; ++it) {
      at += it->second.size;
      if (at == end) return true;
      if (at > end) return false;
    }
    return false;
  }

  std::mutex mu_;
  std::map<CUmemGenericAllocationHandle, Handle> handles_;
  std::map<uintptr_t, Reservation> reservations_;  // by base
  uint64_t handles_made_ = 0;
};

}  // namespace

namespace internal {

bool DriverErrorCode(const std::string& name, int* code) {
  for (const DriverError& e : kDriverErrors) {
    if (name == e.name) {
      *code = static_cast<int>(e.code);
      return true;
    }
  }
  return false;
}

void AddDriverStats(Stats* stats) { Vmm::Get().AddStats(stats); }

}  // namespace internal
}  // namespace cudasim

// ---- The CUDA driver API ---------------------------------------------------------------------

using cudasim::Fail;
using cudasim::Vmm;

extern "C" {

CUresult CUDAAPI cuGetErrorName(CUresult error, const char** pStr) {
  if (pStr == nullptr) return Fail(CUDA_ERROR_INVALID_VALUE, "cuGetErrorName: null", true);
  const cudasim::DriverError* e = cudasim::FindDriverError(cudasim::CodeOf(error));
  *pStr = e != nullptr ? e->name : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char** pStr) {
  if (pStr == nullptr) return Fail(CUDA_ERROR_INVALID_VALUE, "cuGetErrorString: null", true);
  const cudasim::DriverError* e = cudasim::FindDriverError(cudasim::CodeOf(error));
  *pStr = e != nullptr ? e->text : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuInit(unsigned int Flags) {
  if (const cudaError_t e = cudasim::internal::EnterCall("cuInit"); e != cudaSuccess) {
    return Fail(static_cast<CUresult>(e), "cuInit failed (injected)", false);
  }
  if (Flags != 0) {
    return Fail(CUDA_ERROR_INVALID_VALUE, "cuInit(" + std::to_string(Flags) + "): flags must be 0",
                true);
  }
  if (cudasim::internal::DeviceCount() == 0) {
    return Fail(CUDA_ERROR_NO_DEVICE, "cuInit: no simulated device (KVMESH_CUDASIM_DEVICES=0)",
                false);
  }
  cudasim::initialized.store(true, std::memory_order_release);
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice* device, int ordinal) {
  if (const CUresult e = cudasim::Enter("cuDeviceGet"); e != CUDA_SUCCESS) return e;
  if (device == nullptr) return Fail(CUDA_ERROR_INVALID_VALUE, "cuDeviceGet: null", true);
  if (!cudasim::ValidDevice(ordinal)) {
    return Fail(CUDA_ERROR_INVALID_DEVICE,
                "cuDeviceGet(" + std::to_string(ordinal) +
                    "): " + std::to_string(cudasim::internal::DeviceCount()) + " simulated devices",
                false);
  }
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                               CUmemAllocationGranularity_flags option) {
  const char* call = "cuMemGetAllocationGranularity";
  if (const CUresult e = cudasim::Enter(call); e != CUDA_SUCCESS) return e;
  if (granularity == nullptr || prop == nullptr) {
    return Fail(CUDA_ERROR_INVALID_VALUE, std::string(call) + ": null", true);
  }
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
      option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                std::string(call) + ": option " + std::to_string(int(option)), true);
  }
  if (const CUresult e = cudasim::CheckProp(*prop, call); e != CUDA_SUCCESS) return e;
  *granularity = cudasim::kGranularity;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                             const CUmemAllocationProp* prop, unsigned long long flags) {
  if (const CUresult e = cudasim::Enter("cuMemCreate"); e != CUDA_SUCCESS) return e;
  if (handle == nullptr || prop == nullptr || flags != 0) {
    return Fail(CUDA_ERROR_INVALID_VALUE, "cuMemCreate: null handle or prop, or flags not 0", true);
  }
  if (const CUresult e = cudasim::CheckProp(*prop, "cuMemCreate"); e != CUDA_SUCCESS) return e;
  if (size == 0 || size % cudasim::kGranularity != 0) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                "cuMemCreate of " + std::to_string(size) +
                    " bytes: not a nonzero multiple of the granularity (" +
                    std::to_string(cudasim::kGranularity) + ")",
                true);
  }
  return Vmm::Get().Create(handle, size, prop->location.id,
                           prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  CUresult dead;
  if (const CUresult e = cudasim::EnterRelease("cuMemRelease", &dead); e != CUDA_SUCCESS) {
    return e;
  }
  if (const CUresult e = Vmm::Get().Release(handle); e != CUDA_SUCCESS) return e;
  return cudasim::Finish(dead, "cuMemRelease");
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment,
                                     CUdeviceptr addr, unsigned long long flags) {
  if (const CUresult e = cudasim::Enter("cuMemAddressReserve"); e != CUDA_SUCCESS) return e;
  if (ptr == nullptr || flags != 0) {
    return Fail(CUDA_ERROR_INVALID_VALUE, "cuMemAddressReserve: null ptr or flags not 0", true);
  }
  if (size == 0 || size % cudasim::kGranularity != 0) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                "cuMemAddressReserve of " + std::to_string(size) +
                    " bytes: not a nonzero multiple of the granularity (" +
                    std::to_string(cudasim::kGranularity) + ")",
                true);
  }
  if ((alignment & (alignment - 1)) != 0) {
    return Fail(
        CUDA_ERROR_INVALID_VALUE,
        "cuMemAddressReserve: alignment " + std::to_string(alignment) + " is not a power of two",
        true);
  }
  (void)addr;  // a hint, which the simulator does not follow
  return Vmm::Get().Reserve(ptr, size, alignment);
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  CUresult dead;
  if (const CUresult e = cudasim::EnterRelease("cuMemAddressFree", &dead); e != CUDA_SUCCESS) {
    return e;
  }
  if (const CUresult e = Vmm::Get().Free(ptr, size); e != CUDA_SUCCESS) return e;
  return cudasim::Finish(dead, "cuMemAddressFree");
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                          CUmemGenericAllocationHandle handle, unsigned long long flags) {
  if (const CUresult e = cudasim::Enter("cuMemMap"); e != CUDA_SUCCESS) return e;
  if (offset != 0 || flags != 0) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                "cuMemMap: offset " + std::to_string(offset) + ", flags " + std::to_string(flags) +
                    " (both must be 0)",
                true);
  }
  return Vmm::Get().Map(ptr, size, handle);
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  CUresult dead;
  if (const CUresult e = cudasim::EnterRelease("cuMemUnmap", &dead); e != CUDA_SUCCESS) return e;
  // Synchronous, as on a GPU: work queued on the range runs before it goes.
  if (dead == CUDA_SUCCESS) dead = static_cast<CUresult>(cudasim::internal::SynchronizeAll());
  if (const CUresult e = Vmm::Get().Unmap(ptr, size); e != CUDA_SUCCESS) return e;
  return cudasim::Finish(dead, "cuMemUnmap");
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                                size_t count) {
  if (const CUresult e = cudasim::Enter("cuMemSetAccess"); e != CUDA_SUCCESS) return e;
  if (desc == nullptr || count == 0) {
    return Fail(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: no access descriptors", true);
  }
  // One address space serves every simulated device: the range is accessible when any device
  // may read and write it.
  bool accessible = false;
  for (size_t i = 0; i < count; ++i) {
    const std::string which = "cuMemSetAccess, descriptor " + std::to_string(i);
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
      return Fail(CUDA_ERROR_INVALID_VALUE,
                  which + ": location type " + std::to_string(int(desc[i].location.type)) +
                      " (device memory takes CU_MEM_LOCATION_TYPE_DEVICE)",
                  true);
    }
    if (!cudasim::ValidDevice(desc[i].location.id)) {
      return Fail(CUDA_ERROR_INVALID_DEVICE,
                  which + ": device " + std::to_string(desc[i].location.id), true);
    }
    switch (desc[i].flags) {
      case CU_MEM_ACCESS_FLAGS_PROT_NONE:
        break;
      case CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
        accessible = true;
        break;
      case CU_MEM_ACCESS_FLAGS_PROT_READ:
        return Fail(CUDA_ERROR_NOT_SUPPORTED, which + ": read-only access is not simulated", true);
      default:
        return Fail(CUDA_ERROR_INVALID_VALUE,
                    which + ": flags " + std::to_string(int(desc[i].flags)), true);
    }
  }
  // Taking access away waits for the work that may still use the range.
  if (!accessible) {
    if (const cudaError_t e = cudasim::internal::SynchronizeAll(); e != cudaSuccess) {
      return Fail(static_cast<CUresult>(e), "cuMemSetAccess: the device failed", false);
    }
  }
  return Vmm::Get().SetAccess(ptr, size, accessible);
}

CUresult CUDAAPI cuMemExportToShareableHandle(void* shareableHandle,
                                              CUmemGenericAllocationHandle handle,
                                              CUmemAllocationHandleType handleType,
                                              unsigned long long flags) {
  const char* call = "cuMemExportToShareableHandle";
  if (const CUresult e = cudasim::Enter(call); e != CUDA_SUCCESS) return e;
  if (shareableHandle == nullptr || flags != 0) {
    return Fail(CUDA_ERROR_INVALID_VALUE, std::string(call) + ": null handle or flags not 0", true);
  }
  if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                std::string(call) + ": handle type " + std::to_string(int(handleType)) +
                    " (the simulator exports CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)",
                true);
  }
  return Vmm::Get().Export(static_cast<int*>(shareableHandle), handle);
}

CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle,
                                                void* osHandle,
                                                CUmemAllocationHandleType shHandleType) {
  const char* call = "cuMemImportFromShareableHandle";
  if (const CUresult e = cudasim::Enter(call); e != CUDA_SUCCESS) return e;
  if (handle == nullptr) return Fail(CUDA_ERROR_INVALID_VALUE, std::string(call) + ": null", true);
  if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                std::string(call) + ": handle type " + std::to_string(int(shHandleType)) +
                    " (the simulator imports CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)",
                true);
  }
  // The descriptor travels as the pointer's value, as CUDA's own samples pass it.
  const uintptr_t fd = reinterpret_cast<uintptr_t>(osHandle);
  if (fd > static_cast<uintptr_t>(INT_MAX)) {
    return Fail(CUDA_ERROR_INVALID_VALUE,
                std::string(call) + ": " + cudasim::Hex(fd) + " is not a file descriptor", true);
  }
  return Vmm::Get().Import(handle, static_cast<int>(fd));
}

// The runtime's door to the driver functions (what CudaSharedMemory uses, so that production
// binaries need not link libcuda): the simulator's own, by name. Any cudaVersion of 10.2 or
// later finds them (their ABI has not changed since); flags must be cudaEnableDefault.
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr,
                                             unsigned int cudaVersion, unsigned long long flags,
                                             cudaDriverEntryPointQueryResult* driverStatus) {
  struct Entry {
    const char* name;
    void* fn;
  };
  static const Entry kEntries[] = {
      {"cuInit", reinterpret_cast<void*>(&cuInit)},
      {"cuDeviceGet", reinterpret_cast<void*>(&cuDeviceGet)},
      {"cuGetErrorName", reinterpret_cast<void*>(&cuGetErrorName)},
      {"cuGetErrorString", reinterpret_cast<void*>(&cuGetErrorString)},
      {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&cuMemGetAllocationGranularity)},
      {"cuMemCreate", reinterpret_cast<void*>(&cuMemCreate)},
      {"cuMemRelease", reinterpret_cast<void*>(&cuMemRelease)},
      {"cuMemAddressReserve", reinterpret_cast<void*>(&cuMemAddressReserve)},
      {"cuMemAddressFree", reinterpret_cast<void*>(&cuMemAddressFree)},
      {"cuMemMap", reinterpret_cast<void*>(&cuMemMap)},
      {"cuMemUnmap", reinterpret_cast<void*>(&cuMemUnmap)},
      {"cuMemSetAccess", reinterpret_cast<void*>(&cuMemSetAccess)},
      {"cuMemExportToShareableHandle", reinterpret_cast<void*>(&cuMemExportToShareableHandle)},
      {"cuMemImportFromShareableHandle", reinterpret_cast<void*>(&cuMemImportFromShareableHandle)},
  };
  if (symbol == nullptr || funcPtr == nullptr || flags != cudaEnableDefault) {
    cudasim::internal::ReportFailure("cudaErrorInvalidValue",
                                     "cudaGetDriverEntryPointByVersion: null symbol or funcPtr, "
                                     "or flags other than cudaEnableDefault",
                                     /*misuse=*/true);
    return cudaErrorInvalidValue;
  }
  *funcPtr = nullptr;
  if (cudaVersion < 10020) {
    if (driverStatus != nullptr) *driverStatus = cudaDriverEntryPointVersionNotSufficent;
    return cudaSuccess;
  }
  for (const Entry& e : kEntries) {
    if (std::strcmp(e.name, symbol) == 0) {
      *funcPtr = e.fn;
      if (driverStatus != nullptr) *driverStatus = cudaDriverEntryPointSuccess;
      return cudaSuccess;
    }
  }
  if (driverStatus != nullptr) *driverStatus = cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

}  // extern "C"
