#include "service/cluster/reservations.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"

#include "absl/strings/str_cat.h"

namespace kvmesh {

Reservations::Guard& Reservations::Guard::operator=(Guard&& o) noexcept {
  if (this != &o) {
    Reset();
    table_ = std::exchange(o.table_, nullptr);
    kind_ = o.kind_;
    cache_ = std::move(o.cache_);
    ids_ = std::move(o.ids_);
    reservation_ = o.reservation_;
  }
  return *this;
}

void Reservations::Guard::Reset() {
  if (table_ != nullptr) table_->Drop(kind_, cache_, ids_, reservation_);
  table_ = nullptr;
  ids_.clear();
}

absl::StatusOr<Reservations::Guard> Reservations::BeginOperation(Kind kind,
                                                                 const std::string& cache,
                                                                 absl::Span<const int64_t> ids,
                                                                 const char* what) {
  MutexLock lock(&mu_);
  for (int64_t id : ids) {
    auto it = entries_.find(EntryKey(static_cast<int>(kind), cache, id));
    if (it != entries_.end() && !it->second.migrating_to.empty()) {
      return absl::AbortedError(absl::StrCat(what, " refused: ", Noun(kind), " ", id, " of cache '",
                                             NameOf(cache), "' is under migration to node '",
                                             it->second.migrating_to, "'; retry after it"));
    }
  }
  Guard guard;
  guard.table_ = this;
  guard.kind_ = kind;
  guard.cache_ = cache;
  for (int64_t id : ids) {
    ++entries_[EntryKey(static_cast<int>(kind), cache, id)].operations;
    guard.ids_.push_back(id);
  }
  return guard;
}

absl::StatusOr<Reservations::Guard> Reservations::Reserve(Kind kind, const std::string& cache,
                                                          int64_t id, const std::string& target,
                                                          absl::Time deadline) {
  const EntryKey key(static_cast<int>(kind), cache, id);
  MutexLock lock(&mu_);
  {
    Entry& entry = entries_[key];
    if (!entry.migrating_to.empty()) {
      return absl::AbortedError(absl::StrCat(Noun(kind), " ", id, " of cache '", NameOf(cache),
                                             "' is already under migration to node '",
                                             entry.migrating_to, "'"));
    }
    // From here on new operations are refused; wait for the running ones.
    entry.migrating_to = target;
  }
  while (entries_[key].operations > 0) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      Entry& e = entries_[key];
      const int running = e.operations;
      e.migrating_to.clear();
      return absl::DeadlineExceededError(absl::StrCat(
          Noun(kind), " ", id, " of cache '", NameOf(cache), "' could not be reserved for migration: ",
          running, " operation(s) on it were still running at the deadline"));
    }
    drained_.wait_until(mu_, absl::ToChronoTime(std::min(deadline, now + absl::Milliseconds(100))));
  }
  Guard guard;
  guard.table_ = this;
  guard.kind_ = kind;
  guard.cache_ = cache;
  guard.ids_.push_back(id);
  guard.reservation_ = true;
  return guard;
}

bool Reservations::IsReserved(Kind kind, const std::string& cache, int64_t id) const {
  MutexLock lock(&mu_);
  auto it = entries_.find(EntryKey(static_cast<int>(kind), cache, id));
  return it != entries_.end() && !it->second.migrating_to.empty();
}

void Reservations::Drop(Kind kind, const std::string& cache, absl::Span<const int64_t> ids,
                        bool reservation) {
  MutexLock lock(&mu_);
  for (int64_t id : ids) {
    auto it = entries_.find(EntryKey(static_cast<int>(kind), cache, id));
    if (it == entries_.end()) continue;
    if (reservation) {
      it->second.migrating_to.clear();
    } else {
      --it->second.operations;
      if (it->second.operations == 0) drained_.notify_all();
    }
    if (it->second.operations == 0 && it->second.migrating_to.empty()) entries_.erase(it);
  }
}

}  // namespace kvmesh
