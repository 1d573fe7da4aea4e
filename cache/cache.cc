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
#include "cache/layer_group.h"
#include "cache/recurrent_group.h"
#include "cache/rotating_group.h"
#include "cache/shortage.h"
#include "cache/snapshot_wire.h"
#include "cache/status_macros.h"

namespace kvmesh {

namespace {

absl::Status CheckNonNegative(const char* what, int64_t value) {
  if (value < 0)
    return absl::InvalidArgumentError(absl::StrCat(what, " = ", value, " is negative"));
  return absl::OkStatus();
}

bool HasKind(const CacheSpec& spec, GroupKind kind) {
  for (const GroupSpec& g : spec.groups) {
    if (g.kind == kind) return true;
  }
  return false;
}

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

const char* StateStatusName(StateStatus status) {
  switch (status) {
    case StateStatus::kNone:
      return "NONE";
    case StateStatus::kValid:
      return "VALID";
    case StateStatus::kInvalid:
      return "INVALID";
  }
  return "UNKNOWN";
}

Cache::Cache(const CacheSpec& spec, const TokenHasher& hasher)
    : spec_(spec),
      contiguous_(RequiresContiguousPositions(spec)),
      has_attention_(HasKind(spec, GroupKind::kAttention)),
      hasher_(hasher),
      token_limit_(TokenIdLimit(spec)) {}

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
                                          MemoryPool::kCache, stream));
        cache->groups_.push_back(
            std::make_unique<AttentionGroup>(index, spec, std::move(arena), device));
        break;
      }
      case GroupKind::kRotating: {
        ASSIGN_OR_RETURN(DeviceArena arena,
                         device->Allocate(ComputeRotatingGeometry(spec, index).bytes,
                                          MemoryPool::kCache, stream));
        cache->groups_.push_back(
            std::make_unique<RotatingGroup>(index, spec, std::move(arena), device));
        break;
      }
      case GroupKind::kRecurrent: {
        ASSIGN_OR_RETURN(DeviceArena arena,
                         device->Allocate(ComputeRecurrentGeometry(spec, index).bytes,
                                          MemoryPool::kCache, stream));
        cache->groups_.push_back(
            std::make_unique<RecurrentGroup>(index, spec, std::move(arena), device));
        break;
      }
    }
  }
  cache->reserved_append_ = true;
  cache->lends_cells_ = true;
  cache->pieces_in_place_ = true;
  for (const auto& group : cache->groups_) {
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

// ---- Retention and eviction ----------------------------------------------------------------

void Cache::RecordUseLocked(int64_t seq, absl::Time now) const {
  auto retention = retention_.find(seq);
  Use use{now, 0, false};
  if (retention != retention_.end()) {
    use.priority = retention->second.priority;
    use.pinned = retention->second.pinned;
  }
  auto [it, inserted] = last_used_.try_emplace(seq);
  if (!inserted && !it->second.pinned) {
    lru_.erase(LruKey(it->second.priority, it->second.time, seq));
  }
  it->second = use;
  if (!use.pinned) lru_.insert(LruKey(use.priority, use.time, seq));
}

void Cache::TouchLocked(absl::Span<const int64_t> seqs) const {
  const absl::Time now = absl::Now();
  MutexLock lock(&access_mu_);
  for (int64_t seq : seqs) {
    if (IsLiveLocked(seq)) RecordUseLocked(seq, now);
  }
}

void Cache::TouchQueriesLocked(absl::Span<const Query> queries) const {
  const absl::Time now = absl::Now();
  MutexLock lock(&access_mu_);
  int64_t last = -1;
  for (const Query& q : queries) {
    if (q.seq == last) continue;  // a batch's queries come grouped by sequence
    last = q.seq;
    if (IsLiveLocked(q.seq)) RecordUseLocked(q.seq, now);
  }
}

void Cache::ForgetIfDeadLocked(int64_t seq) {
  if (IsLiveLocked(seq) || appending_.contains(seq)) return;
  retention_.erase(seq);
  MutexLock lock(&access_mu_);
  auto it = last_used_.find(seq);
  if (it == last_used_.end()) return;
  if (!it->second.pinned) lru_.erase(LruKey(it->second.priority, it->second.time, seq));
  last_used_.erase(it);
}

absl::Status Cache::ValidateRetention(const Retention& retention) {
  if (retention.ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl ", absl::FormatDuration(retention.ttl), " is negative"));
  }
  return absl::OkStatus();
}

void Cache::SetRetentionLocked(int64_t seq, const Retention& retention) {
  if (retention.priority == 0 && !retention.pinned && retention.ttl == absl::ZeroDuration()) {
    retention_.erase(seq);
  } else {
    retention_[seq] = retention;
  }
}

absl::Status Cache::SetRetention(int64_t seq, const Retention& retention) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(ValidateRetention(retention));
  MutexLock lock(&mu_);
  if (!IsLiveLocked(seq)) {
    return absl::NotFoundError(absl::StrCat("sequence ", seq, " stores nothing"));
  }
  SetRetentionLocked(seq, retention);
  TouchLocked({seq});
  return absl::OkStatus();
}

void Cache::SetEvictionFilter(std::function<bool(int64_t seq)> may_evict) {
  MutexLock lock(&mu_);
  may_evict_ = std::move(may_evict);
}

Cache::EvictionCounts Cache::Evictions() const {
  ReaderMutexLock lock(&mu_);
  return evictions_;
}

bool Cache::EvictableLocked(int64_t seq, bool lru, absl::Time now) const {
  if (pending_.contains(seq) || appending_.contains(seq)) return false;
  auto room = room_.find(seq);
  if (room != room_.end() && room->second.expires > now) return false;
  if (lru) {
    auto it = retention_.find(seq);
    if (it != retention_.end() && it->second.pinned) return false;
  }
  for (const auto& group : groups_) {
    if (group->HasPinnedCells(seq)) return false;
  }
  return !may_evict_ || may_evict_(seq);
}

void Cache::EvictLocked(absl::Span<const int64_t> seqs, const char* reason) {
  absl::Status status;
  for (int64_t seq : seqs) {
    Event evicted;
    evicted.kind = EventKind::kEvicted;
    evicted.seq = seq;
    evicted.offset = OffsetLocked(seq);
    evicted.reason = reason;
    // A whole sequence goes: nothing moves, so no group copies or re-rotates anything.
    for (const auto& group : groups_) {
      const absl::Status s = group->ApplyRemove(seq, 0, std::nullopt);
      if (status.ok()) status = s;
    }
    PublishLocked(std::move(evicted));
    SyncTokensLocked(seq);
    ForgetIfDeadLocked(seq);
    ++(std::string_view(reason) == "ttl" ? evictions_.ttl : evictions_.lru);
  }
  FailLocked(status).IgnoreError();
}

std::vector<int64_t> Cache::ExpireIdle(absl::Time now) {
  MutexLock lock(&mu_);
  if (!CheckUsableLocked().ok()) return {};
  std::vector<int64_t> expired;
  {
    MutexLock access(&access_mu_);
    for (const auto& [seq, retention] : retention_) {
      if (retention.ttl <= absl::ZeroDuration()) continue;
      auto used = last_used_.find(seq);
      const absl::Time last = used == last_used_.end() ? absl::InfinitePast() : used->second.time;
      if (last + retention.ttl <= now && EvictableLocked(seq, /*lru=*/false, now)) {
        expired.push_back(seq);
      }
    }
  }
  std::sort(expired.begin(), expired.end());
  EvictLocked(expired, "ttl");
  return expired;
}

namespace {

// The shortage of a refusal that evicting sequences can relieve.
std::optional<Shortage> RoomShortage(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kResourceExhausted) return std::nullopt;
  std::optional<Shortage> shortage = GetShortage(status);
  if (!shortage.has_value()) return std::nullopt;
  switch (shortage->resource) {
    case Resource::kCells:
    case Resource::kRings:
    case Resource::kStateSlots:
    case Resource::kSequences:
      return shortage;
    default:
      return std::nullopt;
  }
}

}  // namespace

absl::StatusOr<Cache::Admission> Cache::AdmitAppendLocked(
    AppendBatch& batch, const absl::flat_hash_map<int64_t, int32_t>& count, bool may_evict) {
  absl::Status status = CheckAppendLocked(batch, count);
  if (status.ok()) status = PrepareAppendLocked(batch);
  if (status.ok()) return Admission::kPrepared;
  if (spec_.eviction != EvictionPolicy::kLru) return status;
  const std::optional<Shortage> shortage = RoomShortage(status);
  if (!shortage.has_value()) return status;
  const std::optional<std::vector<int64_t>> victims = PlanEvictionLocked(batch, count, status);
  if (!victims.has_value()) {
    return ResourceExhaustedWith(
        absl::StrCat(status.message(),
                     "; evicting every sequence the LRU policy may evict (not pinned, not in "
                     "use) would not make room"),
        *shortage);
  }
  if (!may_evict) return Admission::kWouldEvict;
  EvictLocked(*victims, "lru");
  // What the victims freed is at least what the plan counted (cells they shared with others
  // may be freed by pruning too now), so this cannot fail for room.
  status = CheckAppendLocked(batch, count);
  if (status.ok()) status = PrepareAppendLocked(batch);
  if (!status.ok()) return status;
  return Admission::kEvictedAndPrepared;
}

std::optional<std::vector<int64_t>> Cache::PlanEvictionLocked(
    AppendBatch& batch, const absl::flat_hash_map<int64_t, int32_t>& count, absl::Status refusal) {
  const absl::Time now = absl::Now();
  // Candidates in eviction order, straight from lru_ (unpinned live sequences): those in use
  // and the batch's own are passed over.
  const absl::flat_hash_set<int64_t> own(batch.seqs.begin(), batch.seqs.end());
  MutexLock access(&access_mu_);
  auto next = lru_.begin();
  auto take = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> std::optional<int64_t> {
    while (next != lru_.end()) {
      const int64_t seq = std::get<2>(*next++);
      if (!own.contains(seq) && EvictableLocked(seq, /*lru=*/true, now)) return seq;
    }
    return std::nullopt;
  };

  // Victims are taken in order until they cover what the last refusal said was short; then the
  // batch is weighed again with what they would free counted as free (a negative held-back),
  // which may find another group short, and so on.
  std::vector<LayerGroup::EvictionTally> tallies(groups_.size());
  std::vector<int64_t> held(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) held[g] = groups_[g]->held_back();
  const int32_t held_sequences = held_sequences_;
  std::vector<int64_t> victims;
  absl::flat_hash_set<int64_t> evicting;
  while (true) {
    const std::optional<Shortage> shortage = RoomShortage(refusal);
    if (!shortage.has_value()) return std::nullopt;
    const bool sequences = shortage->resource == Resource::kSequences;
    if (!sequences &&
        (shortage->group < 0 || static_cast<size_t>(shortage->group) >= groups_.size())) {
      return std::nullopt;
    }
    auto gained = [&]() -> int64_t {
      return sequences ? static_cast<int64_t>(victims.size()) : tallies[shortage->group].units;
    };
    const int64_t target = gained() + std::max<int64_t>(1, shortage->needed - shortage->free);
    while (gained() < target) {
      const std::optional<int64_t> candidate = take();
      if (!candidate.has_value()) break;
      const int64_t seq = *candidate;
      victims.push_back(seq);
      evicting.insert(seq);
      for (size_t g = 0; g < groups_.size(); ++g) groups_[g]->TallyEviction(seq, &tallies[g]);
    }
    if (gained() < target) return std::nullopt;
    for (size_t g = 0; g < groups_.size(); ++g) {
      groups_[g]->set_held_back(held[g] - tallies[g].units);
      groups_[g]->set_evicting(&evicting);
    }
    held_sequences_ = held_sequences - static_cast<int32_t>(victims.size());
    refusal = CheckAppendLocked(batch, count);
    if (refusal.ok()) {
      refusal = PrepareAppendLocked(batch);
      if (refusal.ok()) {
        for (const auto& group : groups_) group->AbandonAppend();
      }
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      groups_[g]->set_held_back(held[g]);
      groups_[g]->set_evicting(nullptr);
    }
    held_sequences_ = held_sequences;
    if (refusal.ok()) return victims;
  }
}

std::vector<Cache::RoomReservation> Cache::Reservations() const {
  ReaderMutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::vector<RoomReservation> out;
  for (const auto& [seq, reservation] : room_) {
    if (reservation.expires > now) out.push_back(reservation);
  }
  std::sort(out.begin(), out.end(),
            [](const RoomReservation& a, const RoomReservation& b) { return a.seq < b.seq; });
  return out;
}

void Cache::AwaitNotAppendingLocked(absl::Span<const int64_t> seqs) {
  // Each wake-up starts over: an Append may have begun on a sequence already looked at.
  for (size_t i = 0; i < seqs.size();) {
    if (appending_.contains(seqs[i])) {
      appended_.wait(mu_);
      i = 0;
    } else {
      ++i;
    }
  }
}

absl::Status Cache::CheckRoomForLocked(int64_t seq, const char* what) const {
  if (IsLiveLocked(seq)) return absl::OkStatus();
  const int32_t live = ClaimedCountLocked();
  if (live + 1 <= spec_.max_sequences) return absl::OkStatus();
  return ResourceExhaustedWith(
      absl::StrCat(what, " would make sequence ", seq, " live beside ", live, " others",
                   held_sequences_ > 0
                       ? absl::StrCat(" (", held_sequences_, " of them reserved, not yet live)")
                       : "",
                   ", more than max_sequences = ", spec_.max_sequences),
      {Resource::kSequences, -1, 1, std::max(0, spec_.max_sequences - live), spec_.max_sequences});
}

// ---- Append -------------------------------------------------------------------------------

absl::Status Cache::CheckAppendBatch(absl::Span<const Token> tokens, size_t payload_bytes,
                                     bool speculative, AppendBatch* batch,
                                     absl::flat_hash_map<int64_t, int32_t>* count) const {
  if (tokens.empty()) return absl::InvalidArgumentError("tokens is empty");
  if (tokens.size() > static_cast<size_t>(spec_.max_batch)) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch of ", tokens.size(), " tokens exceeds max_batch = ", spec_.max_batch));
  }
  batch->tokens = tokens;
  batch->speculative = speculative;
  // Per sequence: the last position seen in the batch (to check ordering) and the lowest.
  absl::flat_hash_map<int64_t, int32_t> last_in_batch;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const Token& t = tokens[i];
    if (t.seq < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].seq = ", t.seq, " is negative"));
    }
    if (t.id < 0 && t.id != kNoTokenId) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].token_id = ", t.id, " is negative"));
    }
    if (t.pos < 0 || t.pos == INT32_MAX) {
      // INT32_MAX is excluded so that a sequence's offset (last + 1) stays an int32.
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "].pos = ", t.pos, " is outside [0, ", INT32_MAX, ")"));
    }
    auto [it, inserted] = last_in_batch.emplace(t.seq, t.pos);
    ++(*count)[t.seq];
    if (!inserted) {
      if (t.pos == it->second) {
        return absl::InvalidArgumentError(absl::StrCat("tokens[", i, "]: position ", t.pos,
                                                       " of sequence ", t.seq,
                                                       " appears twice in the batch"));
      }
      if (t.pos < it->second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tokens[", i, "]: position ", t.pos, " of sequence ", t.seq, " follows position ",
            it->second, "; positions of a sequence must increase"));
      }
      it->second = t.pos;
    } else {
      batch->lowest.emplace(t.seq, t.pos);
      batch->seqs.push_back(t.seq);
    }
  }
  const size_t expected = AppendPayloadBytes(spec_, static_cast<int64_t>(tokens.size()),
                                             static_cast<int64_t>(batch->seqs.size()), speculative);
  if (payload_bytes != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "payload is ", payload_bytes, " bytes; ", tokens.size(), " tokens of ", batch->seqs.size(),
        " sequences", speculative ? " (speculative)" : "", " need ", expected));
  }
  return absl::OkStatus();
}

namespace {

// Writes an Append's payload, arriving in pieces, into the cells reserved for it: in the Append
// layout, group after group, each group's planes one after the other, each plane one row per
// token. A row split between two pieces waits in `staging` until it is whole.
class RowScatter {
 public:
  RowScatter(const std::vector<std::unique_ptr<LayerGroup::Reservation>>* reservations,
             std::vector<std::vector<size_t>> row_bytes, size_t rows)
      : reservations_(reservations), row_bytes_(std::move(row_bytes)), rows_(rows) {
    size_t largest_row = 0;
    for (const auto& planes : row_bytes_) {
      for (size_t bytes : planes) largest_row = std::max(largest_row, bytes);
    }
    staging_.reserve(largest_row);
  }

  // The next bytes of the payload; no more than are left.
  absl::Status Write(absl::Span<const uint8_t> bytes) {
    while (!bytes.empty()) {
      const size_t row_bytes = row_bytes_[group_][plane_];
      if (!staging_.empty() || bytes.size() < row_bytes) {
        const size_t n = std::min(bytes.size(), row_bytes - staging_.size());
        staging_.insert(staging_.end(), bytes.begin(), bytes.begin() + n);
        bytes.remove_prefix(n);
        if (staging_.size() < row_bytes) break;
        absl::Status status = WriteRows(staging_.data(), 1);
        staging_.clear();
        RETURN_IF_ERROR(status);
        continue;
      }
      const size_t rows = std::min(bytes.size() / row_bytes, rows_ - row_);
      RETURN_IF_ERROR(WriteRows(bytes.data(), rows));
      bytes.remove_prefix(rows * row_bytes);
    }
    return absl::OkStatus();
  }

  size_t staging_capacity() const { return staging_.capacity(); }
  void FreeStaging() { std::vector<uint8_t>().swap(staging_); }

 private:
  // Whole rows at the cursor, which then moves past them.
  absl::Status WriteRows(const uint8_t* src, size_t rows) {
    RETURN_IF_ERROR((*reservations_)[group_]->WriteRows(plane_, row_, rows, src));
    row_ += rows;
    if (row_ == rows_) {
      row_ = 0;
      if (++plane_ == row_bytes_[group_].size()) {
        plane_ = 0;
        ++group_;
      }
    }
    return absl::OkStatus();
  }

  const std::vector<std::unique_ptr<LayerGroup::Reservation>>* const reservations_;
  const std::vector<std::vector<size_t>> row_bytes_;  // per group, per plane
  const size_t rows_;                                 // the batch's tokens
  size_t group_ = 0;
  size_t plane_ = 0;
  size_t row_ = 0;
  std::vector<uint8_t> staging_;
};

// Each group's planes' row bytes, as RowScatter takes them.
std::vector<std::vector<size_t>> RowBytes(const std::vector<std::unique_ptr<LayerGroup>>& groups) {
  std::vector<std::vector<size_t>> rows;
  for (const auto& group : groups) rows.push_back(group->SnapshotChunkFormat().row_bytes);
  return rows;
}

}  // namespace

absl::Status Cache::Append(absl::Span<const Token> tokens, absl::Span<const uint8_t> payload,
                           bool speculative) {
  const absl::Span<const uint8_t> pieces[] = {payload};
  return AppendPieces(tokens, pieces, speculative);
}

absl::Status Cache::AppendPieces(absl::Span<const Token> tokens,
                                 absl::Span<const absl::Span<const uint8_t>> pieces,
                                 bool speculative) {
  size_t payload_bytes = 0;
  for (const absl::Span<const uint8_t> piece : pieces) payload_bytes += piece.size();
  AppendBatch batch;
  absl::flat_hash_map<int64_t, int32_t> count;
  RETURN_IF_ERROR(CheckAppendBatch(tokens, payload_bytes, speculative, &batch, &count));
  // The payload in one piece: as it came, or gathered.
  std::string gathered;
  absl::Span<const uint8_t> whole = pieces.size() == 1 ? pieces[0] : absl::Span<const uint8_t>();
  auto gather = [&] {
    gathered.reserve(payload_bytes);
    for (const absl::Span<const uint8_t> piece : pieces) {
      gathered.append(reinterpret_cast<const char*>(piece.data()), piece.size());
    }
    whole = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(gathered.data()), payload_bytes);
  };
  // A cache that writes under its lock gathers the pieces before it takes the lock; cells on a
  // device, once they are reserved (below).
  const bool gathers = GathersPieces(pieces.size());
  if (gathers && !reserved_append_) gather();
  std::vector<size_t> section_bytes(spec_.groups.size());
  std::vector<std::unique_ptr<LayerGroup::Reservation>> reservations;
  std::vector<std::vector<size_t>> row_bytes;  // where the pieces go into the cells as they lie
  {
    MutexLock lock(&mu_);
    AwaitNotAppendingLocked(batch.seqs);
    const HeldBack held = HoldBackLocked(batch.seqs);
    ASSIGN_OR_RETURN(const Admission admission,
                     AdmitAppendLocked(batch, count, /*may_evict=*/true));
    for (size_t g = 0; g < groups_.size(); ++g) section_bytes[g] = groups_[g]->SectionBytes(batch);
    // After an eviction the bytes are written under the lock as well, so that no operation
    // sees the victims gone without the Append (and a failed write cannot leave them gone for
    // nothing, short of a device error).
    if (!reserved_append_ || admission == Admission::kEvictedAndPrepared) {
      if (pieces.size() != 1 && gathered.size() != payload_bytes) gather();
      return WriteAndCommitAppendLocked(batch, Sections(whole, section_bytes));
    }
    // Take the cells now and move the bytes with the lock released, so that operations on other
    // sequences do not wait behind the copy; those on the batch's sequences do (appending_).
    for (const auto& group : groups_) reservations.push_back(group->ReserveAppend(batch));
    appending_.insert(batch.seqs.begin(), batch.seqs.end());
    if (pieces.size() > 1 && !gathers) row_bytes = RowBytes(groups_);
  }

  absl::Status written;
  if (!row_bytes.empty()) {
    // Each piece from where it lies into the cells.
    RowScatter scatter(&reservations, std::move(row_bytes), batch.tokens.size());
    for (size_t i = 0; i < pieces.size() && written.ok(); ++i) written = scatter.Write(pieces[i]);
  } else {
    // Into device memory, each write is a copy that waits for the device: one per group, from
    // the payload gathered (with the lock released) when it came in pieces.
    if (gathers) gather();
    const std::vector<const uint8_t*> sections = Sections(whole, section_bytes);
    for (size_t g = 0; g < reservations.size() && written.ok(); ++g) {
      written = reservations[g]->Write(sections[g]);
    }
  }
  MutexLock lock(&mu_);
  for (int64_t seq : batch.seqs) appending_.erase(seq);
  appended_.notify_all();  // the waiters run once this commit has released mu_
  if (written.ok()) written = CheckUsableLocked();
  if (!written.ok()) {
    for (const auto& reservation : reservations) reservation->Abandon();
    return written;
  }
  // Other sequences' speculation may have begun or ended meanwhile; this batch's cannot.
  RefreshPendingFirstLocked(batch);
  for (const auto& reservation : reservations) reservation->Commit(batch);
  if (batch.speculative) {
    for (const Token& t : batch.tokens) pending_[t.seq].push_back(t.pos);
  }
  RecordTokensLocked(batch);
  return absl::OkStatus();
}

std::vector<const uint8_t*> Cache::Sections(absl::Span<const uint8_t> payload,
                                            absl::Span<const size_t> section_bytes) {
  std::vector<const uint8_t*> sections(section_bytes.size());
  const uint8_t* section = payload.data();
  for (size_t g = 0; g < section_bytes.size(); ++g) {
    sections[g] = section;
    section += section_bytes[g];
  }
  return sections;
}

void Cache::RefreshPendingFirstLocked(AppendBatch& batch) const {
  batch.pending_first.clear();
  for (const auto& [seq, positions] : pending_) batch.pending_first.emplace(seq, positions[0]);
}

absl::Status Cache::PrepareAppendLocked(AppendBatch& batch) {
  RefreshPendingFirstLocked(batch);
  for (size_t g = 0; g < groups_.size(); ++g) {
    const absl::Status prepared = groups_[g]->PrepareAppend(batch);
    if (!prepared.ok()) {
      for (size_t h = 0; h <= g; ++h) groups_[h]->AbandonAppend();
      return prepared;
    }
  }
  return absl::OkStatus();
}

// ---- AppendWriter -------------------------------------------------------------------------

struct AppendWriter::State {
  std::shared_ptr<Cache> cache;
  std::vector<Token> tokens;  // batch.tokens views them
  AppendBatch batch;
  absl::flat_hash_map<int64_t, int32_t> count;
  size_t size = 0;
  size_t written = 0;
  absl::Status error;  // final
  bool used = false;   // committed, or failed
  // In cells: one reservation per group, and what writes into them.
  std::vector<std::unique_ptr<LayerGroup::Reservation>> reservations;
  std::unique_ptr<RowScatter> scatter;
  // Otherwise: the payload, allocated by the first Write.
  std::string buffer;
  bool host_memory = true;  // every reservation's cells are in host memory

  // Gives the cells back however the writer goes (a reservation never outlives its state).
  ~State() {
    if (!reservations.empty()) cache->AbandonReservedAppend(*this);
  }
};

absl::StatusOr<std::unique_ptr<AppendWriter>> Cache::BeginAppend(
    const std::shared_ptr<Cache>& cache, absl::Span<const Token> tokens, size_t payload_bytes,
    bool speculative) {
  auto state = std::make_unique<AppendWriter::State>();
  state->cache = cache;
  state->tokens.assign(tokens.begin(), tokens.end());
  state->size = payload_bytes;
  RETURN_IF_ERROR(cache->CheckAppendBatch(state->tokens, payload_bytes, speculative, &state->batch,
                                          &state->count));
  AppendBatch& batch = state->batch;
  {
    MutexLock lock(&cache->mu_);
    cache->AwaitNotAppendingLocked(batch.seqs);
    const HeldBack held = cache->HoldBackLocked(batch.seqs);
    // A writer that would need an eviction evicts nothing now: it buffers the payload, and its
    // Commit's Append evicts, atomically with appending (the writer may never commit).
    ASSIGN_OR_RETURN(const Admission admission,
                     cache->AdmitAppendLocked(batch, state->count, /*may_evict=*/false));
    if (admission == Admission::kWouldEvict) {
      return std::unique_ptr<AppendWriter>(new AppendWriter(std::move(state)));
    }
    bool in_cells = cache->reserved_append_;
    for (const auto& group : cache->groups_) {
      in_cells = in_cells && group->CanReserveWithoutPruning(batch);
    }
    if (in_cells) {
      for (const auto& group : cache->groups_) {
        state->reservations.push_back(group->ReserveAppend(batch));
        state->host_memory = state->host_memory && state->reservations.back()->InHostMemory();
      }
      state->scatter = std::make_unique<RowScatter>(&state->reservations, RowBytes(cache->groups_),
                                                    batch.tokens.size());
    } else {
      for (const auto& group : cache->groups_) group->AbandonAppend();
    }
  }
  return std::unique_ptr<AppendWriter>(new AppendWriter(std::move(state)));
}

absl::Status Cache::CommitReservedAppend(AppendWriter::State& state) {
  AppendBatch& batch = state.batch;
  MutexLock lock(&mu_);
  AwaitNotAppendingLocked(batch.seqs);
  absl::Status status = CheckAppendLocked(batch, state.count);
  for (size_t g = 0; g < groups_.size() && status.ok(); ++g) {
    status = groups_[g]->RecheckAppend(batch);
  }
  if (!status.ok()) {
    for (const auto& reservation : state.reservations) reservation->Abandon();
    state.reservations.clear();
    return status;
  }
  RefreshPendingFirstLocked(batch);
  for (const auto& reservation : state.reservations) reservation->Commit(batch);
  state.reservations.clear();
  if (batch.speculative) {
    for (const Token& t : batch.tokens) pending_[t.seq].push_back(t.pos);
  }
  RecordTokensLocked(batch);
  return absl::OkStatus();
}

void Cache::AbandonReservedAppend(AppendWriter::State& state) {
  if (state.reservations.empty()) return;
  MutexLock lock(&mu_);
  for (const auto& reservation : state.reservations) reservation->Abandon();
  state.reservations.clear();
}

AppendWriter::AppendWriter(std::unique_ptr<State> state) : state_(std::move(state)) {}

AppendWriter::~AppendWriter() { Abandon(); }

size_t AppendWriter::size() const { return state_->size; }
size_t AppendWriter::written() const { return state_->written; }
bool AppendWriter::in_cells() const { return state_->scatter != nullptr; }
bool AppendWriter::in_host_memory() const { return state_->host_memory; }
size_t AppendWriter::host_bytes() const {
  return in_cells() ? state_->scatter->staging_capacity() : state_->size;
}

void AppendWriter::Abandon() {
  state_->cache->AbandonReservedAppend(*state_);
  std::string().swap(state_->buffer);
  if (state_->scatter != nullptr) state_->scatter->FreeStaging();
}

absl::Status AppendWriter::Write(absl::Span<const uint8_t> bytes) {
  State& s = *state_;
  if (!s.error.ok()) return s.error;
  if (s.used) return absl::FailedPreconditionError("the Append was committed already");
  if (bytes.size() > s.size - s.written) {
    s.error = absl::InvalidArgumentError(absl::StrCat("payload data exceeds its ", s.size,
                                                      " bytes: a write of ", bytes.size(),
                                                      " bytes after ", s.written));
    s.used = true;
    Abandon();
    return s.error;
  }
  s.written += bytes.size();
  if (!in_cells()) {
    // Allocated whole once, so that it never reallocates (which would hold two copies).
    if (s.buffer.capacity() < s.size) s.buffer.reserve(s.size);
    s.buffer.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return absl::OkStatus();
  }
  const absl::Status status = s.scatter->Write(bytes);
  if (!status.ok()) {
    s.error = status;
    s.used = true;
    Abandon();
  }
  return status;
}

absl::Status AppendWriter::Commit() {
  State& s = *state_;
  if (!s.error.ok()) return s.error;
  if (s.used) return absl::FailedPreconditionError("the Append was committed already");
  if (s.written != s.size) {
    return absl::FailedPreconditionError(
        absl::StrCat("payload data adds up to ", s.written, " bytes of ", s.size));
  }
  s.used = true;
  if (!in_cells()) {
    const absl::Status status = s.cache->Append(
        s.tokens,
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(s.buffer.data()), s.buffer.size()),
        s.batch.speculative);
    std::string().swap(s.buffer);
    return status;
  }
  return s.cache->CommitReservedAppend(s);
}

absl::Status Cache::CheckAppendLocked(const AppendBatch& batch,
                                      const absl::flat_hash_map<int64_t, int32_t>& count) const {
  RETURN_IF_ERROR(CheckUsableLocked());
  const absl::Span<const Token> tokens = batch.tokens;
  for (int64_t seq : batch.seqs) {
    if (!batch.speculative) RETURN_IF_ERROR(CheckNotPendingLocked(seq, "a plain Append"));
    const int32_t offset = OffsetLocked(seq);
    const int32_t first = batch.lowest.at(seq);
    if (batch.speculative) {
      if (first < offset) {
        return absl::InvalidArgumentError(
            absl::StrCat("speculative position ", first, " of sequence ", seq,
                         " is not past everything it stores (offset ", offset, ")"));
      }
      auto pending = pending_.find(seq);
      const size_t held = pending == pending_.end() ? 0 : pending->second.size();
      if (held + count.at(seq) > static_cast<size_t>(spec_.max_batch)) {
        return ResourceExhaustedWith(
            absl::StrCat("sequence ", seq, " would hold ", held + count.at(seq),
                         " pending speculative tokens, more than max_batch = ", spec_.max_batch),
            {Resource::kPendingTokens, -1, count.at(seq),
             std::max<int64_t>(0, spec_.max_batch - static_cast<int64_t>(held)), spec_.max_batch});
      }
    }
  }
  if (contiguous_) {
    absl::flat_hash_map<int64_t, int32_t> expected;
    for (size_t i = 0; i < tokens.size(); ++i) {
      auto [it, inserted] = expected.emplace(tokens[i].seq, 0);
      if (inserted) it->second = OffsetLocked(tokens[i].seq);
      if (tokens[i].pos != it->second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tokens[", i, "]: sequence ", tokens[i].seq, " has position ", tokens[i].pos, " where ",
            it->second, " is expected (its offset is ", OffsetLocked(tokens[i].seq),
            "); a cache with Rotating or Recurrent groups needs every Append to continue each "
            "sequence exactly at its offset, without gaps"));
      }
      ++it->second;
    }
  }
  int32_t new_sequences = 0;
  for (int64_t seq : batch.seqs) new_sequences += !IsLiveLocked(seq);
  const int32_t live = ClaimedCountLocked();
  if (live + new_sequences > spec_.max_sequences) {
    return ResourceExhaustedWith(
        absl::StrCat("the batch adds ", new_sequences, " new sequences to ", live, " live ones",
                     held_sequences_ > 0
                         ? absl::StrCat(" (", held_sequences_, " of them reserved, not yet live)")
                         : "",
                     ", more than max_sequences = ", spec_.max_sequences),
        {Resource::kSequences, -1, new_sequences, std::max(0, spec_.max_sequences - live),
         spec_.max_sequences});
  }
  return absl::OkStatus();
}

absl::Status Cache::WriteAndCommitAppendLocked(const AppendBatch& batch,
                                               absl::Span<const uint8_t* const> sections) {
  // Write every group before committing any: first those that write into fresh storage, then
  // those that overwrite in place, so that an error in the first kind leaves nothing changed.
  for (bool in_place : {false, true}) {
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (groups_[g]->WritesInPlace(batch) != in_place) continue;
      const absl::Status written = groups_[g]->WriteAppend(batch, sections[g]);
      if (!written.ok()) {
        for (const auto& group : groups_) group->AbandonAppend();
        return in_place ? FailLocked(written) : written;
      }
    }
  }
  for (const auto& group : groups_) group->CommitAppend(batch);
  if (batch.speculative) {
    for (const Token& t : batch.tokens) pending_[t.seq].push_back(t.pos);
  }
  RecordTokensLocked(batch);
  return absl::OkStatus();
}

void Cache::RecordTokensLocked(const AppendBatch& batch) {
  int64_t last_seq = -1;
  TokenChain* chain = nullptr;
  for (const Token& t : batch.tokens) {
    if (t.seq != last_seq) {
      last_seq = t.seq;
      auto it = chains_.find(t.seq);
      if (it == chains_.end() && t.id != kNoTokenId && t.pos == 0) {
        it = chains_.emplace(t.seq, TokenChain()).first;
      }
      chain = it == chains_.end() ? nullptr : &it->second;
    }
    if (chain != nullptr) chain->Stored(t.pos, t.id, batch.speculative, token_limit_);
  }
  for (int64_t seq : batch.seqs) SyncTokensLocked(seq);
  TouchLocked(batch.seqs);
}

void Cache::SyncTokensLocked(int64_t seq) {
  auto it = chains_.find(seq);
  if (it == chains_.end()) return;
  TokenChain& chain = it->second;
  if (!IsLiveLocked(seq)) return DropChainLocked(seq);
  chain.Truncate(OffsetLocked(seq));
  std::vector<uint64_t> dropped;
  const size_t kept = chain.Rehash(hasher_, &dropped);
  const absl::Span<const uint64_t> added = absl::MakeConstSpan(chain.hashes()).subspan(kept);
  block_index_.Remove(seq, dropped);
  block_index_.Add(seq, added);
  if (!dropped.empty() || !added.empty()) {
    Event event;
    event.kind = EventKind::kBlocks;
    event.seq = seq;
    event.offset = OffsetLocked(seq);
    event.kept_blocks = static_cast<int32_t>(kept);
    event.block_hashes.assign(added.begin(), added.end());
    PublishLocked(std::move(event));
  }
  if (chain.empty()) DropChainLocked(seq);
}

void Cache::SetChainLocked(int64_t seq, TokenChain chain) {
  auto it = chains_.find(seq);
  bool had_blocks = false;
  if (it == chains_.end()) {
    it = chains_.emplace(seq, std::move(chain)).first;
  } else {
    had_blocks = !it->second.hashes().empty();
    block_index_.Remove(seq, it->second.hashes());
    it->second = std::move(chain);
  }
  const std::vector<uint64_t>& hashes = it->second.hashes();
  block_index_.Add(seq, hashes);
  if (had_blocks || !hashes.empty()) {
    Event event;
    event.kind = EventKind::kBlocks;
    event.seq = seq;
    event.offset = OffsetLocked(seq);
    event.block_hashes = hashes;
    PublishLocked(std::move(event));
  }
  SyncTokensLocked(seq);
}

void Cache::DropChainLocked(int64_t seq) {
  auto it = chains_.find(seq);
  if (it == chains_.end()) return;
  const bool had_blocks = !it->second.hashes().empty();
  block_index_.Remove(seq, it->second.hashes());
  chains_.erase(it);
  if (had_blocks) {
    Event event;
    event.kind = EventKind::kBlocks;
    event.seq = seq;
    event.offset = OffsetLocked(seq);
    PublishLocked(std::move(event));
  }
}

TokenChain Cache::Tokens(int64_t seq) const {
  ReaderMutexLock lock(&mu_);
  auto it = chains_.find(seq);
  return it == chains_.end() ? TokenChain() : it->second;
}

absl::StatusOr<std::vector<PrefixMatch>> Cache::LookupPrefix(absl::Span<const int32_t> tokens,
                                                             int max_matches) const {
  if (max_matches < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_matches = ", max_matches, " is below 1"));
  }
  ASSIGN_OR_RETURN(const std::vector<uint64_t> hashes, PromptHashes(tokens));
  // No chain holds ids past the limit, so no match reaches past it.
  tokens = tokens.subspan(0, std::min(tokens.size(), static_cast<size_t>(token_limit_)));
  const size_t b = static_cast<size_t>(hasher_.block_size);
  std::vector<PrefixMatch> matches;
  ReaderMutexLock lock(&mu_);
  // Every block of a real match is in the index, so the match ends before the first block that
  // is not; a collision can only make `depth` larger, and verification sorts that out.
  size_t depth = 0;
  while (depth < hashes.size() && block_index_.Find(hashes[depth]) != nullptr) ++depth;
  // Level by level from the deepest: a sequence that really holds block `level` (and not the
  // next, or it would have been met a level deeper) matches [(level + 1) * b, (level + 2) * b)
  // tokens, so whole levels come in order of length, and the longest max_matches are among the
  // levels visited until that many matched. Each candidate costs a comparison of up to the
  // prompt's length: a prompt that many sequences share is answered from the first `budget`
  // candidates.
  // Within a level, the holders are ranked by how far they go past the level's blocks (at most
  // b - 1 ids compared each), and only those taken are compared from position 0.
  int64_t budget = std::max<int64_t>(64, int64_t{4} * max_matches);
  absl::flat_hash_set<int64_t> seen;
  std::vector<std::pair<size_t, int64_t>> ranked;  // (length if the blocks match, seq)
  for (size_t level = depth;
       level-- > 0 && budget > 0 && matches.size() < static_cast<size_t>(max_matches);) {
    const size_t base = (level + 1) * b;
    ranked.clear();
    for (int64_t seq : *block_index_.Find(hashes[level])) {
      // A sequence matched a level deeper holds this block too: it costs nothing here.
      if (seen.contains(seq)) continue;
      if (budget-- <= 0) break;
      const TokenChain& chain = chains_.at(seq);
      const size_t n = std::min(tokens.size(), static_cast<size_t>(chain.exact()));
      if (n < base) continue;  // its chain ends before this block: a collision
      const size_t tail = static_cast<size_t>(
          std::mismatch(tokens.begin() + base, tokens.begin() + n, chain.ids().begin() + base)
              .first -
          (tokens.begin() + base));
      ranked.emplace_back(base + tail, seq);
    }
    std::sort(ranked.begin(), ranked.end(), [](const auto& x, const auto& y) {
      return x.first != y.first ? x.first > y.first : x.second < y.second;
    });
    for (const auto& [length, seq] : ranked) {
      if (matches.size() >= static_cast<size_t>(max_matches)) break;
      // The index lists a sequence once per time it holds a hash: twice only by a collision.
      if (seen.contains(seq)) continue;
      // The blocks themselves, id by id: a hash that collided leaves the sequence to the
      // levels below, where it may really match.
      const TokenChain& chain = chains_.at(seq);
      if (!std::equal(tokens.begin(), tokens.begin() + base, chain.ids().begin())) continue;
      seen.insert(seq);
      PrefixMatch match;
      match.seq = seq;
      match.length = static_cast<int32_t>(length);
      match.offset = OffsetLocked(seq);
      match.can_resume = true;
      for (const auto& group : groups_) match.can_resume &= group->CanResume(seq, match.length);
      matches.push_back(match);
    }
  }
  std::sort(matches.begin(), matches.end(), [](const PrefixMatch& x, const PrefixMatch& y) {
    return x.length != y.length ? x.length > y.length : x.seq < y.seq;
  });
  if (matches.size() > static_cast<size_t>(max_matches)) matches.resize(max_matches);
  return matches;
}

absl::StatusOr<std::vector<uint64_t>> Cache::PromptHashes(absl::Span<const int32_t> tokens) const {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "] = ", tokens[i], " is negative"));
    }
  }
  tokens = tokens.subspan(0, std::min(tokens.size(), static_cast<size_t>(token_limit_)));
  const size_t b = static_cast<size_t>(hasher_.block_size);
  std::vector<uint64_t> hashes(tokens.size() / b);
  for (size_t i = 0; i < hashes.size(); ++i) {
    hashes[i] = hasher_.Block(i == 0 ? hasher_.seed : hashes[i - 1], tokens.subspan(i * b, b));
  }
  return hashes;
}

TokenIndexStats Cache::TokenIndex() const {
  ReaderMutexLock lock(&mu_);
  TokenIndexStats stats;
  stats.sequences = chains_.size();
  stats.hashes = block_index_.hashes();
  stats.entries = block_index_.entries();
  stats.bytes = block_index_.bytes();
  return stats;
}

absl::Status Cache::CommitSpeculation(int64_t seq, int32_t accepted) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("accepted", accepted));
  MutexLock lock(&mu_);
  AwaitNotAppendingLocked({seq});
  RETURN_IF_ERROR(CheckUsableLocked());
  auto it = pending_.find(seq);
  if (it == pending_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", seq, " has no pending speculative tokens to commit"));
  }
  const std::vector<int32_t>& pending = it->second;
  if (static_cast<size_t>(accepted) > pending.size()) {
    return absl::InvalidArgumentError(absl::StrCat("accepted = ", accepted, " is more than the ",
                                                   pending.size(), " pending tokens of sequence ",
                                                   seq));
  }
  absl::Status status;
  for (const auto& group : groups_) {
    const absl::Status s = group->CommitSpeculation(seq, pending, accepted);
    if (status.ok()) status = s;
  }
  auto chain = chains_.find(seq);
  if (chain != chains_.end()) {
    chain->second.Settle(accepted > 0 ? pending[accepted - 1] + 1 : pending[0]);
  }
  pending_.erase(it);
  SyncTokensLocked(seq);
  TouchLocked({seq});
  ForgetIfDeadLocked(seq);
  return FailLocked(status);
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
  bool dst_live_after = false;
  for (const auto& group : groups_) {
    RETURN_IF_ERROR(group->CheckCopyPrefix(src_seq, dst_seq, length));
    dst_live_after |= group->CopyPrefixYields(src_seq, length);
  }
  if (dst_live_after) {
    RETURN_IF_ERROR(CheckRoomForLocked(dst_seq, "copying a prefix"));
  }
  absl::Status status;
  for (const auto& group : groups_) {
    const absl::Status s = group->ApplyCopyPrefix(src_seq, dst_seq, length);
    if (status.ok()) status = s;
  }
  auto src_chain = chains_.find(src_seq);
  if (src_chain == chains_.end()) {
    DropChainLocked(dst_seq);
  } else {
    SetChainLocked(dst_seq, src_chain->second.CopyPrefix(length));
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
  auto chain = chains_.find(seq);
  if (chain != chains_.end()) {
    // Positions past the range move down only when there are some.
    if (end.has_value() && *end < offset) {
      chain->second.Erase(begin, *end);
    } else {
      chain->second.Truncate(begin);
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
  auto chain = chains_.find(seq);
  if (chain != chains_.end()) {
    info.tokens = static_cast<int32_t>(chain->second.ids().size());
    info.exact_tokens = chain->second.exact();
    info.token_blocks = static_cast<int32_t>(chain->second.hashes().size());
  }
  auto retention = retention_.find(seq);
  if (retention != retention_.end()) {
    info.priority = retention->second.priority;
    info.pinned = retention->second.pinned;
    info.ttl = retention->second.ttl;
  }
  MutexLock lock(&access_mu_);
  auto used = last_used_.find(seq);
  if (used != last_used_.end()) info.last_used = used->second.time;
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
  absl::flat_hash_set<const RowChunk*> snapshot_chunks;
  for (const auto& [id, record] : snapshots_) {
    for (const GroupSnapshot& g : record->groups) {
      for (const Segment& segment : g.segments) snapshot_chunks.insert(segment.chunk.get());
    }
  }
  snapshot_chunks.erase(nullptr);
  for (const RowChunk* chunk : snapshot_chunks) usage.snapshot_bytes += chunk->arena.size();
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
  auto it = snapshots_.find(id);
  if (it == snapshots_.end()) {
    return absl::NotFoundError(absl::StrCat("cache '", spec_.name, "' has no snapshot ", id));
  }
  return it->second.get();
}

SnapshotInfo Cache::AddSnapshotLocked(SnapshotRecord record) {
  record.id = next_snapshot_id_++;
  auto stored = std::make_unique<SnapshotRecord>(std::move(record));
  SnapshotInfo info = InfoLocked(*stored);
  snapshots_.emplace(info.id, std::move(stored));
  Event event;
  event.kind = EventKind::kSnapshotCreated;
  event.seq = info.seq;
  event.snapshot = info.id;
  PublishLocked(std::move(event));
  return info;
}

void Cache::EraseSnapshotLocked(uint64_t id) {
  auto it = snapshots_.find(id);
  if (it == snapshots_.end()) return;
  Event event;
  event.kind = EventKind::kSnapshotDropped;
  event.seq = it->second->seq;
  event.snapshot = id;
  snapshots_.erase(it);
  PublishLocked(std::move(event));
}

void Cache::DetachEvents(Event last) {
  MutexLock lock(&mu_);
  if (events_ == nullptr) return;
  events_->Publish(std::move(last));
  events_ = nullptr;
}

void Cache::PublishLocked(Event event) {
  if (events_ == nullptr) return;
  event.tenant = tenant_;
  event.cache = spec_.name;
  if (event.kind == EventKind::kBlocks) event.token_block_size = spec_.token_block_size;
  last_event_ = events_->Publish(std::move(event));
}

ChainListing Cache::ListChains() const {
  ReaderMutexLock lock(&mu_);
  ChainListing listing;
  listing.last_event = last_event_;
  listing.sequences.reserve(chains_.size());
  for (const auto& [seq, chain] : chains_) {
    if (chain.hashes().empty()) continue;
    listing.sequences.push_back({seq, OffsetLocked(seq), chain.hashes()});
  }
  std::sort(listing.sequences.begin(), listing.sequences.end(),
            [](const SequenceBlocks& a, const SequenceBlocks& b) { return a.seq < b.seq; });
  return listing;
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
  RETURN_IF_ERROR(CheckRoomForLocked(seq, what));
  for (size_t g = 0; g < groups_.size(); ++g) {
    RETURN_IF_ERROR(groups_[g]->CheckRoomForPositions(seq, positions[g]));
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
  auto chain = chains_.find(seq);
  if (chain != chains_.end()) record.tokens = chain->second.Prefix(record.to);
  TouchLocked({seq});
  return AddSnapshotLocked(std::move(record));
}

absl::Status Cache::Restore(int64_t seq, std::optional<uint64_t> snapshot_id, int32_t target,
                            const RestoreOptions& options) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("target", target));
  if (options.retention.has_value()) RETURN_IF_ERROR(ValidateRetention(*options.retention));
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
    auto chain = chains_.find(seq);
    const TokenIds& sent = record->tokens;
    const bool sent_exact = static_cast<int32_t>(sent.ids.size()) >= from &&
                            (sent.taint == kNoTaint || sent.taint >= from);
    const bool kept_exact = chain != chains_.end() && chain->second.exact() >= from &&
                            static_cast<int32_t>(chain->second.ids().size()) >= from;
    if (!sent_exact || !kept_exact ||
        !std::equal(sent.ids.begin(), sent.ids.begin() + from, chain->second.ids().begin())) {
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
  } else if (target > offset) {
    return absl::FailedPreconditionError(
        absl::StrCat("target = ", target, " is past the offset ", offset, " of sequence ", seq,
                     "; a rewind without a snapshot cannot go forward"));
  }
  const int32_t from = record == nullptr ? 0 : record->from;
  const int32_t to = record == nullptr ? offset : record->to;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GroupSnapshot* snap = record == nullptr ? nullptr : &record->groups[g];
    RETURN_IF_ERROR(groups_[g]->CheckRestore(seq, snap, from, to, target));
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
  if (options.retention.has_value()) SetRetentionLocked(seq, *options.retention);
  TouchLocked({seq});
  ForgetIfDeadLocked(seq);
  return FailLocked(status);
}

void Cache::RestoreTokensLocked(int64_t seq, const SnapshotRecord* record, int32_t target) {
  auto it = chains_.find(seq);
  if (record == nullptr) {
    if (it != chains_.end()) it->second.Truncate(target);
    SyncTokensLocked(seq);
    return;
  }
  // seq keeps its positions below the snapshot's start and gets the snapshot's data from there.
  // That data is what the snapshot's sequence computed after its own ids below the start: it
  // continues seq's chain exactly only when seq's ids there are the same.
  const int32_t from = record->from;
  const TokenIds& saved = record->tokens;
  TokenIds restored = it == chains_.end() ? TokenIds() : it->second.Prefix(from);
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
  for (const auto& [id, record] : snapshots_) out.push_back(InfoLocked(*record));
  return out;
}

Cache::SnapshotPage Cache::ListSnapshots(uint64_t first, size_t limit) const {
  limit = std::max<size_t>(limit, 1);
  ReaderMutexLock lock(&mu_);
  SnapshotPage page;
  for (auto it = snapshots_.lower_bound(first); it != snapshots_.end(); ++it) {
    if (page.snapshots.size() == limit) {
      page.more = true;
      break;
    }
    page.snapshots.push_back(InfoLocked(*it->second));
  }
  return page;
}

// ---- Moving snapshots between nodes ---------------------------------------------------------

namespace {

// An export reader that counts the bytes it pins in its cache's Usage().export_bytes.
class CountedExportReader final : public SnapshotExportReader {
 public:
  CountedExportReader(std::unique_ptr<SnapshotExportReader> inner,
                      std::shared_ptr<std::atomic<size_t>> counter, size_t bytes)
      : inner_(std::move(inner)), counter_(std::move(counter)), bytes_(bytes) {
    counter_->fetch_add(bytes_);
  }
  ~CountedExportReader() override { counter_->fetch_sub(bytes_); }
  size_t size() const override { return inner_->size(); }
  const SnapshotInfo& info() const override { return inner_->info(); }
  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    return inner_->ReadAt(offset, dst);
  }
  absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const override {
    return inner_->View(offset, max_bytes);
  }

 private:
  const std::unique_ptr<SnapshotExportReader> inner_;
  const std::shared_ptr<std::atomic<size_t>> counter_;
  const size_t bytes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SnapshotExportReader>> Cache::OpenSnapshotExport(uint64_t id) const {
  SnapshotRecord record;
  SnapshotInfo info;
  std::vector<ChunkFormat> formats;
  {
    ReaderMutexLock lock(&mu_);
    ASSIGN_OR_RETURN(const SnapshotRecord* found, FindSnapshotLocked(id));
    // The copy shares the chunks: they stay alive while the reader exists, whatever happens
    // to the snapshot.
    record = *found;
    info = InfoLocked(record);
    for (const auto& group : groups_) formats.push_back(group->SnapshotChunkFormat());
  }
  const size_t bytes = info.bytes;
  ASSIGN_OR_RETURN(
      std::unique_ptr<SnapshotExportReader> reader,
      NewSnapshotExportReader(spec_, std::move(record), std::move(info), std::move(formats)));
  return std::unique_ptr<SnapshotExportReader>(
      new CountedExportReader(std::move(reader), export_bytes_, bytes));
}

absl::StatusOr<std::unique_ptr<SnapshotImportWriter>> Cache::BeginSnapshotImport(
    size_t total_bytes) {
  const size_t min_bytes = MinSnapshotHeaderBytes(spec_);
  if (total_bytes < min_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "total_bytes = ", total_bytes, " is smaller than the smallest snapshot image (", min_bytes,
        " bytes) of cache '", spec_.name, "'"));
  }
  std::vector<ChunkFormat> formats;
  {
    ReaderMutexLock lock(&mu_);
    for (const auto& group : groups_) formats.push_back(group->SnapshotChunkFormat());
  }
  // The writer allocates and fills its chunks without the lock; only Commit takes it.
  return NewSnapshotImportWriter(spec_, std::move(formats), total_bytes,
                                 [this](SnapshotRecord record) {
                                   MutexLock lock(&mu_);
                                   return AddSnapshotLocked(std::move(record));
                                 });
}

// ---- Moving a sequence without a snapshot copy ---------------------------------------------

void Cache::UnpinCells(size_t group, absl::Span<const int32_t> cells) {
  MutexLock lock(&mu_);
  groups_[group]->Unpin(cells);
}

absl::StatusOr<std::unique_ptr<SnapshotExportReader>> Cache::OpenSequenceExport(
    const std::shared_ptr<Cache>& cache, int64_t seq, int32_t from_offset,
    std::optional<int32_t> to, int32_t require_offset) {
  Cache& c = *cache;
  if (!c.lends_cells_) {
    ASSIGN_OR_RETURN(const SnapshotInfo taken,
                     c.SnapshotRequiring(seq, from_offset, to, require_offset));
    absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader = c.OpenSnapshotExport(taken.id);
    // The reader shares the snapshot's chunks: the snapshot itself can go.
    (void)c.DropSnapshot(taken.id);
    return reader;
  }
  RETURN_IF_ERROR(c.CheckSnapshotArgs(seq, from_offset, to));
  SnapshotRecord record;
  SnapshotInfo info;
  std::vector<ChunkFormat> formats;
  {
    MutexLock lock(&c.mu_);
    RETURN_IF_ERROR(c.CheckOffsetAtLeastLocked(seq, require_offset));
    ASSIGN_OR_RETURN(const int32_t end, c.CheckSnapshotLocked(seq, from_offset, to));
    record = c.PinRecordLocked(cache, seq, from_offset, end, &formats);
    auto chain = c.chains_.find(seq);
    if (chain != c.chains_.end()) record.tokens = chain->second.Prefix(end);
    info = c.InfoLocked(record);
  }
  const size_t bytes = info.bytes;
  ASSIGN_OR_RETURN(
      std::unique_ptr<SnapshotExportReader> reader,
      NewSnapshotExportReader(c.spec_, std::move(record), std::move(info), std::move(formats)));
  return std::unique_ptr<SnapshotExportReader>(
      new CountedExportReader(std::move(reader), c.export_bytes_, bytes));
}

SnapshotRecord Cache::PinRecordLocked(const std::shared_ptr<Cache>& self, int64_t seq, int32_t from,
                                      int64_t to, std::vector<ChunkFormat>* formats) {
  SnapshotRecord record;
  record.seq = seq;
  record.from = from;
  record.to = static_cast<int32_t>(std::min<int64_t>(to, INT32_MAX));
  for (size_t g = 0; g < groups_.size(); ++g) {
    LayerGroup& group = *groups_[g];
    std::vector<int32_t> pinned;
    GroupSnapshot snap = group.PinSequence(seq, from, to, &pinned);
    if (!pinned.empty()) {
      // The last reference to the borrowed cells unpins them, outside the cache's lock: a
      // reader or cursor and the slices of a transfer hold them, never an operation of the
      // cache.
      std::shared_ptr<const RowChunk> cells(
          new RowChunk(group.BorrowCells()),
          [self, g, pinned = std::move(pinned)](const RowChunk* chunk) {
            self->UnpinCells(g, pinned);
            delete chunk;
          });
      for (Segment& segment : snap.segments) segment.chunk = cells;
    }
    record.groups.push_back(std::move(snap));
    formats->push_back(group.SnapshotChunkFormat());
  }
  return record;
}

namespace {

absl::Status CheckPayloadRange(size_t offset, size_t bytes, size_t size) {
  if (offset <= size && bytes <= size - offset) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat("ReadAt of ", bytes, " bytes at offset ", offset,
                                            " goes past the end of the ", size, "-byte payload"));
}

// A Read's payload as the data part of a wire image over pinned cells: for each group, each
// plane's rows in position order, which is Read's layout.
class PinnedReadCursor final : public ReadCursor {
 public:
  PinnedReadCursor(ReadResult header, std::unique_ptr<SnapshotExportReader> image,
                   size_t data_begin)
      : header_(std::move(header)), image_(std::move(image)), data_begin_(data_begin) {}
  const ReadResult& header() const override { return header_; }
  size_t size() const override { return image_->size() - data_begin_; }
  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    RETURN_IF_ERROR(CheckPayloadRange(offset, dst.size(), size()));
    return image_->ReadAt(data_begin_ + offset, dst);
  }
  absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const override {
    if (offset >= size()) return {};
    return image_->View(data_begin_ + offset, std::min(max_bytes, size() - offset));
  }

 private:
  const ReadResult header_;
  const std::unique_ptr<SnapshotExportReader> image_;
  const size_t data_begin_;
};

// A Read done at once, its payload kept.
class CopiedReadCursor final : public ReadCursor {
 public:
  explicit CopiedReadCursor(ReadResult result) : result_(std::move(result)) {}
  const ReadResult& header() const override { return result_; }
  size_t size() const override { return result_.payload.size(); }
  absl::Status ReadAt(size_t offset, absl::Span<uint8_t> dst) override {
    RETURN_IF_ERROR(CheckPayloadRange(offset, dst.size(), size()));
    if (!dst.empty()) std::memcpy(dst.data(), result_.payload.data() + offset, dst.size());
    return absl::OkStatus();
  }
  absl::Span<const uint8_t> View(size_t offset, size_t max_bytes) const override {
    if (offset >= size()) return {};
    return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(result_.payload.data()),
                                     result_.payload.size())
        .subspan(offset, max_bytes);
  }

 private:
  const ReadResult result_;
};

}  // namespace

std::unique_ptr<ReadCursor> NewCopiedReadCursor(ReadResult result) {
  return std::make_unique<CopiedReadCursor>(std::move(result));
}

absl::StatusOr<std::unique_ptr<ReadCursor>> Cache::OpenRead(const std::shared_ptr<Cache>& cache,
                                                            int64_t seq, int32_t begin,
                                                            std::optional<int32_t> end) {
  Cache& c = *cache;
  if (!c.lends_cells_) {
    ASSIGN_OR_RETURN(ReadResult result, c.Read(seq, begin, end));
    // Its header() has the payload too; callers use size() and ReadAt.
    return NewCopiedReadCursor(std::move(result));
  }
  RETURN_IF_ERROR(c.CheckReadArgs(seq, begin, end));
  SnapshotRecord record;
  SnapshotInfo info;
  std::vector<ChunkFormat> formats;
  {
    MutexLock lock(&c.mu_);
    RETURN_IF_ERROR(c.CheckUsableLocked());
    if (!c.IsLiveLocked(seq)) {
      return absl::NotFoundError(absl::StrCat("cache '", c.spec_.name, "' has no sequence ", seq));
    }
    const int64_t stop = end.has_value() ? int64_t{*end} : int64_t{INT32_MAX} + 1;
    record = c.PinRecordLocked(cache, seq, begin, stop, &formats);
    info = c.InfoLocked(record);
    c.TouchLocked({seq});
  }
  ReadResult header;
  for (const GroupSnapshot& g : record.groups) {
    std::vector<int32_t> positions;
    for (const Segment& segment : g.segments) {
      positions.insert(positions.end(), segment.positions.begin(), segment.positions.end());
    }
    header.positions.push_back(std::move(positions));
    header.states.push_back(StateStatus::kNone);
  }
  // The image's header is not part of the payload: the data follows it.
  const size_t data_bytes = info.bytes;
  ASSIGN_OR_RETURN(
      std::unique_ptr<SnapshotExportReader> image,
      NewSnapshotExportReader(c.spec_, std::move(record), std::move(info), std::move(formats)));
  const size_t data_begin = image->size() - data_bytes;
  return std::unique_ptr<ReadCursor>(
      new PinnedReadCursor(std::move(header), std::move(image), data_begin));
}

struct SequenceImport::State {
  // Guarded by the cache's lock once the writer exists.
  std::vector<std::vector<int32_t>> pinned;  // per group, the cells the import pinned
  bool in_cells = false;
  bool committed = false;
  bool used = false;      // by RestoreImport
  SnapshotRecord record;  // once committed
};

SequenceImport::~SequenceImport() {
  writer_.reset();
  for (size_t g = 0; g < state_->pinned.size(); ++g) {
    if (!state_->pinned[g].empty()) cache_->UnpinCells(g, state_->pinned[g]);
  }
}

bool SequenceImport::in_cells() const {
  ReaderMutexLock lock(&cache_->mu_);
  return state_->in_cells;
}

absl::StatusOr<bool> Cache::PlaceImport(SequenceImport::State& state, SnapshotRecord* record) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUsableLocked());
  // The import's sequence is not known yet: every room reservation is held back.
  const HeldBack held = HoldBackLocked({});
  std::vector<std::vector<int32_t>> pinned(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const int32_t rows = record->groups[g].stored();
    if (rows == 0) continue;
    pinned[g] = groups_[g]->PinFreeCells(rows);
    if (pinned[g].size() == static_cast<size_t>(rows)) continue;
    // Too few free cells now: the rows go to the snapshot pool, and the Restore copies them
    // (maybe into cells that the sequence's own old ones free).
    for (size_t h = 0; h < g; ++h) groups_[h]->Unpin(pinned[h]);
    return false;
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (pinned[g].empty()) continue;
    auto cells = std::make_shared<RowChunk>(groups_[g]->BorrowCells());
    size_t next = 0;
    for (Segment& segment : record->groups[g].segments) {
      segment.chunk = cells;
      segment.chunk_rows.assign(pinned[g].begin() + next, pinned[g].begin() + next + segment.rows);
      next += static_cast<size_t>(segment.rows);
    }
  }
  state.pinned = std::move(pinned);
  state.in_cells = true;
  return true;
}

SnapshotInfo Cache::CommitImport(SequenceImport::State& state, SnapshotRecord record) {
  MutexLock lock(&mu_);
  SnapshotInfo info = InfoLocked(record);
  state.record = std::move(record);
  state.committed = true;
  return info;
}

absl::StatusOr<std::unique_ptr<SequenceImport>> Cache::BeginSequenceImport(
    const std::shared_ptr<Cache>& cache, size_t total_bytes) {
  Cache& c = *cache;
  const size_t min_bytes = MinSnapshotHeaderBytes(c.spec_);
  if (total_bytes < min_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "total_bytes = ", total_bytes, " is smaller than the smallest snapshot image (", min_bytes,
        " bytes) of cache '", c.spec_.name, "'"));
  }
  auto state = std::make_shared<SequenceImport::State>();
  std::vector<ChunkFormat> formats;
  {
    ReaderMutexLock lock(&c.mu_);
    for (const auto& group : c.groups_) formats.push_back(group->SnapshotChunkFormat());
  }
  // The callbacks run on the writer's thread while the import (which holds the cache) exists.
  SnapshotPlaceFn place;
  if (c.lends_cells_) {
    place = [&c, state](SnapshotRecord* record) { return c.PlaceImport(*state, record); };
  }
  SnapshotCommitFn commit = [&c, state](SnapshotRecord record) {
    return c.CommitImport(*state, std::move(record));
  };
  std::unique_ptr<SequenceImport> import(new SequenceImport(cache, state));
  import->writer_ = NewSnapshotImportWriter(c.spec_, std::move(formats), total_bytes,
                                            std::move(commit), std::move(place));
  return import;
}

absl::Status Cache::RestoreImport(int64_t seq, SequenceImport& import, int32_t target,
                                  const RestoreOptions& options) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(CheckNonNegative("target", target));
  if (options.retention.has_value()) RETURN_IF_ERROR(ValidateRetention(*options.retention));
  if (import.cache_.get() != this) {
    return absl::FailedPreconditionError(
        absl::StrCat("the import was begun on another cache than '", spec_.name, "'"));
  }
  SequenceImport::State& state = *import.state_;
  MutexLock lock(&mu_);
  if (!state.committed || state.used) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the import into cache '", spec_.name, "' ", state.used ? "was used" : "is not committed"));
  }
  AwaitNotAppendingLocked({seq});
  RETURN_IF_ERROR(CheckUsableLocked());
  RETURN_IF_ERROR(CheckNotPendingLocked(seq, "Restore"));
  const absl::Status status = RestoreLocked(seq, &state.record, target, options);
  // A refusal changed nothing, and the import may be restored still. Otherwise it is used up:
  // the sequence took the cells it restored, and the others are free again.
  if (!status.ok() && device_failure_.ok()) return status;
  state.used = true;
  for (size_t g = 0; g < state.pinned.size(); ++g) groups_[g]->Unpin(state.pinned[g]);
  state.pinned.clear();
  state.record = SnapshotRecord();
  return status;
}

}  // namespace kvmesh
