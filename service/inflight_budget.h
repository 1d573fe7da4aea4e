// InflightBudget: the bytes a node may hold for requests and responses in flight, apart from
// the caches' memory and snapshot budgets (--inflight-budget). AppendStream bodies being
// buffered, unary Append payloads waiting for the engine and the answers Visible assembles
// each hold a Reservation for their bytes while they exist, so hostile or broken clients cannot
// make the node grow beyond memory budget + snapshot budget + in-flight budget + overhead
// (docs/security.md#bounded-memory).
//
// Reservations never wait: a request that does not fit now is refused at once with
// RESOURCE_EXHAUSTED (see Reserve), so no request holds part of the budget while it waits for
// more (hold-and-wait, which could stall every stream), and nothing is buffered for a request
// that will not get its bytes. The client retries later, as for any refused request.
//
// A reservation may name the tenant it is for: no tenant may hold more than its share of the
// budget (--inflight-tenant-share), so that one tenant's requests, slow or many, cannot take the
// whole of it and starve the others. A reservation without a tenant (node-internal work) counts
// against the budget only.
//
// Thread safety: thread-safe; a Reservation is a value with one owner at a time and must not
// outlive its budget.
#ifndef KVMESH_SERVICE_INFLIGHT_BUDGET_H_
#define KVMESH_SERVICE_INFLIGHT_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/mutex.h"

namespace kvmesh {

class InflightBudget {
  struct Tenant;

 public:
  // Bytes held for a request; returned to the budget when destroyed, reset or moved from.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept;
    Reservation& operator=(Reservation&& other) noexcept;
    Reservation(const Reservation&) = delete;
    Reservation& operator=(const Reservation&) = delete;
    ~Reservation() { Reset(); }

    uint64_t bytes() const { return bytes_; }

    // Holds `total` bytes instead of bytes(): shrinking always succeeds; growing takes the
    // difference from the budget, or fails as Reserve does and leaves the reservation as it
    // was. A default-constructed reservation cannot grow (FAILED_PRECONDITION).
    absl::Status Resize(uint64_t total, absl::string_view what);

    // Returns every byte to the budget.
    void Reset();

   private:
    friend class InflightBudget;
    Reservation(InflightBudget* budget, std::shared_ptr<Tenant> tenant, uint64_t bytes)
        : budget_(budget), tenant_(std::move(tenant)), bytes_(bytes) {}

    InflightBudget* budget_ = nullptr;
    std::shared_ptr<Tenant> tenant_;  // null: counted against the budget only
    uint64_t bytes_ = 0;
  };

  // `capacity` bytes in all; `flag` names the setting in messages ("--inflight-budget"). Each
  // tenant may hold at most `tenant_share` of them (a fraction in (0, 1]; 1: no share).
  InflightBudget(uint64_t capacity, std::string flag, double tenant_share = 1.0);

  // REQUIRES: every Reservation of the budget is gone (a node's last ones go with its calls,
  // before its servers' Shutdown returns).
  ~InflightBudget();

  InflightBudget(const InflightBudget&) = delete;
  InflightBudget& operator=(const InflightBudget&) = delete;

  // A reservation of `bytes` for `what` (a phrase such as "AppendStream of 4096 bytes" in
  // messages). RESOURCE_EXHAUSTED when `bytes` exceeds the capacity (the request can never be
  // served: the message says to send less) or when other requests hold too much of it now
  // (the message says how much, and to retry later).
  absl::StatusOr<Reservation> Reserve(uint64_t bytes, absl::string_view what);
  // The same for `tenant`'s request: also RESOURCE_EXHAUSTED when the tenant's reservations
  // would hold more than its share (the message names the tenant, its bytes and its share).
  absl::StatusOr<Reservation> Reserve(absl::string_view tenant, uint64_t bytes,
                                      absl::string_view what);

  uint64_t capacity() const { return capacity_; }
  // The most bytes one tenant may hold.
  uint64_t tenant_capacity() const { return tenant_capacity_; }
  // Bytes `tenant`'s reservations hold now.
  uint64_t TenantHeld(absl::string_view tenant) const;
  // Bytes reserved now.
  uint64_t held() const { return held_.load(std::memory_order_relaxed); }
  // Reservations refused (RESOURCE_EXHAUSTED) since the budget was made.
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  // What one tenant holds; an entry lives while a reservation of the tenant does.
  struct Tenant {
    std::string name;
    uint64_t held = 0;  // guarded by the budget's tenants_mu_
  };

  // Adds `bytes` to held_ (and to the tenant's, when not null) when it fits; the error otherwise.
  absl::Status Take(Tenant* tenant, uint64_t bytes, absl::string_view what);
  void Give(Tenant* tenant, uint64_t bytes);
  // The entry of `name`, made when none exists.
  std::shared_ptr<Tenant> TenantOf(absl::string_view name);
  // Called when a reservation of `tenant` is gone: drops the entry when nothing holds it.
  void Release(std::shared_ptr<Tenant> tenant);

  const uint64_t capacity_;
  const std::string flag_;
  const double tenant_share_;
  const uint64_t tenant_capacity_;
  mutable Mutex tenants_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Tenant>> tenants_ ABSL_GUARDED_BY(tenants_mu_);
  std::atomic<uint64_t> held_{0};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_INFLIGHT_BUDGET_H_
