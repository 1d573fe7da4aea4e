#include "service/cluster/leases.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvmesh {

LeaseTable::LeaseTable(absl::Duration tick) : tick_(tick) {
  expiry_thread_ = std::thread([this] { ExpiryLoop(); });
}

LeaseTable::~LeaseTable() {
  std::map<uint64_t, Lease> remaining;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    remaining.swap(leases_);
  }
  stop_cv_.notify_all();
  expiry_thread_.join();
  for (auto& [id, lease] : remaining) {
    if (lease.on_end) lease.on_end();
  }
}

uint64_t LeaseTable::Grant(std::shared_ptr<transport::LeasedPayload> payload, std::string receiver,
                           absl::Duration ttl, std::function<void()> on_end) {
  MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  leases_.emplace(id, Lease{std::move(payload), std::move(receiver), ttl, absl::Now() + ttl,
                            std::move(on_end)});
  return id;
}

std::string LeaseTable::NotFound(uint64_t id) const {
  return absl::StrCat("export lease ", id,
                      " is unknown: never granted, released, or expired after its lease time");
}

absl::StatusOr<std::shared_ptr<transport::LeasedPayload>> LeaseTable::Touch(uint64_t id) {
  MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return absl::NotFoundError(NotFound(id));
  it->second.expires = absl::Now() + it->second.ttl;
  return it->second.payload;
}

absl::Status LeaseTable::Release(uint64_t id) {
  Lease ended;
  {
    MutexLock lock(&mu_);
    auto it = leases_.find(id);
    if (it == leases_.end()) return absl::NotFoundError(NotFound(id));
    ended = std::move(it->second);
    leases_.erase(it);
  }
  if (ended.on_end) ended.on_end();
  return absl::OkStatus();
}

size_t LeaseTable::size() const {
  MutexLock lock(&mu_);
  return leases_.size();
}

uint64_t LeaseTable::expired() const {
  MutexLock lock(&mu_);
  return expired_;
}

void LeaseTable::ExpiryLoop() {
  for (;;) {
    std::vector<Lease> ended;
    {
      MutexLock lock(&mu_);
      if (stopping_) return;
      const absl::Time now = absl::Now();
      for (auto it = leases_.begin(); it != leases_.end();) {
        if (it->second.expires <= now) {
          ended.push_back(std::move(it->second));
          it = leases_.erase(it);
          ++expired_;
        } else {
          ++it;
        }
      }
    }
    // Callbacks outside the lock: they take the cache's lock to drop snapshots.
    for (Lease& lease : ended) {
      if (lease.on_end) lease.on_end();
    }
    ended.clear();
    MutexLock lock(&mu_);
    if (stopping_) return;
    stop_cv_.wait_for(mu_, absl::ToChronoNanoseconds(tick_));
  }
}

}  // namespace kvmesh
