// The simulated CUDA runtime (cuda_sim.h): memory with guard pages and poison, deferred streams,
// events, kernels run thread by thread, error injection and sticky errors.
//
// Locking: registry_mu guards the tables of allocations, streams and events; each stream has a
// queue lock (its pending operations and counters) and an execution lock (held by the one thread
// running its operations). Order: exec -> queue, exec -> registry; the registry lock is never held
// while a stream runs. The driver API's lock (vmm.cc) comes before the registry lock: the hooks
// of sim_internal.h take only the registry lock and never call back into vmm.cc.
#include "tests/testing/cudasim/cuda_sim.h"

#include <cuda_runtime_api.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#include <vector_functions.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tests/testing/cudasim/sim_internal.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVMESH_CUDASIM_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define KVMESH_CUDASIM_ASAN 1
#endif

namespace cudasim {
namespace {

// Fill patterns: fresh device memory, fresh pinned memory, and the slack between the size asked
// for and the 256-byte granule (checked after every kernel: a write there is out of bounds).
using internal::kDevicePoison;
constexpr uint8_t kPinnedPoison = 0x5A;
constexpr uint8_t kCanary = 0xC3;
constexpr size_t kGranule = 256;  // cudaMalloc's alignment
// Freed ranges stay mapped without access for this many allocations, so that a late access
// faults (and names the allocation) instead of landing in a new one.
constexpr size_t kQuarantineCount = 4096;
// The simulated GPU: few SMs keep launches small while still splitting rows into slices.
constexpr int kSms = 2;
constexpr int kThreadsPerSm = 2048;
constexpr int kMaxThreadsPerBlock = 1024;
constexpr size_t kMaxSharedPerBlock = 48 * 1024;

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}
size_t RoundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// ---- Errors ----------------------------------------------------------------------------------

struct ErrorInfo {
  cudaError_t code;
  const char* name;
  const char* text;
};
constexpr ErrorInfo kErrors[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources",
     "too many resources requested for launch"},
    {cudaErrorLaunchTimeout, "cudaErrorLaunchTimeout", "the launch timed out and was terminated"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorHardwareStackError, "cudaErrorHardwareStackError", "hardware stack error"},
    {cudaErrorIllegalInstruction, "cudaErrorIllegalInstruction",
     "an illegal instruction was encountered"},
    {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress", "misaligned address"},
    {cudaErrorECCUncorrectable, "cudaErrorECCUncorrectable", "uncorrectable ECC error encountered"},
    {cudaErrorAssert, "cudaErrorAssert", "device-side assert triggered"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
     "CUDA driver version is insufficient for CUDA runtime version"},
    {cudaErrorDevicesUnavailable, "cudaErrorDevicesUnavailable",
     "CUDA-capable device(s) is/are busy or unavailable"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

const ErrorInfo* FindError(cudaError_t code) {
  for (const ErrorInfo& e : kErrors) {
    if (e.code == code) return &e;
  }
  return nullptr;
}

// Errors after which a real context is unusable: every later call returns them.
bool IsSticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorECCUncorrectable:
    case cudaErrorAssert:
      return true;
    default:
      return false;
  }
}

// ---- Configuration ---------------------------------------------------------------------------

struct Config {
  bool immediate = false;
  ThreadOrder order = ThreadOrder::kForward;
  uint64_t seed = 1;
  int devices = 1;
  size_t memory = size_t{16} << 30;
  bool trace = false;
};

[[noreturn]] __attribute__((format(printf, 1, 2))) void Die(const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::fputs("cudasim: ", stderr);
  std::vfprintf(stderr, format, args);
  std::fputc('\n', stderr);
  va_end(args);
  std::abort();
}

bool ParseBytes(const std::string& text, size_t* out) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long n = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str()) return false;
  const std::string suffix(end);
  unsigned shift = 0;
  if (suffix == "KiB") {
    shift = 10;
  } else if (suffix == "MiB") {
    shift = 20;
  } else if (suffix == "GiB") {
    shift = 30;
  } else if (!suffix.empty()) {
    return false;
  }
  *out = static_cast<size_t>(n) << shift;
  return true;
}

cudaError_t ParseError(const std::string& name) {
  for (const ErrorInfo& e : kErrors) {
    if (name == e.name) return e.code;
  }
  // A driver call fails with the CUresult of the same number, so a CUresult name is one too.
  if (int driver = 0; internal::DriverErrorCode(name, &driver) && driver > 0) {
    return static_cast<cudaError_t>(driver);
  }
  char* end = nullptr;
  const long code = std::strtol(name.c_str(), &end, 10);
  if (end != name.c_str() && *end == '\0' && code > 0) return static_cast<cudaError_t>(code);
  Die("KVMESH_CUDASIM_FAIL: unknown error %s (a cudaError or CUresult name, or a number)",
      name.c_str());
}

// The calls a failure can be injected into: the runtime and driver functions, a launch, a running
// kernel.
bool KnownCall(const std::string& call) {
  static const char* const kCalls[] = {"cudaDeviceGetAttribute",
                                       "cudaDeviceSynchronize",
                                       "cudaEventCreateWithFlags",
                                       "cudaEventDestroy",
                                       "cudaEventQuery",
                                       "cudaEventRecord",
                                       "cudaEventSynchronize",
                                       "cudaFree",
                                       "cudaFreeHost",
                                       "cudaGetDevice",
                                       "cudaGetDeviceCount",
                                       "cudaGetDeviceProperties",
                                       "cudaMalloc",
                                       "cudaMallocHost",
                                       "cudaMemGetInfo",
                                       "cudaMemcpy",
                                       "cudaMemcpyAsync",
                                       "cudaMemset",
                                       "cudaMemsetAsync",
                                       "cudaSetDevice",
                                       "cudaStreamCreateWithFlags",
                                       "cudaStreamDestroy",
                                       "cudaStreamQuery",
                                       "cudaStreamSynchronize",
                                       "cudaLaunchKernel",
                                       "kernel",
                                       "cuInit",
                                       "cuDeviceGet",
                                       "cuMemGetAllocationGranularity",
                                       "cuMemCreate",
                                       "cuMemRelease",
                                       "cuMemAddressReserve",
                                       "cuMemAddressFree",
                                       "cuMemMap",
                                       "cuMemUnmap",
                                       "cuMemSetAccess",
                                       "cuMemExportToShareableHandle",
                                       "cuMemImportFromShareableHandle"};
  for (const char* known : kCalls) {
    if (call == known) return true;
  }
  return false;
}

struct Injection {
  std::string call;
  int64_t countdown;  // fails when it reaches 0
  cudaError_t error;
};

// ---- Memory ----------------------------------------------------------------------------------

enum class Kind { kDevice, kPinned };

struct Allocation {
  uint64_t id = 0;
  Kind kind = Kind::kDevice;
  int device = 0;
  uint8_t* base = nullptr;  // what the caller got
  size_t size = 0;          // what the caller asked for
  size_t granted = 0;       // size rounded up to kGranule; base + granted is a guard page
  uint8_t* map = nullptr;   // the whole mapping, guard pages included
  size_t map_bytes = 0;
  // Device memory that cuMemMap placed (vmm.cc): base == map, size == granted == map_bytes, and
  // vmm.cc owns the addresses; only cuMemSetAccess makes it accessible.
  bool mapped = false;
  bool accessible = true;
};

const char* KindName(Kind k) { return k == Kind::kDevice ? "device" : "pinned host"; }
const char* KindName(const Allocation& a) {
  return a.mapped ? "cuMemMap device" : KindName(a.kind);
}

// ---- Streams and events ----------------------------------------------------------------------

struct Op {
  std::string what;
  std::function<cudaError_t()> run;  // a copy or a kernel; its error is sticky when sticky
  std::unique_ptr<AsyncOp> async;
  bool started = false;
};

struct Stream {
  int device = 0;
  std::mutex queue_mu;
  std::deque<Op> ops;      // not yet completed, oldest first
  uint64_t enqueued = 0;   // operations ever enqueued
  uint64_t completed = 0;  // operations completed
  bool queried = false;    // a query answered NotReady since the last enqueue
  std::mutex exec_mu;      // held by the thread running ops
};

struct Event {
  std::mutex mu;
  std::shared_ptr<Stream> stream;  // of the last record; null: never recorded
  uint64_t target = 0;             // complete once stream->completed >= target
  bool queried = false;            // a query answered NotReady since the last record
};

// ---- The simulator ---------------------------------------------------------------------------

class Sim {
 public:
  static Sim& Get() {
    // Immortal: streams may still be used by threads that outlive static destruction.
    static Sim* const sim = new Sim();
    return *sim;
  }

  const Config& config() const { return config_; }

  // Every API call starts here: the sticky error, then injected failures.
  cudaError_t Enter(const char* call) {
    const cudaError_t sticky = sticky_.load(std::memory_order_acquire);
    if (sticky != cudaSuccess) return sticky;
    return Injected(call);
  }

  cudaError_t Injected(const char* call) {
    if (!any_injection_.load(std::memory_order_acquire)) return cudaSuccess;
    std::lock_guard<std::mutex> lock(inject_mu_);
    cudaError_t result = cudaSuccess;
    for (auto it = injections_.begin(); it != injections_.end();) {
      if (it->call == call && --it->countdown == 0) {
        if (result == cudaSuccess) result = it->error;
        it = injections_.erase(it);
      } else {
        ++it;
      }
    }
    any_injection_.store(!injections_.empty(), std::memory_order_release);
    if (result != cudaSuccess && config_.trace) {
      std::fprintf(stderr, "cudasim: injected %s into %s\n", FindError(result)->name, call);
    }
    return result;
  }

  void Inject(const std::string& call, int nth, cudaError_t error) {
    if (nth < 1) Die("InjectFailure(%s): nth must be at least 1, not %d", call.c_str(), nth);
    if (!KnownCall(call)) Die("InjectFailure(%s): not a call the simulator has", call.c_str());
    std::lock_guard<std::mutex> lock(inject_mu_);
    injections_.push_back(Injection{call, nth, error});
    any_injection_.store(true, std::memory_order_release);
  }

  void ResetFailures() {
    {
      std::lock_guard<std::mutex> lock(inject_mu_);
      injections_.clear();
      any_injection_.store(false, std::memory_order_release);
    }
    // Work a dead context left queued never runs, as after cudaDeviceReset.
    for (const std::shared_ptr<Stream>& s : AllStreams()) {
      std::lock_guard<std::mutex> exec(s->exec_mu);
      std::lock_guard<std::mutex> lock(s->queue_mu);
      s->ops.clear();
      s->completed = s->enqueued;
    }
    sticky_.store(cudaSuccess, std::memory_order_release);
  }

  int PendingFailures() {
    std::lock_guard<std::mutex> lock(inject_mu_);
    return static_cast<int>(injections_.size());
  }

  void SetSticky(cudaError_t e) {
    cudaError_t expected = cudaSuccess;
    sticky_.compare_exchange_strong(expected, e, std::memory_order_acq_rel);
  }
  cudaError_t sticky() const { return sticky_.load(std::memory_order_acquire); }

  void SetOrder(ThreadOrder order, uint64_t seed) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    config_.order = order;
    config_.seed = seed;
  }
  void SetImmediate(bool immediate) { immediate_.store(immediate, std::memory_order_release); }
  bool immediate() const { return immediate_.load(std::memory_order_acquire); }

  // ---- memory ----

  cudaError_t Allocate(Kind kind, int device, size_t size, void** out, std::string* why) {
    const size_t page = PageSize();
    const size_t granted = RoundUp(std::max<size_t>(size, 1), kGranule);
    const size_t body = RoundUp(granted, page);
    const size_t map_bytes = body + 2 * page;
    if (kind == Kind::kDevice && !Charge(device, granted, size, "cudaMalloc", why)) {
      return cudaErrorMemoryAllocation;
    }
    void* map =
        mmap(nullptr, map_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    uint8_t* first = static_cast<uint8_t*>(map) + page;
    if (map == MAP_FAILED || mprotect(first, body, PROT_READ | PROT_WRITE) != 0) {
      if (map != MAP_FAILED) munmap(map, map_bytes);
      if (kind == Kind::kDevice) Uncharge(device, granted);
      *why = "mmap of " + std::to_string(map_bytes) + " bytes failed: " + std::strerror(errno);
      return cudaErrorMemoryAllocation;
    }
    Allocation a;
    a.kind = kind;
    a.device = device;
    a.base = first + (body - granted);  // the end of the granule touches the upper guard page
    a.size = size;
    a.granted = granted;
    a.map = static_cast<uint8_t*>(map);
    a.map_bytes = map_bytes;
    // The slack before the base (up to a page) and after the size both hold the canary: a
    // kernel writing just before or after an allocation is caught when it ends.
    std::memset(first, kCanary, static_cast<size_t>(a.base - first));
    std::memset(a.base, kind == Kind::kDevice ? kDevicePoison : kPinnedPoison, size);
    std::memset(a.base + size, kCanary, granted - size);
    std::lock_guard<std::mutex> lock(registry_mu_);
    a.id = ++next_allocation_;
    live_[reinterpret_cast<uintptr_t>(a.base)] = a;
    *out = a.base;
    return cudaSuccess;
  }

  // Counts `bytes` (`asked` as the caller put it) against `device`; false, with *why naming
  // `call`, when they do not fit.
  bool Charge(int device, size_t bytes, size_t asked, const char* call, std::string* why) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    if (device_used_[device] + bytes > config_.memory) {
      *why = std::string(call) + " of " + std::to_string(asked) +
             " bytes: " + std::to_string(config_.memory - device_used_[device]) + " of " +
             std::to_string(config_.memory) + " bytes free on simulated device " +
             std::to_string(device);
      return false;
    }
    device_used_[device] += bytes;
    return true;
  }
  void Uncharge(int device, size_t bytes) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    device_used_[device] -= bytes;
  }

  // ---- memory that cuMemMap placed (sim_internal.h) ----

  void RegisterMapped(void* base, size_t size, int device) {
    Allocation a;
    a.kind = Kind::kDevice;
    a.device = device;
    a.base = static_cast<uint8_t*>(base);
    a.size = size;
    a.granted = size;
    a.map = a.base;
    a.map_bytes = size;
    a.mapped = true;
    a.accessible = false;
    std::lock_guard<std::mutex> lock(registry_mu_);
    a.id = ++next_allocation_;
    live_[reinterpret_cast<uintptr_t>(base)] = a;
  }

  void SetMappedAccess(void* base, bool accessible) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    auto it = live_.find(reinterpret_cast<uintptr_t>(base));
    if (it == live_.end() || !it->second.mapped) Die("SetMappedAccess(%p): not a mapping", base);
    it->second.accessible = accessible;
  }

  void UnregisterMapped(void* base) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    auto it = live_.find(reinterpret_cast<uintptr_t>(base));
    if (it == live_.end() || !it->second.mapped) Die("UnregisterMapped(%p): not a mapping", base);
    Quarantine(it->second);
    live_.erase(it);
  }

  void ForgetUnmapped(void* base, size_t size) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(base);
    std::lock_guard<std::mutex> lock(registry_mu_);
    auto it = freed_.lower_bound(first);
    while (it != freed_.end() && it->first < first + size) {
      if (!it->second.mapped) Die("ForgetUnmapped(%p): freed cudaMalloc memory inside", base);
      freed_order_.erase(std::find(freed_order_.begin(), freed_order_.end(), it->first));
      it = freed_.erase(it);
    }
  }

  // Frees the allocation starting at p. `kind` is what the call frees (cudaFree: device). The
  // range moves from the live table to the quarantine in one step, and its memory is replaced by
  // an inaccessible mapping, so a late access faults and is named.
  cudaError_t Free(Kind kind, void* p, std::string* why) {
    if (p == nullptr) return cudaSuccess;
    Allocation a;
    {
      std::lock_guard<std::mutex> lock(registry_mu_);
      auto it = live_.find(reinterpret_cast<uintptr_t>(p));
      if (it == live_.end() || it->second.kind != kind || it->second.mapped) {
        *why = std::string(kind == Kind::kDevice ? "cudaFree" : "cudaFreeHost") + "(" +
               Describe(p) + "): not the start of a live " + KindName(kind) + " allocation" +
               (it != live_.end() && it->second.mapped ? " (cuMemUnmap unmaps it)" : "");
        return kind == Kind::kDevice ? cudaErrorInvalidDevicePointer : cudaErrorInvalidValue;
      }
      a = it->second;
      CheckCanary(a, "it was freed");
      live_.erase(it);
      if (kind == Kind::kDevice) device_used_[a.device] -= a.granted;
      if (mmap(a.map, a.map_bytes, PROT_NONE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED) {
        Die("remapping freed allocation #%" PRIu64 " without access failed: %s", a.id,
            std::strerror(errno));
      }
      Quarantine(a);
    }
    return cudaSuccess;
  }

  // Remembers a freed or unmapped allocation whose range is already inaccessible; the oldest
  // one leaves the quarantine (and cudaMalloc's gives its addresses back; cuMemMap's belong to
  // their reservation). REQUIRES: registry_mu_ held.
  void Quarantine(const Allocation& a) {
    freed_[reinterpret_cast<uintptr_t>(a.base)] = a;
    freed_order_.push_back(reinterpret_cast<uintptr_t>(a.base));
    if (freed_order_.size() > kQuarantineCount) {
      auto old = freed_.find(freed_order_.front());
      freed_order_.pop_front();
      if (!old->second.mapped) munmap(old->second.map, old->second.map_bytes);
      freed_.erase(old);
    }
  }

  std::string DescribeLocked(const void* p) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    return Describe(p);
  }

  // What p is, for messages. REQUIRES: registry_mu_ held.
  std::string Describe(const void* p) const {
    char text[256];
    const Allocation* a = Containing(live_, p);
    const char* state = "live";
    if (a == nullptr) {
      a = Containing(freed_, p);
      state = a != nullptr && a->mapped ? "unmapped" : "freed";
    }
    if (a == nullptr) {
      std::snprintf(text, sizeof(text), "%p (host memory not allocated through CUDA)", p);
    } else {
      std::snprintf(text, sizeof(text),
                    "%p (offset %td of %s %s allocation #%" PRIu64 " of %zu bytes)", p,
                    static_cast<const uint8_t*>(p) - a->base, state, KindName(*a), a->id, a->size);
    }
    return text;
  }

  // The allocation of `table` whose mapping (guard pages included) holds p.
  static const Allocation* Containing(const std::map<uintptr_t, Allocation>& table, const void* p) {
    const uintptr_t x = reinterpret_cast<uintptr_t>(p);
    // A base lies at most two pages (less 256 bytes) into its mapping: the lower guard page,
    // then the slack that puts the end of the granule against the upper one.
    auto it = table.upper_bound(x + 2 * PageSize());
    while (it != table.begin()) {
      --it;
      const Allocation& a = it->second;
      const uintptr_t map = reinterpret_cast<uintptr_t>(a.map);
      if (x >= map && x < map + a.map_bytes) return &a;
      if (map + a.map_bytes <= x) break;
    }
    return nullptr;
  }

  enum class Where { kDevice, kPinned, kPageable };

  // Classifies [p, p + n) for a copy; false (with *why) when it is in freed memory, a guard page,
  // or straddles the end of an allocation.
  bool Classify(const void* p, size_t n, Where* where, std::string* why) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    if (const Allocation* a = Containing(live_, p)) {
      const uint8_t* b = static_cast<const uint8_t*>(p);
      if (b < a->base || b + n > a->base + a->size) {
        *why = Describe(p) + " + " + std::to_string(n) + " bytes is outside the allocation";
        return false;
      }
      if (!a->accessible) {
        *why = Describe(p) + " is mapped without access (cuMemSetAccess grants it)";
        return false;
      }
      *where = a->kind == Kind::kDevice ? Where::kDevice : Where::kPinned;
      return true;
    }
    if (Containing(freed_, p) != nullptr) {
      *why = "use after free: " + Describe(p);
      return false;
    }
    *where = Where::kPageable;
    return true;
  }

  bool CheckDevice(const void* p, size_t n, const char* what, std::string* why) {
    Where where;
    if (!Classify(p, n, &where, why)) {
      *why = std::string(what) + ": " + *why;
      return false;
    }
    if (where != Where::kDevice) {
      std::lock_guard<std::mutex> lock(registry_mu_);
      *why = std::string(what) + ": " + Describe(p) + " is not device memory";
      return false;
    }
    return true;
  }

  // Reports a write into the slack of an allocation (past its size, before the guard page).
  void CheckCanary(const Allocation& a, const char* when) {
    const uint8_t* first = a.map + PageSize();
    for (const uint8_t* q = first; q < a.base; ++q) {
      if (*q != kCanary) {
        Die("%s allocation #%" PRIu64
            " of %zu bytes at %p was written %td bytes before its "
            "start (found when %s): an out-of-bounds write",
            KindName(a.kind), a.id, a.size, static_cast<void*>(a.base), a.base - q, when);
      }
    }
    for (size_t i = a.size; i < a.granted; ++i) {
      if (a.base[i] != kCanary) {
        Die("%s allocation #%" PRIu64
            " of %zu bytes at %p was written %zu bytes past its end "
            "(found when %s): an out-of-bounds write",
            KindName(a.kind), a.id, a.size, static_cast<void*>(a.base), i - a.size + 1, when);
      }
    }
  }

  // Under the registry lock: Free remaps an allocation without access under it, so one that
  // another thread frees meanwhile is either checked whole or not at all (found by
  // cache_transfer_test_cuda's concurrent exports under ASan).
  void CheckAllCanaries(const char* when) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    for (const auto& entry : live_) CheckCanary(entry.second, when);
  }

  // Fault reports: what a faulting address was (no locks: the process is going down).
  void DescribeFault(const void* p, char* out, size_t n) const {
    const Allocation* a = Containing(live_, p);
    bool freed = false;
    if (a == nullptr) {
      a = Containing(freed_, p);
      freed = true;
    }
    if (a == nullptr) {
      std::snprintf(out, n, "%p is no CUDA allocation's", p);
      return;
    }
    const uint8_t* b = static_cast<const uint8_t*>(p);
    if (freed) {
      std::snprintf(out, n, "%p: use after free of %s allocation #%" PRIu64 " (%zu bytes at %p)", p,
                    KindName(*a), a->id, a->size, static_cast<void*>(a->base));
    } else if (!a->accessible) {
      std::snprintf(out, n,
                    "%p: offset %td of %s allocation #%" PRIu64
                    " (%zu bytes at %p), mapped without access",
                    p, b - a->base, KindName(*a), a->id, a->size, static_cast<void*>(a->base));
    } else if (b < a->base) {
      std::snprintf(out, n, "%p: %td bytes before %s allocation #%" PRIu64 " (%zu bytes at %p)", p,
                    a->base - b, KindName(a->kind), a->id, a->size, static_cast<void*>(a->base));
    } else {
      std::snprintf(out, n,
                    "%p: %td bytes past the end of %s allocation #%" PRIu64 " (%zu bytes at %p)", p,
                    b - (a->base + a->size) + 1, KindName(a->kind), a->id, a->size,
                    static_cast<void*>(a->base));
    }
  }

  uint64_t LiveCount(Kind kind, uint64_t* bytes) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    uint64_t n = 0;
    for (const auto& entry : live_) {
      if (entry.second.kind != kind || entry.second.mapped) continue;
      ++n;
      if (bytes != nullptr) *bytes += entry.second.size;
    }
    return n;
  }

  size_t DeviceUsed(int device) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    return device_used_[device];
  }

  // ---- streams ----

  std::shared_ptr<Stream> NewStream(int device) {
    auto s = std::make_shared<Stream>();
    s->device = device;
    std::lock_guard<std::mutex> lock(registry_mu_);
    streams_[s.get()] = s;
    return s;
  }

  // The stream behind a handle: the legacy stream of the current device for null.
  std::shared_ptr<Stream> FindStream(cudaStream_t handle, int device) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    if (handle == nullptr) {
      auto& legacy = legacy_[device];
      if (legacy == nullptr) {
        legacy = std::make_shared<Stream>();
        legacy->device = device;
      }
      return legacy;
    }
    auto it = streams_.find(reinterpret_cast<void*>(handle));
    return it == streams_.end() ? nullptr : it->second;
  }

  // Retires a stream: its handle is gone at once, but work still queued on it completes later
  // (the next device-wide synchronization runs it), as cudaStreamDestroy promises.
  std::shared_ptr<Stream> RemoveStream(cudaStream_t handle) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    auto it = streams_.find(reinterpret_cast<void*>(handle));
    if (it == streams_.end()) return nullptr;
    std::shared_ptr<Stream> s = std::move(it->second);
    streams_.erase(it);
    retired_.push_back(s);
    return s;
  }

  // Live, legacy and retired streams; retired ones whose work is done are forgotten here.
  std::vector<std::shared_ptr<Stream>> AllStreams() {
    std::lock_guard<std::mutex> lock(registry_mu_);
    std::vector<std::shared_ptr<Stream>> all;
    for (auto& entry : streams_) all.push_back(entry.second);
    for (auto it = retired_.begin(); it != retired_.end();) {
      bool done;
      {
        std::lock_guard<std::mutex> queue((*it)->queue_mu);
        done = (*it)->completed == (*it)->enqueued;
      }
      if (done) {
        it = retired_.erase(it);
      } else {
        all.push_back(*it);
        ++it;
      }
    }
    for (auto& entry : legacy_) {
      if (entry.second != nullptr) all.push_back(entry.second);
    }
    return all;
  }

  std::shared_ptr<Event> NewEvent() {
    auto e = std::make_shared<Event>();
    std::lock_guard<std::mutex> lock(registry_mu_);
    events_[e.get()] = e;
    return e;
  }
  std::shared_ptr<Event> FindEvent(cudaEvent_t handle) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    auto it = events_.find(reinterpret_cast<void*>(handle));
    return it == events_.end() ? nullptr : it->second;
  }
  bool RemoveEvent(cudaEvent_t handle) {
    std::lock_guard<std::mutex> lock(registry_mu_);
    return events_.erase(reinterpret_cast<void*>(handle)) == 1;
  }

  // Appends an operation; in immediate mode runs the stream at once (without blocking).
  void Push(const std::shared_ptr<Stream>& s, Op op) {
    {
      std::lock_guard<std::mutex> lock(s->queue_mu);
      s->ops.push_back(std::move(op));
      ++s->enqueued;
      s->queried = false;
    }
    if (immediate()) (void)Run(*s, UINT64_MAX, /*blocking=*/false);
  }

  // Runs the stream's operations until `upto` of them have completed (UINT64_MAX: all enqueued
  // now). Without `blocking`, stops at an asynchronous operation that is not done, and does not
  // wait for another thread that is running the stream: cudaErrorNotReady then.
  cudaError_t Run(Stream& s, uint64_t upto, bool blocking) {
    {
      std::lock_guard<std::mutex> lock(s.queue_mu);
      if (upto == UINT64_MAX) upto = s.enqueued;
      if (s.completed >= upto) return sticky();
    }
    std::unique_lock<std::mutex> exec(s.exec_mu, std::defer_lock);
    if (blocking) {
      exec.lock();
    } else if (!exec.try_lock()) {
      return cudaErrorNotReady;
    }
    while (true) {
      Op* op;
      {
        std::lock_guard<std::mutex> lock(s.queue_mu);
        if (s.completed >= upto) break;
        op = &s.ops.front();  // deque references survive push_back
      }
      if (sticky() != cudaSuccess) {
        // A dead context runs nothing more; waiting for it reports the error.
        return sticky();
      }
      if (op->async != nullptr) {
        if (!op->started) {
          op->started = true;
          op->async->Start();
        }
        if (!op->async->Poll(blocking)) return cudaErrorNotReady;
      } else {
        const cudaError_t e = op->run();
        if (e != cudaSuccess) {
          if (config_.trace) {
            std::fprintf(stderr, "cudasim: %s failed as it ran: %s\n", op->what.c_str(),
                         FindError(e) != nullptr ? FindError(e)->name : "error");
          }
          if (IsSticky(e)) SetSticky(e);
          std::lock_guard<std::mutex> lock(s.queue_mu);
          s.ops.pop_front();
          ++s.completed;
          return e;
        }
      }
      std::lock_guard<std::mutex> lock(s.queue_mu);
      s.ops.pop_front();
      ++s.completed;
    }
    return sticky();
  }

  // Runs every stream to its end (cudaDeviceSynchronize, and the implicit one of cudaFree).
  cudaError_t RunAll() {
    cudaError_t result = cudaSuccess;
    for (const std::shared_ptr<Stream>& s : AllStreams()) {
      const cudaError_t e = Run(*s, UINT64_MAX, /*blocking=*/true);
      if (result == cudaSuccess) result = e;
    }
    return result;
  }

  uint64_t NextLaunch() { return launches_.fetch_add(1, std::memory_order_relaxed); }
  void CountKernel() { kernels_run_.fetch_add(1, std::memory_order_relaxed); }
  void CountMisuse() { misuses_.fetch_add(1, std::memory_order_relaxed); }
  void CountNotReady() { not_ready_.fetch_add(1, std::memory_order_relaxed); }
  Stats stats() {
    Stats st;
    st.device_allocations = LiveCount(Kind::kDevice, &st.device_bytes);
    st.pinned_allocations = LiveCount(Kind::kPinned, nullptr);
    st.kernels_run = kernels_run_.load();
    st.misuses = misuses_.load();
    st.not_ready_answers = not_ready_.load();
    return st;
  }

  std::pair<ThreadOrder, uint64_t> order() {
    std::lock_guard<std::mutex> lock(registry_mu_);
    return {config_.order, config_.seed};
  }

 private:
  Sim();
  void InstallFaultHandler();

  Config config_;
  std::atomic<bool> immediate_{false};
  std::atomic<cudaError_t> sticky_{cudaSuccess};

  std::mutex inject_mu_;
  std::vector<Injection> injections_;
  std::atomic<bool> any_injection_{false};

  std::mutex registry_mu_;
  std::map<uintptr_t, Allocation> live_;
  std::map<uintptr_t, Allocation> freed_;
  std::deque<uintptr_t> freed_order_;
  std::map<int, size_t> device_used_;
  uint64_t next_allocation_ = 0;
  std::unordered_map<void*, std::shared_ptr<Stream>> streams_;
  std::map<int, std::shared_ptr<Stream>> legacy_;
  std::vector<std::shared_ptr<Stream>> retired_;  // destroyed with work still queued
  std::unordered_map<void*, std::shared_ptr<Event>> events_;

  std::atomic<uint64_t> launches_{0};
  std::atomic<uint64_t> kernels_run_{0};
  std::atomic<uint64_t> misuses_{0};
  std::atomic<uint64_t> not_ready_{0};
};

// ---- Fault handler: names the allocation a wild kernel or copy touched -----------------------
// ASan reports the fault itself, with the faulting line; elsewhere this says what was hit.
#if !defined(KVMESH_CUDASIM_ASAN)
struct sigaction previous_segv;

void OnSegv(int sig, siginfo_t* info, void* context) {
  char what[320];
  Sim::Get().DescribeFault(info->si_addr, what, sizeof(what));
  char line[512];
  const int n = std::snprintf(line, sizeof(line),
                              "cudasim: segmentation fault at %s (a guard page or freed memory: "
                              "an out-of-bounds or use-after-free access)\n",
                              what);
  if (n > 0) (void)!write(STDERR_FILENO, line, static_cast<size_t>(n));
  void* frames[64];
  const int depth = backtrace(frames, 64);
  backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  sigaction(SIGSEGV, &previous_segv, nullptr);  // the access faults again and ends the process
  (void)sig;
  (void)context;
}

#endif

void Sim::InstallFaultHandler() {
#if !defined(KVMESH_CUDASIM_ASAN)
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_sigaction = OnSegv;
  action.sa_flags = SA_SIGINFO;
  // backtrace() loads libgcc on its first call, which must not happen inside the handler.
  void* frame;
  (void)backtrace(&frame, 1);
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &previous_segv);
#endif
}

Sim::Sim() {
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v == nullptr ? std::string() : std::string(v);
  };
  const std::string exec = env("KVMESH_CUDASIM_EXEC");
  if (exec == "immediate") {
    config_.immediate = true;
  } else if (!exec.empty() && exec != "deferred") {
    Die("KVMESH_CUDASIM_EXEC=%s: expected deferred or immediate", exec.c_str());
  }
  immediate_.store(config_.immediate);
  const std::string order = env("KVMESH_CUDASIM_ORDER");
  if (order.empty() || order == "forward") {
    config_.order = ThreadOrder::kForward;
  } else if (order == "reverse") {
    config_.order = ThreadOrder::kReverse;
  } else if (order.rfind("shuffle", 0) == 0) {
    config_.order = ThreadOrder::kShuffle;
    if (order.size() > 7) {
      if (order[7] != ':') Die("KVMESH_CUDASIM_ORDER=%s: expected shuffle[:SEED]", order.c_str());
      config_.seed = std::strtoull(order.c_str() + 8, nullptr, 10);
    }
  } else {
    Die("KVMESH_CUDASIM_ORDER=%s: expected forward, reverse or shuffle[:SEED]", order.c_str());
  }
  const std::string devices = env("KVMESH_CUDASIM_DEVICES");
  if (!devices.empty()) {
    char* end = nullptr;
    const long n = std::strtol(devices.c_str(), &end, 10);
    if (*end != '\0' || n < 0 || n > 16) {
      Die("KVMESH_CUDASIM_DEVICES=%s: expected 0 to 16", devices.c_str());
    }
    config_.devices = static_cast<int>(n);
  }
  const std::string memory = env("KVMESH_CUDASIM_MEMORY");
  if (!memory.empty() && !ParseBytes(memory, &config_.memory)) {
    Die("KVMESH_CUDASIM_MEMORY=%s: expected bytes, optionally with KiB, MiB or GiB",
        memory.c_str());
  }
  config_.trace = env("KVMESH_CUDASIM_TRACE") == "1";
  const std::string fail = env("KVMESH_CUDASIM_FAIL");
  size_t at = 0;
  while (at < fail.size()) {
    size_t end = fail.find(',', at);
    if (end == std::string::npos) end = fail.size();
    const std::string item = fail.substr(at, end - at);
    const size_t c1 = item.find(':');
    const size_t c2 = c1 == std::string::npos ? c1 : item.find(':', c1 + 1);
    if (c2 == std::string::npos) {
      Die("KVMESH_CUDASIM_FAIL: %s is not CALL:N:ERROR", item.c_str());
    }
    const int nth = std::atoi(item.substr(c1 + 1, c2 - c1 - 1).c_str());
    if (nth < 1) Die("KVMESH_CUDASIM_FAIL: %s: N must be at least 1", item.c_str());
    const std::string call = item.substr(0, c1);
    if (!KnownCall(call))
      Die("KVMESH_CUDASIM_FAIL: %s is not a call the simulator has", call.c_str());
    injections_.push_back(Injection{call, nth, ParseError(item.substr(c2 + 1))});
    at = end + 1;
  }
  any_injection_.store(!injections_.empty());
  InstallFaultHandler();
}

// ---- Per-thread state ------------------------------------------------------------------------

thread_local cudaError_t last_error = cudaSuccess;
// A reset (ResetFailures) forgets the last error of every thread: one recorded before the reset
// epoch it carries is stale.
std::atomic<uint64_t> reset_epoch{0};
thread_local uint64_t last_error_epoch = 0;
thread_local std::string last_message;
thread_local int current_device = 0;

// Records a failed call: the thread's last error, and why (printed when it is a misuse or when
// tracing). Returns `e`.
cudaError_t Fail(cudaError_t e, const std::string& why, bool misuse) {
  if (e == cudaSuccess || e == cudaErrorNotReady) return e;
  last_error = e;
  last_error_epoch = reset_epoch.load(std::memory_order_acquire);
  internal::ReportFailure(FindError(e) ? FindError(e)->name : "error", why, misuse);
  return e;
}

// Records and prints a misuse that is not the result of a CUDA call.
void Report(const std::string& why) {
  last_message = why;
  Sim::Get().CountMisuse();
  std::fprintf(stderr, "cudasim: %s\n", why.c_str());
}

#define SIM_ENTER(call)                                      \
  do {                                                       \
    const cudaError_t sim_entered_ = Sim::Get().Enter(call); \
    if (sim_entered_ != cudaSuccess) {                       \
      return Fail(sim_entered_,                              \
                  std::string(call) +                        \
                      " failed (injected or "                \
                      "after an earlier device fault)",      \
                  false);                                    \
    }                                                        \
  } while (0)

bool ValidDevice(int device) { return device >= 0 && device < Sim::Get().config().devices; }

cudaError_t NoDevice(const char* call) {
  return Fail(cudaErrorNoDevice,
              std::string(call) + ": no simulated device (KVMESH_CUDASIM_DEVICES=0)", false);
}

// Enqueues a copy after checking both ranges against `kind`.
cudaError_t Copy(const char* call, void* dst, const void* src, size_t n, cudaMemcpyKind kind,
                 cudaStream_t handle, bool synchronous) {
  Sim& sim = Sim::Get();
  std::shared_ptr<Stream> s = sim.FindStream(handle, current_device);
  if (s == nullptr) {
    return Fail(cudaErrorInvalidResourceHandle, std::string(call) + ": unknown stream", true);
  }
  if (n == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) {
    return Fail(cudaErrorInvalidValue, std::string(call) + ": null pointer", true);
  }
  Sim::Where to, from;
  std::string why;
  if (!sim.Classify(dst, n, &to, &why)) {
    return Fail(cudaErrorInvalidValue, std::string(call) + ": destination " + why, true);
  }
  if (!sim.Classify(src, n, &from, &why)) {
    return Fail(cudaErrorInvalidValue, std::string(call) + ": source " + why, true);
  }
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), r = reinterpret_cast<uintptr_t>(src);
  if (d < r + n && r < d + n) {
    return Fail(cudaErrorInvalidValue,
                std::string(call) + ": source and destination of " + std::to_string(n) +
                    " bytes overlap (undefined on a GPU)",
                true);
  }
  const bool to_device = to == Sim::Where::kDevice, from_device = from == Sim::Where::kDevice;
  bool ok = true;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      ok = to_device && !from_device;
      break;
    case cudaMemcpyDeviceToHost:
      ok = !to_device && from_device;
      break;
    case cudaMemcpyDeviceToDevice:
      ok = to_device && from_device;
      break;
    case cudaMemcpyHostToHost:
      ok = !to_device && !from_device;
      break;
    case cudaMemcpyDefault:
      break;
    default:
      return Fail(cudaErrorInvalidMemcpyDirection,
                  std::string(call) + ": kind " + std::to_string(int(kind)), true);
  }
  if (!ok) {
    static const char* const kKinds[] = {"HostToHost", "HostToDevice", "DeviceToHost",
                                         "DeviceToDevice", "Default"};
    return Fail(cudaErrorInvalidValue,
                std::string(call) + ": cudaMemcpy" + kKinds[kind] + " from " +
                    (from_device ? "device" : "host") + " memory to " +
                    (to_device ? "device" : "host") + " memory (" + std::to_string(n) + " bytes)",
                true);
  }
  // Pageable host memory: a real GPU stages the source at once (so the caller may reuse it when
  // the call returns) and finishes copies into pageable memory before returning.
  const bool pageable_src = from == Sim::Where::kPageable;
  const bool pageable_dst = to == Sim::Where::kPageable;
  Op op;
  op.what = call;
  if (pageable_src) {
    auto staged = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(src),
                                                         static_cast<const uint8_t*>(src) + n);
    op.run = [dst, staged]() {
      std::memcpy(dst, staged->data(), staged->size());
      return cudaSuccess;
    };
  } else {
    op.run = [dst, src, n]() {
      std::memcpy(dst, src, n);
      return cudaSuccess;
    };
  }
  sim.Push(s, std::move(op));
  if (synchronous || pageable_dst) {
    const cudaError_t e = sim.Run(*s, UINT64_MAX, /*blocking=*/true);
    if (e != cudaSuccess) return Fail(e, std::string(call) + ": stream failed", false);
  }
  return cudaSuccess;
}

cudaError_t Memset(const char* call, void* p, int value, size_t n, cudaStream_t handle,
                   bool synchronous) {
  Sim& sim = Sim::Get();
  std::shared_ptr<Stream> s = sim.FindStream(handle, current_device);
  if (s == nullptr) {
    return Fail(cudaErrorInvalidResourceHandle, std::string(call) + ": unknown stream", true);
  }
  if (n == 0) return cudaSuccess;
  std::string why;
  if (!sim.CheckDevice(p, n, call, &why)) return Fail(cudaErrorInvalidValue, why, true);
  Op op;
  op.what = call;
  op.run = [p, value, n]() {
    std::memset(p, value, n);
    return cudaSuccess;
  };
  sim.Push(s, std::move(op));
  if (synchronous) {
    const cudaError_t e = sim.Run(*s, UINT64_MAX, /*blocking=*/true);
    if (e != cudaSuccess) return Fail(e, std::string(call) + ": stream failed", false);
  }
  return cudaSuccess;
}

// cudaFree and cudaFreeHost: both synchronize the device first, as on a GPU. After a device
// fault (a dead context) the memory is still released, as a context's memory is when it goes,
// and the call returns the fault.
cudaError_t FreeCall(const char* call, Kind kind, void* ptr) {
  Sim& sim = Sim::Get();
  const cudaError_t dead = sim.sticky();
  if (dead == cudaSuccess) {
    if (const cudaError_t e = sim.Injected(call); e != cudaSuccess) {
      return Fail(e, std::string(call) + " failed (injected)", false);
    }
  }
  if (ptr == nullptr) return dead == cudaSuccess ? cudaSuccess : Fail(dead, call, false);
  const cudaError_t drained = dead == cudaSuccess ? sim.RunAll() : dead;
  std::string why;
  const cudaError_t e = sim.Free(kind, ptr, &why);
  if (e != cudaSuccess) return Fail(e, why, true);
  return drained == cudaSuccess ? cudaSuccess
                                : Fail(drained, std::string(call) + ": the device failed", false);
}

cudaError_t AllocateCall(const char* call, Kind kind, void** ptr, size_t size) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue, std::string(call) + ": null", true);
  if (Sim::Get().config().devices == 0) return NoDevice(call);
  std::string why;
  const cudaError_t e = Sim::Get().Allocate(kind, current_device, size, ptr, &why);
  return e == cudaSuccess ? e : Fail(e, why, false);
}

}  // namespace

// ---- cuda_sim.h ------------------------------------------------------------------------------

void SetThreadOrder(ThreadOrder order, uint64_t seed) { Sim::Get().SetOrder(order, seed); }
void SetImmediateExecution(bool immediate) { Sim::Get().SetImmediate(immediate); }
void InjectFailure(const std::string& call, int nth, cudaError_t error) {
  Sim::Get().Inject(call, nth, error);
}
void ResetFailures() {
  Sim::Get().ResetFailures();
  reset_epoch.fetch_add(1, std::memory_order_acq_rel);
}
int PendingFailures() { return Sim::Get().PendingFailures(); }
std::string LastMessage() { return last_message; }
Stats GetStats() {
  Stats stats = Sim::Get().stats();
  internal::AddDriverStats(&stats);
  return stats;
}
bool Active() { return true; }

cudaError_t Enqueue(cudaStream_t stream, std::unique_ptr<AsyncOp> op, const char* what) {
  Sim& sim = Sim::Get();
  std::shared_ptr<Stream> s = sim.FindStream(stream, current_device);
  if (s == nullptr) {
    return Fail(cudaErrorInvalidResourceHandle, std::string(what) + ": unknown stream", true);
  }
  Op entry;
  entry.what = what;
  entry.async = std::move(op);
  sim.Push(s, std::move(entry));
  return cudaSuccess;
}

bool CheckDeviceRange(const void* p, size_t bytes, const char* what) {
  std::string why;
  if (Sim::Get().CheckDevice(p, bytes == 0 ? 1 : bytes, what, &why)) return true;
  // Not a CUDA call: reported, but not left behind as this thread's last error.
  Report(why);
  return false;
}

namespace internal {

// ---- sim_internal.h ----

cudaError_t EnterCall(const char* call) { return Sim::Get().Enter(call); }
cudaError_t InjectedFailure(const char* call) { return Sim::Get().Injected(call); }
cudaError_t StickyError() { return Sim::Get().sticky(); }

void ReportFailure(const char* error_name, const std::string& why, bool misuse) {
  last_message = why;
  if (misuse) Sim::Get().CountMisuse();
  if (misuse || Sim::Get().config().trace) {
    std::fprintf(stderr, "cudasim: %s: %s\n", error_name, why.c_str());
  }
}

int DeviceCount() { return Sim::Get().config().devices; }
cudaError_t SynchronizeAll() { return Sim::Get().RunAll(); }

bool ChargeDevice(int device, size_t bytes, const char* call, std::string* why) {
  return Sim::Get().Charge(device, bytes, bytes, call, why);
}
void UnchargeDevice(int device, size_t bytes) { Sim::Get().Uncharge(device, bytes); }
void RegisterMapped(void* base, size_t size, int device) {
  Sim::Get().RegisterMapped(base, size, device);
}
void SetMappedAccess(void* base, bool accessible) { Sim::Get().SetMappedAccess(base, accessible); }
void UnregisterMapped(void* base) { Sim::Get().UnregisterMapped(base); }
void ForgetUnmapped(void* base, size_t size) { Sim::Get().ForgetUnmapped(base, size); }

// ---- kernels ----

void LaunchKernel(const char* name, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                  const void* const* pointers, size_t num_pointers,
                  std::function<void(const LaunchOrder&)> run) {
  Sim& sim = Sim::Get();
  const std::string call = std::string("launch of ") + name;
  if (const cudaError_t e = sim.Enter("cudaLaunchKernel"); e != cudaSuccess) {
    // Injected launch failure (or a dead context): reported through cudaGetLastError.
    Fail(e, call + " failed (injected or after an earlier device fault)", false);
    return;
  }
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64 || blocks == 0 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535 ||
      shared_bytes > kMaxSharedPerBlock) {
    char text[200];
    std::snprintf(text, sizeof(text),
                  ": grid (%u, %u, %u), block (%u, %u, %u), %zu bytes of "
                  "shared memory",
                  grid.x, grid.y, grid.z, block.x, block.y, block.z, shared_bytes);
    Fail(cudaErrorInvalidConfiguration, call + text, true);
    return;
  }
  std::shared_ptr<Stream> s = sim.FindStream(stream, current_device);
  if (s == nullptr) {
    Fail(cudaErrorInvalidResourceHandle, call + ": unknown stream", true);
    return;
  }
  if (s->device != current_device) {
    Fail(cudaErrorInvalidResourceHandle,
         call + ": the stream belongs to device " + std::to_string(s->device) +
             ", the current device is " + std::to_string(current_device),
         true);
    return;
  }
  // A pointer argument a kernel could not dereference (host memory that is not pinned, freed
  // memory) makes it fault when it runs, as on a GPU: a sticky cudaErrorIllegalAddress.
  std::string bad_pointer;
  for (size_t i = 0; i < num_pointers && bad_pointer.empty(); ++i) {
    if (pointers[i] == nullptr) continue;
    Sim::Where where;
    std::string why;
    if (!sim.Classify(pointers[i], 1, &where, &why)) {
      bad_pointer = call + ", pointer argument " + std::to_string(i) + ": " + why;
    } else if (where == Sim::Where::kPageable) {
      bad_pointer = call + ", pointer argument " + std::to_string(i) + ": " +
                    sim.DescribeLocked(pointers[i]) + " is not device or pinned memory";
    }
  }
  if (!bad_pointer.empty()) Report(bad_pointer + " (the kernel will fault)");
  const auto [order, seed] = sim.order();
  const uint64_t launch = sim.NextLaunch();
  const int device = current_device;
  Op op;
  op.what = call;
  op.run = [name = std::string(name), grid, block, threads, blocks, order = order,
            seed = seed + launch, device, bad_pointer, run = std::move(run)]() -> cudaError_t {
    Sim& sim = Sim::Get();
    if (!bad_pointer.empty()) {
      sim.SetSticky(cudaErrorIllegalAddress);
      return cudaErrorIllegalAddress;
    }
    const cudaError_t injected = sim.Injected("kernel");
    if (injected != cudaSuccess) {
      // Surfaces through the call that waits for the stream, not cudaGetLastError.
      if (sim.config().trace) {
        std::fprintf(stderr, "cudasim: kernel %s fails as it runs (injected %s)\n", name.c_str(),
                     cudaGetErrorName(injected));
      }
      // Any fault of a running kernel kills the context on a GPU.
      sim.SetSticky(injected);
      return injected;
    }
    const uint64_t total = threads * blocks;
    std::vector<uint64_t> sequence;
    if (order == ThreadOrder::kShuffle) {
      // Warps in a random order across the whole grid, and the lanes of each warp in a random
      // order of their own: every thread still runs at a random point relative to every thread
      // of another warp and of its own, while a warp's neighbouring bytes stay close in time
      // (a full shuffle costs twice the time for no other order it could find).
      std::mt19937_64 rng(seed);
      const uint64_t warp = 32;
      std::vector<uint64_t> warps((total + warp - 1) / warp);
      std::iota(warps.begin(), warps.end(), uint64_t{0});
      std::shuffle(warps.begin(), warps.end(), rng);
      sequence.reserve(total);
      for (uint64_t w : warps) {
        const size_t first = sequence.size();
        for (uint64_t t = w * warp; t < std::min(total, (w + 1) * warp); ++t) sequence.push_back(t);
        std::shuffle(sequence.begin() + first, sequence.end(), rng);
      }
    }
    const int saved_device = current_device;
    current_device = device;
    run(LaunchOrder{order, sequence.data(), total, grid, block});
    current_device = saved_device;
    sim.CountKernel();
    sim.CheckAllCanaries(("kernel " + name + " ran").c_str());
    return cudaSuccess;
  };
  sim.Push(s, std::move(op));
}

}  // namespace internal
}  // namespace cudasim

// ---- The CUDA runtime API --------------------------------------------------------------------

using cudasim::current_device;
using cudasim::Fail;
using cudasim::Sim;

extern "C" {

const char* cudaGetErrorName(cudaError_t error) {
  const cudasim::ErrorInfo* e = cudasim::FindError(error);
  return e != nullptr ? e->name : "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  const cudasim::ErrorInfo* e = cudasim::FindError(error);
  return e != nullptr ? e->text : "unrecognized error code";
}

cudaError_t cudaGetLastError(void) {
  cudaError_t last = std::exchange(cudasim::last_error, cudaSuccess);
  if (cudasim::last_error_epoch != cudasim::reset_epoch.load(std::memory_order_acquire)) {
    last = cudaSuccess;
  }
  const cudaError_t sticky = Sim::Get().sticky();
  return sticky != cudaSuccess ? sticky : last;
}

cudaError_t cudaPeekAtLastError(void) {
  const cudaError_t sticky = Sim::Get().sticky();
  if (sticky != cudaSuccess) return sticky;
  return cudasim::last_error_epoch == cudasim::reset_epoch.load(std::memory_order_acquire)
             ? cudasim::last_error
             : cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  SIM_ENTER("cudaGetDeviceCount");
  if (count == nullptr) return Fail(cudaErrorInvalidValue, "cudaGetDeviceCount: null", true);
  *count = Sim::Get().config().devices;
  if (*count == 0) return cudasim::NoDevice("cudaGetDeviceCount");
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  SIM_ENTER("cudaSetDevice");
  if (Sim::Get().config().devices == 0) return cudasim::NoDevice("cudaSetDevice");
  if (!cudasim::ValidDevice(device)) {
    return Fail(cudaErrorInvalidDevice,
                "cudaSetDevice(" + std::to_string(device) +
                    "): " + std::to_string(Sim::Get().config().devices) + " simulated devices",
                false);
  }
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  SIM_ENTER("cudaGetDevice");
  if (device == nullptr) return Fail(cudaErrorInvalidValue, "cudaGetDevice: null", true);
  if (Sim::Get().config().devices == 0) return cudasim::NoDevice("cudaGetDevice");
  *device = current_device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  SIM_ENTER("cudaDeviceGetAttribute");
  if (value == nullptr || !cudasim::ValidDevice(device)) {
    return Fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: null value or bad device", true);
  }
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = cudasim::kSms;
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
      *value = cudasim::kThreadsPerSm;
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = cudasim::kMaxThreadsPerBlock;
      return cudaSuccess;
    case cudaDevAttrWarpSize:
      *value = 32;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      return cudaSuccess;
    default:
      return Fail(
          cudaErrorInvalidValue,
          "cudaDeviceGetAttribute: attribute " + std::to_string(int(attr)) + " is not simulated",
          true);
  }
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  SIM_ENTER("cudaGetDeviceProperties");
  if (prop == nullptr || !cudasim::ValidDevice(device)) {
    return Fail(cudaErrorInvalidDevice, "cudaGetDeviceProperties: bad device", false);
  }
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "kvmesh cudasim (simulated GPU on the CPU)");
  prop->totalGlobalMem = Sim::Get().config().memory;
  prop->multiProcessorCount = cudasim::kSms;
  prop->maxThreadsPerMultiProcessor = cudasim::kThreadsPerSm;
  prop->maxThreadsPerBlock = cudasim::kMaxThreadsPerBlock;
  prop->warpSize = 32;
  prop->major = 9;
  prop->minor = 0;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  if (version == nullptr) return Fail(cudaErrorInvalidValue, "cudaDriverGetVersion: null", true);
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  if (version == nullptr) return Fail(cudaErrorInvalidValue, "cudaRuntimeGetVersion: null", true);
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  SIM_ENTER("cudaMemGetInfo");
  if (free_bytes == nullptr || total_bytes == nullptr) {
    return Fail(cudaErrorInvalidValue, "cudaMemGetInfo: null", true);
  }
  *total_bytes = Sim::Get().config().memory;
  *free_bytes = *total_bytes - Sim::Get().DeviceUsed(current_device);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  SIM_ENTER("cudaMalloc");
  return cudasim::AllocateCall("cudaMalloc", cudasim::Kind::kDevice, ptr, size);
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  SIM_ENTER("cudaMallocHost");
  return cudasim::AllocateCall("cudaMallocHost", cudasim::Kind::kPinned, ptr, size);
}

cudaError_t cudaFree(void* ptr) {
  return cudasim::FreeCall("cudaFree", cudasim::Kind::kDevice, ptr);
}

cudaError_t cudaFreeHost(void* ptr) {
  return cudasim::FreeCall("cudaFreeHost", cudasim::Kind::kPinned, ptr);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  SIM_ENTER("cudaMemcpy");
  return cudasim::Copy("cudaMemcpy", dst, src, count, kind, nullptr, /*synchronous=*/true);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
  SIM_ENTER("cudaMemcpyAsync");
  return cudasim::Copy("cudaMemcpyAsync", dst, src, count, kind, stream, /*synchronous=*/false);
}

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  SIM_ENTER("cudaMemset");
  return cudasim::Memset("cudaMemset", ptr, value, count, nullptr, /*synchronous=*/true);
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  SIM_ENTER("cudaMemsetAsync");
  return cudasim::Memset("cudaMemsetAsync", ptr, value, count, stream, /*synchronous=*/false);
}

cudaError_t cudaDeviceSynchronize(void) {
  SIM_ENTER("cudaDeviceSynchronize");
  const cudaError_t e = Sim::Get().RunAll();
  return e == cudaSuccess ? e : Fail(e, "cudaDeviceSynchronize: a kernel failed", false);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  SIM_ENTER("cudaStreamCreateWithFlags");
  if (stream == nullptr || (flags & ~cudaStreamNonBlocking) != 0) {
    return Fail(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: null or unknown flags", true);
  }
  *stream = reinterpret_cast<cudaStream_t>(Sim::Get().NewStream(current_device).get());
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  SIM_ENTER("cudaStreamDestroy");
  std::shared_ptr<cudasim::Stream> s = Sim::Get().RemoveStream(stream);
  if (s == nullptr) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: unknown stream", true);
  }
  // Returns at once, as on a GPU: what is queued runs without blocking now if it can, the rest
  // at the next device-wide synchronization.
  (void)Sim::Get().Run(*s, UINT64_MAX, /*blocking=*/false);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  SIM_ENTER("cudaStreamSynchronize");
  std::shared_ptr<cudasim::Stream> s = Sim::Get().FindStream(stream, current_device);
  if (s == nullptr) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: unknown stream", true);
  }
  const cudaError_t e = Sim::Get().Run(*s, UINT64_MAX, /*blocking=*/true);
  return e == cudaSuccess ? e : Fail(e, "cudaStreamSynchronize: the stream failed", false);
}

// The first query after new work answers NotReady without running anything; later ones run
// what they can without blocking.
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  SIM_ENTER("cudaStreamQuery");
  Sim& sim = Sim::Get();
  std::shared_ptr<cudasim::Stream> s = sim.FindStream(stream, current_device);
  if (s == nullptr) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaStreamQuery: unknown stream", true);
  }
  {
    std::lock_guard<std::mutex> lock(s->queue_mu);
    if (s->completed < s->enqueued && !s->queried) {
      s->queried = true;
      sim.CountNotReady();
      return cudaErrorNotReady;
    }
  }
  const cudaError_t e = sim.Run(*s, UINT64_MAX, /*blocking=*/false);
  if (e == cudaErrorNotReady) sim.CountNotReady();
  return e == cudaSuccess || e == cudaErrorNotReady
             ? e
             : Fail(e, "cudaStreamQuery: the stream failed", false);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  SIM_ENTER("cudaEventCreateWithFlags");
  constexpr unsigned kKnown =
      cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (event == nullptr || (flags & ~kKnown) != 0) {
    return Fail(cudaErrorInvalidValue, "cudaEventCreateWithFlags: null or unknown flags", true);
  }
  *event = reinterpret_cast<cudaEvent_t>(Sim::Get().NewEvent().get());
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  SIM_ENTER("cudaEventDestroy");
  if (!Sim::Get().RemoveEvent(event)) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy: unknown event", true);
  }
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  SIM_ENTER("cudaEventRecord");
  Sim& sim = Sim::Get();
  std::shared_ptr<cudasim::Event> e = sim.FindEvent(event);
  std::shared_ptr<cudasim::Stream> s = sim.FindStream(stream, current_device);
  if (e == nullptr || s == nullptr) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: unknown event or stream", true);
  }
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(s->queue_mu);
    target = s->enqueued;
  }
  std::lock_guard<std::mutex> lock(e->mu);
  e->stream = s;
  e->target = target;
  e->queried = false;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  SIM_ENTER("cudaEventSynchronize");
  Sim& sim = Sim::Get();
  std::shared_ptr<cudasim::Event> e = sim.FindEvent(event);
  if (e == nullptr) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: unknown event", true);
  }
  std::shared_ptr<cudasim::Stream> s;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    s = e->stream;
    target = e->target;
  }
  if (s == nullptr) return cudaSuccess;  // never recorded: complete
  const cudaError_t result = sim.Run(*s, target, /*blocking=*/true);
  return result == cudaSuccess ? result
                               : Fail(result, "cudaEventSynchronize: the stream failed", false);
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  SIM_ENTER("cudaEventQuery");
  Sim& sim = Sim::Get();
  std::shared_ptr<cudasim::Event> e = sim.FindEvent(event);
  if (e == nullptr) {
    return Fail(cudaErrorInvalidResourceHandle, "cudaEventQuery: unknown event", true);
  }
  std::shared_ptr<cudasim::Stream> s;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    s = e->stream;
    target = e->target;
    if (s != nullptr && !e->queried) {
      std::lock_guard<std::mutex> queue(s->queue_mu);
      if (s->completed < target) {
        e->queried = true;
        sim.CountNotReady();
        return cudaErrorNotReady;
      }
    }
  }
  if (s == nullptr) return cudaSuccess;
  const cudaError_t result = sim.Run(*s, target, /*blocking=*/false);
  if (result == cudaErrorNotReady) sim.CountNotReady();
  return result == cudaSuccess || result == cudaErrorNotReady
             ? result
             : Fail(result, "cudaEventQuery: the stream failed", false);
}

}  // extern "C"
