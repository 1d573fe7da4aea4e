#include "cache/recurrent_group.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "cache/shortage.h"
#include "cache/status_macros.h"

namespace kvmesh {

RecurrentGroup::RecurrentGroup(int index, const CacheSpec& spec, DeviceArena arena, Device* device)
    : StagingGroup(index, std::move(arena), device),
      geo_(ComputeRecurrentGeometry(spec, index)),
      refs_(static_cast<size_t>(geo_.slots), 0),
      pins_(static_cast<size_t>(geo_.slots), 0) {
  // Arena layout: for each layer, [slots][conv + delta].
  const size_t layer_bytes = geo_.conv_bytes + geo_.delta_bytes;
  for (int32_t l = 0; l < spec.groups[index].num_layers; ++l) {
    planes_.push_back(Plane{size_t(l) * size_t(geo_.slots) * layer_bytes, layer_bytes});
  }
  free_.reserve(geo_.slots);
  for (int32_t s = geo_.slots - 1; s >= 0; --s) free_.push_back(s);
}

GroupSequenceInfo RecurrentGroup::Info(int64_t seq) const {
  GroupSequenceInfo g;
  const Sequence* s = Find(seq);
  if (s == nullptr) return g;
  g.shared = s->slot >= 0 && refs_[s->slot] > 1 ? 1 : 0;
  g.state = s->valid || !s->pending.empty() ? StateStatus::kValid : StateStatus::kInvalid;
  return g;
}

GroupUsage RecurrentGroup::Usage() const {
  GroupUsage g;
  g.cells_total = geo_.slots;
  g.cells_used = geo_.slots - static_cast<int64_t>(free_.size());
  g.memory = kUnlimitedMemory;
  g.bytes = arena_.size();
  return g;
}

int64_t RecurrentGroup::SharedCellCount() const {
  int64_t shared = 0;
  for (const int32_t refs : refs_) shared += refs > 1;
  return shared;
}

int32_t RecurrentGroup::TakeSlot() {
  const int32_t slot = free_.back();
  free_.pop_back();
  refs_[slot] = 1;
  return slot;
}

void RecurrentGroup::ReleaseSlot(int32_t slot) {
  if (slot >= 0 && --refs_[slot] == 0 && pins_[slot] == 0) free_.push_back(slot);
}

void RecurrentGroup::Drop(int64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  ReleaseSlot(it->second.slot);
  seqs_.erase(it);
}

int32_t RecurrentGroup::MakeWritable(Sequence* s) {
  if (s->slot >= 0 && Holders(s->slot) == 1) return s->slot;
  ReleaseSlot(s->slot);
  s->slot = TakeSlot();
  return s->slot;
}

// ---- Append -------------------------------------------------------------------------------

absl::Status RecurrentGroup::PrepareAppend(const AppendBatch& batch) {
  if (batch.speculative) return PrepareStagedAppend(batch);
  PlanWrites(batch);
  size_t needed = 0;
  for (const Write& w : writes_) needed += w.slot < 0;
  // A write that keeps its sequence's slot overwrites the stored state.
  in_place_ = writes_.size() > needed;
  // held_back_: 0, or less while the cache weighs an eviction (Cache's LRU policy).
  const int64_t free = static_cast<int64_t>(free_.size()) - held_back_;
  if (static_cast<int64_t>(needed) > free) {
    writes_.clear();
    return ResourceExhaustedWith(
        absl::StrCat("group ", index(), ": the batch needs ", needed, " new state slots; ", free,
                     " of ", geo_.slots, " are free"),
        {Resource::kStateSlots, index(), static_cast<int64_t>(needed), std::max<int64_t>(0, free),
         geo_.slots});
  }
  return absl::OkStatus();
}

void RecurrentGroup::PlanWrites(const AppendBatch& batch) {
  // A private slot is overwritten in place. A shared one is left to the sequences that keep
  // it: a writer moves to a fresh slot, except that when every sharer writes in this batch the
  // last of them may keep the old slot (it is then private).
  absl::flat_hash_map<int32_t, int32_t> remaining;  // slot -> sharers not yet moved
  writes_.clear();
  for (int64_t seq : batch.seqs) {
    const Sequence* s = Find(seq);
    const int32_t old = s == nullptr ? -1 : s->slot;
    if (old < 0) {
      writes_.push_back(Write{seq, -1, -1});
      continue;
    }
    auto [it, inserted] = remaining.emplace(old, Holders(old));
    if (it->second == 1) {
      writes_.push_back(Write{seq, old, -1});
    } else {
      --it->second;
      writes_.push_back(Write{seq, -1, old});
    }
  }
  // A sharer outside the batch keeps the slot: then every writer of it moved, as planned.
}

size_t RecurrentGroup::SectionBytes(const AppendBatch& batch) const {
  return geo_.state_bytes * (batch.speculative ? batch.tokens.size() : batch.seqs.size());
}

absl::Status RecurrentGroup::WriteAppend(const AppendBatch& batch, const uint8_t* section) {
  if (batch.speculative) return WriteStagedAppend(batch, section);
  std::vector<int32_t> slots;
  for (Write& w : writes_) {
    if (w.slot < 0) {
      w.slot = TakeSlot();
      w.fresh = true;
    }
    slots.push_back(w.slot);
  }
  return device_->Scatter(arena_, planes_, slots, section);
}

void RecurrentGroup::CommitAppend(const AppendBatch& batch) {
  if (batch.speculative) {
    CommitStagedAppend(batch);
    return;
  }
  absl::flat_hash_map<int64_t, int32_t> last;
  for (const Token& t : batch.tokens) last[t.seq] = t.pos;
  for (const Write& w : writes_) {
    Sequence& s = seqs_[w.seq];
    if (w.slot != s.slot) {
      ReleaseSlot(s.slot);
      s.slot = w.slot;
    }
    s.offset = last[w.seq] + 1;
    s.valid = true;
  }
  writes_.clear();
}

void RecurrentGroup::AbandonAppend() {
  for (const Write& w : writes_) {
    if (w.fresh) ReleaseSlot(w.slot);
  }
  writes_.clear();
  spec_chunk_.reset();
}

// A plan writes each batch sequence's state into a fresh slot (in batch.seqs order), which the
// sequence takes at Commit.
class RecurrentGroup::StagedReservation final : public RowsReservation {
 public:
  StagedReservation(RecurrentGroup* group, const AppendBatch& batch)
      : RowsReservation(group->device_, &group->arena_, &group->planes_), group_(group) {
    for (size_t k = 0; k < batch.seqs.size(); ++k) rows_.push_back(group->TakeSlot());
  }
  ~StagedReservation() override { Abandon(); }

  absl::Status Commit(const AppendBatch& batch) override {
    absl::flat_hash_map<int64_t, int32_t> last;
    for (const Token& t : batch.tokens) last[t.seq] = t.pos;
    for (size_t k = 0; k < batch.seqs.size(); ++k) {
      Sequence& s = group_->seqs_[batch.seqs[k]];
      group_->ReleaseSlot(s.slot);
      s.slot = rows_[k];
      s.offset = last[batch.seqs[k]] + 1;
      s.valid = true;
    }
    rows_.clear();
    return absl::OkStatus();
  }
  void Abandon() override {
    for (const int32_t slot : rows_) group_->ReleaseSlot(slot);
    rows_.clear();
  }

 private:
  RecurrentGroup* const group_;
};

absl::Status RecurrentGroup::CheckReserve(const AppendBatch& batch) const {
  if (batch.speculative) return absl::OkStatus();  // its chunk, from PrepareAppend
  const int64_t free = static_cast<int64_t>(free_.size()) - held_back();
  const int64_t needed = static_cast<int64_t>(batch.seqs.size());
  if (needed > free) {
    return ResourceExhaustedWith(
        absl::StrCat("group ", index(),
                     " is Recurrent: an Append plan writes each sequence's new "
                     "state into a free state slot; the batch has ",
                     needed, " sequences and ", std::max<int64_t>(0, free), " of ", geo_.slots,
                     " slots are free (the others hold states, pinned states or other plans' "
                     "states)"),
        {Resource::kStateSlots, index(), needed, std::max<int64_t>(0, free), geo_.slots});
  }
  return absl::OkStatus();
}

absl::Status RecurrentGroup::CheckRoomForPositions(int64_t seq, int64_t) const {
  // Whatever the positions: an imported sequence brings its state.
  if (!NeedsSlot(Find(seq)) || FreeSlots() > 0) return absl::OkStatus();
  return ResourceExhaustedWith(
      absl::StrCat("group ", index(), ": no free state slot for sequence ", seq,
                   " (slots that local workers pin or stage into are not free)"),
      {Resource::kStateSlots, index(), 1, 0, geo_.slots});
}

std::unique_ptr<LayerGroup::Reservation> RecurrentGroup::ReserveAppend(const AppendBatch& batch) {
  writes_.clear();  // PrepareAppend's plan for WriteAppend: a reservation writes elsewhere
  if (batch.speculative) return ReserveSpeculative(batch);
  return std::make_unique<StagedReservation>(this, batch);
}

absl::Status RecurrentGroup::CheckCommitSpeculation(int64_t seq, int32_t accepted) const {
  const Sequence* s = Find(seq);
  if (accepted == 0 || s == nullptr || !NeedsSlot(s) || FreeSlots() > 0) return absl::OkStatus();
  return ResourceExhaustedWith(
      absl::StrCat("group ", index(), ": no free state slot for sequence ", seq,
                   " to commit its accepted tokens (slots that local workers pin or stage into "
                   "are not free)"),
      {Resource::kStateSlots, index(), 1, 0, geo_.slots});
}

absl::Status RecurrentGroup::CommitSpeculation(int64_t seq, absl::Span<const int32_t> pending,
                                               int32_t accepted) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::OkStatus();
  Sequence& s = it->second;
  std::vector<PendingRow> rows = std::move(s.pending);
  s.pending.clear();
  absl::Status status;
  if (accepted > 0) {
    if (NeedsSlot(&s) && free_.empty()) {
      return absl::InternalError(
          absl::StrCat("group ", index(), ": no free state slot for ", "sequence ", seq));
    }
    const PendingRow& row = rows[accepted - 1];
    const int32_t slot = MakeWritable(&s);
    const int32_t src = row.row;
    status = CopyFromChunk(*row.chunk, {&src, 1}, {&slot, 1});
    s.offset = row.pos + 1;
    s.valid = true;
  }
  if (s.offset == 0) Drop(seq);
  return status;
}

// ---- Read / CanResume ---------------------------------------------------------------------

ReadPart RecurrentGroup::PlanRead(int64_t seq, int64_t begin, int64_t end,
                                  int32_t seq_offset) const {
  ReadPart part;
  const Sequence* s = Find(seq);
  if (s == nullptr || end < seq_offset) return part;
  if (!s->pending.empty()) {
    part.rows.push_back(-static_cast<int32_t>(s->pending.size()));  // the last pending state
  } else if (s->valid) {
    part.rows.push_back(s->slot);
  } else {
    part.state = StateStatus::kInvalid;
    return part;
  }
  part.state = StateStatus::kValid;
  part.bytes = geo_.state_bytes;
  return part;
}

absl::Status RecurrentGroup::Gather(int64_t seq, const ReadPart& part, uint8_t* dst) const {
  if (part.rows.empty()) return absl::OkStatus();
  const int32_t row = part.rows[0];
  if (row >= 0) return device_->Gather(arena_, planes_, {&row, 1}, dst);
  const PendingRow& pending = Find(seq)->pending[-row - 1];
  return device_->Gather(pending.chunk->arena, pending.chunk->planes, {&pending.row, 1}, dst);
}

bool RecurrentGroup::CanResume(int64_t seq, int32_t pos) const {
  const Sequence* s = Find(seq);
  if (s == nullptr) return pos == 0;
  if (!s->pending.empty()) return pos == Offset(seq);
  return pos == s->offset && s->valid;
}

// ---- CopyPrefix ---------------------------------------------------------------------------

absl::Status RecurrentGroup::CheckCopyPrefix(int64_t src, int64_t dst, int32_t length) const {
  const Sequence* s = Find(src);
  if (s == nullptr || length >= s->offset) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "group ", index(), " is Recurrent: sequence ", src, "'s state exists only at its offset ",
      s->offset, ", so a prefix of length ", length, " cannot be copied"));
}

bool RecurrentGroup::CopyPrefixYields(int64_t src, int32_t length) const {
  const Sequence* s = Find(src);
  return s != nullptr && length >= s->offset;
}

absl::Status RecurrentGroup::ApplyCopyPrefix(int64_t src, int64_t dst, int32_t length) {
  Drop(dst);
  const Sequence* s = Find(src);
  if (s == nullptr) return absl::OkStatus();
  Sequence copy;
  copy.slot = s->slot;
  copy.offset = s->offset;
  copy.valid = s->valid;
  if (copy.slot >= 0) ++refs_[copy.slot];
  seqs_.emplace(dst, std::move(copy));
  return absl::OkStatus();
}

// ---- Remove -------------------------------------------------------------------------------

absl::Status RecurrentGroup::ApplyRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || begin >= it->second.offset) return absl::OkStatus();
  Sequence& s = it->second;
  const int32_t removed = (end.has_value() ? std::min(*end, s.offset) : s.offset) - begin;
  s.offset -= removed;
  if (s.offset == 0) {
    Drop(seq);
    return absl::OkStatus();
  }
  // The state summarizes every position before the offset; with some of them gone it describes
  // nothing that exists any more.
  ReleaseSlot(s.slot);
  s.slot = -1;
  s.valid = false;
  return absl::OkStatus();
}

// ---- Snapshots ----------------------------------------------------------------------------

absl::Status RecurrentGroup::CheckSnapshot(int64_t seq, int32_t from) const {
  const Sequence* s = Find(seq);
  if (s != nullptr && s->valid) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "group ", index(), " is Recurrent and sequence ", seq,
      s == nullptr ? " has no state" : "'s state is INVALID (a removal below its offset)",
      "; there is nothing to snapshot"));
}

absl::StatusOr<GroupSnapshot> RecurrentGroup::TakeSnapshot(int64_t seq, int32_t from,
                                                           int32_t to) const {
  GroupSnapshot snap;
  snap.row_bytes = geo_.state_bytes;
  const Sequence* s = Find(seq);
  RETURN_IF_ERROR(AddSnapshotSegment({&s->slot, 1}, {}, &snap));
  snap.has_state = true;
  return snap;
}

absl::Status RecurrentGroup::CheckRestore(int64_t seq, const GroupSnapshot* snap, int32_t from,
                                          int32_t to, int32_t target) const {
  const Sequence* s = Find(seq);
  if (snap == nullptr) {
    const int32_t offset = s == nullptr ? 0 : s->offset;
    if (target != offset) {
      return absl::FailedPreconditionError(
          absl::StrCat("group ", index(), " is Recurrent: its state cannot be rewound from offset ",
                       offset, " to ", target, " without a snapshot"));
    }
    return absl::OkStatus();
  }
  if (target != to) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", index(), " is Recurrent: the snapshot's state belongs to offset ",
                     to, ", so it can only be restored with target ", to, ", not ", target));
  }
  if (!snap->has_state) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", index(), ": the snapshot holds no recurrent state"));
  }
  if (NeedsSlot(s) && FreeSlots() <= 0) {
    return ResourceExhaustedWith(
        absl::StrCat("group ", index(), ": no free state slot for sequence ", seq),
        {Resource::kStateSlots, index(), 1, 0, geo_.slots});
  }
  return absl::OkStatus();
}

absl::Status RecurrentGroup::ApplyRestore(int64_t seq, const GroupSnapshot* snap, int32_t from,
                                          int32_t to, int32_t target) {
  if (snap == nullptr) return absl::OkStatus();
  Sequence& s = seqs_[seq];
  const int32_t slot = MakeWritable(&s);
  s.offset = to;
  s.valid = true;
  const Segment& segment = snap->segments.front();
  return CopyFromChunk(*segment.chunk, {&segment.first_row, 1}, {&slot, 1});
}

// ---- Pins ---------------------------------------------------------------------------------

absl::Status RecurrentGroup::CheckPin(int64_t seq, int64_t from, int64_t to) const {
  const Sequence* s = Find(seq);
  if (s == nullptr || s->pending.empty() || to <= s->offset) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "group ", index(), " is Recurrent and sequence ", seq,
      "'s state after its speculative "
      "positions is pending outside the state slots: commit the speculation, or pin below ",
      s->offset));
}

GroupSnapshot RecurrentGroup::PinSequence(int64_t seq, int64_t from, int64_t to,
                                          std::vector<int32_t>* pinned) {
  GroupSnapshot snap;
  snap.row_bytes = geo_.state_bytes;
  const Sequence* s = Find(seq);
  // The state summarizes every position below the offset: a pin reaching the offset holds it.
  if (s == nullptr || !s->valid || s->slot < 0 || to < s->offset || from >= s->offset) {
    return snap;
  }
  Segment segment;
  segment.positions.push_back(s->offset - 1);
  segment.chunk_rows.push_back(s->slot);
  segment.rows = 1;
  ++pins_[s->slot];
  pinned->push_back(s->slot);
  snap.segments.push_back(std::move(segment));
  snap.has_state = true;
  return snap;
}

void RecurrentGroup::Unpin(absl::Span<const int32_t> slots) {
  for (const int32_t slot : slots) {
    if (--pins_[slot] == 0 && refs_[slot] == 0) free_.push_back(slot);
  }
}

}  // namespace kvmesh
