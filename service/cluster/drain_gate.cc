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

bool DrainGate::Close(absl::Time deadline) {
  bool changed = false;
  bool idle = false;
  {
    MutexLock lock(&mu_);
    changed = !draining_;
    draining_ = true;
    const auto until = absl::ToChronoTime(deadline);
    while (held_ > 0 && released_.wait_until(mu_, until) != std::cv_status::timeout) {
    }
    idle = held_ == 0;
  }
  if (changed && listener_) listener_(true);
  return idle;
}

void DrainGate::Open() {
  bool changed = false;
  {
    MutexLock lock(&mu_);
    changed = draining_;
    draining_ = false;
  }
  if (changed && listener_) listener_(false);
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
