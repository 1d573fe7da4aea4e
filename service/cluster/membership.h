// Membership: who the other nodes of the cluster are, and the channels to reach them
// (docs/api.md#membership, docs/cluster.md "Membership").
//
// A node knows its peers either statically (`--peers=name=host:port,...`) or from a Kubernetes
// headless Service (`--peer-dns=SERVICE:PORT`, one A/AAAA record per ready StatefulSet pod):
// each address is reverse-resolved and the member's name is the first label of its reverse
// name (the pod name, "kvmesh-1" of "kvmesh-1.kvmesh.default.svc.cluster.local"); an address
// without a reverse name is named by its IP. The address that is this node (same name, or one
// of this host's interface addresses with this node's port) is left out. A background thread
// re-resolves every `rediscover_interval`; a failed resolution keeps the members last known and
// is reported in Describe (this node's `detail`).
//
// Channels are created once per address and shared by every component that talks to peers
// (cluster operations, transports): large messages allowed, quick reconnection after a peer
// restarts.
//
// Thread safety: thread-safe. The destructor stops the discovery thread (waiting for a DNS
// query already running, which cannot be interrupted); it must not run concurrently with other
// calls.
#ifndef KVMESH_SERVICE_CLUSTER_MEMBERSHIP_H_
#define KVMESH_SERVICE_CLUSTER_MEMBERSHIP_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache/mutex.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "kvmesh/v1/kvmesh.pb.h"

namespace kvmesh {

// A member: its node name and the host:port of its gRPC server.
struct MemberAddress {
  std::string name;
  std::string address;

  friend bool operator==(const MemberAddress& a, const MemberAddress& b) {
    return a.name == b.name && a.address == b.address;
  }
};

class Membership {
 public:
  struct Options {
    // This node: its name (letters, digits, '.', '_', '-'), the host:port it listens on (port 0
    // allowed until SetSelfAddress tells the bound port), what it runs on and the transports
    // it can move payloads with.
    std::string self_name;
    std::string self_address;
    std::string backend = "host";  // "host" or "cuda:N"
    std::vector<std::string> transports;
    // Static peers (ParsePeers), or empty.
    std::vector<MemberAddress> peers;
    // "SERVICE:PORT" of a headless Service to discover peers from, or empty. Exclusive with
    // `peers`.
    std::string peer_dns;
    // Describe waits at most this long for a peer's answers.
    absl::Duration health_timeout = absl::Seconds(1);
    // How often peer_dns is resolved again.
    absl::Duration rediscover_interval = absl::Seconds(5);
    // Largest message a peer channel sends or receives (export payload chunks, NCCL ids, ...).
    int max_message_bytes = 128 << 20;
    // The credentials of the channel to a member (its name as this node knows it, or empty,
    // and its address): with TLS, the node's certificate and a check of the member's
    // (NodeTls::PeerChannelCredentials). Null: plaintext.
    std::function<std::shared_ptr<grpc::ChannelCredentials>(const MemberAddress& member)>
        channel_credentials;
  };

  // Parses `--peers`: "name=host:port,name=host:port,..." (whitespace around items ignored; ""
  // is no peers). host is a name, an IPv4 address or a bracketed IPv6 address; port 1..65535.
  // INVALID_ARGUMENT naming the entry for an empty entry, a missing '=', an empty or malformed
  // name, a bad host:port, a port out of range, or a name given twice. The messages do not name
  // the flag: callers prefix it ("--peers: entry 'b' is not name=host:port (no '=')").
  static absl::StatusOr<std::vector<MemberAddress>> ParsePeers(absl::string_view flag);

  // Checks `options` and, with peer_dns, starts discovery (the first resolution runs at once on
  // the discovery thread; Rediscover runs one synchronously). INVALID_ARGUMENT for an empty or
  // malformed self_name, an empty self_address, a static peer named like this node, a peer list
  // that ParsePeers would reject, both peers and peer_dns, a malformed peer_dns, or non-positive
  // durations or message size.
  static absl::StatusOr<std::unique_ptr<Membership>> Create(Options options);

  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  const std::string& self_name() const { return options_.self_name; }
  const std::string& backend() const { return options_.backend; }
  const std::vector<std::string>& transports() const { return options_.transports; }

  // The address this node listens on, once the server has bound its port.
  void SetSelfAddress(std::string address);
  std::string self_address() const;

  // The member called `name`: this node (with its self_address) or a peer. INVALID_ARGUMENT
  // "node 'x' is not a member (members: a, b, c)" otherwise (members sorted, this node
  // included).
  absl::StatusOr<MemberAddress> Find(absl::string_view name) const;

  // The peers (this node excluded), sorted by name.
  std::vector<MemberAddress> Peers() const;

  // The channel to `member`'s address, created on first use and shared afterwards.
  std::shared_ptr<grpc::Channel> Channel(const MemberAddress& member);
  // A new channel to `member` with the same settings and a connection of its own, for a caller
  // that calls peers before they may listen (the cluster index): a shared channel whose
  // connection attempts failed waits out its reconnection backoff (up to 2 s) before its next
  // call can succeed, which would fail the cluster operations that follow a peer's start.
  std::shared_ptr<grpc::Channel> OwnChannel(const MemberAddress& member);

  // This node first (SERVING, its backend and transports), then every peer by name, each
  // checked in parallel: grpc.health.v1.Health/Check of the server ("") and PeerService/NodeInfo
  // for its backend and transports, both with deadline min(`deadline`, now + health_timeout).
  // A peer whose health check fails is UNREACHABLE (detail: the RPC status); one whose health
  // service answers anything but SERVING is NOT_SERVING. Returns by that deadline (plus the
  // time gRPC takes to report it).
  v1::ListMembersResponse Describe(absl::Time deadline);

  // With peer_dns: resolves it now and updates the peers; the status of the resolution
  // (UNAVAILABLE naming the service and the resolver's error; the last known peers stay).
  // FAILED_PRECONDITION without peer_dns.
  absl::Status Rediscover();

 private:
  explicit Membership(Options options);

  // One DNS resolution of peer_dns: the peers it names, without this node.
  absl::StatusOr<std::vector<MemberAddress>> ResolvePeers() const;
  void DiscoveryLoop();
  std::shared_ptr<grpc::Channel> NewChannelLocked(const MemberAddress& member, bool own_connection)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  std::string dns_host_;  // peer_dns split; immutable after Create
  int dns_port_ = 0;

  // Lock order: mu_ only (the discovery thread resolves without it).
  mutable Mutex mu_;
  std::condition_variable_any wake_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::string self_address_ ABSL_GUARDED_BY(mu_);
  std::vector<MemberAddress> peers_ ABSL_GUARDED_BY(mu_);  // sorted by name
  // Discovery: resolutions are numbered when they start, and a result older than the one
  // applied is dropped (Rediscover and the thread may race).
  uint64_t resolutions_started_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t resolution_applied_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status last_resolution_ ABSL_GUARDED_BY(mu_);
  absl::Time last_resolution_time_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);

  std::thread discovery_;  // runs DiscoveryLoop with peer_dns
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CLUSTER_MEMBERSHIP_H_
