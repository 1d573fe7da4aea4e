// The Cache's eviction mechanism: an Append's admission with the victims the RetentionIndex's
// order gives, TTL expiry, and room reservations (cache/cache.h, "Where things live").
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

// ---- Retention and eviction ----------------------------------------------------------------

void Cache::TouchLocked(absl::Span<const int64_t> seqs) const {
  RetentionIndex::Uses uses(&retention_, absl::Now());
  for (int64_t seq : seqs) {
    if (IsLiveLocked(seq)) uses.Record(seq);
  }
}

void Cache::TouchQueriesLocked(absl::Span<const Query> queries) const {
  RetentionIndex::Uses uses(&retention_, absl::Now());
  int64_t last = -1;
  for (const Query& q : queries) {
    if (q.seq == last) continue;  // a batch's queries come grouped by sequence
    last = q.seq;
    if (IsLiveLocked(q.seq)) uses.Record(q.seq);
  }
}

void Cache::ForgetIfDeadLocked(int64_t seq) {
  if (IsLiveLocked(seq) || appending_.contains(seq)) return;
  retention_.Forget(seq);
}

absl::Status Cache::SetRetention(int64_t seq, const Retention& retention) {
  RETURN_IF_ERROR(ValidateSeq(seq));
  RETURN_IF_ERROR(RetentionIndex::Validate(retention));
  MutexLock lock(&mu_);
  if (!IsLiveLocked(seq)) {
    return absl::NotFoundError(absl::StrCat("sequence ", seq, " stores nothing"));
  }
  retention_.Set(seq, retention);
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
  if (lru && retention_.Get(seq).pinned) return false;
  // Being read (a Read, an export, a worker's pin): the reader holds the cells anyway, and an
  // eviction would free nothing of them. A sequence that only shares cells with one being read
  // may go: its own cells free, the shared ones stay with the reader and their other holders.
  if (read_pins_.contains(seq)) return false;
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
  // The policy says whose TTL has run out; those in use stay.
  std::vector<int64_t> expired = retention_.Expired(now);
  expired.erase(std::remove_if(expired.begin(), expired.end(),
                               [&](int64_t seq) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                 return !EvictableLocked(seq, /*lru=*/false, now);
                               }),
                expired.end());
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

// A refusal for room that no eviction the LRU policy may make would relieve.
absl::Status NoRoomByEviction(const absl::Status& refusal, const Shortage& shortage) {
  return ResourceExhaustedWith(
      absl::StrCat(refusal.message(),
                   "; evicting every sequence the LRU policy may evict (not pinned, not in "
                   "use) would not make room"),
      shortage);
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
  const std::optional<std::vector<int64_t>> victims = PlanEvictionLocked(
      batch.seqs,
      [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        absl::Status refusal = CheckAppendLocked(batch, count);
        if (refusal.ok()) {
          refusal = PrepareAppendLocked(batch);
          if (refusal.ok()) {
            for (const auto& group : groups_) group->AbandonAppend();
          }
        }
        return refusal;
      },
      status);
  if (!victims.has_value()) return NoRoomByEviction(status, *shortage);
  if (!may_evict) return Admission::kWouldEvict;
  EvictLocked(*victims, "lru");
  // What the victims freed is at least what the plan counted (cells they shared with others
  // may be freed by pruning too now), so this cannot fail for room.
  status = CheckAppendLocked(batch, count);
  if (status.ok()) status = PrepareAppendLocked(batch);
  if (!status.ok()) return status;
  return Admission::kEvictedAndPrepared;
}

absl::Status Cache::MakeRoomLocked(absl::Status refusal, absl::Span<const int64_t> own,
                                   absl::FunctionRef<absl::Status()> check, bool evict) {
  if (spec_.eviction != EvictionPolicy::kLru) return refusal;
  const std::optional<Shortage> shortage = RoomShortage(refusal);
  if (!shortage.has_value()) return refusal;
  const std::optional<std::vector<int64_t>> victims = PlanEvictionLocked(own, check, refusal);
  if (!victims.has_value()) return NoRoomByEviction(refusal, *shortage);
  if (!evict) return absl::OkStatus();
  EvictLocked(*victims, "lru");
  return check();
}

std::optional<std::vector<int64_t>> Cache::PlanEvictionLocked(
    absl::Span<const int64_t> own_seqs, absl::FunctionRef<absl::Status()> recheck,
    absl::Status refusal) {
  const absl::Time now = absl::Now();
  // Candidates in the policy's order (unpinned live sequences): those in use and the
  // operation's own are passed over.
  const absl::flat_hash_set<int64_t> own(own_seqs.begin(), own_seqs.end());
  RetentionIndex::Candidates candidates(&retention_);
  auto take = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> std::optional<int64_t> {
    while (const std::optional<int64_t> seq = candidates.Next()) {
      if (!own.contains(*seq) && EvictableLocked(*seq, /*lru=*/true, now)) return seq;
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
    refusal = recheck();
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

}  // namespace kvmesh
