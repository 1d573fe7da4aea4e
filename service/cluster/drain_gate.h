// DrainGate: whether this node still takes new caches and new sequences (docs/api.md#drain).
//
// A draining node moves what it holds to its peers; it must not take new work meanwhile, or
// what arrives after the drain has listed the node's contents would stay behind. Operations that
// would create something (a cache, or a sequence that stores nothing yet) ask Admit first and
// hold the ticket it returns until they are done; Close refuses new admissions from then on and
// waits for the tickets already handed out, so that once it returns every new sequence is
// visible to the drain. Operations on what already exists need no ticket: they go on until the
// drain moves their sequence (and are then refused as under migration, or find nothing here).
//
// Except those that take long before they write (a cross-node CopyPrefix pulls its payload
// first): AdmitWrite hands them a ticket for sequences that exist too, so that a drain that
// begins while one runs waits for it, rather than moving its sequence away under it and leaving
// it a payload it may no longer commit. When such an operation commits, Readmit lets it through
// if its ticket predates the drain (the drain waits for it, then moves what it wrote) and
// admits it afresh otherwise.
//
// Thread safety: thread-safe. Tickets may be released on any thread; the gate must outlive them.
#ifndef KVMESH_SERVICE_CLUSTER_DRAIN_GATE_H_
#define KVMESH_SERVICE_CLUSTER_DRAIN_GATE_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "cache/cache.h"
#include "cache/mutex.h"

namespace kvmesh {

class DrainGate {
 public:
  // Held by an admitted operation; releases on destruction. Movable; a default-constructed
  // ticket holds nothing (the operation needed none).
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& o) noexcept
        : gate_(std::exchange(o.gate_, nullptr)), generation_(o.generation_) {}
    Ticket& operator=(Ticket&& o) noexcept;
    ~Ticket() { Reset(); }

   private:
    friend class DrainGate;
    Ticket(DrainGate* gate, uint64_t generation) : gate_(gate), generation_(generation) {}
    void Reset();
    DrainGate* gate_ = nullptr;
    // The number of drains begun when it was handed out: a drain waits for the tickets of
    // earlier generations.
    uint64_t generation_ = 0;
  };

  explicit DrainGate(std::string self_name) : self_name_(std::move(self_name)) {}
  DrainGate(const DrainGate&) = delete;
  DrainGate& operator=(const DrainGate&) = delete;

  // A ticket for an operation that creates `what` (for the message: "a new cache 'x'");
  // UNAVAILABLE naming this node while it drains.
  absl::StatusOr<Ticket> Admit(absl::string_view what);
  // Admit when any of `seqs` stores nothing in `cache` (the operation starts a sequence);
  // an empty ticket otherwise.
  absl::StatusOr<Ticket> AdmitSequences(const Cache& cache, absl::Span<const int64_t> seqs,
                                        const char* what);
  // For an operation that writes `seqs` of `cache` with data it fetches first (a cross-node
  // CopyPrefix): refused as AdmitSequences, but the ticket is never empty, so that a drain
  // beginning while the operation runs waits for it.
  absl::StatusOr<Ticket> AdmitWrite(const Cache& cache, absl::Span<const int64_t> seqs,
                                    const char* what);
  // When an operation holding `held` writes `seqs`: an empty ticket (go on) when `held` was
  // handed out before the drain in progress began and that drain still waits for it; otherwise
  // AdmitSequences (a sequence drained away meanwhile is not started again here).
  absl::StatusOr<Ticket> Readmit(const Ticket& held, const Cache& cache,
                                 absl::Span<const int64_t> seqs, const char* what);

  // Starts draining: Admit refuses from now on.
  void Close();
  // Waits until every ticket handed out before the drain began has been released (true), or
  // `deadline`, or the gate is opened again (false). Once it returned false, Readmit no longer
  // lets the operations still running through: the drain has stopped waiting for them.
  bool AwaitAdmitted(absl::Time deadline);
  // Close, then AwaitAdmitted.
  bool Close(absl::Time deadline) {
    Close();
    return AwaitAdmitted(deadline);
  }
  // Ends draining: Admit hands out tickets again.
  void Open();
  bool draining() const;

  // Called with the new state whenever Close or Open changes it (kvmesh-node: readiness), on
  // the thread that changed it. May be set or cleared at any time.
  void set_listener(std::function<void(bool draining)> listener);

 private:
  void Release(uint64_t generation);
  void Notify();
  Ticket Issue() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tickets of generations before the drain in progress are still held.
  bool HoldsEarlier() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const std::string self_name_;
  Mutex notify_mu_;  // held while the listener runs; taken before mu_
  mutable Mutex mu_;
  std::function<void(bool)> listener_ ABSL_GUARDED_BY(mu_);
  std::condition_variable_any released_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  // Drains begun (Close while open); the generation of the tickets handed out now.
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  // AwaitAdmitted gave up on the drain in progress.
  bool gave_up_ ABSL_GUARDED_BY(mu_) = false;
  // Tickets held, by generation (no zero counts).
  std::map<uint64_t, int64_t> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CLUSTER_DRAIN_GATE_H_
