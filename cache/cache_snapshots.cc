// The Cache's snapshots: taking, restoring, merging, splitting, dropping and listing them
// (cache/cache.h, "Where things live").
#include "cache/cache.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache/attention_group.h"
#include "cache/cache_internal.h"
#include "cache/layer_group.h"
#include "cache/recurrent_group.h"
#include "cache/rotating_group.h"
#include "cache/shortage.h"
#include "cache/snapshot_wire.h"
#include "cache/status_macros.h"

namespace kvmesh {

using cache_internal::CheckNonNegative;

namespace {

// The token ids of a merge of `parent` and `child`. A cache with Attention groups keeps the
// parent's data below the child's start: the child's ids continue it exactly only when the two
// agree below that start. Otherwise the child's data is all there is.
TokenIds MergeTokens(const SnapshotRecord& parent, const SnapshotRecord& child,
                     bool has_attention) {
  if (!has_attention) return child.tokens;
  const size_t start = static_cast<size_t>(child.from);
  const TokenIds& p = parent.tokens;
  const TokenIds& c = child.tokens;
  TokenIds merged;
  merged.ids.assign(p.ids.begin(), p.ids.begin() + std::min(p.ids.size(), start));
  merged.taint = p.taint < child.from ? p.taint : kNoTaint;
  if (merged.ids.size() < start) return merged;
  const bool same =
      c.ids.size() >= start && std::equal(merged.ids.begin(), merged.ids.end(), c.ids.begin());
  if (c.ids.size() > start) merged.ids.insert(merged.ids.end(), c.ids.begin() + start, c.ids.end());
  if (!same) {
    merged.taint = std::min(merged.taint, child.from);
  } else if (merged.taint == kNoTaint && c.taint != kNoTaint) {
    merged.taint = std::max(c.taint, child.from);  // the parent's data below it is exact
  }
  return merged;
}

}  // namespace

// ---- Snapshots ----------------------------------------------------------------------------

SnapshotInfo Cache::InfoLocked(const SnapshotRecord& record) const {
  SnapshotInfo info;
  info.id = record.id;
  info.seq = record.seq;
  info.from = record.from;
  info.to = record.to;
  for (const GroupSnapshot& g : record.groups) {
    SnapshotGroupInfo gi;
    gi.stored = g.stored();
    gi.ring_index = g.ring_index;
    gi.state = g.has_state ? StateStatus::kValid : StateStatus::kNone;
    info.bytes += g.bytes();
    info.groups.push_back(gi);
  }
  info.tokens = static_cast<int32_t>(record.tokens.ids.size());
  return info;
}

absl::StatusOr<const SnapshotRecord*> Cache::FindSnapshotLocked(uint64_t id) const {
  const SnapshotRecord* record = snapshots_.Find(id);
  if (record == nullptr) {
    return absl::NotFoundError(absl::StrCat("cache '", spec_.name, "' has no snapshot ", id));
  }
  return record;
}

SnapshotInfo Cache::AddSnapshotLocked(SnapshotRecord record) {
  SnapshotInfo info = InfoLocked(snapshots_.Add(std::move(record)));
  Event event;
  event.kind = EventKind::kSnapshotCreated;
  event.seq = info.seq;
  event.snapshot = info.id;
  PublishLocked(std::move(event));
  return info;
}

void Cache::EraseSnapshotLocked(uint64_t id) {
  const std::unique_ptr<SnapshotRecord> record = snapshots_.Take(id);
  if (record == nullptr) return;
  Event event;
  event.kind = EventKind::kSnapshotDropped;
  event.seq = record->seq;
  event.snapshot = id;
  PublishLocked(std::move(event));
}

absl::Status Cache::CheckRoomForSequence(int64_t seq, absl::Span<const int64_t> positions,
                                         const char* what) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  if (positions.size() != spec_.groups.size()) {
    return absl::InvalidArgumentError(absl::StrCat("positions for ", positions.size(),
                                                   " groups; the cache has ", spec_.groups.size()));
  }
  // Exclusive: the check holds back other sequences' room reservations (HoldBackLocked).
  MutexLock lock(&mu_);
  const HeldBack held = HoldBackLocked({seq});
  RETURN_IF_ERROR(CheckUsableLocked());
  RETURN_IF_ERROR(CheckNotPendingLocked(seq, what));
  auto check = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
    RETURN_IF_ERROR(CheckRoomForLocked(seq, what));
    for (size_t g = 0; g < groups_.size(); ++g) {
      RETURN_IF_ERROR(groups_[g]->CheckRoomForPositions(seq, positions[g]));
    }
    return absl::OkStatus();
  };
  // Under LRU, room that eviction would make counts: the Restore that follows evicts.
  if (absl::Status room = check(); !room.ok()) {
    return MakeRoomLocked(std::move(room), {seq}, check, /*evict=*/false);
  }
  return absl::OkStatus();
}

absl::Status Cache::CheckSnapshotArgs(int64_t seq, int32_t from_offset,
                                      std::optional<int32_t> to) const {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("from_offset", from_offset));
  if (to.has_value()) {
    if (*to <= from_offset) {
      return absl::InvalidArgumentError(absl::StrCat("to = ", *to, " is not above from_offset = ",
                                                     from_offset, ": the snapshot would be empty"));
    }
    if (contiguous_) {
      return absl::InvalidArgumentError(
          absl::StrCat("cache '", spec_.name,
                       "' has a Rotating or Recurrent group: a snapshot "
                       "of it cannot stop at position ",
                       *to));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> Cache::CheckSnapshotLocked(int64_t seq, int32_t from_offset,
                                                   std::optional<int32_t> to) const {
  RETURN_IF_ERROR(CheckUsableLocked());
  if (!IsLiveLocked(seq)) {
    return absl::NotFoundError(absl::StrCat("cache '", spec_.name, "' has no sequence ", seq));
  }
  RETURN_IF_ERROR(CheckNotPendingLocked(seq, "Snapshot"));
  const int32_t offset = OffsetLocked(seq);
  if (from_offset >= offset) {
    return absl::FailedPreconditionError(
        absl::StrCat("from_offset = ", from_offset, " is not below the offset ", offset,
                     " of sequence ", seq, ": the snapshot would be empty"));
  }
  for (const auto& group : groups_) RETURN_IF_ERROR(group->CheckSnapshot(seq, from_offset));
  return to.has_value() ? std::min(*to, offset) : offset;
}

absl::StatusOr<SnapshotInfo> Cache::Snapshot(int64_t seq, int32_t from_offset,
                                             std::optional<int32_t> to) {
  return SnapshotRequiring(seq, from_offset, to, /*require_offset=*/0);
}

absl::StatusOr<SnapshotInfo> Cache::SnapshotRequiring(int64_t seq, int32_t from_offset,
                                                      std::optional<int32_t> to,
                                                      int32_t require_offset) {
  RETURN_IF_ERROR(CheckSnapshotArgs(seq, from_offset, to));
  MutexLock lock(&mu_);
  SnapshotRecord record;
  record.seq = seq;
  record.from = from_offset;
  RETURN_IF_ERROR(CheckOffsetAtLeastLocked(seq, require_offset));
  ASSIGN_OR_RETURN(record.to, CheckSnapshotLocked(seq, from_offset, to));
  for (const auto& group : groups_) {
    ASSIGN_OR_RETURN(GroupSnapshot g, group->TakeSnapshot(seq, from_offset, record.to));
    record.groups.push_back(std::move(g));
  }
  if (const TokenChain* chain = tokens_.Find(seq); chain != nullptr) {
    record.tokens = chain->Prefix(record.to);
  }
  TouchLocked({seq});
  return AddSnapshotLocked(std::move(record));
}

absl::Status Cache::Restore(int64_t seq, std::optional<uint64_t> snapshot_id, int32_t target,
                            const RestoreOptions& options) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("target", target));
  if (options.retention.has_value()) RETURN_IF_ERROR(RetentionIndex::Validate(*options.retention));
  MutexLock lock(&mu_);
  AwaitNotAppendingLocked({seq});
  RETURN_IF_ERROR(CheckUsableLocked());
  RETURN_IF_ERROR(CheckNotPendingLocked(seq, "Restore"));
  const SnapshotRecord* record = nullptr;
  if (snapshot_id.has_value()) {
    ASSIGN_OR_RETURN(record, FindSnapshotLocked(*snapshot_id));
  }
  return RestoreLocked(seq, record, target, options);
}

absl::Status Cache::RestoreLocked(int64_t seq, const SnapshotRecord* record, int32_t target,
                                  const RestoreOptions& options) {
  if (options.keeps_prefix && record != nullptr && record->from > 0) {
    // The receiver of an incremental pull keeps seq's positions below `from` in place of the
    // sender's: only if they are still exactly the ids the sender's were when it took the data.
    const int32_t from = record->from;
    const TokenChain* chain = tokens_.Find(seq);
    const TokenIds& sent = record->tokens;
    const bool sent_exact = static_cast<int32_t>(sent.ids.size()) >= from &&
                            (sent.taint == kNoTaint || sent.taint >= from);
    const bool kept_exact = chain != nullptr && chain->exact() >= from &&
                            static_cast<int32_t>(chain->ids().size()) >= from;
    if (!sent_exact || !kept_exact ||
        !std::equal(sent.ids.begin(), sent.ids.begin() + from, chain->ids().begin())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", seq, " no longer holds exactly the token ids of positions [0, ", from,
          ") that the copy skipped (it or the source changed meanwhile); copy again"));
    }
  }
  const HeldBack held = HoldBackLocked({seq});
  const int32_t offset = OffsetLocked(seq);
  if (record != nullptr) {
    const std::string name = record->id > 0 ? absl::StrCat("snapshot ", record->id)
                                            : std::string("the imported sequence");
    if (target > record->to) {
      return absl::FailedPreconditionError(absl::StrCat("target = ", target, " is past the end ",
                                                        record->to, " of ", name, " [",
                                                        record->from, ", ", record->to, ")"));
    }
    if (has_attention_ && offset < record->from) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", seq, " has offset ", offset, ", below the start ", record->from, " of ",
          name, ": restoring it would leave positions [", offset, ", ", record->from, ") missing"));
    }
  } else if (target > offset) {
    return absl::FailedPreconditionError(
        absl::StrCat("target = ", target, " is past the offset ", offset, " of sequence ", seq,
                     "; a rewind without a snapshot cannot go forward"));
  }
  const int32_t from = record == nullptr ? 0 : record->from;
  const int32_t to = record == nullptr ? offset : record->to;
  auto check = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
    if (record != nullptr) {
      // A new sequence counts against max_sequences only if the restore leaves it holding
      // something: a ring or state (target > 0), or snapshot positions below target.
      bool yields = false;
      for (size_t g = 0; g < groups_.size() && !yields; ++g) {
        if (groups_[g]->kind() != GroupKind::kAttention) {
          yields = target > 0;
          continue;
        }
        for (const Segment& segment : record->groups[g].segments) {
          if (!segment.positions.empty() && segment.positions.front() < target) yields = true;
        }
      }
      if (yields) RETURN_IF_ERROR(CheckRoomForLocked(seq, "restoring the snapshot"));
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      const GroupSnapshot* snap = record == nullptr ? nullptr : &record->groups[g];
      RETURN_IF_ERROR(groups_[g]->CheckRestore(seq, snap, from, to, target));
    }
    return absl::OkStatus();
  };
  // Under LRU a restore (an import's too: a cross-node CopyPrefix or Migrate) that needs room
  // makes it as an Append does.
  if (absl::Status room = check(); !room.ok()) {
    RETURN_IF_ERROR(MakeRoomLocked(std::move(room), {seq}, check));
  }
  absl::Status status;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GroupSnapshot* snap = record == nullptr ? nullptr : &record->groups[g];
    const absl::Status s = groups_[g]->ApplyRestore(seq, snap, from, to, target);
    if (status.ok()) status = s;
  }
  RestoreTokensLocked(seq, record, target);
  // Before the use is recorded, which files the sequence under its priority (or not, pinned);
  // a sequence the restore leaves empty forgets it again.
  if (options.retention.has_value()) retention_.Set(seq, *options.retention);
  TouchLocked({seq});
  ForgetIfDeadLocked(seq);
  return FailLocked(status);
}

void Cache::RestoreTokensLocked(int64_t seq, const SnapshotRecord* record, int32_t target) {
  TokenChain* chain = tokens_.FindMutable(seq);
  if (record == nullptr) {
    if (chain != nullptr) chain->Truncate(target);
    SyncTokensLocked(seq);
    return;
  }
  // seq keeps its positions below the snapshot's start and gets the snapshot's data from there.
  // That data is what the snapshot's sequence computed after its own ids below the start: it
  // continues seq's chain exactly only when seq's ids there are the same.
  const int32_t from = record->from;
  const TokenIds& saved = record->tokens;
  TokenIds restored = chain == nullptr ? TokenIds() : chain->Prefix(from);
  const bool whole = static_cast<int32_t>(restored.ids.size()) == from;
  const bool same_prefix = whole && saved.ids.size() >= restored.ids.size() &&
                           std::equal(restored.ids.begin(), restored.ids.end(), saved.ids.begin());
  if (whole && saved.ids.size() > static_cast<size_t>(from)) {
    const size_t end = std::min(saved.ids.size(), static_cast<size_t>(std::max(target, from)));
    restored.ids.insert(restored.ids.end(), saved.ids.begin() + from, saved.ids.begin() + end);
  }
  if (!same_prefix) {
    restored.taint = std::min(restored.taint, from);
  } else if (restored.taint == kNoTaint && saved.taint != kNoTaint) {
    // The snapshot's data starts at `from`: a taint below it says that data saw something
    // other than its ids there, while seq's own positions below `from` stay exact.
    restored.taint = std::max(saved.taint, from);
  }
  if (restored.ids.empty() && restored.taint == kNoTaint) {
    DropChainLocked(seq);
  } else {
    SetChainLocked(seq, TokenChain(restored, hasher_));
  }
}

absl::StatusOr<SnapshotInfo> Cache::MergeSnapshots(uint64_t parent, uint64_t child) {
  if (parent == child) {
    return absl::InvalidArgumentError(
        absl::StrCat("parent and child are both snapshot ", parent, "; a merge needs two"));
  }
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const SnapshotRecord* p, FindSnapshotLocked(parent));
  ASSIGN_OR_RETURN(const SnapshotRecord* c, FindSnapshotLocked(child));
  if (has_attention_ && p->to != c->from) {
    return absl::InvalidArgumentError(absl::StrCat(
        "snapshot ", parent, " covers [", p->from, ", ", p->to, ") and snapshot ", child,
        " covers [", c->from, ", ", c->to, "): the parent must end where the child starts"));
  }
  SnapshotRecord merged;
  merged.seq = c->seq;
  merged.from = std::min(p->from, c->from);
  merged.to = c->to;
  for (size_t g = 0; g < groups_.size(); ++g) {
    GroupSnapshot out = c->groups[g];
    if (groups_[g]->kind() == GroupKind::kAttention) {
      out.segments = p->groups[g].segments;
      out.segments.insert(out.segments.end(), c->groups[g].segments.begin(),
                          c->groups[g].segments.end());
    }
    merged.groups.push_back(std::move(out));
  }
  merged.tokens = MergeTokens(*p, *c, has_attention_);
  EraseSnapshotLocked(parent);
  EraseSnapshotLocked(child);
  return AddSnapshotLocked(std::move(merged));
}

absl::StatusOr<SplitResult> Cache::SplitSnapshot(uint64_t id, int32_t at) {
  RETURN_IF_ERROR(CheckNonNegative("at", at));
  MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const SnapshotRecord* record, FindSnapshotLocked(id));
  SnapshotRecord whole = *record;
  EraseSnapshotLocked(id);
  SplitResult result;
  // A ring or a recurrent state cannot be cut at a position: the whole snapshot is the child.
  if (contiguous_ || at <= whole.from) {
    result.child = AddSnapshotLocked(std::move(whole));
    return result;
  }
  if (at >= whole.to) {
    result.parent = AddSnapshotLocked(std::move(whole));
    return result;
  }
  SnapshotRecord below = whole, above = whole;
  below.to = at;
  above.from = at;
  below.tokens = whole.tokens.Prefix(at);
  for (size_t g = 0; g < whole.groups.size(); ++g) {
    below.groups[g].segments.clear();
    above.groups[g].segments.clear();
    for (const Segment& segment : whole.groups[g].segments) {
      const int32_t cut = static_cast<int32_t>(
          std::lower_bound(segment.positions.begin(), segment.positions.end(), at) -
          segment.positions.begin());
      if (cut > 0) {
        Segment lo = segment;
        lo.rows = cut;
        lo.positions.resize(cut);
        below.groups[g].segments.push_back(std::move(lo));
      }
      if (cut < segment.rows) {
        Segment hi = segment;
        hi.first_row += cut;
        hi.rows -= cut;
        hi.positions.erase(hi.positions.begin(), hi.positions.begin() + cut);
        above.groups[g].segments.push_back(std::move(hi));
      }
    }
  }
  result.parent = AddSnapshotLocked(std::move(below));
  result.child = AddSnapshotLocked(std::move(above));
  return result;
}

absl::Status Cache::DropSnapshot(uint64_t id) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(FindSnapshotLocked(id).status());
  EraseSnapshotLocked(id);
  return absl::OkStatus();
}

std::vector<SnapshotInfo> Cache::ListSnapshots() const {
  ReaderMutexLock lock(&mu_);
  std::vector<SnapshotInfo> out;
  out.reserve(snapshots_.size());
  snapshots_.ForEachFrom(0, [&](const SnapshotRecord& record) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    out.push_back(InfoLocked(record));
    return true;
  });
  return out;
}

Cache::SnapshotPage Cache::ListSnapshots(uint64_t first, size_t limit) const {
  limit = std::max<size_t>(limit, 1);
  ReaderMutexLock lock(&mu_);
  SnapshotPage page;
  snapshots_.ForEachFrom(first, [&](const SnapshotRecord& record) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (page.snapshots.size() == limit) {
      page.more = true;
      return false;
    }
    page.snapshots.push_back(InfoLocked(record));
    return true;
  });
  return page;
}

}  // namespace kvmesh
