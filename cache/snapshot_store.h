// SnapshotStore: the snapshots one cache holds, by id. Ids are given in increasing order from 1
// and never reused, so a listing resumes after the last id it returned. The store holds the
// records (their rows live in the chunks their segments share); what they are charged against
// and the events of their coming and going are the Cache's.
//
// Thread safety: none; the Cache guards it with its lock.
#ifndef KVMESH_CACHE_SNAPSHOT_STORE_H_
#define KVMESH_CACHE_SNAPSHOT_STORE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "absl/functional/function_ref.h"

namespace kvmesh {

struct SnapshotRecord;  // cache/layer_group.h

class SnapshotStore {
 public:
  SnapshotStore();
  ~SnapshotStore();
  SnapshotStore(const SnapshotStore&) = delete;
  SnapshotStore& operator=(const SnapshotStore&) = delete;

  // Stores `record` under the next id, which it sets in the record; returns the stored record.
  const SnapshotRecord& Add(SnapshotRecord record);
  // The record of `id`; null when there is none.
  const SnapshotRecord* Find(uint64_t id) const;
  // Removes the record of `id` and returns it; null when there is none.
  std::unique_ptr<SnapshotRecord> Take(uint64_t id);

  size_t size() const { return records_.size(); }
  // Calls `visit` with the records of ids `first` and up, in id order, until it returns false.
  void ForEachFrom(uint64_t first, absl::FunctionRef<bool(const SnapshotRecord&)> visit) const;
  // Bytes of the chunks that hold the records' rows, each chunk counted once however many
  // records share it.
  size_t ChunkBytes() const;

 private:
  std::map<uint64_t, std::unique_ptr<SnapshotRecord>> records_;
  uint64_t next_id_ = 1;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_SNAPSHOT_STORE_H_
