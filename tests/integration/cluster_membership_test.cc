// Membership against real gRPC servers on loopback: Describe's health checks (serving, not
// serving, refused, silent, misnamed, not a kvmesh node), their deadline and parallelism, and
// DNS discovery of "localhost:PORT".
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "kvmesh/v1/kvmesh.grpc.pb.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "service/cluster/membership.h"

namespace kvmesh {
namespace {

using ::testing::AnyOf;
using ::testing::ElementsAre;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::StartsWith;

// A gRPC server with the health service and, unless told otherwise, a PeerService that answers
// NodeInfo (every other method is UNIMPLEMENTED).
class FakePeer final : public v1::PeerService::CallbackService {
 public:
  struct Options {
    std::string name;
    std::string backend = "host";
    std::vector<std::string> transports = {"grpc-stream"};
    bool peer_service = true;
    std::string listen = "127.0.0.1:0";
  };

  explicit FakePeer(Options options) : options_(std::move(options)) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options_.listen, grpc::InsecureServerCredentials(), &port_);
    // A server needs one service besides health: without PeerService, a CacheService whose
    // methods are all UNIMPLEMENTED.
    if (options_.peer_service) {
      builder.RegisterService(this);
    } else {
      builder.RegisterService(&other_);
    }
    server_ = builder.BuildAndStart();
  }
  ~FakePeer() override { server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1))); }

  bool ok() const { return server_ != nullptr && port_ != 0; }
  int port() const { return port_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  void SetServing(bool serving) { server_->GetHealthCheckService()->SetServingStatus(serving); }

  grpc::ServerUnaryReactor* NodeInfo(grpc::CallbackServerContext* context,
                                     const v1::NodeInfoRequest*,
                                     v1::NodeInfoResponse* response) override {
    response->set_name(options_.name);
    response->set_backend(options_.backend);
    for (const std::string& t : options_.transports) response->add_transports(t);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  const Options options_;
  v1::CacheService::CallbackService other_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// FakePeer options: a PeerService answering as `name`.
FakePeer::Options Peer(std::string name, std::string listen = "127.0.0.1:0") {
  FakePeer::Options options;
  options.name = std::move(name);
  options.listen = std::move(listen);
  return options;
}

// A TCP port on 127.0.0.1 held by a socket: `listening` accepts connections (into the backlog;
// nothing ever answers on them: a frozen peer), otherwise connections are refused.
class HeldPort {
 public:
  explicit HeldPort(bool listening) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
        (listening && listen(fd_, 16) != 0)) {
      return;
    }
    port_ = ntohs(addr.sin_port);
  }
  ~HeldPort() {
    if (fd_ >= 0) close(fd_);
  }
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;

  int port() const { return port_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
};

std::unique_ptr<Membership> MakeMembership(std::vector<MemberAddress> peers,
                                           absl::Duration health_timeout = absl::Seconds(5)) {
  Membership::Options options;
  options.self_name = "a";
  options.self_address = "127.0.0.1:7700";
  options.backend = "cuda:0";
  options.transports = {"grpc-stream", "nccl"};
  options.peers = std::move(peers);
  options.health_timeout = health_timeout;
  auto membership = Membership::Create(std::move(options));
  EXPECT_TRUE(membership.ok()) << membership.status();
  return membership.ok() ? *std::move(membership) : nullptr;
}

TEST(DescribeTest, ServingNotServingAndUnreachable) {
  FakePeer::Options b_options = Peer("b");
  b_options.backend = "cuda:3";
  b_options.transports = {"grpc-stream", "nccl"};
  FakePeer b(b_options);
  FakePeer c(Peer("c"));
  ASSERT_TRUE(b.ok() && c.ok());
  c.SetServing(false);
  HeldPort refused(/*listening=*/false);
  ASSERT_NE(refused.port(), 0);

  auto membership = MakeMembership(
      {{"d", refused.address()}, {"c", c.address()}, {"b", b.address()}}, absl::Seconds(10));
  ASSERT_NE(membership, nullptr);
  const absl::Time start = absl::Now();
  v1::ListMembersResponse response = membership->Describe(absl::Now() + absl::Seconds(10));
  // A refused connection is reported at once, not at the deadline.
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));

  ASSERT_EQ(response.members_size(), 4) << response.DebugString();
  const v1::Member& self = response.members(0);
  EXPECT_EQ(self.name(), "a");
  EXPECT_EQ(self.address(), "127.0.0.1:7700");
  EXPECT_TRUE(self.self());
  EXPECT_EQ(self.health(), v1::MEMBER_HEALTH_SERVING);
  EXPECT_EQ(self.backend(), "cuda:0");
  EXPECT_THAT(self.transports(), ElementsAre("grpc-stream", "nccl"));

  const v1::Member& mb = response.members(1);
  EXPECT_EQ(mb.name(), "b");
  EXPECT_EQ(mb.address(), b.address());
  EXPECT_FALSE(mb.self());
  EXPECT_EQ(mb.health(), v1::MEMBER_HEALTH_SERVING);
  EXPECT_EQ(mb.backend(), "cuda:3");
  EXPECT_THAT(mb.transports(), ElementsAre("grpc-stream", "nccl"));
  EXPECT_EQ(mb.detail(), "");

  const v1::Member& mc = response.members(2);
  EXPECT_EQ(mc.name(), "c");
  EXPECT_EQ(mc.health(), v1::MEMBER_HEALTH_NOT_SERVING);
  EXPECT_EQ(mc.detail(), "health: NOT_SERVING");
  EXPECT_EQ(mc.backend(), "host");  // it still answers NodeInfo

  const v1::Member& md = response.members(3);
  EXPECT_EQ(md.name(), "d");
  EXPECT_EQ(md.address(), refused.address());
  EXPECT_EQ(md.health(), v1::MEMBER_HEALTH_UNREACHABLE);
  EXPECT_THAT(md.detail(), StartsWith("UNAVAILABLE: "));
  EXPECT_EQ(md.backend(), "");
  EXPECT_THAT(md.transports(), IsEmpty());
}

TEST(DescribeTest, FrozenPeersAreUnreachableAtTheDeadlineCheckedInParallel) {
  HeldPort frozen1(/*listening=*/true);
  HeldPort frozen2(/*listening=*/true);
  HeldPort frozen3(/*listening=*/true);
  ASSERT_TRUE(frozen1.port() != 0 && frozen2.port() != 0 && frozen3.port() != 0);
  FakePeer b(Peer("b"));
  ASSERT_TRUE(b.ok());
  const absl::Duration timeout = absl::Seconds(1);
  auto membership = MakeMembership({{"x", frozen1.address()},
                                    {"y", frozen2.address()},
                                    {"z", frozen3.address()},
                                    {"b", b.address()}},
                                   timeout);
  ASSERT_NE(membership, nullptr);

  const absl::Time start = absl::Now();
  // The caller's deadline is later: health_timeout bounds the wait.
  v1::ListMembersResponse response = membership->Describe(absl::Now() + absl::Seconds(30));
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_GE(elapsed, timeout - absl::Milliseconds(50));
  // Three frozen peers one after the other would take 3 s (slack for sanitizer builds).
  EXPECT_LT(elapsed, timeout + absl::Milliseconds(1500));

  ASSERT_EQ(response.members_size(), 5);
  EXPECT_EQ(response.members(1).name(), "b");
  EXPECT_EQ(response.members(1).health(), v1::MEMBER_HEALTH_SERVING);
  for (int i = 2; i < 5; ++i) {
    EXPECT_EQ(response.members(i).health(), v1::MEMBER_HEALTH_UNREACHABLE);
    EXPECT_THAT(response.members(i).detail(), StartsWith("DEADLINE_EXCEEDED: "));
  }

  // An earlier deadline of the caller wins over health_timeout.
  const absl::Time again = absl::Now();
  response = membership->Describe(absl::Now() + absl::Milliseconds(100));
  EXPECT_LT(absl::Now() - again, absl::Milliseconds(900));
  EXPECT_EQ(response.members(2).health(), v1::MEMBER_HEALTH_UNREACHABLE);
}

TEST(DescribeTest, MisnamedPeerAndServerWithoutPeerService) {
  FakePeer misnamed(Peer("zz"));
  FakePeer::Options plain_options = Peer("");
  plain_options.peer_service = false;
  FakePeer plain(plain_options);
  ASSERT_TRUE(misnamed.ok() && plain.ok());
  auto membership = MakeMembership({{"b", misnamed.address()}, {"c", plain.address()}});
  ASSERT_NE(membership, nullptr);
  v1::ListMembersResponse response = membership->Describe(absl::Now() + absl::Seconds(5));
  ASSERT_EQ(response.members_size(), 3);
  EXPECT_EQ(response.members(1).health(), v1::MEMBER_HEALTH_SERVING);
  EXPECT_EQ(response.members(1).detail(), "answers as node 'zz'");
  EXPECT_EQ(response.members(2).health(), v1::MEMBER_HEALTH_SERVING);
  EXPECT_THAT(response.members(2).detail(), StartsWith("NodeInfo: UNIMPLEMENTED"));
  EXPECT_EQ(response.members(2).backend(), "");
}

TEST(DescribeTest, RestartedPeerIsSeenAgainQuickly) {
  auto held = std::make_unique<HeldPort>(/*listening=*/false);
  const int port = held->port();
  ASSERT_NE(port, 0);
  auto membership = MakeMembership({{"b", held->address()}});
  ASSERT_NE(membership, nullptr);
  EXPECT_EQ(membership->Describe(absl::Now() + absl::Seconds(5)).members(1).health(),
            v1::MEMBER_HEALTH_UNREACHABLE);
  // The peer comes (back) up on its port: the channel's reconnect backoff is short, so the next
  // checks see it within a few seconds rather than gRPC's default of up to two minutes.
  held.reset();
  FakePeer b(Peer("b", absl::StrCat("127.0.0.1:", port)));
  ASSERT_TRUE(b.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  v1::MemberHealth health = v1::MEMBER_HEALTH_UNKNOWN;
  while (absl::Now() < deadline) {
    health = membership->Describe(absl::Now() + absl::Seconds(1)).members(1).health();
    if (health == v1::MEMBER_HEALTH_SERVING) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(health, v1::MEMBER_HEALTH_SERVING);
}

// ---- DNS discovery -------------------------------------------------------------------------

Membership::Options DnsOptions(const std::string& self_name, const std::string& self_address,
                               const std::string& peer_dns) {
  Membership::Options options;
  options.self_name = self_name;
  options.self_address = self_address;
  options.peer_dns = peer_dns;
  options.transports = {"grpc-stream"};
  options.rediscover_interval = absl::Hours(1);  // the tests call Rediscover
  return options;
}

// What a loopback address may be called by its reverse lookup, or its own IP.
const auto kLoopbackName = AnyOf("localhost", "localhost.localdomain", "ip6-localhost",
                                 "ip6-loopback", "127.0.0.1", "::1");

TEST(DnsDiscoveryTest, LocalhostResolvesToTheServer) {
  // Served on every address of localhost (127.0.0.1 and/or ::1), with one port.
  FakePeer peer(Peer("localhost", "localhost:0"));
  ASSERT_TRUE(peer.ok());
  auto created = Membership::Create(
      DnsOptions("self", "127.0.0.1:1", absl::StrCat("localhost:", peer.port())));
  ASSERT_TRUE(created.ok()) << created.status();
  Membership& m = **created;
  ASSERT_TRUE(m.Rediscover().ok());

  const std::vector<MemberAddress> peers = m.Peers();
  ASSERT_FALSE(peers.empty());
  std::set<std::string> names;
  for (const MemberAddress& p : peers) {
    EXPECT_THAT(p.name, kLoopbackName);
    EXPECT_THAT(p.address, EndsWith(absl::StrCat(":", peer.port())));
    EXPECT_THAT(p.address, AnyOf(StartsWith("127.0.0.1:"), StartsWith("[::1]:")));
    EXPECT_TRUE(names.insert(p.name).second) << "name given twice: " << p.name;
    auto found = m.Find(p.name);
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_EQ(*found, p);
  }
  v1::ListMembersResponse response = m.Describe(absl::Now() + absl::Seconds(5));
  ASSERT_EQ(response.members_size(), 1 + static_cast<int>(peers.size()));
  EXPECT_EQ(response.members(0).detail(), "");
  for (int i = 1; i < response.members_size(); ++i) {
    EXPECT_EQ(response.members(i).health(), v1::MEMBER_HEALTH_SERVING)
        << response.members(i).DebugString();
  }
}

TEST(DnsDiscoveryTest, SelfIsLeftOutByNameOrByAddressAndPort) {
  FakePeer peer(Peer("localhost", "localhost:0"));
  ASSERT_TRUE(peer.ok());
  const std::string dns = absl::StrCat("localhost:", peer.port());
  {
    // The reverse name of 127.0.0.1 is this node's name.
    auto m = Membership::Create(DnsOptions("localhost", "127.0.0.1:1", dns));
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE((*m)->Rediscover().ok());
    for (const MemberAddress& p : (*m)->Peers()) EXPECT_NE(p.name, "localhost");
  }
  {
    // Any address of this host with this node's port is this node, whatever its name.
    auto m = Membership::Create(DnsOptions("pod-0", absl::StrCat("0.0.0.0:", peer.port()), dns));
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE((*m)->Rediscover().ok());
    EXPECT_THAT((*m)->Peers(), IsEmpty());
  }
}

TEST(DnsDiscoveryTest, BackgroundThreadResolvesAndStopsPromptly) {
  FakePeer peer(Peer("localhost", "localhost:0"));
  ASSERT_TRUE(peer.ok());
  Membership::Options options =
      DnsOptions("self", "127.0.0.1:1", absl::StrCat("localhost:", peer.port()));
  options.rediscover_interval = absl::Hours(1);
  auto m = Membership::Create(std::move(options));
  ASSERT_TRUE(m.ok()) << m.status();
  // The first resolution runs at once on the discovery thread.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((*m)->Peers().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_FALSE((*m)->Peers().empty());
  // The thread waits for an hour; the destructor wakes it.
  const absl::Time start = absl::Now();
  m->reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(DnsDiscoveryTest, FailureIsReportedInDescribe) {
  auto m =
      Membership::Create(DnsOptions("self", "127.0.0.1:1", "kvmesh-no-such-service.invalid:7700"));
  ASSERT_TRUE(m.ok()) << m.status();
  const absl::Status status = (*m)->Rediscover();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("cannot resolve 'kvmesh-no-such-service.invalid'"));
  EXPECT_THAT((*m)->Peers(), IsEmpty());
  v1::ListMembersResponse response = (*m)->Describe(absl::Now() + absl::Seconds(1));
  ASSERT_EQ(response.members_size(), 1);
  EXPECT_THAT(response.members(0).detail(),
              HasSubstr("peer discovery: cannot resolve 'kvmesh-no-such-service.invalid'"));
  EXPECT_THAT(response.members(0).detail(), HasSubstr("keeping the 0 peers last known"));
  EXPECT_EQ((*m)->Find("x").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvmesh
