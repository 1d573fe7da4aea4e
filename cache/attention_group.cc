#include "cache/attention_group.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvmesh {

AttentionGroup::AttentionGroup(int index, const CacheSpec& spec, DeviceArena arena, Device* device)
    : index_(index),
      spec_(spec.groups[index].attention),
      dtype_(spec.dtype),
      geo_(ComputeAttentionGeometry(spec, index)),
      device_(device),
      arena_(std::move(arena)),
      refs_(static_cast<size_t>(geo_.cells), 0) {
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

const AttentionGroup::Index* AttentionGroup::Find(int64_t seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? nullptr : &it->second;
}

int32_t AttentionGroup::SharedCells(const Index& index) const {
  int32_t shared = 0;
  for (const auto& [pos, cell] : index) shared += refs_[cell] > 1;
  return shared;
}

int32_t AttentionGroup::AllocateCell() {
  int32_t cell;
  if (!free_.empty()) {
    cell = free_.back();
    free_.pop_back();
  } else {
    cell = static_cast<int32_t>(next_fresh_++);
  }
  refs_[cell] = 1;
  return cell;
}

void AttentionGroup::ReleaseCell(int32_t cell) {
  if (--refs_[cell] == 0) free_.push_back(cell);
}

// ---- Append -------------------------------------------------------------------------------

AttentionGroup::AppendPlan AttentionGroup::PlanAppend(
    const absl::flat_hash_map<int64_t, int32_t>& batch_lowest) const {
  AppendPlan plan;
  if (!limited_memory()) return plan;
  for (const auto& [seq, lowest] : batch_lowest) {
    if (seqs_.contains(seq)) plan.prune.emplace_back(seq, int64_t{lowest} - geo_.memory);
  }
  for (int64_t seq : prune_pending_) {
    if (batch_lowest.contains(seq)) continue;
    auto found = seqs_.find(seq);
    if (found == seqs_.end()) continue;  // pending sequences are live; be safe all the same
    plan.prune.emplace_back(seq, int64_t{found->second.rbegin()->first} + 1 - geo_.memory);
    plan.pruned_pending.insert(seq);
  }
  // A cell is freed when every sequence referencing it drops it.
  absl::flat_hash_map<int32_t, int32_t> drops;
  for (const auto& [seq, below] : plan.prune) {
    const Index& index = seqs_.at(seq);
    for (auto it = index.begin(); it != index.end() && it->first < below; ++it) {
      const int32_t cell = it->second;
      if (refs_[cell] == 1) {
        ++plan.freed;
      } else if (++drops[cell] == refs_[cell]) {
        ++plan.freed;
      }
    }
  }
  return plan;
}

absl::Status AttentionGroup::CheckAppend(const AppendPlan& plan, int64_t num_tokens) const {
  const int64_t available = free_cells() + plan.freed;
  if (available < num_tokens) {
    return absl::ResourceExhaustedError(
        absl::StrCat("group ", index_, ": a batch of ", num_tokens,
                     " tokens needs as many free cells; ", available, " of ", geo_.cells,
                     " are free", plan.freed > 0 ? " after sliding-window pruning" : ""));
  }
  return absl::OkStatus();
}

void AttentionGroup::ApplyPrune(const AppendPlan& plan) {
  for (const auto& [seq, below] : plan.prune) {
    auto found = seqs_.find(seq);
    if (found == seqs_.end()) continue;
    Index& index = found->second;
    auto end = index.begin();
    while (end != index.end() && end->first < below) {
      ReleaseCell(end->second);
      ++end;
    }
    index.erase(index.begin(), end);
    if (index.empty()) {
      seqs_.erase(found);
      prune_pending_.erase(seq);
    }
  }
  for (int64_t seq : plan.pruned_pending) prune_pending_.erase(seq);
}

absl::Status AttentionGroup::WriteAppend(const AppendPlan& plan, absl::Span<const Token> tokens,
                                         const uint8_t* payload, std::vector<int32_t>* cells) {
  pruned_early_ = free_cells() < static_cast<int64_t>(tokens.size());
  if (pruned_early_) ApplyPrune(plan);
  cells->resize(tokens.size());
  for (int32_t& cell : *cells) cell = AllocateCell();
  return device_->Scatter(arena_, planes_, *cells, payload);
}

void AttentionGroup::AbandonAppend(absl::Span<const int32_t> cells) {
  for (int32_t cell : cells) ReleaseCell(cell);
  pruned_early_ = false;
}

void AttentionGroup::CommitAppend(const AppendPlan& plan, absl::Span<const Token> tokens,
                                  absl::Span<const int32_t> cells) {
  if (!pruned_early_) ApplyPrune(plan);
  pruned_early_ = false;
  for (size_t i = 0; i < tokens.size(); ++i) {
    Index& index = seqs_[tokens[i].seq];
    index.emplace_hint(index.end(), tokens[i].pos, cells[i]);
    if (limited_memory()) prune_pending_.insert(tokens[i].seq);
  }
}

// ---- Read ---------------------------------------------------------------------------------

void AttentionGroup::Collect(int64_t seq, int64_t begin, int64_t end,
                             std::vector<int32_t>* positions, std::vector<int32_t>* cells) const {
  const Index* index = Find(seq);
  if (index == nullptr || begin >= end) return;
  for (auto it = index->lower_bound(static_cast<int32_t>(std::min<int64_t>(begin, INT32_MAX)));
       it != index->end() && it->first < end; ++it) {
    positions->push_back(it->first);
    cells->push_back(it->second);
  }
}

size_t AttentionGroup::PayloadBytes(size_t num_tokens) const {
  return k_planes_.size() * num_tokens * (geo_.k_row_bytes + geo_.v_row_bytes);
}

absl::Status AttentionGroup::Gather(absl::Span<const int32_t> cells, uint8_t* dst) const {
  return device_->Gather(arena_, planes_, cells, dst);
}

// ---- CopyPrefix ---------------------------------------------------------------------------

bool AttentionGroup::HasPrefix(int64_t src_seq, int32_t length) const {
  const Index* index = Find(src_seq);
  return index != nullptr && index->begin()->first < length;
}

void AttentionGroup::ApplyCopyPrefix(int64_t src_seq, int64_t dst_seq, int32_t length) {
  if (auto dst = seqs_.find(dst_seq); dst != seqs_.end()) {
    for (const auto& [pos, cell] : dst->second) ReleaseCell(cell);
    seqs_.erase(dst);
  }
  if (limited_memory()) prune_pending_.erase(dst_seq);
  if (!HasPrefix(src_seq, length)) return;
  const Index& src = seqs_.at(src_seq);
  Index copy;
  for (auto it = src.begin(); it != src.end() && it->first < length; ++it) {
    ++refs_[it->second];
    copy.emplace_hint(copy.end(), it->first, it->second);
  }
  seqs_.emplace(dst_seq, std::move(copy));
  if (limited_memory()) prune_pending_.insert(dst_seq);
}

// ---- Remove -------------------------------------------------------------------------------

absl::Status AttentionGroup::CheckRemove(int64_t seq, int32_t begin,
                                         std::optional<int32_t> end) const {
  const Index* index = Find(seq);
  if (index == nullptr || !end.has_value()) return absl::OkStatus();
  auto moved = index->lower_bound(*end);
  if (moved == index->end()) return absl::OkStatus();
  if (spec_.rope.type == RopeType::kNone) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", index_, " has rope NONE: removing [", begin, ", ", *end, ") from sequence ", seq,
        " would move its positions >= ", *end, " without re-rotating their keys"));
  }
  int64_t shared = 0;
  for (auto it = moved; it != index->end(); ++it) shared += refs_[it->second] > 1;
  if (shared == 0) return absl::OkStatus();
  int64_t freed = 0;
  for (auto it = index->lower_bound(begin); it != moved; ++it) freed += refs_[it->second] == 1;
  if (free_cells() + freed < shared) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "group ", index_, ": removing [", begin, ", ", *end, ") from sequence ", seq, " moves ",
        shared, " cells shared with other sequences, which need private copies; only ",
        free_cells() + freed, " cells are free"));
  }
  return absl::OkStatus();
}

absl::Status AttentionGroup::ApplyRemove(int64_t seq, int32_t begin, std::optional<int32_t> end) {
  auto found = seqs_.find(seq);
  if (found == seqs_.end()) return absl::OkStatus();
  Index& index = found->second;
  auto first = index.lower_bound(begin);
  auto last = end.has_value() ? index.lower_bound(*end) : index.end();
  for (auto it = first; it != last; ++it) ReleaseCell(it->second);
  index.erase(first, last);

  absl::Status status;
  if (end.has_value()) {
    auto moved_begin = index.lower_bound(*end);
    if (moved_begin != index.end()) {
      const int32_t distance = *end - begin;
      std::vector<std::pair<int32_t, int32_t>> moved(moved_begin, index.end());
      index.erase(moved_begin, index.end());
      // Shared cells get private copies before their keys are rotated.
      std::vector<int32_t> copy_src, copy_dst, rotate;
      rotate.reserve(moved.size());
      for (auto& [pos, cell] : moved) {
        if (refs_[cell] > 1) {
          const int32_t fresh = AllocateCell();
          copy_src.push_back(cell);
          copy_dst.push_back(fresh);
          ReleaseCell(cell);
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
      for (const auto& [pos, cell] : moved) {
        index.emplace_hint(index.end(), pos - distance, cell);
      }
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
  const int32_t first = index->begin()->first;
  const int32_t last = index->rbegin()->first;
  const int64_t window_start = std::max<int64_t>(0, int64_t{pos} - spec_.window.window);
  return window_start >= first && int64_t{pos} <= int64_t{last} + 1;
}

std::vector<int32_t> AttentionGroup::Visible(const Query& query) const {
  std::vector<int32_t> out;
  const Index* index = Find(query.seq);
  if (index == nullptr) return out;
  int64_t lo = 0;
  const int64_t hi = query.non_causal ? INT32_MAX : query.pos;
  switch (spec_.window.kind) {
    case WindowKind::kFull:
      break;
    case WindowKind::kSliding:
      lo = std::max<int64_t>(lo, int64_t{query.pos} - spec_.window.window);
      break;
    case WindowKind::kChunked:
      lo = int64_t{query.pos} - query.pos % spec_.window.chunk;
      break;
  }
  for (auto it = index->lower_bound(static_cast<int32_t>(lo));
       it != index->end() && it->first <= hi; ++it) {
    out.push_back(it->first);
  }
  return out;
}

}  // namespace kvmesh
