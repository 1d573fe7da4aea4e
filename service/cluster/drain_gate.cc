#include "service/cluster/drain_gate.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "cache/status_macros.h"

namespace kvmesh {

DrainGate::Ticket& DrainGate::Ticket::operator=(Ticket&& o) noexcept {
  if (this != &o) {
    Reset();
    gate_ = std::exchange(o.gate_, nullptr);
    generation_ = o.generation_;
  }
  return *this;
}

void DrainGate::Ticket::Reset() {
  if (gate_ != nullptr) std::exchange(gate_, nullptr)->Release(generation_);
}

absl::StatusOr<DrainGate::Ticket> DrainGate::Admit(absl::string_view what) {
  MutexLock lock(&mu_);
  if (draining_) {
    return absl::UnavailableError(absl::StrCat(
        "node '", self_name_, "' is draining: it takes no ", what,
        "; use another node (ListMembers), or this one after it is resumed"));
  }
  return Issue();
}

DrainGate::Ticket DrainGate::Issue() {
  ++held_[generation_];
  return Ticket(this, generation_);
}

bool DrainGate::HoldsEarlier() const {
  return !held_.empty() && held_.begin()->first < generation_;
}

absl::StatusOr<DrainGate::Ticket> DrainGate::AdmitSequences(const Cache& cache,
                                                            absl::Span<const int64_t> seqs,
                                                            const char* what) {
  for (const int64_t seq : seqs) {
    if (!cache.IsLive(seq)) {
      return Admit(absl::StrCat("new sequence (", what, " into sequence ", seq, " of cache '",
                                cache.spec().name, "', which stores nothing here)"));
    }
  }
  return Ticket();
}

absl::StatusOr<DrainGate::Ticket> DrainGate::AdmitWrite(const Cache& cache,
                                                        absl::Span<const int64_t> seqs,
                                                        const char* what) {
  ASSIGN_OR_RETURN(Ticket admitted, AdmitSequences(cache, seqs, what));
  if (admitted.gate_ != nullptr) return admitted;
  // Every sequence exists: a ticket that a drain waits for, draining or not.
  MutexLock lock(&mu_);
  return Issue();
}

absl::StatusOr<DrainGate::Ticket> DrainGate::Readmit(const Ticket& held, const Cache& cache,
                                                     absl::Span<const int64_t> seqs,
                                                     const char* what) {
  if (held.gate_ == this) {
    ReaderMutexLock lock(&mu_);
    if (draining_ && held.generation_ < generation_ && !gave_up_) return Ticket();
  }
  return AdmitSequences(cache, seqs, what);
}

void DrainGate::set_listener(std::function<void(bool draining)> listener) {
  MutexLock lock(&mu_);
  listener_ = std::move(listener);
}

void DrainGate::Close() {
  bool changed = false;
  {
    MutexLock lock(&mu_);
    changed = !draining_;
    draining_ = true;
    if (changed) {
      ++generation_;
      gave_up_ = false;
    }
  }
  // Not ready from now on, also while admitted operations finish.
  if (changed) Notify();
}

bool DrainGate::AwaitAdmitted(absl::Time deadline) {
  MutexLock lock(&mu_);
  const auto until = absl::ToChronoTime(deadline);
  gave_up_ = false;  // a drain that gives way to the shutdown drain gave up; this one waits
  while (HoldsEarlier() && draining_ &&
         released_.wait_until(mu_, until) != std::cv_status::timeout) {
  }
  if (!HoldsEarlier()) return true;
  gave_up_ = true;
  return false;
}

void DrainGate::Open() {
  bool changed = false;
  {
    MutexLock lock(&mu_);
    changed = draining_;
    draining_ = false;
  }
  released_.notify_all();  // AwaitAdmitted stops waiting
  if (changed) Notify();
}

// Serialized, and with the state as it is now rather than as the caller changed it: a Close and
// an Open racing each other leave the listener told the final state last.
void DrainGate::Notify() {
  MutexLock notifying(&notify_mu_);
  bool draining = false;
  std::function<void(bool)> listener;
  {
    ReaderMutexLock lock(&mu_);
    draining = draining_;
    listener = listener_;
  }
  if (listener) listener(draining);
}

bool DrainGate::draining() const {
  ReaderMutexLock lock(&mu_);
  return draining_;
}

void DrainGate::Release(uint64_t generation) {
  MutexLock lock(&mu_);
  auto it = held_.find(generation);
  if (--it->second > 0) return;
  held_.erase(it);
  if (!HoldsEarlier()) released_.notify_all();
}

}  // namespace kvmesh
