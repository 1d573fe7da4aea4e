#include "cache/layer_group.h"

#include <utility>

namespace kvmesh {

absl::StatusOr<std::shared_ptr<RowChunk>> AllocateChunk(Device* device, MemoryPool pool,
                                                        const DeviceArena& owner,
                                                        absl::Span<const size_t> row_bytes,
                                                        int32_t rows) {
  return AllocateChunk(device, pool, owner.stream(), row_bytes, rows);
}

absl::StatusOr<std::shared_ptr<RowChunk>> AllocateChunk(Device* device, MemoryPool pool,
                                                        std::shared_ptr<DeviceStream> stream,
                                                        absl::Span<const size_t> row_bytes,
                                                        int32_t rows) {
  auto chunk = std::make_shared<RowChunk>();
  size_t offset = 0;
  for (size_t bytes : row_bytes) {
    chunk->planes.push_back(Plane{offset, bytes});
    offset += bytes * size_t(rows);
  }
  if (offset > 0) {
    absl::StatusOr<DeviceArena> arena = device->Allocate(offset, pool, std::move(stream));
    if (!arena.ok()) return arena.status();
    chunk->arena = *std::move(arena);
  }
  return chunk;
}

int32_t GroupSnapshot::stored() const {
  int32_t n = 0;
  for (const Segment& segment : segments) n += static_cast<int32_t>(segment.positions.size());
  return n;
}

size_t GroupSnapshot::bytes() const {
  size_t n = 0;
  for (const Segment& segment : segments) n += size_t(segment.rows) * row_bytes;
  return n;
}

}  // namespace kvmesh
