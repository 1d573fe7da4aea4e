// LeaseTable: the export leases of a node (docs/cluster.md, "Pull protocol").
//
// A lease pins the payload of one export (a snapshot's wire image) for a receiver. It lives
// until the receiver releases it or until it has not been touched (Fetch, NcclSend) for its
// lease time; then it expires on its own, so a receiver that dies or freezes costs the sender
// nothing for long. When a lease ends, by release or expiry, its `on_end` callback runs once
// (outside the table's lock): it frees what the export held (the snapshot taken for it).
//
// Thread safety: thread-safe. A background thread expires leases; the destructor stops it and
// ends every remaining lease.
#ifndef KVMESH_SERVICE_CLUSTER_LEASES_H_
#define KVMESH_SERVICE_CLUSTER_LEASES_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
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

  // Ends lease `id` now. NOT_FOUND for an unknown, released or expired lease.
  absl::Status Release(const std::string& id);

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
  struct Lease {
    std::shared_ptr<transport::LeasedPayload> payload;
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
  mutable Mutex mu_;
  std::condition_variable_any stop_cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t expired_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, size_t> per_receiver_ ABSL_GUARDED_BY(mu_);  // leases held, > 0
  std::thread expiry_thread_;
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CLUSTER_LEASES_H_
