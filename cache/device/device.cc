#include "cache/device/device.h"

#include "absl/strings/str_cat.h"

namespace kvmesh {

DeviceArena& DeviceArena::operator=(DeviceArena&& o) noexcept {
  if (this != &o) {
    Reset();
    device_ = o.device_;
    data_ = o.data_;
    size_ = o.size_;
    o.device_ = nullptr;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

void DeviceArena::Reset() {
  if (device_ != nullptr && data_ != nullptr) device_->Release(data_, size_);
  device_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

size_t Device::used_bytes() const { return used_bytes_.load(std::memory_order_relaxed); }

absl::StatusOr<DeviceArena> Device::Allocate(size_t bytes) {
  // Reserve against the budget first so concurrent allocations cannot overshoot it.
  size_t used = used_bytes_.load(std::memory_order_relaxed);
  do {
    if (bytes > budget_bytes_ || used > budget_bytes_ - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("device ", name(), ": allocating ", bytes,
                                                       " bytes exceeds the memory budget (", used,
                                                       " of ", budget_bytes_, " bytes in use)"));
    }
  } while (!used_bytes_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  absl::StatusOr<uint8_t*> data = RawAllocate(bytes);
  if (!data.ok()) {
    used_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
    return data.status();
  }
  return DeviceArena(this, *data, bytes);
}

void Device::Release(uint8_t* data, size_t bytes) {
  RawFree(data, bytes);
  used_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
}

}  // namespace kvmesh
