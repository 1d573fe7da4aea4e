#include "service/cluster/leases.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "service/common/convert.h"
#include "service/common/process_info.h"

namespace kvmesh {
namespace {

// Lease ids: 128 bits from the kernel's CSPRNG, never guessable from earlier ids.
std::string RandomLeaseId() { return RandomHex128(); }

}  // namespace

LeaseTable::LeaseTable(absl::Duration tick, size_t max_per_receiver)
    : tick_(tick), max_per_receiver_(max_per_receiver) {
  expiry_thread_ = std::thread([this] { ExpiryLoop(); });
}

LeaseTable::~LeaseTable() {
  std::map<std::string, Lease> remaining;
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

absl::StatusOr<std::string> LeaseTable::Grant(std::shared_ptr<transport::LeasedPayload> payload,
                                              std::string receiver, absl::Duration ttl,
                                              std::function<void()> on_end, std::string transport,
                                              std::string peer) {
  MutexLock lock(&mu_);
  size_t& held = per_receiver_[receiver];
  if (held >= max_per_receiver_) {
    if (held == 0) per_receiver_.erase(receiver);
    return absl::ResourceExhaustedError(
        absl::StrCat("receiver ", receiver, " holds ", max_per_receiver_,
                     " export leases on this node already, the most it may (release some, or "
                     "wait for them to expire)"));
  }
  std::string id = RandomLeaseId();
  while (leases_.count(id) != 0) id = RandomLeaseId();  // 2^-128: never, but never reuse either
  ++held;
  const absl::Time now = absl::Now();
  leases_.emplace(id, Lease{std::move(payload), std::move(receiver), ttl, now + ttl,
                            std::move(on_end), std::move(transport), std::move(peer), now});
  return id;
}

std::string LeaseTable::NotFound(const std::string& id) {
  // A client may send any string as a lease id: never echo a long one whole.
  return absl::StrCat("export lease ", QuoteBounded(id),
                      " is unknown: never granted to the caller, released, or expired after its "
                      "lease time");
}

absl::StatusOr<std::shared_ptr<transport::LeasedPayload>> LeaseTable::Touch(const std::string& id) {
  MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return absl::NotFoundError(NotFound(id));
  it->second.expires = absl::Now() + it->second.ttl;
  return it->second.payload;
}

absl::Status LeaseTable::CheckReceiver(const std::string& id, const std::string& receiver) const {
  MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end() || it->second.receiver != receiver) {
    return absl::NotFoundError(NotFound(id));
  }
  return absl::OkStatus();
}

absl::Status LeaseTable::Release(const std::string& id) {
  Lease ended;
  {
    MutexLock lock(&mu_);
    auto it = leases_.find(id);
    if (it == leases_.end()) return absl::NotFoundError(NotFound(id));
    ended = std::move(it->second);
    leases_.erase(it);
    auto held = per_receiver_.find(ended.receiver);
    if (--held->second == 0) per_receiver_.erase(held);
  }
  if (ended.on_end) ended.on_end();
  return absl::OkStatus();
}

size_t LeaseTable::size() const {
  MutexLock lock(&mu_);
  return leases_.size();
}

uint64_t LeaseTable::leased_bytes() const {
  MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (const auto& [id, lease] : leases_) bytes += lease.payload->size();
  return bytes;
}

absl::StatusOr<LeaseTable::Info> LeaseTable::Describe(const std::string& id) const {
  MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return absl::NotFoundError(NotFound(id));
  return Info{it->second.payload->size(), it->second.receiver, it->second.transport,
              it->second.peer, it->second.granted};
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
          auto held = per_receiver_.find(it->second.receiver);
          if (--held->second == 0) per_receiver_.erase(held);
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
