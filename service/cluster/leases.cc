#include "service/cluster/leases.h"

#include <utility>
#include <vector>

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
    : tick_(tick),
      max_per_receiver_(max_per_receiver),
      background_(std::make_shared<Background>()) {
  expiry_thread_ = std::thread([this] { ExpiryLoop(); });
}

LeaseTable::~LeaseTable() {
  {
    MutexLock lock(&background_->mu);
    background_->stopping = true;
  }
  background_->wake.notify_all();
  expiry_thread_.join();
  std::map<std::string, Lease> remaining;
  {
    MutexLock lock(&mu_);
    remaining.swap(leases_);
  }
  for (auto& [id, lease] : remaining) {
    if (lease.on_end) lease.on_end();
  }
  remaining.clear();
  // What the thread left: from here on a payload's deleter runs its waiters itself.
  std::vector<std::function<void()>> freed;
  std::vector<std::pair<absl::Time, std::shared_ptr<transport::LeasedPayload>>> lagging;
  {
    MutexLock lock(&background_->mu);
    freed.swap(background_->freed);
    lagging.swap(background_->lagging);
  }
  lagging.clear();  // their deleters run their waiters themselves now
  for (std::function<void()>& callback : freed) callback();
}

absl::StatusOr<std::string> LeaseTable::Grant(std::shared_ptr<transport::LeasedPayload> payload,
                                              std::string receiver, absl::Duration ttl,
                                              std::function<void()> on_end, std::string transport,
                                              std::string peer) {
  // The table hands out (Touch) and keeps only this tracking reference: when the last of its
  // copies goes, its deleter frees the payload and tells whoever waits for that (Release).
  auto state = std::make_shared<PayloadState>();
  transport::LeasedPayload* const raw = payload.get();
  std::shared_ptr<transport::LeasedPayload> tracked(
      raw, [payload = std::move(payload), state,
            background = background_](transport::LeasedPayload* /*raw*/) mutable {
        payload.reset();  // the export reader goes: what it pinned is free again
        std::vector<std::function<void()>> waiters;
        {
          MutexLock lock(&state->mu);
          state->freed = true;
          waiters.swap(state->waiters);
        }
        if (waiters.empty()) return;
        {
          MutexLock lock(&background->mu);
          if (!background->stopping) {
            for (std::function<void()>& w : waiters) background->freed.push_back(std::move(w));
            background->wake.notify_all();
            return;
          }
        }
        for (std::function<void()>& w : waiters) w();
      });
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
  leases_.emplace(id,
                  Lease{std::move(tracked), std::move(state), std::move(receiver), ttl, now + ttl,
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

absl::Status LeaseTable::Release(const std::string& id, std::function<void()> freed) {
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
  if (freed) {
    // Before the table's reference goes: the payload cannot be freed yet.
    MutexLock lock(&ended.state->mu);
    ended.state->waiters.push_back(std::move(freed));
  }
  {
    MutexLock lock(&background_->mu);
    if (background_->release_lag > absl::ZeroDuration() && !background_->stopping) {
      background_->lagging.emplace_back(absl::Now() + background_->release_lag,
                                        std::move(ended.payload));
    }
  }
  // Outside every lock: the deleter may run here.
  ended.payload.reset();
  if (ended.on_end) ended.on_end();
  return absl::OkStatus();
}

void LeaseTable::set_testing_release_lag(absl::Duration lag) {
  MutexLock lock(&background_->mu);
  background_->release_lag = lag;
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
    std::vector<std::function<void()>> freed;
    std::vector<std::shared_ptr<transport::LeasedPayload>> due;
    {
      MutexLock lock(&background_->mu);
      if (background_->stopping) return;
      if (background_->freed.empty()) {
        background_->wake.wait_for(background_->mu, absl::ToChronoNanoseconds(tick_));
        if (background_->stopping) return;
      }
      freed.swap(background_->freed);
      const absl::Time now = absl::Now();
      auto& lagging = background_->lagging;
      for (auto it = lagging.begin(); it != lagging.end();) {
        if (it->first <= now) {
          due.push_back(std::move(it->second));
          it = lagging.erase(it);
        } else {
          ++it;
        }
      }
    }
    due.clear();  // outside the lock: a deleter queues its waiters (run on the next turn)
    for (std::function<void()>& callback : freed) callback();
  }
}

}  // namespace kvmesh
