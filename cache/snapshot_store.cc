#include "cache/snapshot_store.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "cache/layer_group.h"

namespace kvmesh {

SnapshotStore::SnapshotStore() = default;
SnapshotStore::~SnapshotStore() = default;

const SnapshotRecord& SnapshotStore::Add(SnapshotRecord record) {
  record.id = next_id_++;
  auto stored = std::make_unique<SnapshotRecord>(std::move(record));
  const SnapshotRecord& added = *stored;
  records_.emplace(added.id, std::move(stored));
  return added;
}

const SnapshotRecord* SnapshotStore::Find(uint64_t id) const {
  auto it = records_.find(id);
  return it == records_.end() ? nullptr : it->second.get();
}

std::unique_ptr<SnapshotRecord> SnapshotStore::Take(uint64_t id) {
  auto it = records_.find(id);
  if (it == records_.end()) return nullptr;
  std::unique_ptr<SnapshotRecord> record = std::move(it->second);
  records_.erase(it);
  return record;
}

void SnapshotStore::ForEachFrom(uint64_t first,
                                absl::FunctionRef<bool(const SnapshotRecord&)> visit) const {
  for (auto it = records_.lower_bound(first); it != records_.end(); ++it) {
    if (!visit(*it->second)) return;
  }
}

size_t SnapshotStore::ChunkBytes() const {
  absl::flat_hash_set<const RowChunk*> chunks;
  for (const auto& [id, record] : records_) {
    for (const GroupSnapshot& g : record->groups) {
      for (const Segment& segment : g.segments) chunks.insert(segment.chunk.get());
    }
  }
  chunks.erase(nullptr);
  size_t bytes = 0;
  for (const RowChunk* chunk : chunks) bytes += chunk->arena.size();
  return bytes;
}

}  // namespace kvmesh
