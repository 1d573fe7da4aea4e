#include "service/cluster/membership.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cache/status_macros.h"
#include "grpc/grpc.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "service/common/health_client.h"
#include "service/common/log.h"
#include "service/common/process_info.h"

namespace kvmesh {
namespace {

// A peer that restarts must be reachable again quickly: gRPC's default reconnect backoff grows
// to 120 s, during which every call to it fails at once.
constexpr int kInitialReconnectBackoffMs = 100;
constexpr int kMaxReconnectBackoffMs = 2000;

bool IsNameChar(char c) { return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-'; }

bool IsValidName(absl::string_view name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), IsNameChar);
}

struct HostPort {
  std::string host;  // without brackets
  int port = 0;
};

// "host:port", "1.2.3.4:port" or "[v6]:port". `what` names the text in errors.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text, bool allow_port_zero,
                                       absl::string_view what) {
  auto error = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", text, "': ", why));
  };
  HostPort out;
  absl::string_view port_text;
  if (absl::StartsWith(text, "[")) {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos) return error("no ']' after an IPv6 address");
    out.host = std::string(text.substr(1, close - 1));
    in6_addr addr;
    if (inet_pton(AF_INET6, out.host.c_str(), &addr) != 1) {
      return error("not an IPv6 address between the brackets");
    }
    if (text.substr(close + 1, 1) != ":") return error("expected host:port");
    port_text = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) return error("expected host:port");
    out.host = std::string(text.substr(0, colon));
    port_text = text.substr(colon + 1);
    if (out.host.empty()) return error("empty host");
    if (out.host.find(':') != std::string::npos) {
      return error("an IPv6 address needs brackets: [addr]:port");
    }
    if (!std::all_of(out.host.begin(), out.host.end(), IsNameChar)) {
      return error("the host is not a name or an address");
    }
  }
  if (port_text.empty() || !std::all_of(port_text.begin(), port_text.end(), absl::ascii_isdigit)) {
    return error("the port is not a number");
  }
  int port = 0;
  if (port_text.size() > 5 || !absl::SimpleAtoi(port_text, &port) || port > 65535 ||
      (port == 0 && !allow_port_zero)) {
    return error(absl::StrCat("port ", port_text, " is out of range (1..65535)"));
  }
  out.port = port;
  return out;
}

// "ip:port", with brackets for IPv6.
std::string JoinHostPort(const std::string& ip, int port) {
  if (ip.find(':') != std::string::npos) return absl::StrCat("[", ip, "]:", port);
  return absl::StrCat(ip, ":", port);
}

// The numeric form of `addr`, or "" when it has none.
std::string NumericHost(const sockaddr* addr, socklen_t len) {
  char host[NI_MAXHOST];
  if (getnameinfo(addr, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return "";
  return host;
}

// The numeric addresses of this host's interfaces (loopback included).
std::set<std::string> LocalAddresses() {
  std::set<std::string> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (const ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    const socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::string host = NumericHost(i->ifa_addr, len);
    if (!host.empty()) out.insert(std::move(host));
  }
  freeifaddrs(list);
  return out;
}

std::string GaiError(int rc) {
  if (rc == EAI_SYSTEM) return std::strerror(errno);
  return gai_strerror(rc);
}

std::string RpcError(const grpc::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                      ": ", status.error_message());
}

bool ByName(const MemberAddress& a, const MemberAddress& b) { return a.name < b.name; }

}  // namespace

absl::StatusOr<std::vector<MemberAddress>> Membership::ParsePeers(absl::string_view flag) {
  std::vector<MemberAddress> peers;
  if (absl::StripAsciiWhitespace(flag).empty()) return peers;
  std::set<std::string> names;
  for (absl::string_view item : absl::StrSplit(flag, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("empty entry in '", flag, "'"));
    }
    const size_t eq = item.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("entry '", item, "' is not name=host:port (no '=')"));
    }
    const absl::string_view name = absl::StripAsciiWhitespace(item.substr(0, eq));
    const absl::string_view address = absl::StripAsciiWhitespace(item.substr(eq + 1));
    if (name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("entry '", item, "' has an empty name"));
    }
    if (!IsValidName(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "entry '", item, "': name '", name, "' may hold only letters, digits, '.', '_' and '-'"));
    }
    auto host_port = ParseHostPort(address, /*allow_port_zero=*/false,
                                   absl::StrCat("entry '", item, "': address"));
    if (!host_port.ok()) return host_port.status();
    if (!names.insert(std::string(name)).second) {
      return absl::InvalidArgumentError(absl::StrCat("node name '", name, "' is given twice"));
    }
    peers.push_back(MemberAddress{std::string(name), std::string(address)});
  }
  std::sort(peers.begin(), peers.end(), ByName);
  return peers;
}

absl::StatusOr<std::unique_ptr<Membership>> Membership::Create(Options options) {
  if (!IsValidName(options.self_name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("node name '", options.self_name,
                     "' must be non-empty and hold only letters, digits, '.', '_' and '-'"));
  }
  // The node checked its own address when it parsed --listen; gRPC has the last word on it.
  if (options.self_address.empty()) {
    return absl::InvalidArgumentError("membership: this node's address is empty");
  }
  std::set<std::string> names;
  for (const MemberAddress& peer : options.peers) {
    if (!IsValidName(peer.name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--peers: name '", peer.name, "' may hold only letters, digits, '.', '_' and '-'"));
    }
    RETURN_IF_ERROR(ParseHostPort(peer.address, /*allow_port_zero=*/false,
                                  absl::StrCat("--peers: address of '", peer.name, "'"))
                        .status());
    if (peer.name == options.self_name) {
      return absl::InvalidArgumentError(absl::StrCat("--peers: '", peer.name, "=", peer.address,
                                                     "' names this node ('", options.self_name,
                                                     "'); list the other members only"));
    }
    if (!names.insert(peer.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--peers: node name '", peer.name, "' is given twice"));
    }
  }
  HostPort dns;
  if (!options.peer_dns.empty()) {
    if (!options.peers.empty()) {
      return absl::InvalidArgumentError(
          "--peers and --peer-dns are exclusive: list the peers or discover them, not both");
    }
    ASSIGN_OR_RETURN(dns, ParseHostPort(options.peer_dns, /*allow_port_zero=*/false,
                                        "--peer-dns (SERVICE:PORT)"));
  }
  if (options.health_timeout <= absl::ZeroDuration() ||
      options.rediscover_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("membership: health timeout (", absl::FormatDuration(options.health_timeout),
                     ") and rediscover interval (",
                     absl::FormatDuration(options.rediscover_interval), ") must be positive"));
  }
  if (options.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("membership: max message bytes ",
                                                   options.max_message_bytes, " must be positive"));
  }

  std::unique_ptr<Membership> membership(new Membership(std::move(options)));
  if (!membership->options_.peer_dns.empty()) {
    membership->dns_host_ = dns.host;
    membership->dns_port_ = dns.port;
    membership->discovery_ = std::thread([m = membership.get()] { m->DiscoveryLoop(); });
  }
  return membership;
}

Membership::Membership(Options options) : options_(std::move(options)) {
  MutexLock lock(&mu_);
  self_address_ = options_.self_address;
  peers_ = options_.peers;
  std::sort(peers_.begin(), peers_.end(), ByName);
}

Membership::~Membership() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (discovery_.joinable()) discovery_.join();
}

void Membership::SetSelfAddress(std::string address) {
  MutexLock lock(&mu_);
  self_address_ = std::move(address);
}

std::string Membership::self_address() const {
  ReaderMutexLock lock(&mu_);
  return self_address_;
}

absl::StatusOr<MemberAddress> Membership::Find(absl::string_view name) const {
  ReaderMutexLock lock(&mu_);
  if (name == options_.self_name) return MemberAddress{options_.self_name, self_address_};
  auto it =
      std::lower_bound(peers_.begin(), peers_.end(), name,
                       [](const MemberAddress& m, absl::string_view n) { return m.name < n; });
  if (it != peers_.end() && it->name == name) return *it;
  std::vector<std::string> names;
  for (const MemberAddress& peer : peers_) names.push_back(peer.name);
  names.push_back(options_.self_name);
  std::sort(names.begin(), names.end());
  return absl::InvalidArgumentError(absl::StrCat(
      "node '", name, "' is not a member (members: ", absl::StrJoin(names, ", "), ")"));
}

std::vector<MemberAddress> Membership::Peers() const {
  ReaderMutexLock lock(&mu_);
  return peers_;
}

std::shared_ptr<grpc::Channel> Membership::Channel(const MemberAddress& member) {
  MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[member.address];
  if (channel == nullptr) channel = NewChannelLocked(member, /*own_connection=*/false);
  return channel;
}

std::shared_ptr<grpc::Channel> Membership::OwnChannel(const MemberAddress& member) {
  MutexLock lock(&mu_);
  return NewChannelLocked(member, /*own_connection=*/true);
}

std::shared_ptr<grpc::Channel> Membership::NewChannelLocked(const MemberAddress& member,
                                                            bool own_connection) {
  grpc::ChannelArguments args;
  // gRPC shares connections between channels of equal settings; a channel with a subchannel
  // pool of its own has its own connection, and its own reconnection backoff.
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(options_.max_message_bytes);
  args.SetMaxSendMessageSize(options_.max_message_bytes);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kInitialReconnectBackoffMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kMaxReconnectBackoffMs);
  // Retries stay on (gRPC's default): peer requests are small, so the retry buffer costs
  // nothing, and transparent retries cover a call that races a connection's shutdown.
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options_.channel_credentials) {
    // Callers that know only an address (the transports) pass it as the name too: the
    // member's certificate may name the member, so look its name up.
    MemberAddress named{member.name == member.address ? "" : member.name, member.address};
    for (const MemberAddress& peer : peers_) {
      if (named.name.empty() && peer.address == member.address) named.name = peer.name;
    }
    credentials = options_.channel_credentials(named);
  }
  return grpc::CreateCustomChannel(member.address, credentials, args);
}

v1::ListMembersResponse Membership::Describe(absl::Time deadline) {
  deadline = std::min(deadline, absl::Now() + options_.health_timeout);

  // One probe per peer: two calls in flight, answered on gRPC threads.
  struct Probe {
    MemberAddress member;
    grpc::ClientContext health_context;
    grpc::ClientContext info_context;
    std::unique_ptr<v1::PeerService::Stub> stub;
    v1::NodeInfoRequest info_request;
    v1::NodeInfoResponse info_response;
    grpc::Status health_rpc;
    ServingStatus serving = ServingStatus::kUnknown;
    grpc::Status info_rpc;
  };
  std::vector<MemberAddress> peers;
  std::string self_address;
  std::string discovery_detail;
  {
    ReaderMutexLock lock(&mu_);
    peers = peers_;
    self_address = self_address_;
    if (!options_.peer_dns.empty()) {
      if (resolution_applied_ == 0) {
        discovery_detail =
            absl::StrCat("peer discovery (", options_.peer_dns, "): not resolved yet");
      } else if (!last_resolution_.ok()) {
        discovery_detail =
            absl::StrCat("peer discovery: ", last_resolution_.message(), " (",
                         absl::FormatDuration(absl::Trunc(absl::Now() - last_resolution_time_,
                                                          absl::Milliseconds(1))),
                         " ago); keeping the ", peers_.size(), " peers last known");
      }
    }
  }

  std::vector<std::unique_ptr<Probe>> probes;
  // Shared with the callbacks, so that the last one may still be unlocking when this function
  // returns.
  struct Countdown {
    Mutex mu;
    std::condition_variable_any cv;
    size_t pending ABSL_GUARDED_BY(mu) = 0;
  };
  auto countdown = std::make_shared<Countdown>();
  {
    MutexLock lock(&countdown->mu);
    countdown->pending = 2 * peers.size();
  }
  auto finished = [countdown] {
    MutexLock lock(&countdown->mu);
    if (--countdown->pending == 0) countdown->cv.notify_all();
  };
  for (const MemberAddress& peer : peers) {
    auto probe = std::make_unique<Probe>();
    Probe* p = probe.get();
    p->member = peer;
    std::shared_ptr<grpc::Channel> channel = Channel(peer);
    p->health_context.set_deadline(absl::ToChronoTime(deadline));
    p->info_context.set_deadline(absl::ToChronoTime(deadline));
    p->stub = v1::PeerService::NewStub(channel);
    probes.push_back(std::move(probe));
    HealthClient(channel).CheckAsync(&p->health_context, "",
                                     [p, finished](grpc::Status rpc, ServingStatus serving) {
                                       p->health_rpc = std::move(rpc);
                                       p->serving = serving;
                                       finished();
                                     });
    p->stub->async()->NodeInfo(&p->info_context, &p->info_request, &p->info_response,
                               [p, finished](grpc::Status rpc) {
                                 p->info_rpc = std::move(rpc);
                                 finished();
                               });
  }
  {
    MutexLock lock(&countdown->mu);
    while (countdown->pending > 0) countdown->cv.wait(countdown->mu);
  }

  v1::ListMembersResponse response;
  v1::Member* self = response.add_members();
  self->set_name(options_.self_name);
  self->set_address(self_address);
  self->set_self(true);
  self->set_health(v1::MEMBER_HEALTH_SERVING);
  self->set_backend(options_.backend);
  for (const std::string& t : options_.transports) self->add_transports(t);
  self->set_detail(discovery_detail);
  const ProcessInfo& process = ThisProcess();
  self->set_boot_id(process.boot_id);
  self->set_start_time_unix_ms(absl::ToUnixMillis(process.start_time));
  self->set_version(process.version);

  for (const std::unique_ptr<Probe>& p : probes) {
    v1::Member* m = response.add_members();
    m->set_name(p->member.name);
    m->set_address(p->member.address);
    std::vector<std::string> detail;
    if (!p->health_rpc.ok()) {
      m->set_health(v1::MEMBER_HEALTH_UNREACHABLE);
      detail.push_back(RpcError(p->health_rpc));
    } else if (p->serving != ServingStatus::kServing) {
      m->set_health(v1::MEMBER_HEALTH_NOT_SERVING);
      detail.push_back(absl::StrCat("health: ", ServingStatusName(p->serving)));
    } else {
      m->set_health(v1::MEMBER_HEALTH_SERVING);
    }
    if (p->info_rpc.ok()) {
      m->set_backend(p->info_response.backend());
      *m->mutable_transports() = p->info_response.transports();
      m->set_boot_id(p->info_response.boot_id());
      m->set_start_time_unix_ms(p->info_response.start_time_unix_ms());
      m->set_version(p->info_response.version());
      if (p->info_response.name() != p->member.name) {
        detail.push_back(absl::StrCat("answers as node '", p->info_response.name(), "'"));
      }
    } else if (p->health_rpc.ok()) {  // unreachable: the health detail says it already
      detail.push_back(absl::StrCat("NodeInfo: ", RpcError(p->info_rpc)));
    }
    m->set_detail(absl::StrJoin(detail, "; "));
  }
  return response;
}

absl::StatusOr<std::vector<MemberAddress>> Membership::ResolvePeers() const {
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(dns_host_.c_str(), nullptr, &hints, &result);
  if (rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve '", dns_host_, "': ", GaiError(rc)));
  }
  int self_port = -1;
  {
    ReaderMutexLock lock(&mu_);
    auto self = ParseHostPort(self_address_, /*allow_port_zero=*/true, "");
    if (self.ok() && self->port != 0) self_port = self->port;
  }
  const std::set<std::string> local =
      self_port == dns_port_ ? LocalAddresses() : std::set<std::string>();

  std::vector<MemberAddress> peers;
  std::set<std::string> seen_ips;
  std::set<std::string> names;
  for (const addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6) continue;
    const std::string ip = NumericHost(ai->ai_addr, ai->ai_addrlen);
    if (ip.empty() || !seen_ips.insert(ip).second) continue;
    if (local.count(ip) != 0) continue;  // this node: one of our addresses, our port
    char host[NI_MAXHOST];
    std::string name = ip;
    if (getnameinfo(ai->ai_addr, ai->ai_addrlen, host, sizeof(host), nullptr, 0, NI_NAMEREQD) ==
        0) {
      absl::string_view label = absl::string_view(host).substr(0, std::strcspn(host, "."));
      if (!label.empty()) name = std::string(label);
    }
    if (name == options_.self_name) continue;
    // Two addresses of one name (a host's IPv4 and IPv6 addresses): the resolver's first.
    if (!names.insert(name).second) continue;
    peers.push_back(MemberAddress{name, JoinHostPort(ip, dns_port_)});
  }
  freeaddrinfo(result);
  std::sort(peers.begin(), peers.end(), ByName);
  return peers;
}

absl::Status Membership::Rediscover() {
  if (options_.peer_dns.empty()) {
    return absl::FailedPreconditionError("no --peer-dns: the peers are static");
  }
  uint64_t number;
  {
    MutexLock lock(&mu_);
    number = ++resolutions_started_;
  }
  absl::StatusOr<std::vector<MemberAddress>> peers = ResolvePeers();
  MutexLock lock(&mu_);
  if (number < resolution_applied_) return peers.status();  // a later one was applied
  const bool first = resolution_applied_ == 0;
  resolution_applied_ = number;
  last_resolution_time_ = absl::Now();
  // Log changes only: a resolution every few seconds must not flood the log.
  if (!peers.ok()) {
    if (first || last_resolution_.ok() || last_resolution_ != peers.status()) {
      Log(LogLevel::kWarning, absl::StrCat("peer discovery: ", peers.status().message(),
                                           "; keeping ", peers_.size(), " peers"));
    }
    last_resolution_ = peers.status();
    return last_resolution_;
  }
  last_resolution_ = absl::OkStatus();
  if (first || *peers != peers_) {
    std::vector<std::string> listed;
    for (const MemberAddress& p : *peers) listed.push_back(absl::StrCat(p.name, "=", p.address));
    Log(LogLevel::kInfo, absl::StrCat("peers from ", options_.peer_dns, ": ",
                                      listed.empty() ? "(none)" : absl::StrJoin(listed, ",")));
    // Channels to addresses that left (a restarted pod has a new IP) are dropped from the cache;
    // a caller holding one keeps it.
    std::set<std::string> addresses;
    for (const MemberAddress& p : *peers) addresses.insert(p.address);
    for (auto it = channels_.begin(); it != channels_.end();) {
      it = addresses.count(it->first) == 0 ? channels_.erase(it) : std::next(it);
    }
    peers_ = *std::move(peers);
  }
  return absl::OkStatus();
}

void Membership::DiscoveryLoop() {
  while (true) {
    Rediscover().IgnoreError();  // recorded for Describe
    MutexLock lock(&mu_);
    const auto wake_at =
        std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(options_.rediscover_interval);
    while (!stopping_ && std::chrono::steady_clock::now() < wake_at) {
      wake_.wait_until(mu_, wake_at);
    }
    if (stopping_) return;
  }
}

}  // namespace kvmesh
