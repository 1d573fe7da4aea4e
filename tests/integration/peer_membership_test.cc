// PeerService's callers are members for as long as the membership says so: a member's
// PeerService.WatchEvents (every tenant's events, what the other members' cluster indexes
// follow) ends PERMISSION_DENIED within about a second of the member leaving the membership.
//
// In process, over mTLS on loopback: the node's PeerServiceImpl behind its RequestGate, its
// Membership discovering its peers from DNS ("localhost:PORT", the loopback names of this
// host), and a client whose certificate (made by openssl at test time) names the member that
// discovery found. The member leaves as a pod does when its DNS record goes: the next
// resolution no longer lists it (here because the node now listens on the port the name
// resolves to, which makes every loopback address the node itself).
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/cache_registry.h"
#include "cache/device/host_device.h"
#include "cache/event_log.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "service/cluster/membership.h"
#include "service/common/tls.h"
#include "service/executor.h"
#include "service/peer_service.h"
#include "tests/integration/client_util.h"
#include "tests/testing/certs.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace {

using ::testing::HasSubstr;
using testutil::CertFiles;
using testutil::StatusText;
using testutil::TempDir;
using testutil::TestCa;

TEST(PeerMembershipTest, AMemberThatLeavesLosesItsEventStreamWithinASecondOrTwo) {
  absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("kvmesh-peer-membership");
  ASSERT_TRUE(dir.ok()) << dir.status();
  absl::StatusOr<std::unique_ptr<TestCa>> ca =
      TestCa::Create((*dir)->path(), "ca", "peer_membership_test CA");
  ASSERT_TRUE(ca.ok()) << ca.status();
  absl::StatusOr<CertFiles> node_cert = (*ca)->Issue("self", {"self", {"DNS:self"}});
  ASSERT_TRUE(node_cert.ok()) << node_cert.status();

  // The member: whatever this host calls its loopback address ("localhost" on most).
  const int port = testutil::ReservePort();
  ASSERT_NE(port, 0);
  Membership::Options m;
  m.self_name = "self";
  m.self_address = "127.0.0.1:1";
  m.peer_dns = absl::StrCat("localhost:", port);
  m.transports = {"grpc-stream"};
  m.rediscover_interval = absl::Hours(1);  // the test calls Rediscover
  absl::StatusOr<std::unique_ptr<Membership>> membership = Membership::Create(m);
  ASSERT_TRUE(membership.ok()) << membership.status();
  ASSERT_TRUE((*membership)->Rediscover().ok());
  const std::vector<MemberAddress> peers = (*membership)->Peers();
  ASSERT_FALSE(peers.empty()) << "localhost resolves to no address";
  const std::string member = peers[0].name;
  absl::StatusOr<CertFiles> member_cert =
      (*ca)->Issue("member", {member, {absl::StrCat("DNS:", member)}});
  ASSERT_TRUE(member_cert.ok()) << member_cert.status();

  HostDevice device(size_t{16} << 20);
  CacheRegistry registry(&device);
  EventLog events;
  Executor executor(1, 8);
  PeerServiceImpl::Options options;
  options.name = "self";
  options.membership = membership->get();
  options.require_member_certificate = true;
  options.backend = "host";
  options.registry = &registry;
  options.events = &events;
  // WatchEvents needs no cluster nor leases.
  PeerServiceImpl peer_service(nullptr, nullptr, &executor, &executor, options);

  NodeTlsOptions tls_options;
  tls_options.cert_file = node_cert->cert;
  tls_options.key_file = node_cert->key;
  tls_options.peer_ca_file = (*ca)->cert_file();
  absl::StatusOr<std::unique_ptr<NodeTls>> tls = NodeTls::Create(tls_options);
  ASSERT_TRUE(tls.ok()) << tls.status();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), (*tls)->PeerPortServerCredentials(),
                           &bound);
  builder.RegisterCallbackGenericService(peer_service.request_gate());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_TRUE(server != nullptr && bound == port);

  ClientTlsOptions client;
  client.ca_file = (*ca)->cert_file();
  client.cert_file = member_cert->cert;
  client.key_file = member_cert->key;
  client.server_name = "self";
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ClientChannelCredentials(client);
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  grpc::ChannelArguments args;
  AddClientTlsChannelArgs(client, &args);
  auto stub = v1::PeerService::NewStub(
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), *credentials, args));

  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
      stub->WatchEvents(&context, v1::PeerWatchEventsRequest());
  v1::WatchEventsResponse message;
  // A member: the listing, then heartbeats for as long as it stays one (two of them here).
  ASSERT_TRUE(reader->Read(&message)) << StatusText(reader->Finish());
  const absl::Time served_until = absl::Now() + absl::Milliseconds(2500);
  while (absl::Now() < served_until) {
    ASSERT_TRUE(reader->Read(&message)) << StatusText(reader->Finish());
  }

  // The member leaves the membership.
  (*membership)->SetSelfAddress(absl::StrCat("127.0.0.1:", port));
  ASSERT_TRUE((*membership)->Rediscover().ok());
  ASSERT_TRUE((*membership)->Peers().empty());
  const absl::Time left = absl::Now();
  while (reader->Read(&message)) {
  }
  const absl::Duration took = absl::Now() - left;
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr(absl::StrCat("'", member, "'")));
  // The watcher asks at every heartbeat (kWatchHeartbeat, 1 s).
  EXPECT_LT(took, absl::Seconds(3)) << "the stream ended " << took << " after the member left";

  // And a new stream is refused at once.
  grpc::ClientContext again;
  again.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  reader = stub->WatchEvents(&again, v1::PeerWatchEventsRequest());
  EXPECT_FALSE(reader->Read(&message));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);

  peer_service.StopWatchers();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  server->Wait();
  executor.Shutdown();
}

}  // namespace
}  // namespace kvmesh
