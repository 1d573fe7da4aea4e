// RecurrentGroup: one Recurrent layer group of a Cache (lfm2_hybrid_cache.go's conv slots and
// mlx_recurrent_cache.go's gated-delta state). Each sequence has at most one state slot: conv
// [conv_tail][conv_dim] in dtype and delta [num_v_heads][head_v_dim][head_k_dim] in float32 per
// layer. Slots are reference-counted; CopyPrefix shares a slot copy-on-write and the next write
// to either sequence goes to a private slot. A state cannot be rewound: a removal below the
// offset marks it INVALID (and frees the slot) rather than zeroing it.
//
// A local worker's pin holds a slot as a sharer does, so the next write to its sequence goes to
// a fresh slot; a worker's Append plan writes each sequence's new state into a free slot, which
// becomes the sequence's at Commit (the old one is released): no copy either way.
//
// Thread safety: none. The owning Cache serializes access under its lock.
#ifndef KVMESH_CACHE_RECURRENT_GROUP_H_
#define KVMESH_CACHE_RECURRENT_GROUP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "cache/device/device.h"
#include "cache/layer_group.h"
#include "cache/spec.h"

namespace kvmesh {

// What a RecurrentGroup keeps for a sequence: offset is the position its committed state
// belongs to, and each pending token carries the state after it.
struct RecurrentSequence : StagedSequence {
  int32_t slot = -1;  // -1: no state (invalidated, or only pending tokens so far)
  bool valid = false;
};

class RecurrentGroup final : public StagingGroup<RecurrentSequence> {
 public:
  RecurrentGroup(int index, const CacheSpec& spec, DeviceArena arena, Device* device);

  GroupKind kind() const override { return GroupKind::kRecurrent; }
  // One state slot per possible sequence (max_sequences of them), at most one per live
  // sequence: a room reservation's sequence slot (Cache::Reserve) keeps one for it, so the group
  // holds nothing back itself.
  int64_t UnitsToGrow(int64_t, int32_t) const override { return 0; }
  int64_t FreeUnits() const override { return static_cast<int64_t>(free_.size()); }
  GroupSequenceInfo Info(int64_t seq) const override;
  GroupUsage Usage() const override;
  int64_t SharedCellCount() const override;

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
  std::vector<int32_t> Visible(const Query&) const override { return {}; }
  int64_t VisibleBound(const Query&) const override { return 0; }
  bool CanResume(int64_t seq, int32_t pos) const override;

  absl::Status CheckCopyPrefix(int64_t src, int64_t dst, int32_t length) const override;
  absl::Status CheckRoomForPositions(int64_t seq, int64_t positions) const override;
  bool CopyPrefixYields(int64_t src, int32_t length) const override;
  absl::Status ApplyCopyPrefix(int64_t src, int64_t dst, int32_t length) override;

  void TallyEviction(int64_t seq, EvictionTally* tally) const override {
    const Sequence* s = Find(seq);
    if (s != nullptr && s->slot >= 0 && ++tally->refs[s->slot] == refs_[s->slot] &&
        pins_[s->slot] == 0) {
      ++tally->units;
    }
  }
  absl::Status CheckRemove(int64_t, int32_t, std::optional<int32_t>) const override {
    return absl::OkStatus();
  }
  absl::Status ApplyRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) override;

  absl::Status CheckSnapshot(int64_t seq, int32_t from) const override;
  absl::StatusOr<GroupSnapshot> TakeSnapshot(int64_t seq, int32_t from, int32_t to) const override;
  absl::Status CheckRestore(int64_t seq, const GroupSnapshot* snap, int32_t from, int32_t to,
                            int32_t target) const override;
  absl::Status ApplyRestore(int64_t seq, const GroupSnapshot* snap, int32_t from, int32_t to,
                            int32_t target) override;

  bool PinsInPlace() const override { return true; }
  absl::Status CheckPin(int64_t seq, int64_t from, int64_t to) const override;
  GroupSnapshot PinSequence(int64_t seq, int64_t from, int64_t to,
                            std::vector<int32_t>* pinned) override;
  void Unpin(absl::Span<const int32_t> slots) override;

 private:
  using Sequence = RecurrentSequence;
  class StagedReservation;

  // Free slots less those held back (more, while an eviction is weighed).
  int64_t FreeSlots() const { return static_cast<int64_t>(free_.size()) - held_back(); }
  // Sequences and pins holding a slot.
  int32_t Holders(int32_t slot) const { return refs_[slot] + pins_[slot]; }
  // Whether writing `s`'s state needs a new slot (none yet, or shared copy-on-write, or pinned).
  bool NeedsSlot(const Sequence* s) const {
    return s == nullptr || s->slot < 0 || Holders(s->slot) > 1;
  }
  int32_t TakeSlot();
  void ReleaseSlot(int32_t slot);
  void Drop(int64_t seq);
  // Points `s` at a slot it may overwrite: its own private one, or a fresh one (the shared one
  // loses a reference).
  int32_t MakeWritable(Sequence* s);

  const RecurrentGeometry geo_;

  std::vector<int32_t> refs_;  // per slot: the sequences (or a staging reservation) holding it
  std::vector<int32_t> pins_;  // per slot: the pins local workers hold on it
  std::vector<int32_t> free_;

  // The Append in progress: per batch sequence, the slot written (-1 until WriteAppend takes a
  // fresh one) and the shared slot it leaves (-1 when none).
  struct Write {
    int64_t seq;
    int32_t slot;
    int32_t old_slot;
    bool fresh = false;  // taken by WriteAppend
  };
  void PlanWrites(const AppendBatch& batch);
  std::vector<Write> writes_;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_RECURRENT_GROUP_H_
