#include "cache/layer_group.h"

#include <utility>

#include "cache/status_macros.h"

namespace kvmesh {

namespace {

std::vector<size_t> RowBytes(absl::Span<const Plane> planes) {
  std::vector<size_t> row_bytes;
  row_bytes.reserve(planes.size());
  for (const Plane& plane : planes) row_bytes.push_back(plane.row_bytes);
  return row_bytes;
}

}  // namespace

absl::StatusOr<std::shared_ptr<RowChunk>> AllocateChunk(Device* device, MemoryPool pool,
                                                        std::shared_ptr<DeviceStream> stream,
                                                        absl::Span<const size_t> row_bytes,
                                                        int32_t rows, bool shareable) {
  auto chunk = std::make_shared<RowChunk>();
  size_t offset = 0;
  for (size_t bytes : row_bytes) {
    chunk->planes.push_back(Plane{offset, bytes});
    offset += bytes * size_t(rows);
  }
  if (offset > 0) {
    absl::StatusOr<DeviceArena> arena =
        device->Allocate(offset, pool, std::move(stream), shareable);
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

void LayerGroup::VisibleRanges(const Query& query, std::vector<PositionRange>* out) const {
  const std::vector<int32_t> positions = Visible(query);
  for (size_t i = 0; i < positions.size();) {
    size_t j = i + 1;
    while (j < positions.size() && int64_t{positions[j]} == int64_t{positions[j - 1]} + 1) ++j;
    out->push_back(PositionRange{positions[i], positions[j - 1]});
    i = j;
  }
}

ChunkFormat LayerGroup::SnapshotChunkFormat() const {
  return ChunkFormat{device_, arena_.stream(), RowBytes(planes_)};
}

absl::StatusOr<std::shared_ptr<RowChunk>> LayerGroup::NewChunk(MemoryPool pool, int32_t rows,
                                                               bool shareable) const {
  return AllocateChunk(device_, pool, arena_.stream(), RowBytes(planes_), rows, shareable);
}

absl::Status LayerGroup::AddSnapshotSegment(absl::Span<const int32_t> rows,
                                            std::vector<int32_t> positions,
                                            GroupSnapshot* snap) const {
  Segment segment;
  segment.rows = static_cast<int32_t>(rows.size());
  segment.positions = std::move(positions);
  ASSIGN_OR_RETURN(std::shared_ptr<RowChunk> chunk, NewChunk(MemoryPool::kSnapshot, segment.rows));
  std::vector<int32_t> chunk_rows(rows.size());
  for (size_t i = 0; i < chunk_rows.size(); ++i) chunk_rows[i] = static_cast<int32_t>(i);
  RETURN_IF_ERROR(
      device_->CopyRowsBetween(arena_, planes_, rows, chunk->arena, chunk->planes, chunk_rows));
  segment.chunk = std::move(chunk);
  snap->segments.push_back(std::move(segment));
  return absl::OkStatus();
}

absl::Status LayerGroup::CopyFromChunk(const RowChunk& chunk, absl::Span<const int32_t> src,
                                       absl::Span<const int32_t> dst) {
  return device_->CopyRowsBetween(chunk.arena, chunk.planes, src, arena_, planes_, dst);
}

}  // namespace kvmesh
