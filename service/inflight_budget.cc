#include "service/inflight_budget.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cache/shortage.h"

namespace kvmesh {

InflightBudget::Reservation::Reservation(Reservation&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)),
      tenant_(std::move(other.tenant_)),
      bytes_(std::exchange(other.bytes_, 0)) {
  other.tenant_ = nullptr;
}

InflightBudget::Reservation& InflightBudget::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    Reset();
    budget_ = std::exchange(other.budget_, nullptr);
    tenant_ = std::move(other.tenant_);
    other.tenant_ = nullptr;
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

absl::Status InflightBudget::Reservation::Resize(uint64_t total, absl::string_view what) {
  if (total <= bytes_) {
    if (budget_ != nullptr) budget_->Give(tenant_.get(), bytes_ - total);
    bytes_ = total;
    return absl::OkStatus();
  }
  if (budget_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("internal: ", what, " grows a reservation of no budget"));
  }
  // Asking for the whole of `total` in messages: that is what the caller will hold.
  const uint64_t more = total - bytes_;
  // A total that can never fit is refused as such, naming all of it.
  if (total > budget_->capacity_ || (tenant_ != nullptr && total > budget_->tenant_capacity_)) {
    return budget_->Take(tenant_.get(), total, what);
  }
  absl::Status status = budget_->Take(tenant_.get(), more, what);
  if (status.ok()) bytes_ = total;
  return status;
}

void InflightBudget::Reservation::Reset() {
  if (budget_ != nullptr) {
    budget_->Give(tenant_.get(), bytes_);
    if (tenant_ != nullptr) budget_->Release(std::move(tenant_));
  }
  budget_ = nullptr;
  tenant_ = nullptr;
  bytes_ = 0;
}

InflightBudget::InflightBudget(uint64_t capacity, std::string flag, double tenant_share)
    : capacity_(capacity),
      flag_(std::move(flag)),
      tenant_share_(tenant_share),
      tenant_capacity_(
          tenant_share >= 1.0 || !(tenant_share > 0.0)
              ? capacity
              : static_cast<uint64_t>(std::floor(static_cast<double>(capacity) * tenant_share))) {}

InflightBudget::~InflightBudget() {
  // The last reservations were released on gRPC's threads, ordered before this by gRPC's own
  // synchronization (its Shutdown), which TSan does not see; the lock states it.
  MutexLock lock(&tenants_mu_);
}

absl::StatusOr<InflightBudget::Reservation> InflightBudget::Reserve(uint64_t bytes,
                                                                    absl::string_view what) {
  if (absl::Status status = Take(nullptr, bytes, what); !status.ok()) return status;
  return Reservation(this, nullptr, bytes);
}

absl::StatusOr<InflightBudget::Reservation> InflightBudget::Reserve(absl::string_view tenant,
                                                                    uint64_t bytes,
                                                                    absl::string_view what) {
  std::shared_ptr<Tenant> entry = TenantOf(tenant);
  if (absl::Status status = Take(entry.get(), bytes, what); !status.ok()) {
    Release(std::move(entry));
    return status;
  }
  return Reservation(this, std::move(entry), bytes);
}

uint64_t InflightBudget::TenantHeld(absl::string_view tenant) const {
  MutexLock lock(&tenants_mu_);
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? 0 : it->second->held;
}

std::shared_ptr<InflightBudget::Tenant> InflightBudget::TenantOf(absl::string_view name) {
  MutexLock lock(&tenants_mu_);
  std::shared_ptr<Tenant>& entry = tenants_[name];
  if (entry == nullptr) {
    entry = std::make_shared<Tenant>();
    entry->name = std::string(name);
  }
  return entry;
}

void InflightBudget::Release(std::shared_ptr<Tenant> tenant) {
  MutexLock lock(&tenants_mu_);
  // The map's reference and this one: no other reservation holds the entry.
  if (tenant.use_count() == 2 && tenant->held == 0) tenants_.erase(tenant->name);
}

absl::Status InflightBudget::Take(Tenant* tenant, uint64_t bytes, absl::string_view what) {
  if (bytes > capacity_) {
    refused_.fetch_add(1, std::memory_order_relaxed);
    return ResourceExhaustedWith(
        absl::StrCat(what, " needs ", bytes, " bytes in flight, more than this node's whole ",
                     "in-flight budget (", flag_, " = ", capacity_,
                     " bytes); send it in smaller requests"),
        {Resource::kInflightBytes, -1, static_cast<int64_t>(bytes),
         static_cast<int64_t>(capacity_ - held_.load(std::memory_order_relaxed)),
         static_cast<int64_t>(capacity_)});
  }
  // The whole budget first: when it is full, that is what the caller must hear.
  uint64_t held = held_.load(std::memory_order_relaxed);
  do {
    if (bytes > capacity_ - held) {
      refused_.fetch_add(1, std::memory_order_relaxed);
      return ResourceExhaustedWith(
          absl::StrCat(what, " needs ", bytes, " bytes in flight, but other requests hold ", held,
                       " of the ", capacity_, " bytes of this node's in-flight budget (", flag_,
                       "); retry later"),
          {Resource::kInflightBytes, -1, static_cast<int64_t>(bytes),
           static_cast<int64_t>(capacity_ - held), static_cast<int64_t>(capacity_)});
    }
  } while (!held_.compare_exchange_weak(held, held + bytes, std::memory_order_relaxed));
  if (tenant == nullptr) return absl::OkStatus();
  MutexLock lock(&tenants_mu_);
  if (bytes > tenant_capacity_ - std::min(tenant->held, tenant_capacity_)) {
    held_.fetch_sub(bytes, std::memory_order_relaxed);
    refused_.fetch_add(1, std::memory_order_relaxed);
    const std::string share = absl::StrFormat("%g", tenant_share_);
    return ResourceExhaustedWith(
        bytes > tenant_capacity_
            ? absl::StrCat(what, " needs ", bytes, " bytes in flight, more than a tenant's share ",
                           "of this node's in-flight budget (", tenant_capacity_, " bytes: ", share,
                           " of ", flag_, " = ", capacity_,
                           ", --inflight-tenant-share); send it in smaller requests")
            : absl::StrCat(what, " needs ", bytes, " bytes in flight, but tenant '", tenant->name,
                           "' holds ", tenant->held, " of its share of ", tenant_capacity_,
                           " bytes (", share, " of ", flag_,
                           ", --inflight-tenant-share) already; retry later"),
        {Resource::kInflightBytes, -1, static_cast<int64_t>(bytes),
         static_cast<int64_t>(tenant_capacity_ - std::min(tenant->held, tenant_capacity_)),
         static_cast<int64_t>(tenant_capacity_)});
  }
  tenant->held += bytes;
  return absl::OkStatus();
}

void InflightBudget::Give(Tenant* tenant, uint64_t bytes) {
  if (tenant != nullptr) {
    MutexLock lock(&tenants_mu_);
    tenant->held -= bytes;
  }
  held_.fetch_sub(bytes, std::memory_order_relaxed);
}

}  // namespace kvmesh
