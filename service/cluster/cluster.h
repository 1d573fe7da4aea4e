// Cluster: the cluster operations of a node (docs/cluster.md), both as the node a scheduler
// calls (CopyPrefix from another node, Migrate, MigrateSnapshot, Remove across the cluster) and
// as the peer another node pulls from (Export, Release) or asks to pull (Pull).
//
// Sender side: Export snapshots the sequence (or takes the snapshot), opens the engine's export
// reader on it, computes the CRC-32C of the wire image and registers a lease; the temporary
// snapshot is dropped at once, since the reader pins its data. Receiver side: PullInto calls
// Export on the sender, moves the payload with a Transport into an import writer, commits it
// as a snapshot of the local cache and releases the lease; callers then Restore from it.
//
// Every call blocks until done or its deadline; CacheServiceImpl and PeerServiceImpl run them
// on the node's cluster executor, never on gRPC's threads nor on the engine executor (a
// transfer waits on the network for seconds).
//
// Thread safety: thread-safe. Everything passed to the constructor must outlive it.
#ifndef KVMESH_SERVICE_CLUSTER_CLUSTER_H_
#define KVMESH_SERVICE_CLUSTER_CLUSTER_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/cache.h"
#include "cache/cache_registry.h"
#include "cache/mutex.h"
#include "kvmesh/v1/kvmesh.pb.h"
#include "kvmesh/v1/peer.pb.h"
#include "service/cluster/drain_gate.h"
#include "service/cluster/leases.h"
#include "service/cluster/membership.h"
#include "service/cluster/reservations.h"
#include "transport/transport.h"

namespace kvmesh {

class Metrics;

class Cluster {
 public:
  struct Options {
    std::string self_name;
    std::string backend = "host";  // "host" or "cuda:N"
    // Lease time granted when the receiver asks for none, and the most granted.
    absl::Duration lease_time = absl::Seconds(30);
    absl::Duration max_lease_time = absl::Minutes(10);
    // Lease time a receiver asks for.
    absl::Duration requested_lease_time = absl::Seconds(30);
    // Deadline of a cluster operation whose caller set none (or a later one).
    absl::Duration transfer_timeout = absl::Seconds(120);
    // Deadline of each control RPC of a transfer (Export, Release, NodeInfo) within it.
    absl::Duration control_timeout = absl::Seconds(10);
    // "auto", "grpc-stream" or "nccl".
    std::string transport = "auto";
    // Whether this node takes new caches and sequences (not owned; null: always). A draining
    // node refuses Pull and Place(create), and CopyPrefix from a peer into a new sequence.
    DrainGate* gate = nullptr;
    // A tenant's quota, for Place(create) (null: unlimited).
    std::function<TenantQuota(const std::string& tenant)> quota;
    // Testing only: the first this many Pulls of a sequence that commit answer UNAVAILABLE
    // anyway, as when the reply is lost on its way back.
    int testing_lose_pull_replies = 0;
    // Transfers and migrations are counted here (not owned; null: not counted).
    Metrics* metrics = nullptr;
    // Sequences migrated in and out are published here (not owned; null: not published).
    EventLog* events = nullptr;
  };

  // `transports` maps transport names (transport::kGrpcStream, transport::kNccl) to the
  // receiver side of each transport this node has; grpc-stream is required.
  Cluster(Options options, CacheRegistry* registry, Membership* membership, LeaseTable* leases,
          Reservations* reservations, std::map<std::string, transport::Transport*> transports);

  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  const Options& options() const { return options_; }
  Reservations* reservations() const { return reservations_; }

  // The deadline of an operation whose caller asked for `requested` (absl::InfiniteFuture()
  // when none): the earlier of it and now + transfer_timeout.
  absl::Time Deadline(absl::Time requested) const;

  // ---- scheduler-facing operations (this node is the one called) --------------------------
  // Each acts on the caches of `tenant` (the caller's), here and on the other nodes, which
  // look the cache up among that tenant's caches.
  // CopyPrefix with source_node naming another member: pulls into dst_seq, and fills
  // response's transfer and dst's offset.
  absl::Status CopyPrefixFrom(const std::string& tenant, const v1::CopyPrefixRequest& request,
                              absl::Time deadline, v1::CopyPrefixResponse* response);
  // With target_seq_unused (a drain), the target refuses to replace a sequence that stores
  // something there (ALREADY_EXISTS). `migration_id` names the migration (empty: a new one);
  // the target remembers the ids it committed, so that a Migrate repeated with the same id
  // after an unclear failure (a lost reply) finds it done instead of copying it again.
  absl::StatusOr<v1::MigrateResponse> Migrate(const std::string& tenant,
                                              const v1::MigrateRequest& request,
                                              absl::Time deadline, bool target_seq_unused = false,
                                              const std::string& migration_id = "");
  absl::StatusOr<v1::MigrateSnapshotResponse> MigrateSnapshot(
      const std::string& tenant, const v1::MigrateSnapshotRequest& request, absl::Time deadline);
  // Remove with REMOVE_SCOPE_CLUSTER: every member, this one first. `local` runs the Remove
  // here (with the same checks as a local Remove RPC); the peers run RemoveLocal.
  absl::StatusOr<v1::RemoveResponse> RemoveEverywhere(const std::string& tenant,
                                                      const v1::RemoveRequest& request,
                                                      absl::Time deadline,
                                                      const std::function<absl::Status()>& local);

  // PeerService/Place on `target`: whether it can take `request.spec`'s cache (a drain).
  absl::StatusOr<v1::PlaceResponse> AskToPlace(const MemberAddress& target,
                                               const v1::PlaceRequest& request,
                                               absl::Time deadline);

  // ListMembers: this node and its peers, each peer checked now.
  v1::ListMembersResponse DescribeMembers() const;

  // ---- peer-facing operations ---------------------------------------------------------------
  // `caller` is the identity PeerServiceImpl established for the calling node; a lease is
  // granted to it and usable by it alone. Export refuses a transport this node does not have
  // (INVALID_ARGUMENT) and a receiver that is not a member.
  absl::StatusOr<v1::ExportResponse> Export(const v1::ExportRequest& request,
                                            const std::string& caller);
  // Ends the lease; `freed` (if set, and only when OK is returned) runs once the export's
  // payload is freed, i.e. the cells or snapshot chunks it pinned are back (LeaseTable::Release):
  // PeerService answers the receiver's Release only then, so that a cluster operation that
  // waits for its Release (every one does) answers after the sender is consistent.
  absl::Status Release(const v1::ReleaseRequest& request, const std::string& caller,
                       std::function<void()> freed = nullptr);
  absl::StatusOr<v1::PullResponse> Pull(const v1::PullRequest& request, absl::Time deadline);
  // The local part of another node's cluster-wide Remove.
  absl::Status RemoveLocal(const v1::PeerRemoveRequest& request);
  // Room here for a draining peer's cache; with request.create, creates it from the spec
  // (within the tenant's quota and the memory budget). FAILED_PRECONDITION when a cache of that
  // name exists with another spec; UNAVAILABLE for create while this node drains itself.
  absl::StatusOr<v1::PlaceResponse> Place(const v1::PlaceRequest& request);

 private:
  // The operations above without their metrics.
  absl::StatusOr<v1::MigrateResponse> MigrateSequence(const std::string& tenant,
                                                      const v1::MigrateRequest& request,
                                                      absl::Time deadline, bool target_seq_unused,
                                                      const std::string& migration_id);
  absl::StatusOr<v1::MigrateSnapshotResponse> MigrateOneSnapshot(
      const std::string& tenant, const v1::MigrateSnapshotRequest& request, absl::Time deadline);
  absl::StatusOr<v1::PullResponse> PullHere(const v1::PullRequest& request, absl::Time deadline);
  void CountMigration(const char* kind, const char* role, const absl::Status& status) const;

  struct Pulled {
    bool empty = false;     // the sender had nothing to send
    SnapshotInfo snapshot;  // imported into the local cache (when !empty)
    // A sequence pull's import (when !empty), restored by CommitSequence; without it the
    // pull is a stored snapshot, `snapshot`.
    std::shared_ptr<SequenceImport> import;
    v1::TransferStats stats;
  };

  // Receiver side of the pull protocol: imports `what` of `cache` from member `source` as a
  // new local snapshot. With `into_seq` (a sequence pull, restored into that sequence up to
  // `length`, 0: all), the room it needs here (a sequence slot, free cells) is checked once the
  // sender has said what it holds and before any byte moves, and the rows are received as a
  // SequenceImport (straight into free cells where the cache lends them), not a snapshot.
  absl::StatusOr<Pulled> PullInto(const std::string& tenant, const std::shared_ptr<Cache>& cache,
                                  const std::string& source, const v1::ExportRequest& what,
                                  absl::Time deadline,
                                  std::optional<int64_t> into_seq = std::nullopt,
                                  int32_t length = 0);
  // Restores a pulled sequence into dst_seq (or empties it), then drops the pulled snapshot.
  // With must_be_unused, ALREADY_EXISTS when dst_seq stores something. A non-empty
  // `commit_key` (a migration's) is remembered once committed; a commit under a key already
  // remembered does nothing and succeeds. With `offset`, dst_seq's offset as the commit left
  // it (read under the same guard). With `retention` (a migration's), dst_seq takes it with
  // the data. `admitted`: the operation's DrainGate ticket (DrainGate::Readmit).
  absl::Status CommitSequence(const std::string& tenant, const std::shared_ptr<Cache>& cache,
                              const Pulled& pulled, int64_t dst_seq, int32_t length,
                              bool must_be_unused, const std::string& commit_key, const char* what,
                              const DrainGate::Ticket& admitted, int32_t* offset = nullptr,
                              const std::optional<Retention>& retention = std::nullopt);
  bool Committed(const std::string& commit_key) const;
  void RememberCommitted(const std::string& commit_key);
  // ALREADY_EXISTS when `seq` stores something in `cache`.
  absl::Status CheckUnused(const Cache& cache, int64_t seq) const;
  // The transport to pull from `source` with.
  // PeerService/Pull on `target` (Migrate, MigrateSnapshot): the target pulls from this node.
  // Publishes a sequence's arrival from `peer` or departure for it (Options::events).
  void PublishMigration(EventKind kind, const std::string& tenant, const std::string& cache,
                        int64_t seq, const std::string& peer);
  absl::StatusOr<v1::PullResponse> AskToPull(const MemberAddress& target,
                                             const v1::PullRequest& pull, absl::Time deadline);
  absl::StatusOr<transport::Transport*> ChooseTransport(const MemberAddress& source,
                                                        absl::Time deadline);
  // The cache `name` of `tenant`: INVALID_ARGUMENT for an empty name or a malformed tenant.
  absl::StatusOr<std::shared_ptr<Cache>> FindCache(const std::string& tenant,
                                                   const std::string& name) const;
  absl::StatusOr<MemberAddress> FindPeer(const std::string& name, const char* field) const;

  const Options options_;
  CacheRegistry* const registry_;
  Membership* const membership_;
  LeaseTable* const leases_;
  Reservations* const reservations_;
  const std::map<std::string, transport::Transport*> transports_;

  // The last kCommittedMigrations sequence migrations committed here (tenant, cache, migration
  // id, target sequence), oldest first.
  static constexpr size_t kCommittedMigrations = 4096;
  mutable Mutex committed_mu_;
  std::deque<std::string> committed_order_ ABSL_GUARDED_BY(committed_mu_);
  std::set<std::string> committed_ ABSL_GUARDED_BY(committed_mu_);
  int lost_replies_ ABSL_GUARDED_BY(committed_mu_) = 0;
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CLUSTER_CLUSTER_H_
