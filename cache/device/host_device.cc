#include "cache/device/host_device.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvmesh {

absl::StatusOr<uint8_t*> HostDevice::RawAllocate(size_t bytes) {
  // malloc of a large block maps fresh pages; they cost nothing until first written.
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("host: malloc of ", bytes, " bytes failed"));
  }
  return static_cast<uint8_t*>(p);
}

void HostDevice::RawFree(uint8_t* data, size_t bytes) { std::free(data); }

absl::Status HostDevice::Scatter(const DeviceArena& arena, absl::Span<const Plane> planes,
                                 absl::Span<const int32_t> rows, const uint8_t* src) {
  for (const Plane& plane : planes) {
    uint8_t* base = arena.data() + plane.offset;
    for (int32_t row : rows) {
      std::memcpy(base + size_t(row) * plane.row_bytes, src, plane.row_bytes);
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
  const bool neox = p.rope.type == RopeType::kNeox;
  const size_t elem = DTypeSize(p.dtype);
  for (const Plane& plane : planes) {
    uint8_t* base = arena.data() + plane.offset;
    for (int32_t row : rows) {
      uint8_t* r = base + size_t(row) * plane.row_bytes;
      for (int32_t h = 0; h < p.num_heads; ++h) {
        uint8_t* head = r + size_t(h) * p.head_dim * elem;
        for (int32_t i = 0; i < half; ++i) {
          const size_t a = neox ? size_t(i) : size_t(2 * i);
          const size_t b = neox ? size_t(i + half) : size_t(2 * i + 1);
          const float x0 = LoadElement(p.dtype, head, a);
          const float x1 = LoadElement(p.dtype, head, b);
          StoreElement(p.dtype, head, a, x0 * cos_table[i] - x1 * sin_table[i]);
          StoreElement(p.dtype, head, b, x0 * sin_table[i] + x1 * cos_table[i]);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvmesh
