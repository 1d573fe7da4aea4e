// LayerGroup: the storage and metadata of one layer group of a Cache, whatever its kind
// (AttentionGroup, RotatingGroup, RecurrentGroup), and the data types the groups share with
// Cache: an Append batch, a Read part, and snapshot data. SequenceMapGroup and StagingGroup
// hold what several kinds do alike, so that each kind's class shows only what is its own.
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
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/device/device.h"
#include "cache/spec.h"
#include "cache/types.h"

namespace kvmesh {

class LayerGroup;

// Rows held in one device allocation: a snapshot's data, or the pending tokens of a
// speculative batch. Several snapshots (after Split/Merge) or sequences (one speculative batch)
// may reference one chunk; its memory returns to the device with the last reference.
struct RowChunk {
  DeviceArena arena;
  std::vector<Plane> planes;  // in the owning group's plane order
  // Set when the rows are cells of that group's own arena, borrowed (DeviceArena::Borrow), not
  // a chunk of their own: an export straight from a sequence's cells, or an import straight
  // into free cells (Cache::OpenSequenceExport, Cache::BeginSequenceImport).
  const LayerGroup* cells_of = nullptr;
};

// Allocates a chunk of `rows` rows for planes of the given row sizes, laid out plane after
// plane, bound to `stream`: that of the arena of the group the chunk belongs to, which a group
// passes itself (LayerGroup::NewChunk) and an imported snapshot names in its ChunkFormat
// (snapshot_wire.h). `rows` may be 0 (no allocation).
// With `shareable`, the chunk's memory is one another process can map (Device::Share).
absl::StatusOr<std::shared_ptr<RowChunk>> AllocateChunk(Device* device, MemoryPool pool,
                                                        std::shared_ptr<DeviceStream> stream,
                                                        absl::Span<const size_t> row_bytes,
                                                        int32_t rows, bool shareable = false);

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
  // When not empty (an import straight into cells): row i is chunk row chunk_rows[i], not
  // first_row + i.
  std::vector<int32_t> chunk_rows;
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
  TokenIds tokens;  // of the sequence it was taken from, positions [0, to) at most
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
  // The rows are written by another process (a local worker's plan, Cache::BeginAppend with
  // in_place): what a group stages them in must be memory that process can map.
  bool in_place = false;
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

// The interface Cache drives, and the group's arena: every kind keeps its data in one arena
// on the device, as planes of rows.
class LayerGroup {
 public:
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
  // Appends to *out the first `limit` sequences (ascending) with ids >= `first` that the group
  // holds anything for: O(log n + limit), for a page of Cache::ListSequences.
  virtual void LiveFrom(int64_t first, size_t limit, std::vector<int64_t>* out) const = 0;
  virtual GroupSequenceInfo Info(int64_t seq) const = 0;
  virtual GroupUsage Usage() const = 0;
  // Cells (Recurrent: state slots) referenced by more than one sequence: a walk over every
  // cell, for monitoring rather than the request path (Usage stays O(1) per group).
  virtual int64_t SharedCellCount() const { return 0; }
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

  // Appending without the cache's lock held while the bytes move (Cache::Append, when every
  // group of the cache supports it). After PrepareAppend, ReserveAppend takes the batch's cells
  // under the lock; the reservation's Write fills them without it (they belong to no sequence
  // yet, so nothing else reads or writes them); its Commit or Abandon finishes under the lock
  // again. Between the two the cache may change in every other way except the batch's own
  // sequences, so Commit plans its own sliding-window pruning from `batch`, whose pending_first
  // the caller refreshes. A reservation must end in Commit or Abandon.
  class Reservation {
   public:
    virtual ~Reservation() = default;
    virtual absl::Status Write(const uint8_t* section) const = 0;
    // Writes rows [first_row, first_row + num_rows) of plane `plane` of the batch's section
    // from `src` (num_rows x the plane's row bytes): part of what Write writes, for a payload
    // that arrives piece by piece (Cache::BeginAppend).
    virtual absl::Status WriteRows(size_t plane, size_t first_row, size_t num_rows,
                                   const uint8_t* src) const = 0;
    // Whether the reserved cells lie in host memory (a write is a memcpy, not a device copy).
    virtual bool InHostMemory() const = 0;
    // The cell each row of the batch's section goes to, in batch order (-1: a row that a later
    // token of the batch overwrites, never written); empty for a group whose rows are not cells
    // of the group's planes.
    virtual absl::Span<const int32_t> cells() const { return {}; }
    // Where cells() are rows of a chunk of the reservation's own (a speculative batch of a
    // Rotating or Recurrent group: its pending rows), that chunk, allocated shareable; null where
    // they are rows of the group's planes.
    virtual const RowChunk* staging() const { return nullptr; }
    // An error is a device error after the sequences changed (a copy from staging rows): the
    // caller fails the cache.
    virtual absl::Status Commit(const AppendBatch& batch) = 0;
    virtual void Abandon() = 0;
  };
  virtual bool SupportsReservedAppend() const { return false; }
  // Whether ReserveAppend works for a plain (non-speculative) batch, perhaps through staging
  // units that its Commit copies from (Rotating: a free ring; Recurrent: a free state slot): what
  // a local worker's Append plan needs (Cache::BeginAppend with in_place). Where only this holds,
  // an Append through gRPC still writes under the lock (no extra copy, no spare units).
  virtual bool SupportsInPlaceAppend() const { return SupportsReservedAppend(); }
  // Where SupportsInPlaceAppend(), after PrepareAppend: whether ReserveAppend can take the
  // batch's rows now, without pruning anything; otherwise FAILED_PRECONDITION or
  // RESOURCE_EXHAUSTED saying why.
  virtual absl::Status CheckReserve(const AppendBatch& batch) const = 0;
  // Where SupportsReservedAppend(): whether the cells lie in host memory (a write into them is
  // a memcpy, not a device copy).
  virtual bool CellsInHostMemory() const { return false; }
  // Only called where SupportsReservedAppend(); PrepareAppend must have succeeded just before.
  virtual std::unique_ptr<Reservation> ReserveAppend(const AppendBatch& batch) { return nullptr; }
  // Whether ReserveAppend would find the batch's cells free without pruning anything (a
  // reservation that may be abandoned later must not have changed a sequence).
  virtual bool CanReserveWithoutPruning(const AppendBatch& batch) const { return false; }
  // PrepareAppend's checks of the batch against what the group stores, without its check of
  // room: for a reservation about to commit after the cache changed (its cells are taken).
  virtual absl::Status RecheckAppend(const AppendBatch& batch) const { return absl::OkStatus(); }

  // Whether CommitSpeculation would find the units it takes (a ring, a state slot) free.
  virtual absl::Status CheckCommitSpeculation(int64_t seq, int32_t accepted) const {
    return absl::OkStatus();
  }
  // Keeps the first `accepted` of `pending` (the sequence's pending positions, ascending).
  virtual absl::Status CommitSpeculation(int64_t seq, absl::Span<const int32_t> pending,
                                         int32_t accepted) = 0;

  // ---- Read / Visible / CanResume -------------------------------------------------------
  // `end` is exclusive; `seq_offset` is the sequence's offset over all groups.
  virtual ReadPart PlanRead(int64_t seq, int64_t begin, int64_t end, int32_t seq_offset) const = 0;
  virtual absl::Status Gather(int64_t seq, const ReadPart& part, uint8_t* dst) const = 0;
  virtual std::vector<int32_t> Visible(const Query& query) const = 0;
  // An upper bound of Visible(query).size() found without listing the positions (O(log n)),
  // so that a Visible request too large to serve is refused before any work.
  virtual int64_t VisibleBound(const Query& query) const = 0;
  // Visible(query) as maximal ranges, appended to *out. The default compresses Visible().
  virtual void VisibleRanges(const Query& query, std::vector<PositionRange>* out) const;
  // An upper bound of what VisibleRanges(query) appends, found as VisibleBound is.
  virtual int64_t VisibleRangesBound(const Query& query) const { return VisibleBound(query); }
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
  // Whether `seq` could take `positions` new positions from 0 on, replacing what it stores
  // (a restore of a whole imported sequence): groups that hold positions in cells check their
  // free cells; the others have nothing to check.
  virtual absl::Status CheckRoomForPositions(int64_t seq, int64_t positions) const {
    return absl::OkStatus();
  }
  virtual absl::Status CheckRestore(int64_t seq, const GroupSnapshot* snap, int32_t from,
                                    int32_t to, int32_t target) const = 0;
  virtual absl::Status ApplyRestore(int64_t seq, const GroupSnapshot* snap, int32_t from,
                                    int32_t to, int32_t target) = 0;
  // The device, stream and plane row sizes of the group's snapshot chunks: a chunk has the
  // arena's planes, so that rows copy between the two plane by plane.
  ChunkFormat SnapshotChunkFormat() const;

  // ---- Room reservations ----------------------------------------------------------------
  // Units of the group's pool (Attention: cells; Rotating: rings; Recurrent: state slots) that
  // `seq` would still take to hold `positions` positions, beyond what it holds now: what a room
  // reservation for it holds back from other sequences (Cache::Reserve).
  virtual int64_t UnitsToGrow(int64_t seq, int32_t positions) const = 0;
  // Units free now, whatever is held back.
  virtual int64_t FreeUnits() const = 0;
  // Units the operation under way may not take: other sequences' room reservations. The Cache
  // sets it under its exclusive lock for one operation (Cache::HoldBack) and clears it after;
  // every room check of the group counts it as used.
  void set_held_back(int64_t units) { held_back_ = units; }
  int64_t held_back() const { return held_back_; }

  // ---- Cells lent to transfers (groups that hold positions in cells) ---------------------
  // A transfer between nodes may use cells in place of a snapshot's copy. An export pins the
  // cells of a sequence's positions, so that they are neither freed nor written while their
  // bytes are sent; an import pins free cells and writes the received rows into them, and a
  // Restore of its record then hands them to the sequence (ApplyRestore of a segment whose
  // chunk is this group's cells takes the cells, not a copy). A pinned cell counts as used, and
  // an operation that would write a pinned cell in place writes a copy instead.
  virtual bool LendsCells() const { return false; }
  // Pins the cells of `seq`'s positions in [from, to) and returns them as this group's part of
  // a snapshot, segments as TakeSnapshot makes them but with the cells as chunk_rows (chunk
  // unset), appending the cells to `pinned`.
  virtual GroupSnapshot PinSequence(int64_t seq, int64_t from, int64_t to,
                                    std::vector<int32_t>* pinned) {
    return GroupSnapshot();
  }
  // Pins `n` free cells, in the order the free pool gives them; none when fewer are free.
  virtual std::vector<int32_t> PinFreeCells(int64_t n) { return {}; }
  // Drops one pin of each cell; a cell that no sequence references and nothing pins is free.
  virtual void Unpin(absl::Span<const int32_t> cells) {}
  // Whether PinSequence and Unpin work (a local worker's pin, Cache::PinCells), though the
  // group may lend no cells to transfers: Rotating pins a sequence's ring, Recurrent its state
  // slot (the pinned unit's number is then the one entry of `pinned`), and a write to a pinned
  // unit goes to a copy.
  virtual bool PinsInPlace() const { return LendsCells(); }
  // Whether PinSequence(seq, from, to) can pin everything of `seq` in [from, to) in place:
  // FAILED_PRECONDITION where some of it lies elsewhere (pending speculative rows of a Rotating
  // or Recurrent group, in the cache pool's chunks).
  virtual absl::Status CheckPin(int64_t seq, int64_t from, int64_t to) const {
    return absl::OkStatus();
  }

  // ---- Eviction (Cache's EvictionPolicy::kLru) ------------------------------------------
  // What removing a set of whole sequences would free: TallyEviction adds `seq` to the set
  // `tally` counts, and tally->units is then the group's units (cells, rings, state slots)
  // that the set's sequences reference, no sequence outside it references and nothing pins.
  struct EvictionTally {
    absl::flat_hash_map<int32_t, int32_t> refs;  // per unit: references from the set
    int64_t units = 0;
  };
  virtual void TallyEviction(int64_t seq, EvictionTally* tally) const = 0;
  // While the cache weighs an eviction: the sequences it would evict, whose cells the tally
  // counts already, so that an Append's plan does not count them again as freed by pruning
  // (null otherwise).
  void set_evicting(const absl::flat_hash_set<int64_t>* seqs) { evicting_ = seqs; }

  // The group's cells as a chunk (arena borrowed, cells_of this group). Valid while the group
  // exists.
  RowChunk BorrowCells() const { return RowChunk{DeviceArena::Borrow(arena_), planes_, this}; }
  // The device the group's memory is on.
  Device* device() const { return device_; }

 protected:
  // The kind lays out planes_ in its constructor.
  LayerGroup(int index, DeviceArena arena, Device* device)
      : device_(device), arena_(std::move(arena)), index_(index) {}

  // A chunk of `rows` rows with the arena's planes, bound to the arena's stream.
  absl::StatusOr<std::shared_ptr<RowChunk>> NewChunk(MemoryPool pool, int32_t rows,
                                                     bool shareable = false) const;
  // Copies arena rows `rows` into a new snapshot chunk and adds them to `snap` as a segment:
  // rows[i] becomes the row of positions[i] (positions empty for a recurrent state).
  absl::Status AddSnapshotSegment(absl::Span<const int32_t> rows, std::vector<int32_t> positions,
                                  GroupSnapshot* snap) const;
  // Copies rows `src` of `chunk` (a pending or snapshot chunk of this group) into arena rows
  // `dst`.
  absl::Status CopyFromChunk(const RowChunk& chunk, absl::Span<const int32_t> src,
                             absl::Span<const int32_t> dst);

  // Shared with the kinds rather than hidden behind accessors: each kind's code is mostly device
  // calls on its own arena.
  Device* const device_;
  DeviceArena arena_;
  // In payload order: an Append section or a Read holds each plane's rows in turn, in this
  // order. The group's chunks have planes of the same row sizes, in the same order (NewChunk).
  std::vector<Plane> planes_;

 private:
  const int index_;

 protected:
  int64_t held_back_ = 0;                                   // see set_held_back
  const absl::flat_hash_set<int64_t>* evicting_ = nullptr;  // see set_evicting
};

// One Entry per sequence id: a hash map for the lookups of the request path, with the same ids
// kept in order beside it for paged listings (LayerGroup::LiveFrom). Only the creation and the
// erasure of an entry touch the ordered set (O(log n) each, about 12 bytes per id); the map's
// interface is the subset of absl::flat_hash_map's that the groups use.
template <typename Entry>
class SequenceMap {
 public:
  using Map = absl::flat_hash_map<int64_t, Entry>;
  using iterator = typename Map::iterator;
  using const_iterator = typename Map::const_iterator;

  iterator begin() { return map_.begin(); }
  iterator end() { return map_.end(); }
  const_iterator begin() const { return map_.begin(); }
  const_iterator end() const { return map_.end(); }
  iterator find(int64_t seq) { return map_.find(seq); }
  const_iterator find(int64_t seq) const { return map_.find(seq); }
  bool contains(int64_t seq) const { return map_.contains(seq); }
  Entry& at(int64_t seq) { return map_.at(seq); }
  const Entry& at(int64_t seq) const { return map_.at(seq); }
  size_t size() const { return map_.size(); }

  // The entry of `seq`, default-constructed when it has none.
  Entry& operator[](int64_t seq) {
    auto [it, inserted] = map_.try_emplace(seq);
    if (inserted) order_.insert(seq);
    return it->second;
  }
  template <typename... Args>
  std::pair<iterator, bool> emplace(int64_t seq, Args&&... args) {
    auto result = map_.try_emplace(seq, std::forward<Args>(args)...);
    if (result.second) order_.insert(seq);
    return result;
  }
  void erase(iterator it) {
    order_.erase(it->first);
    map_.erase(it);
  }

  // Appends the first `limit` ids >= `first` to *out, ascending.
  void IdsFrom(int64_t first, size_t limit, std::vector<int64_t>* out) const {
    for (auto it = order_.lower_bound(first); it != order_.end() && limit > 0; ++it, --limit) {
      out->push_back(*it);
    }
  }

 private:
  Map map_;
  absl::btree_set<int64_t> order_;
};

// A LayerGroup whose metadata is one Entry per sequence, kept exactly while the group holds
// anything for the sequence: each kind erases a sequence's entry when it empties it, so the
// map answers Has, AddLive, LiveCount and LiveFrom.
// A reservation whose rows are rows of planes of one arena (the group's cells, a staging ring
// or slot, a chunk of its own): Write, WriteRows, InHostMemory and cells() for every kind. The
// arena and planes must outlive every call of those.
class RowsReservation : public LayerGroup::Reservation {
 public:
  absl::Status Write(const uint8_t* section) const override {
    return device_->Scatter(*arena_, *planes_, rows_, section);
  }
  absl::Status WriteRows(size_t plane, size_t first_row, size_t num_rows,
                         const uint8_t* src) const override {
    return device_->Scatter(*arena_, absl::MakeConstSpan(&(*planes_)[plane], 1),
                            absl::MakeConstSpan(rows_).subspan(first_row, num_rows), src);
  }
  bool InHostMemory() const override { return device_->HostAddress(*arena_) != nullptr; }
  absl::Span<const int32_t> cells() const override { return rows_; }

 protected:
  RowsReservation(Device* device, const DeviceArena* arena, const std::vector<Plane>* planes)
      : device_(device), arena_(arena), planes_(planes) {}
  std::vector<int32_t> rows_;

 private:
  Device* const device_;
  const DeviceArena* const arena_;
  const std::vector<Plane>* const planes_;
};

template <typename Entry>
class SequenceMapGroup : public LayerGroup {
 public:
  bool Has(int64_t seq) const override { return seqs_.contains(seq); }
  void AddLive(absl::flat_hash_set<int64_t>* live) const override {
    for (const auto& [seq, entry] : seqs_) live->insert(seq);
  }
  size_t LiveCount() const override { return seqs_.size(); }
  void LiveFrom(int64_t first, size_t limit, std::vector<int64_t>* out) const override {
    seqs_.IdsFrom(first, limit, out);
  }

 protected:
  using LayerGroup::LayerGroup;

  // The entry of `seq`, or nullptr when the group holds nothing for it.
  const Entry* Find(int64_t seq) const {
    auto it = seqs_.find(seq);
    return it == seqs_.end() ? nullptr : &it->second;
  }

  SequenceMap<Entry> seqs_;
};

// What a StagingGroup keeps for every sequence; each kind adds where the committed data lives.
struct StagedSequence {
  int32_t offset = 0;               // one past the last committed position
  std::vector<PendingRow> pending;  // the pending speculative tokens, ascending positions
};

// A group whose Append overwrites what a sequence stores (Rotating's ring rows, Recurrent's
// state), where a speculative token could not be taken back if rejected. So pending tokens are
// staged outside the arena, one row per token in chunks of the cache pool, and
// CommitSpeculation copies the accepted ones in.
template <typename Sequence>
class StagingGroup : public SequenceMapGroup<Sequence> {
  static_assert(std::is_base_of_v<StagedSequence, Sequence>);

 public:
  int32_t Offset(int64_t seq) const override {
    const Sequence* s = this->Find(seq);
    if (s == nullptr) return 0;
    return s->pending.empty() ? s->offset : s->pending.back().pos + 1;
  }
  void AddPendingChunks(absl::flat_hash_set<const RowChunk*>* chunks) const override {
    for (const auto& [seq, s] : this->seqs_) {
      for (const PendingRow& row : s.pending) chunks->insert(row.chunk.get());
    }
  }
  bool WritesInPlace(const AppendBatch& batch) const override {
    return !batch.speculative && in_place_;
  }

 protected:
  using SequenceMapGroup<Sequence>::SequenceMapGroup;

  // A speculative Append, whatever the kind, writes token i of the batch to row i of a new
  // chunk: these are its Prepare, Write and Commit halves (AbandonAppend resets spec_chunk_).
  absl::Status PrepareStagedAppend(const AppendBatch& batch) {
    absl::StatusOr<std::shared_ptr<RowChunk>> chunk = this->NewChunk(
        MemoryPool::kCache, static_cast<int32_t>(batch.tokens.size()), batch.in_place);
    if (!chunk.ok()) return chunk.status();
    spec_chunk_ = *std::move(chunk);
    return absl::OkStatus();
  }
  absl::Status WriteStagedAppend(const AppendBatch& batch, const uint8_t* section) {
    std::vector<int32_t> rows(batch.tokens.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i);
    return this->device_->Scatter(spec_chunk_->arena, spec_chunk_->planes, rows, section);
  }
  void CommitStagedAppend(const AppendBatch& batch) {
    for (size_t i = 0; i < batch.tokens.size(); ++i) {
      const Token& t = batch.tokens[i];
      this->seqs_[t.seq].pending.push_back(PendingRow{spec_chunk_, static_cast<int32_t>(i), t.pos});
    }
    spec_chunk_.reset();
  }

  // A speculative batch's reservation: token i's rows are row i of the chunk PrepareAppend
  // allocated (shareable for an in-place plan), which Commit makes the tokens' pending rows.
  class SpeculativeReservation final : public RowsReservation {
   public:
    SpeculativeReservation(StagingGroup* group, std::shared_ptr<RowChunk> chunk, size_t rows)
        : RowsReservation(group->device_, &chunk->arena, &chunk->planes),
          group_(group),
          chunk_(std::move(chunk)) {
      for (size_t i = 0; i < rows; ++i) rows_.push_back(static_cast<int32_t>(i));
    }
    const RowChunk* staging() const override { return chunk_.get(); }
    absl::Status Commit(const AppendBatch& batch) override {
      group_->spec_chunk_ = std::move(chunk_);
      group_->CommitStagedAppend(batch);
      return absl::OkStatus();
    }
    void Abandon() override { chunk_.reset(); }

   private:
    StagingGroup* const group_;
    std::shared_ptr<RowChunk> chunk_;
  };
  // After a speculative PrepareAppend: its chunk, as a reservation.
  std::unique_ptr<LayerGroup::Reservation> ReserveSpeculative(const AppendBatch& batch) {
    return std::make_unique<SpeculativeReservation>(this, std::move(spec_chunk_),
                                                    batch.tokens.size());
  }

  // The Append in progress: whether it overwrites stored data (each kind's PrepareAppend sets
  // this for a non-speculative batch), and a speculative one's chunk.
  bool in_place_ = false;
  std::shared_ptr<RowChunk> spec_chunk_;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_LAYER_GROUP_H_
