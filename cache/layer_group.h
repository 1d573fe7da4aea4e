// LayerGroup: the storage and metadata of one layer group of a Cache, whatever its kind
// (AttentionGroup, RotatingGroup, RecurrentGroup), and the data types the groups share with
// Cache: an Append batch, a Read part, and snapshot data.
//
// Every operation comes in halves: Check*/Prepare* inspect and never mutate; Apply*/Write*/
// Commit* mutate and can fail only on a device error. Cache runs every group's check before any
// group's apply, which is what makes its operations all-or-nothing across groups.
//
// Thread safety: none. The owning Cache serializes access under its lock.
#ifndef KVMESH_CACHE_LAYER_GROUP_H_
#define KVMESH_CACHE_LAYER_GROUP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/cache.h"
#include "cache/device/device.h"
#include "cache/spec.h"

namespace kvmesh {

// Rows held in one device allocation: a snapshot's data, or the pending tokens of a
// speculative batch. Several snapshots (after Split/Merge) or sequences (one speculative batch)
// may reference one chunk; its memory returns to the device with the last reference.
struct RowChunk {
  DeviceArena arena;
  std::vector<Plane> planes;  // in the owning group's plane order
};

// Allocates a chunk of `rows` rows for planes of the given row sizes, laid out plane after
// plane, bound to the stream of `owner` (the arena of the group the chunk belongs to). `rows`
// may be 0 (no allocation).
absl::StatusOr<std::shared_ptr<RowChunk>> AllocateChunk(Device* device, MemoryPool pool,
                                                        const DeviceArena& owner,
                                                        absl::Span<const size_t> row_bytes,
                                                        int32_t rows);
// As above, bound to `stream` directly (a chunk allocated away from its group: an imported
// snapshot, snapshot_wire.h).
absl::StatusOr<std::shared_ptr<RowChunk>> AllocateChunk(Device* device, MemoryPool pool,
                                                        std::shared_ptr<DeviceStream> stream,
                                                        absl::Span<const size_t> row_bytes,
                                                        int32_t rows);

// How a group's snapshot chunks are made: what importing a snapshot needs to allocate and fill
// chunks for a group without holding the cache's lock (snapshot_wire.h). Every snapshot chunk
// of the group has one plane per entry of row_bytes, in this order.
struct ChunkFormat {
  Device* device = nullptr;
  std::shared_ptr<DeviceStream> stream;  // the stream of the group's arena
  std::vector<size_t> row_bytes;         // per plane
};

// A run of rows of one chunk: row first_row + i holds position positions[i] (Attention and
// Rotating), or the one recurrent state (positions empty, one row).
struct Segment {
  std::shared_ptr<const RowChunk> chunk;
  int32_t first_row = 0;
  int32_t rows = 0;
  std::vector<int32_t> positions;
};

// One group's part of a snapshot.
struct GroupSnapshot {
  std::vector<Segment> segments;  // ascending positions across segments
  int32_t ring_index = -1;        // Rotating
  bool has_state = false;         // Recurrent
  size_t row_bytes = 0;           // bytes of one row over all planes
  int32_t stored() const;
  size_t bytes() const;
};

// A snapshot of a whole cache: one GroupSnapshot per group.
struct SnapshotRecord {
  uint64_t id = 0;
  int64_t seq = 0;
  int32_t from = 0;
  int32_t to = 0;
  std::vector<GroupSnapshot> groups;
};

// A pending speculative token's data in a group that keeps pending data outside its storage.
struct PendingRow {
  std::shared_ptr<const RowChunk> chunk;
  int32_t row = 0;
  int32_t pos = 0;
};

// What every group sees of an Append.
struct AppendBatch {
  absl::Span<const Token> tokens;
  std::vector<int64_t> seqs;                     // distinct, in order of first appearance
  absl::flat_hash_map<int64_t, int32_t> lowest;  // per sequence, its lowest batch position
  bool speculative = false;
  // Sequences with pending speculative tokens: their first pending position. Sliding-window
  // pruning never goes past (this - memory) for them, so a rejection loses nothing.
  absl::flat_hash_map<int64_t, int32_t> pending_first;
};

// What a group returns for a Read before gathering: the positions, and group-defined rows.
struct ReadPart {
  std::vector<int32_t> positions;
  std::vector<int32_t> rows;
  StateStatus state = StateStatus::kNone;
  size_t bytes = 0;
};

class LayerGroup {
 public:
  explicit LayerGroup(int index) : index_(index) {}
  virtual ~LayerGroup() = default;
  LayerGroup(const LayerGroup&) = delete;
  LayerGroup& operator=(const LayerGroup&) = delete;

  int index() const { return index_; }
  virtual GroupKind kind() const = 0;

  // ---- sequences ------------------------------------------------------------------------
  // Whether the group holds anything for `seq` (positions, window, state, pending tokens).
  virtual bool Has(int64_t seq) const = 0;
  // One past the largest position the group holds for `seq`, pending included; 0 when none.
  virtual int32_t Offset(int64_t seq) const = 0;
  virtual void AddLive(absl::flat_hash_set<int64_t>* live) const = 0;
  virtual size_t LiveCount() const = 0;
  virtual GroupSequenceInfo Info(int64_t seq) const = 0;
  virtual GroupUsage Usage() const = 0;
  // Device bytes of pending speculative data this group references (chunks counted once).
  virtual void AddPendingChunks(absl::flat_hash_set<const RowChunk*>* chunks) const {}

  // ---- Append ---------------------------------------------------------------------------
  // Checks resources and remembers a plan for the Write/Commit/Abandon that follow.
  virtual absl::Status PrepareAppend(const AppendBatch& batch) = 0;
  virtual size_t SectionBytes(const AppendBatch& batch) const = 0;
  // Whether WriteAppend overwrites stored data (so a device error there damages the cache).
  virtual bool WritesInPlace(const AppendBatch& batch) const = 0;
  virtual absl::Status WriteAppend(const AppendBatch& batch, const uint8_t* section) = 0;
  virtual void CommitAppend(const AppendBatch& batch) = 0;
  virtual void AbandonAppend() = 0;

  // Keeps the first `accepted` of `pending` (the sequence's pending positions, ascending).
  virtual absl::Status CommitSpeculation(int64_t seq, absl::Span<const int32_t> pending,
                                         int32_t accepted) = 0;

  // ---- Read / Visible / CanResume -------------------------------------------------------
  // `end` is exclusive; `seq_offset` is the sequence's offset over all groups.
  virtual ReadPart PlanRead(int64_t seq, int64_t begin, int64_t end, int32_t seq_offset) const = 0;
  virtual absl::Status Gather(int64_t seq, const ReadPart& part, uint8_t* dst) const = 0;
  virtual std::vector<int32_t> Visible(const Query& query) const = 0;
  virtual bool CanResume(int64_t seq, int32_t pos) const = 0;

  // ---- CopyPrefix -----------------------------------------------------------------------
  virtual absl::Status CheckCopyPrefix(int64_t src, int64_t dst, int32_t length) const = 0;
  // Whether dst holds anything in this group after the copy.
  virtual bool CopyPrefixYields(int64_t src, int32_t length) const = 0;
  virtual absl::Status ApplyCopyPrefix(int64_t src, int64_t dst, int32_t length) = 0;

  // ---- Remove ---------------------------------------------------------------------------
  virtual absl::Status CheckRemove(int64_t seq, int32_t begin,
                                   std::optional<int32_t> end) const = 0;
  virtual absl::Status ApplyRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) = 0;

  // ---- Snapshots ------------------------------------------------------------------------
  virtual absl::Status CheckSnapshot(int64_t seq, int32_t from) const { return absl::OkStatus(); }
  // Copies the group's part of [from, to) into the snapshot pool.
  virtual absl::StatusOr<GroupSnapshot> TakeSnapshot(int64_t seq, int32_t from,
                                                     int32_t to) const = 0;
  // `snap` is null for a live rewind; `range` is the snapshot's [from, to).
  virtual absl::Status CheckRestore(int64_t seq, const GroupSnapshot* snap, int32_t from,
                                    int32_t to, int32_t target) const = 0;
  virtual absl::Status ApplyRestore(int64_t seq, const GroupSnapshot* snap, int32_t from,
                                    int32_t to, int32_t target) = 0;
  // The device, stream and plane row sizes of the group's snapshot chunks.
  virtual ChunkFormat SnapshotChunkFormat() const = 0;

 private:
  const int index_;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_LAYER_GROUP_H_
