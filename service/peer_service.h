// PeerServiceImpl: kvmesh.v1.PeerService (proto/kvmesh/v1/peer.proto), the node-to-node API of
// the pull protocol (docs/cluster.md), on gRPC's callback API.
//
// Only members may call it. With TLS (Options::require_member_certificate) a subject
// alternative name of the caller's verified certificate must name a current member (a DNS name
// or the URI kvmesh://member/<name> equal to its node name, or a DNS or IP name equal to the host
// of its peer address; never the common name), and that member is the caller's identity; without
// TLS the service is reachable only on the peer plane's private address (or loopback in development
// mode) and the caller's identity is its IP address. Anyone else gets PERMISSION_DENIED before a
// request is looked at. Leases are granted to the caller's identity: Fetch, NcclSend and Release of
// a lease by anyone else are NOT_FOUND, as for an unknown lease. A member may speak only for
// itself: Export's receiver, Pull's source_node and NcclConnect's from_node must be the member its
// certificate names.
//
// Export runs on the engine executor (it snapshots and checksums); Pull, NcclConnect and
// NcclSend run on the cluster executor (they wait on the network); Fetch is served by the
// grpc-stream transport's sender (transport::ServeFetch) over the lease table, which reads
// chunks that need a copy on Options::sender.run_read (kvmesh-node: a pool of its own); NodeInfo
// answers inline. Release ends the lease inline and answers once the export's payload is freed
// (LeaseTable::Release): a Fetch stream still finishing may hold it a moment longer, and the
// receiver's cluster operation must not answer before the cells it pinned are back. A full
// executor answers UNAVAILABLE.
//
// Thread safety: thread-safe; everything passed to the constructor must outlive it, and the
// executors (and what sender.run_read runs reads on) must keep running until the server has
// shut down.
#ifndef KVMESH_SERVICE_PEER_SERVICE_H_
#define KVMESH_SERVICE_PEER_SERVICE_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "service/cluster/cluster.h"
#include "service/cluster/leases.h"
#include "service/executor.h"
#include "service/watch_events.h"
#include "transport/grpc_stream_transport.h"

namespace kvmesh {

// The most WatchEvents streams of members a node serves at once: one per member of a cluster
// of up to that many nodes and one more.
inline constexpr int kMaxPeerWatchers = 256;

// Fetch is served raw (grpc::ByteBuffer): the grpc-stream sender writes chunks straight from
// the exported image (transport/grpc_stream_transport.h).
class PeerServiceImpl final : public transport::PeerServiceWithRawFetch {
 public:
  // Polled by a hook while it waits: CANCELLED once the caller has cancelled the RPC (or its
  // deadline passed), else OK. The hook stops and returns that status (transport::NcclInterrupt).
  using Interrupt = std::function<absl::Status()>;
  // The sender side of the nccl transport, when this node has one (transport::NcclPeerSide's
  // Connect and Send). Run on the cluster executor; the call ends with the returned status.
  struct NcclHooks {
    std::function<absl::Status(const v1::NcclConnectRequest&, absl::Time deadline,
                               const Interrupt& interrupt)>
        connect;
    std::function<absl::Status(const v1::NcclSendRequest&, absl::Time deadline,
                               const Interrupt& interrupt)>
        send;
  };
  struct Options {
    std::string name;
    // Who may call: the cluster's members (required).
    Membership* membership = nullptr;
    // TLS is on: every caller must present a certificate that names a member.
    bool require_member_certificate = false;
    std::string backend;
    std::vector<std::string> transports;
    transport::SenderOptions sender;
    NcclHooks nccl;  // empty functions: no nccl transport here
    // WatchEvents and LookupPrefix, for the other members' cluster indexes (not owned; null:
    // both are FAILED_PRECONDITION).
    CacheRegistry* registry = nullptr;
    EventLog* events = nullptr;
  };

  PeerServiceImpl(Cluster* cluster, LeaseTable* leases, Executor* engine_executor,
                  Executor* cluster_executor, Options options);

  grpc::ServerUnaryReactor* NodeInfo(grpc::CallbackServerContext* context,
                                     const v1::NodeInfoRequest* request,
                                     v1::NodeInfoResponse* response) override;
  grpc::ServerUnaryReactor* Export(grpc::CallbackServerContext* context,
                                   const v1::ExportRequest* request,
                                   v1::ExportResponse* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Fetch(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context,
                                    const v1::ReleaseRequest* request,
                                    v1::ReleaseResponse* response) override;
  grpc::ServerUnaryReactor* Pull(grpc::CallbackServerContext* context,
                                 const v1::PullRequest* request,
                                 v1::PullResponse* response) override;
  grpc::ServerUnaryReactor* NcclConnect(grpc::CallbackServerContext* context,
                                        const v1::NcclConnectRequest* request,
                                        v1::NcclConnectResponse* response) override;
  grpc::ServerUnaryReactor* NcclSend(grpc::CallbackServerContext* context,
                                     const v1::NcclSendRequest* request,
                                     v1::NcclSendResponse* response) override;
  grpc::ServerUnaryReactor* Remove(grpc::CallbackServerContext* context,
                                   const v1::PeerRemoveRequest* request,
                                   v1::PeerRemoveResponse* response) override;
  grpc::ServerUnaryReactor* Place(grpc::CallbackServerContext* context,
                                  const v1::PlaceRequest* request,
                                  v1::PlaceResponse* response) override;
  // Every tenant's events (WatchScope::kAllTenants), to at most kMaxPeerWatchers members at once.
  grpc::ServerWriteReactor<v1::WatchEventsResponse>* WatchEvents(
      grpc::CallbackServerContext* context, const v1::PeerWatchEventsRequest* request) override;
  grpc::ServerUnaryReactor* LookupPrefix(grpc::CallbackServerContext* context,
                                         const v1::PeerLookupPrefixRequest* request,
                                         v1::LookupPrefixResponse* response) override;

  // Ends every WatchEvents stream with UNAVAILABLE, and refuses new ones: the node is shutting
  // down (before the server's Shutdown, which would wait for them).
  void StopWatchers();

 private:
  // Who is calling (see the class comment).
  struct Caller {
    std::string identity;  // what leases are bound to
    std::string member;    // the member its certificate names; empty without TLS
  };
  absl::StatusOr<Caller> Identify(const grpc::CallbackServerContext& context) const;
  // PERMISSION_DENIED unless `claimed` (named by `field`) is the caller's own member name; OK
  // without TLS, where a caller has no name to check against.
  static absl::Status CheckSpeaksForItself(const Caller& caller, const std::string& claimed,
                                           const char* field);
  // A unary reactor already finished with `status`.
  static grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* context,
                                          const absl::Status& status);

  // Finishes the call with FAILED_PRECONDITION: this node has no nccl transport.
  grpc::ServerUnaryReactor* NoNccl(grpc::CallbackServerContext* context) const;

  // Runs `fn` on `executor` and finishes the call with its status (RunUnaryOn; UNAVAILABLE
  // naming this node when the executor refuses it).
  grpc::ServerUnaryReactor* RunOn(Executor* executor, grpc::CallbackServerContext* context,
                                  absl::AnyInvocable<absl::Status() &&> fn);

  Cluster* const cluster_;
  LeaseTable* const leases_;
  Executor* const engine_executor_;
  Executor* const cluster_executor_;
  const Options options_;
  WatcherCount watchers_;
};

// The deadline a callback server context carries, absl::InfiniteFuture() for none.
absl::Time ContextDeadline(const grpc::CallbackServerContext& context);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_PEER_SERVICE_H_
