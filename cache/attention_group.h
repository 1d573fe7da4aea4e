// AttentionGroup: the storage and metadata of one Attention layer group of a Cache
// (kvcache_causal.go's Causal: full, sliding-window and chunked attention).
//
// Cells form a pool shared by all sequences. Each cell holds one token's K and V in every layer
// of the group and a reference count: the number of sequences whose index points at it. A cell
// is free at count zero. Each sequence has an ordered index position -> cell kept as runs
// (RunIndex), so every operation costs in proportion to the runs and cells it touches, never to
// the pool size, and a prefix copy shares whole runs. Cells are taken from the free pool in
// ascending order, so a sequence appended in one piece is held in consecutive cells: one run.
//
// Pending speculative tokens are ordinary cells; sliding-window pruning stops short of what a
// rejected speculation would need (AppendBatch::pending_first).
//
// Thread safety: none. The owning Cache serializes access under its lock.
#ifndef KVMESH_CACHE_ATTENTION_GROUP_H_
#define KVMESH_CACHE_ATTENTION_GROUP_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "cache/device/device.h"
#include "cache/layer_group.h"
#include "cache/run_index.h"
#include "cache/spec.h"
#include "cache/types.h"

namespace kvmesh {

class AttentionGroup final : public SequenceMapGroup<RunIndex> {
 public:
  using Index = RunIndex;  // position -> cell

  AttentionGroup(int index, const CacheSpec& spec, DeviceArena arena, Device* device);

  // LayerGroup:
  GroupKind kind() const override { return GroupKind::kAttention; }
  int32_t Offset(int64_t seq) const override;
  GroupSequenceInfo Info(int64_t seq) const override;
  GroupUsage Usage() const override;
  int64_t SharedCellCount() const override;
  absl::Status PrepareAppend(const AppendBatch& batch) override;
  size_t SectionBytes(const AppendBatch& batch) const override {
    return PayloadBytes(batch.tokens.size());
  }
  bool WritesInPlace(const AppendBatch&) const override { return false; }
  absl::Status WriteAppend(const AppendBatch& batch, const uint8_t* section) override;
  void CommitAppend(const AppendBatch& batch) override;
  void AbandonAppend() override;
  bool SupportsReservedAppend() const override { return true; }
  bool CellsInHostMemory() const override;
  std::unique_ptr<Reservation> ReserveAppend(const AppendBatch& batch) override;
  bool CanReserveWithoutPruning(const AppendBatch& batch) const override {
    return free_cells() >= static_cast<int64_t>(batch.tokens.size());
  }
  absl::Status CheckReserve(const AppendBatch& batch) const override {
    if (CanReserveWithoutPruning(batch)) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("group ", index(), ": the batch's ", batch.tokens.size(),
                     " tokens need as many free cells "
                     "and ",
                     free_cells(),
                     " are free: it has room only by pruning its window, which a plan "
                     "does not do; Append it through gRPC"));
  }
  absl::Status RecheckAppend(const AppendBatch& batch) const override;
  absl::Status CommitSpeculation(int64_t seq, absl::Span<const int32_t> pending,
                                 int32_t accepted) override;
  ReadPart PlanRead(int64_t seq, int64_t begin, int64_t end, int32_t seq_offset) const override;
  absl::Status Gather(int64_t seq, const ReadPart& part, uint8_t* dst) const override;
  std::vector<int32_t> Visible(const Query& query) const override;
  int64_t VisibleBound(const Query& query) const override;
  void VisibleRanges(const Query& query, std::vector<PositionRange>* out) const override;
  int64_t VisibleRangesBound(const Query& query) const override;
  bool CanResume(int64_t seq, int32_t pos) const override;
  absl::Status CheckCopyPrefix(int64_t, int64_t, int32_t) const override {
    return absl::OkStatus();
  }
  bool CopyPrefixYields(int64_t src, int32_t length) const override {
    return HasPrefix(src, length);
  }
  absl::Status ApplyCopyPrefix(int64_t src_seq, int64_t dst_seq, int32_t length) override;
  absl::Status CheckRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) const override;
  absl::Status ApplyRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) override;
  absl::StatusOr<GroupSnapshot> TakeSnapshot(int64_t seq, int32_t from, int32_t to) const override;
  absl::Status CheckRoomForPositions(int64_t seq, int64_t positions) const override;
  absl::Status CheckRestore(int64_t seq, const GroupSnapshot* snap, int32_t from, int32_t to,
                            int32_t target) const override;
  absl::Status ApplyRestore(int64_t seq, const GroupSnapshot* snap, int32_t from, int32_t to,
                            int32_t target) override;
  bool LendsCells() const override { return true; }
  GroupSnapshot PinSequence(int64_t seq, int64_t from, int64_t to,
                            std::vector<int32_t>* pinned) override;
  std::vector<int32_t> PinFreeCells(int64_t n) override;
  void Unpin(absl::Span<const int32_t> cells) override;
  void TallyEviction(int64_t seq, EvictionTally* tally) const override;

  const AttentionGeometry& geometry() const { return geo_; }
  const AttentionSpec& spec() const { return spec_; }
  // Cells the operation under way may take: the free ones less those held back for other
  // sequences' room reservations (set_held_back).
  int64_t free_cells() const { return std::max<int64_t>(0, raw_free_cells() - held_back_); }
  // Cells no sequence references and nothing pins.
  int64_t raw_free_cells() const { return int64_t(free_.size()) + (geo_.cells - next_fresh_); }
  int64_t UnitsToGrow(int64_t seq, int32_t positions) const override;
  int64_t FreeUnits() const override { return raw_free_cells(); }
  size_t arena_bytes() const { return arena_.size(); }

  // Stored positions of `seq` in [begin, end) and their cells.
  void Collect(int64_t seq, int64_t begin, int64_t end, std::vector<int32_t>* positions,
               std::vector<int32_t>* cells) const;
  size_t PayloadBytes(size_t num_tokens) const;

  // Whether src has any stored position < length.
  bool HasPrefix(int64_t src_seq, int32_t length) const;

 private:
  struct AppendPlan {
    std::vector<std::pair<int64_t, int64_t>> prune;  // (seq, drop positions below this)
    absl::flat_hash_set<int64_t> pruned_pending;     // non-batch sequences pruned to `last`
    int64_t freed = 0;                               // cells the pruning frees
  };
  // The cells an Append took for its tokens, not yet in any sequence's index.
  struct TakenCells {
    std::vector<int32_t> cells;      // one per token of the batch, in order
    std::vector<int64_t> cell_seqs;  // the sequence of each
  };
  class AppendReservation;

  // Sliding-window pruning for a batch whose sequences have the given lowest positions;
  // sequences in `pending_first` are never pruned past (first pending - memory).
  AppendPlan PlanAppend(const absl::flat_hash_map<int64_t, int32_t>& batch_lowest,
                        const absl::flat_hash_map<int64_t, int32_t>& pending_first) const;
  // Appending is split so that Cache can write every group before committing any: WriteAppend
  // takes cells and scatters the rows into them; CommitAppend then prunes and indexes them, or
  // AbandonAppend gives them back. Cells come from the free pool first; only when it is short
  // does WriteAppend apply the plan's pruning early to reuse the cells it frees (then an
  // abandoned append leaves that pruning done, with metadata and data consistent).
  // Takes cells for the batch (pruning early by plan_ when short); returns whether it pruned.
  bool TakeCells(const AppendBatch& batch, TakenCells* taken);
  void IndexTakenCells(const AppendBatch& batch, TakenCells* taken);
  void ReturnTakenCells(TakenCells* taken);

  // Drops `seq`'s positions >= from (no device work).
  void Truncate(int64_t seq, int32_t from);
  // Cells of `seq` at positions >= from that no other sequence references.
  int64_t PrivateCellsFrom(int64_t seq, int32_t from) const;
  // Cells of index's positions in [begin, end) that are not Private (shared: other sequences or
  // a pin hold them too) or that are (!shared).
  int64_t CountCells(const Index& index, int64_t begin, int64_t end, bool shared) const;
  bool Private(int32_t cell) const { return refs_[cell] == 1 && pins_[cell] == 0; }
  void ApplyPrune(const AppendPlan& plan);
  // Every reference of a sequence to a cell is taken and dropped here, which keeps the shared
  // counts (shared_, shared_cells_) without ever visiting a sequence's positions: a cell with
  // one reference knows its holder from holders_, so the holder's count drops when the others
  // let go of the cell.
  int32_t TakeFreeCell();                       // REQUIRES: free_cells() > 0
  int32_t AllocateCell(int64_t seq);            // a free cell, referenced by seq only
  void RefCell(int32_t cell, int64_t seq);      // seq references a used cell too
  void ReleaseCell(int32_t cell, int64_t seq);  // seq drops its reference
  // Drops seq's positions in [begin, end) from its index, and ReleaseCell for their cells with
  // the counts summed. Freed cells go back so that they are taken again in ascending order.
  void DropRange(Index& index, int64_t seq, int64_t begin, int64_t end);
  void AddShared(int64_t seq, int32_t delta);
  bool limited_memory() const { return geo_.memory != kUnlimitedMemory; }

  const AttentionSpec spec_;
  const DType dtype_;
  const AttentionGeometry geo_;
  std::vector<Plane> k_planes_;  // K0, K1, ... of planes_ (K0, V0, K1, V1, ...)

  std::vector<int32_t> refs_;  // per cell: the sequences referencing it
  // Per cell, transfers that pinned it (LayerGroup::PinSequence, PinFreeCells). A cell is free
  // when neither a sequence nor a pin holds it; it may be written in place only when one
  // sequence and no pin does (Private).
  std::vector<int32_t> pins_;
  // Per cell, the XOR of the ids of the sequences referencing it: the holder when refs_ is 1.
  std::vector<uint64_t> holders_;
  absl::flat_hash_map<int64_t, int32_t> shared_;  // seq -> its cells with refs_ > 1; absent: 0
  int64_t shared_cells_ = 0;                      // cells with refs_ > 1
  std::vector<int32_t> free_;                     // released cells, reused first, from the back
  int64_t next_fresh_ = 0;                        // cells >= this have never been used
  // Sequences changed since their last prune as non-batch sequences (sliding groups only):
  // pruning a sequence outside the batch drops below last+1-memory, which cannot change
  // until the sequence does, so only these need looking at.
  absl::flat_hash_set<int64_t> prune_pending_;
  bool pruned_early_ = false;  // WriteAppend applied the plan's pruning already
  AppendPlan plan_;            // of the Append being prepared, or written under the lock
  TakenCells taken_;           // by the Append written under the lock
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_ATTENTION_GROUP_H_
