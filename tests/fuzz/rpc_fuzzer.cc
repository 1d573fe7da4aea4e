// Fuzz target: the RPCs of kvmesh.v1.CacheService and kvmesh.v1.PeerService (all but the
// WatchEvents streams and CacheService.Drain), with requests built from the input
// (rpc_format.h), through the real services of two nodes that run in this process (node "a",
// called; node "b", its peer: CopyPrefix from b, Migrate to b, Pull and Export between them move
// real payloads over loopback), so that authentication, validation, the conversions of
// service/common/convert.cc, the cluster machinery and the engine all see them. Each CacheService
// call is made by one of several principals (rpc_format.h, Principal): the admin, tenants t1 and
// t2, and callers who must be refused.
//
// Every session starts from the same state (rpc_format.h, BaselineCaches). After each call:
//  - no INTERNAL, UNKNOWN, DATA_LOSS, UNIMPLEMENTED or DEADLINE_EXCEEDED (the harness allows a
//    minute per call: nothing here takes that long), and every error has a message of at most
//    kMaxErrorMessage bytes (an echoed request field must be cut);
//  - a caller without a valid token is UNAUTHENTICATED, a tenant naming another tenant is
//    PERMISSION_DENIED, whatever the request;
//  - no call changes the caches of a tenant other than the one it acts for, on either node;
//  - a refused call changed nothing, except where the contract allows it (an Append refused for
//    lack of cells may have pruned a sliding window); a successful one changed node b only if it
//    was a cluster operation that goes there;
//  - a successful call's response is well-formed and agrees with the engine: specs convert
//    back, lists hold the caller's caches only and are sorted, Read returns exactly the engine's
//    header and bytes in chunks within max_chunk_bytes, Visible the engine's answer, Fetch
//    contiguous chunks whose CRC-32C match, usage and snapshot and sequence listings what the
//    engine reports, ListMembers hides the operators' details from tenants.
// After each session: every lease granted is released and no other is left, and once the
// caches are deleted every device byte and every in-flight byte is back.
//
// KVMESH_FUZZ_VERBOSE=1 prints every call and its status. KVMESH_FUZZ_RELEASE_LAG_MS=N frees a
// released export's payload N ms late (LeaseTable::set_testing_release_lag), as gRPC may when it
// ends a Fetch stream, and checks after each call that moved a payload that nothing changes
// once the lag is over: the call answered with its source consistent.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/cache.h"
#include "cache/cache_registry.h"
#include "cache/device/host_device.h"
#include "google/protobuf/message.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "service/auth.h"
#include "service/cache_service.h"
#include "service/cluster/cluster.h"
#include "service/cluster/leases.h"
#include "service/cluster/membership.h"
#include "service/cluster/reservations.h"
#include "service/common/convert.h"
#include "service/executor.h"
#include "service/inflight_budget.h"
#include "service/list_pages.h"
#include "service/peer_service.h"
#include "tests/fuzz/fuzz_support.h"
#include "tests/fuzz/rpc_format.h"
#include "transport/checksum.h"
#include "transport/grpc_stream_transport.h"

namespace kvmesh {
namespace fuzz {
namespace {

using google::protobuf::Message;
using google::protobuf::util::MessageDifferencer;

constexpr int kMaxMessage = 4 << 20;
constexpr absl::Duration kCallDeadline = absl::Seconds(60);
// The longest error message accepted: enough for any message about one field, too little for
// one that echoes a long name or payload whole.
constexpr size_t kMaxErrorMessage = 1024;

// The tenants of the token file, and the tokens (random enough for a test: the file holds only
// their SHA-256).
constexpr const char* kTenants[] = {"default", "t1", "t2"};
constexpr char kAdminToken[] = "fuzz-admin-9b1c3e0f5a7d4e2b8c6a1f0e3d5b7a9c";
constexpr char kTenant1Token[] = "fuzz-t1-4f2e8d6c0b9a7e5d3c1b0a9f8e7d6c5b";
constexpr char kTenant2Token[] = "fuzz-t2-1a3c5e7f9b0d2f4a6c8e0b2d4f6a8c0e";

struct Caller {
  const char* name;
  const char* token;   // null: no authorization metadata
  const char* act_as;  // kvmesh-tenant, or null
  const char* tenant;  // the tenant the calls act for; null: every call must be refused
  bool admin;
  grpc::StatusCode refusal;  // the code of every call when tenant is null
};
// Indexed by Principal.
constexpr Caller kCallers[kPrincipalCount] = {
    {"admin", kAdminToken, nullptr, "default", true, grpc::StatusCode::OK},
    {"t1", kTenant1Token, nullptr, "t1", false, grpc::StatusCode::OK},
    {"t2", kTenant2Token, nullptr, "t2", false, grpc::StatusCode::OK},
    {"anonymous", nullptr, nullptr, nullptr, false, grpc::StatusCode::UNAUTHENTICATED},
    {"unknown token", "fuzz-not-a-listed-token", nullptr, nullptr, false,
     grpc::StatusCode::UNAUTHENTICATED},
    {"t1 as default", kTenant1Token, "default", nullptr, false,
     grpc::StatusCode::PERMISSION_DENIED},
    {"admin as t1", kAdminToken, "t1", "t1", true, grpc::StatusCode::OK},
};
// PeerService calls come from node b, which sends no token: the peer plane knows its callers by
// their address (their certificate with TLS), and each request names its tenant.
constexpr Caller kPeerCaller = {"node b", nullptr, nullptr, "default", true, grpc::StatusCode::OK};

// A free TCP port on 127.0.0.1 (bound and released; the node binds it right after).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) Fail("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    Fail("cannot bind a port on 127.0.0.1");
  }
  close(fd);
  return ntohs(addr.sin_port);
}

// One kvmesh node, wired as kvmesh-node wires it (service/node_main.cc) with a token file and a
// peer plane of its own (--peer-listen, plaintext on loopback): CacheService on a server that
// the harness reaches in-process, PeerService on 127.0.0.1:port, the address the other node
// knows it by.
// KVMESH_FUZZ_RELEASE_LAG_MS: how much later than its lease's release a node frees an export's
// payload (LeaseTable::set_testing_release_lag); 0 without it.
absl::Duration ReleaseLag() {
  const char* lag = std::getenv("KVMESH_FUZZ_RELEASE_LAG_MS");
  return lag == nullptr ? absl::ZeroDuration() : absl::Milliseconds(std::atoi(lag));
}

class Node {
 public:
  Node(std::string name, int port, std::string peer_name, int peer_port, const Authenticator* auth)
      : name_(std::move(name)),
        address_(absl::StrCat("127.0.0.1:", port)),
        device_(16 << 20, 8 << 20),
        registry_(&device_),
        executor_(2, 64),
        cluster_executor_(2, 64),
        transfer_reads_(1, 64),
        inflight_(8 << 20, "--inflight-budget") {
    Membership::Options m;
    m.self_name = name_;
    m.self_address = address_;
    m.transports = {transport::kGrpcStream};
    m.peers = {MemberAddress{peer_name, absl::StrCat("127.0.0.1:", peer_port)}};
    m.health_timeout = absl::Seconds(5);
    m.max_message_bytes = kMaxMessage;
    absl::StatusOr<std::unique_ptr<Membership>> membership = Membership::Create(std::move(m));
    KVMESH_FUZZ_CHECK(membership.ok(), membership.status().ToString());
    membership_ = *std::move(membership);
    transport::GrpcStreamTransport::Options stream;
    stream.max_receive_message = kMaxMessage;
    Membership* const members = membership_.get();
    grpc_stream_ = std::make_unique<transport::GrpcStreamTransport>(
        [members](const std::string& address) {
          return members->Channel(MemberAddress{address, address});
        },
        stream);
    // As kvmesh-node: a sequence under migration is neither evicted nor expired.
    registry_.SetEvictionFilterFactory([this](const std::string& tenant, const std::string& cache) {
      return [this, key = Reservations::Key(tenant, cache)](int64_t seq) {
        return !reservations_.IsReserved(Reservations::Kind::kSequence, key, seq);
      };
    });
    Cluster::Options c;
    c.self_name = name_;
    c.quota = [auth](const std::string& tenant) { return auth->Quota(tenant); };
    cluster_ = std::make_unique<Cluster>(
        c, &registry_, membership_.get(), &leases_, &reservations_,
        std::map<std::string, transport::Transport*>{{transport::kGrpcStream, grpc_stream_.get()}});
    CacheServiceImpl::Options s;
    s.max_send_message_bytes = kMaxMessage;
    s.cluster = cluster_.get();
    s.cluster_executor = &cluster_executor_;
    s.auth = auth;
    s.inflight = &inflight_;
    service_ = std::make_unique<CacheServiceImpl>(&registry_, &executor_, s);
    PeerServiceImpl::Options p;
    p.name = name_;
    p.membership = membership_.get();
    p.backend = device_.name();
    p.transports = {transport::kGrpcStream};
    p.registry = &registry_;
    p.sender.max_chunk_bytes = kMaxMessage / 2;
    p.sender.run_read = [this](std::function<void()> read) {
      if (transfer_reads_.Submit(std::move(read))) return absl::OkStatus();
      return absl::UnavailableError("the transfer read queue is full");
    };
    peer_service_ = std::make_unique<PeerServiceImpl>(cluster_.get(), &leases_, &executor_,
                                                      &cluster_executor_, p);
    leases_.set_testing_release_lag(ReleaseLag());
  }

  void Start() {
    auto configure = [](grpc::ServerBuilder& builder) {
      builder.SetMaxReceiveMessageSize(kMaxMessage);
      builder.SetMaxSendMessageSize(kMaxMessage);
      builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    };
    grpc::ServerBuilder builder;
    configure(builder);
    builder.RegisterService(service_.get());
    builder.RegisterCallbackGenericService(service_->request_gate());
    server_ = builder.BuildAndStart();
    KVMESH_FUZZ_CHECK(server_ != nullptr, "cannot start the client server");
    grpc::ServerBuilder peer_builder;
    configure(peer_builder);
    int bound = 0;
    peer_builder.AddListeningPort(address_, grpc::InsecureServerCredentials(), &bound);
    peer_builder.RegisterCallbackGenericService(peer_service_->request_gate());
    peer_server_ = peer_builder.BuildAndStart();
    KVMESH_FUZZ_CHECK(peer_server_ != nullptr && bound != 0,
                      absl::StrCat("cannot listen on ", address_));
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessage);
    args.SetMaxSendMessageSize(kMaxMessage);
    stub_ = v1::CacheService::NewStub(server_->InProcessChannel(args));
    // The peer plane is called over the network, from 127.0.0.1, as the other node calls it.
    peer_stub_ = v1::PeerService::NewStub(
        grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args));
  }

  // Stops serving and joins every thread the node started.
  void Stop() {
    stub_.reset();
    peer_stub_.reset();
    const auto deadline = absl::ToChronoTime(absl::Now() + absl::Seconds(5));
    server_->Shutdown(deadline);
    peer_server_->Shutdown(deadline);
    executor_.Shutdown();
    cluster_executor_.Shutdown();
    transfer_reads_.Shutdown();
    server_->Wait();
    peer_server_->Wait();
  }

  const std::string& name() const { return name_; }
  CacheRegistry& registry() { return registry_; }
  LeaseTable& leases() { return leases_; }
  v1::CacheService::Stub& stub() { return *stub_; }
  v1::PeerService::Stub& peer_stub() { return *peer_stub_; }

  // The caches of `tenant` as text: equal digests, equal caches.
  std::string Digest(absl::string_view tenant) const {
    std::string out;
    for (const std::shared_ptr<Cache>& cache : registry_.List(tenant)) {
      absl::StrAppend(&out, "== ", tenant, "/", cache->spec().name, "\n", CacheDigest(*cache),
                      "\n");
    }
    return out;
  }

  // Deletes every cache and waits until the device and the in-flight budget have every byte
  // back.
  void Clear() {
    for (const CacheRegistry::Entry& e : registry_.ListAll()) {
      const absl::Status deleted = registry_.Delete(e.tenant, e.cache->spec().name);
      KVMESH_FUZZ_CHECK(deleted.ok(), deleted.ToString());
    }
    // An executor task (or the sender's side of a finished Fetch) may still hold a cache's
    // data for a moment after its call has ended.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (device_.used_bytes(MemoryPool::kCache) != 0 ||
           device_.used_bytes(MemoryPool::kSnapshot) != 0 || inflight_.held() != 0) {
      KVMESH_FUZZ_CHECK(
          absl::Now() < deadline,
          absl::StrCat("node ", name_, " keeps ", device_.used_bytes(MemoryPool::kCache),
                       " cache and ", device_.used_bytes(MemoryPool::kSnapshot),
                       " snapshot bytes and ", inflight_.held(),
                       " in-flight bytes with no cache and no lease"));
      absl::SleepFor(absl::Milliseconds(1));
    }
  }

  // The caches and data of rpc_format.h's baseline.
  void Populate() {
    std::map<std::string, v1::CacheSpec> specs;
    for (const v1::CacheSpec& s : BaselineSpecs()) specs[s.name()] = s;
    for (const BaselineCache& c : BaselineCaches()) {
      absl::StatusOr<CacheSpec> spec = SpecFromProto(specs.at(c.name));
      KVMESH_FUZZ_CHECK(spec.ok(), spec.status().ToString());
      absl::StatusOr<CacheRegistry::CreateResult> created =
          registry_.Create(c.tenant, *spec, TenantQuota());
      KVMESH_FUZZ_CHECK(created.ok(), created.status().ToString());
    }
    for (const BaselineSequence& s : BaselineSequences()) {
      absl::StatusOr<std::shared_ptr<Cache>> cache = registry_.Get(s.tenant, s.cache);
      KVMESH_FUZZ_CHECK(cache.ok(), cache.status().ToString());
      std::vector<Token> tokens;
      for (int32_t p = s.begin; p < s.end; ++p) {
        tokens.push_back(Token{s.seq, p, BaselineTokenId(p)});
      }
      const std::string payload =
          PrefillPayload((*cache)->spec(), static_cast<int32_t>(tokens.size()),
                         static_cast<uint8_t>(s.seq + 1 + 16 * (s.tenant != "default")));
      const absl::Status appended = (*cache)->Append(
          tokens,
          absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()));
      KVMESH_FUZZ_CHECK(appended.ok(), appended.ToString());
      if (s.seq == 0) {
        const absl::Status snapshot = (*cache)->Snapshot(0, 0).status();
        KVMESH_FUZZ_CHECK(snapshot.ok(), snapshot.ToString());
      }
    }
  }

 private:
  const std::string name_;
  const std::string address_;
  // Declared in the order node_main.cc gives them, so they are destroyed in the reverse order.
  HostDevice device_;
  CacheRegistry registry_;
  Executor executor_;
  Executor cluster_executor_;
  Executor transfer_reads_;
  InflightBudget inflight_;
  std::unique_ptr<Membership> membership_;
  LeaseTable leases_;
  Reservations reservations_;
  std::unique_ptr<transport::GrpcStreamTransport> grpc_stream_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<CacheServiceImpl> service_;
  std::unique_ptr<PeerServiceImpl> peer_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> peer_server_;
  std::unique_ptr<v1::CacheService::Stub> stub_;
  std::unique_ptr<v1::PeerService::Stub> peer_stub_;
};

bool IsBug(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::DATA_LOSS:
    case grpc::StatusCode::UNIMPLEMENTED:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return true;
    default:
      return false;
  }
}

bool IsPeerRpc(Rpc rpc) { return static_cast<int>(rpc) >= static_cast<int>(Rpc::kNodeInfo); }

std::string Show(const Message& m) {
  std::string text = m.ShortDebugString();
  if (text.size() > 2000) text = absl::StrCat(text.substr(0, 2000), "...");
  return text;
}

// Each of the node's tenants' digests.
std::map<std::string, std::string> Digests(const Node& node) {
  std::map<std::string, std::string> out;
  for (const char* tenant : kTenants) out[tenant] = node.Digest(tenant);
  return out;
}

class Harness {
 public:
  static Harness& Get() {
    static Harness* const harness = [] {
      // Bytes that are not UTF-8 in a string field fail to parse (the session ends there, as a
      // server refuses them); protobuf would log every one of them.
      google::protobuf::SetLogHandler(nullptr);
      grpc::EnableDefaultHealthCheckService(true);
      auto* h = new Harness();
      // Stopped before the static objects of gRPC and Abseil go, which the nodes' threads use.
      std::atexit([] { Get().Stop(); });
      return h;
    }();
    return *harness;
  }

  void RunSession(const uint8_t* data, size_t size) {
    a_->Clear();
    b_->Clear();
    a_->Populate();
    b_->Populate();
    leases_.clear();
    size_t at = 0;
    for (size_t record = 0; record < kMaxRecords && at < size; ++record) {
      const uint8_t first = data[at++];
      const Rpc rpc = static_cast<Rpc>(first % kRpcCount);
      const Caller& caller = kCallers[(first / kRpcCount) % kPrincipalCount];
      size_t length = 0;
      if (at < size) length = data[at++];
      if (at < size) length |= size_t{data[at++]} << 8;
      length = std::min(length, size - at);
      const std::string bytes(reinterpret_cast<const char*>(data + at), length);
      at += length;
      if (!Call(rpc, IsPeerRpc(rpc) ? kPeerCaller : caller, bytes)) break;
    }
    EndSession();
  }

 private:
  Harness() {
    // The token file both nodes read.
    char path[] = "/tmp/kvmesh-fuzz-tokens-XXXXXX";
    const int fd = mkstemp(path);
    KVMESH_FUZZ_CHECK(fd >= 0, "mkstemp");
    close(fd);
    token_file_ = path;
    {
      std::ofstream file(token_file_, std::ios::trunc);
      file << "token sha256:" << Sha256Hex(kAdminToken) << " default admin\n"
           << "token sha256:" << Sha256Hex(kTenant1Token) << " t1 tenant\n"
           << "token sha256:" << Sha256Hex(kTenant2Token) << " t2 tenant\n"
           << "quota t2 caches=1 bytes=64KiB\n";
      KVMESH_FUZZ_CHECK(file.good(), token_file_);
    }
    Authenticator::Options options;
    options.token_file = token_file_;
    options.reload_interval = absl::Hours(1);
    absl::StatusOr<std::unique_ptr<Authenticator>> auth = Authenticator::Create(options);
    KVMESH_FUZZ_CHECK(auth.ok(), auth.status().ToString());
    auth_ = *std::move(auth);
    const int port_a = FreePort();
    const int port_b = FreePort();
    a_ = std::make_unique<Node>(kNodeA, port_a, kNodeB, port_b, auth_.get());
    b_ = std::make_unique<Node>(kNodeB, port_b, kNodeA, port_a, auth_.get());
    a_->Start();
    b_->Start();
  }

  void Stop() {
    a_->Stop();
    b_->Stop();
    a_.reset();
    b_.reset();
    auth_.reset();
    std::remove(token_file_.c_str());
  }

  // Releases the leases the session was granted; then no lease may be left on either node.
  void EndSession() {
    for (const std::string& id : leases_) {
      v1::ReleaseRequest request;
      request.set_lease_id(id);
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
      v1::ReleaseResponse response;
      const grpc::Status status = a_->peer_stub().Release(&context, request, &response);
      KVMESH_FUZZ_CHECK(status.ok() || status.error_code() == grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("Release of lease ", id, ": ", status.error_message()));
    }
    leases_.clear();
    KVMESH_FUZZ_CHECK(a_->leases().size() == 0 && b_->leases().size() == 0,
                      absl::StrCat(a_->leases().size(), " leases left on a, ", b_->leases().size(),
                                   " on b, none of them granted to this session"));
  }

  // The lease id of a Fetch, Release or NcclSend: an id of at most two bytes stands for the
  // index of one of the leases granted in this session, so that the fuzzer reaches leases it
  // could never guess (they are 128-bit random).
  template <typename Request>
  void MapLease(Request* request) {
    const std::string& id = request->lease_id();
    if (leases_.empty() || id.size() > 2) return;
    size_t index = 0;
    for (char c : id) index = index * 256 + static_cast<uint8_t>(c);
    request->set_lease_id(leases_[index % leases_.size()]);
  }

  static void Authorize(const Caller& caller, grpc::ClientContext* context) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
    if (caller.token != nullptr) {
      context->AddMetadata(kAuthorizationMetadata, absl::StrCat("Bearer ", caller.token));
    }
    if (caller.act_as != nullptr) context->AddMetadata(kTenantMetadata, caller.act_as);
  }

  void CheckStatus(Rpc rpc, const Caller& caller, const Message& request,
                   const grpc::Status& status) {
    const std::string call = absl::StrCat(RpcName(rpc), "(", Show(request), ") by ", caller.name);
    KVMESH_FUZZ_CHECK(
        !IsBug(status.error_code()),
        absl::StrCat(call, " answered ", status.error_code(), ": ", status.error_message()));
    // Every RPC, the streams included, judges its caller before anything the caller sent.
    if (caller.tenant == nullptr) {
      KVMESH_FUZZ_CHECK(status.error_code() == caller.refusal,
                        absl::StrCat(call, " answered ", status.error_code(), " (",
                                     status.error_message(), "), not ", caller.refusal));
    }
    if (status.ok()) return;
    KVMESH_FUZZ_CHECK(
        !status.error_message().empty(),
        absl::StrCat(call, " failed with code ", status.error_code(), " and no message"));
    KVMESH_FUZZ_CHECK(
        status.error_message().size() <= kMaxErrorMessage,
        absl::StrCat(call, " failed with a ", status.error_message().size(),
                     "-byte message: ", status.error_message().substr(0, 300), "..."));
  }

  // Whether a refused call may still have changed its tenant's caches on node a: an Append
  // refused for lack of cells may have pruned sliding windows to look for them
  // (docs/semantics.md, "Decisions where the contract is silent").
  static bool MayChangeWhenRefused(Rpc rpc, grpc::StatusCode code) {
    return (rpc == Rpc::kAppend || rpc == Rpc::kAppendStream) &&
           code == grpc::StatusCode::RESOURCE_EXHAUSTED;
  }

  // Whether a successful call may change node b.
  static bool ChangesPeer(Rpc rpc, const Message& request) {
    if (rpc == Rpc::kMigrate || rpc == Rpc::kMigrateSnapshot) return true;
    if (rpc == Rpc::kRemove) {
      return static_cast<const v1::RemoveRequest&>(request).scope() == v1::REMOVE_SCOPE_CLUSTER;
    }
    return false;
  }

  // The tenant a peer-plane request names (a PeerService call acts for the tenant it carries).
  static std::string PeerTenant(Rpc rpc, const Message& request) {
    const google::protobuf::FieldDescriptor* f = request.GetDescriptor()->FindFieldByName("tenant");
    std::string tenant = f == nullptr ? "" : request.GetReflection()->GetString(request, f);
    return tenant.empty() ? kDefaultTenant : tenant;
  }

  // Calls `call` (which sends `request` and checks a successful response) with the checks
  // every call gets.
  bool Checked(Rpc rpc, const Caller& caller, const Message& request,
               const std::function<grpc::Status()>& call) {
    const std::map<std::string, std::string> before_a = Digests(*a_);
    const std::map<std::string, std::string> before_b = Digests(*b_);
    const grpc::Status status = call();
    if (verbose_) {
      std::fprintf(stderr, "%s(%s) by %s -> %d %s\n", RpcName(rpc), Show(request).c_str(),
                   caller.name, static_cast<int>(status.error_code()),
                   status.error_message().c_str());
    }
    CheckStatus(rpc, caller, request, status);
    // The tenant whose caches the call may change.
    std::string acting = caller.tenant == nullptr ? "" : caller.tenant;
    if (IsPeerRpc(rpc)) acting = PeerTenant(rpc, request);
    const std::map<std::string, std::string> after_a = Digests(*a_);
    const std::map<std::string, std::string> after_b = Digests(*b_);
    for (const char* tenant : kTenants) {
      const bool own = tenant == acting;
      const bool a_may_change =
          own && (status.ok() || MayChangeWhenRefused(rpc, status.error_code()));
      const bool b_may_change = own && status.ok() && ChangesPeer(rpc, request);
      const std::string call = absl::StrCat(
          RpcName(rpc), "(", Show(request), ") by ", caller.name, " ended ", status.error_code(),
          " (", status.error_message(), ") and changed tenant ", tenant, "'s caches on node ");
      if (!a_may_change) {
        KVMESH_FUZZ_CHECK(after_a.at(tenant) == before_a.at(tenant),
                          absl::StrCat(call, "a:\n--- before\n", before_a.at(tenant), "--- after\n",
                                       after_a.at(tenant)));
      }
      if (!b_may_change) {
        KVMESH_FUZZ_CHECK(after_b.at(tenant) == before_b.at(tenant),
                          absl::StrCat(call, "b:\n--- before\n", before_b.at(tenant), "--- after\n",
                                       after_b.at(tenant)));
      }
    }
    // With a release lag, a call that moved a payload is looked at again once every lagging
    // payload would have been freed: nothing may change after the call answered (the source of a
    // Migrate, MigrateSnapshot or CopyPrefix is consistent when the caller sees OK).
    if (release_lag_ > absl::ZeroDuration() && status.ok() &&
        (rpc == Rpc::kMigrate || rpc == Rpc::kMigrateSnapshot || rpc == Rpc::kCopyPrefix ||
         rpc == Rpc::kPull || rpc == Rpc::kRelease)) {
      absl::SleepFor(release_lag_ + absl::Milliseconds(250));  // the lease table's tick: 100 ms
      const std::map<std::string, std::string> settled_a = Digests(*a_);
      const std::map<std::string, std::string> settled_b = Digests(*b_);
      for (const char* tenant : kTenants) {
        const std::string call =
            absl::StrCat(RpcName(rpc), "(", Show(request), ") by ", caller.name,
                         " answered OK, then tenant ", tenant, "'s caches changed on node ");
        KVMESH_FUZZ_CHECK(settled_a.at(tenant) == after_a.at(tenant),
                          absl::StrCat(call, "a:\n--- answered\n", after_a.at(tenant),
                                       "--- later\n", settled_a.at(tenant)));
        KVMESH_FUZZ_CHECK(settled_b.at(tenant) == after_b.at(tenant),
                          absl::StrCat(call, "b:\n--- answered\n", after_b.at(tenant),
                                       "--- later\n", settled_b.at(tenant)));
      }
    }
    return true;
  }

  template <typename Request, typename Response, typename Stub>
  bool Unary(Rpc rpc, const Caller& caller, const std::string& bytes, Stub& stub,
             grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
             const std::function<void(const Request&, const Response&)>& check) {
    Request request;
    if (!request.ParseFromString(bytes)) return false;
    if constexpr (std::is_same_v<Request, v1::FetchRequest> ||
                  std::is_same_v<Request, v1::ReleaseRequest> ||
                  std::is_same_v<Request, v1::NcclSendRequest>) {
      MapLease(&request);
    }
    return Checked(rpc, caller, request, [&] {
      grpc::ClientContext context;
      Authorize(caller, &context);
      Response response;
      const grpc::Status status = (stub.*method)(&context, request, &response);
      if (status.ok() && check) check(request, response);
      return status;
    });
  }

  std::shared_ptr<Cache> CacheOf(Node& node, const std::string& tenant, const std::string& name) {
    absl::StatusOr<std::shared_ptr<Cache>> cache = node.registry().Get(tenant, name);
    KVMESH_FUZZ_CHECK(cache.ok(),
                      absl::StrCat("cache '", name, "' of ", tenant,
                                   " after a successful call: ", cache.status().ToString()));
    return *cache;
  }

  // A local lookup's answer is the engine's: the same sequences in the same order, each named
  // with the node, verified, and holding exactly the prompt's first `length` ids.
  void CheckMatches(Node& node, const std::string& tenant, const v1::LookupPrefixRequest& q,
                    const v1::LookupPrefixResponse& r) {
    const std::shared_ptr<Cache> cache = CacheOf(node, tenant, q.cache());
    const int32_t max_matches = q.max_matches() == 0 ? 1 : q.max_matches();
    absl::StatusOr<std::vector<PrefixMatch>> expected =
        cache->LookupPrefix(q.tokens(), max_matches);
    KVMESH_FUZZ_CHECK(
        expected.ok(),
        absl::StrCat(Show(q), " answered, the engine: ", expected.status().ToString()));
    KVMESH_FUZZ_CHECK(
        static_cast<size_t>(r.matches_size()) == expected->size() && r.unverified_size() == 0,
        absl::StrCat(Show(r), " for ", expected->size(), " matches"));
    for (int i = 0; i < r.matches_size(); ++i) {
      const v1::PrefixMatch& m = r.matches(i);
      const PrefixMatch& e = (*expected)[i];
      KVMESH_FUZZ_CHECK(m.node() == node.name() && m.seq() == e.seq && m.length() == e.length &&
                            m.offset() == e.offset && m.can_resume() == e.can_resume &&
                            m.verified() && m.length() > 0 && m.length() <= q.tokens_size(),
                        Show(r));
      const std::optional<SequenceInfo> info = cache->GetSequence(m.seq());
      KVMESH_FUZZ_CHECK(info.has_value() && info->exact_tokens >= m.length(),
                        absl::StrCat(Show(r), ": sequence ", m.seq(), " holds fewer exact ids"));
    }
  }

  // A Read of `seq` of cache `name` up to `end` as text (header and bytes), or nullopt when the
  // cache is not there, has other than Attention groups (whose copies and moves carry exactly
  // the positions below the length; rings and states follow rules of their own), or the
  // sequence has pending tokens (which a Read shows and a copy does not take).
  std::optional<std::string> ReadText(Node& node, const std::string& tenant,
                                      const std::string& name, int64_t seq,
                                      std::optional<int32_t> end) {
    absl::StatusOr<std::shared_ptr<Cache>> cache = node.registry().Get(tenant, name);
    if (!cache.ok()) return std::nullopt;
    for (const GroupSpec& g : (*cache)->spec().groups) {
      if (g.kind != GroupKind::kAttention) return std::nullopt;
    }
    for (const SequenceInfo& info : (*cache)->ListSequences()) {
      if (info.seq == seq && info.pending > 0) return std::nullopt;
    }
    if (seq < 0 || (end.has_value() && *end < 0)) return std::nullopt;
    absl::StatusOr<ReadResult> read = (*cache)->Read(seq, 0, end);
    if (!read.ok()) {
      return absl::StrCat("no data (", absl::StatusCodeToString(read.status().code()), ")");
    }
    std::string out = ReadHeaderToProto(*read).SerializeAsString();
    // A sequence that stores nothing below `end` reads as one that stores nothing at all.
    bool empty = true;
    for (const auto& p : read->positions) empty &= p.empty();
    if (empty && read->payload.empty()) return std::string("no data (NOT_FOUND)");
    return absl::StrCat(out.size(), ":", out, read->payload);
  }

  // The wire image of snapshot `id` of cache `name`, or nullopt.
  std::optional<std::string> ExportImage(Node& node, const std::string& tenant,
                                         const std::string& name, uint64_t id) {
    absl::StatusOr<std::shared_ptr<Cache>> cache = node.registry().Get(tenant, name);
    if (!cache.ok()) return std::nullopt;
    absl::StatusOr<std::unique_ptr<SnapshotExportReader>> reader = (*cache)->OpenSnapshotExport(id);
    if (!reader.ok()) return std::nullopt;
    std::string image((*reader)->size(), '\0');
    const absl::Status read = (*reader)->ReadAt(
        0, absl::MakeSpan(reinterpret_cast<uint8_t*>(image.data()), image.size()));
    KVMESH_FUZZ_CHECK(read.ok(), read.ToString());
    return image;
  }

  void CheckSpec(const v1::CacheSpec& spec) {
    const absl::Status valid = SpecFromProto(spec).status();
    KVMESH_FUZZ_CHECK(valid.ok(), absl::StrCat("a spec in a response: ", valid.ToString()));
  }

  void CheckSnapshotListed(Node& node, const std::string& tenant, const std::string& cache,
                           const v1::SnapshotInfo& info, bool listed) {
    bool found = false;
    for (const SnapshotInfo& s : CacheOf(node, tenant, cache)->ListSnapshots()) {
      if (s.id != info.id()) continue;
      found = true;
      KVMESH_FUZZ_CHECK(MessageDifferencer::Equals(SnapshotInfoToProto(s), info),
                        absl::StrCat(Show(SnapshotInfoToProto(s)), " vs ", Show(info)));
    }
    KVMESH_FUZZ_CHECK(found == listed, absl::StrCat("snapshot ", info.id(), " of '", cache, "' on ",
                                                    node.name(), " listed: ", found));
  }

  void CheckRead(const std::string& tenant, const v1::ReadRequest& request,
                 const std::vector<v1::ReadResponse>& messages) {
    KVMESH_FUZZ_CHECK(!messages.empty() && messages[0].has_header(), "Read without a header");
    const int64_t limit = request.max_chunk_bytes() > 0 ? request.max_chunk_bytes() : 1 << 20;
    std::string data;
    for (size_t i = 0; i < messages.size(); ++i) {
      KVMESH_FUZZ_CHECK(i == 0 || !messages[i].has_header(), absl::StrCat("header in message ", i));
      KVMESH_FUZZ_CHECK(static_cast<int64_t>(messages[i].data().size()) <= limit,
                        absl::StrCat(messages[i].data().size(), "-byte chunk, limit ", limit));
      data += messages[i].data();
    }
    const v1::ReadHeader& header = messages[0].header();
    KVMESH_FUZZ_CHECK(header.payload_bytes() == static_cast<int64_t>(data.size()),
                      absl::StrCat(header.payload_bytes(), " announced, ", data.size(), " sent"));
    std::optional<int32_t> end;
    if (request.has_end()) end = request.end();
    absl::StatusOr<ReadResult> expected =
        CacheOf(*a_, tenant, request.cache())->Read(request.seq(), request.begin(), end);
    KVMESH_FUZZ_CHECK(expected.ok(), expected.status().ToString());
    KVMESH_FUZZ_CHECK(
        MessageDifferencer::Equals(ReadHeaderToProto(*expected), header),
        absl::StrCat(Show(header), " vs the engine's ", Show(ReadHeaderToProto(*expected))));
    KVMESH_FUZZ_CHECK(expected->payload == data, "Read's bytes differ from the engine's");
  }

  bool Call(Rpc rpc, const Caller& caller, const std::string& bytes) {
    v1::CacheService::Stub& s = a_->stub();
    v1::PeerService::Stub& p = a_->peer_stub();
    using S = v1::CacheService::Stub;
    using P = v1::PeerService::Stub;
    // The tenant a successful CacheService call acted for.
    const std::string t = caller.tenant == nullptr ? "" : caller.tenant;
    switch (rpc) {
      case Rpc::kCreateCache:
        return Unary<v1::CreateCacheRequest, v1::CreateCacheResponse>(
            rpc, caller, bytes, s, &S::CreateCache,
            [&](const v1::CreateCacheRequest& q, const v1::CreateCacheResponse& r) {
              CheckSpec(r.cache().spec());
              absl::StatusOr<CacheSpec> asked = SpecFromProto(q.spec());
              absl::StatusOr<CacheSpec> got = SpecFromProto(r.cache().spec());
              KVMESH_FUZZ_CHECK(
                  asked.ok() && got.ok() && *asked == *got,
                  absl::StrCat(Show(q.spec()), " created as ", Show(r.cache().spec())));
              KVMESH_FUZZ_CHECK(r.cache().tenant() == t, Show(r));
              CacheOf(*a_, t, q.spec().name());
            });
      case Rpc::kDeleteCache:
        return Unary<v1::DeleteCacheRequest, v1::DeleteCacheResponse>(
            rpc, caller, bytes, s, &S::DeleteCache,
            [&](const v1::DeleteCacheRequest& q, const v1::DeleteCacheResponse&) {
              KVMESH_FUZZ_CHECK(!a_->registry().Get(t, q.cache()).ok(), q.cache());
            });
      case Rpc::kGetCache:
        return Unary<v1::GetCacheRequest, v1::GetCacheResponse>(
            rpc, caller, bytes, s, &S::GetCache,
            [&](const v1::GetCacheRequest& q, const v1::GetCacheResponse& r) {
              CheckSpec(r.cache().spec());
              KVMESH_FUZZ_CHECK(r.cache().spec().name() == q.cache() && r.cache().tenant() == t,
                                Show(r));
              KVMESH_FUZZ_CHECK(
                  MessageDifferencer::Equals(r.cache().usage(),
                                             UsageToProto(CacheOf(*a_, t, q.cache())->Usage())),
                  Show(r));
            });
      case Rpc::kListCaches:
        return Unary<v1::ListCachesRequest, v1::ListCachesResponse>(
            rpc, caller, bytes, s, &S::ListCaches,
            [&](const v1::ListCachesRequest& q, const v1::ListCachesResponse& r) {
              // A tenant's caches; an admin naming no tenant lists every tenant's (docs/api.md),
              // ordered by tenant, then name; one page of them (docs/api.md#paging).
              std::vector<std::pair<std::string, std::string>> expected;
              if (caller.admin && caller.act_as == nullptr) {
                for (const CacheRegistry::Entry& e : a_->registry().ListAll()) {
                  expected.emplace_back(e.tenant, e.cache->spec().name);
                }
              } else {
                for (const std::shared_ptr<Cache>& c : a_->registry().List(t)) {
                  expected.emplace_back(t, c->spec().name);
                }
              }
              std::sort(expected.begin(), expected.end());
              if (!q.page_token().empty()) {
                const absl::StatusOr<CacheKey> after = ParseCachePageToken(q.page_token());
                KVMESH_FUZZ_CHECK(after.ok(), "a page token the node took does not parse");
                const std::pair<std::string, std::string> key(after->tenant, after->name);
                expected.erase(expected.begin(),
                               std::upper_bound(expected.begin(), expected.end(), key));
              }
              const absl::StatusOr<size_t> page =
                  PageSize(q.page_size(), kDefaultCachePageSize, kMaxCachePageSize);
              KVMESH_FUZZ_CHECK(page.ok(), "a page size the node took is refused");
              const bool more = expected.size() > *page;
              if (more) expected.resize(*page);
              KVMESH_FUZZ_CHECK(r.next_page_token().empty() != more, Show(r));
              std::vector<std::pair<std::string, std::string>> listed;
              for (const v1::CacheInfo& info : r.caches()) {
                CheckSpec(info.spec());
                listed.emplace_back(info.tenant(), info.spec().name());
              }
              KVMESH_FUZZ_CHECK(listed == expected, absl::StrCat(Show(r), " for ", caller.name));
            });
      case Rpc::kAppend:
        return Unary<v1::AppendRequest, v1::AppendResponse>(
            rpc, caller, bytes, s, &S::Append,
            [&](const v1::AppendRequest& q, const v1::AppendResponse& r) {
              KVMESH_FUZZ_CHECK(MessageDifferencer::Equals(
                                    r.usage(), UsageToProto(CacheOf(*a_, t, q.cache())->Usage())),
                                Show(r));
            });
      case Rpc::kAppendStream: {
        // The stream's messages, each [2 bytes: length][AppendStreamRequest].
        std::vector<v1::AppendStreamRequest> stream;
        size_t at = 0;
        while (at < bytes.size()) {
          size_t n = static_cast<uint8_t>(bytes[at++]);
          if (at < bytes.size()) n |= size_t{static_cast<uint8_t>(bytes[at++])} << 8;
          n = std::min(n, bytes.size() - at);
          v1::AppendStreamRequest m;
          if (!m.ParseFromArray(bytes.data() + at, static_cast<int>(n))) return false;
          at += n;
          stream.push_back(std::move(m));
        }
        v1::AppendStreamRequest shown;  // for messages: the header
        if (!stream.empty()) shown = stream[0];
        shown.clear_data();
        return Checked(rpc, caller, shown, [&] {
          grpc::ClientContext context;
          Authorize(caller, &context);
          v1::AppendResponse response;
          std::unique_ptr<grpc::ClientWriter<v1::AppendStreamRequest>> writer =
              s.AppendStream(&context, &response);
          for (const v1::AppendStreamRequest& m : stream) {
            if (!writer->Write(m)) break;  // the server ended the call; Finish says why
          }
          writer->WritesDone();
          const grpc::Status status = writer->Finish();
          if (status.ok()) {
            KVMESH_FUZZ_CHECK(!stream.empty() && stream[0].has_header(), "AppendStream accepted");
            KVMESH_FUZZ_CHECK(
                MessageDifferencer::Equals(
                    response.usage(),
                    UsageToProto(CacheOf(*a_, t, stream[0].header().cache())->Usage())),
                Show(response));
          }
          return status;
        });
      }
      case Rpc::kRead: {
        v1::ReadRequest request;
        if (!request.ParseFromString(bytes)) return false;
        return Checked(rpc, caller, request, [&] {
          grpc::ClientContext context;
          Authorize(caller, &context);
          std::unique_ptr<grpc::ClientReader<v1::ReadResponse>> reader = s.Read(&context, request);
          std::vector<v1::ReadResponse> messages;
          v1::ReadResponse m;
          while (reader->Read(&m)) messages.push_back(std::move(m));
          const grpc::Status status = reader->Finish();
          if (status.ok()) CheckRead(t, request, messages);
          return status;
        });
      }
      case Rpc::kVisible:
        return Unary<v1::VisibleRequest, v1::VisibleResponse>(
            rpc, caller, bytes, s, &S::Visible,
            [&](const v1::VisibleRequest& q, const v1::VisibleResponse& r) {
              absl::StatusOr<std::vector<Query>> queries = QueriesFromProto(q.queries());
              KVMESH_FUZZ_CHECK(queries.ok(), queries.status().ToString());
              absl::StatusOr<std::vector<std::vector<int32_t>>> expected =
                  CacheOf(*a_, t, q.cache())->Visible(q.group(), *queries);
              KVMESH_FUZZ_CHECK(expected.ok(), expected.status().ToString());
              KVMESH_FUZZ_CHECK(static_cast<size_t>(r.visible_size()) == expected->size(),
                                r.visible_size());
              for (int i = 0; i < r.visible_size(); ++i) {
                const v1::Visibility& v = r.visible(i);
                std::vector<int32_t> got(v.positions().begin(), v.positions().end());
                if (q.as_ranges()) {
                  // Ranges instead of positions: ascending, maximal, and the same positions.
                  KVMESH_FUZZ_CHECK(got.empty(), Show(v));
                  int64_t after = -2;  // the last position of the range before
                  for (const v1::PositionRange& range : v.ranges()) {
                    KVMESH_FUZZ_CHECK(range.first() <= range.last() && range.first() > after + 1,
                                      absl::StrCat("query ", i, ": ", Show(v)));
                    for (int64_t p = range.first(); p <= range.last(); ++p) {
                      got.push_back(static_cast<int32_t>(p));
                    }
                    after = range.last();
                  }
                } else {
                  KVMESH_FUZZ_CHECK(v.ranges().empty(), Show(v));
                }
                KVMESH_FUZZ_CHECK(got == (*expected)[i], absl::StrCat("query ", i, ": ", Show(v)));
              }
            });
      case Rpc::kCopyPrefix:
        return Unary<v1::CopyPrefixRequest, v1::CopyPrefixResponse>(
            rpc, caller, bytes, s, &S::CopyPrefix,
            [&](const v1::CopyPrefixRequest& q, const v1::CopyPrefixResponse&) {
              // dst holds src's positions below length, with their bytes, whichever node src
              // is on.
              Node& source = q.source_node() == kNodeB ? *b_ : *a_;
              const std::optional<std::string> want =
                  ReadText(source, t, q.cache(), q.src_seq(), q.length());
              if (!want.has_value()) return;
              KVMESH_FUZZ_CHECK(ReadText(*a_, t, q.cache(), q.dst_seq(), std::nullopt) == want,
                                absl::StrCat(Show(q), ": dst differs from src's prefix"));
            });
      case Rpc::kRemove:
        return Unary<v1::RemoveRequest, v1::RemoveResponse>(
            rpc, caller, bytes, s, &S::Remove,
            [&](const v1::RemoveRequest& q, const v1::RemoveResponse& r) {
              if (q.scope() != v1::REMOVE_SCOPE_CLUSTER) return;
              KVMESH_FUZZ_CHECK(
                  r.nodes_size() == 2 && r.nodes(0).node() == kNodeA && r.nodes(1).node() == kNodeB,
                  Show(r));
              for (const v1::NodeResult& n : r.nodes()) {
                KVMESH_FUZZ_CHECK(!IsBug(static_cast<grpc::StatusCode>(n.code())), Show(r));
              }
            });
      case Rpc::kCanResume:
        return Unary<v1::CanResumeRequest, v1::CanResumeResponse>(rpc, caller, bytes, s,
                                                                  &S::CanResume, nullptr);
      case Rpc::kListSequences:
        return Unary<v1::ListSequencesRequest, v1::ListSequencesResponse>(
            rpc, caller, bytes, s, &S::ListSequences,
            [&](const v1::ListSequencesRequest& q, const v1::ListSequencesResponse& r) {
              // One page of the sequences, by id, from the page token's (docs/api.md#paging).
              std::vector<SequenceInfo> expected = CacheOf(*a_, t, q.cache())->ListSequences();
              std::sort(expected.begin(), expected.end(),
                        [](const SequenceInfo& x, const SequenceInfo& y) { return x.seq < y.seq; });
              if (!q.page_token().empty()) {
                const absl::StatusOr<int64_t> first = ParseSequencePageToken(q.page_token());
                KVMESH_FUZZ_CHECK(first.ok(), "a page token the node took does not parse");
                expected.erase(
                    std::remove_if(expected.begin(), expected.end(),
                                   [&](const SequenceInfo& i) { return i.seq < *first; }),
                    expected.end());
              }
              const absl::StatusOr<size_t> page =
                  PageSize(q.page_size(), kDefaultSequencePageSize, kMaxSequencePageSize);
              KVMESH_FUZZ_CHECK(page.ok(), "a page size the node took is refused");
              const bool more = expected.size() > *page;
              if (more) expected.resize(*page);
              KVMESH_FUZZ_CHECK(r.next_page_token().empty() != more, Show(r));
              KVMESH_FUZZ_CHECK(static_cast<size_t>(r.sequences_size()) == expected.size(),
                                Show(r));
              for (int i = 0; i < r.sequences_size(); ++i) {
                // Everything but the time since the last use, which the two read at other times.
                v1::SequenceInfo got = r.sequences(i);
                v1::SequenceInfo want = SequenceInfoToProto(expected[i]);
                got.clear_idle_ms();
                want.clear_idle_ms();
                KVMESH_FUZZ_CHECK(MessageDifferencer::Equals(got, want), Show(r));
              }
            });
      case Rpc::kSnapshot:
        return Unary<v1::SnapshotRequest, v1::SnapshotResponse>(
            rpc, caller, bytes, s, &S::Snapshot,
            [&](const v1::SnapshotRequest& q, const v1::SnapshotResponse& r) {
              KVMESH_FUZZ_CHECK(
                  r.snapshot().id() > 0 && r.snapshot().from_offset() < r.snapshot().to_offset(),
                  Show(r));
              CheckSnapshotListed(*a_, t, q.cache(), r.snapshot(), true);
            });
      case Rpc::kRestore:
        return Unary<v1::RestoreRequest, v1::RestoreResponse>(rpc, caller, bytes, s, &S::Restore,
                                                              nullptr);
      case Rpc::kMergeSnapshots:
        return Unary<v1::MergeSnapshotsRequest, v1::MergeSnapshotsResponse>(
            rpc, caller, bytes, s, &S::MergeSnapshots,
            [&](const v1::MergeSnapshotsRequest& q, const v1::MergeSnapshotsResponse& r) {
              CheckSnapshotListed(*a_, t, q.cache(), r.snapshot(), true);
              v1::SnapshotInfo gone;
              gone.set_id(q.parent());
              CheckSnapshotListed(*a_, t, q.cache(), gone, false);
              gone.set_id(q.child());
              CheckSnapshotListed(*a_, t, q.cache(), gone, false);
            });
      case Rpc::kSplitSnapshot:
        return Unary<v1::SplitSnapshotRequest, v1::SplitSnapshotResponse>(
            rpc, caller, bytes, s, &S::SplitSnapshot,
            [&](const v1::SplitSnapshotRequest& q, const v1::SplitSnapshotResponse& r) {
              if (r.has_parent()) CheckSnapshotListed(*a_, t, q.cache(), r.parent(), true);
              if (r.has_child()) CheckSnapshotListed(*a_, t, q.cache(), r.child(), true);
              v1::SnapshotInfo gone;
              gone.set_id(q.snapshot_id());
              CheckSnapshotListed(*a_, t, q.cache(), gone, false);
            });
      case Rpc::kDropSnapshot:
        return Unary<v1::DropSnapshotRequest, v1::DropSnapshotResponse>(
            rpc, caller, bytes, s, &S::DropSnapshot,
            [&](const v1::DropSnapshotRequest& q, const v1::DropSnapshotResponse&) {
              v1::SnapshotInfo gone;
              gone.set_id(q.snapshot_id());
              CheckSnapshotListed(*a_, t, q.cache(), gone, false);
            });
      case Rpc::kListSnapshots:
        return Unary<v1::ListSnapshotsRequest, v1::ListSnapshotsResponse>(
            rpc, caller, bytes, s, &S::ListSnapshots,
            [&](const v1::ListSnapshotsRequest& q, const v1::ListSnapshotsResponse& r) {
              // One page of the snapshots, by id, from the page token's.
              std::vector<SnapshotInfo> expected = CacheOf(*a_, t, q.cache())->ListSnapshots();
              std::sort(expected.begin(), expected.end(),
                        [](const SnapshotInfo& x, const SnapshotInfo& y) { return x.id < y.id; });
              if (!q.page_token().empty()) {
                const absl::StatusOr<uint64_t> first = ParseSnapshotPageToken(q.page_token());
                KVMESH_FUZZ_CHECK(first.ok(), "a page token the node took does not parse");
                expected.erase(std::remove_if(expected.begin(), expected.end(),
                                              [&](const SnapshotInfo& i) { return i.id < *first; }),
                               expected.end());
              }
              const absl::StatusOr<size_t> page =
                  PageSize(q.page_size(), kDefaultSnapshotPageSize, kMaxSnapshotPageSize);
              KVMESH_FUZZ_CHECK(page.ok(), "a page size the node took is refused");
              const bool more = expected.size() > *page;
              if (more) expected.resize(*page);
              KVMESH_FUZZ_CHECK(r.next_page_token().empty() != more, Show(r));
              KVMESH_FUZZ_CHECK(static_cast<size_t>(r.snapshots_size()) == expected.size(),
                                Show(r));
              for (int i = 0; i < r.snapshots_size(); ++i) {
                KVMESH_FUZZ_CHECK(
                    MessageDifferencer::Equals(r.snapshots(i), SnapshotInfoToProto(expected[i])),
                    Show(r));
              }
            });
      case Rpc::kCommitSpeculation:
        return Unary<v1::CommitSpeculationRequest, v1::CommitSpeculationResponse>(
            rpc, caller, bytes, s, &S::CommitSpeculation,
            [&](const v1::CommitSpeculationRequest& q, const v1::CommitSpeculationResponse& r) {
              int32_t offset = 0;
              for (const SequenceInfo& info : CacheOf(*a_, t, q.cache())->ListSequences()) {
                if (info.seq == q.seq()) offset = info.offset;
              }
              KVMESH_FUZZ_CHECK(r.offset() == offset, absl::StrCat(Show(r), " vs ", offset));
            });
      case Rpc::kMigrate: {
        // What the sequence holds before it moves, to compare with what arrives.
        v1::MigrateRequest peek;
        std::optional<std::string> before;
        std::optional<SequenceInfo> kept;  // and how long it is kept
        if (peek.ParseFromString(bytes) && caller.tenant != nullptr) {
          before = ReadText(*a_, t, peek.cache(), peek.seq(), std::nullopt);
          if (absl::StatusOr<std::shared_ptr<Cache>> c = a_->registry().Get(t, peek.cache());
              c.ok()) {
            kept = (*c)->GetSequence(peek.seq());
          }
        }
        return Unary<v1::MigrateRequest, v1::MigrateResponse>(
            rpc, caller, bytes, s, &S::Migrate,
            [&](const v1::MigrateRequest& q, const v1::MigrateResponse&) {
              const std::optional<SequenceInfo> moved =
                  CacheOf(*b_, t, q.cache())->GetSequence(q.target_seq());
              KVMESH_FUZZ_CHECK(
                  kept.has_value() && moved.has_value() && moved->priority == kept->priority &&
                      moved->pinned == kept->pinned && moved->ttl == kept->ttl,
                  absl::StrCat(Show(q), ": the target sequence is not kept as the source was"));
              if (!before.has_value()) return;
              KVMESH_FUZZ_CHECK(ReadText(*b_, t, q.cache(), q.target_seq(), std::nullopt) == before,
                                absl::StrCat(Show(q),
                                             ": the target sequence differs from the "
                                             "migrated one"));
              if (!q.keep_source()) {
                KVMESH_FUZZ_CHECK(!CacheOf(*a_, t, q.cache())->Read(q.seq(), 0, std::nullopt).ok(),
                                  absl::StrCat(Show(q), ": the source still holds the sequence"));
              }
            });
      }
      case Rpc::kMigrateSnapshot: {
        // The snapshot's wire image before it moves: the target's copy has the same one.
        v1::MigrateSnapshotRequest peek;
        std::optional<std::string> before;
        if (peek.ParseFromString(bytes) && caller.tenant != nullptr) {
          before = ExportImage(*a_, t, peek.cache(), peek.snapshot_id());
        }
        return Unary<v1::MigrateSnapshotRequest, v1::MigrateSnapshotResponse>(
            rpc, caller, bytes, s, &S::MigrateSnapshot,
            [&](const v1::MigrateSnapshotRequest& q, const v1::MigrateSnapshotResponse& r) {
              CheckSnapshotListed(*b_, t, q.cache(), r.snapshot(), true);
              KVMESH_FUZZ_CHECK(
                  before.has_value() && ExportImage(*b_, t, q.cache(), r.snapshot().id()) == before,
                  absl::StrCat(Show(q), ": the target's snapshot ", r.snapshot().id(),
                               " is not the source's"));
              v1::SnapshotInfo source;
              source.set_id(q.snapshot_id());
              if (!q.keep_source()) CheckSnapshotListed(*a_, t, q.cache(), source, false);
            });
      }
      case Rpc::kListMembers:
        return Unary<v1::ListMembersRequest, v1::ListMembersResponse>(
            rpc, caller, bytes, s, &S::ListMembers,
            [&](const v1::ListMembersRequest&, const v1::ListMembersResponse& r) {
              KVMESH_FUZZ_CHECK(r.members_size() == 2 && r.members(0).self() &&
                                    r.members(0).name() == kNodeA && r.members(1).name() == kNodeB,
                                Show(r));
              if (caller.admin) return;
              // Where nodes are and what they run on are the operators' details.
              for (const v1::Member& m : r.members()) {
                KVMESH_FUZZ_CHECK(m.address().empty() && m.backend().empty() &&
                                      m.transports().empty() && m.detail().empty(),
                                  absl::StrCat(Show(r), " for tenant ", t));
              }
            });
      case Rpc::kReserve:
        return Unary<v1::ReserveRequest, v1::ReserveResponse>(
            rpc, caller, bytes, s, &S::Reserve,
            [&](const v1::ReserveRequest& q, const v1::ReserveResponse& r) {
              KVMESH_FUZZ_CHECK(MessageDifferencer::Equals(
                                    r.usage(), UsageToProto(CacheOf(*a_, t, q.cache())->Usage())),
                                Show(r));
            });
      case Rpc::kSetRetention:
        return Unary<v1::SetRetentionRequest, v1::SetRetentionResponse>(
            rpc, caller, bytes, s, &S::SetRetention,
            [&](const v1::SetRetentionRequest& q, const v1::SetRetentionResponse& r) {
              const std::optional<SequenceInfo> info =
                  CacheOf(*a_, t, q.cache())->GetSequence(q.seq());
              KVMESH_FUZZ_CHECK(info.has_value(), absl::StrCat(Show(q), ": no such sequence"));
              KVMESH_FUZZ_CHECK(info->priority == q.priority() && info->pinned == q.pinned() &&
                                    info->ttl == absl::Milliseconds(q.ttl_ms()),
                                absl::StrCat(Show(q), ": the sequence is kept otherwise"));
              v1::SequenceInfo got = r.sequence();
              v1::SequenceInfo want = SequenceInfoToProto(*info);
              got.clear_idle_ms();
              want.clear_idle_ms();
              KVMESH_FUZZ_CHECK(MessageDifferencer::Equals(got, want), Show(r));
            });
      case Rpc::kLookupPrefix:
        return Unary<v1::LookupPrefixRequest, v1::LookupPrefixResponse>(
            rpc, caller, bytes, s, &S::LookupPrefix,
            [&](const v1::LookupPrefixRequest& q, const v1::LookupPrefixResponse& r) {
              // The harness's nodes keep no cluster index: a cluster lookup is refused.
              KVMESH_FUZZ_CHECK(q.scope() == v1::LOOKUP_SCOPE_LOCAL, Show(q));
              CheckMatches(*a_, t, q, r);
            });
      case Rpc::kNodeInfo:
        return Unary<v1::NodeInfoRequest, v1::NodeInfoResponse>(
            rpc, caller, bytes, p, &P::NodeInfo,
            [&](const v1::NodeInfoRequest&, const v1::NodeInfoResponse& r) {
              KVMESH_FUZZ_CHECK(r.name() == kNodeA, Show(r));
            });
      case Rpc::kExport:
        return Unary<v1::ExportRequest, v1::ExportResponse>(
            rpc, caller, bytes, p, &P::Export,
            [&](const v1::ExportRequest&, const v1::ExportResponse& r) {
              KVMESH_FUZZ_CHECK(r.empty() == r.lease_id().empty(), Show(r));
              if (r.empty()) return;
              KVMESH_FUZZ_CHECK(r.payload_bytes() > 0, Show(r));
              leases_.push_back(r.lease_id());
            });
      case Rpc::kFetch: {
        v1::FetchRequest request;
        if (!request.ParseFromString(bytes)) return false;
        MapLease(&request);
        return Checked(rpc, caller, request, [&] {
          grpc::ClientContext context;
          context.set_deadline(absl::ToChronoTime(absl::Now() + kCallDeadline));
          std::unique_ptr<grpc::ClientReader<v1::Chunk>> reader = p.Fetch(&context, request);
          int64_t next = request.offset();
          v1::Chunk chunk;
          while (reader->Read(&chunk)) {
            KVMESH_FUZZ_CHECK(chunk.offset() == next,
                              absl::StrCat("chunk at ", chunk.offset(), ", expected ", next));
            KVMESH_FUZZ_CHECK(chunk.has_crc32c(), "chunk without a CRC-32C");
            const std::string& data = chunk.data();
            KVMESH_FUZZ_CHECK(
                chunk.crc32c() == transport::Crc32c(absl::MakeConstSpan(
                                      reinterpret_cast<const uint8_t*>(data.data()), data.size())),
                absl::StrCat("chunk at ", chunk.offset(), " fails its CRC-32C"));
            next += static_cast<int64_t>(data.size());
          }
          return reader->Finish();
        });
      }
      case Rpc::kRelease:
        return Unary<v1::ReleaseRequest, v1::ReleaseResponse>(rpc, caller, bytes, p, &P::Release,
                                                              nullptr);
      case Rpc::kPull:
        return Unary<v1::PullRequest, v1::PullResponse>(
            rpc, caller, bytes, p, &P::Pull,
            [&](const v1::PullRequest& q, const v1::PullResponse& r) {
              if (q.what_case() == v1::PullRequest::kSnapshotId) {
                CheckSnapshotListed(*a_, PeerTenant(rpc, q), q.cache(), r.snapshot(), true);
              }
            });
      case Rpc::kNcclConnect:
        return Unary<v1::NcclConnectRequest, v1::NcclConnectResponse>(rpc, caller, bytes, p,
                                                                      &P::NcclConnect, nullptr);
      case Rpc::kNcclSend:
        return Unary<v1::NcclSendRequest, v1::NcclSendResponse>(rpc, caller, bytes, p, &P::NcclSend,
                                                                nullptr);
      case Rpc::kPeerRemove:
        return Unary<v1::PeerRemoveRequest, v1::PeerRemoveResponse>(rpc, caller, bytes, p,
                                                                    &P::Remove, nullptr);
      case Rpc::kPeerLookupPrefix:
        return Unary<v1::PeerLookupPrefixRequest, v1::LookupPrefixResponse>(
            rpc, caller, bytes, p, &P::LookupPrefix,
            [&](const v1::PeerLookupPrefixRequest& q, const v1::LookupPrefixResponse& r) {
              CheckMatches(*a_, PeerTenant(rpc, q), q.lookup(), r);
            });
      case Rpc::kPlace:
        return Unary<v1::PlaceRequest, v1::PlaceResponse>(
            rpc, caller, bytes, p, &P::Place,
            [&](const v1::PlaceRequest& q, const v1::PlaceResponse& r) {
              // What it says of the cache is what the node holds.
              absl::StatusOr<std::shared_ptr<Cache>> cache =
                  a_->registry().Get(PeerTenant(rpc, q), q.spec().name());
              KVMESH_FUZZ_CHECK(
                  r.exists() == cache.ok() && (!r.created() || r.exists()) && !r.draining(),
                  Show(r));
              if (!r.exists()) return;
              std::vector<int64_t> live;
              for (const SequenceInfo& info : (*cache)->ListSequences()) live.push_back(info.seq);
              KVMESH_FUZZ_CHECK(std::vector<int64_t>(r.seqs().begin(), r.seqs().end()) == live,
                                Show(r));
            });
    }
    return false;
  }

  // KVMESH_FUZZ_VERBOSE=1: print every call and its status (to see what an input does).
  const bool verbose_ = std::getenv("KVMESH_FUZZ_VERBOSE") != nullptr;
  const absl::Duration release_lag_ = ReleaseLag();
  std::string token_file_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<Node> a_;
  std::unique_ptr<Node> b_;
  std::vector<std::string> leases_;  // granted by a's Export in this session
};

}  // namespace
}  // namespace fuzz
}  // namespace kvmesh

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvmesh::fuzz::Harness::Get().RunSession(data, size);
  return 0;
}
