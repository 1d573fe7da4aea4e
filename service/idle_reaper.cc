#include "service/idle_reaper.h"

#include <algorithm>
#include <vector>

namespace kvmesh {
namespace {

bool Enabled(absl::Duration timeout) {
  return timeout > absl::ZeroDuration() && timeout != absl::InfiniteDuration();
}

}  // namespace

IdleReaper::IdleReaper(absl::Duration timeout)
    : timeout_(Enabled(timeout) ? timeout : absl::InfiniteDuration()) {
  thread_ = std::thread([this] { Loop(); });
}

IdleReaper::~IdleReaper() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void IdleReaper::Add(Stream* stream) {
  MutexLock lock(&mu_);
  streams_.insert(stream);
}

void IdleReaper::Remove(Stream* stream) {
  MutexLock lock(&mu_);
  streams_.erase(stream);
}

void IdleReaper::Loop() {
  const absl::Duration tick =
      Enabled(timeout_) ? std::clamp(timeout_ / 4, absl::Milliseconds(10), absl::Seconds(1))
                        : absl::Seconds(1);
  std::vector<Stream*> expired;
  for (;;) {
    {
      MutexLock lock(&mu_);
      // A spurious wake-up only scans early.
      if (!stop_) wake_.wait_for(mu_, absl::ToChronoMilliseconds(tick));
      if (stop_) return;
      const absl::Time now = absl::Now();
      for (Stream* stream : streams_) {
        if (stream->Expire(now, timeout_)) expired.push_back(stream);
      }
    }
    // Outside the lock: ending a stream leads to its Remove (from gRPC's OnDone, possibly on
    // this very thread). An expired stream cannot be destroyed before EndExpired has finished it.
    for (Stream* stream : expired) stream->EndExpired(timeout_);
    expired.clear();
  }
}

}  // namespace kvmesh
