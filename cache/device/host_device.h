// HostDevice: the Device on host memory. The embedded default and what every test uses.
// Allocations come from the heap (pages are only touched when written); row operations are
// plain loops over memcpy. Thread safety as Device.
#ifndef KVMESH_CACHE_DEVICE_HOST_DEVICE_H_
#define KVMESH_CACHE_DEVICE_HOST_DEVICE_H_

#include "cache/device/device.h"

namespace kvmesh {

class HostDevice : public Device {
 public:
  // The snapshot pool defaults to the size of the cache pool.
  explicit HostDevice(size_t budget_bytes) : Device(budget_bytes, budget_bytes) {}
  HostDevice(size_t budget_bytes, size_t snapshot_budget_bytes)
      : Device(budget_bytes, snapshot_budget_bytes) {}

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

 protected:
  absl::StatusOr<uint8_t*> RawAllocate(size_t bytes) override;
  void RawFree(uint8_t* data, size_t bytes) override;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_DEVICE_HOST_DEVICE_H_
