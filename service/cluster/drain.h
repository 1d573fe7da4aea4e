// Drainer: empties a node into its peers (docs/api.md#drain), for the Drain RPC and for
// SIGTERM (a pod being deleted, a rolling update).
//
// A drain closes the node's DrainGate (no new caches or sequences; the node's readiness turns
// NOT_SERVING through the gate's listener), then moves every live sequence and every snapshot of
// every tenant to peers, in passes, until nothing is left or the deadline passes:
//  - per cache, each peer is asked (PeerService.Place) whether it drains too, has the cache
//    with the same spec, how many cells are free and which sequence ids it uses; candidates
//    are the peers that have the cache, most free cells first, then those that do not, which
//    get the cache created from its spec (within the tenant's quota) when one is chosen;
//  - a sequence is Migrated (keep_source false) under its own id, or the next id above those
//    the target uses when its own is taken there; the target refuses to replace a sequence
//    (PullRequest.target_seq_unused), so a sequence a scheduler started there meanwhile is never
//    overwritten: the drain picks another id;
//  - a snapshot is MigrateSnapshot'ed (a new id there).
// An item that fails on one peer is tried on the next. A pass that moves nothing is repeated
// after a pause while some failure may pass (ABORTED: pending tokens, a migration in progress;
// UNAVAILABLE, DEADLINE_EXCEEDED: a peer that does not answer); otherwise the drain ends and
// lists what stayed, each item with the last reason. Nothing is lost: Migrate removes the source
// only once the target has committed.
//
// Thread safety: thread-safe. One drain runs at a time: a request while one runs is ABORTED; the
// shutdown drain (SIGTERM) cuts a running one short to its own deadline, waits for it, then
// makes its own attempt on what is left, and from then on Resume is refused. Everything passed
// to the constructor must outlive it.
#ifndef KVMESH_SERVICE_CLUSTER_DRAIN_H_
#define KVMESH_SERVICE_CLUSTER_DRAIN_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "cache/cache_registry.h"
#include "cache/mutex.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "service/cluster/cluster.h"
#include "service/cluster/drain_gate.h"
#include "service/cluster/membership.h"

namespace kvmesh {

class Metrics;

class Drainer {
 public:
  struct Options {
    std::string self_name;
    // Pause between passes that moved nothing.
    absl::Duration retry_interval = absl::Milliseconds(250);
    // Receives one line per item moved or left behind, and a summary (kvmesh-node: stderr).
    std::function<void(const std::string& line)> log;
    // Drains are counted here (not owned; null: not counted).
    Metrics* metrics = nullptr;
  };

  enum class Mode {
    kRequest,   // the Drain RPC: the node keeps running
    kShutdown,  // SIGTERM: the node exits afterwards
  };

  Drainer(Options options, CacheRegistry* registry, Membership* membership, Cluster* cluster,
          DrainGate* gate);
  Drainer(const Drainer&) = delete;
  Drainer& operator=(const Drainer&) = delete;

  // Drains until nothing is left or `deadline`. The node stays draining afterwards (until
  // Resume), whatever stayed. ABORTED for a request while another drain runs.
  absl::StatusOr<v1::DrainResponse> Drain(absl::Time deadline, Mode mode);

  // Ends draining: the gate opens, and a drain in progress stops before its next item. Returns
  // the response of a Drain RPC with resume (draining false, nothing moved); FAILED_PRECONDITION
  // once a shutdown drain has begun.
  absl::StatusOr<v1::DrainResponse> Resume();

 private:
  struct Item;
  struct Candidate;
  struct Outcome;
  // A Migrate whose outcome is unclear: where it went, as what, under which migration id.
  struct Unclear {
    std::string node;
    int64_t target_seq = 0;
    std::string migration_id;
  };

  std::vector<Item> Inventory() const;
  // `wait_for_unreachable`: a peer that does not answer makes the pass worth repeating (early
  // in a drain: a peer restarting in a rolling update) rather than being left out.
  std::vector<Candidate> Probe(const std::string& tenant, const Cache& cache, absl::Time deadline,
                               bool wait_for_unreachable, std::string* reasons, bool* retryable);
  // `local_seqs`: the ids of the cache's sequences here, which a renamed one avoids.
  // `unclear`: attempts of earlier passes whose outcome is unclear, which go first.
  Outcome MoveSequence(const Item& item, const std::set<int64_t>& local_seqs,
                       std::vector<Candidate>& candidates, absl::Time deadline,
                       std::map<std::string, Unclear>* unclear, v1::DrainResponse* response);
  Outcome MoveSnapshot(const Item& item, std::vector<Candidate>& candidates, absl::Time deadline,
                       v1::DrainResponse* response);
  // Creates the cache on `candidate` when it lacks it; false (and `reason`) when that fails.
  bool EnsureCache(const Item& item, Candidate& candidate, absl::Time deadline,
                   v1::DrainResponse* response, absl::Status* reason);
  void Log(const std::string& line) const;
  bool Resumed(uint64_t epoch) const;
  // `deadline`, or earlier when a shutdown drain is waiting for this one.
  absl::Time Until(absl::Time deadline) const;
  v1::DrainResponse Run(absl::Time deadline, uint64_t epoch);

  const Options options_;
  CacheRegistry* const registry_;
  Membership* const membership_;
  Cluster* const cluster_;
  DrainGate* const gate_;

  // Taken before the gate's mutexes (Drain and Resume change the gate under it).
  mutable Mutex mu_;
  std::condition_variable_any wake_;
  uint64_t resumes_ ABSL_GUARDED_BY(mu_) = 0;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool terminating_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time cap_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CLUSTER_DRAIN_H_
