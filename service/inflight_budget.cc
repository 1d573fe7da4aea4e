#include "service/inflight_budget.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/shortage.h"

namespace kvmesh {

InflightBudget::Reservation::Reservation(Reservation&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

InflightBudget::Reservation& InflightBudget::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    Reset();
    budget_ = std::exchange(other.budget_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

absl::Status InflightBudget::Reservation::Resize(uint64_t total, absl::string_view what) {
  if (total <= bytes_) {
    if (budget_ != nullptr) budget_->Give(bytes_ - total);
    bytes_ = total;
    return absl::OkStatus();
  }
  if (budget_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("internal: ", what, " grows a reservation of no budget"));
  }
  // Asking for the whole of `total` in messages: that is what the caller will hold.
  const uint64_t more = total - bytes_;
  if (total > budget_->capacity_) return budget_->Take(total, what);
  absl::Status status = budget_->Take(more, what);
  if (status.ok()) bytes_ = total;
  return status;
}

void InflightBudget::Reservation::Reset() {
  if (budget_ != nullptr) budget_->Give(bytes_);
  budget_ = nullptr;
  bytes_ = 0;
}

InflightBudget::InflightBudget(uint64_t capacity, std::string flag)
    : capacity_(capacity), flag_(std::move(flag)) {}

absl::StatusOr<InflightBudget::Reservation> InflightBudget::Reserve(uint64_t bytes,
                                                                    absl::string_view what) {
  if (absl::Status status = Take(bytes, what); !status.ok()) return status;
  return Reservation(this, bytes);
}

absl::Status InflightBudget::Take(uint64_t bytes, absl::string_view what) {
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
  return absl::OkStatus();
}

void InflightBudget::Give(uint64_t bytes) { held_.fetch_sub(bytes, std::memory_order_relaxed); }

}  // namespace kvmesh
