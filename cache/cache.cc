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

bool HasKind(const CacheSpec& spec, GroupKind kind) {
  for (const GroupSpec& g : spec.groups) {
    if (g.kind == kind) return true;
  }
  return false;
}

}  // namespace

Cache::Cache(const CacheSpec& spec, const TokenHasher& hasher)
    : spec_(spec),
      contiguous_(RequiresContiguousPositions(spec)),
      has_attention_(HasKind(spec, GroupKind::kAttention)),
      hasher_(hasher),
      token_limit_(TokenIdLimit(spec)),
      tokens_(hasher_, token_limit_) {}

Cache::~Cache() = default;

absl::StatusOr<std::unique_ptr<Cache>> Cache::Create(const CacheSpec& spec, Device* device,
                                                     absl::string_view tenant, int token_hash_bits,
                                                     EventLog* events) {
  RETURN_IF_ERROR(ValidateSpec(spec));
  if (token_hash_bits < 1 || token_hash_bits > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("token_hash_bits = ", token_hash_bits, " is outside [1, 64]"));
  }
  const size_t needed = CacheBytes(spec);
  if (needed > device->free_bytes()) {
    return ResourceExhaustedWith(
        absl::StrCat("cache '", spec.name, "' needs ", needed, " bytes on device ", device->name(),
                     " but only ", device->free_bytes(), " of ", device->budget_bytes(),
                     " bytes are free in the memory budget"),
        {Resource::kDeviceBytes, -1, static_cast<int64_t>(needed),
         static_cast<int64_t>(device->free_bytes()), static_cast<int64_t>(device->budget_bytes())});
  }
  // One stream per cache: its arenas (and the snapshot and pending chunks its groups allocate)
  // are bound to it, so work on different caches can overlap on the device.
  ASSIGN_OR_RETURN(std::shared_ptr<DeviceStream> stream, device->CreateStream());
  TokenHasher hasher;
  hasher.seed = TokenHashSeed(tenant, spec.name);
  hasher.block_size = spec.token_block_size;
  hasher.bits = token_hash_bits;
  std::unique_ptr<Cache> cache(new Cache(spec, hasher));
  cache->tenant_ = std::string(tenant);
  {
    MutexLock lock(&cache->mu_);
    cache->events_ = events;
  }
  MutexLock lock(&cache->mu_);
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    const int index = static_cast<int>(g);
    switch (spec.groups[g].kind) {
      case GroupKind::kAttention: {
        ASSIGN_OR_RETURN(DeviceArena arena,
                         device->Allocate(ComputeAttentionGeometry(spec, index).bytes,
                                          MemoryPool::kCache, stream, /*shareable=*/true));
        cache->groups_.push_back(
            std::make_unique<AttentionGroup>(index, spec, std::move(arena), device));
        break;
      }
      case GroupKind::kRotating: {
        ASSIGN_OR_RETURN(DeviceArena arena,
                         device->Allocate(ComputeRotatingGeometry(spec, index).bytes,
                                          MemoryPool::kCache, stream, /*shareable=*/true));
        cache->groups_.push_back(
            std::make_unique<RotatingGroup>(index, spec, std::move(arena), device));
        break;
      }
      case GroupKind::kRecurrent: {
        ASSIGN_OR_RETURN(DeviceArena arena,
                         device->Allocate(ComputeRecurrentGeometry(spec, index).bytes,
                                          MemoryPool::kCache, stream, /*shareable=*/true));
        cache->groups_.push_back(
            std::make_unique<RecurrentGroup>(index, spec, std::move(arena), device));
        break;
      }
    }
  }
  cache->reserved_append_ = true;
  cache->lends_cells_ = true;
  cache->pieces_in_place_ = true;
  cache->in_place_append_ = true;
  cache->pins_in_place_ = true;
  for (const auto& group : cache->groups_) {
    cache->in_place_append_ &= group->SupportsInPlaceAppend();
    cache->pins_in_place_ &= group->PinsInPlace();
    cache->reserved_append_ &= group->SupportsReservedAppend();
    cache->lends_cells_ &= group->LendsCells();
    cache->pieces_in_place_ &= group->SupportsReservedAppend() && group->CellsInHostMemory();
  }
  return cache;
}

absl::Status Cache::ValidateSeq(int64_t seq) const { return CheckNonNegative("seq", seq); }

absl::Status Cache::CheckUsableLocked() const {
  if (device_failure_.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("cache '", spec_.name, "' is unusable after a device error (",
                   device_failure_.ToString(), "); delete and recreate it"));
}

absl::Status Cache::CheckNotPendingLocked(int64_t seq, const char* what) const {
  auto it = pending_.find(seq);
  if (it == pending_.end()) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat("sequence ", seq, " has ", it->second.size(),
                                         " pending speculative tokens; ", what,
                                         " must wait for CommitSpeculation"));
}

absl::Status Cache::FailLocked(absl::Status status) {
  if (!status.ok() && device_failure_.ok()) device_failure_ = status;
  return status;
}

bool Cache::IsLive(int64_t seq) const {
  ReaderMutexLock lock(&mu_);
  return IsLiveLocked(seq);
}

bool Cache::IsLiveLocked(int64_t seq) const {
  for (const auto& group : groups_) {
    if (group->Has(seq)) return true;
  }
  return false;
}

int32_t Cache::LiveCountLocked() const {
  if (groups_.size() == 1) return static_cast<int32_t>(groups_[0]->LiveCount());
  absl::flat_hash_set<int64_t> live;
  for (const auto& group : groups_) group->AddLive(&live);
  return static_cast<int32_t>(live.size());
}

int32_t Cache::OffsetLocked(int64_t seq) const {
  int32_t offset = 0;
  for (const auto& group : groups_) offset = std::max(offset, group->Offset(seq));
  return offset;
}

int32_t Cache::ClaimedCountLocked() const {
  int32_t claimed = LiveCountLocked() + held_sequences_;
  for (int64_t seq : appending_) claimed += !IsLiveLocked(seq);
  return claimed;
}

// The guard lives within the exclusive lock of the operation that made it (HoldBackLocked's
// contract), which the analysis cannot see in a destructor.
Cache::HeldBack::~HeldBack() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  for (const auto& group : cache_->groups_) group->set_held_back(0);
  cache_->held_sequences_ = 0;
}

Cache::HeldBack Cache::HoldBackLocked(absl::Span<const int64_t> seqs) {
  if (room_.empty()) return HeldBack(this);  // nothing held back: every group's is 0 already
  const absl::Time now = absl::Now();
  for (auto it = room_.begin(); it != room_.end();) {
    if (it->second.expires <= now) {
      room_.erase(it++);
    } else {
      ++it;
    }
  }
  std::vector<int64_t> held(groups_.size(), 0);
  int32_t sequences = 0;
  for (const auto& [seq, reservation] : room_) {
    if (std::find(seqs.begin(), seqs.end(), seq) != seqs.end()) continue;
    for (size_t g = 0; g < groups_.size(); ++g) {
      held[g] += groups_[g]->UnitsToGrow(seq, reservation.positions);
    }
    sequences += !IsLiveLocked(seq) && !appending_.contains(seq);
  }
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g]->set_held_back(held[g]);
  held_sequences_ = sequences;
  return HeldBack(this);  // not copied: a prvalue initializes the caller's guard
}

absl::Status Cache::Reserve(int64_t seq, int32_t positions, absl::Time expires) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("positions", positions));
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUsableLocked());
  const HeldBack held = HoldBackLocked({seq});
  if (positions == 0 || expires <= absl::Now()) {
    room_.erase(seq);
    return absl::OkStatus();
  }
  if (!IsLiveLocked(seq) && !appending_.contains(seq)) {
    RETURN_IF_ERROR(CheckRoomForLocked(seq, "reserving room"));
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    const LayerGroup& group = *groups_[g];
    const int64_t needed = group.UnitsToGrow(seq, positions);
    if (needed == 0) continue;
    // What the others' reservations do not hold back is free for seq.
    const int64_t available = std::max<int64_t>(0, group.FreeUnits() - group.held_back());
    if (needed > available) {
      return ResourceExhaustedWith(
          absl::StrCat("group ", g, ": reserving room for ", positions, " positions of sequence ",
                       seq, " needs ", needed, " more cells; ", available,
                       " are free and not reserved for other sequences"),
          {Resource::kCells, static_cast<int32_t>(g), needed, available,
           group.Usage().cells_total});
    }
  }
  room_[seq] = RoomReservation{seq, positions, expires};
  return absl::OkStatus();
}

// ---- Read / Visible / CanResume -----------------------------------------------------------

absl::StatusOr<ReadResult> Cache::Read(int64_t seq, int32_t begin,
                                       std::optional<int32_t> end) const {
  return Read(seq, begin, end, [](size_t) { return absl::OkStatus(); });
}

absl::Status Cache::CheckReadArgs(int64_t seq, int32_t begin, std::optional<int32_t> end) const {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("begin", begin));
  if (end.has_value() && *end < begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("begin = ", begin, " is greater than end = ", *end));
  }
  return absl::OkStatus();
}

absl::StatusOr<ReadResult> Cache::Read(int64_t seq, int32_t begin, std::optional<int32_t> end,
                                       absl::FunctionRef<absl::Status(size_t)> admit) const {
  RETURN_IF_ERROR(CheckReadArgs(seq, begin, end));
  ReaderMutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUsableLocked());
  if (!IsLiveLocked(seq)) {
    return absl::NotFoundError(absl::StrCat("cache '", spec_.name, "' has no sequence ", seq));
  }
  const int32_t offset = OffsetLocked(seq);
  const int64_t stop = end.has_value() ? int64_t{*end} : int64_t{INT32_MAX} + 1;
  ReadResult result;
  std::vector<ReadPart> parts;
  parts.reserve(groups_.size());
  size_t total = 0;
  for (const auto& group : groups_) {
    parts.push_back(group->PlanRead(seq, begin, stop, offset));
    total += parts.back().bytes;
  }
  RETURN_IF_ERROR(admit(total));
  result.payload.resize(total);
  uint8_t* dst = reinterpret_cast<uint8_t*>(result.payload.data());
  for (size_t g = 0; g < groups_.size(); ++g) {
    RETURN_IF_ERROR(groups_[g]->Gather(seq, parts[g], dst));
    dst += parts[g].bytes;
    result.positions.push_back(std::move(parts[g].positions));
    result.states.push_back(parts[g].state);
  }
  TouchLocked({seq});
  return result;
}

namespace {

absl::Status CheckVisibleRequest(const CacheSpec& spec, int group,
                                 absl::Span<const Query> queries) {
  if (group < 0 || group >= static_cast<int>(spec.groups.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("group = ", group, " is out of range [0, ", spec.groups.size(), ")"));
  }
  if (spec.groups[group].kind == GroupKind::kRecurrent) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group = ", group, " is Recurrent: it holds a state, not positions to attend to"));
  }
  for (size_t i = 0; i < queries.size(); ++i) {
    if (queries[i].seq < 0 || queries[i].pos < 0) {
      return absl::InvalidArgumentError(absl::StrCat("queries[", i, "] has seq = ", queries[i].seq,
                                                     ", pos = ", queries[i].pos,
                                                     "; both must be >= 0"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::vector<int32_t>>> Cache::Visible(
    int group, absl::Span<const Query> queries) const {
  return Visible(group, queries, [](int64_t) { return absl::OkStatus(); });
}

absl::StatusOr<std::vector<std::vector<int32_t>>> Cache::Visible(
    int group, absl::Span<const Query> queries,
    absl::FunctionRef<absl::Status(int64_t max_positions)> admit) const {
  RETURN_IF_ERROR(CheckVisibleRequest(spec_, group, queries));
  ReaderMutexLock lock(&mu_);
  RETURN_IF_ERROR(admit(VisibleBoundLocked(group, queries)));
  std::vector<std::vector<int32_t>> out;
  out.reserve(queries.size());
  for (const Query& q : queries) out.push_back(groups_[group]->Visible(q));
  TouchQueriesLocked(queries);
  return out;
}

absl::StatusOr<std::vector<std::vector<PositionRange>>> Cache::VisibleRanges(
    int group, absl::Span<const Query> queries,
    absl::FunctionRef<absl::Status(int64_t max_ranges)> admit) const {
  RETURN_IF_ERROR(CheckVisibleRequest(spec_, group, queries));
  ReaderMutexLock lock(&mu_);
  int64_t bound = 0;  // at most queries x 2^31: no overflow
  for (const Query& q : queries) bound += groups_[group]->VisibleRangesBound(q);
  RETURN_IF_ERROR(admit(bound));
  std::vector<std::vector<PositionRange>> out(queries.size());
  for (size_t i = 0; i < queries.size(); ++i) groups_[group]->VisibleRanges(queries[i], &out[i]);
  TouchQueriesLocked(queries);
  return out;
}

int64_t Cache::VisibleBoundLocked(int group, absl::Span<const Query> queries) const {
  int64_t bound = 0;  // at most queries x 2^31: no overflow
  for (const Query& q : queries) bound += groups_[group]->VisibleBound(q);
  return bound;
}

absl::StatusOr<bool> Cache::CanResume(int64_t seq, int32_t pos) const {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("pos", pos));
  ReaderMutexLock lock(&mu_);
  TouchLocked({seq});
  for (const auto& group : groups_) {
    if (!group->CanResume(seq, pos)) return false;
  }
  return true;
}

// ---- CopyPrefix / Remove ------------------------------------------------------------------

absl::StatusOr<int32_t> Cache::CopyPrefix(int64_t src_seq, int64_t dst_seq, int32_t length,
                                          int32_t require_src_offset) {
  RETURN_IF_ERROR(CheckNonNegative("src_seq", src_seq));
  RETURN_IF_ERROR(CheckNonNegative("dst_seq", dst_seq));
  RETURN_IF_ERROR(CheckNonNegative("length", length));
  RETURN_IF_ERROR(CheckCopyPrefixCondition(length, require_src_offset));
  if (src_seq == dst_seq) {
    return absl::InvalidArgumentError(absl::StrCat("src_seq and dst_seq are both ", src_seq,
                                                   "; a prefix copy needs two sequences"));
  }
  MutexLock lock(&mu_);
  AwaitNotAppendingLocked({dst_seq});
  const HeldBack held = HoldBackLocked({dst_seq});
  RETURN_IF_ERROR(CheckUsableLocked());
  RETURN_IF_ERROR(CheckNotPendingLocked(src_seq, "CopyPrefix from it"));
  RETURN_IF_ERROR(CheckNotPendingLocked(dst_seq, "CopyPrefix into it"));
  RETURN_IF_ERROR(CheckOffsetAtLeastLocked(src_seq, require_src_offset));
  auto check = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
    bool dst_live_after = false;
    for (const auto& group : groups_) {
      RETURN_IF_ERROR(group->CheckCopyPrefix(src_seq, dst_seq, length));
      dst_live_after |= group->CopyPrefixYields(src_seq, length);
    }
    if (dst_live_after) RETURN_IF_ERROR(CheckRoomForLocked(dst_seq, "copying a prefix"));
    return absl::OkStatus();
  };
  // Under LRU a copy that needs a sequence slot or a ring makes room as an Append does.
  if (absl::Status room = check(); !room.ok()) {
    RETURN_IF_ERROR(MakeRoomLocked(std::move(room), {src_seq, dst_seq}, check));
  }
  absl::Status status;
  for (const auto& group : groups_) {
    const absl::Status s = group->ApplyCopyPrefix(src_seq, dst_seq, length);
    if (status.ok()) status = s;
  }
  if (const TokenChain* src_chain = tokens_.Find(src_seq); src_chain == nullptr) {
    DropChainLocked(dst_seq);
  } else {
    SetChainLocked(dst_seq, src_chain->CopyPrefix(length));
  }
  TouchLocked({src_seq, dst_seq});
  ForgetIfDeadLocked(dst_seq);
  RETURN_IF_ERROR(FailLocked(status));
  return OffsetLocked(dst_seq);
}

absl::Status Cache::CheckCopyPrefixCondition(int32_t length, int32_t require_src_offset) {
  RETURN_IF_ERROR(CheckNonNegative("require_src_offset", require_src_offset));
  if (length == 0 && require_src_offset > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("require_src_offset = ", require_src_offset,
                     " with length = 0: a copy of nothing empties dst whatever src holds"));
  }
  return absl::OkStatus();
}

absl::Status Cache::CheckOffsetAtLeastLocked(int64_t seq, int32_t required) const {
  if (required == 0) return absl::OkStatus();
  const int32_t offset = OffsetLocked(seq);
  if (offset >= required) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("sequence ", seq, " of cache '", spec_.name, "' has offset ", offset,
                   offset == 0 ? " (it stores nothing)" : "", ", below the required ", required));
}

absl::Status Cache::Remove(int64_t seq, int32_t begin, std::optional<int32_t> end) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("begin", begin));
  if (end.has_value() && *end < begin) {
    return absl::InvalidArgumentError(
        absl::StrCat("begin = ", begin, " is greater than end = ", *end));
  }
  if (end.has_value() && *end == begin) return absl::OkStatus();
  MutexLock lock(&mu_);
  AwaitNotAppendingLocked({seq});
  const HeldBack held = HoldBackLocked({seq});
  RETURN_IF_ERROR(CheckUsableLocked());
  RETURN_IF_ERROR(CheckNotPendingLocked(seq, "Remove"));
  for (const auto& group : groups_) RETURN_IF_ERROR(group->CheckRemove(seq, begin, end));
  const int32_t offset = OffsetLocked(seq);
  absl::Status status;
  for (const auto& group : groups_) {
    const absl::Status s = group->ApplyRemove(seq, begin, end);
    if (status.ok()) status = s;
  }
  Event removed;
  removed.kind = EventKind::kRemoved;
  removed.seq = seq;
  removed.begin = begin;
  removed.end = end.value_or(-1);
  PublishLocked(std::move(removed));
  if (TokenChain* chain = tokens_.FindMutable(seq); chain != nullptr) {
    // Positions past the range move down only when there are some.
    if (end.has_value() && *end < offset) {
      chain->Erase(begin, *end);
    } else {
      chain->Truncate(begin);
    }
    SyncTokensLocked(seq);
  }
  TouchLocked({seq});
  ForgetIfDeadLocked(seq);
  return FailLocked(status);
}

// ---- Listing ------------------------------------------------------------------------------

SequenceInfo Cache::SequenceInfoLocked(int64_t seq) const {
  SequenceInfo info;
  info.seq = seq;
  info.offset = OffsetLocked(seq);
  auto pending = pending_.find(seq);
  if (pending != pending_.end()) info.pending = static_cast<int32_t>(pending->second.size());
  for (const auto& group : groups_) info.groups.push_back(group->Info(seq));
  if (const TokenChain* chain = tokens_.Find(seq); chain != nullptr) {
    info.tokens = static_cast<int32_t>(chain->ids().size());
    info.exact_tokens = chain->exact();
    info.token_blocks = static_cast<int32_t>(chain->hashes().size());
  }
  const Retention retention = retention_.Get(seq);
  info.priority = retention.priority;
  info.pinned = retention.pinned;
  info.ttl = retention.ttl;
  if (const std::optional<absl::Time> used = retention_.LastUse(seq)) info.last_used = *used;
  return info;
}

std::vector<SequenceInfo> Cache::ListSequences() const {
  return ListSequences(0, std::numeric_limits<size_t>::max() - 1).sequences;
}

Cache::SequencePage Cache::ListSequences(int64_t first, size_t limit) const {
  limit = std::clamp<size_t>(limit, 1, std::numeric_limits<size_t>::max() - 1);
  ReaderMutexLock lock(&mu_);
  // Each group's first limit + 1 ids from `first`: the page's ids are the lowest limit + 1 of
  // their union (one more than the page, to tell whether more follow).
  std::vector<int64_t> ids;
  for (const auto& group : groups_) {
    const size_t before = ids.size();
    group->LiveFrom(first, limit + 1, &ids);
    std::inplace_merge(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(before), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    if (ids.size() > limit + 1) ids.resize(limit + 1);
  }
  SequencePage page;
  page.more = ids.size() > limit;
  if (page.more) ids.resize(limit);
  page.sequences.reserve(ids.size());
  for (int64_t seq : ids) page.sequences.push_back(SequenceInfoLocked(seq));
  return page;
}

std::optional<SequenceInfo> Cache::GetSequence(int64_t seq) const {
  ReaderMutexLock lock(&mu_);
  if (!IsLiveLocked(seq)) return std::nullopt;
  return SequenceInfoLocked(seq);
}

std::vector<int64_t> Cache::SharedCells() const {
  ReaderMutexLock lock(&mu_);
  std::vector<int64_t> shared;
  shared.reserve(groups_.size());
  for (const auto& group : groups_) shared.push_back(group->SharedCellCount());
  return shared;
}

CacheUsage Cache::Usage() const {
  ReaderMutexLock lock(&mu_);
  CacheUsage usage;
  absl::flat_hash_set<const RowChunk*> pending_chunks;
  for (const auto& group : groups_) {
    usage.groups.push_back(group->Usage());
    usage.bytes_held += usage.groups.back().bytes;
    group->AddPendingChunks(&pending_chunks);
  }
  for (const RowChunk* chunk : pending_chunks) usage.bytes_held += chunk->arena.size();
  usage.sequences_live = LiveCountLocked();
  usage.snapshot_bytes = snapshots_.ChunkBytes();
  usage.export_bytes = export_bytes_->load();
  usage.snapshots = static_cast<int32_t>(snapshots_.size());
  const absl::Time now = absl::Now();
  for (const auto& [seq, reservation] : room_) {
    if (reservation.expires <= now) continue;
    for (size_t g = 0; g < groups_.size(); ++g) {
      usage.groups[g].cells_reserved += groups_[g]->UnitsToGrow(seq, reservation.positions);
    }
    usage.sequences_reserved += !IsLiveLocked(seq);
  }
  return usage;
}

}  // namespace kvmesh
