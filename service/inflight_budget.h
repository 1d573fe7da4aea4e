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
// Thread safety: thread-safe; a Reservation is a value with one owner at a time and must not
// outlive its budget.
#ifndef KVMESH_SERVICE_INFLIGHT_BUDGET_H_
#define KVMESH_SERVICE_INFLIGHT_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvmesh {

class InflightBudget {
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
    Reservation(InflightBudget* budget, uint64_t bytes) : budget_(budget), bytes_(bytes) {}

    InflightBudget* budget_ = nullptr;
    uint64_t bytes_ = 0;
  };

  // `capacity` bytes in all; `flag` names the setting in messages ("--inflight-budget").
  InflightBudget(uint64_t capacity, std::string flag);

  InflightBudget(const InflightBudget&) = delete;
  InflightBudget& operator=(const InflightBudget&) = delete;

  // A reservation of `bytes` for `what` (a phrase such as "AppendStream of 4096 bytes" in
  // messages). RESOURCE_EXHAUSTED when `bytes` exceeds the capacity (the request can never be
  // served: the message says to send less) or when other requests hold too much of it now
  // (the message says how much, and to retry later).
  absl::StatusOr<Reservation> Reserve(uint64_t bytes, absl::string_view what);

  uint64_t capacity() const { return capacity_; }
  // Bytes reserved now.
  uint64_t held() const { return held_.load(std::memory_order_relaxed); }
  // Reservations refused (RESOURCE_EXHAUSTED) since the budget was made.
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  // Adds `bytes` to held_ when it fits; the error otherwise.
  absl::Status Take(uint64_t bytes, absl::string_view what);
  void Give(uint64_t bytes);

  const uint64_t capacity_;
  const std::string flag_;
  std::atomic<uint64_t> held_{0};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_INFLIGHT_BUDGET_H_
