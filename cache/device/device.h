// Device: where cache tensors live and the handful of bulk operations the engine runs on them.
//
// The engine keeps all metadata on the host and asks the device only to move rows: scatter
// appended rows into cells, gather cells into a host buffer, copy cells (copy-on-write), and
// re-rotate keys by RoPE. Every operation addresses an arena as a set of *planes*: a plane is a
// table of equally sized rows starting at some byte offset in the arena (one plane per layer
// for K, one for V). Keeping the interface this small is what lets a CUDA device implement each
// call as one kernel launch.
//
// Every row operation is synchronous: when it returns, the data has moved (or the returned error
// says it could not), so host buffers passed in may be reused at once.
//
// Thread safety: a Device is shared by every cache of a node. Allocate/Free and the accounting
// are thread-safe. Row operations may run concurrently, on one arena too, as long as no row one
// of them writes is touched by another: the engine reads under a shared lock, and an Append
// scatters into cells that belong to no sequence yet without holding the cache's lock at all.
#ifndef KVMESH_CACHE_DEVICE_DEVICE_H_
#define KVMESH_CACHE_DEVICE_DEVICE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/dtype.h"
#include "cache/spec.h"

namespace kvmesh {

class Device;

// An in-order queue of device work. A cache creates one and binds every arena it allocates to
// it, so the operations of different caches can run concurrently on the device while those of
// one cache stay ordered. Shared: arenas hold a reference, so a stream lives as long as the last
// arena bound to it. HostDevice's streams hold nothing (its operations are plain loops).
class DeviceStream {
 public:
  virtual ~DeviceStream() = default;
};

// A device keeps two budgets: one for cache storage (group arenas and pending speculative
// data) and one for snapshots, so that checkpoints can never starve live sequences.
enum class MemoryPool { kCache, kSnapshot };

// Move-only owner of one device allocation. Frees it (and returns the bytes to the device's
// budget) on destruction. The Device must outlive every arena it allocated.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(Device* device, MemoryPool pool, uint8_t* data, size_t size,
              std::shared_ptr<DeviceStream> stream)
      : device_(device), pool_(pool), data_(data), size_(size), stream_(std::move(stream)) {}
  ~DeviceArena() { Reset(); }
  DeviceArena(DeviceArena&& o) noexcept { *this = std::move(o); }
  DeviceArena& operator=(DeviceArena&& o) noexcept;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // The memory of `arena` as an arena that frees nothing when it goes: a group's cells lent to
  // a transfer. `arena` must outlive it.
  static DeviceArena Borrow(const DeviceArena& arena) {
    return DeviceArena(nullptr, arena.pool_, arena.data_, arena.size_, arena.stream_);
  }

  // Device address of the first byte; only the owning Device may dereference it.
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // The stream operations on this arena are issued on; null for the device's own stream.
  const std::shared_ptr<DeviceStream>& stream() const { return stream_; }

 private:
  void Reset();
  Device* device_ = nullptr;
  MemoryPool pool_ = MemoryPool::kCache;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::shared_ptr<DeviceStream> stream_;
};

// An arena's memory as another process on this machine maps it (Device::Share): the local data
// path, where an inference engine reads and writes cells in place.
struct SharedArena {
  enum class Kind {
    // Host memory: `fd` is a memfd holding the arena from offset 0; map it.
    kHostMemfd,
    // GPU memory of CUDA device `device`: `fd` is a POSIX descriptor of the driver's virtual
    // memory management (cuMemImportFromShareableHandle, then cuMemMap at offset 0 of a range
    // of `size` bytes, then cuMemSetAccess).
    kCudaMemory,
  };
  Kind kind = Kind::kHostMemfd;
  // The device's own descriptor, open while the arena lives: send a copy (SCM_RIGHTS), never
  // close it.
  int fd = -1;
  // Bytes the descriptor holds: the arena's size rounded up to whole pages (host) or granules
  // of the driver (CUDA).
  size_t size = 0;
  int device = -1;  // the CUDA device ordinal of kCudaMemory
};

// A table of rows inside an arena: row r occupies [offset + r*row_bytes, +row_bytes).
struct Plane {
  size_t offset = 0;
  size_t row_bytes = 0;
};

// What a RoPE shift needs to know about the rows it rotates.
struct RopeShiftParams {
  RopeSpec rope;  // type != kNone
  DType dtype = DType::kF16;
  int32_t num_heads = 0;  // heads per row
  int32_t head_dim = 0;   // elements per head; rope.dims <= head_dim
  int32_t delta = 0;      // positions to shift by (negative for a Remove)
};

class Device {
 public:
  virtual ~Device() = default;

  // "host" or "cuda:N".
  virtual std::string name() const = 0;

  // A new stream for one cache's work (see DeviceStream). Errors mean the device is unusable.
  virtual absl::StatusOr<std::shared_ptr<DeviceStream>> CreateStream() {
    return std::make_shared<DeviceStream>();
  }

  // Allocates `bytes` of device memory from `pool`, bound to `stream` (null: the device's own).
  // RESOURCE_EXHAUSTED when the pool's budget, or the device itself, cannot hold it. Contents
  // are unspecified. With `shareable`, on a device that shares its memory (the local data path),
  // the arena is one that Share hands to other processes: a cache group's cells.
  absl::StatusOr<DeviceArena> Allocate(size_t bytes, MemoryPool pool = MemoryPool::kCache,
                                       std::shared_ptr<DeviceStream> stream = nullptr,
                                       bool shareable = false);

  size_t budget_bytes(MemoryPool pool = MemoryPool::kCache) const {
    return budgets_[static_cast<int>(pool)];
  }
  size_t used_bytes(MemoryPool pool = MemoryPool::kCache) const;
  // Freed memory the device keeps for reuse (counted in no pool), and the most it keeps: 0 for
  // a device that keeps nothing.
  virtual size_t kept_bytes() const { return 0; }
  virtual size_t kept_limit_bytes() const { return 0; }
  size_t free_bytes(MemoryPool pool = MemoryPool::kCache) const;

  // For each plane p (in order) and each i, copies row_bytes from
  // src[cursor] to row rows[i] of p, where cursor walks src contiguously: the layout of an
  // Append payload for one group. A row index of -1 skips its source row (a token that would be
  // overwritten within the same batch); no other row may appear twice. REQUIRES: every other
  // row index is within the arena.
  virtual absl::Status Scatter(const DeviceArena& arena, absl::Span<const Plane> planes,
                               absl::Span<const int32_t> rows, const uint8_t* src) = 0;

  // The inverse of Scatter: rows of every plane, in order, into dst contiguously.
  virtual absl::Status Gather(const DeviceArena& arena, absl::Span<const Plane> planes,
                              absl::Span<const int32_t> rows, uint8_t* dst) = 0;

  // For each plane, row dst_rows[i] = row src_rows[i]. The two lists have equal length and
  // no row appears in both.
  virtual absl::Status CopyRows(const DeviceArena& arena, absl::Span<const Plane> planes,
                                absl::Span<const int32_t> src_rows,
                                absl::Span<const int32_t> dst_rows) = 0;

  // For each plane index p and each i: row dst_rows[i] of dst_planes[p] in `dst` = row
  // src_rows[i] of src_planes[p] in `src`. Plane lists have equal length and equal row_bytes
  // pairwise; row lists have equal length. `src` and `dst` may be the same arena only when no
  // row is both read and written. Both arenas belong to this device (either pool).
  virtual absl::Status CopyRowsBetween(const DeviceArena& src, absl::Span<const Plane> src_planes,
                                       absl::Span<const int32_t> src_rows, const DeviceArena& dst,
                                       absl::Span<const Plane> dst_planes,
                                       absl::Span<const int32_t> dst_rows) = 0;

  // The arena's first byte as a host address the caller may read, or null when the arena is not
  // in host memory (the default). For zero-copy reads of immutable arenas (snapshot exports).
  virtual const uint8_t* HostAddress(const DeviceArena& arena) const {
    (void)arena;
    return nullptr;
  }

  // The memory of `arena` (or of the arena it borrows) for another process to map.
  // FAILED_PRECONDITION when this device does not share its memory (the default).
  virtual absl::StatusOr<SharedArena> Share(const DeviceArena& arena) const;

  // Rotates the keys in rows `rows` of every plane by params.delta positions
  // (docs/api.md#rope-shift), computing in float32 and rounding back to params.dtype.
  virtual absl::Status RopeShift(const DeviceArena& arena, absl::Span<const Plane> planes,
                                 absl::Span<const int32_t> rows, const RopeShiftParams& params) = 0;

 protected:
  Device(size_t budget_bytes, size_t snapshot_budget_bytes)
      : budgets_{budget_bytes, snapshot_budget_bytes} {}

  // Implementations allocate and free raw memory of `pool`, `shareable` as Allocate says (a
  // device that shares its memory knows its shared arenas by address when they are freed);
  // accounting is done by the base class.
  virtual absl::StatusOr<uint8_t*> RawAllocate(size_t bytes, MemoryPool pool, bool shareable) = 0;
  virtual void RawFree(uint8_t* data, size_t bytes, MemoryPool pool) = 0;

 private:
  friend class DeviceArena;
  void Release(MemoryPool pool, uint8_t* data, size_t bytes);

  const size_t budgets_[2];
  mutable std::atomic<size_t> used_bytes_[2] = {0, 0};
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_DEVICE_DEVICE_H_
