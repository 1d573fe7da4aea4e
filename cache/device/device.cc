#include "cache/device/device.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cache/shortage.h"

namespace kvmesh {

DeviceArena& DeviceArena::operator=(DeviceArena&& o) noexcept {
  if (this != &o) {
    Reset();
    device_ = o.device_;
    pool_ = o.pool_;
    data_ = o.data_;
    size_ = o.size_;
    stream_ = std::move(o.stream_);
    o.device_ = nullptr;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void DeviceArena::Reset() {
  if (device_ != nullptr && data_ != nullptr) device_->Release(pool_, data_, size_);
  device_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  stream_.reset();
}

size_t Device::used_bytes(MemoryPool pool) const {
  return used_bytes_[static_cast<int>(pool)].load(std::memory_order_relaxed);
}

size_t Device::free_bytes(MemoryPool pool) const {
  const size_t budget = budget_bytes(pool);
  return budget - std::min(budget, used_bytes(pool));
}

absl::StatusOr<DeviceArena> Device::Allocate(size_t bytes, MemoryPool pool,
                                             std::shared_ptr<DeviceStream> stream, bool shareable) {
  const int p = static_cast<int>(pool);
  const size_t budget = budgets_[p];
  // Reserve against the budget first so concurrent allocations cannot overshoot it.
  size_t used = used_bytes_[p].load(std::memory_order_relaxed);
  do {
    if (bytes > budget || used > budget - bytes) {
      return ResourceExhaustedWith(
          absl::StrCat("device ", name(), ": allocating ", bytes, " bytes exceeds the ",
                       pool == MemoryPool::kCache ? "memory" : "snapshot", " budget (", used,
                       " of ", budget, " bytes in use)"),
          {pool == MemoryPool::kCache ? Resource::kDeviceBytes : Resource::kSnapshotBytes, -1,
           static_cast<int64_t>(bytes), static_cast<int64_t>(used <= budget ? budget - used : 0),
           static_cast<int64_t>(budget)});
    }
  } while (!used_bytes_[p].compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  absl::StatusOr<uint8_t*> data = RawAllocate(bytes, pool, shareable);
  if (!data.ok()) {
    used_bytes_[p].fetch_sub(bytes, std::memory_order_relaxed);
    return data.status();
  }
  return DeviceArena(this, pool, *data, bytes, std::move(stream));
}

absl::StatusOr<SharedArena> Device::Share(const DeviceArena& arena) const {
  (void)arena;
  return absl::FailedPreconditionError(
      absl::StrCat("device ", name(), " does not share its memory with other processes"));
}

void Device::Release(MemoryPool pool, uint8_t* data, size_t bytes) {
  RawFree(data, bytes, pool);
  used_bytes_[static_cast<int>(pool)].fetch_sub(bytes, std::memory_order_relaxed);
}

}  // namespace kvmesh
