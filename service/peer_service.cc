#include "service/peer_service.h"

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/mutex.h"
#include "cache/status_macros.h"
#include "service/cluster/cluster_index.h"
#include "service/cluster/membership.h"
#include "service/common/convert.h"
#include "service/common/process_info.h"
#include "service/common/tls.h"

namespace kvmesh {

absl::Time ContextDeadline(const grpc::CallbackServerContext& context) {
  const std::chrono::system_clock::time_point deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

namespace {

// The host part of a gRPC peer string: "ipv4:10.0.0.7:41234" -> "10.0.0.7", "ipv6:[::1]:5" ->
// "[::1]"; the whole string for other forms (unix:...).
std::string PeerHost(const std::string& peer) {
  std::string host = peer;
  const size_t scheme = host.find(':');
  if (scheme != std::string::npos &&
      (host.compare(0, scheme, "ipv4") == 0 || host.compare(0, scheme, "ipv6") == 0)) {
    host = host.substr(scheme + 1);
    const size_t port = host.rfind(':');
    if (port != std::string::npos) host = host.substr(0, port);
  }
  return host;
}

// Answers `call` with `status`, an error.
void Refuse(UnaryCall* call, const absl::Status& status) { call->Answer(ToGrpcStatus(status)); }

// The host of a "host:port" member address.
std::string AddressHost(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

PeerServiceImpl::PeerServiceImpl(Cluster* cluster, LeaseTable* leases, Executor* engine_executor,
                                 Executor* cluster_executor, Options options)
    : cluster_(cluster),
      leases_(leases),
      engine_executor_(engine_executor),
      cluster_executor_(cluster_executor),
      options_(std::move(options)),
      gate_([this](const grpc::CallbackServerContext& context) {
        return Identify(context).status();
      }) {
  watchers_.max = kMaxPeerWatchers;
  Register(&gate_);
}

void PeerServiceImpl::AddTo(RequestGate* gate) {
  gate->AuthenticateService(
      v1::PeerService::service_full_name(),
      [this](const grpc::CallbackServerContext& context) { return Identify(context).status(); });
  Register(gate);
}

void PeerServiceImpl::Register(RequestGate* gate) {
  auto name = [](const char* method) {
    return absl::StrCat("/", v1::PeerService::service_full_name(), "/", method);
  };
  auto add = [this, gate, &name](const char* method, size_t limit, auto handler) {
    gate->Add(name(method), limit, this, handler);
  };
  add("NodeInfo", kMaxPeerRequestBytes, &PeerServiceImpl::HandleNodeInfo);
  add("Export", kMaxPeerTokensRequestBytes, &PeerServiceImpl::HandleExport);
  add("Release", kMaxPeerRequestBytes, &PeerServiceImpl::HandleRelease);
  add("Pull", kMaxPeerTokensRequestBytes, &PeerServiceImpl::HandlePull);
  add("NcclConnect", kMaxPeerRequestBytes, &PeerServiceImpl::HandleNcclConnect);
  add("NcclSend", kMaxPeerRequestBytes, &PeerServiceImpl::HandleNcclSend);
  add("Remove", kMaxPeerRequestBytes, &PeerServiceImpl::HandleRemove);
  add("Place", kMaxPeerRequestBytes, &PeerServiceImpl::HandlePlace);
  add("LookupPrefix", kMaxPeerTokensRequestBytes, &PeerServiceImpl::HandleLookupPrefix);
  gate->AddServerStream(name("Fetch"), kMaxPeerRequestBytes,
                        [this](StreamCall* call, const grpc::ByteBuffer* request) {
                          return StartFetch(call, request);
                        });
  gate->AddServerStream(name("WatchEvents"), kMaxPeerRequestBytes,
                        [this](StreamCall* call, const grpc::ByteBuffer* request) {
                          return StartWatchEvents(call, request);
                        });
}

void PeerServiceImpl::RunOn(Executor* executor, UnaryCall* call,
                            absl::AnyInvocable<absl::Status() &&> fn) {
  auto busy = [this, executor] {
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat("kvmesh-node ", options_.name, " is overloaded: its executor queue holds ",
                     executor->max_queued(), " tasks already; retry later"));
  };
  RunUnaryOn(executor, call, std::move(fn), "call cancelled by the peer", busy);
}

absl::StatusOr<PeerServiceImpl::Caller> PeerServiceImpl::Identify(
    const grpc::CallbackServerContext& context) const {
  if (!options_.require_member_certificate) {
    return Caller{absl::StrCat("address ", PeerHost(context.peer())), ""};
  }
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  const PeerCertificate cert = auth != nullptr ? VerifiedPeerCertificate(*auth) : PeerCertificate();
  if (!cert.verified) {
    return absl::PermissionDeniedError(absl::StrCat(
        "node '", options_.name,
        "' serves PeerService to cluster members only, and the caller presented no verified "
        "certificate"));
  }
  // Said whenever a certificate is refused: a common name that names a member is the attempt
  // this refuses.
  const std::string common_name_note =
      cert.common_name.empty() ? std::string()
                               : absl::StrCat("; its common name '", cert.common_name.substr(0, 64),
                                              "' is not an identity");
  if (!cert.has_names()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "node '", options_.name,
        "' serves PeerService to cluster members only, and the caller's certificate has no "
        "subject alternative name (a member is named by a DNS, IP or URI subject alternative "
        "name)",
        common_name_note));
  }
  const std::vector<MemberAddress> peers = options_.membership->Peers();
  // A name of the member first (a DNS name or its MemberUri), then the host of its address (a
  // DNS or IP name), so that members sharing a host are told apart by their names.
  for (const MemberAddress& peer : peers) {
    const std::string uri = MemberUri(peer.name);
    for (const std::string& dns : cert.dns_names) {
      if (dns == peer.name) return Caller{absl::StrCat("member ", peer.name), peer.name};
    }
    for (const std::string& named : cert.uri_names) {
      if (named == uri) return Caller{absl::StrCat("member ", peer.name), peer.name};
    }
  }
  for (const MemberAddress& peer : peers) {
    const std::string host = AddressHost(peer.address);
    for (const std::vector<std::string>* names : {&cert.dns_names, &cert.ip_names}) {
      for (const std::string& name : *names) {
        if (name == host) return Caller{absl::StrCat("member ", peer.name), peer.name};
      }
    }
  }
  std::string listed;
  size_t shown = 0;
  for (const std::vector<std::string>* names : {&cert.dns_names, &cert.ip_names, &cert.uri_names}) {
    for (const std::string& name : *names) {
      if (shown == 4) break;
      absl::StrAppend(&listed, shown++ == 0 ? "" : ", ", "'", name.substr(0, 64), "'");
    }
  }
  return absl::PermissionDeniedError(
      absl::StrCat("node '", options_.name,
                   "' serves PeerService to cluster members only; the caller's certificate's "
                   "subject alternative names are ",
                   listed, ", none of which names a member", common_name_note));
}

absl::Status PeerServiceImpl::CheckSpeaksForItself(const Caller& caller, const std::string& claimed,
                                                   const char* field) {
  if (caller.member.empty() || claimed == caller.member) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      field, " = '", claimed.substr(0, 32), "', but the caller's certificate names member '",
      caller.member, "': a member speaks for itself only"));
}

void PeerServiceImpl::HandleNodeInfo(UnaryCall* call, const v1::NodeInfoRequest* request,
                                     v1::NodeInfoResponse* response) {
  response->set_name(options_.name);
  response->set_backend(options_.backend);
  for (const std::string& t : options_.transports) response->add_transports(t);
  const ProcessInfo& process = ThisProcess();
  response->set_boot_id(process.boot_id);
  response->set_start_time_unix_ms(absl::ToUnixMillis(process.start_time));
  response->set_version(process.version);
  call->Answer(grpc::Status::OK);
}

void PeerServiceImpl::HandleExport(UnaryCall* call, const v1::ExportRequest* request,
                                   v1::ExportResponse* response) {
  absl::StatusOr<Caller> caller = Identify(*call->context());
  if (!caller.ok()) return Refuse(call, caller.status());
  if (absl::Status s = CheckNames({{"cache", request->cache()},
                                   {"tenant", request->tenant()},
                                   {"receiver", request->receiver()},
                                   {"sequence.migration_id", request->sequence().migration_id()}});
      !s.ok()) {
    return Refuse(call, s);
  }
  if (absl::Status s = CheckSpeaksForItself(*caller, request->receiver(), "receiver"); !s.ok()) {
    return Refuse(call, s);
  }
  RunOn(engine_executor_, call,
        [this, request, response, identity = caller->identity]() -> absl::Status {
          absl::StatusOr<v1::ExportResponse> exported = cluster_->Export(*request, identity);
          if (!exported.ok()) return exported.status();
          *response = *std::move(exported);
          return absl::OkStatus();
        });
}

StreamReactor* PeerServiceImpl::StartFetch(StreamCall* call, const grpc::ByteBuffer* request) {
  absl::StatusOr<Caller> caller = Identify(*call->context());
  if (!caller.ok()) return RefuseStream(call, ToGrpcStatus(caller.status()));
  // The lease must be the caller's; ServeFetch parses the request again (a few bytes).
  v1::FetchRequest fetch;
  if (grpc::Status parsed =
          ParseRequest(*request, kMaxPeerRequestBytes, "/kvmesh.v1.PeerService/Fetch", &fetch);
      !parsed.ok()) {
    return RefuseStream(call, std::move(parsed));
  }
  if (absl::Status s = leases_->CheckReceiver(fetch.lease_id(), caller->identity); !s.ok()) {
    return RefuseStream(call, ToGrpcStatus(s));
  }
  return transport::ServeFetch(call, request, leases_, options_.sender);
}

namespace {

// A Release's answer: OK once the export's payload is freed (Cluster::Release's `freed`), an
// error at once, or CANCELLED when the caller goes away (its deadline) first; whichever comes
// first answers, from any thread, and the others find the call gone.
class ReleaseAnswer {
 public:
  explicit ReleaseAnswer(UnaryCall* call) : call_(call) {}

  static void Answer(const std::shared_ptr<ReleaseAnswer>& answer, const grpc::Status& status) {
    UnaryCall* call = nullptr;
    {
      MutexLock lock(&answer->mu_);
      std::swap(call, answer->call_);
    }
    if (call != nullptr) call->Answer(status);
  }

 private:
  Mutex mu_;
  UnaryCall* call_ ABSL_GUARDED_BY(mu_);  // null once answered
};

}  // namespace

void PeerServiceImpl::HandleRelease(UnaryCall* call, const v1::ReleaseRequest* request,
                                    v1::ReleaseResponse* response) {
  // Ending a lease only drops references (cheap enough for gRPC's thread); the answer waits
  // until the export's payload is freed, which a Fetch stream still finishing may delay a
  // little, so that the receiver, and the cluster operation it runs, sees the cells and
  // snapshot chunks the export pinned back on this node.
  absl::StatusOr<Caller> caller = Identify(*call->context());
  if (!caller.ok()) return Refuse(call, caller.status());
  auto answer = std::make_shared<ReleaseAnswer>(call);
  call->NotifyOnCancel([answer] {
    ReleaseAnswer::Answer(answer, grpc::Status(grpc::StatusCode::CANCELLED,
                                               "Release cancelled before the export's memory "
                                               "was freed"));
  });
  const absl::Status released = cluster_->Release(
      *request, caller->identity, [answer] { ReleaseAnswer::Answer(answer, grpc::Status::OK); });
  if (!released.ok()) ReleaseAnswer::Answer(answer, ToGrpcStatus(released));
}

void PeerServiceImpl::HandlePull(UnaryCall* call, const v1::PullRequest* request,
                                 v1::PullResponse* response) {
  absl::StatusOr<Caller> caller = Identify(*call->context());
  if (!caller.ok()) return Refuse(call, caller.status());
  if (absl::Status s = CheckNames({{"cache", request->cache()},
                                   {"tenant", request->tenant()},
                                   {"source_node", request->source_node()},
                                   {"sequence.migration_id", request->sequence().migration_id()}});
      !s.ok()) {
    return Refuse(call, s);
  }
  if (absl::Status s = CheckSpeaksForItself(*caller, request->source_node(), "source_node");
      !s.ok()) {
    return Refuse(call, s);
  }
  grpc::CallbackServerContext* const context = call->context();
  RunOn(cluster_executor_, call, [this, context, request, response]() -> absl::Status {
    absl::StatusOr<v1::PullResponse> pulled =
        cluster_->Pull(*request, cluster_->Deadline(ContextDeadline(*context)));
    if (!pulled.ok()) return pulled.status();
    *response = *std::move(pulled);
    return absl::OkStatus();
  });
}

namespace {

// The interrupt of an nccl hook that serves `context`: the receiver's cancellation (or the
// call's deadline) stops the wait on the communicator instead of leaving it to the deadline.
PeerServiceImpl::Interrupt CancelledBy(grpc::CallbackServerContext* context, const char* rpc) {
  return [context, rpc]() -> absl::Status {
    if (!context->IsCancelled()) return absl::OkStatus();
    return absl::CancelledError(
        absl::StrCat(rpc, ": the receiver cancelled the call or its deadline passed"));
  };
}

}  // namespace

void PeerServiceImpl::NoNccl(UnaryCall* call) const {
  call->Answer(
      grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                   absl::StrCat("node '", options_.name, "' has no nccl transport (backend ",
                                options_.backend, ")")));
}

void PeerServiceImpl::HandleNcclConnect(UnaryCall* call, const v1::NcclConnectRequest* request,
                                        v1::NcclConnectResponse* response) {
  absl::StatusOr<Caller> caller = Identify(*call->context());
  if (!caller.ok()) return Refuse(call, caller.status());
  if (absl::Status s = CheckNameLength("from_node", request->from_node()); !s.ok()) {
    return Refuse(call, s);
  }
  if (absl::Status s = CheckSpeaksForItself(*caller, request->from_node(), "from_node"); !s.ok()) {
    return Refuse(call, s);
  }
  if (!options_.nccl.connect) return NoNccl(call);
  grpc::CallbackServerContext* const context = call->context();
  RunOn(cluster_executor_, call, [this, context, request]() {
    return options_.nccl.connect(*request, cluster_->Deadline(ContextDeadline(*context)),
                                 CancelledBy(context, "NcclConnect"));
  });
}

void PeerServiceImpl::HandleNcclSend(UnaryCall* call, const v1::NcclSendRequest* request,
                                     v1::NcclSendResponse* response) {
  absl::StatusOr<Caller> caller = Identify(*call->context());
  if (!caller.ok()) return Refuse(call, caller.status());
  if (absl::Status s = CheckNameLength("to_node", request->to_node()); !s.ok()) {
    return Refuse(call, s);
  }
  if (absl::Status s = CheckSpeaksForItself(*caller, request->to_node(), "to_node"); !s.ok()) {
    return Refuse(call, s);
  }
  if (absl::Status s = leases_->CheckReceiver(request->lease_id(), caller->identity); !s.ok()) {
    return Refuse(call, s);
  }
  if (!options_.nccl.send) return NoNccl(call);
  grpc::CallbackServerContext* const context = call->context();
  RunOn(cluster_executor_, call, [this, context, request]() {
    return options_.nccl.send(*request, cluster_->Deadline(ContextDeadline(*context)),
                              CancelledBy(context, "NcclSend"));
  });
}

void PeerServiceImpl::HandleRemove(UnaryCall* call, const v1::PeerRemoveRequest* request,
                                   v1::PeerRemoveResponse* response) {
  if (absl::Status s =
          CheckNames({{"remove.cache", request->remove().cache()}, {"tenant", request->tenant()}});
      !s.ok()) {
    return Refuse(call, s);
  }
  RunOn(engine_executor_, call,
        [this, request]() -> absl::Status { return cluster_->RemoveLocal(*request); });
}

void PeerServiceImpl::HandlePlace(UnaryCall* call, const v1::PlaceRequest* request,
                                  v1::PlaceResponse* response) {
  if (absl::Status s =
          CheckNames({{"spec.name", request->spec().name()}, {"tenant", request->tenant()}});
      !s.ok()) {
    return Refuse(call, s);
  }
  RunOn(engine_executor_, call, [this, request, response]() -> absl::Status {
    ASSIGN_OR_RETURN(*response, cluster_->Place(*request));
    return absl::OkStatus();
  });
}

StreamReactor* PeerServiceImpl::StartWatchEvents(StreamCall* call,
                                                 const grpc::ByteBuffer* request) {
  grpc::CallbackServerContext* const context = call->context();
  absl::StatusOr<Caller> caller = Identify(*context);
  absl::StatusOr<Principal> principal = Principal{kDefaultTenant, Role::kAdmin};
  v1::PeerWatchEventsRequest peer_request;
  if (!caller.ok()) {
    principal = caller.status();
  } else if (grpc::Status parsed =
                 ParseRequest(*request, kMaxPeerRequestBytes, "/kvmesh.v1.PeerService/WatchEvents",
                              &peer_request);
             !parsed.ok()) {
    principal = FromGrpcStatus(parsed);
  } else if (options_.events == nullptr || options_.registry == nullptr) {
    principal = absl::FailedPreconditionError("this node keeps no event log");
  } else if (watchers_.stopping.load()) {
    principal = absl::UnavailableError("the node is shutting down");
  }
  v1::WatchEventsRequest watch;
  watch.set_boot_id(peer_request.boot_id());
  watch.set_next(peer_request.next());
  // A peer removed from the membership (or whose certificate no longer names a member) loses
  // its stream within about a second: Identify is asked again at every heartbeat.
  std::function<absl::Status()> still_allowed;
  if (caller.ok()) {
    still_allowed = [this, context] { return Identify(*context).status(); };
  }
  return StartWatch(call, watch, std::move(principal), WatchScope::kAllTenants, options_.registry,
                    options_.events, &watchers_, std::move(still_allowed));
}

void PeerServiceImpl::StopWatchers() { watchers_.Stop(options_.events); }

void PeerServiceImpl::HandleLookupPrefix(UnaryCall* call,
                                         const v1::PeerLookupPrefixRequest* request,
                                         v1::LookupPrefixResponse* response) {
  if (options_.registry == nullptr) {
    return Refuse(call, absl::FailedPreconditionError("this node serves no prefix lookups"));
  }
  if (absl::Status s =
          CheckNames({{"lookup.cache", request->lookup().cache()}, {"tenant", request->tenant()}});
      !s.ok()) {
    return Refuse(call, s);
  }
  RunOn(engine_executor_, call, [this, request, response]() -> absl::Status {
    const v1::LookupPrefixRequest& lookup = request->lookup();
    ASSIGN_OR_RETURN(const int max_matches, LookupMatchCount(lookup.max_matches()));
    ASSIGN_OR_RETURN(const std::shared_ptr<Cache> cache,
                     options_.registry->Get(request->tenant(), lookup.cache()));
    ASSIGN_OR_RETURN(const std::vector<PrefixMatch> matches,
                     cache->LookupPrefix(lookup.tokens(), max_matches));
    AddPrefixMatches(options_.name, matches, response);
    return absl::OkStatus();
  });
}

}  // namespace kvmesh
