#include "cache/rotating_group.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "cache/shortage.h"
#include "cache/status_macros.h"

namespace kvmesh {

RotatingGroup::RotatingGroup(int index, const CacheSpec& spec, DeviceArena arena, Device* device)
    : StagingGroup(index, std::move(arena), device),
      spec_(spec.groups[index].rotating),
      geo_(ComputeRotatingGeometry(spec, index)),
      pins_(static_cast<size_t>(geo_.rings), 0),
      owned_(static_cast<size_t>(geo_.rings), 0) {
  // Arena layout: for each layer, K [rings * max_size][k_row] then V [...][v_row].
  const size_t rows = size_t(geo_.rings) * size_t(geo_.max_size);
  size_t offset = 0;
  for (int32_t l = 0; l < spec.groups[index].num_layers; ++l) {
    planes_.push_back(Plane{offset, geo_.k_row_bytes});
    offset += rows * geo_.k_row_bytes;
    planes_.push_back(Plane{offset, geo_.v_row_bytes});
    offset += rows * geo_.v_row_bytes;
  }
  free_rings_.reserve(geo_.rings);
  for (int32_t r = geo_.rings - 1; r >= 0; --r) free_rings_.push_back(r);
}

GroupSequenceInfo RotatingGroup::Info(int64_t seq) const {
  GroupSequenceInfo g;
  const Sequence* s = Find(seq);
  if (s == nullptr) return g;
  const int32_t window = s->offset - WindowStart(*s);
  g.stored = window + static_cast<int32_t>(s->pending.size());
  if (g.stored > 0) {
    g.first = window > 0 ? WindowStart(*s) : s->pending.front().pos;
    g.last = Offset(seq) - 1;
  }
  return g;
}

GroupUsage RotatingGroup::Usage() const {
  GroupUsage g;
  g.cells_total = int64_t{geo_.rings} * geo_.max_size;
  for (const auto& [seq, s] : seqs_) g.cells_used += s.offset - WindowStart(s);
  g.memory = geo_.max_size;
  g.bytes = arena_.size();
  return g;
}

int32_t RotatingGroup::TakeRing() {
  const int32_t ring = free_rings_.back();
  free_rings_.pop_back();
  owned_[ring] = 1;
  return ring;
}

void RotatingGroup::ReleaseRing(int32_t ring) {
  if (ring < 0) return;
  owned_[ring] = 0;
  if (pins_[ring] == 0) free_rings_.push_back(ring);
}

void RotatingGroup::Drop(int64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  ReleaseRing(it->second.ring);
  seqs_.erase(it);
}

absl::Status RotatingGroup::CopyWindow(int32_t from, int32_t to, int32_t begin, int32_t end) {
  std::vector<int32_t> src, dst;
  for (int32_t p = begin; p < end; ++p) {
    src.push_back(from * geo_.max_size + p % geo_.max_size);
    dst.push_back(to * geo_.max_size + p % geo_.max_size);
  }
  if (src.empty()) return absl::OkStatus();
  return device_->CopyRows(arena_, planes_, src, dst);
}

absl::Status RotatingGroup::MoveOffPinnedRing(Sequence* s, int32_t* old) {
  *old = -1;
  if (s->ring < 0 || pins_[s->ring] == 0) return absl::OkStatus();
  const int32_t ring = TakeRing();
  *old = s->ring;
  s->ring = ring;
  return CopyWindow(*old, ring, WindowStart(*s), s->offset);
}

absl::Status RotatingGroup::NoFreeRing(int64_t seq, absl::string_view why) const {
  return ResourceExhaustedWith(
      absl::StrCat("group ", index(), ": no free ring for sequence ", seq, " (", why,
                   "; rings that local workers pin or stage into are not free)"),
      {Resource::kRings, index(), 1, 0, geo_.rings});
}

std::vector<int32_t> RotatingGroup::Positions(const Sequence& s, int64_t begin, int64_t end) const {
  std::vector<int32_t> out;
  for (int64_t p = std::max<int64_t>(begin, WindowStart(s)); p < std::min<int64_t>(end, s.offset);
       ++p) {
    out.push_back(static_cast<int32_t>(p));
  }
  for (const PendingRow& row : s.pending) {
    if (row.pos >= begin && row.pos < end) out.push_back(row.pos);
  }
  return out;
}

// ---- Append -------------------------------------------------------------------------------

absl::Status RotatingGroup::PrepareAppend(const AppendBatch& batch) {
  if (batch.speculative) return PrepareStagedAppend(batch);
  size_t needed = 0;
  in_place_ = false;
  for (int64_t seq : batch.seqs) {
    const Sequence* s = Find(seq);
    // A sequence without a ring takes one; one whose ring is pinned moves to a fresh one.
    needed += NeedsRing(s);
    // Writing into a ring that holds a window overwrites stored rows; a fresh ring holds none.
    in_place_ = in_place_ || !NeedsRing(s);
  }
  // held_back_: 0, or less while the cache weighs an eviction (Cache's LRU policy).
  const int64_t free = static_cast<int64_t>(free_rings_.size()) - held_back_;
  if (static_cast<int64_t>(needed) > free) {
    return ResourceExhaustedWith(absl::StrCat("group ", index(), ": the batch needs ", needed,
                                              " new rings; ", free, " are free"),
                                 {Resource::kRings, index(), static_cast<int64_t>(needed),
                                  std::max<int64_t>(0, free), geo_.rings});
  }
  return absl::OkStatus();
}

size_t RotatingGroup::SectionBytes(const AppendBatch& batch) const {
  return batch.tokens.size() * TokenBytes();
}

absl::Status RotatingGroup::WriteAppend(const AppendBatch& batch, const uint8_t* section) {
  if (batch.speculative) return WriteStagedAppend(batch, section);
  const absl::Span<const Token> tokens = batch.tokens;
  for (int64_t seq : batch.seqs) {
    Sequence& s = seqs_[seq];
    if (s.ring < 0) {
      s.ring = TakeRing();
      new_rings_.push_back(seq);
    } else if (pins_[s.ring] > 0) {
      int32_t old = -1;
      const absl::Status moved = MoveOffPinnedRing(&s, &old);
      moved_.emplace_back(seq, old);
      RETURN_IF_ERROR(moved);
    }
  }
  // Only the last max_size tokens of each sequence reach the ring; earlier ones would be
  // overwritten within this batch, so they are skipped (row -1).
  absl::flat_hash_map<int64_t, int32_t> last;
  for (const Token& t : tokens) last[t.seq] = t.pos;
  std::vector<int32_t> rows(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const Sequence& s = seqs_.at(tokens[i].seq);
    rows[i] = tokens[i].pos > last[tokens[i].seq] - geo_.max_size ? Row(s, tokens[i].pos) : -1;
  }
  return device_->Scatter(arena_, planes_, rows, section);
}

void RotatingGroup::CommitAppend(const AppendBatch& batch) {
  if (batch.speculative) {
    CommitStagedAppend(batch);
  } else {
    for (const Token& t : batch.tokens) seqs_[t.seq].offset = t.pos + 1;
  }
  for (const auto& [seq, old] : moved_) ReleaseRing(old);
  new_rings_.clear();
  moved_.clear();
}

void RotatingGroup::AbandonAppend() {
  for (const auto& [seq, old] : moved_) {
    Sequence& s = seqs_.at(seq);
    ReleaseRing(s.ring);
    s.ring = old;
  }
  for (int64_t seq : new_rings_) Drop(seq);
  new_rings_.clear();
  moved_.clear();
  spec_chunk_.reset();
}

// A plan's rows go to a staging ring per sequence: row pos mod max_size of it, as in the
// sequence's own ring, so that Commit moves rows between the two without reordering.
class RotatingGroup::StagedReservation final : public RowsReservation {
 public:
  StagedReservation(RotatingGroup* group, const AppendBatch& batch)
      : RowsReservation(group->device_, &group->arena_, &group->planes_), group_(group) {
    const int32_t max_size = group->geo_.max_size;
    absl::flat_hash_map<int64_t, int32_t> ring, last;
    for (const Token& t : batch.tokens) last[t.seq] = t.pos;
    for (int64_t seq : batch.seqs) {
      rings_.push_back(group->TakeRing());
      ring[seq] = rings_.back();
    }
    // As WriteAppend: a row that a later token of the batch overwrites is skipped (-1).
    for (const Token& t : batch.tokens) {
      rows_.push_back(t.pos > last[t.seq] - max_size ? ring[t.seq] * max_size + t.pos % max_size
                                                     : -1);
    }
  }
  ~StagedReservation() override { Abandon(); }

  absl::Status Commit(const AppendBatch& batch) override {
    RotatingGroup& g = *group_;
    absl::flat_hash_map<int64_t, int32_t> last;
    for (const Token& t : batch.tokens) last[t.seq] = t.pos;
    absl::Status status;
    for (size_t k = 0; k < batch.seqs.size(); ++k) {
      const int64_t seq = batch.seqs[k];
      const int32_t staged = rings_[k];
      Sequence& s = g.seqs_[seq];
      const int32_t end = last[seq] + 1;
      if (s.ring < 0) {
        s.ring = staged;
      } else {
        // The window rows that survive the batch, and the batch's rows that reach the window.
        const int32_t keep_begin = std::max(g.WindowStart(s), end - g.geo_.max_size);
        const int32_t kept = std::max(0, s.offset - keep_begin);
        const int32_t new_begin = std::max(batch.lowest.at(seq), end - g.geo_.max_size);
        absl::Status copied;
        if (g.pins_[s.ring] > 0 || kept <= end - new_begin) {
          copied = g.CopyWindow(s.ring, staged, keep_begin, s.offset);
          g.ReleaseRing(s.ring);
          s.ring = staged;
        } else {
          copied = g.CopyWindow(staged, s.ring, new_begin, end);
          g.ReleaseRing(staged);
        }
        if (status.ok()) status = copied;
      }
      s.offset = end;
    }
    rings_.clear();
    return status;
  }
  void Abandon() override {
    for (const int32_t ring : rings_) group_->ReleaseRing(ring);
    rings_.clear();
  }

 private:
  RotatingGroup* const group_;
  std::vector<int32_t> rings_;  // per batch sequence, in batch.seqs order
};

absl::Status RotatingGroup::CheckReserve(const AppendBatch& batch) const {
  if (batch.speculative) return absl::OkStatus();  // its chunk, from PrepareAppend
  const int64_t free = static_cast<int64_t>(free_rings_.size()) - held_back();
  const int64_t needed = static_cast<int64_t>(batch.seqs.size());
  if (needed > free) {
    return ResourceExhaustedWith(
        absl::StrCat("group ", index(),
                     " is Rotating: an Append plan stages its rows in one "
                     "free ring per sequence; the batch has ",
                     needed, " sequences and ", std::max<int64_t>(0, free), " of ", geo_.rings,
                     " rings are free (the others hold sequences, pinned windows or other "
                     "plans' rows)"),
        {Resource::kRings, index(), needed, std::max<int64_t>(0, free), geo_.rings});
  }
  return absl::OkStatus();
}

std::unique_ptr<LayerGroup::Reservation> RotatingGroup::ReserveAppend(const AppendBatch& batch) {
  if (batch.speculative) return ReserveSpeculative(batch);
  return std::make_unique<StagedReservation>(this, batch);
}

absl::Status RotatingGroup::CheckCommitSpeculation(int64_t seq, int32_t accepted) const {
  if (accepted == 0 || !NeedsRing(Find(seq)) || FreeRings() > 0) return absl::OkStatus();
  return NoFreeRing(seq, "to commit its accepted tokens");
}

absl::Status RotatingGroup::CommitSpeculation(int64_t seq, absl::Span<const int32_t> pending,
                                              int32_t accepted) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return absl::OkStatus();
  Sequence& s = it->second;
  std::vector<PendingRow> rows = std::move(s.pending);
  s.pending.clear();
  absl::Status status;
  if (accepted > 0) {
    if (NeedsRing(&s) && free_rings_.empty()) {
      return absl::InternalError(absl::StrCat("group ", index(), ": no free ring for sequence ",
                                              seq, " (CheckCommitSpeculation let it through)"));
    }
    if (s.ring < 0) {
      s.ring = TakeRing();
    } else {
      int32_t old = -1;
      status = MoveOffPinnedRing(&s, &old);
      ReleaseRing(old);
    }
    s.offset = rows[accepted - 1].pos + 1;
    // The accepted rows that stay in the window, grouped by chunk.
    for (int32_t i = std::max(0, accepted - geo_.max_size); i < accepted;) {
      const RowChunk* chunk = rows[i].chunk.get();
      std::vector<int32_t> src, dst;
      for (; i < accepted && rows[i].chunk.get() == chunk; ++i) {
        src.push_back(rows[i].row);
        dst.push_back(Row(s, rows[i].pos));
      }
      const absl::Status copied = CopyFromChunk(*chunk, src, dst);
      if (status.ok()) status = copied;
    }
  }
  if (s.offset == 0) Drop(seq);
  return status;
}

// ---- Read / Visible / CanResume -----------------------------------------------------------

ReadPart RotatingGroup::PlanRead(int64_t seq, int64_t begin, int64_t end, int32_t) const {
  ReadPart part;
  const Sequence* s = Find(seq);
  if (s == nullptr) return part;
  part.positions = Positions(*s, begin, end);
  // rows: ring rows for window positions; -(i + 1) for pending token i.
  for (int32_t pos : part.positions) {
    if (pos < s->offset) {
      part.rows.push_back(Row(*s, pos));
    } else {
      for (size_t i = 0; i < s->pending.size(); ++i) {
        if (s->pending[i].pos == pos) part.rows.push_back(-static_cast<int32_t>(i) - 1);
      }
    }
  }
  part.bytes = part.positions.size() * TokenBytes();
  return part;
}

absl::Status RotatingGroup::Gather(int64_t seq, const ReadPart& part, uint8_t* dst) const {
  const Sequence* s = Find(seq);
  if (s == nullptr || part.rows.empty()) return absl::OkStatus();
  std::vector<int32_t> ring_rows;
  std::vector<const PendingRow*> pending;
  for (int32_t row : part.rows) {
    if (row >= 0) {
      ring_rows.push_back(row);
    } else {
      pending.push_back(&s->pending[-row - 1]);
    }
  }
  // The payload is plane-major: every plane's window rows, then its pending rows.
  for (size_t p = 0; p < planes_.size(); ++p) {
    if (!ring_rows.empty()) {
      const absl::Status s1 =
          device_->Gather(arena_, absl::MakeConstSpan(&planes_[p], 1), ring_rows, dst);
      if (!s1.ok()) return s1;
      dst += ring_rows.size() * planes_[p].row_bytes;
    }
    for (const PendingRow* row : pending) {
      const int32_t r = row->row;
      const absl::Status s2 = device_->Gather(
          row->chunk->arena, absl::MakeConstSpan(&row->chunk->planes[p], 1), {&r, 1}, dst);
      if (!s2.ok()) return s2;
      dst += planes_[p].row_bytes;
    }
  }
  return absl::OkStatus();
}

std::vector<int32_t> RotatingGroup::Visible(const Query& query) const {
  const Sequence* s = Find(query.seq);
  if (s == nullptr) return {};
  const int64_t lo = int64_t{query.pos} - geo_.max_size + 1;
  const int64_t hi = query.non_causal ? int64_t{INT32_MAX} + 1 : int64_t{query.pos} + 1;
  return Positions(*s, lo, hi);
}

std::pair<int64_t, int64_t> RotatingGroup::VisibleCounts(const Query& query) const {
  const Sequence* s = Find(query.seq);
  if (s == nullptr) return {0, 0};
  // Without listing: the window part of Positions() is a range, plus pending rows.
  const int64_t lo = int64_t{query.pos} - geo_.max_size + 1;
  const int64_t hi = query.non_causal ? int64_t{INT32_MAX} + 1 : int64_t{query.pos} + 1;
  const int64_t window = std::max<int64_t>(
      0, std::min<int64_t>(hi, s->offset) - std::max<int64_t>(lo, WindowStart(*s)));
  int64_t pending = 0;
  for (const PendingRow& row : s->pending) pending += row.pos >= lo && row.pos < hi;
  return {window, pending};
}

int64_t RotatingGroup::VisibleBound(const Query& query) const {
  const auto [window, pending] = VisibleCounts(query);
  return window + pending;  // exact
}

int64_t RotatingGroup::VisibleRangesBound(const Query& query) const {
  const auto [window, pending] = VisibleCounts(query);
  return (window > 0 ? 1 : 0) + pending;  // the window is one range; each pending row at most one
}

bool RotatingGroup::CanResume(int64_t seq, int32_t pos) const {
  const Sequence* s = Find(seq);
  if (s == nullptr) return pos == 0;
  const int32_t offset = Offset(seq);
  return pos == offset || (pos < offset && !Wrapped(*s));
}

// ---- CopyPrefix ---------------------------------------------------------------------------

absl::Status RotatingGroup::CheckCopyPrefix(int64_t src, int64_t dst, int32_t length) const {
  const Sequence* s = Find(src);
  if (s != nullptr && length < s->offset && Wrapped(*s)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", index(), " is Rotating and sequence ", src, "'s ring has wrapped (offset ",
        s->offset, " > max_size ", geo_.max_size, "): a prefix of length ", length,
        " no longer exists; copy at least ", s->offset));
  }
  // Checked last: a refusal for room is one that eviction may relieve.
  if (CopyPrefixYields(src, length) && NeedsRing(Find(dst)) && FreeRings() <= 0) {
    return NoFreeRing(dst, "to take the copied window");
  }
  return absl::OkStatus();
}

absl::Status RotatingGroup::CheckRoomForPositions(int64_t seq, int64_t positions) const {
  if (positions == 0 || !NeedsRing(Find(seq)) || FreeRings() > 0) return absl::OkStatus();
  return NoFreeRing(seq, "to take the sequence");
}

bool RotatingGroup::CopyPrefixYields(int64_t src, int32_t length) const {
  const Sequence* s = Find(src);
  return s != nullptr && std::min(length, s->offset) > 0;
}

absl::Status RotatingGroup::ApplyCopyPrefix(int64_t src, int64_t dst, int32_t length) {
  const Sequence* s = Find(src);
  const int32_t n = s == nullptr ? 0 : std::min(length, s->offset);
  if (n == 0) {
    Drop(dst);
    return absl::OkStatus();
  }
  Sequence& d = seqs_[dst];
  s = Find(src);  // seqs_ may have rehashed
  d.pending.clear();
  if (d.ring >= 0 && pins_[d.ring] > 0) {  // the pinned window stays as its readers see it
    ReleaseRing(d.ring);
    d.ring = -1;
  }
  if (d.ring < 0) d.ring = TakeRing();
  d.offset = n;
  std::vector<int32_t> from, to;
  for (int32_t p = std::max(0, n - geo_.max_size); p < n; ++p) {
    from.push_back(Row(*s, p));
    to.push_back(Row(d, p));
  }
  return device_->CopyRows(arena_, planes_, from, to);
}

// ---- Remove -------------------------------------------------------------------------------

absl::Status RotatingGroup::CheckRemove(int64_t seq, int32_t begin,
                                        std::optional<int32_t> end) const {
  const Sequence* s = Find(seq);
  if (s == nullptr || begin >= s->offset) return absl::OkStatus();
  if (end.has_value() && *end < s->offset) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", index(), " is Rotating: removing [", begin, ", ", *end, ") from sequence ", seq,
        " would move its positions >= ", *end, "; a ring can only be truncated"));
  }
  if (begin > 0 && Wrapped(*s)) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", index(), " is Rotating and sequence ", seq,
                     "'s ring has wrapped (offset ", s->offset, " > max_size ", geo_.max_size,
                     "): truncating at ", begin, " would leave an incomplete window"));
  }
  return absl::OkStatus();
}

absl::Status RotatingGroup::ApplyRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || begin >= it->second.offset) return absl::OkStatus();
  if (begin == 0) {
    Drop(seq);
  } else {
    it->second.offset = begin;
  }
  return absl::OkStatus();
}

// ---- Snapshots ----------------------------------------------------------------------------

absl::StatusOr<GroupSnapshot> RotatingGroup::TakeSnapshot(int64_t seq, int32_t from,
                                                          int32_t to) const {
  GroupSnapshot snap;
  snap.row_bytes = TokenBytes();
  snap.ring_index = to % geo_.max_size;
  const Sequence* s = Find(seq);
  if (s == nullptr || s->offset == 0) return snap;
  std::vector<int32_t> positions, rows;
  for (int32_t p = WindowStart(*s); p < s->offset; ++p) {
    positions.push_back(p);
    rows.push_back(Row(*s, p));
  }
  RETURN_IF_ERROR(AddSnapshotSegment(rows, std::move(positions), &snap));
  return snap;
}

absl::Status RotatingGroup::CheckRestore(int64_t seq, const GroupSnapshot* snap, int32_t from,
                                         int32_t to, int32_t target) const {
  const Sequence* s = Find(seq);
  const int32_t offset = s == nullptr ? 0 : s->offset;
  if (snap == nullptr) {
    if (target < offset && Wrapped(*s)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "group ", index(), " is Rotating and sequence ", seq, "'s ring has wrapped (offset ",
          offset, " > max_size ", geo_.max_size, "): rewinding to ", target, " needs a snapshot"));
    }
    return absl::OkStatus();
  }
  if (target < to && to > geo_.max_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", index(), " is Rotating: the snapshot ends at ", to, " > max_size ", geo_.max_size,
        ", so clamping it to target ", target, " would leave an incomplete window"));
  }
  if (target > 0 && NeedsRing(s) && FreeRings() <= 0) return NoFreeRing(seq, "to restore");
  return absl::OkStatus();
}

absl::Status RotatingGroup::ApplyRestore(int64_t seq, const GroupSnapshot* snap, int32_t from,
                                         int32_t to, int32_t target) {
  if (target == 0) {
    Drop(seq);
    return absl::OkStatus();
  }
  if (snap == nullptr) {
    auto it = seqs_.find(seq);
    if (it != seqs_.end()) it->second.offset = std::min(it->second.offset, target);
    return absl::OkStatus();
  }
  Sequence& s = seqs_[seq];
  if (s.ring >= 0 && pins_[s.ring] > 0) {  // the pinned window stays as its readers see it
    ReleaseRing(s.ring);
    s.ring = -1;
  }
  if (s.ring < 0) s.ring = TakeRing();
  s.offset = target;
  absl::Status status;
  for (const Segment& segment : snap->segments) {
    std::vector<int32_t> src, dst;
    for (int32_t i = 0; i < segment.rows; ++i) {
      const int32_t pos = segment.positions[i];
      if (pos < target - geo_.max_size || pos >= target) continue;
      src.push_back(segment.first_row + i);
      dst.push_back(Row(s, pos));
    }
    if (src.empty()) continue;
    const absl::Status copied = CopyFromChunk(*segment.chunk, src, dst);
    if (status.ok()) status = copied;
  }
  return status;
}

// ---- Pins ---------------------------------------------------------------------------------

absl::Status RotatingGroup::CheckPin(int64_t seq, int64_t from, int64_t to) const {
  const Sequence* s = Find(seq);
  if (s == nullptr) return absl::OkStatus();
  for (const PendingRow& row : s->pending) {
    if (row.pos >= from && row.pos < to) {
      return absl::FailedPreconditionError(absl::StrCat(
          "group ", index(), " is Rotating and sequence ", seq, "'s speculative position ", row.pos,
          " is pending outside its ring: commit the speculation, or pin below ",
          s->pending.front().pos));
    }
  }
  return absl::OkStatus();
}

GroupSnapshot RotatingGroup::PinSequence(int64_t seq, int64_t from, int64_t to,
                                         std::vector<int32_t>* pinned) {
  GroupSnapshot snap;
  snap.row_bytes = TokenBytes();
  const Sequence* s = Find(seq);
  if (s == nullptr || s->ring < 0) return snap;
  Segment segment;
  for (int64_t p = std::max<int64_t>(from, WindowStart(*s)); p < std::min<int64_t>(to, s->offset);
       ++p) {
    segment.positions.push_back(static_cast<int32_t>(p));
    segment.chunk_rows.push_back(Row(*s, static_cast<int32_t>(p)));
  }
  if (segment.positions.empty()) return snap;
  segment.rows = static_cast<int32_t>(segment.positions.size());
  ++pins_[s->ring];
  pinned->push_back(s->ring);
  snap.segments.push_back(std::move(segment));
  return snap;
}

void RotatingGroup::Unpin(absl::Span<const int32_t> rings) {
  for (const int32_t ring : rings) {
    if (--pins_[ring] == 0 && !owned_[ring]) free_rings_.push_back(ring);
  }
}

}  // namespace kvmesh
