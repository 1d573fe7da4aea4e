// HostDevice: the Device on host memory. The embedded default and what every test uses.
// Small allocations come from the heap; arenas of 2 MiB and more are mapped directly with
// transparent huge pages, and freed ones are kept for reuse (below). Row operations are plain
// loops over memcpy. Thread safety as Device.
//
// Reuse of freed arenas. The first write to freshly mapped memory costs a page fault per page
// and the kernel zeroes every page; on a VM that measured slower than the copy itself (a
// snapshot, an import, a restore: docs/benchmarks.md, Cluster). So a freed mapped arena is not
// unmapped but kept, up to `kept_limit` bytes in all, and an allocation of the same mapped length
// takes the most recently freed one (its pages are resident and warm). When keeping an arena
// would pass the limit, the oldest kept ones are unmapped first. A kept arena is marked
// MADV_FREE: its pages stay resident while memory is plentiful, and the kernel may reclaim them
// under pressure (a reused page it took back faults in again, zeroed). Kept arenas are counted
// in no budget (they hold no data anyone can read); kept_bytes() reports them. A failed mmap unmaps
// every kept arena and tries once more. Sanitizer builds use malloc throughout and keep nothing.
#ifndef KVMESH_CACHE_DEVICE_HOST_DEVICE_H_
#define KVMESH_CACHE_DEVICE_HOST_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "cache/device/device.h"
#include "cache/mutex.h"

namespace kvmesh {

class HostDevice : public Device {
 public:
  // Freed arenas kept for reuse, at most: the smaller of this and the two budgets together.
  static constexpr size_t kDefaultKeptLimit = size_t{1} << 30;

  // The snapshot pool defaults to the size of the cache pool.
  explicit HostDevice(size_t budget_bytes) : HostDevice(budget_bytes, budget_bytes) {}
  // With `prefault`, a freshly mapped arena has every page faulted in before it is handed out
  // (MADV_POPULATE_WRITE), so the cost of fresh memory is paid when a cache or snapshot is
  // allocated rather than by the first operation that writes it (a new cache's first import,
  // which on a VM costs several times the copy itself). Reused kept arenas are warm already.
  // With `shareable`, every arena allocated shareable (a cache group's cells) is a memfd mapping
  // that Share hands to other processes (the local data path; other arenas are not): nothing is
  // kept for reuse (an arena another process mapped is never given to another cache), and a freed
  // arena's pages are released at once, even while another process still maps them (it then
  // reads zeros).
  HostDevice(size_t budget_bytes, size_t snapshot_budget_bytes,
             size_t kept_limit = kDefaultKeptLimit, bool prefault = false, bool shareable = false);
  // Unmaps the kept arenas. REQUIRES: every arena was freed.
  ~HostDevice() override;

  // Bytes of freed arenas kept for reuse now.
  size_t kept_bytes() const override;
  // The limit in force: the smaller of the constructor's kept_limit and the two budgets (0
  // where nothing is kept).
  size_t kept_limit_bytes() const override { return KeepsArenas() ? kept_limit_ : 0; }
  // Whether this build maps large arenas and keeps freed ones (false under sanitizers).
  static bool KeepsArenas();

  std::string name() const override { return "host"; }
  absl::Status Scatter(const DeviceArena& arena, absl::Span<const Plane> planes,
                       absl::Span<const int32_t> rows, const uint8_t* src) override;
  absl::Status Gather(const DeviceArena& arena, absl::Span<const Plane> planes,
                      absl::Span<const int32_t> rows, uint8_t* dst) override;
  absl::Status CopyRows(const DeviceArena& arena, absl::Span<const Plane> planes,
                        absl::Span<const int32_t> src_rows,
                        absl::Span<const int32_t> dst_rows) override;
  absl::Status CopyRowsBetween(const DeviceArena& src, absl::Span<const Plane> src_planes,
                               absl::Span<const int32_t> src_rows, const DeviceArena& dst,
                               absl::Span<const Plane> dst_planes,
                               absl::Span<const int32_t> dst_rows) override;
  absl::Status RopeShift(const DeviceArena& arena, absl::Span<const Plane> planes,
                         absl::Span<const int32_t> rows, const RopeShiftParams& params) override;
  const uint8_t* HostAddress(const DeviceArena& arena) const override { return arena.data(); }
  // With `shareable`: the arena's memfd. FAILED_PRECONDITION without it.
  absl::StatusOr<SharedArena> Share(const DeviceArena& arena) const override;
  bool shareable() const { return shareable_; }

 protected:
  absl::StatusOr<uint8_t*> RawAllocate(size_t bytes, MemoryPool pool, bool shareable) override;
  void RawFree(uint8_t* data, size_t bytes, MemoryPool pool) override;

 private:
  // Unmaps kept arenas, oldest first, until at most `limit` bytes are kept.
  void TrimKept(size_t limit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A shareable arena: a memfd of `length` bytes mapped at the arena's address.
  absl::StatusOr<uint8_t*> AllocateShared(size_t bytes);
  // Frees a shareable arena; false when `data` is not one.
  bool FreeShared(uint8_t* data);

  const size_t kept_limit_;
  const bool prefault_;
  const bool shareable_;
  mutable Mutex mu_;
  // Shareable arenas by address: their memfd and its length.
  absl::flat_hash_map<const uint8_t*, std::pair<int, size_t>> shared_ ABSL_GUARDED_BY(mu_);
  // Freed mapped arenas (mapped length, address), oldest first.
  std::deque<std::pair<size_t, uint8_t*>> kept_ ABSL_GUARDED_BY(mu_);
  size_t kept_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_DEVICE_HOST_DEVICE_H_
