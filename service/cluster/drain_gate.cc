#include "service/cluster/drain_gate.h"

#include <chrono>

#include "absl/strings/str_cat.h"

namespace kvmesh {

DrainGate::Ticket& DrainGate::Ticket::operator=(Ticket&& o) noexcept {
  if (this != &o) {
    Reset();
    gate_ = std::exchange(o.gate_, nullptr);
  }
  return *this;
}

void DrainGate::Ticket::Reset() {
  if (gate_ != nullptr) std::exchange(gate_, nullptr)->Release();
}

absl::StatusOr<DrainGate::Ticket> DrainGate::Admit(absl::string_view what) {
  MutexLock lock(&mu_);
  if (draining_) {
    return absl::UnavailableError(absl::StrCat(
        "node '", self_name_, "' is draining: it takes no ", what,
        "; use another node (ListMembers), or this one after it is resumed"));
  }
  ++held_;
  return Ticket(this);
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
  }
  // Not ready from now on, also while admitted operations finish.
  if (changed) Notify();
}

bool DrainGate::AwaitAdmitted(absl::Time deadline) {
  MutexLock lock(&mu_);
  const auto until = absl::ToChronoTime(deadline);
  while (held_ > 0 && draining_ &&
         released_.wait_until(mu_, until) != std::cv_status::timeout) {
  }
  return held_ == 0;
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

void DrainGate::Release() {
  MutexLock lock(&mu_);
  if (--held_ == 0) released_.notify_all();
}

}  // namespace kvmesh
