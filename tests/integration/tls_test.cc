// TLS and mTLS between real kvmesh-node processes and clients, with certificates made at test
// time by openssl (tests/testing/certs.h): the client port with a CA, without one, with the
// wrong one, with client certificates required; the server name override; kvmeshctl over TLS
// with a bearer token; certificate rotation without a restart; the peer plane (mTLS on
// --peer-listen) moving a sequence between two nodes, refusing plaintext, foreign CAs and
// certificates that name no member; and the start-up checks of the TLS flags and files.
//
// Also the pure functions of service/common/tls.h (names in certificates, loopback addresses),
// which need no node.
#include <openssl/evp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvmesh/v1/peer.grpc.pb.h"
#include "service/common/client_channel.h"
#include "service/common/tls.h"
#include "service/peer_service.h"
#include "tests/integration/client_util.h"
#include "tests/testing/certs.h"
#include "tests/testing/node_process.h"

#ifndef KVMESH_CTL_PATH
#error "KVMESH_CTL_PATH must be defined by the build (the path of kvmeshctl)"
#endif

namespace kvmesh {
namespace testutil {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Connections that must fail do so at the handshake; a short deadline keeps a wrong outcome
// (a hang) from eating the test's time.
constexpr absl::Duration kFailFast = absl::Seconds(10);

// `lhs = *expr` after asserting that `expr` (a StatusOr) is OK.
#define TLS_TEST_CONCAT_INNER(a, b) a##b
#define TLS_TEST_CONCAT(a, b) TLS_TEST_CONCAT_INNER(a, b)
#define ASSERT_OK_AND_ASSIGN(lhs, expr)                \
  auto TLS_TEST_CONCAT(result_, __LINE__) = (expr);    \
  ASSERT_TRUE(TLS_TEST_CONCAT(result_, __LINE__).ok()) \
      << TLS_TEST_CONCAT(result_, __LINE__).status();  \
  lhs = *std::move(TLS_TEST_CONCAT(result_, __LINE__))

// The certificates every test uses: the cluster CA with leaves for two nodes, a client and a
// non-member, and an unrelated CA with a leaf of its own. Made once (openssl takes a moment).
struct Pki {
  std::unique_ptr<TempDir> dir;
  std::unique_ptr<TestCa> ca;
  std::unique_ptr<TestCa> other_ca;
  CertFiles node_a, node_b, client, mallory, foreign_client;
};

Pki* pki = nullptr;

class TlsEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    auto state = std::make_unique<Pki>();
    ASSERT_OK_AND_ASSIGN(state->dir, TempDir::Create("kvmesh-tls"));
    const std::string dir = state->dir->path();
    ASSERT_OK_AND_ASSIGN(state->ca, TestCa::Create(dir, "ca", "kvmesh test CA"));
    ASSERT_OK_AND_ASSIGN(state->other_ca, TestCa::Create(dir, "other-ca", "unrelated CA"));
    ASSERT_OK_AND_ASSIGN(state->node_a,
                         state->ca->Issue("node-a", {"node-a", {"DNS:node-a", "IP:127.0.0.1"}}));
    ASSERT_OK_AND_ASSIGN(state->node_b,
                         state->ca->Issue("node-b", {"node-b", {"DNS:node-b", "IP:127.0.0.1"}}));
    ASSERT_OK_AND_ASSIGN(state->client,
                         state->ca->Issue("client", {"scheduler", {"DNS:scheduler"}}));
    // A certificate of the cluster CA that names no member (and not the members' host).
    ASSERT_OK_AND_ASSIGN(state->mallory, state->ca->Issue("mallory", {"mallory", {"DNS:mallory"}}));
    ASSERT_OK_AND_ASSIGN(state->foreign_client,
                         state->other_ca->Issue("foreign", {"node-a", {"DNS:node-a"}}));
    pki = state.release();
  }
  void TearDown() override {
    delete pki;
    pki = nullptr;
  }
};

[[maybe_unused]] const ::testing::Environment* const kEnvironment =
    ::testing::AddGlobalTestEnvironment(new TlsEnvironment);

// kvmesh-node flags for TLS with `leaf` (and the cluster CA as the peer CA).
std::vector<std::string> TlsFlags(const CertFiles& leaf) {
  return {"--tls-cert=" + leaf.cert, "--tls-key=" + leaf.key, "--peer-ca=" + pki->ca->cert_file()};
}

ClientConnectionOptions TrustingCa(const std::string& ca_file = "") {
  ClientConnectionOptions client;
  client.tls.ca_file = ca_file.empty() ? pki->ca->cert_file() : ca_file;
  return client;
}

ClientConnectionOptions WithClientCert(const CertFiles& leaf, const std::string& ca_file = "") {
  ClientConnectionOptions client = TrustingCa(ca_file);
  client.tls.cert_file = leaf.cert;
  client.tls.key_file = leaf.key;
  return client;
}

std::unique_ptr<NodeProcess> StartNode(NodeProcess::Options options) {
  absl::StatusOr<std::unique_ptr<NodeProcess>> node = NodeProcess::Start(options);
  EXPECT_TRUE(node.ok()) << node.status();
  return node.ok() ? *std::move(node) : nullptr;
}

// ListCaches over `channel`; `served` (if not null) gets the PEM certificate the server
// presented and `names` what PeerCertificateNames makes of it.
grpc::Status ListOver(const std::shared_ptr<grpc::Channel>& channel, std::string* served = nullptr,
                      std::vector<std::string>* names = nullptr,
                      absl::Duration timeout = kFailFast) {
  auto stub = v1::CacheService::NewStub(channel);
  grpc::ClientContext context;
  SetDeadline(&context, timeout);
  v1::ListCachesResponse response;
  const grpc::Status status = stub->ListCaches(&context, v1::ListCachesRequest(), &response);
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (served != nullptr) {
    served->clear();
    if (auth != nullptr) {
      for (const grpc::string_ref& pem :
           auth->FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME)) {
        served->assign(pem.data(), pem.size());
      }
    }
  }
  if (names != nullptr) {
    *names = auth != nullptr ? PeerCertificateNames(*auth) : std::vector<std::string>();
  }
  return status;
}

std::shared_ptr<grpc::Channel> ChannelTo(const NodeProcess& node,
                                         const ClientConnectionOptions& client) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = node.NewChannelWith(client);
  EXPECT_TRUE(channel.ok()) << channel.status();
  return channel.ok() ? *channel : nullptr;
}

// ---- the pure functions ---------------------------------------------------------------------

TEST(TlsFunctionsTest, LoopbackListenAddresses) {
  for (const char* address :
       {"127.0.0.1:7700", "127.1.2.3:0", "localhost:7700", "LOCALHOST:1", "[::1]:7700", "::1",
        "[::ffff:127.0.0.1]:7700", "127.0.0.1", "unix:/run/kvmesh.sock"}) {
    EXPECT_TRUE(IsLoopbackListenAddress(address)) << address;
  }
  for (const char* address :
       {"0.0.0.0:7700", ":7700", "[::]:7700", "10.0.0.1:7700", "128.0.0.1:7700",
        "127.example.com:7700", "localhost.evil:7700", "node-a:7700", "[::2]:1", "", "[::1"}) {
    EXPECT_FALSE(IsLoopbackListenAddress(address)) << address;
  }
}

TEST(TlsFunctionsTest, CertificateNamesHost) {
  const std::vector<std::string> dns = {"node-a", "*.kvmesh.default.svc"};
  const std::vector<std::string> ips = {"10.0.0.7"};
  EXPECT_TRUE(CertificateNamesHost(dns, ips, "node-a"));
  EXPECT_TRUE(CertificateNamesHost(dns, ips, "NODE-A"));
  EXPECT_TRUE(CertificateNamesHost(dns, ips, "10.0.0.7"));
  EXPECT_TRUE(CertificateNamesHost(dns, ips, "kvmesh-1.kvmesh.default.svc"));
  // A wildcard stands for exactly one label.
  EXPECT_FALSE(CertificateNamesHost(dns, ips, "kvmesh.default.svc"));
  EXPECT_FALSE(CertificateNamesHost(dns, ips, "a.b.kvmesh.default.svc"));
  EXPECT_FALSE(CertificateNamesHost(dns, ips, ".kvmesh.default.svc"));
  EXPECT_FALSE(CertificateNamesHost(dns, ips, "node-b"));
  EXPECT_FALSE(CertificateNamesHost(dns, ips, "10.0.0.8"));
  EXPECT_FALSE(CertificateNamesHost(dns, ips, ""));
  // Without subject alternative names nothing is named (the common name is not looked at).
  EXPECT_FALSE(CertificateNamesHost({}, {}, "node-b"));
  EXPECT_EQ(MemberUri("node-b"), "kvmesh://member/node-b");
}

// ---- start-up checks ------------------------------------------------------------------------

// Runs kvmesh-node with `flags` until it exits; expects exit 1 and `message` in its stderr.
void ExpectStartupFailure(const std::vector<std::string>& flags, const std::string& message) {
  std::vector<std::string> args = {"--listen=127.0.0.1:0", "--node-name=bad-flags"};
  args.insert(args.end(), flags.begin(), flags.end());
  absl::StatusOr<NodeRun> run = RunNodeToExit(args);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_TRUE(run->status.exited && run->status.code == 1)
      << run->status.ToString() << "; stderr:\n"
      << run->stderr_text;
  EXPECT_THAT(run->stderr_text, HasSubstr(message));
  EXPECT_EQ(run->stdout_text, "");  // it never listened
}

TEST(TlsStartupTest, FlagCombinations) {
  const CertFiles& a = pki->node_a;
  const std::string ca = pki->ca->cert_file();
  ExpectStartupFailure({"--tls-key=" + a.key, "--peer-ca=" + ca},
                       "--tls-key is set but --tls-cert is not: give both");
  ExpectStartupFailure({"--tls-cert=" + a.cert, "--peer-ca=" + ca},
                       "--tls-cert is set but --tls-key is not: give both");
  ExpectStartupFailure({"--tls-cert=" + a.cert, "--tls-key=" + a.key},
                       "--peer-ca is required when TLS is on (--tls-cert)");
  ExpectStartupFailure({"--tls-client-ca=" + ca}, "--tls-client-ca needs TLS on the client port");
  ExpectStartupFailure({"--peer-ca=" + ca}, "--peer-ca needs TLS");
  ExpectStartupFailure({"--testing-tls-reload-interval-s=0"},
                       "--testing_tls_reload_interval_s=0 must be at least 1");
}

TEST(TlsStartupTest, BadFilesAreNamedWithTheirFlag) {
  const CertFiles& a = pki->node_a;
  const std::string ca = pki->ca->cert_file();
  const std::string missing = pki->dir->File("missing.pem");
  ExpectStartupFailure({"--tls-cert=" + missing, "--tls-key=" + a.key, "--peer-ca=" + ca},
                       "--tls-cert: cannot read '" + missing + "': No such file or directory");
  ExpectStartupFailure({"--tls-cert=" + a.cert, "--tls-key=" + a.key, "--peer-ca=" + missing},
                       "--peer-ca: cannot read '" + missing + "'");
  ExpectStartupFailure({"--tls-cert=" + a.cert, "--tls-key=" + a.key, "--peer-ca=" + ca,
                        "--tls-client-ca=" + missing},
                       "--tls-client-ca: cannot read '" + missing + "'");
  // A key where the certificate belongs, and the other way round.
  ExpectStartupFailure({"--tls-cert=" + a.key, "--tls-key=" + a.key, "--peer-ca=" + ca},
                       "--tls-cert '" + a.key + "' holds no PEM certificate");
  ExpectStartupFailure({"--tls-cert=" + a.cert, "--tls-key=" + a.cert, "--peer-ca=" + ca},
                       "--tls-key '" + a.cert + "' holds no unencrypted PEM private key");
  // A PEM block that is not a certificate.
  const std::string garbage = pki->dir->File("garbage.pem");
  ASSERT_TRUE(ReplaceFile(garbage,
                          "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n"
                          "-----END CERTIFICATE-----\n")
                  .ok());
  ExpectStartupFailure({"--tls-cert=" + a.cert, "--tls-key=" + a.key, "--peer-ca=" + garbage},
                       "--peer-ca '" + garbage + "' holds a PEM certificate that does not parse");
  // Node b's key with node a's certificate.
  ExpectStartupFailure({"--tls-cert=" + a.cert, "--tls-key=" + pki->node_b.key, "--peer-ca=" + ca},
                       "--tls-key '" + pki->node_b.key +
                           "' is not the private key of the certificate in --tls-cert '" + a.cert +
                           "'");
  // A certificate the peer CA did not sign: other members would refuse it.
  ExpectStartupFailure({"--tls-cert=" + pki->foreign_client.cert,
                        "--tls-key=" + pki->foreign_client.key, "--peer-ca=" + ca},
                       "does not verify against --peer-ca '" + ca + "'");
}

TEST(TlsStartupTest, ExpiredOrServerOnlyCertificatesAreRefused) {
  ASSERT_OK_AND_ASSIGN(
      CertFiles expired,
      pki->ca->Issue("expired", {"node-a", {"DNS:node-a"}, "serverAuth,clientAuth", -1}));
  ExpectStartupFailure({"--tls-cert=" + expired.cert, "--tls-key=" + expired.key,
                        "--peer-ca=" + pki->ca->cert_file()},
                       "the certificate in --tls-cert '" + expired.cert + "' expired on ");
  // The peer plane presents the node's certificate as a client certificate too.
  ASSERT_OK_AND_ASSIGN(CertFiles server_only,
                       pki->ca->Issue("server-only", {"node-a", {"DNS:node-a"}, "serverAuth"}));
  ExpectStartupFailure({"--tls-cert=" + server_only.cert, "--tls-key=" + server_only.key,
                        "--peer-ca=" + pki->ca->cert_file()},
                       "as a TLS client certificate: unsuitable certificate purpose");
}

// ---- the client port ------------------------------------------------------------------------

TEST(TlsClientPortTest, TlsWithTheCaWorksPlaintextAndWrongCaFail) {
  NodeProcess::Options options;
  options.node_name = "node-a";
  options.extra_args = TlsFlags(pki->node_a);
  options.client = TrustingCa();
  std::unique_ptr<NodeProcess> node = StartNode(options);
  ASSERT_NE(node, nullptr);
  EXPECT_THAT(node->ReadStderr(), ::testing::Not(HasSubstr("PLAINTEXT")));

  // The node's own channel (Options::client) and a cache service call over it.
  auto stub = node->NewStub();
  ASSERT_TRUE(CreateCache(*stub, SpecProto("tls-cache", 2, 16, 8, {AttentionGroupProto({})})).ok());
  std::string served;
  std::vector<std::string> names;
  grpc::Status status = ListOver(node->channel(), &served, &names);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ASSERT_OK_AND_ASSIGN(std::string node_a_pem, ReadTextFile(pki->node_a.cert));
  EXPECT_EQ(served, node_a_pem);
  // The client's view of the server: its DNS and IP names (never the CN).
  EXPECT_THAT(names, ElementsAre("node-a", "127.0.0.1"));

  // Plaintext against a TLS port: the handshake never completes.
  status = ListOver(ChannelTo(*node, ClientConnectionOptions()));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  // A CA that did not sign the node's certificate.
  status = ListOver(ChannelTo(*node, TrustingCa(pki->other_ca->cert_file())));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  // A server name override that the certificate does not name.
  ClientConnectionOptions override_name = TrustingCa();
  override_name.tls.server_name = "node-b";
  status = ListOver(ChannelTo(*node, override_name));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  // A node whose certificate names it but not 127.0.0.1: only with the override. (Host names
  // such as "localhost" would need a DNS resolution, whose c-ares leaks under ASan.)
  ASSERT_OK_AND_ASSIGN(CertFiles name_only,
                       pki->ca->Issue("name-only", {"node-c", {"DNS:node-c"}}));
  NodeProcess::Options by_name_options;
  by_name_options.node_name = "node-c";
  by_name_options.extra_args = TlsFlags(name_only);
  by_name_options.client = TrustingCa();
  std::unique_ptr<NodeProcess> by_name = StartNode(by_name_options);
  ASSERT_NE(by_name, nullptr);
  status = ListOver(by_name->channel());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  override_name.tls.server_name = "node-c";
  status = ListOver(ChannelTo(*by_name, override_name));
  EXPECT_TRUE(status.ok()) << StatusText(status);
  by_name->ReleaseChannel();
  EXPECT_TRUE(by_name->Stop().clean());

  // Without --tls-client-ca no client certificate is asked for, and one offered is ignored.
  status = ListOver(ChannelTo(*node, WithClientCert(pki->client)));
  EXPECT_TRUE(status.ok()) << StatusText(status);

  node->ReleaseChannel();
  stub.reset();
  EXPECT_TRUE(node->Stop().clean());
}

TEST(TlsClientPortTest, ClientCaRequiresAClientCertificateItSigned) {
  NodeProcess::Options options;
  options.node_name = "node-a";
  options.extra_args = TlsFlags(pki->node_a);
  options.extra_args.push_back("--tls-client-ca=" + pki->ca->cert_file());
  options.client = WithClientCert(pki->client);
  std::unique_ptr<NodeProcess> node = StartNode(options);
  ASSERT_NE(node, nullptr);

  grpc::Status status = ListOver(node->channel());
  EXPECT_TRUE(status.ok()) << StatusText(status);
  // No client certificate.
  status = ListOver(ChannelTo(*node, TrustingCa()));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  // A client certificate from another CA (naming a member, which does not help).
  status = ListOver(ChannelTo(*node, WithClientCert(pki->foreign_client)));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  // Health is behind the same port and needs the same certificate.
  int serving = 0;
  EXPECT_EQ(HealthCheck(ChannelTo(*node, TrustingCa()), "", &serving).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(HealthCheck(node->channel(), "", &serving).ok());
  EXPECT_EQ(serving, 1);
  node->ReleaseChannel();
  EXPECT_TRUE(node->Stop().clean());
}

// ---- kvmeshctl and tokens -------------------------------------------------------------------

std::string Sha256Hex(const std::string& data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EXPECT_EQ(EVP_Digest(data.data(), data.size(), digest, &size, EVP_sha256(), nullptr), 1);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), size));
}

CommandResult Kvmeshctl(const std::vector<std::string>& args,
                        const std::vector<std::string>& env = {"KVMESH_TOKEN"}) {
  std::vector<std::string> argv = {KVMESH_CTL_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<CommandResult> run = RunProcess(argv, env);
  EXPECT_TRUE(run.ok()) << run.status();
  return run.ok() ? *run : CommandResult();
}

TEST(TlsKvmeshctlTest, TlsClientCertificateAndBearerToken) {
  // Random enough for a test; the node stores only its hash.
  const std::string token = "3b1f6a0c9e8d7f2a41c5b6e0d9a8f7e6c5b4a3928170f6e5d4c3b2a1f0e9d8c7";
  const std::string token_file = pki->dir->File("tokens.txt");
  ASSERT_TRUE(
      ReplaceFile(token_file, absl::StrCat("token sha256:", Sha256Hex(token), " ops admin\n"))
          .ok());
  const std::string client_token = pki->dir->File("ctl-token");
  ASSERT_TRUE(ReplaceFile(client_token, token + "\n").ok());

  NodeProcess::Options options;
  options.node_name = "node-a";
  options.extra_args = TlsFlags(pki->node_a);
  options.extra_args.push_back("--tls-client-ca=" + pki->ca->cert_file());
  options.extra_args.push_back("--token-file=" + token_file);
  options.client = WithClientCert(pki->client);
  options.client.token = token;
  std::unique_ptr<NodeProcess> node = StartNode(options);
  ASSERT_NE(node, nullptr);

  // Every call of the test's stub carries the token: create, then list.
  auto stub = node->NewStub();
  grpc::Status status =
      CreateCache(*stub, SpecProto("ctl-cache", 2, 16, 8, {AttentionGroupProto({})}));
  ASSERT_TRUE(status.ok()) << StatusText(status);
  // The same TLS without the token.
  ClientConnectionOptions no_token = WithClientCert(pki->client);
  status = ListOver(ChannelTo(*node, no_token));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << StatusText(status);

  const std::vector<std::string> tls = {
      "--addr=" + node->address(), "--tls-ca=" + pki->ca->cert_file(),
      "--tls-cert=" + pki->client.cert, "--tls-key=" + pki->client.key, "--timeout=10s"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = tls;
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  CommandResult run = Kvmeshctl(with({"--token-file=" + client_token, "list"}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("ctl-cache"));
  // The token from the environment.
  run = Kvmeshctl(with({"list"}), {"KVMESH_TOKEN=" + token});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("ctl-cache"));
  // Health needs no token.
  run = Kvmeshctl(with({"health"}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("SERVING"));
  // No token; a wrong one.
  run = Kvmeshctl(with({"list"}));
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("error: UNAUTHENTICATED"));
  run = Kvmeshctl(with({"list"}), {"KVMESH_TOKEN=not-the-token"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("error: UNAUTHENTICATED"));
  // No client certificate: the handshake fails before any token is looked at.
  run = Kvmeshctl({"--addr=" + node->address(), "--tls-ca=" + pki->ca->cert_file(),
                   "--token-file=" + client_token, "--timeout=10s", "list"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("error: UNAVAILABLE"));
  // Plaintext.
  run = Kvmeshctl(
      {"--addr=" + node->address(), "--token-file=" + client_token, "--timeout=10s", "list"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("error: UNAVAILABLE"));
  // A bad TLS flag is named before anything is sent.
  run = Kvmeshctl({"--addr=" + node->address(), "--tls-ca=" + pki->client.key, "list"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr("error: INVALID_ARGUMENT: --tls-ca '" + pki->client.key +
                                    "' holds no PEM certificate"));

  stub.reset();
  node->ReleaseChannel();
  EXPECT_TRUE(node->Stop().clean());
}

TEST(TlsKvmeshctlTest, TokenOverLoopbackPlaintext) {
  // Call credentials are sent over plaintext too (a loopback development node with tokens).
  const std::string token = "0f9e8d7c6b5a49382716f5e4d3c2b1a00f9e8d7c6b5a49382716f5e4d3c2b1a0";
  const std::string token_file = pki->dir->File("tokens-plain.txt");
  ASSERT_TRUE(
      ReplaceFile(token_file, absl::StrCat("token sha256:", Sha256Hex(token), " team-a tenant\n"))
          .ok());
  NodeProcess::Options options;
  options.node_name = "plain";
  options.extra_args = {"--token-file=" + token_file};
  options.client.token = token;
  std::unique_ptr<NodeProcess> node = StartNode(options);
  ASSERT_NE(node, nullptr);
  grpc::Status status = ListOver(node->channel());
  EXPECT_TRUE(status.ok()) << StatusText(status);
  status = ListOver(ChannelTo(*node, ClientConnectionOptions()));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << StatusText(status);
  node->ReleaseChannel();
  EXPECT_TRUE(node->Stop().clean());
}

// ---- rotation -------------------------------------------------------------------------------

TEST(TlsRotationTest, ANewCertificateIsServedWithoutARestart) {
  ASSERT_OK_AND_ASSIGN(CertFiles live,
                       pki->ca->Issue("rotating", {"node-a", {"DNS:node-a", "IP:127.0.0.1"}}));
  ASSERT_OK_AND_ASSIGN(std::string first, ReadTextFile(live.cert));
  NodeProcess::Options options;
  options.node_name = "node-a";
  options.extra_args = TlsFlags(live);
  options.extra_args.push_back("--testing-tls-reload-interval-s=1");
  options.client = TrustingCa();
  std::unique_ptr<NodeProcess> node = StartNode(options);
  ASSERT_NE(node, nullptr);
  std::string served;
  ASSERT_TRUE(ListOver(node->channel(), &served).ok());
  EXPECT_EQ(served, first);

  // cert-manager's rotation: a new key and certificate (a new serial), renamed over the old.
  ASSERT_OK_AND_ASSIGN(CertFiles next, pki->ca->Issue("rotated", {"node-a-rotated",
                                                                  {"DNS:node-a", "IP:127.0.0.1"}}));
  ASSERT_OK_AND_ASSIGN(std::string second, ReadTextFile(next.cert));
  ASSERT_OK_AND_ASSIGN(std::string second_key, ReadTextFile(next.key));
  ASSERT_NE(first, second);
  ASSERT_TRUE(ReplaceFile(live.key, second_key).ok());
  ASSERT_TRUE(ReplaceFile(live.cert, second).ok());

  // New connections see the new certificate within a few reload intervals.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::vector<std::string> names;
  grpc::Status status;
  do {
    absl::SleepFor(absl::Milliseconds(200));
    status = ListOver(ChannelTo(*node, TrustingCa()), &served, &names);
  } while ((!status.ok() || served != second) && absl::Now() < deadline);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_EQ(served, second);
  EXPECT_THAT(names, ElementsAre("node-a", "127.0.0.1"));
  // The same process all along.
  EXPECT_TRUE(node->Running());
  node->ReleaseChannel();
  EXPECT_TRUE(node->Stop().clean());
}

// ---- the peer plane -------------------------------------------------------------------------

// Two TLS nodes that know each other by their --peer-listen addresses on 127.0.0.1.
class TlsClusterTest : public ::testing::Test {
 protected:
  // `b_leaf`: node-b's certificate (node-a always has pki->node_a).
  void StartCluster(const CertFiles& b_leaf) {
    const int peer_a = ReservePort();
    const int peer_b = ReservePort();
    ASSERT_NE(peer_a, 0);
    ASSERT_NE(peer_b, 0);
    for (int i = 0; i < 2; ++i) {
      NodeProcess::Options options;
      options.node_name = i == 0 ? "node-a" : "node-b";
      options.extra_args = TlsFlags(i == 0 ? pki->node_a : b_leaf);
      options.extra_args.push_back(
          absl::StrCat("--peer-listen=127.0.0.1:", i == 0 ? peer_a : peer_b));
      options.extra_args.push_back(absl::StrCat("--peers=", i == 0 ? "node-b" : "node-a",
                                                "=127.0.0.1:", i == 0 ? peer_b : peer_a));
      options.client = TrustingCa();
      // node-b's certificate may not name 127.0.0.1: clients ask for the name it has.
      options.client.tls.server_name = options.node_name;
      nodes_[i] = StartNode(options);
      ASSERT_NE(nodes_[i], nullptr);
      EXPECT_THAT(nodes_[i]->listening_line(),
                  HasSubstr(absl::StrCat(" peer-plane=127.0.0.1:", i == 0 ? peer_a : peer_b)));
      stubs_[i] = nodes_[i]->NewStub();
    }
  }
  void TearDown() override {
    for (int i = 0; i < 2; ++i) {
      stubs_[i].reset();
      if (nodes_[i] != nullptr) nodes_[i]->ReleaseChannel();
    }
    for (int i = 0; i < 2; ++i) {
      if (nodes_[i] != nullptr) {
        EXPECT_TRUE(nodes_[i]->Stop().clean());
      }
    }
  }

  // node-b copies seq 1 of `cache` from node-a.
  grpc::Status CopyFromA(const std::string& cache, int32_t length) {
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(30));
    v1::CopyPrefixRequest request;
    request.set_cache(cache);
    request.set_src_seq(1);
    request.set_dst_seq(1);
    request.set_length(length);
    request.set_source_node("node-a");
    v1::CopyPrefixResponse response;
    return stubs_[1]->CopyPrefix(&context, request, &response);
  }

  // A cache on both nodes, with 6 tokens of seq 1 on node-a.
  void CreateCaches(const v1::CacheSpec& spec) {
    for (int i = 0; i < 2; ++i) {
      const grpc::Status status = CreateCache(*stubs_[i], spec);
      ASSERT_TRUE(status.ok()) << StatusText(status);
    }
    const grpc::Status status = Append(*stubs_[0], MakeAppend(spec, 1, {0, 1, 2, 3, 4, 5}, 3));
    ASSERT_TRUE(status.ok()) << StatusText(status);
  }

  std::unique_ptr<NodeProcess> nodes_[2];
  std::unique_ptr<Stub> stubs_[2];
};

TEST_F(TlsClusterTest, CrossNodeCopyOverMtls) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(pki->node_b));
  const v1::CacheSpec spec = SpecProto("shared", 2, 16, 8, {AttentionGroupProto({})});
  ASSERT_NO_FATAL_FAILURE(CreateCaches(spec));
  grpc::Status status = CopyFromA("shared", 6);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ReadOutput a, b;
  ASSERT_TRUE(Read(*stubs_[0], ReadRequest("shared", 1), &a).ok());
  ASSERT_TRUE(Read(*stubs_[1], ReadRequest("shared", 1), &b).ok());
  EXPECT_EQ(a.header.SerializeAsString(), b.header.SerializeAsString());
  EXPECT_EQ(a.payload.size(), b.payload.size());
  EXPECT_TRUE(a.payload == b.payload);

  // ListMembers sees the other member serving through the mTLS peer plane.
  grpc::ClientContext context;
  SetDeadline(&context);
  v1::ListMembersResponse members;
  status = stubs_[1]->ListMembers(&context, v1::ListMembersRequest(), &members);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  ASSERT_EQ(members.members_size(), 2);
  EXPECT_EQ(members.members(1).name(), "node-a");
  EXPECT_EQ(members.members(1).health(), v1::MEMBER_HEALTH_SERVING) << members.DebugString();
}

// The peer port as an outsider sees it: plaintext, a foreign CA's certificate, no certificate,
// and a certificate of the cluster CA that names no member.
TEST_F(TlsClusterTest, PeerPortRefusesNonMembers) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(pki->node_b));
  const v1::CacheSpec spec = SpecProto("secret", 2, 16, 8, {AttentionGroupProto({})});
  ASSERT_NO_FATAL_FAILURE(CreateCaches(spec));
  const NodeProcess& a = *nodes_[0];

  auto export_from_a = [&](const ClientConnectionOptions& client) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = a.NewPeerChannelWith(client);
    EXPECT_TRUE(channel.ok()) << channel.status();
    if (!channel.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, "no channel");
    auto peer = v1::PeerService::NewStub(*channel);
    grpc::ClientContext context;
    SetDeadline(&context, kFailFast);
    v1::ExportRequest request;
    request.set_cache("secret");
    *request.mutable_spec() = spec;
    request.set_receiver("mallory");
    request.mutable_sequence()->set_seq(1);
    request.set_transport("grpc-stream");
    v1::ExportResponse response;
    return peer->Export(&context, request, &response);
  };

  ClientConnectionOptions plaintext;
  grpc::Status status = export_from_a(plaintext);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  ClientConnectionOptions no_cert = TrustingCa();
  status = export_from_a(no_cert);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  status = export_from_a(WithClientCert(pki->foreign_client));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  // Through the handshake (the cluster CA signed it), refused by PeerService: not a member.
  status = export_from_a(WithClientCert(pki->mallory));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("'mallory'"));
  // So are the index's calls: every tenant's events, and another tenant's lookups.
  {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        a.NewPeerChannelWith(WithClientCert(pki->mallory));
    ASSERT_TRUE(channel.ok()) << channel.status();
    auto peer = v1::PeerService::NewStub(*channel);
    grpc::ClientContext watch_context;
    SetDeadline(&watch_context, kFailFast);
    std::unique_ptr<grpc::ClientReader<v1::WatchEventsResponse>> reader =
        peer->WatchEvents(&watch_context, v1::PeerWatchEventsRequest());
    v1::WatchEventsResponse message;
    EXPECT_FALSE(reader->Read(&message)) << message.DebugString();
    status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << StatusText(status);
    grpc::ClientContext lookup_context;
    SetDeadline(&lookup_context, kFailFast);
    v1::PeerLookupPrefixRequest lookup;
    lookup.set_tenant("default");
    lookup.mutable_lookup()->set_cache("secret");
    lookup.mutable_lookup()->add_tokens(1);
    v1::LookupPrefixResponse found;
    status = peer->LookupPrefix(&lookup_context, lookup, &found);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << StatusText(status);
  }

  // The client port does not serve PeerService at all outside development mode.
  auto on_client_port = v1::PeerService::NewStub(nodes_[0]->channel());
  grpc::ClientContext context;
  SetDeadline(&context, kFailFast);
  v1::ExportResponse response;
  status = on_client_port->Export(&context, v1::ExportRequest(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << StatusText(status);
}

// The peer port reads nothing of a request before it knows the caller is a member, and holds a
// member's request to its method's limit before parsing it: 10 MiB to every PeerService method
// from a certificate of the cluster CA that names no member is refused PERMISSION_DENIED with
// node-a's RSS about where it was (gRPC read each request whole before, up to the 128 MiB
// message limit, and parsed it); the same 10 MiB from member node-b is RESOURCE_EXHAUSTED
// naming the method's limit.
TEST_F(TlsClusterTest, PeerPortReadsNoRequestOfANonMemberAndLimitsEachMethod) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(pki->node_b));
  const NodeProcess& a = *nodes_[0];
  const std::vector<std::string> methods = {"NodeInfo", "Export",      "Fetch",       "Release",
                                            "Pull",     "NcclConnect", "NcclSend",    "Remove",
                                            "Place",    "WatchEvents", "LookupPrefix"};
  // Unknown field 15 of 10 MiB: every request type skips it when parsing.
  std::string body = "\x7a";
  for (uint32_t n = 10 << 20;; n >>= 7) {
    if (n < 0x80) {
      body.push_back(static_cast<char>(n));
      break;
    }
    body.push_back(static_cast<char>((n & 0x7f) | 0x80));
  }
  body.append(10 << 20, 'x');
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<grpc::Channel> stranger,
                       a.NewPeerChannelWith(WithClientCert(pki->mallory)));
  const uint64_t rss_before = ProcessStatusBytes(a.pid(), "VmRSS");
  for (const std::string& method : methods) {
    std::vector<std::string> responses;
    const grpc::Status status =
        CallRaw(stranger, absl::StrCat("/kvmesh.v1.PeerService/", method), body, &responses);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << method << ": " << StatusText(status);
    EXPECT_THAT(status.error_message(), HasSubstr("'mallory'")) << method;
  }
  const uint64_t rss_after = ProcessStatusBytes(a.pid(), "VmRSS");
  // gRPC's stream window (a few MiB) at most, never one 10 MiB body, let alone eleven.
  EXPECT_LT(rss_after, rss_before + (uint64_t{8} << 20))
      << "RSS " << rss_before << " -> " << rss_after;

  ASSERT_OK_AND_ASSIGN(std::shared_ptr<grpc::Channel> member,
                       a.NewPeerChannelWith(WithClientCert(pki->node_b)));
  for (const std::string& method : methods) {
    const bool tokens = method == "Export" || method == "Pull" || method == "LookupPrefix";
    std::vector<std::string> responses;
    const grpc::Status status =
        CallRaw(member, absl::StrCat("/kvmesh.v1.PeerService/", method), body, &responses);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << method << ": " << StatusText(status);
    EXPECT_THAT(
        status.error_message(),
        HasSubstr(absl::StrCat(
            "limit of ", tokens ? kMaxPeerTokensRequestBytes : kMaxPeerRequestBytes, " bytes")))
        << method;
  }
  // Within the limits the methods serve the member as before.
  grpc::ClientContext context;
  SetDeadline(&context, kFailFast);
  v1::NodeInfoResponse info;
  const grpc::Status status =
      v1::PeerService::NewStub(member)->NodeInfo(&context, v1::NodeInfoRequest(), &info);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  EXPECT_EQ(info.name(), "node-a");
}

// Calls on node-a's peer port with `leaf` as the client certificate: Export of seq 1 of `spec`'s
// cache for receiver node-b (released at once when granted), and a PeerService.LookupPrefix in
// tenant "default" (what the cluster index asks its peers).
struct PeerCalls {
  grpc::Status exported;
  grpc::Status released;
  grpc::Status looked_up;
};
PeerCalls CallPeerPortOfA(const NodeProcess& a, const CertFiles& leaf, const v1::CacheSpec& spec) {
  PeerCalls calls;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      a.NewPeerChannelWith(WithClientCert(leaf));
  EXPECT_TRUE(channel.ok()) << channel.status();
  if (!channel.ok()) return calls;
  auto peer = v1::PeerService::NewStub(*channel);
  {
    grpc::ClientContext context;
    SetDeadline(&context, kFailFast);
    v1::ExportRequest request;
    request.set_cache(spec.name());
    request.set_tenant("default");
    *request.mutable_spec() = spec;
    request.set_receiver("node-b");
    request.mutable_sequence()->set_seq(1);
    request.set_transport("grpc-stream");
    v1::ExportResponse response;
    calls.exported = peer->Export(&context, request, &response);
    if (calls.exported.ok()) {
      grpc::ClientContext release_context;
      SetDeadline(&release_context, kFailFast);
      v1::ReleaseRequest release;
      release.set_lease_id(response.lease_id());
      v1::ReleaseResponse released;
      calls.released = peer->Release(&release_context, release, &released);
    }
  }
  grpc::ClientContext context;
  SetDeadline(&context, kFailFast);
  v1::PeerLookupPrefixRequest lookup;
  lookup.set_tenant("default");
  lookup.mutable_lookup()->set_cache(spec.name());
  lookup.mutable_lookup()->add_tokens(1);
  v1::LookupPrefixResponse found;
  calls.looked_up = peer->LookupPrefix(&context, lookup, &found);
  return calls;
}

// Who a certificate says it is comes from its subject alternative names only. A certificate of
// the cluster CA with CN=node-b and DNS:mallory2 as its only subject alternative name is not
// node-b (it was accepted as node-b, by its common name, and fetched tenant data); nor is one
// with CN=node-b and no subject alternative name at all. DNS:node-b or URI:kvmesh://member/node-b
// is node-b, whatever the common name.
TEST_F(TlsClusterTest, PeerPortTakesTheMemberFromSubjectAlternativeNamesOnly) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(pki->node_b));
  const v1::CacheSpec spec = SpecProto("tenant-data", 2, 16, 8, {AttentionGroupProto({})});
  ASSERT_NO_FATAL_FAILURE(CreateCaches(spec));
  const NodeProcess& a = *nodes_[0];

  ASSERT_OK_AND_ASSIGN(CertFiles cn_only_member,
                       pki->ca->Issue("cn-node-b-dns-mallory2", {"node-b", {"DNS:mallory2"}}));
  PeerCalls calls = CallPeerPortOfA(a, cn_only_member, spec);
  EXPECT_EQ(calls.exported.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << StatusText(calls.exported);
  EXPECT_THAT(calls.exported.error_message(), HasSubstr("'mallory2'"));
  EXPECT_THAT(calls.exported.error_message(), HasSubstr("common name 'node-b' is not an identity"));
  EXPECT_EQ(calls.looked_up.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << StatusText(calls.looked_up);

  ASSERT_OK_AND_ASSIGN(CertFiles no_sans, pki->ca->Issue("cn-node-b-no-san", {"node-b", {}}));
  calls = CallPeerPortOfA(a, no_sans, spec);
  EXPECT_EQ(calls.exported.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << StatusText(calls.exported);
  EXPECT_THAT(calls.exported.error_message(), HasSubstr("has no subject alternative name"));
  EXPECT_THAT(calls.exported.error_message(), HasSubstr("'node-b'"));
  EXPECT_EQ(calls.looked_up.error_code(), grpc::StatusCode::PERMISSION_DENIED)
      << StatusText(calls.looked_up);

  ASSERT_OK_AND_ASSIGN(CertFiles by_dns,
                       pki->ca->Issue("cn-other-dns-node-b", {"someone-else", {"DNS:node-b"}}));
  calls = CallPeerPortOfA(a, by_dns, spec);
  EXPECT_TRUE(calls.exported.ok()) << StatusText(calls.exported);
  EXPECT_TRUE(calls.released.ok()) << StatusText(calls.released);
  EXPECT_TRUE(calls.looked_up.ok()) << StatusText(calls.looked_up);

  ASSERT_OK_AND_ASSIGN(
      CertFiles by_uri,
      pki->ca->Issue("cn-other-uri-node-b", {"someone-else", {"URI:kvmesh://member/node-b"}}));
  calls = CallPeerPortOfA(a, by_uri, spec);
  EXPECT_TRUE(calls.exported.ok()) << StatusText(calls.exported);
  EXPECT_TRUE(calls.released.ok()) << StatusText(calls.released);
  EXPECT_TRUE(calls.looked_up.ok()) << StatusText(calls.looked_up);
}

// The channels to members do not take a common name either: node-b with a certificate of the
// cluster CA that says node-b only in its common name is refused both ways, by node-a's channel
// when node-a pulls from it (UNAVAILABLE, the handshake fails) and by node-a's peer port when
// node-b pulls from node-a (PERMISSION_DENIED).
TEST_F(TlsClusterTest, MemberCertificateWithOnlyACommonNameIsRefused) {
  ASSERT_OK_AND_ASSIGN(CertFiles cn_only, pki->ca->Issue("node-b-cn-only", {"node-b", {}}));
  ASSERT_NO_FATAL_FAILURE(StartCluster(cn_only));
  const v1::CacheSpec spec = SpecProto("cn-only", 2, 16, 8, {AttentionGroupProto({})});
  ASSERT_NO_FATAL_FAILURE(CreateCaches(spec));
  ASSERT_TRUE(Append(*stubs_[1], MakeAppend(spec, 1, {0, 1, 2}, 5)).ok());

  grpc::Status status = CopyFromA("cn-only", 6);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << StatusText(status);
  EXPECT_THAT(status.error_message(), HasSubstr("no subject alternative name"));

  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(30));
  v1::CopyPrefixRequest request;
  request.set_cache("cn-only");
  request.set_src_seq(1);
  request.set_dst_seq(2);
  request.set_length(3);
  request.set_source_node("node-b");
  v1::CopyPrefixResponse response;
  status = stubs_[0]->CopyPrefix(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  v1::ListSequencesResponse list;
  ASSERT_TRUE(ListSequences(*stubs_[0], "cn-only", &list).ok());
  ASSERT_EQ(list.sequences_size(), 1);  // seq 1 only: seq 2 was never written
}

// A member whose certificate names it but not the host of its address (node-b: DNS:node-b
// only): node-a's peer channel accepts it by the member's name.
TEST_F(TlsClusterTest, MemberCertificateMayNameTheMemberInsteadOfItsHost) {
  ASSERT_OK_AND_ASSIGN(CertFiles b_by_name,
                       pki->ca->Issue("node-b-name-only", {"node-b", {"DNS:node-b"}}));
  ASSERT_NO_FATAL_FAILURE(StartCluster(b_by_name));
  const v1::CacheSpec spec = SpecProto("by-name", 2, 16, 8, {AttentionGroupProto({})});
  ASSERT_NO_FATAL_FAILURE(CreateCaches(spec));
  // node-b pulls from node-a (a's certificate names 127.0.0.1), then node-a from node-b.
  grpc::Status status = CopyFromA("by-name", 6);
  ASSERT_TRUE(status.ok()) << StatusText(status);
  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(30));
  v1::CopyPrefixRequest request;
  request.set_cache("by-name");
  request.set_src_seq(1);
  request.set_dst_seq(2);
  request.set_length(6);
  request.set_source_node("node-b");
  v1::CopyPrefixResponse response;
  status = stubs_[0]->CopyPrefix(&context, request, &response);
  EXPECT_TRUE(status.ok()) << StatusText(status);
}

// A member whose certificate (signed by the cluster CA) names neither its host nor its member
// name: the other member's peer channel refuses it, so nothing is copied from it.
TEST_F(TlsClusterTest, MemberCertificateNamingSomeoneElseIsRefused) {
  ASSERT_OK_AND_ASSIGN(CertFiles impostor,
                       pki->ca->Issue("node-b-impostor", {"node-x", {"DNS:node-x"}}));
  ASSERT_NO_FATAL_FAILURE(StartCluster(impostor));
  // node-b's client port certificate names node-x, so the test's client asks for that name.
  ClientConnectionOptions to_b = TrustingCa();
  to_b.tls.server_name = "node-x";
  absl::StatusOr<std::shared_ptr<grpc::Channel>> b_channel = nodes_[1]->NewChannelWith(to_b);
  ASSERT_TRUE(b_channel.ok());
  stubs_[1] = v1::CacheService::NewStub(*b_channel);
  const v1::CacheSpec spec = SpecProto("impostor", 2, 16, 8, {AttentionGroupProto({})});
  ASSERT_NO_FATAL_FAILURE(CreateCaches(spec));
  ASSERT_TRUE(Append(*stubs_[1], MakeAppend(spec, 1, {0, 1, 2}, 5)).ok());

  grpc::ClientContext context;
  SetDeadline(&context, absl::Seconds(30));
  v1::CopyPrefixRequest request;
  request.set_cache("impostor");
  request.set_src_seq(1);
  request.set_dst_seq(2);
  request.set_length(3);
  request.set_source_node("node-b");
  v1::CopyPrefixResponse response;
  const grpc::Status status = stubs_[0]->CopyPrefix(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << StatusText(status);
  v1::ListSequencesResponse list;
  ASSERT_TRUE(ListSequences(*stubs_[0], "impostor", &list).ok());
  ASSERT_EQ(list.sequences_size(), 1);  // seq 1 only: seq 2 was never written
  EXPECT_EQ(list.sequences(0).seq(), 1);
}

}  // namespace
}  // namespace testutil
}  // namespace kvmesh
