// Membership without a network: --peers parsing (every error), Create's checks, Find, Peers and
// the channel cache. Health checks and DNS discovery against real servers are in
// tests/integration/cluster_membership_test.cc.
#include "service/cluster/membership.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvmesh {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

MemberAddress M(std::string name, std::string address) {
  return MemberAddress{std::move(name), std::move(address)};
}

TEST(ParsePeersTest, ListSortedByName) {
  auto peers = Membership::ParsePeers("b=10.0.0.2:7700, a=kvmesh-0.kvmesh.ns.svc:7701 ,c=[::1]:80");
  ASSERT_TRUE(peers.ok()) << peers.status();
  EXPECT_THAT(*peers, ElementsAre(M("a", "kvmesh-0.kvmesh.ns.svc:7701"), M("b", "10.0.0.2:7700"),
                                  M("c", "[::1]:80")));
}

TEST(ParsePeersTest, EmptyFlagIsNoPeers) {
  for (const char* flag : {"", "  "}) {
    auto peers = Membership::ParsePeers(flag);
    ASSERT_TRUE(peers.ok()) << peers.status();
    EXPECT_THAT(*peers, IsEmpty());
  }
}

TEST(ParsePeersTest, NamesAndPortsAtTheLimits) {
  auto peers = Membership::ParsePeers("node_1.x-y=h:1,Z=localhost:65535");
  ASSERT_TRUE(peers.ok()) << peers.status();
  EXPECT_THAT(*peers, ElementsAre(M("Z", "localhost:65535"), M("node_1.x-y", "h:1")));
}

TEST(ParsePeersTest, EveryErrorNamesTheEntry) {
  struct Case {
    const char* flag;
    const char* message;  // a part of the message
  };
  const Case cases[] = {
      {"a=h:1,,b=h:2", "empty entry in 'a=h:1,,b=h:2'"},
      {"a=h:1,", "empty entry"},
      {"a=h:1,b", "entry 'b' is not name=host:port (no '=')"},
      {"=h:1", "entry '=h:1' has an empty name"},
      {" =h:1", "entry '=h:1' has an empty name"},
      {"a b=h:1", "name 'a b' may hold only"},
      {"a,b=h:1", "entry 'a' is not name=host:port"},
      {"a=h", "entry 'a=h': address 'h': expected host:port"},
      {"a=", "entry 'a=': address '': expected host:port"},
      {"a=h:", "address 'h:': the port is not a number"},
      {"a=h:x", "address 'h:x': the port is not a number"},
      {"a=h:-1", "the port is not a number"},
      {"a=:1", "address ':1': empty host"},
      {"a=::1:80", "an IPv6 address needs brackets"},
      {"a=[::1:80", "no ']' after an IPv6 address"},
      {"a=[zz]:80", "not an IPv6 address between the brackets"},
      {"a=[::1]80", "address '[::1]80': expected host:port"},
      {"a=h/x:80", "the host is not a name or an address"},
      {"a=h:0", "port 0 is out of range (1..65535)"},
      {"a=h:65536", "port 65536 is out of range (1..65535)"},
      {"a=h:123456", "port 123456 is out of range"},
      {"a=h:1,b=h:2,a=h:3", "node name 'a' is given twice"},
  };
  for (const Case& c : cases) {
    auto peers = Membership::ParsePeers(c.flag);
    EXPECT_EQ(peers.status().code(), absl::StatusCode::kInvalidArgument) << c.flag;
    EXPECT_THAT(std::string(peers.status().message()), HasSubstr(c.message)) << c.flag;
  }
}

Membership::Options Options(std::vector<MemberAddress> peers = {}) {
  Membership::Options options;
  options.self_name = "self";
  options.self_address = "127.0.0.1:7700";
  options.transports = {"grpc-stream"};
  options.peers = std::move(peers);
  return options;
}

TEST(MembershipCreateTest, RejectsBadOptions) {
  struct Case {
    Membership::Options options;
    const char* message;
  };
  std::vector<Case> cases;
  {
    Membership::Options o = Options({M("b", "h:2"), M("self", "h:3")});
    cases.push_back({o, "--peers: 'self=h:3' names this node ('self')"});
  }
  {
    Membership::Options o = Options();
    o.self_name = "";
    cases.push_back({o, "node name '' must be non-empty"});
  }
  {
    Membership::Options o = Options();
    o.self_name = "a,b";
    cases.push_back({o, "node name 'a,b'"});
  }
  {
    Membership::Options o = Options();
    o.self_address = "";
    cases.push_back({o, "address is empty"});
  }
  {
    Membership::Options o = Options({M("b", "h:2"), M("b", "h:3")});
    cases.push_back({o, "--peers: node name 'b' is given twice"});
  }
  {
    Membership::Options o = Options({M("b", "h")});
    cases.push_back({o, "--peers: address of 'b' 'h': expected host:port"});
  }
  {
    Membership::Options o = Options({M("b", "h:2")});
    o.peer_dns = "kvmesh:7700";
    cases.push_back({o, "--peers and --peer-dns are exclusive"});
  }
  {
    Membership::Options o = Options();
    o.peer_dns = "kvmesh";
    cases.push_back({o, "--peer-dns (SERVICE:PORT) 'kvmesh': expected host:port"});
  }
  {
    Membership::Options o = Options();
    o.peer_dns = "kvmesh:0";
    cases.push_back({o, "port 0 is out of range"});
  }
  {
    Membership::Options o = Options();
    o.health_timeout = absl::ZeroDuration();
    cases.push_back({o, "must be positive"});
  }
  {
    Membership::Options o = Options();
    o.rediscover_interval = absl::Seconds(-1);
    cases.push_back({o, "must be positive"});
  }
  {
    Membership::Options o = Options();
    o.max_message_bytes = 0;
    cases.push_back({o, "max message bytes 0 must be positive"});
  }
  for (Case& c : cases) {
    auto membership = Membership::Create(std::move(c.options));
    EXPECT_EQ(membership.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(membership.status().message()), HasSubstr(c.message));
  }
}

TEST(MembershipTest, FindPeersAndSelf) {
  auto membership = Membership::Create(Options({M("c", "h:3"), M("a", "h:1")}));
  ASSERT_TRUE(membership.ok()) << membership.status();
  Membership& m = **membership;
  EXPECT_EQ(m.self_name(), "self");
  EXPECT_THAT(m.Peers(), ElementsAre(M("a", "h:1"), M("c", "h:3")));

  auto a = m.Find("a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, M("a", "h:1"));
  auto self = m.Find("self");
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_EQ(*self, M("self", "127.0.0.1:7700"));

  auto missing = m.Find("b");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.status().message(), "node 'b' is not a member (members: a, c, self)");
  EXPECT_EQ(m.Find("").status().code(), absl::StatusCode::kInvalidArgument);

  // The bound port replaces the one of --listen.
  m.SetSelfAddress("127.0.0.1:40000");
  EXPECT_EQ(m.Find("self")->address, "127.0.0.1:40000");
  EXPECT_EQ(m.self_address(), "127.0.0.1:40000");
}

TEST(MembershipTest, NoPeers) {
  auto membership = Membership::Create(Options());
  ASSERT_TRUE(membership.ok()) << membership.status();
  EXPECT_THAT((*membership)->Peers(), IsEmpty());
  EXPECT_EQ((*membership)->Find("x").status().message(),
            "node 'x' is not a member (members: self)");
  // Static peers cannot be rediscovered.
  EXPECT_EQ((*membership)->Rediscover().code(), absl::StatusCode::kFailedPrecondition);
  // Describe of a lone node: itself, without waiting for anyone.
  v1::ListMembersResponse members = (*membership)->Describe(absl::Now() + absl::Seconds(5));
  ASSERT_EQ(members.members_size(), 1);
  EXPECT_EQ(members.members(0).name(), "self");
  EXPECT_TRUE(members.members(0).self());
  EXPECT_EQ(members.members(0).health(), v1::MEMBER_HEALTH_SERVING);
  EXPECT_EQ(members.members(0).backend(), "host");
  EXPECT_THAT(members.members(0).transports(), ElementsAre("grpc-stream"));
  EXPECT_EQ(members.members(0).detail(), "");
}

TEST(MembershipTest, ChannelsAreCachedPerAddress) {
  auto membership = Membership::Create(Options({M("a", "127.0.0.1:1"), M("b", "127.0.0.1:2")}));
  ASSERT_TRUE(membership.ok()) << membership.status();
  Membership& m = **membership;
  std::shared_ptr<grpc::Channel> a = m.Channel(M("a", "127.0.0.1:1"));
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(m.Channel(M("a", "127.0.0.1:1")), a);
  // Keyed by address: the transports know a sender by its address only.
  EXPECT_EQ(m.Channel(M("127.0.0.1:1", "127.0.0.1:1")), a);
  EXPECT_NE(m.Channel(M("b", "127.0.0.1:2")), a);
}

}  // namespace
}  // namespace kvmesh
