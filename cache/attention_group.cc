#include "cache/attention_group.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/shortage.h"
#include "cache/status_macros.h"

namespace kvmesh {

AttentionGroup::AttentionGroup(int index, const CacheSpec& spec, DeviceArena arena, Device* device)
    : SequenceMapGroup(index, std::move(arena), device),
      spec_(spec.groups[index].attention),
      dtype_(spec.dtype),
      geo_(ComputeAttentionGeometry(spec, index)),
      refs_(static_cast<size_t>(geo_.cells), 0),
      pins_(static_cast<size_t>(geo_.cells), 0),
      holders_(static_cast<size_t>(geo_.cells), 0) {
  // Arena layout: for each layer, K [cells][k_row] then V [cells][v_row].
  const size_t cells = static_cast<size_t>(geo_.cells);
  size_t offset = 0;
  for (int32_t l = 0; l < spec.groups[index].num_layers; ++l) {
    const Plane k{offset, geo_.k_row_bytes};
    offset += cells * geo_.k_row_bytes;
    const Plane v{offset, geo_.v_row_bytes};
    offset += cells * geo_.v_row_bytes;
    planes_.push_back(k);
    planes_.push_back(v);
    k_planes_.push_back(k);
  }
}

int32_t AttentionGroup::Offset(int64_t seq) const {
  const Index* index = Find(seq);
  return index == nullptr ? 0 : index->last() + 1;
}

GroupSequenceInfo AttentionGroup::Info(int64_t seq) const {
  GroupSequenceInfo g;
  if (const Index* index = Find(seq)) {
    g.stored = static_cast<int32_t>(index->size());
    if (auto shared = shared_.find(seq); shared != shared_.end()) g.shared = shared->second;
    g.first = index->first();
    g.last = index->last();
  }
  return g;
}

int64_t AttentionGroup::UnitsToGrow(int64_t seq, int32_t positions) const {
  // A sliding window keeps at most `memory` positions of a sequence: it needs no more cells.
  const int64_t held = std::min<int64_t>(positions, geo_.memory);
  const Index* index = Find(seq);
  return std::max<int64_t>(0, held - (index == nullptr ? 0 : index->size()));
}

GroupUsage AttentionGroup::Usage() const {
  GroupUsage g;
  g.cells_total = geo_.cells;
  g.cells_used = g.cells_total - raw_free_cells();
  g.memory = geo_.memory;
  g.bytes = arena_bytes();
  return g;
}

int64_t AttentionGroup::SharedCellCount() const { return shared_cells_; }

void AttentionGroup::AddShared(int64_t seq, int32_t delta) {
  if (delta == 0) return;
  int32_t& count = shared_[seq];
  count += delta;
  if (count == 0) shared_.erase(seq);
}

int32_t AttentionGroup::TakeFreeCell() {
  if (free_.empty()) return static_cast<int32_t>(next_fresh_++);
  const int32_t cell = free_.back();
  free_.pop_back();
  return cell;
}

int32_t AttentionGroup::AllocateCell(int64_t seq) {
  const int32_t cell = TakeFreeCell();
  refs_[cell] = 1;
  holders_[cell] = static_cast<uint64_t>(seq);
  return cell;
}

void AttentionGroup::RefCell(int32_t cell, int64_t seq) {
  if (refs_[cell] == 1) {  // the holder's cell becomes shared
    AddShared(static_cast<int64_t>(holders_[cell]), 1);
    ++shared_cells_;
  }
  ++refs_[cell];
  holders_[cell] ^= static_cast<uint64_t>(seq);
  AddShared(seq, 1);
}

void AttentionGroup::ReleaseCell(int32_t cell, int64_t seq) {
  holders_[cell] ^= static_cast<uint64_t>(seq);
  const int32_t refs = --refs_[cell];
  if (refs == 0) {
    if (pins_[cell] == 0) free_.push_back(cell);
    return;
  }
  AddShared(seq, -1);
  if (refs == 1) {  // the one holder left has the cell to itself
    AddShared(static_cast<int64_t>(holders_[cell]), -1);
    --shared_cells_;
  }
}

void AttentionGroup::DropRange(Index& index, int64_t seq, int64_t begin, int64_t end) {
  // The free pool is taken from its back: cells are pushed from the highest down, so that they
  // come back in ascending order and a later append of one sequence gets consecutive cells.
  std::vector<Index::Run> runs;
  index.ForEachRun(begin, end, [&runs](const Index::Run& run) { runs.push_back(run); });
  const uint64_t id = static_cast<uint64_t>(seq);
  int32_t own = 0;          // of seq's cells, those that were shared
  int64_t last_holder = 0;  // the sole holders left, counted in stretches (mostly one sequence)
  int32_t stretch = 0;
  for (auto run = runs.rbegin(); run != runs.rend(); ++run) {
    for (int32_t cell = run->cell + run->length - 1; cell >= run->cell; --cell) {
      holders_[cell] ^= id;
      const int32_t refs = --refs_[cell];
      if (refs == 0) {
        if (pins_[cell] == 0) free_.push_back(cell);
        continue;
      }
      ++own;
      if (refs == 1) {
        --shared_cells_;
        const int64_t holder = static_cast<int64_t>(holders_[cell]);
        if (stretch > 0 && holder != last_holder) {
          AddShared(last_holder, -stretch);
          stretch = 0;
        }
        last_holder = holder;
        ++stretch;
      }
    }
  }
  if (stretch > 0) AddShared(last_holder, -stretch);
  AddShared(seq, -own);
  index.Erase(begin, end);
}

// ---- Append -------------------------------------------------------------------------------

AttentionGroup::AppendPlan AttentionGroup::PlanAppend(
    const absl::flat_hash_map<int64_t, int32_t>& batch_lowest,
    const absl::flat_hash_map<int64_t, int32_t>& pending_first) const {
  AppendPlan plan;
  if (!limited_memory()) return plan;
  auto bound = [&](int64_t seq, int64_t position) {
    auto found = pending_first.find(seq);
    if (found != pending_first.end()) position = std::min<int64_t>(position, found->second);
    return position - geo_.memory;
  };
  for (const auto& [seq, lowest] : batch_lowest) {
    if (seqs_.contains(seq)) plan.prune.emplace_back(seq, bound(seq, lowest));
  }
  for (int64_t seq : prune_pending_) {
    if (batch_lowest.contains(seq)) continue;
    // Weighed as evicted (LayerGroup::set_evicting): all its cells are counted as freed there.
    if (evicting_ != nullptr && evicting_->contains(seq)) continue;
    auto found = seqs_.find(seq);
    if (found == seqs_.end()) continue;  // pending sequences are live; be safe all the same
    plan.prune.emplace_back(seq, bound(seq, int64_t{found->second.last()} + 1));
    // A sequence held back by its pending tokens is looked at again after its commit.
    if (!pending_first.contains(seq)) plan.pruned_pending.insert(seq);
  }
  // A cell is freed when every sequence referencing it drops it and nothing pins it.
  absl::flat_hash_map<int32_t, int32_t> drops;
  for (const auto& [seq, below] : plan.prune) {
    seqs_.at(seq).ForEachRun(Index::kBegin, below, [&](const Index::Run& run) {
      for (int32_t cell = run.cell; cell < run.cell + run.length; ++cell) {
        if (pins_[cell] > 0) continue;
        if (refs_[cell] == 1) {
          ++plan.freed;
        } else if (++drops[cell] == refs_[cell]) {
          ++plan.freed;
        }
      }
    });
  }
  return plan;
}

absl::Status AttentionGroup::RecheckAppend(const AppendBatch& batch) const {
  for (size_t i = 0; i < batch.tokens.size(); ++i) {
    const Index* index = Find(batch.tokens[i].seq);
    if (index != nullptr && index->contains(batch.tokens[i].pos)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "]: sequence ", batch.tokens[i].seq,
                       " already stores position ", batch.tokens[i].pos));
    }
  }
  return absl::OkStatus();
}

absl::Status AttentionGroup::PrepareAppend(const AppendBatch& batch) {
  RETURN_IF_ERROR(RecheckAppend(batch));
  plan_ = PlanAppend(batch.lowest, batch.pending_first);
  const int64_t num_tokens = static_cast<int64_t>(batch.tokens.size());
  const int64_t available = free_cells() + plan_.freed;
  if (available < num_tokens) {
    return ResourceExhaustedWith(
        absl::StrCat("group ", index(), ": a batch of ", num_tokens,
                     " tokens needs as many free cells; ", available, " of ", geo_.cells,
                     " are free", plan_.freed > 0 ? " after sliding-window pruning" : ""),
        {Resource::kCells, index(), num_tokens, available, geo_.cells});
  }
  return absl::OkStatus();
}

void AttentionGroup::ApplyPrune(const AppendPlan& plan) {
  for (const auto& [seq, below] : plan.prune) {
    auto found = seqs_.find(seq);
    if (found == seqs_.end()) continue;
    Index& index = found->second;
    DropRange(index, seq, Index::kBegin, below);
    if (index.empty()) {
      seqs_.erase(found);
      prune_pending_.erase(seq);
    }
  }
  for (int64_t seq : plan.pruned_pending) prune_pending_.erase(seq);
}

bool AttentionGroup::TakeCells(const AppendBatch& batch, TakenCells* taken) {
  const absl::Span<const Token> tokens = batch.tokens;
  const bool prune = free_cells() < static_cast<int64_t>(tokens.size());
  if (prune) ApplyPrune(plan_);
  taken->cells.resize(tokens.size());
  taken->cell_seqs.resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    taken->cells[i] = AllocateCell(tokens[i].seq);
    taken->cell_seqs[i] = tokens[i].seq;
  }
  return prune;
}

void AttentionGroup::IndexTakenCells(const AppendBatch& batch, TakenCells* taken) {
  const absl::Span<const Token> tokens = batch.tokens;
  for (size_t i = 0; i < tokens.size(); ++i) {
    seqs_[tokens[i].seq].Insert(tokens[i].pos, taken->cells[i]);
    if (limited_memory()) prune_pending_.insert(tokens[i].seq);
  }
  taken->cells.clear();
  taken->cell_seqs.clear();
}

void AttentionGroup::ReturnTakenCells(TakenCells* taken) {
  // From the last, so that the free pool gives the cells back in the order it gave them.
  for (size_t i = taken->cells.size(); i-- > 0;) ReleaseCell(taken->cells[i], taken->cell_seqs[i]);
  taken->cells.clear();
  taken->cell_seqs.clear();
}

absl::Status AttentionGroup::WriteAppend(const AppendBatch& batch, const uint8_t* section) {
  pruned_early_ = TakeCells(batch, &taken_);
  return device_->Scatter(arena_, planes_, taken_.cells, section);
}

void AttentionGroup::AbandonAppend() {
  ReturnTakenCells(&taken_);
  pruned_early_ = false;
}

void AttentionGroup::CommitAppend(const AppendBatch& batch) {
  if (!pruned_early_) ApplyPrune(plan_);
  pruned_early_ = false;
  IndexTakenCells(batch, &taken_);
}

class AttentionGroup::AppendReservation final : public LayerGroup::Reservation {
 public:
  explicit AppendReservation(AttentionGroup* group) : group_(group) {}

  absl::Status Write(const uint8_t* section) const override {
    return group_->device_->Scatter(group_->arena_, group_->planes_, taken_.cells, section);
  }
  absl::Status WriteRows(size_t plane, size_t first_row, size_t num_rows,
                         const uint8_t* src) const override {
    return group_->device_->Scatter(group_->arena_, absl::MakeConstSpan(&group_->planes_[plane], 1),
                                    absl::MakeConstSpan(taken_.cells).subspan(first_row, num_rows),
                                    src);
  }
  bool InHostMemory() const override { return group_->CellsInHostMemory(); }
  absl::Span<const int32_t> cells() const override { return taken_.cells; }
  absl::Status Commit(const AppendBatch& batch) override {
    // The pruning this batch allows now; what TakeCells pruned early stays done.
    group_->ApplyPrune(group_->PlanAppend(batch.lowest, batch.pending_first));
    group_->IndexTakenCells(batch, &taken_);
    return absl::OkStatus();
  }
  void Abandon() override { group_->ReturnTakenCells(&taken_); }

  TakenCells* taken() { return &taken_; }

 private:
  AttentionGroup* const group_;
  TakenCells taken_;
};

bool AttentionGroup::CellsInHostMemory() const { return device_->HostAddress(arena_) != nullptr; }

std::unique_ptr<LayerGroup::Reservation> AttentionGroup::ReserveAppend(const AppendBatch& batch) {
  auto reservation = std::make_unique<AppendReservation>(this);
  TakeCells(batch, reservation->taken());
  return reservation;
}

absl::Status AttentionGroup::CommitSpeculation(int64_t seq, absl::Span<const int32_t> pending,
                                               int32_t accepted) {
  if (static_cast<size_t>(accepted) < pending.size()) Truncate(seq, pending[accepted]);
  if (limited_memory() && seqs_.contains(seq)) prune_pending_.insert(seq);
  return absl::OkStatus();
}

void AttentionGroup::Truncate(int64_t seq, int32_t from) {
  auto found = seqs_.find(seq);
  if (found == seqs_.end()) return;
  Index& index = found->second;
  DropRange(index, seq, from, Index::kEnd);
  if (index.empty()) {
    seqs_.erase(found);
    prune_pending_.erase(seq);
  } else if (limited_memory()) {
    prune_pending_.insert(seq);
  }
}

int64_t AttentionGroup::CountCells(const Index& index, int64_t begin, int64_t end,
                                   bool shared) const {
  int64_t n = 0;
  index.ForEachRun(begin, end, [&](const Index::Run& run) {
    for (int32_t cell = run.cell; cell < run.cell + run.length; ++cell) {
      n += !Private(cell) == shared;
    }
  });
  return n;
}

int64_t AttentionGroup::PrivateCellsFrom(int64_t seq, int32_t from) const {
  const Index* index = Find(seq);
  if (index == nullptr) return 0;
  return CountCells(*index, from, Index::kEnd, /*shared=*/false);
}

// ---- Read ---------------------------------------------------------------------------------

void AttentionGroup::Collect(int64_t seq, int64_t begin, int64_t end,
                             std::vector<int32_t>* positions, std::vector<int32_t>* cells) const {
  const Index* index = Find(seq);
  if (index == nullptr || begin >= end) return;
  index->ForEachRun(begin, end, [positions, cells](const Index::Run& run) {
    for (int32_t i = 0; i < run.length; ++i) {
      positions->push_back(run.pos + i);
      cells->push_back(run.cell + i);
    }
  });
}

size_t AttentionGroup::PayloadBytes(size_t num_tokens) const {
  return k_planes_.size() * num_tokens * (geo_.k_row_bytes + geo_.v_row_bytes);
}

ReadPart AttentionGroup::PlanRead(int64_t seq, int64_t begin, int64_t end, int32_t) const {
  ReadPart part;
  Collect(seq, begin, end, &part.positions, &part.rows);
  part.bytes = PayloadBytes(part.rows.size());
  return part;
}

absl::Status AttentionGroup::Gather(int64_t, const ReadPart& part, uint8_t* dst) const {
  if (part.rows.empty()) return absl::OkStatus();
  return device_->Gather(arena_, planes_, part.rows, dst);
}

// ---- CopyPrefix ---------------------------------------------------------------------------

bool AttentionGroup::HasPrefix(int64_t src_seq, int32_t length) const {
  const Index* index = Find(src_seq);
  return index != nullptr && index->first() < length;
}

absl::Status AttentionGroup::ApplyCopyPrefix(int64_t src_seq, int64_t dst_seq, int32_t length) {
  if (auto dst = seqs_.find(dst_seq); dst != seqs_.end()) {
    DropRange(dst->second, dst_seq, Index::kBegin, Index::kEnd);
    seqs_.erase(dst);
  }
  if (limited_memory()) prune_pending_.erase(dst_seq);
  if (!HasPrefix(src_seq, length)) return absl::OkStatus();
  const Index& src = seqs_.at(src_seq);
  // RefCell for each cell, with the counts summed: every cell is src's, so a cell with one
  // reference is src's alone, and every cell is shared by dst afterwards.
  const uint64_t dst_id = static_cast<uint64_t>(dst_seq);
  int32_t newly_shared = 0, copied = 0;
  src.ForEachRun(Index::kBegin, length, [&](const Index::Run& run) {
    int32_t* refs = refs_.data() + run.cell;
    uint64_t* holders = holders_.data() + run.cell;
    for (int32_t i = 0; i < run.length; ++i) {
      newly_shared += refs[i] == 1;
      ++refs[i];
      holders[i] ^= dst_id;
    }
    copied += run.length;
  });
  AddShared(src_seq, newly_shared);
  AddShared(dst_seq, copied);
  shared_cells_ += newly_shared;
  seqs_.emplace(dst_seq, src.Prefix(length));
  if (limited_memory()) prune_pending_.insert(dst_seq);
  return absl::OkStatus();
}

// ---- Remove -------------------------------------------------------------------------------

absl::Status AttentionGroup::CheckRemove(int64_t seq, int32_t begin,
                                         std::optional<int32_t> end) const {
  const Index* index = Find(seq);
  if (index == nullptr || !end.has_value()) return absl::OkStatus();
  if (index->last() < *end) return absl::OkStatus();
  if (spec_.rope.type == RopeType::kNone) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", LayerGroup::index(), " has rope NONE: removing [", begin, ", ", *end,
                     ") from sequence ", seq, " would move its positions >= ", *end,
                     " without re-rotating their keys"));
  }
  const int64_t shared = CountCells(*index, *end, Index::kEnd, /*shared=*/true);
  if (shared == 0) return absl::OkStatus();
  const int64_t freed = CountCells(*index, begin, *end, /*shared=*/false);
  if (free_cells() + freed < shared) {
    return ResourceExhaustedWith(
        absl::StrCat("group ", LayerGroup::index(), ": removing [", begin, ", ", *end,
                     ") from sequence ", seq, " moves ", shared,
                     " cells shared with other sequences (or pinned by transfers), which need "
                     "private copies; only ",
                     free_cells() + freed, " cells are free"),
        {Resource::kCells, LayerGroup::index(), shared, free_cells() + freed, geo_.cells});
  }
  return absl::OkStatus();
}

absl::Status AttentionGroup::ApplyRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) {
  auto found = seqs_.find(seq);
  if (found == seqs_.end()) return absl::OkStatus();
  Index& index = found->second;
  DropRange(index, seq, begin, end.has_value() ? int64_t{*end} : Index::kEnd);

  absl::Status status;
  if (end.has_value()) {
    if (!index.empty() && index.last() >= *end) {
      const int32_t distance = *end - begin;
      std::vector<std::pair<int32_t, int32_t>> moved;
      moved.reserve(static_cast<size_t>(index.size()));
      index.ForEachRun(*end, Index::kEnd, [&moved](const Index::Run& run) {
        for (int32_t i = 0; i < run.length; ++i) moved.emplace_back(run.pos + i, run.cell + i);
      });
      index.Erase(*end, Index::kEnd);
      // Shared cells get private copies before their keys are rotated.
      std::vector<int32_t> copy_src, copy_dst, rotate;
      rotate.reserve(moved.size());
      for (auto& [pos, cell] : moved) {
        if (!Private(cell)) {
          const int32_t fresh = AllocateCell(seq);
          copy_src.push_back(cell);
          copy_dst.push_back(fresh);
          ReleaseCell(cell, seq);
          cell = fresh;
        }
        rotate.push_back(cell);
      }
      if (!copy_src.empty()) status = device_->CopyRows(arena_, planes_, copy_src, copy_dst);
      if (status.ok()) {
        RopeShiftParams params;
        params.rope = spec_.rope;
        params.dtype = dtype_;
        params.num_heads = spec_.num_kv_heads;
        params.head_dim = spec_.head_dim_k;
        params.delta = -distance;
        status = device_->RopeShift(arena_, k_planes_, rotate, params);
      }
      // The metadata follows the move even on a device error, so no cell is leaked or shared
      // wrongly; the caller (Cache) then refuses further use of the cache's data.
      for (const auto& [pos, cell] : moved) index.Insert(pos - distance, cell);
    }
  }
  if (index.empty()) {
    seqs_.erase(found);
    prune_pending_.erase(seq);
  } else if (limited_memory()) {
    prune_pending_.insert(seq);
  }
  return status;
}

// ---- CanResume / Visible ------------------------------------------------------------------

bool AttentionGroup::CanResume(int64_t seq, int32_t pos) const {
  if (!limited_memory()) return true;
  const Index* index = Find(seq);
  if (index == nullptr) return false;
  const int32_t first = index->first();
  const int32_t last = index->last();
  const int64_t window_start = std::max<int64_t>(0, int64_t{pos} - spec_.window.window);
  return window_start >= first && int64_t{pos} <= int64_t{last} + 1;
}

namespace {

// The positions [lo, hi] a query may attend to in an Attention group with `window`, before
// looking at what is stored.
std::pair<int64_t, int64_t> VisibleRange(const WindowSpec& window, const Query& query) {
  int64_t lo = 0;
  const int64_t hi = query.non_causal ? INT32_MAX : query.pos;
  switch (window.kind) {
    case WindowKind::kFull:
      break;
    case WindowKind::kSliding:
      lo = std::max<int64_t>(lo, int64_t{query.pos} - window.window);
      break;
    case WindowKind::kChunked:
      lo = int64_t{query.pos} - query.pos % window.chunk;
      break;
  }
  return {lo, hi};
}

}  // namespace

std::vector<int32_t> AttentionGroup::Visible(const Query& query) const {
  std::vector<int32_t> out;
  const Index* index = Find(query.seq);
  if (index == nullptr) return out;
  const auto [lo, hi] = VisibleRange(spec_.window, query);
  index->ForEachRun(lo, hi + 1, [&out](const Index::Run& run) {
    for (int32_t i = 0; i < run.length; ++i) out.push_back(run.pos + i);
  });
  return out;
}

int64_t AttentionGroup::VisibleBound(const Query& query) const {
  const Index* index = Find(query.seq);
  if (index == nullptr) return 0;
  const auto [lo, hi] = VisibleRange(spec_.window, query);
  const auto first = index->lower_bound(lo);
  if (first == index->end() || first.pos() > hi) return 0;
  // The last stored position <= hi: positions are distinct, so at most last - first + 1 of them
  // lie between (exact when the sequence stores them without gaps).
  const int32_t last = *index->LastAtOrBelow(hi);
  return std::min<int64_t>(index->size(), int64_t{last} - first.pos() + 1);
}

void AttentionGroup::VisibleRanges(const Query& query, std::vector<PositionRange>* out) const {
  const Index* index = Find(query.seq);
  if (index == nullptr) return;
  const auto [lo, hi] = VisibleRange(spec_.window, query);
  const size_t first = out->size();
  // Runs are maximal in (position, cell); two of them may still hold consecutive positions in
  // cells that are not consecutive, and those join into one range.
  index->ForEachRun(lo, hi + 1, [out, first](const Index::Run& run) {
    const int32_t last = run.pos + (run.length - 1);
    if (out->size() > first && int64_t{out->back().last} + 1 == run.pos) {
      out->back().last = last;
    } else {
      out->push_back(PositionRange{run.pos, last});
    }
  });
}

int64_t AttentionGroup::VisibleRangesBound(const Query& query) const {
  const Index* index = Find(query.seq);
  if (index == nullptr) return 0;
  return std::min<int64_t>(VisibleBound(query), static_cast<int64_t>(index->run_count()));
}

// ---- Snapshots ----------------------------------------------------------------------------

absl::StatusOr<GroupSnapshot> AttentionGroup::TakeSnapshot(int64_t seq, int32_t from,
                                                           int32_t to) const {
  GroupSnapshot snap;
  snap.row_bytes = PayloadBytes(1);
  std::vector<int32_t> positions, cells;
  Collect(seq, from, to, &positions, &cells);
  if (cells.empty()) return snap;
  RETURN_IF_ERROR(AddSnapshotSegment(cells, std::move(positions), &snap));
  return snap;
}

absl::Status AttentionGroup::CheckRoomForPositions(int64_t seq, int64_t positions) const {
  const int64_t available = free_cells() + PrivateCellsFrom(seq, 0);
  if (available >= positions) return absl::OkStatus();
  return ResourceExhaustedWith(
      absl::StrCat("group ", index(), ": ", positions, " positions for sequence ", seq,
                   " need as many free cells; ", available, " of ", geo_.cells, " are free"),
      {Resource::kCells, index(), positions, available, geo_.cells});
}

absl::Status AttentionGroup::CheckRestore(int64_t seq, const GroupSnapshot* snap, int32_t from,
                                          int32_t to, int32_t target) const {
  if (snap == nullptr) return absl::OkStatus();
  int64_t needed = 0;
  for (const Segment& segment : snap->segments) {
    if (segment.chunk->cells_of == this) continue;  // its cells are taken as they are
    for (int32_t pos : segment.positions) needed += pos < target;
  }
  const int64_t available = free_cells() + PrivateCellsFrom(seq, std::min(from, target));
  if (available < needed) {
    return ResourceExhaustedWith(
        absl::StrCat("group ", index(), ": restoring ", needed, " positions into sequence ", seq,
                     " needs as many free cells; ", available, " of ", geo_.cells, " are free"),
        {Resource::kCells, index(), needed, available, geo_.cells});
  }
  return absl::OkStatus();
}

absl::Status AttentionGroup::ApplyRestore(int64_t seq, const GroupSnapshot* snap, int32_t from,
                                          int32_t to, int32_t target) {
  if (snap == nullptr) {
    Truncate(seq, target);
    return absl::OkStatus();
  }
  Truncate(seq, std::min(from, target));
  absl::Status status;
  for (const Segment& segment : snap->segments) {
    if (segment.chunk->cells_of == this) {
      // Cells an import pinned and wrote: the sequence takes them; the importer unpins them.
      for (int32_t i = 0; i < segment.rows && segment.positions[i] < target; ++i) {
        const int32_t cell =
            segment.chunk_rows.empty() ? segment.first_row + i : segment.chunk_rows[i];
        refs_[cell] = 1;
        holders_[cell] = static_cast<uint64_t>(seq);
        seqs_[seq].Insert(segment.positions[i], cell);
      }
      continue;
    }
    std::vector<int32_t> src_rows, cells;
    for (int32_t i = 0; i < segment.rows; ++i) {
      const int32_t pos = segment.positions[i];
      if (pos >= target) break;
      const int32_t cell = AllocateCell(seq);
      src_rows.push_back(segment.first_row + i);
      cells.push_back(cell);
      seqs_[seq].Insert(pos, cell);
    }
    if (cells.empty()) continue;
    const absl::Status s = CopyFromChunk(*segment.chunk, src_rows, cells);
    if (status.ok()) status = s;
  }
  if (limited_memory() && seqs_.contains(seq)) prune_pending_.insert(seq);
  return status;
}

// ---- Cells lent to transfers ---------------------------------------------------------------

GroupSnapshot AttentionGroup::PinSequence(int64_t seq, int64_t from, int64_t to,
                                          std::vector<int32_t>* pinned) {
  GroupSnapshot snap;
  snap.row_bytes = PayloadBytes(1);
  const Index* index = Find(seq);
  if (index == nullptr) return snap;
  // One segment, as TakeSnapshot makes, so that the image is the snapshot's byte for byte.
  Segment segment;
  index->ForEachRun(from, to, [&](const Index::Run& run) {
    for (int32_t i = 0; i < run.length; ++i) {
      segment.positions.push_back(run.pos + i);
      segment.chunk_rows.push_back(run.cell + i);
      ++pins_[run.cell + i];
    }
  });
  if (segment.positions.empty()) return snap;
  segment.rows = static_cast<int32_t>(segment.positions.size());
  pinned->insert(pinned->end(), segment.chunk_rows.begin(), segment.chunk_rows.end());
  snap.segments.push_back(std::move(segment));
  return snap;
}

std::vector<int32_t> AttentionGroup::PinFreeCells(int64_t n) {
  std::vector<int32_t> cells;
  if (n > free_cells()) return cells;
  cells.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t cell = TakeFreeCell();
    pins_[cell] = 1;
    cells.push_back(cell);
  }
  return cells;
}

void AttentionGroup::TallyEviction(int64_t seq, EvictionTally* tally) const {
  const RunIndex* index = Find(seq);
  if (index == nullptr) return;
  for (auto it = index->begin(); it != index->end(); ++it) {
    const int32_t cell = it.cell();
    if (++tally->refs[cell] == refs_[cell] && pins_[cell] == 0) ++tally->units;
  }
}

void AttentionGroup::Unpin(absl::Span<const int32_t> cells) {
  // From the last, so that the free pool gives back in ascending order what was pinned so.
  for (size_t i = cells.size(); i-- > 0;) {
    const int32_t cell = cells[i];
    if (--pins_[cell] == 0 && refs_[cell] == 0) free_.push_back(cell);
  }
}

}  // namespace kvmesh
