// RotatingGroup: one Rotating layer group of a Cache (mlx_cache.go's RotatingKVCache): each
// sequence owns a ring of max_size rows holding its last max_size committed tokens, position p
// in row p mod max_size. Pending speculative tokens stay outside the ring, in chunks of the
// cache pool, until CommitSpeculation copies the accepted ones in; a rejected token therefore
// never overwrites the window.
//
// A local worker's pin (PinSequence) holds a sequence's ring: a write to a pinned ring goes to a
// fresh ring that takes the window first, and the pinned one is freed at its last unpin. A
// worker's Append plan (ReserveAppend) stages its rows in a free ring, which Commit either
// adopts as the sequence's ring (copying the surviving window rows in) or copies the new rows
// from, whichever moves fewer rows.
//
// Thread safety: none. The owning Cache serializes access under its lock.
#ifndef KVMESH_CACHE_ROTATING_GROUP_H_
#define KVMESH_CACHE_ROTATING_GROUP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "cache/device/device.h"
#include "cache/layer_group.h"
#include "cache/spec.h"

namespace kvmesh {

// What a RotatingGroup keeps for a sequence: offset counts its committed tokens, so its window
// is [max(0, offset - max_size), offset).
struct RotatingSequence : StagedSequence {
  int32_t ring = -1;  // index of the ring, -1 while only pending tokens exist
};

class RotatingGroup final : public StagingGroup<RotatingSequence> {
 public:
  RotatingGroup(int index, const CacheSpec& spec, DeviceArena arena, Device* device);

  GroupKind kind() const override { return GroupKind::kRotating; }
  // One ring per possible sequence (max_sequences of them), at most one per live
  // sequence: a room reservation's sequence slot (Cache::Reserve) keeps one for it, so the group
  // holds nothing back itself.
  int64_t UnitsToGrow(int64_t, int32_t) const override { return 0; }
  // Rings pinned after their sequence left, and rings staging a plan's rows, are not free.
  int64_t FreeUnits() const override { return static_cast<int64_t>(free_rings_.size()); }
  GroupSequenceInfo Info(int64_t seq) const override;
  GroupUsage Usage() const override;

  absl::Status PrepareAppend(const AppendBatch& batch) override;
  size_t SectionBytes(const AppendBatch& batch) const override;
  absl::Status WriteAppend(const AppendBatch& batch, const uint8_t* section) override;
  void CommitAppend(const AppendBatch& batch) override;
  void AbandonAppend() override;
  bool SupportsInPlaceAppend() const override { return true; }
  absl::Status CheckReserve(const AppendBatch& batch) const override;
  std::unique_ptr<Reservation> ReserveAppend(const AppendBatch& batch) override;
  absl::Status CheckCommitSpeculation(int64_t seq, int32_t accepted) const override;
  absl::Status CommitSpeculation(int64_t seq, absl::Span<const int32_t> pending,
                                 int32_t accepted) override;

  ReadPart PlanRead(int64_t seq, int64_t begin, int64_t end, int32_t seq_offset) const override;
  absl::Status Gather(int64_t seq, const ReadPart& part, uint8_t* dst) const override;
  std::vector<int32_t> Visible(const Query& query) const override;
  int64_t VisibleBound(const Query& query) const override;
  int64_t VisibleRangesBound(const Query& query) const override;
  bool CanResume(int64_t seq, int32_t pos) const override;

  absl::Status CheckCopyPrefix(int64_t src, int64_t dst, int32_t length) const override;
  absl::Status CheckRoomForPositions(int64_t seq, int64_t positions) const override;
  bool CopyPrefixYields(int64_t src, int32_t length) const override;
  absl::Status ApplyCopyPrefix(int64_t src, int64_t dst, int32_t length) override;

  absl::Status CheckRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) const override;
  // A ring is one sequence's alone.
  void TallyEviction(int64_t seq, EvictionTally* tally) const override {
    const Sequence* s = Find(seq);
    if (s != nullptr && s->ring >= 0 && pins_[s->ring] == 0) ++tally->units;
  }
  absl::Status ApplyRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) override;

  absl::StatusOr<GroupSnapshot> TakeSnapshot(int64_t seq, int32_t from, int32_t to) const override;
  absl::Status CheckRestore(int64_t seq, const GroupSnapshot* snap, int32_t from, int32_t to,
                            int32_t target) const override;
  absl::Status ApplyRestore(int64_t seq, const GroupSnapshot* snap, int32_t from, int32_t to,
                            int32_t target) override;

  bool PinsInPlace() const override { return true; }
  absl::Status CheckPin(int64_t seq, int64_t from, int64_t to) const override;
  GroupSnapshot PinSequence(int64_t seq, int64_t from, int64_t to,
                            std::vector<int32_t>* pinned) override;
  void Unpin(absl::Span<const int32_t> rings) override;

 private:
  using Sequence = RotatingSequence;
  class StagedReservation;

  // Of what `query` sees: positions of the ring's window, and pending rows.
  std::pair<int64_t, int64_t> VisibleCounts(const Query& query) const;

  bool Wrapped(const Sequence& s) const { return s.offset > geo_.max_size; }
  int32_t WindowStart(const Sequence& s) const {
    return s.offset > geo_.max_size ? s.offset - geo_.max_size : 0;
  }
  int32_t Row(const Sequence& s, int32_t pos) const {
    return s.ring * geo_.max_size + pos % geo_.max_size;
  }
  // Bytes of one token over every layer (K and V).
  size_t TokenBytes() const { return planes_.size() / 2 * (geo_.k_row_bytes + geo_.v_row_bytes); }
  // Positions of `seq` (window, then pending) in [begin, end).
  std::vector<int32_t> Positions(const Sequence& s, int64_t begin, int64_t end) const;
  int32_t TakeRing();
  // Gives up a ring's owner (a sequence or a staging reservation); free once nothing pins it.
  void ReleaseRing(int32_t ring);
  void Drop(int64_t seq);  // forgets `seq` and releases its ring
  // Whether writing into `s`'s ring needs a fresh ring first (none yet, or pinned).
  // Free rings less those held back (more, while an eviction is weighed).
  int64_t FreeRings() const { return static_cast<int64_t>(free_rings_.size()) - held_back(); }
  bool NeedsRing(const Sequence* s) const {
    return s == nullptr || s->ring < 0 || pins_[s->ring] > 0;
  }
  // Copies the rows of positions [begin, end) from ring `from` to ring `to` (each position
  // keeps its row within the ring).
  absl::Status CopyWindow(int32_t from, int32_t to, int32_t begin, int32_t end);
  // Where `s`'s ring is pinned: moves `s` to a fresh ring holding its window, leaving the pinned
  // one to its readers (the caller checked that a ring is free). *old is the pinned ring, -1
  // when nothing moved.
  absl::Status MoveOffPinnedRing(Sequence* s, int32_t* old);
  absl::Status NoFreeRing(int64_t seq, absl::string_view why) const;

  const RotatingSpec spec_;
  const RotatingGeometry geo_;

  std::vector<int32_t> free_rings_;
  std::vector<int32_t> pins_;   // per ring: the pins local workers hold on it
  std::vector<uint8_t> owned_;  // per ring: a sequence or a staging reservation holds it

  // The Append in progress: sequences given a ring, and those moved off a pinned ring (with the
  // pinned one, released at CommitAppend or given back at AbandonAppend).
  std::vector<int64_t> new_rings_;
  std::vector<std::pair<int64_t, int32_t>> moved_;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_ROTATING_GROUP_H_
