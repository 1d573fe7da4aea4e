// LeaseTable: the export leases of a node (docs/cluster.md, "Pull protocol").
//
// A lease pins the payload of one export (a snapshot's wire image) for a receiver. It lives
// until the receiver releases it or until it has not been touched (Fetch, NcclSend) for its
// lease time; then it expires on its own, so a receiver that dies or freezes costs the sender
// nothing for long. When a lease ends, by release or expiry, its `on_end` callback runs once
// (outside the table's lock): it frees what the export held (the snapshot taken for it).
//
// The payload itself (its export reader, and the cells or snapshot chunks it pins) is freed when
// its last reference goes, which may come after the lease ended: a Fetch stream that is still
// finishing, or chunks gRPC has yet to drop, hold references of their own. Release can report
// that moment (its `freed` callback), so that a receiver's Release is answered only once the
// sender's memory is back.
//
// Thread safety: thread-safe. A background thread expires leases and runs `freed` callbacks;
// the destructor stops it and ends every remaining lease.
#ifndef KVMESH_SERVICE_CLUSTER_LEASES_H_
#define KVMESH_SERVICE_CLUSTER_LEASES_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/mutex.h"
#include "transport/transport.h"

namespace kvmesh {

class LeaseTable final : public transport::LeaseLookup {
 public:
  // `tick`: how often the expiry thread looks for expired leases. `max_per_receiver`: leases one
  // receiver may hold at once (each pins a copy of its export in the snapshot pool).
  explicit LeaseTable(absl::Duration tick = absl::Milliseconds(100), size_t max_per_receiver = 32);
  ~LeaseTable() override;

  LeaseTable(const LeaseTable&) = delete;
  LeaseTable& operator=(const LeaseTable&) = delete;

  // Registers a lease on `payload` for `receiver` (the identity of the node that will fetch it:
  // PeerServiceImpl's caller identity) that expires `ttl` after its last touch. Returns its id:
  // 32 lowercase hex digits, 128 bits from the kernel's CSPRNG (getrandom), never guessable from
  // earlier ids. RESOURCE_EXHAUSTED when `receiver` holds max_per_receiver leases already.
  absl::StatusOr<std::string> Grant(std::shared_ptr<transport::LeasedPayload> payload,
                                    std::string receiver, absl::Duration ttl,
                                    std::function<void()> on_end, std::string transport = "",
                                    std::string peer = "");

  // transport::LeaseLookup.
  absl::StatusOr<std::shared_ptr<transport::LeasedPayload>> Touch(const std::string& id) override;

  // Ends lease `id` now. NOT_FOUND for an unknown, released or expired lease. When it is ended
  // and `freed` is set, `freed` runs once nothing references the payload any more: at once if
  // the table held the last reference, else when the Fetch stream or the chunks still holding
  // it let go. It always runs on the table's own thread (never the caller's, nor a gRPC thread
  // that dropped the last reference), or, once the table is destroyed, where the last
  // reference goes.
  absl::Status Release(const std::string& id, std::function<void()> freed = nullptr);

  // Testing only: a released lease's payload is kept `lag` longer (by the table's thread, in
  // steps of its tick), as a Fetch stream that gRPC finishes late would keep it.
  void set_testing_release_lag(absl::Duration lag);

  // OK when lease `id` exists and was granted to `receiver`; NOT_FOUND worded as for an unknown
  // lease otherwise, so that another node learns nothing about ids it was not given.
  absl::Status CheckReceiver(const std::string& id, const std::string& receiver) const;

  // Leases alive now, and the payload bytes they pin.
  size_t size() const;
  uint64_t leased_bytes() const;

  // What lease `id` is (for the sender's transfer metrics); NOT_FOUND as Touch.
  struct Info {
    uint64_t payload_bytes = 0;
    std::string receiver;
    std::string transport;  // as given to Grant
    std::string peer;       // as given to Grant: the receiving member's name
    absl::Time granted;
  };
  absl::StatusOr<Info> Describe(const std::string& id) const;
  // Leases ended by expiry since the table was created (for tests and logs).
  uint64_t expired() const;

 private:
  // Whether a payload is freed, and who waits for it (Release's `freed`).
  struct PayloadState {
    Mutex mu;
    bool freed ABSL_GUARDED_BY(mu) = false;
    std::vector<std::function<void()>> waiters ABSL_GUARDED_BY(mu);
  };
  // What the table's thread does besides expiring leases; shared with the payloads' deleters,
  // which may outlive the table.
  struct Background {
    Mutex mu;
    std::condition_variable_any wake;
    bool stopping ABSL_GUARDED_BY(mu) = false;                     // the table is being destroyed
    std::vector<std::function<void()>> freed ABSL_GUARDED_BY(mu);  // callbacks to run
    // Payloads kept by set_testing_release_lag, and until when.
    std::vector<std::pair<absl::Time, std::shared_ptr<transport::LeasedPayload>>> lagging
        ABSL_GUARDED_BY(mu);
    absl::Duration release_lag ABSL_GUARDED_BY(mu) = absl::ZeroDuration();
  };
  struct Lease {
    // The reference handed out by Touch: its deleter frees the payload and reports it to
    // `state`'s waiters.
    std::shared_ptr<transport::LeasedPayload> payload;
    std::shared_ptr<PayloadState> state;
    std::string receiver;
    absl::Duration ttl;
    absl::Time expires;
    std::function<void()> on_end;
    std::string transport;
    std::string peer;
    absl::Time granted;
  };

  void ExpiryLoop();
  static std::string NotFound(const std::string& id);

  const absl::Duration tick_;
  const size_t max_per_receiver_;
  const std::shared_ptr<Background> background_;
  mutable Mutex mu_;
  uint64_t expired_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, size_t> per_receiver_ ABSL_GUARDED_BY(mu_);  // leases held, > 0
  std::thread expiry_thread_;
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CLUSTER_LEASES_H_
