// Tenants, bearer tokens and the closed peer plane (docs/security.md), with real kvmesh-node
// processes: a node with --token-file refuses calls without a known token, keeps each tenant's
// caches invisible to the others (NOT_FOUND worded as for a cache nobody has), enforces quotas
// and admin-only details, reloads the file when it changes; a cluster with --peer-listen carries
// the tenant across nodes; PeerService is not on the client port, refuses receivers that are
// not members and transports it does not have, hands out unguessable lease ids bound to their
// receiver, caps leases per receiver and clamps lease times.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "service/auth.h"
#include "service/common/client_channel.h"
#include "tests/integration/client_util.h"
#include "tests/testing/certs.h"
#include "tests/testing/node_process.h"

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::HasSubstr;

#define ASSERT_OK(expr)                                                \
  do {                                                                 \
    const grpc::Status status_ = (expr);                               \
    ASSERT_TRUE(status_.ok()) << #expr << ": " << StatusText(status_); \
  } while (0)
#define EXPECT_OK(expr)                                                \
  do {                                                                 \
    const grpc::Status status_ = (expr);                               \
    EXPECT_TRUE(status_.ok()) << #expr << ": " << StatusText(status_); \
  } while (0)
using ::testing::Not;

// Tokens are random in production; fixed here, and only their hashes reach the node.
constexpr char kAlice[] = "alice-0123456789abcdef0123456789abcdef";  // team-a, tenant
constexpr char kBob[] = "bob-0123456789abcdef0123456789abcdef";      // team-b, tenant
constexpr char kRoot[] = "root-0123456789abcdef0123456789abcdef";    // ops, admin
constexpr char kCarol[] = "carol-0123456789abcdef0123456789abcdef";  // added by a reload

std::string TokenLine(const std::string& token, const std::string& tenant,
                      const std::string& role) {
  return absl::StrCat("token sha256:", Sha256Hex(token), " ", tenant, " ", role, "\n");
}

// Writes `text` to `path` through a rename, as a Secret volume update swaps files.
void WriteFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
  }
  ASSERT_EQ(std::rename(tmp.c_str(), path.c_str()), 0);
}

std::string BaseTokens() {
  return absl::StrCat("# test tenants\n", TokenLine(kAlice, "team-a", "tenant"),
                      TokenLine(kBob, "team-b", "tenant"), TokenLine(kRoot, "ops", "admin"),
                      "quota team-b caches=2 bytes=4MiB\n");
}

// A tiny Attention cache: 2 layers x 1 head x 8 dims, F32.
v1::CacheSpec SmallSpec(const std::string& name, int32_t capacity = 64) {
  AttentionOptions a;
  a.num_layers = 2;
  a.num_kv_heads = 1;
  a.head_dim_k = 8;
  a.head_dim_v = 8;
  return SpecProto(name, 4, capacity, 16, {AttentionGroupProto(a)});
}

std::unique_ptr<Stub> StubFor(const std::string& address, const std::string& token,
                              const std::string& tenant = "") {
  ClientConnectionOptions options;
  options.token = token;
  options.tenant = tenant;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = NewClientChannel(address, options, args);
  EXPECT_TRUE(channel.ok()) << channel.status();
  return v1::CacheService::NewStub(*channel);
}

class TenantsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("kvmesh-tenants");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *std::move(dir);
    tokens_ = dir_->File("tokens");
    WriteFile(tokens_, BaseTokens());
    NodeProcess::Options options;
    options.node_name = "t0";
    options.extra_args = {absl::StrCat("--token-file=", tokens_), "--memory-budget=64MiB",
                          "--snapshot-budget=16MiB"};
    absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = *std::move(node);
    alice_ = StubFor(node_->address(), kAlice);
    bob_ = StubFor(node_->address(), kBob);
    root_ = StubFor(node_->address(), kRoot);
  }

  std::unique_ptr<TempDir> dir_;
  std::string tokens_;
  std::unique_ptr<NodeProcess> node_;
  std::unique_ptr<Stub> alice_, bob_, root_;
};

TEST_F(TenantsTest, CallsWithoutAKnownTokenAreUnauthenticated) {
  std::unique_ptr<Stub> anonymous = StubFor(node_->address(), "");
  v1::ListCachesResponse list;
  grpc::Status status = ListCaches(*anonymous, &list);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("authorization: Bearer"));
  status = CreateCache(*anonymous, SmallSpec("m"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << StatusText(status);

  const std::string wrong = "not-a-token-0123456789abcdef";
  std::unique_ptr<Stub> stranger = StubFor(node_->address(), wrong);
  v1::GetCacheResponse got;
  status = GetCache(*stranger, "m", &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << StatusText(status);
  EXPECT_THAT(status.error_message(), Not(HasSubstr(wrong)));
  // The anonymous create above created nothing.
  ASSERT_OK(ListCaches(*root_, &list));
  EXPECT_EQ(list.caches_size(), 0);

  // Streams too, whatever they send: a header-less AppendStream and an out-of-range Read.
  v1::AppendStreamRequest headerless;
  headerless.set_data("x");
  status = AppendStream(*anonymous, {headerless});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << StatusText(status);
  v1::ReadRequest bad_read = ReadRequest("m", 0);
  bad_read.set_max_chunk_bytes(-1);
  ReadOutput ignored;
  status = Read(*anonymous, bad_read, &ignored);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << StatusText(status);

  // Health and reflection stay open.
  int serving = 0;
  EXPECT_TRUE(HealthCheck(node_->channel(), "", &serving).ok());
  EXPECT_EQ(serving, 1);
  std::vector<std::string> services;
  EXPECT_TRUE(ListReflectedServices(node_->channel(), &services).ok());
}

TEST_F(TenantsTest, ATenantCannotSeeReadDeleteOrCopyAnothersCache) {
  const v1::CacheSpec spec = SmallSpec("m");
  ASSERT_OK(CreateCache(*alice_, spec));
  ASSERT_OK(Append(*alice_, MakeAppend(spec, 0, {0, 1, 2, 3}, 7)));
  ReadOutput before;
  ASSERT_OK(Read(*alice_, ReadRequest("m", 0), &before));

  // Everything bob does to "m" is NOT_FOUND, worded as for a name nobody uses.
  v1::GetCacheResponse got;
  const grpc::Status unknown = GetCache(*bob_, "nobody-has-this", &got);
  ASSERT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  const grpc::Status hidden = GetCache(*bob_, "m", &got);
  EXPECT_EQ(hidden.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(hidden.error_message(), "no cache named 'm'");
  ReadOutput read;
  EXPECT_EQ(Read(*bob_, ReadRequest("m", 0), &read).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Append(*bob_, MakeAppend(spec, 0, {4}, 9)).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(CopyPrefix(*bob_, "m", 0, 1, 4).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Remove(*bob_, "m", 0, 0).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::ListSequencesResponse seqs;
  EXPECT_EQ(ListSequences(*bob_, "m", &seqs).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Snapshot(*bob_, "m", 0, 0).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(DeleteCache(*bob_, "m").error_code(), grpc::StatusCode::NOT_FOUND);
  v1::ListCachesResponse list;
  ASSERT_OK(ListCaches(*bob_, &list));
  EXPECT_EQ(list.caches_size(), 0);

  // Names are per tenant: bob's own "m", with another spec, is a new cache, not ALREADY_EXISTS.
  v1::CreateCacheResponse created;
  ASSERT_OK(CreateCache(*bob_, SmallSpec("m", 32), &created));
  EXPECT_TRUE(created.created());
  EXPECT_EQ(created.cache().tenant(), "team-b");

  // Alice's cache is exactly as before.
  ReadOutput after;
  ASSERT_OK(Read(*alice_, ReadRequest("m", 0), &after));
  EXPECT_EQ(after.payload, before.payload);
  ASSERT_OK(ListCaches(*alice_, &list));
  ASSERT_EQ(list.caches_size(), 1);
  EXPECT_EQ(list.caches(0).spec().capacity(), 64);
  EXPECT_EQ(list.caches(0).tenant(), "team-a");

  // An admin sees every tenant's caches, and may act for one.
  ASSERT_OK(ListCaches(*root_, &list));
  ASSERT_EQ(list.caches_size(), 2);
  std::set<std::string> tenants = {list.caches(0).tenant(), list.caches(1).tenant()};
  EXPECT_EQ(tenants, (std::set<std::string>{"team-a", "team-b"}));
  std::unique_ptr<Stub> root_as_a = StubFor(node_->address(), kRoot, "team-a");
  ReadOutput admin_read;
  ASSERT_OK(Read(*root_as_a, ReadRequest("m", 0), &admin_read));
  EXPECT_EQ(admin_read.payload, before.payload);
  ASSERT_OK(ListCaches(*root_as_a, &list));
  EXPECT_EQ(list.caches_size(), 1);
}

TEST_F(TenantsTest, OnlyAnAdminMayActForAnotherTenantOrSeeMemberDetails) {
  ASSERT_OK(CreateCache(*bob_, SmallSpec("b")));
  std::unique_ptr<Stub> alice_as_b = StubFor(node_->address(), kAlice, "team-b");
  v1::GetCacheResponse got;
  const grpc::Status denied = GetCache(*alice_as_b, "b", &got);
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED) << StatusText(denied);
  EXPECT_THAT(denied.error_message(), HasSubstr("only an admin"));

  v1::ListMembersResponse members;
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    ASSERT_TRUE(alice_->ListMembers(&context, v1::ListMembersRequest(), &members).ok());
  }
  ASSERT_EQ(members.members_size(), 1);
  EXPECT_EQ(members.members(0).name(), "t0");
  EXPECT_EQ(members.members(0).address(), "");
  EXPECT_EQ(members.members(0).backend(), "");
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    ASSERT_TRUE(root_->ListMembers(&context, v1::ListMembersRequest(), &members).ok());
  }
  EXPECT_NE(members.members(0).address(), "");
  EXPECT_NE(members.members(0).backend(), "");

  // Drain moves every tenant's data: admins only. A bad timeout names itself; an admin's
  // drain of a node without peers lists what stayed, and resume ends it.
  v1::DrainResponse drained;
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    const grpc::Status status = alice_->Drain(&context, v1::DrainRequest(), &drained);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("only an admin"));
  }
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::DrainRequest request;
    request.set_timeout_ms(-3);
    const grpc::Status status = root_->Drain(&context, request, &drained);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("timeout_ms = -3"));
  }
  ASSERT_OK(Append(*bob_, MakeAppend(SmallSpec("b"), 4, {0, 1}, 9)));
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::DrainRequest request;
    request.set_timeout_ms(5000);
    ASSERT_OK(root_->Drain(&context, request, &drained));
    ASSERT_EQ(drained.stayed_size(), 1) << drained.DebugString();
    EXPECT_EQ(drained.stayed(0).tenant(), "team-b");
    EXPECT_EQ(drained.stayed(0).cache(), "b");
    EXPECT_EQ(drained.stayed(0).seq(), 4);
    EXPECT_THAT(drained.stayed(0).reason(), HasSubstr("no peers"));
  }
  const grpc::Status refused = CreateCache(*alice_, SmallSpec("a2"));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(refused);
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::DrainRequest request;
    request.set_resume(true);
    ASSERT_OK(root_->Drain(&context, request, &drained));
    EXPECT_FALSE(drained.draining());
  }
  ASSERT_OK(CreateCache(*alice_, SmallSpec("a2")));
}

TEST_F(TenantsTest, QuotasHold) {
  // team-b: 2 caches and 4 MiB of arenas. A 64-cell cache of this spec is 8 KiB.
  ASSERT_OK(CreateCache(*bob_, SmallSpec("one")));
  ASSERT_OK(CreateCache(*bob_, SmallSpec("two")));
  grpc::Status status = CreateCache(*bob_, SmallSpec("three"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("tenant 'team-b' holds 2 caches"));
  // The same spec again is still an idempotent success, not a third cache.
  EXPECT_OK(CreateCache(*bob_, SmallSpec("two")));
  ASSERT_OK(DeleteCache(*bob_, "two"));
  // 65536 cells x 2 layers x 2 x 8 x 4 bytes = 8 MiB: over the byte quota.
  status = CreateCache(*bob_, SmallSpec("big", 65536));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("quota of 4194304 bytes"));
  EXPECT_OK(CreateCache(*bob_, SmallSpec("three")));
  // Other tenants have no quota line: unlimited by count.
  for (int i = 0; i < 4; ++i) {
    EXPECT_OK(CreateCache(*alice_, SmallSpec(absl::StrCat("a", i))));
  }
}

TEST_F(TenantsTest, TheTokenFileIsReloadedAndABadVersionKeepsTheLastGoodOne) {
  std::unique_ptr<Stub> carol = StubFor(node_->address(), kCarol);
  v1::ListCachesResponse list;
  ASSERT_EQ(ListCaches(*carol, &list).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // Bob revoked, carol added.
  WriteFile(tokens_, absl::StrCat(TokenLine(kAlice, "team-a", "tenant"),
                                  TokenLine(kCarol, "team-c", "tenant")));
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!ListCaches(*carol, &list).ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_OK(ListCaches(*carol, &list));
  EXPECT_EQ(ListCaches(*bob_, &list).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // A malformed version is refused; the last good one stays in force.
  WriteFile(tokens_, "token sha256:not-hex team-a tenant\n");
  const absl::Time logged = absl::Now() + absl::Seconds(20);
  while (node_->ReadStderr().find("stays in force") == std::string::npos && absl::Now() < logged) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_THAT(node_->ReadStderr(), HasSubstr("line 1: the token hash is not sha256"));
  EXPECT_OK(ListCaches(*carol, &list));
  EXPECT_OK(ListCaches(*alice_, &list));
}

TEST(TokenFileTest, AMalformedFileStopsTheNodeAtStartUp) {
  absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("kvmesh-tenants");
  ASSERT_TRUE(dir.ok());
  const std::string path = (*dir)->File("tokens");
  WriteFile(path, absl::StrCat(TokenLine(kAlice, "team-a", "tenant"),
                               TokenLine(kBob, "team/b", "tenant")));
  absl::StatusOr<NodeRun> run = RunNodeToExit(
      {"--listen=127.0.0.1:0", absl::StrCat("--token-file=", path)}, absl::Seconds(30));
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_FALSE(run->status.clean());
  EXPECT_THAT(run->stderr_text, HasSubstr("line 2: the tenant 'team/b' is not a tenant name"));
  // Outside development mode a cluster needs --peer-listen.
  WriteFile(path, TokenLine(kAlice, "team-a", "tenant"));
  run = RunNodeToExit(
      {"--listen=127.0.0.1:0", absl::StrCat("--token-file=", path), "--peers=other=127.0.0.1:1"},
      absl::Seconds(30));
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_FALSE(run->status.clean());
  EXPECT_THAT(run->stderr_text, HasSubstr("need --peer_listen"));
}

// ---- two nodes with a private peer plane ---------------------------------------------------

class PeerPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("kvmesh-peers");
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *std::move(dir);
    tokens_ = dir_->File("tokens");
    WriteFile(tokens_, BaseTokens());
    const int peer_ports[2] = {ReservePort(), ReservePort()};
    ASSERT_NE(peer_ports[0], 0);
    ASSERT_NE(peer_ports[1], 0);
    for (int i = 0; i < 2; ++i) {
      NodeProcess::Options options;
      options.node_name = absl::StrCat("p", i);
      options.extra_args = {absl::StrCat("--token-file=", tokens_),
                            absl::StrCat("--peer-listen=127.0.0.1:", peer_ports[i]),
                            absl::StrCat("--peers=p", 1 - i, "=127.0.0.1:", peer_ports[1 - i]),
                            "--memory-budget=64MiB", "--snapshot-budget=16MiB",
                            "--max-leases-per-receiver=2", "--lease-ms=20000",
                            "--max-lease-ms=60000",
                            // Block hashes of 1 bit: equal prompts of different tenants
                            // collide, so only the tenant in the index's keys keeps them apart.
                            "--testing-token-hash-bits=1"};
      absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
      ASSERT_TRUE(node.ok()) << node.status();
      ASSERT_EQ((*node)->peer_port(), peer_ports[i]);
      nodes_[i] = *std::move(node);
    }
  }

  std::unique_ptr<v1::PeerService::Stub> PeerStub(int i) {
    return v1::PeerService::NewStub(
        grpc::CreateChannel(nodes_[i]->peer_address(), grpc::InsecureChannelCredentials()));
  }

  // Alice's cache "m" on both nodes, 8 tokens of seq 0 on node 0.
  void AliceCacheOnBoth() {
    for (int i = 0; i < 2; ++i) {
      ASSERT_OK(CreateCache(*StubFor(nodes_[i]->address(), kAlice), SmallSpec("m")));
    }
    ASSERT_OK(Append(*StubFor(nodes_[0]->address(), kAlice),
                     MakeAppend(SmallSpec("m"), 0, {0, 1, 2, 3, 4, 5, 6, 7}, 3)));
  }

  v1::ExportRequest ExportOf(const std::string& tenant, const std::string& receiver,
                             const std::string& transport) {
    v1::ExportRequest request;
    request.set_cache("m");
    request.set_tenant(tenant);
    *request.mutable_spec() = SmallSpec("m");
    request.set_receiver(receiver);
    request.set_transport(transport);
    request.mutable_sequence()->set_seq(0);
    return request;
  }

  grpc::Status Export(int node, const v1::ExportRequest& request, v1::ExportResponse* response) {
    grpc::ClientContext context;
    SetDeadline(&context);
    return PeerStub(node)->Export(&context, request, response);
  }

  std::unique_ptr<TempDir> dir_;
  std::string tokens_;
  std::unique_ptr<NodeProcess> nodes_[2];
};

TEST_F(PeerPlaneTest, TheTenantTravelsWithCrossNodeOperations) {
  AliceCacheOnBoth();
  std::unique_ptr<Stub> alice1 = StubFor(nodes_[1]->address(), kAlice);
  v1::CopyPrefixRequest copy;
  copy.set_cache("m");
  copy.set_source_node("p0");
  copy.set_src_seq(0);
  copy.set_dst_seq(2);
  copy.set_length(8);
  v1::CopyPrefixResponse copied;
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    const grpc::Status status = alice1->CopyPrefix(&context, copy, &copied);
    ASSERT_TRUE(status.ok()) << StatusText(status);
  }
  ReadOutput there, here;
  ASSERT_OK(Read(*StubFor(nodes_[0]->address(), kAlice), ReadRequest("m", 0), &here));
  ASSERT_OK(Read(*alice1, ReadRequest("m", 2), &there));
  EXPECT_EQ(there.payload, here.payload);

  // Bob has a cache "m" on node 1 too, but none on node 0: copying "his" m from node 0 must not
  // reach alice's.
  std::unique_ptr<Stub> bob1 = StubFor(nodes_[1]->address(), kBob);
  ASSERT_OK(CreateCache(*bob1, SmallSpec("m")));
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    const grpc::Status status = bob1->CopyPrefix(&context, copy, &copied);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << StatusText(status);
  }
  v1::ListSequencesResponse seqs;
  ASSERT_OK(ListSequences(*bob1, "m", &seqs));
  EXPECT_EQ(seqs.sequences_size(), 0);
  // Bob's cluster-wide Remove of seq 0 of "m" leaves alice's sequence alone on both nodes.
  v1::RemoveRequest remove;
  remove.set_cache("m");
  remove.set_seq(0);
  remove.set_scope(v1::REMOVE_SCOPE_CLUSTER);
  v1::RemoveResponse removed;
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    ASSERT_TRUE(bob1->Remove(&context, remove, &removed).ok());
  }
  ASSERT_EQ(removed.nodes_size(), 2);
  for (const v1::NodeResult& result : removed.nodes()) {
    if (result.node() == "p0") {
      EXPECT_EQ(result.code(), static_cast<int>(grpc::StatusCode::NOT_FOUND)) << result.message();
    }
  }
  ReadOutput still;
  ASSERT_OK(Read(*StubFor(nodes_[0]->address(), kAlice), ReadRequest("m", 0), &still));
  EXPECT_EQ(still.payload, here.payload);
  // Alice's cluster-wide Remove reaches both of her sequences 0.
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    ASSERT_TRUE(StubFor(nodes_[0]->address(), kAlice)->Remove(&context, remove, &removed).ok());
  }
  for (const v1::NodeResult& result : removed.nodes()) {
    EXPECT_EQ(result.code(), 0) << result.node() << ": " << result.message();
  }
}

// Alice and Bob store the same prompt on node 0, each in a cache "m" of their own: a cluster
// lookup on node 1 (from its index of node 0, and verified by node 0) finds the caller's only,
// although with 1-bit hashes (the fixture's nodes) both tenants' blocks hash alike.
TEST_F(PeerPlaneTest, ClusterLookupsFindTheCallersOwnPrefixesOnly) {
  std::vector<int32_t> prompt(40);
  for (int32_t p = 0; p < 40; ++p) prompt[p] = 500 + p;
  const struct {
    const char* token;
    int64_t seq;
  } callers[] = {{kAlice, 3}, {kBob, 6}};
  for (const auto& caller : callers) {
    for (int i = 0; i < 2; ++i) {
      ASSERT_OK(CreateCache(*StubFor(nodes_[i]->address(), caller.token), SmallSpec("m")));
    }
    for (int32_t begin = 0; begin < 32; begin += 16) {
      std::vector<int32_t> positions(16);
      for (int32_t p = 0; p < 16; ++p) positions[p] = begin + p;
      v1::AppendRequest append = MakeAppend(SmallSpec("m"), caller.seq, positions, 3);
      for (v1::Token& t : *append.mutable_tokens()) t.set_token_id(prompt[t.pos()]);
      ASSERT_OK(Append(*StubFor(nodes_[0]->address(), caller.token), append));
    }
  }
  for (const auto& caller : callers) {
    SCOPED_TRACE(caller.seq);
    std::unique_ptr<Stub> on1 = StubFor(nodes_[1]->address(), caller.token);
    for (const bool verify : {false, true}) {
      v1::LookupPrefixResponse found;
      const absl::Time end = absl::Now() + absl::Seconds(15);
      do {
        found.Clear();
        ASSERT_OK(LookupPrefix(*on1, "m", prompt, &found, 8, v1::LOOKUP_SCOPE_CLUSTER, verify));
        if (found.matches_size() > 0) break;
        absl::SleepFor(absl::Milliseconds(50));
      } while (absl::Now() < end);
      ASSERT_EQ(found.matches_size(), 1) << found.DebugString();
      EXPECT_EQ(found.matches(0).node(), "p0");
      EXPECT_EQ(found.matches(0).seq(), caller.seq);
      EXPECT_EQ(found.matches(0).length(), 32);
      EXPECT_EQ(found.matches(0).verified(), verify);
    }
  }
  // The peer calls behind it: a member's stream names each event's tenant; a lookup names the
  // tenant whose cache it reads, and bad values by name.
  std::unique_ptr<v1::PeerService::Stub> peer = PeerStub(0);
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
        peer->WatchEvents(&context, v1::PeerWatchEventsRequest());
    std::set<std::string> tenants;
    v1::WatchEventsResponse message;
    while (reader->Read(&message)) {
      for (const v1::Event& e : message.events()) tenants.insert(e.tenant());
      if (message.synced()) break;
    }
    EXPECT_EQ(tenants, (std::set<std::string>{"team-a", "team-b"}));
    context.TryCancel();
    (void)reader->Finish();
  }
  auto peer_lookup = [&](const std::string& tenant, const std::string& cache, int32_t max,
                         v1::LookupPrefixResponse* found) {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::PeerLookupPrefixRequest request;
    request.set_tenant(tenant);
    request.mutable_lookup()->set_cache(cache);
    request.mutable_lookup()->mutable_tokens()->Add(prompt.begin(), prompt.end());
    request.mutable_lookup()->set_max_matches(max);
    return peer->LookupPrefix(&context, request, found);
  };
  v1::LookupPrefixResponse found;
  ASSERT_OK(peer_lookup("team-b", "m", 4, &found));
  ASSERT_EQ(found.matches_size(), 1);
  EXPECT_EQ(found.matches(0).seq(), 6);
  EXPECT_TRUE(found.matches(0).verified());
  grpc::Status status = peer_lookup("team-c", "m", 4, &found);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("'m'"));
  status = peer_lookup("team-a", "m", 65, &found);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("max_matches = 65"));
  // No tenant named: no tenant's cache (as the other peer calls that name one).
  status = peer_lookup("", "m", 1, &found);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << StatusText(status);
}

TEST_F(PeerPlaneTest, PeerServiceIsNotOnTheClientPort) {
  std::unique_ptr<v1::PeerService::Stub> wrong_port = v1::PeerService::NewStub(
      grpc::CreateChannel(nodes_[0]->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::NodeInfoResponse info;
  const grpc::Status status = wrong_port->NodeInfo(&context, v1::NodeInfoRequest(), &info);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << StatusText(status);
  // And CacheService is not on the peer port.
  std::unique_ptr<Stub> cache_on_peer_port = StubFor(nodes_[0]->peer_address(), kRoot);
  v1::ListCachesResponse list;
  EXPECT_EQ(ListCaches(*cache_on_peer_port, &list).error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(PeerPlaneTest, ExportsGoOnlyToMembersOverTransportsTheNodeHas) {
  AliceCacheOnBoth();
  v1::ExportResponse exported;
  grpc::Status status = Export(0, ExportOf("team-a", "mallory", "grpc-stream"), &exported);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("'mallory' is not a member"));
  status = Export(0, ExportOf("team-a", "p1", "carrier-pigeon"), &exported);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("'carrier-pigeon' is not a transport"));
  status = Export(0, ExportOf("team-a", "p1", "nccl"), &exported);  // a host node has no nccl
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  // The wrong tenant finds nothing.
  status = Export(0, ExportOf("team-b", "p1", "grpc-stream"), &exported);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << StatusText(status);
  // None of these took a lease: the cache pins no export bytes.
  v1::GetCacheResponse got;
  ASSERT_OK(GetCache(*StubFor(nodes_[0]->address(), kAlice), "m", &got));
  EXPECT_EQ(got.cache().usage().export_bytes(), 0);
}

TEST_F(PeerPlaneTest, PlaceDescribesRoomCreatesCachesAndNamesBadValues) {
  AliceCacheOnBoth();
  std::unique_ptr<Stub> alice1 = StubFor(nodes_[1]->address(), kAlice);
  ASSERT_OK(Append(*alice1, MakeAppend(SmallSpec("m"), 5, {0, 1}, 11)));
  auto place = [&](const std::string& tenant, const v1::CacheSpec& spec, bool create,
                   v1::PlaceResponse* response) {
    v1::PlaceRequest request;
    request.set_tenant(tenant);
    *request.mutable_spec() = spec;
    request.set_create(create);
    grpc::ClientContext context;
    SetDeadline(&context);
    return PeerStub(1)->Place(&context, request, response);
  };
  v1::PlaceResponse room;
  ASSERT_OK(place("team-a", SmallSpec("m"), false, &room));
  EXPECT_FALSE(room.draining());
  EXPECT_TRUE(room.exists());
  EXPECT_FALSE(room.created());
  EXPECT_GT(room.free_cells(), 0);
  EXPECT_THAT(room.seqs(), ::testing::ElementsAre(5));
  // Another tenant's cache of that name is not there for team-b; without create nothing moves.
  ASSERT_OK(place("team-b", SmallSpec("m"), false, &room));
  EXPECT_FALSE(room.exists());
  // A different spec, a malformed tenant: named, nothing created.
  grpc::Status status = place("team-a", SmallSpec("m", 128), true, &room);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("cache 'm' has another spec"));
  status = place("team/x", SmallSpec("n"), true, &room);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("tenant = 'team/x'"));
  v1::GetCacheResponse got;
  EXPECT_EQ(GetCache(*alice1, "n", &got).error_code(), grpc::StatusCode::NOT_FOUND);
  // create makes the cache for that tenant, from the spec.
  ASSERT_OK(place("team-a", SmallSpec("n"), true, &room));
  EXPECT_TRUE(room.created());
  EXPECT_TRUE(room.exists());
  ASSERT_OK(GetCache(*alice1, "n", &got));
  EXPECT_EQ(got.cache().tenant(), "team-a");

  // A drain's Pull refuses to replace a sequence that stores something, before any transfer.
  ReadOutput before;
  ASSERT_OK(Read(*alice1, ReadRequest("m", 5), &before));
  v1::PullRequest pull;
  pull.set_cache("m");
  pull.set_tenant("team-a");
  pull.set_source_node("p0");
  pull.mutable_sequence()->set_seq(0);
  pull.mutable_sequence()->set_migration_id("p0/m/0@1");
  pull.set_target_seq(5);
  pull.set_target_seq_unused(true);
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::PullResponse pulled;
  status = PeerStub(1)->Pull(&context, pull, &pulled);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("sequence 5 of cache 'm' already stores data"));
  ReadOutput after;
  ASSERT_OK(Read(*alice1, ReadRequest("m", 5), &after));
  EXPECT_EQ(after.payload, before.payload);
}

TEST_F(PeerPlaneTest, APullOfASequenceOutsideAMigrationIsRefused) {
  AliceCacheOnBoth();
  std::unique_ptr<Stub> alice1 = StubFor(nodes_[1]->address(), kAlice);
  ASSERT_OK(Append(*alice1, MakeAppend(SmallSpec("m"), 5, {0, 1}, 11)));
  ReadOutput before;
  ASSERT_OK(Read(*alice1, ReadRequest("m", 5), &before));
  // Node 1 asked to overwrite its seq 5 with node 0's seq 0, with no migration behind it.
  v1::PullRequest pull;
  pull.set_cache("m");
  pull.set_tenant("team-a");
  pull.set_source_node("p0");
  pull.mutable_sequence()->set_seq(0);
  pull.set_target_seq(5);
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::PullResponse pulled;
  const grpc::Status status = PeerStub(1)->Pull(&context, pull, &pulled);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("migration_id is empty"));
  // A migration's Pull whose retention is bad is refused before anything moves.
  pull.mutable_sequence()->set_migration_id("m1");
  pull.mutable_retention()->set_ttl_ms(-7);
  grpc::ClientContext bad_context;
  SetDeadline(&bad_context);
  const grpc::Status bad = PeerStub(1)->Pull(&bad_context, pull, &pulled);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << StatusText(bad);
  EXPECT_THAT(bad.error_message(), HasSubstr("retention.ttl_ms = -7"));
  ReadOutput after;
  ASSERT_OK(Read(*alice1, ReadRequest("m", 5), &after));
  EXPECT_EQ(after.payload, before.payload);
}

TEST_F(PeerPlaneTest, LeaseIdsCannotBeGuessedAndLeasesAreCappedAndClamped) {
  AliceCacheOnBoth();
  v1::ExportRequest request = ExportOf("team-a", "p1", "grpc-stream");
  request.set_lease_ms(3600 * 1000);  // asks for an hour
  v1::ExportResponse first, second;
  ASSERT_OK(Export(0, request, &first));
  ASSERT_OK(Export(0, request, &second));
  EXPECT_EQ(first.lease_ms(), 60000);  // clamped to --max-lease-ms
  ASSERT_EQ(first.lease_id().size(), 32u);
  EXPECT_NE(first.lease_id(), second.lease_id());
  // A third lease for the same receiver exceeds --max-leases-per-receiver=2.
  v1::ExportResponse third;
  const grpc::Status capped = Export(0, request, &third);
  EXPECT_EQ(capped.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << StatusText(capped);

  // Guessed ids (small numbers, the neighbour of a real one) find nothing.
  std::string neighbour = first.lease_id();
  neighbour.back() = neighbour.back() == '0' ? '1' : '0';
  for (const std::string& guess : {std::string("1"), std::string("2"), neighbour}) {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::FetchRequest fetch;
    fetch.set_lease_id(guess);
    std::unique_ptr<grpc::ClientReader<v1::Chunk>> reader = PeerStub(0)->Fetch(&context, fetch);
    v1::Chunk chunk;
    EXPECT_FALSE(reader->Read(&chunk)) << guess;
    const grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND)
        << guess << ": " << StatusText(status);
  }
  // The real id works for its receiver (here: this process's address, the one that exported).
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::FetchRequest fetch;
    fetch.set_lease_id(first.lease_id());
    std::unique_ptr<grpc::ClientReader<v1::Chunk>> reader = PeerStub(0)->Fetch(&context, fetch);
    v1::Chunk chunk;
    int64_t bytes = 0;
    while (reader->Read(&chunk)) bytes += static_cast<int64_t>(chunk.data().size());
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_EQ(bytes, first.payload_bytes());
  }
  for (const std::string& id : {first.lease_id(), second.lease_id()}) {
    grpc::ClientContext context;
    SetDeadline(&context);
    v1::ReleaseRequest release;
    release.set_lease_id(id);
    v1::ReleaseResponse ignored;
    EXPECT_TRUE(PeerStub(0)->Release(&context, release, &ignored).ok());
  }
  v1::GetCacheResponse got;
  ASSERT_OK(GetCache(*StubFor(nodes_[0]->address(), kAlice), "m", &got));
  EXPECT_EQ(got.cache().usage().export_bytes(), 0);
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
