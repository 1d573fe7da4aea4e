// PeerServiceImpl: kvmesh.v1.PeerService (proto/kvmesh/v1/peer.proto), the node-to-node API of
// the pull protocol (docs/cluster.md), on gRPC's callback API.
//
// Every method is served through a RequestGate (service/request_gate.h): Identify (below)
// decides about a call from its certificate or address before its request is read, and the
// request is then held to its method's limit (kMaxPeerRequestBytes, kMaxPeerTokensRequestBytes)
// before it is parsed. The node registers the gate (request_gate()) with the peer plane's
// server, or, in development mode where PeerService shares the client port, adds the methods to
// CacheService's gate (AddTo).
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
// receiver's cluster operation must not answer before the cells it pinned are back (CANCELLED
// if the caller goes first). A full executor answers UNAVAILABLE.
//
// Thread safety: thread-safe; everything passed to the constructor must outlive it, and the
// executors (and what sender.run_read runs reads on) must keep running until the server has
// shut down.
#ifndef KVMESH_SERVICE_PEER_SERVICE_H_
#define KVMESH_SERVICE_PEER_SERVICE_H_

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvmesh/v1/peer.pb.h"
#include "service/cluster/cluster.h"
#include "service/cluster/leases.h"
#include "service/executor.h"
#include "service/request_gate.h"
#include "service/watch_events.h"
#include "transport/grpc_stream_transport.h"

namespace kvmesh {

// The most WatchEvents streams of members a node serves at once: one per member of a cluster
// of up to that many nodes and one more.
inline constexpr int kMaxPeerWatchers = 256;

// What a PeerService request may be, in bytes, before it is parsed (RequestGate): names, ids and
// a cache spec.
inline constexpr size_t kMaxPeerRequestBytes = size_t{64} << 10;
// An Export's or a Pull's request, whose ExportSequence may list up to 1,048,576 token ids the
// receiver holds (packed varints of at most 5 bytes), and a LookupPrefix forwarded from a
// member (CacheService's limit for its prompt, and room for the rest).
inline constexpr size_t kMaxPeerTokensRequestBytes = (size_t{8} << 20) + kMaxPeerRequestBytes;

class PeerServiceImpl final {
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

  // The generic service that serves PeerService, every caller identified (Identify) before its
  // request is read: register it with the peer plane's server
  // (ServerBuilder::RegisterCallbackGenericService).
  RequestGate* request_gate() { return &gate_; }
  // Serves PeerService through `gate` too (a server has one generic service: a development node
  // serves PeerService beside CacheService, through CacheService's gate), with the same
  // identification and limits. Before the server starts; `gate` must not outlive this service.
  void AddTo(RequestGate* gate);

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

  // Adds every method to `gate`.
  void Register(RequestGate* gate);

  void HandleNodeInfo(UnaryCall* call, const v1::NodeInfoRequest* request,
                      v1::NodeInfoResponse* response);
  void HandleExport(UnaryCall* call, const v1::ExportRequest* request,
                    v1::ExportResponse* response);
  StreamReactor* StartFetch(StreamCall* call, const grpc::ByteBuffer* request);
  void HandleRelease(UnaryCall* call, const v1::ReleaseRequest* request,
                     v1::ReleaseResponse* response);
  void HandlePull(UnaryCall* call, const v1::PullRequest* request, v1::PullResponse* response);
  void HandleNcclConnect(UnaryCall* call, const v1::NcclConnectRequest* request,
                         v1::NcclConnectResponse* response);
  void HandleNcclSend(UnaryCall* call, const v1::NcclSendRequest* request,
                      v1::NcclSendResponse* response);
  void HandleRemove(UnaryCall* call, const v1::PeerRemoveRequest* request,
                    v1::PeerRemoveResponse* response);
  void HandlePlace(UnaryCall* call, const v1::PlaceRequest* request, v1::PlaceResponse* response);
  // Every tenant's events (WatchScope::kAllTenants), to at most kMaxPeerWatchers members at once.
  StreamReactor* StartWatchEvents(StreamCall* call, const grpc::ByteBuffer* request);
  void HandleLookupPrefix(UnaryCall* call, const v1::PeerLookupPrefixRequest* request,
                          v1::LookupPrefixResponse* response);

  // Answers the call with FAILED_PRECONDITION: this node has no nccl transport.
  void NoNccl(UnaryCall* call) const;

  // Runs `fn` on `executor` and answers the call with its status (RunUnaryOn; UNAVAILABLE
  // naming this node when the executor refuses it).
  void RunOn(Executor* executor, UnaryCall* call, absl::AnyInvocable<absl::Status() &&> fn);

  Cluster* const cluster_;
  LeaseTable* const leases_;
  Executor* const engine_executor_;
  Executor* const cluster_executor_;
  const Options options_;
  WatcherCount watchers_;
  RequestGate gate_;
};

// The deadline a callback server context carries, absl::InfiniteFuture() for none.
absl::Time ContextDeadline(const grpc::CallbackServerContext& context);

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_PEER_SERVICE_H_
