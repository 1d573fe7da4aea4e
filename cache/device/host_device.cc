#include "cache/device/host_device.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"

namespace kvmesh {

namespace {

// Arenas of at least this size are mapped directly, 2 MiB-aligned, and marked for transparent
// huge pages: a freshly allocated arena is written once in full (a group's cells, a snapshot, an
// import), and with 4 KiB pages that first write costs one page fault per 4 KiB, which measured
// 10x slower than the copy itself on a VM (docs/benchmarks.md, Cluster). With THP in "madvise"
// mode each fault then maps 2 MiB. Sanitizer builds keep malloc, which they instrument.
constexpr size_t kHugePage = size_t{2} << 20;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVMESH_HOST_DEVICE_MALLOC_ONLY 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define KVMESH_HOST_DEVICE_MALLOC_ONLY 1
#endif
#endif

#ifdef KVMESH_HOST_DEVICE_MALLOC_ONLY
bool MappedDirectly(size_t) { return false; }
#else
bool MappedDirectly(size_t bytes) { return bytes >= kHugePage; }
#endif

size_t RoundUpToHugePage(size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }

// Maps `length` bytes (a multiple of kHugePage) starting on a 2 MiB boundary; null on failure.
uint8_t* MapAligned(size_t length) {
  // Map one huge page more than needed and cut the ends, so the arena starts on a 2 MiB
  // boundary (a huge page must be aligned).
  void* raw = mmap(nullptr, length + kHugePage, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + length + kHugePage;
  if (end > aligned + length)
    munmap(reinterpret_cast<void*>(aligned + length), end - aligned - length);
  // Advice only: without THP the arena works the same, with small pages.
  (void)madvise(reinterpret_cast<void*>(aligned), length, MADV_HUGEPAGE);
  return reinterpret_cast<uint8_t*>(aligned);
}

// Faults in every page of [data, data + length) writable without writing it; on a kernel
// without MADV_POPULATE_WRITE (before 5.14), by writing a zero to each 4 KiB page of the fresh,
// zero-filled mapping. An arena whose pages could not be populated works the same, only slower
// at first.
void Prefault(uint8_t* data, size_t length) {
#ifdef MADV_POPULATE_WRITE
  if (madvise(data, length, MADV_POPULATE_WRITE) == 0) return;
  if (errno != EINVAL) return;  // ENOMEM and the like: leave it to the first writes
#endif
  for (size_t at = 0; at < length; at += 4096) {
    reinterpret_cast<volatile uint8_t*>(data)[at] = 0;
  }
}

}  // namespace

HostDevice::HostDevice(size_t budget_bytes, size_t snapshot_budget_bytes, size_t kept_limit,
                       bool prefault, bool shareable)
    : Device(budget_bytes, snapshot_budget_bytes),
      kept_limit_(shareable ? 0
                            : std::min(kept_limit, budget_bytes > SIZE_MAX - snapshot_budget_bytes
                                                       ? SIZE_MAX
                                                       : budget_bytes + snapshot_budget_bytes)),
      prefault_(prefault),
      shareable_(shareable) {}

HostDevice::~HostDevice() {
  MutexLock lock(&mu_);
  TrimKept(0);
}

bool HostDevice::KeepsArenas() { return MappedDirectly(kHugePage); }

size_t HostDevice::kept_bytes() const {
  ReaderMutexLock lock(&mu_);
  return kept_bytes_;
}

void HostDevice::TrimKept(size_t limit) {
  while (kept_bytes_ > limit) {
    const auto [length, data] = kept_.front();
    kept_.pop_front();
    kept_bytes_ -= length;
    munmap(data, length);
  }
}

absl::StatusOr<uint8_t*> HostDevice::AllocateShared(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t length = std::max(page, (bytes + page - 1) / page * page);
  const int fd = memfd_create("kvmesh-arena", MFD_CLOEXEC);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host: memfd_create for ", bytes, " bytes failed: ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(length)) != 0) {
    const int error = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("host: sizing a memfd to ", length, " bytes failed: ", std::strerror(error)));
  }
  void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (data == MAP_FAILED) {
    const int error = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("host: mapping a memfd of ", length, " bytes failed: ", std::strerror(error)));
  }
  uint8_t* const arena = static_cast<uint8_t*>(data);
  if (prefault_) Prefault(arena, length);
  MutexLock lock(&mu_);
  shared_.emplace(arena, std::make_pair(fd, length));
  return arena;
}

bool HostDevice::FreeShared(uint8_t* data) {
  std::pair<int, size_t> shared;
  {
    MutexLock lock(&mu_);
    auto it = shared_.find(data);
    if (it == shared_.end()) return false;
    shared = it->second;
    shared_.erase(it);
  }
  const auto [fd, length] = shared;
  // Another process may still map it: release the pages now rather than when it unmaps, so a
  // deleted cache's memory is back at once and no one reads its bytes any more.
  (void)fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(length));
  munmap(data, length);
  close(fd);
  return true;
}

absl::StatusOr<SharedArena> HostDevice::Share(const DeviceArena& arena) const {
  if (!shareable_) return Device::Share(arena);
  ReaderMutexLock lock(&mu_);
  auto it = shared_.find(arena.data());
  if (it == shared_.end()) {
    return absl::FailedPreconditionError("host: the arena is not one of this device's");
  }
  SharedArena shared;
  shared.fd = it->second.first;
  shared.size = it->second.second;
  return shared;
}

absl::StatusOr<uint8_t*> HostDevice::RawAllocate(size_t bytes, MemoryPool pool, bool shareable) {
  (void)pool;
  if (shareable_ && shareable) return AllocateShared(bytes);
  if (MappedDirectly(bytes)) {
    const size_t length = RoundUpToHugePage(bytes);
    MutexLock lock(&mu_);
    // The most recently freed arena of this length: its pages are the likeliest to be warm.
    for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {
      if (it->first != length) continue;
      uint8_t* data = it->second;
      kept_.erase(std::next(it).base());
      kept_bytes_ -= length;
      return data;
    }
    uint8_t* data = MapAligned(length);
    int error = errno;
    if (data == nullptr && !kept_.empty()) {
      TrimKept(0);
      data = MapAligned(length);
      error = errno;
    }
    if (data == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("host: mmap of ", length + kHugePage,
                                                       " bytes failed: ", std::strerror(error)));
    }
    if (prefault_) Prefault(data, length);
    return data;
  }
  // Small arenas: malloc maps fresh pages; they cost nothing until first written.
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("host: malloc of ", bytes, " bytes failed"));
  }
  return static_cast<uint8_t*>(p);
}

void HostDevice::RawFree(uint8_t* data, size_t bytes, MemoryPool pool) {
  (void)pool;
  if (shareable_ && FreeShared(data)) return;
  if (MappedDirectly(bytes)) {
    const size_t length = RoundUpToHugePage(bytes);
    MutexLock lock(&mu_);
    if (length > kept_limit_) {
      munmap(data, length);
      return;
    }
    TrimKept(kept_limit_ - length);
    // Lazily free: the pages stay mapped and warm unless the kernel needs the memory, when it
    // takes them back instead of swapping or killing (a reused arena's contents are unspecified).
    (void)madvise(data, length, MADV_FREE);
    kept_.emplace_back(length, data);
    kept_bytes_ += length;
    return;
  }
  std::free(data);
}

absl::Status HostDevice::Scatter(const DeviceArena& arena, absl::Span<const Plane> planes,
                                 absl::Span<const int32_t> rows, const uint8_t* src) {
  for (const Plane& plane : planes) {
    uint8_t* base = arena.data() + plane.offset;
    for (int32_t row : rows) {
      if (row >= 0) std::memcpy(base + size_t(row) * plane.row_bytes, src, plane.row_bytes);
      src += plane.row_bytes;
    }
  }
  return absl::OkStatus();
}

absl::Status HostDevice::Gather(const DeviceArena& arena, absl::Span<const Plane> planes,
                                absl::Span<const int32_t> rows, uint8_t* dst) {
  for (const Plane& plane : planes) {
    const uint8_t* base = arena.data() + plane.offset;
    for (int32_t row : rows) {
      std::memcpy(dst, base + size_t(row) * plane.row_bytes, plane.row_bytes);
      dst += plane.row_bytes;
    }
  }
  return absl::OkStatus();
}

absl::Status HostDevice::CopyRows(const DeviceArena& arena, absl::Span<const Plane> planes,
                                  absl::Span<const int32_t> src_rows,
                                  absl::Span<const int32_t> dst_rows) {
  for (const Plane& plane : planes) {
    uint8_t* base = arena.data() + plane.offset;
    for (size_t i = 0; i < src_rows.size(); ++i) {
      std::memcpy(base + size_t(dst_rows[i]) * plane.row_bytes,
                  base + size_t(src_rows[i]) * plane.row_bytes, plane.row_bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status HostDevice::CopyRowsBetween(const DeviceArena& src, absl::Span<const Plane> src_planes,
                                         absl::Span<const int32_t> src_rows, const DeviceArena& dst,
                                         absl::Span<const Plane> dst_planes,
                                         absl::Span<const int32_t> dst_rows) {
  for (size_t p = 0; p < src_planes.size(); ++p) {
    const uint8_t* from = src.data() + src_planes[p].offset;
    uint8_t* to = dst.data() + dst_planes[p].offset;
    const size_t row_bytes = src_planes[p].row_bytes;
    for (size_t i = 0; i < src_rows.size(); ++i) {
      std::memcpy(to + size_t(dst_rows[i]) * row_bytes, from + size_t(src_rows[i]) * row_bytes,
                  row_bytes);
    }
  }
  return absl::OkStatus();
}

namespace {

#if defined(__x86_64__)
// F16C converts eight halves per instruction; without it the conversions, not memory, bound
// the host shift. Chosen at run time so the binary still runs on CPUs without F16C.
__attribute__((target("avx,f16c"))) void HalfToFloatF16C(const uint8_t* src, float* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = LoadElement(DType::kF16, src, i);
}

__attribute__((target("avx,f16c"))) void FloatToHalfF16C(const float* src, uint8_t* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), h);
  }
  for (; i < n; ++i) StoreElement(DType::kF16, dst, i, src[i]);
}

bool HaveF16C() {
  // clang 14's __builtin_cpu_supports does not know "f16c": read CPUID leaf 1 (ECX bit 29).
  static const bool have = [] {
    unsigned eax, ebx, ecx, edx;
    return __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) &&
           (ecx & (1u << 29)) != 0;
  }();
  return have;
}
#else
bool HaveF16C() { return false; }
void HalfToFloatF16C(const uint8_t*, float*, int) {}
void FloatToHalfF16C(const float*, uint8_t*, int) {}
#endif

void LoadFloats(DType dtype, const uint8_t* src, float* dst, int n) {
  if (dtype == DType::kF16 && HaveF16C()) return HalfToFloatF16C(src, dst, n);
  for (int i = 0; i < n; ++i) dst[i] = LoadElement(dtype, src, i);
}

void StoreFloats(DType dtype, const float* src, uint8_t* dst, int n) {
  if (dtype == DType::kF16 && HaveF16C()) return FloatToHalfF16C(src, dst, n);
  for (int i = 0; i < n; ++i) StoreElement(dtype, dst, i, src[i]);
}

// Rotates the first rope.dims elements of every head of the given rows: each head is widened
// to float, rotated, and narrowed back; elements past dims are never touched.
void RotateRows(uint8_t* base, size_t row_bytes, absl::Span<const int32_t> rows,
                const RopeShiftParams& p, const float* cos_table, const float* sin_table) {
  const int32_t dims = p.rope.dims;
  const int32_t half = dims / 2;
  const size_t head_bytes = size_t(p.head_dim) * DTypeSize(p.dtype);
  std::vector<float> x(dims);
  float* v = x.data();
  for (int32_t row : rows) {
    uint8_t* r = base + size_t(row) * row_bytes;
    for (int32_t h = 0; h < p.num_heads; ++h) {
      uint8_t* head = r + size_t(h) * head_bytes;
      LoadFloats(p.dtype, head, v, dims);
      if (p.rope.type == RopeType::kNeox) {
        for (int32_t i = 0; i < half; ++i) {
          const float x0 = v[i], x1 = v[i + half];
          v[i] = x0 * cos_table[i] - x1 * sin_table[i];
          v[i + half] = x0 * sin_table[i] + x1 * cos_table[i];
        }
      } else {
        for (int32_t i = 0; i < half; ++i) {
          const float x0 = v[2 * i], x1 = v[2 * i + 1];
          v[2 * i] = x0 * cos_table[i] - x1 * sin_table[i];
          v[2 * i + 1] = x0 * sin_table[i] + x1 * cos_table[i];
        }
      }
      StoreFloats(p.dtype, v, head, dims);
    }
  }
}

}  // namespace

absl::Status HostDevice::RopeShift(const DeviceArena& arena, absl::Span<const Plane> planes,
                                   absl::Span<const int32_t> rows, const RopeShiftParams& p) {
  const int32_t half = p.rope.dims / 2;
  // One angle per pair for the whole call: every row moves by the same delta.
  std::vector<float> cos_table(half), sin_table(half);
  for (int32_t i = 0; i < half; ++i) {
    const double theta = double(p.delta) * double(p.rope.freq_scale) *
                         std::pow(double(p.rope.base), -2.0 * i / double(p.rope.dims));
    cos_table[i] = static_cast<float>(std::cos(theta));
    sin_table[i] = static_cast<float>(std::sin(theta));
  }
  for (const Plane& plane : planes) {
    uint8_t* base = arena.data() + plane.offset;
    RotateRows(base, plane.row_bytes, rows, p, cos_table.data(), sin_table.data());
  }
  return absl::OkStatus();
}

}  // namespace kvmesh
